"""rlcode.envs.tools: every tool on good and bad input, confinement to the working copy (../,
absolute paths, planted symlinks and hard links, a symlink swapped into a resolved path), schema
validation of calls, and error observations instead of exceptions.

Commands go through `LocalExecutor`, a test double that runs them with `subprocess.run` in the
working copy; it isolates nothing (the sandbox's isolation is tested with the sandbox)."""

import dataclasses
import difflib
import inspect
import json
import os
import sys
import threading
import time

import pytest

from rlcode.envs import tools
from support.local_executor import LocalExecutor, Result  # this test directory is on sys.path


MODULE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TEST = "from pkg.mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "tests" / "test_mod.py").write_text(TEST)
    (root / "notes.txt").write_text("".join(f"line {i}\n" for i in range(1, 21)))
    outside = tmp_path / "outside.txt"
    outside.write_text("secret outside the copy\n")
    return root


@pytest.fixture
def ws(repo):
    return tools.Workspace(repo, LocalExecutor(), test_paths=["tests/test_mod.py"])


def call(ws, name, **arguments):
    return tools.call_tool(ws, name, arguments)


# ---------------------------------------------------------------------------------------------
# read_file

def test_read_file_numbers_lines_and_ranges(ws):
    out = call(ws, "read_file", path="pkg/mod.py")
    assert out.status == "ok"
    lines = out.observation.splitlines()
    assert lines[0] == "pkg/mod.py (lines 1-6 of 6)"
    assert lines[1:] == [f"{i:6d}\t{text}" for i, text in enumerate(MODULE.splitlines(), 1)]
    part = call(ws, "read_file", path="notes.txt", start_line=3, end_line=5).observation.splitlines()
    assert part == ["notes.txt (lines 3-5 of 20)", "     3\tline 3", "     4\tline 4", "     5\tline 5"]
    tail = call(ws, "read_file", path="notes.txt", start_line=19, end_line=99).observation.splitlines()
    assert tail[0] == "notes.txt (lines 19-20 of 20)" and len(tail) == 3


@pytest.mark.parametrize("arguments, message", [
    ({"path": "nope.py"}, "does not exist"),
    ({"path": "pkg"}, "is a directory"),
    ({"path": "notes.txt", "start_line": 0}, "start_line must be >= 1"),
    ({"path": "notes.txt", "start_line": 5, "end_line": 4}, "before start_line"),
    ({"path": "notes.txt", "start_line": 21}, "past the end"),
])
def test_read_file_errors(ws, arguments, message):
    out = tools.call_tool(ws, "read_file", arguments)
    assert out.status == "error"
    assert out.observation.startswith("Error: ") and message in out.observation


def test_read_file_caps_size_and_output(repo):
    limits = tools.ToolLimits(max_file_bytes=10_000, max_observation_chars=300)
    ws = tools.Workspace(repo, LocalExecutor(), limits=limits)
    (repo / "big.txt").write_text("x" * 10_001)
    out = call(ws, "read_file", path="big.txt")
    assert out.status == "error" and "limit of 10000" in out.observation
    (repo / "long.txt").write_text("".join(f"row {i:04d} " + "y" * 40 + "\n" for i in range(1, 101)))
    out = call(ws, "read_file", path="long.txt")
    assert out.status == "ok"
    assert len(out.observation) < 400
    header = out.observation.splitlines()[0]
    shown = int(header.split("lines 1-")[1].split(" ")[0])
    assert 1 <= shown < 100 and f"continue with start_line={shown + 1}" in header
    assert out.observation.splitlines()[-1].startswith(f"{shown:6d}\trow {shown:04d}")


def test_read_file_refuses_fifo_without_blocking(ws, repo):
    os.mkfifo(repo / "pipe")
    start = time.monotonic()
    out = call(ws, "read_file", path="pipe")
    assert out.status == "error" and "not a regular file" in out.observation
    assert time.monotonic() - start < 10  # a blocking open would never return


# ---------------------------------------------------------------------------------------------
# confinement

ESCAPES = ["../outside.txt", "pkg/../../outside.txt", "/etc/passwd", "/tmp", "tests/../../repo/../outside.txt"]


@pytest.mark.parametrize("path", ESCAPES)
def test_paths_outside_the_copy_are_refused(ws, tmp_path, path):
    for name, arguments in [("read_file", {"path": path}), ("list_dir", {"path": path}),
                            ("write_file", {"path": path, "content": "x"}),
                            ("edit_file", {"path": path, "old": "secret", "new": "x"}),
                            ("grep", {"pattern": "secret", "path": path}),
                            ("run_tests", {"paths": [path]}), ("lint", {"paths": [path]})]:
        out = tools.call_tool(ws, name, arguments)
        assert out.status == "error", (name, out)
        assert "outside the repository" in out.observation or "absolute" in out.observation, (name, out)
    assert (tmp_path / "outside.txt").read_text() == "secret outside the copy\n"


def test_symlinks_planted_by_run_are_not_followed_out(ws, repo, tmp_path):
    out = call(ws, "run", command="ln -s /etc etc_link && ln -s ../outside.txt leak.txt && ln -s / rootfs")
    assert out.status == "ok" and "exit code: 0" in out.observation
    for name, arguments in [("read_file", {"path": "etc_link/passwd"}), ("read_file", {"path": "leak.txt"}),
                            ("list_dir", {"path": "etc_link"}), ("list_dir", {"path": "rootfs"}),
                            ("write_file", {"path": "etc_link/rlcode_test", "content": "x"}),
                            ("write_file", {"path": "leak.txt", "content": "overwritten"}),
                            ("edit_file", {"path": "leak.txt", "old": "secret", "new": "public"}),
                            ("grep", {"pattern": "root", "path": "etc_link"}),
                            ("run_tests", {"paths": ["etc_link"]})]:
        result = tools.call_tool(ws, name, arguments)
        assert result.status == "error" and "outside the repository" in result.observation, (name, result)
    assert (tmp_path / "outside.txt").read_text() == "secret outside the copy\n"
    assert not os.path.exists("/etc/rlcode_test")
    # grep over the whole copy does not walk through the planted links either.
    out = call(ws, "grep", pattern="root:")
    assert out.status == "ok" and out.observation == "no matches"
    listing = call(ws, "list_dir").observation.splitlines()
    assert {"etc_link@", "leak.txt@", "rootfs@", "pkg/", "notes.txt"} <= set(listing)


def test_symlink_inside_the_copy_is_followed(ws, repo):
    os.symlink("pkg/mod.py", repo / "alias.py")
    out = call(ws, "read_file", path="alias.py")
    assert out.status == "ok" and "return a + b" in out.observation
    assert call(ws, "edit_file", path="alias.py", old="a + b", new="b + a").status == "ok"
    assert "return b + a" in (repo / "pkg" / "mod.py").read_text()
    assert os.path.islink(repo / "alias.py")


def test_hard_link_to_a_file_outside_is_refused(ws, repo, tmp_path):
    os.link(tmp_path / "outside.txt", repo / "hard.txt")
    out = call(ws, "read_file", path="hard.txt")
    assert out.status == "error" and "hard-linked" in out.observation


def test_symlink_swapped_in_after_resolution_is_refused(ws, repo, tmp_path):
    # resolve() saw a real directory; by the time of the open it is a symlink to outside.
    (repo / "sub").mkdir()
    (repo / "sub" / "f.txt").write_text("inside")
    rel = ws.resolve("sub/f.txt")
    os.rename(repo / "sub", repo / "sub_old")
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "f.txt").write_text("outside")
    os.symlink(tmp_path / "evil", repo / "sub")
    with pytest.raises(tools.ToolError, match="cannot open"):
        ws._read_bytes(rel, "sub/f.txt")
    with pytest.raises(tools.ToolError):
        ws._write_bytes(rel, b"x", "sub/f.txt")
    assert (tmp_path / "evil" / "f.txt").read_text() == "outside"
    # A symlink swapped in as the final component is replaced, never written through.
    os.remove(repo / "sub")
    os.rename(repo / "sub_old", repo / "sub")
    os.remove(repo / "sub" / "f.txt")
    os.symlink(tmp_path / "evil" / "f.txt", repo / "sub" / "f.txt")
    with pytest.raises(tools.ToolError):
        ws._read_bytes(rel, "sub/f.txt")
    ws._write_bytes(rel, b"new", "sub/f.txt")
    assert (tmp_path / "evil" / "f.txt").read_text() == "outside"
    assert not os.path.islink(repo / "sub" / "f.txt") and (repo / "sub" / "f.txt").read_text() == "new"


def test_heldout_location_is_not_writable(ws, repo):
    for path in ["heldout_tests/test_x.py", "tests/../heldout_tests/test_x.py", "heldout_tests"]:
        out = call(ws, "write_file", path=path, content="def test_x():\n    pass\n")
        assert out.status == "error" and "protected" in out.observation, path
    assert not (repo / "heldout_tests").exists()
    os.symlink("heldout_tests", repo / "sneaky")
    out = call(ws, "write_file", path="sneaky/test_y.py", content="x")
    assert out.status == "error" and "protected" in out.observation
    assert not (repo / "heldout_tests").exists()


# ---------------------------------------------------------------------------------------------
# write_file / edit_file / list_dir

def test_write_file_creates_and_overwrites(ws, repo):
    out = call(ws, "write_file", path="pkg/new/deep.py", content="X = 1\nY = 2\n")
    assert out.status == "ok" and out.observation == "Wrote 12 bytes (2 lines) to pkg/new/deep.py."
    assert (repo / "pkg" / "new" / "deep.py").read_text() == "X = 1\nY = 2\n"
    os.chmod(repo / "pkg" / "mod.py", 0o755)
    assert call(ws, "write_file", path="pkg/mod.py", content="Z = 3\n").status == "ok"
    assert (repo / "pkg" / "mod.py").read_text() == "Z = 3\n"
    assert os.stat(repo / "pkg" / "mod.py").st_mode & 0o777 == 0o755
    assert not [n for n in os.listdir(repo / "pkg") if n.endswith(".tmp")]


def test_write_file_errors(repo):
    ws = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(max_file_bytes=100))
    assert "limit of 100" in call(ws, "write_file", path="a.txt", content="x" * 101).observation
    assert not (repo / "a.txt").exists()
    assert "is a directory" in call(ws, "write_file", path="pkg", content="x").observation
    assert "repository root" in call(ws, "write_file", path=".", content="x").observation
    assert "repository root" in call(ws, "write_file", path="pkg/..", content="x").observation


def test_edit_file_exact_unique_match(ws, repo):
    out = call(ws, "edit_file", path="pkg/mod.py", old="    return a - b\n", new="    return a - b - 0\n")
    assert out.status == "ok"
    assert out.observation.startswith("Edited pkg/mod.py: replaced 1 occurrence (now lines 6-6).")
    assert "     6\t    return a - b - 0" in out.observation
    assert (repo / "pkg" / "mod.py").read_text() == MODULE.replace("a - b", "a - b - 0")


@pytest.mark.parametrize("old, new, message", [
    ("return a * b", "x", "not found"),
    ("    return a", "    return 0", "occurs 2 times"),
    ("", "x", "non-empty"),
    ("return a + b", "return a + b", "identical"),
])
def test_edit_file_errors_leave_the_file_unchanged(ws, repo, old, new, message):
    out = call(ws, "edit_file", path="pkg/mod.py", old=old, new=new)
    assert out.status == "error" and message in out.observation
    assert (repo / "pkg" / "mod.py").read_text() == MODULE


def test_a_missing_old_text_is_answered_with_the_files_closest_text(ws, repo):
    # The hint is the file's text as JSON, so the next call can copy it into its `old` verbatim.
    out = call(ws, "edit_file", path="pkg/mod.py", old="    return a * b\n", new="    return a + b + 0\n")
    assert out.status == "error" and "old text not found" in out.observation
    assert out.observation.endswith('the closest text in the file (line 2) is "    return a + b\\n"')
    assert tools.edit_hint(out.observation) == "    return a + b\n"
    again = call(ws, "edit_file", path="pkg/mod.py", old=json.loads(out.observation.rsplit(" is ", 1)[1]),
                 new="    return a + b + 0\n")
    assert tools.edit_hint(again.observation) is None
    assert again.status == "ok" and (repo / "pkg" / "mod.py").read_text() == MODULE.replace("a + b", "a + b + 0")
    # Nothing alike: no hint, only the advice to read the file.
    out = call(ws, "edit_file", path="pkg/mod.py", old="import numpy as np\n", new="x")
    assert out.status == "error" and out.observation.endswith("(read the file first)")
    assert tools.edit_hint(out.observation) is None
    # A hint whose text the observation limit cut short is no hint.
    assert tools.edit_hint(tools.HINT_PREFIX + '2) is "    return a +') is None
    tricky = 'a " b) is "c"\n'
    assert tools.edit_hint(tools.HINT_PREFIX + "2) is " + json.dumps(tricky)) == tricky
    # Hints off (what runs before they existed saw).
    quiet = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(edit_hints=False))
    out = call(quiet, "edit_file", path="pkg/mod.py", old="    return a * b\n", new="x")
    assert out.status == "error" and out.observation.endswith("(read the file first)")


@pytest.mark.parametrize("old, expected", [
    ("def sub(a, c):\n    return a - c\n", (5, "def sub(a, b):\n    return a - b\n")),  # as many lines as old
    ("def ad(a, b):", (1, "def add(a, b):\n")),  # a partial line: the whole line, with its break
    ("    return a - b\n", (6, "    return a - b\n")),  # present: itself
    ("return", None),  # too unlike any line
    ("a\nb\nc\nd\ne\nf\ng\n", None),  # more lines than the file
])
def test_closest_text_against_a_brute_force_search(old, expected):
    assert tools.closest_text(MODULE, old) == expected
    lines = MODULE.splitlines(keepends=True)
    k = max(1, len(old.splitlines()))
    scored = [(difflib.SequenceMatcher(None, "".join(lines[i:i + k]), old, autojunk=False).ratio(), -i)
              for i in range(len(lines) - k + 1)]
    if scored and max(scored)[0] >= tools.CLOSEST_MIN_RATIO:
        ratio, i = max(scored)
        assert expected == (-i + 1, "".join(lines[-i:-i + k]))
    else:
        assert expected is None


def test_edit_file_concurrent_edits_do_not_lose_updates(ws, repo):
    (repo / "many.txt").write_text("".join(f"item{i}\n" for i in range(40)))
    threads = [threading.Thread(target=call, args=(ws, "edit_file"),
                                kwargs={"path": "many.txt", "old": f"item{i}\n", "new": f"done{i}\n"})
               for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (repo / "many.txt").read_text() == "".join(f"done{i}\n" for i in range(40))


def test_list_dir(ws, repo):
    out = call(ws, "list_dir")
    assert out.observation.splitlines() == [".:", "notes.txt", "pkg/", "tests/"]
    assert call(ws, "list_dir", path="pkg").observation.splitlines() == ["pkg:", "__init__.py", "mod.py"]
    assert "does not exist" in call(ws, "list_dir", path="nope").observation
    assert "not a directory" in call(ws, "list_dir", path="notes.txt").observation
    (repo / "crowd").mkdir()
    for i in range(30):
        (repo / "crowd" / f"f{i:02d}").write_text("")
    small = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(max_list_entries=10))
    lines = call(small, "list_dir", path="crowd").observation.splitlines()
    assert lines[1:11] == [f"f{i:02d}" for i in range(10)] and lines[-1] == "[... 20 more entries]"


# ---------------------------------------------------------------------------------------------
# grep / run / run_tests / lint / submit

def test_grep_literal_and_regex(ws):
    out = call(ws, "grep", pattern="return a")
    assert out.observation.splitlines() == ["pkg/mod.py:2:     return a + b", "pkg/mod.py:6:     return a - b"]
    out = call(ws, "grep", pattern=r"line 1\d$", path="notes.txt", regex=True)
    assert out.observation.splitlines() == [f"notes.txt:{i}: line {i}" for i in range(10, 20)]
    assert call(ws, "grep", pattern="a + b", regex=False).observation == "pkg/mod.py:2:     return a + b"
    assert call(ws, "grep", pattern="zzz_absent").observation == "no matches"
    bad = call(ws, "grep", pattern="(unclosed", regex=True)
    assert bad.status == "error" and "invalid regular expression" in bad.observation
    assert "does not exist" in call(ws, "grep", pattern="x", path="missing").observation


def test_grep_caps_matches(repo):
    ws = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(max_grep_matches=3))
    lines = call(ws, "grep", pattern="line").observation.splitlines()
    assert lines[:3] == ["notes.txt:1: line 1", "notes.txt:2: line 2", "notes.txt:3: line 3"]
    assert lines[3:] == ["[20 matches; showing the first 3]"]


def test_grep_runaway_regex_is_stopped(repo):
    (repo / "evil.txt").write_text("a" * 40 + "!\n")
    ws = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(grep_timeout=1.0))
    start = time.monotonic()
    out = call(ws, "grep", pattern="(a+)+$", path="evil.txt", regex=True)
    assert time.monotonic() - start < 10
    assert out.status == "error" and "timed out" in out.observation


def test_run_command(ws):
    out = call(ws, "run", command="pwd; echo err >&2; exit 3")
    assert out.status == "ok"
    lines = out.observation.splitlines()
    assert lines[0] == "exit code: 3"
    assert lines[lines.index("--- stdout ---") + 1] == ws.root
    assert lines[lines.index("--- stderr ---") + 1] == "err"
    out = call(ws, "run", command="sleep 5", timeout=0.5)
    assert "timed out" in out.observation
    assert ws.executor.calls[-1][2] == 0.5 and ws.executor.calls[-1][3] == ws.root
    call(ws, "run", command="true", timeout=10_000)
    assert ws.executor.calls[-1][2] == ws.limits.max_command_timeout
    assert call(ws, "run", command="   ").status == "error"
    assert call(ws, "run", command="true", timeout=-1).status == "error"


def test_run_output_is_capped(repo):
    ws = tools.Workspace(repo, LocalExecutor(), limits=tools.ToolLimits(max_observation_chars=1_000))
    out = call(ws, "run", command="python3 -c \"print('a' * 100000 + 'END')\"")
    assert len(out.observation) < 1_400 and "characters omitted" in out.observation
    assert out.observation.rstrip().endswith("END")


def test_run_tests(ws, repo):
    out = call(ws, "run_tests")
    assert out.status == "ok" and out.observation.startswith("exit code: 0") and "1 passed" in out.observation
    (repo / "pkg" / "mod.py").write_text(MODULE.replace("a + b", "a * b"))
    out = call(ws, "run_tests", paths=["tests/test_mod.py"])
    assert out.observation.startswith("exit code: 1") and "1 failed" in out.observation
    assert "does not exist" in call(ws, "run_tests", paths=["tests/nope.py"]).observation
    assert call(ws, "run_tests", paths=[]).status == "error"
    assert not (repo / ".pytest_cache").exists()
    assert not list(repo.rglob("__pycache__"))


def test_lint_reports_real_problems(ws, repo):
    out = call(ws, "lint")
    assert out.status == "ok" and out.observation.splitlines()[0] == "linter: pyflakes"
    assert out.observation.splitlines()[-1] == "0 problem(s) in 3 file(s)"
    (repo / "pkg" / "bad.py").write_text(
        "import os\nimport sys\nfrom json import dumps\nfrom . import mod as m\n\nCONST = 1\n\n\n"
        "def f(x):\n    global G\n    G = x\n"
        "    return helper(x) + CONST + len(sys.argv)\n\n\nclass K:\n    y = CONST\n\n    def m(self):\n"
        "        return [y for y in range(3)] + [G, undefined_thing]\n")
    (repo / "pkg" / "broken.py").write_text("def f(:\n    pass\n")
    out = call(ws, "lint", paths=["pkg/bad.py", "pkg/broken.py", "pkg/mod.py"])
    text = out.observation
    assert out.status == "ok"
    lines = text.splitlines()
    assert any(line.startswith("pkg/bad.py:12:") and "undefined name 'helper'" in line for line in lines)
    assert any(line.startswith("pkg/bad.py:19:") and "undefined name 'undefined_thing'" in line for line in lines)
    for name in ("os", "json.dumps", ".mod as m"):
        assert any(f"'{name}' imported but unused" in line for line in lines), name
    for absent in ("'sys' imported", "name 'G'", "name 'CONST'", "name 'y'", "name 'x'", "name 'len'"):
        assert absent not in text, absent
    assert any(line.startswith("pkg/broken.py:1") for line in lines)
    assert not any(line.startswith("pkg/mod.py") for line in lines)
    # pyflakes also reports that method `m` redefines the unused import `m`.
    assert any(line.startswith("pkg/bad.py:18:") and "redefinition of unused 'm'" in line for line in lines)
    assert len([line for line in lines if line.startswith("pkg/bad.py")]) == 6


def test_submit(ws):
    assert not ws.submitted
    assert call(ws, "submit").status == "ok"
    assert ws.submitted


# ---------------------------------------------------------------------------------------------
# call validation and failures

@pytest.mark.parametrize("name, arguments, message", [
    ("no_such_tool", {}, "unknown tool 'no_such_tool'"),
    (None, {}, "unknown tool None"),
    ("read_file", {}, "missing required argument(s) ['path']"),
    ("read_file", {"path": 3}, "'path' must be string"),
    ("read_file", {"path": "a", "start_line": "3"}, "'start_line' must be integer"),
    ("read_file", {"path": "a", "start_line": True}, "'start_line' must be integer"),
    ("read_file", {"path": "a", "start_line": 1.5}, "'start_line' must be integer"),
    ("read_file", {"path": "a", "mode": "r"}, "unexpected argument(s) ['mode']"),
    ("run", {"command": "true", "timeout": "5"}, "'timeout' must be number"),
    ("run_tests", {"paths": "tests"}, "'paths' must be array of strings"),
    ("run_tests", {"paths": ["a", 1]}, "'paths' must be array of strings"),
    ("grep", {"pattern": "x", "regex": "yes"}, "'regex' must be boolean"),
    ("submit", {"now": True}, "unexpected argument(s) ['now']"),
    ("read_file", ["a"], "must be an object"),
    ("write_file", {"path": "a", "content": None}, "'content' must be string"),
    ("write_file", {"path": "a"}, "missing required argument(s) ['content']"),
])
def test_malformed_calls(ws, name, arguments, message):
    out = tools.call_tool(ws, name, arguments)
    assert out.status == "malformed"
    assert out.observation.startswith("Error (malformed tool call): ") and message in out.observation
    assert ws.executor.calls == []


def test_optional_null_arguments_are_accepted(ws):
    out = tools.call_tool(ws, "read_file", {"path": "notes.txt", "start_line": None, "end_line": 2})
    assert out.status == "ok" and out.observation.startswith("notes.txt (lines 1-2 of 20)")


def test_executor_failures_are_infra_observations(ws):
    class Raising:
        def run(self, argv, **kwargs):
            raise ConnectionError("worker lost")

    class Infra:
        def run(self, argv, **kwargs):
            return Result("", "could not start", None, "infra")

    for executor, needle in [(Raising(), "ConnectionError: worker lost"), (Infra(), "could not start")]:
        broken = tools.Workspace(ws.root, executor)
        for name, arguments in [("run", {"command": "true"}), ("run_tests", {}), ("lint", {}),
                                ("grep", {"pattern": "x"})]:
            out = tools.call_tool(broken, name, arguments)
            assert out.status == "infra" and needle in out.observation, (name, out)


def test_unexpected_tool_exception_becomes_an_error_observation(ws):
    def explode(ws, path):
        raise RuntimeError("boom")

    registry = dict(tools.TOOLS, read_file=dataclasses.replace(tools.TOOLS["read_file"], fn=explode))
    out = tools.call_tool(ws, "read_file", {"path": "x"}, registry)
    assert out.status == "error" and "RuntimeError: boom" in out.observation


def test_registry_schemas_match_the_functions():
    assert set(tools.TOOLS) == {"read_file", "write_file", "edit_file", "list_dir", "grep", "run", "run_tests",
                                "lint", "submit"}
    docs = [json.loads(line) for line in tools.render_tool_docs().splitlines()]
    assert [d["name"] for d in docs] == list(tools.TOOLS)
    for spec in tools.TOOLS.values():
        params = list(inspect.signature(spec.fn).parameters.values())[1:]
        assert [p.name for p in params] == list(spec.parameters["properties"]), spec.name
        required = [p.name for p in params if p.default is inspect.Parameter.empty]
        assert required == spec.parameters["required"], spec.name
        assert spec.parameters["additionalProperties"] is False


def test_workspace_rejects_a_missing_root(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        tools.Workspace(tmp_path / "missing", LocalExecutor())


def test_python_of_the_workspace_is_used(repo):
    ws = tools.Workspace(repo, LocalExecutor(), python=sys.executable)
    call(ws, "run_tests")
    assert ws.executor.calls[-1][0][0] == sys.executable


def test_line_numbers_follow_python(ws, repo):
    # A form feed does not end a line for Python (or pytest's line numbers), so not here either.
    (repo / "ff.py").write_text("a = 1\x0c\nb = 2\r\nc = 3\n")
    lines = call(ws, "read_file", path="ff.py").observation.split("\n")
    assert lines[0] == "ff.py (lines 1-3 of 3)" and lines[3] == "     3\tc = 3"
    assert call(ws, "grep", pattern="c = 3", path="ff.py").observation == "ff.py:3: c = 3"
