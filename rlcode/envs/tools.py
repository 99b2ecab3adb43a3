"""The agent's tools, confined to one rollout's working copy, and their registry.

Tools act on a `Workspace`: the root directory of one rollout's private copy (see
`rlcode.envs.tasks.repo.materialize`) plus the `Executor` that runs commands in it.

* File tools (``read_file``, ``write_file``, ``edit_file``, ``list_dir``) run in this process.
  A path is relative to the root; it is resolved with every symlink followed
  (`os.path.realpath`) and refused unless the result lies inside the root, and the file is then
  opened one path component at a time relative to the parent directory's descriptor with
  ``O_NOFOLLOW``, so a symlink swapped in between the check and the open (say by a concurrent
  ``run``) makes the call fail instead of escaping. Only regular files with a single link are
  read or replaced (a FIFO would block, a hard link could alias a file outside the root). Writes
  go to a temporary file that is renamed over the target, and are refused under the protected
  prefixes (the held-out test directory). File sizes and observations are capped (`ToolLimits`).
* Command tools (``run``, ``run_tests``, ``lint``, ``grep``) go through the executor with
  ``workdir`` = the root and a timeout. ``grep`` runs there too: a regular expression written
  by the policy can backtrack for ever, and only a separate process can be stopped.

Shell commands can of course write anywhere in the copy (including a ``heldout_tests/``
directory); this is harmless because grading runs the held-out tests in a pristine copy. What a
command can reach outside the copy is the executor's business (`rlcode.sandbox`).

Linting runs pyflakes (a project dependency) in the executor's Python; the first line of the
observation names the linter.

Every tool returns an observation string. `call_tool` validates the call against the tool's
JSON schema and turns every failure into an observation with a status: ``"malformed"`` (unknown
tool, missing, unexpected or wrongly typed argument), ``"error"`` (the tool refused or failed:
a path outside the root, no unique match for ``edit_file``, ...), ``"infra"`` (the executor
itself failed). Nothing raises into the episode loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

# ----------------------------------------------------------------------------------------------
# The executor interface (implemented by rlcode.sandbox's pool; tests use a subprocess double).

EXEC_STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "infra")
# The command ran to its end (whatever its exit code); the other statuses mean it was stopped.
_FINISHED = ("ok", "error")


class ExecResult(Protocol):
    """The outcome of one command; ``status`` is one of `EXEC_STATUSES`. stdout and stderr may
    be str or bytes (bytes are decoded as UTF-8 with replacement)."""

    stdout: str | bytes
    stderr: str | bytes
    returncode: int | None
    status: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_time: float


class Executor(Protocol):
    """Runs one command with `workdir` as its working directory, within `timeout` seconds."""

    def run(self, argv: list[str], *, files: Mapping[str, str] | None = None, stdin: str | None = None,
            timeout: float, workdir: str | None = None) -> ExecResult: ...


# ----------------------------------------------------------------------------------------------
# Workspace.

@dataclasses.dataclass(frozen=True)
class ToolLimits:
    """Caps on what the tools read, write and return."""

    max_file_bytes: int = 1_000_000  # largest file read, edited or written
    max_observation_chars: int = 12_000  # longest observation (head and tail are kept)
    edit_hints: bool = True  # a failed edit_file shows the file's closest text (`closest_text`)
    max_grep_matches: int = 50
    max_grep_line_chars: int = 200  # a matching line is cut to this many characters
    max_list_entries: int = 200
    default_command_timeout: float = 30.0
    max_command_timeout: float = 120.0
    test_timeout: float = 120.0
    lint_timeout: float = 60.0
    grep_timeout: float = 20.0


class ToolError(Exception):
    """A refusal or failure of a tool; its message becomes the observation."""


class InfraError(Exception):
    """The executor failed to run a command (not the command's own failure)."""


def output_text(data: str | bytes | None) -> str:
    """An executor's stdout or stderr as text."""
    if data is None:
        return ""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data).decode("utf-8", errors="replace")
    return data


def _lines(text: str) -> list[str]:
    """Lines as Python and pytest number them (``\n``, ``\r\n`` or ``\r`` ends a line; unlike
    `str.splitlines`, form feeds and Unicode separators do not)."""
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def _truncate(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:]}"


class Workspace:
    """One rollout's working copy and the executor that runs commands in it.

    root: the copy's directory (its real path is used). executor: an `Executor`.
    test_paths: the visible tests ``run_tests`` runs by default. protected: relative path
    prefixes the file tools refuse to write (default: the held-out test directory).
    python: the interpreter the executor runs for tests, lint and grep.
    shell: argv prefix of ``run`` (the command is appended).
    command_concurrency: at most this many executor commands of this workspace run at once
      (None: no limit). File tools are not limited.
    """

    def __init__(self, root: str | os.PathLike, executor: Executor, *, test_paths: Sequence[str] = ("tests",),
                 protected: Sequence[str] = ("heldout_tests",), python: str = sys.executable,
                 shell: Sequence[str] = ("bash", "-c"), limits: ToolLimits = ToolLimits(),
                 command_concurrency: int | None = None):
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise ValueError(f"workspace root {self.root} is not a directory")
        self.executor = executor
        self.test_paths = tuple(test_paths)
        self.protected = tuple(os.path.normpath(p) for p in protected)
        self.python = python
        self.shell = tuple(shell)
        self.limits = limits
        self.submitted = False
        # Serialises read-modify-write tools against each other (calls of one turn run concurrently).
        self._write_lock = threading.Lock()
        if command_concurrency is not None and command_concurrency < 1:
            raise ValueError(f"command_concurrency must be >= 1 or None, got {command_concurrency}")
        self._command_slots = (threading.BoundedSemaphore(command_concurrency)
                               if command_concurrency is not None else None)

    # -- paths ---------------------------------------------------------------------------------

    def resolve(self, path: str, *, write: bool = False) -> str:
        """The normalised path relative to the root ("." for the root) that `path` denotes once
        every symlink is followed; ToolError if it is absolute, leaves the root, or (when
        `write`) lies in a protected location."""
        if not isinstance(path, str) or not path:
            raise ToolError("path must be a non-empty string")
        if "\x00" in path:
            raise ToolError("path must not contain NUL characters")
        if os.path.isabs(path):
            raise ToolError(f"{path!r} is absolute; paths are relative to the repository root")
        full = os.path.realpath(os.path.join(self.root, path))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise ToolError(f"{path!r} is outside the repository")
        rel = os.path.relpath(full, self.root)
        if write:
            for prefix in self.protected:
                if rel == prefix or rel.startswith(prefix + os.sep):
                    raise ToolError(f"{path!r} is in a protected location ({prefix}); it cannot be written")
            if rel == ".":
                raise ToolError("cannot write to the repository root itself")
        return rel

    def _open_dir(self, parts: Sequence[str], *, create: bool = False) -> int:
        """A descriptor of root/parts..., walked without following symlinks."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _split(rel: str) -> tuple[list[str], str]:
        parts = [] if rel == "." else rel.split(os.sep)
        return parts[:-1], (parts[-1] if parts else ".")

    def _read_bytes(self, rel: str, display: str) -> bytes:
        parents, name = self._split(rel)
        try:
            dir_fd = self._open_dir(parents)
        except OSError as e:
            raise ToolError(f"cannot open {display!r}: {e.strerror}") from None
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                raise ToolError(f"{display!r} does not exist") from None
            except OSError as e:
                raise ToolError(f"cannot open {display!r}: {e.strerror}") from None
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise ToolError(f"{display!r} is a directory; use list_dir")
                if not stat.S_ISREG(st.st_mode):
                    raise ToolError(f"{display!r} is not a regular file")
                if st.st_nlink > 1:
                    raise ToolError(f"{display!r} is hard-linked; refusing to read it")
                if st.st_size > self.limits.max_file_bytes:
                    raise ToolError(f"{display!r} has {st.st_size} bytes, more than the limit of "
                                    f"{self.limits.max_file_bytes}")
                chunks, size = [], 0
                while size <= self.limits.max_file_bytes:
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                if size > self.limits.max_file_bytes:
                    raise ToolError(f"{display!r} is larger than the limit of {self.limits.max_file_bytes} bytes")
                return b"".join(chunks)
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def _read_text(self, rel: str, display: str) -> str:
        return self._read_bytes(rel, display).decode("utf-8", errors="replace")

    def _write_bytes(self, rel: str, data: bytes, display: str) -> None:
        if len(data) > self.limits.max_file_bytes:
            raise ToolError(f"content has {len(data)} bytes, more than the limit of {self.limits.max_file_bytes}")
        parents, name = self._split(rel)
        try:
            dir_fd = self._open_dir(parents, create=True)
        except OSError as e:
            raise ToolError(f"cannot create the directories of {display!r}: {e.strerror}") from None
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            mode = 0o644
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if stat.S_ISDIR(st.st_mode):
                    raise ToolError(f"{display!r} is a directory")
                if stat.S_ISREG(st.st_mode):
                    mode = stat.S_IMODE(st.st_mode)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            # rename replaces a symlink or a file at `name` itself; it never writes through it.
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise ToolError(f"cannot write {display!r}: {e.strerror}") from None
        finally:
            os.close(dir_fd)

    # -- command helper ------------------------------------------------------------------------

    def execute(self, argv: list[str], timeout: float) -> ExecResult:
        """Run `argv` in the root through the executor; InfraError when the executor fails."""
        slots = self._command_slots
        if slots is not None:
            slots.acquire()
        try:
            result = self.executor.run(list(argv), timeout=timeout, workdir=self.root)
        except Exception as e:  # the sandbox's own failure, whatever its type
            raise InfraError(f"the sandbox could not run the command: {type(e).__name__}: {e}") from e
        finally:
            if slots is not None:
                slots.release()
        if getattr(result, "status", None) == "infra":
            detail = " ".join(filter(None, (str(getattr(result, "info", "") or "").strip(),
                                            output_text(result.stderr).strip())))
            raise InfraError("the sandbox could not run the command (infrastructure failure)"
                             + (f": {detail}" if detail else ""))
        return result

    def format_result(self, result: ExecResult) -> str:
        status = result.status
        lines = [f"exit code: {result.returncode}"]
        if status == "timeout":
            lines.append("status: timed out (the command was killed)")
        elif status == "memory":
            lines.append("status: killed for exceeding the memory limit")
        elif status == "output_limit":
            lines.append("status: killed for exceeding the output limit")
        half = self.limits.max_observation_chars // 2
        for name, text, cut in (("stdout", output_text(result.stdout), result.stdout_truncated),
                                ("stderr", output_text(result.stderr), result.stderr_truncated)):
            if text or cut:
                note = " (truncated by the sandbox)" if cut else ""
                lines.append(f"--- {name}{note} ---\n{_truncate(text, half).rstrip()}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The tools. Each takes the workspace and the validated arguments and returns an observation.

def read_file(ws: Workspace, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
    rel = ws.resolve(path)
    lines = _lines(ws._read_text(rel, path))
    total = len(lines)
    start = 1 if start_line is None else start_line
    end = total if end_line is None else min(end_line, total)
    if start < 1:
        raise ToolError(f"start_line must be >= 1, got {start}")
    if end_line is not None and end_line < start:
        raise ToolError(f"end_line ({end_line}) is before start_line ({start})")
    if total == 0:
        return f"{path}: empty file"
    if start > total:
        raise ToolError(f"start_line {start} is past the end of {path!r} ({total} lines)")
    out, used = [], 0
    shown_end = start - 1
    for number in range(start, end + 1):
        row = f"{number:6d}\t{lines[number - 1]}"
        if used + len(row) + 1 > ws.limits.max_observation_chars and out:
            break
        out.append(row[:ws.limits.max_observation_chars])
        used += len(row) + 1
        shown_end = number
    header = f"{path} (lines {start}-{shown_end} of {total})"
    if shown_end < end:
        header += f" [output capped; continue with start_line={shown_end + 1}]"
    return header + "\n" + "\n".join(out)


def write_file(ws: Workspace, path: str, content: str) -> str:
    rel = ws.resolve(path, write=True)
    data = content.encode("utf-8", errors="replace")
    with ws._write_lock:
        ws._write_bytes(rel, data, path)
    return f"Wrote {len(data)} bytes ({len(content.splitlines())} lines) to {path}."


# A failed edit shows the file's text most like `old` when it is at least this similar
# (difflib's ratio), so the next call can copy it; below that no hint is given.
CLOSEST_MIN_RATIO = 0.6
CLOSEST_MAX_WINDOWS = 5000  # lines of a file searched for it


def closest_text(text: str, old: str) -> tuple[int, str] | None:
    """(first line number, the text) of the run of whole lines of `text` most like `old`: as
    many lines as `old` has, each with its line break as the file has it; None when none is
    at least CLOSEST_MIN_RATIO similar (or `old` spans more lines than the file). Ties go to
    the earliest run."""
    import difflib  # noqa: PLC0415

    lines = text.splitlines(keepends=True)
    k = max(1, len(old.splitlines()))
    best, where = CLOSEST_MIN_RATIO, None
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(old)
    for i in range(min(len(lines) - k + 1, CLOSEST_MAX_WINDOWS)):
        window = "".join(lines[i:i + k])
        matcher.set_seq1(window)
        if matcher.real_quick_ratio() >= best and matcher.quick_ratio() >= best:
            ratio = matcher.ratio()
            if ratio > best or (ratio == best and where is None):
                best, where = ratio, (i + 1, window)
    return where


HINT_PREFIX = "; the closest text in the file (line "  # how a failed edit_file names the closest text


def edit_hint(observation: str) -> str | None:
    """The closest text a failed ``edit_file`` showed in `observation` (None: no hint, or one cut
    short by the observation limit)."""
    at = observation.rfind(HINT_PREFIX)
    if at < 0:
        return None
    rest = observation[at + len(HINT_PREFIX):]
    start = rest.find(") is ")
    try:
        return json.loads(rest[start + len(") is "):]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def edit_file(ws: Workspace, path: str, old: str, new: str) -> str:
    if not old:
        raise ToolError("old must be a non-empty string")
    if old == new:
        raise ToolError("old and new are identical; nothing would change")
    rel = ws.resolve(path, write=True)
    with ws._write_lock:
        text = ws._read_text(rel, path)
        count = text.count(old)
        if count == 0:
            close = closest_text(text, old) if ws.limits.edit_hints else None
            hint = (f"{HINT_PREFIX}{close[0]}) is {json.dumps(close[1])}" if close else
                    " (read the file first)")
            raise ToolError(_truncate(f"old text not found in {path!r}; it must match the file exactly, "
                                      f"including indentation and line breaks{hint}", ws.limits.max_observation_chars))
        if count > 1:
            raise ToolError(f"old text occurs {count} times in {path!r}; include more surrounding "
                            "lines so that it matches exactly once")
        at = text.index(old)
        updated = text[:at] + new + text[at + len(old):]
        ws._write_bytes(rel, updated.encode("utf-8", errors="replace"), path)
    first = text.count("\n", 0, at) + 1
    last = first + max(new.count("\n") - (1 if new.endswith("\n") else 0), 0)
    lines = _lines(updated)
    lo, hi = max(first - 2, 1), min(last + 2, len(lines))
    snippet = "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(lo, hi + 1))
    return _truncate(f"Edited {path}: replaced 1 occurrence (now lines {first}-{last}).\n{snippet}",
                     ws.limits.max_observation_chars)


def list_dir(ws: Workspace, path: str = ".") -> str:
    rel = ws.resolve(path)
    try:
        fd = ws._open_dir([] if rel == "." else rel.split(os.sep))
    except FileNotFoundError:
        raise ToolError(f"{path!r} does not exist") from None
    except NotADirectoryError:
        raise ToolError(f"{path!r} is not a directory; use read_file") from None
    except OSError as e:
        raise ToolError(f"cannot list {path!r}: {e.strerror}") from None
    try:
        entries = []
        with os.scandir(fd) as it:
            for entry in it:
                if entry.is_symlink():
                    entries.append(f"{entry.name}@")
                elif entry.is_dir(follow_symlinks=False):
                    entries.append(f"{entry.name}/")
                else:
                    entries.append(entry.name)
    finally:
        os.close(fd)
    entries.sort()
    shown = entries[:ws.limits.max_list_entries]
    more = len(entries) - len(shown)
    body = "\n".join(shown) if shown else "(empty directory)"
    return f"{path}:\n{body}" + (f"\n[... {more} more entries]" if more else "")


# Defined in the scripts below, which run in the copy through the executor: the entries of a
# tree that are not directories, walked with an explicit stack (os.walk recurses, and a copy may be
# thousands of levels deep), never into a symlink, a hidden directory or __pycache__.
_WALK = r'''
def walk(top):
    stack = [top]
    while stack:
        try:
            entries = sorted(os.scandir(stack.pop()), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for e in entries:
            if e.is_dir():
                if not e.is_symlink() and not e.name.startswith(".") and e.name != "__pycache__":
                    subdirs.append(e.path)
            else:
                yield e
        stack.extend(reversed(subdirs))
'''

# argv = pattern, path, regex flag, caps.
_GREP_SCRIPT = r'''
import os, re, sys
pattern, top, regex, max_matches, max_chars, max_bytes = sys.argv[1:7]
max_matches, max_chars, max_bytes = int(max_matches), int(max_chars), int(max_bytes)
match = re.compile(pattern).search if regex == "1" else (lambda line: pattern in line)
''' + _WALK + r'''
def files():
    if os.path.isfile(top) and not os.path.islink(top):
        yield top
        return
    for e in walk(top):
        if not e.is_symlink() and e.is_file():
            yield e.path
found = 0
for p in files():
    try:
        if os.path.getsize(p) > max_bytes:
            continue
        with open(p, "rb") as f:
            data = f.read()
    except OSError:
        continue
    if b"\0" in data[:8192]:
        continue
    for number, line in enumerate(re.split(r"\r\n|\r|\n", data.decode("utf-8", "replace")), 1):
        if match(line):
            found += 1
            if found <= max_matches:
                shown = line if len(line) <= max_chars else line[:max_chars] + " [...]"
                print(f"{os.path.normpath(p)}:{number}: {shown}")
if found == 0:
    print("no matches")
elif found > max_matches:
    print(f"[{found} matches; showing the first {max_matches}]")
'''


def grep(ws: Workspace, pattern: str, path: str = ".", regex: bool = False) -> str:
    if not pattern:
        raise ToolError("pattern must be a non-empty string")
    if regex:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ToolError(f"invalid regular expression: {e}") from None
    rel = ws.resolve(path)
    if not os.path.lexists(os.path.join(ws.root, rel)):
        raise ToolError(f"{path!r} does not exist")
    lim = ws.limits
    result = ws.execute([ws.python, "-c", _GREP_SCRIPT, pattern, rel, "1" if regex else "0",
                         str(lim.max_grep_matches), str(lim.max_grep_line_chars), str(lim.max_file_bytes)],
                        timeout=lim.grep_timeout)
    if result.status in _FINISHED and result.returncode == 0:
        return _truncate(output_text(result.stdout).rstrip(), lim.max_observation_chars)
    raise ToolError("grep failed:\n" + ws.format_result(result))


def run(ws: Workspace, command: str, timeout: float | None = None) -> str:
    if not command.strip():
        raise ToolError("command must be a non-empty string")
    lim = ws.limits
    timeout = lim.default_command_timeout if timeout is None else float(timeout)
    if not timeout > 0:
        raise ToolError(f"timeout must be positive, got {timeout}")
    timeout = min(timeout, lim.max_command_timeout)
    return ws.format_result(ws.execute([*ws.shell, command], timeout=timeout))


def _test_targets(ws: Workspace, paths: Sequence[str] | None) -> list[str]:
    if paths is None:
        return list(ws.test_paths)
    if not paths:
        raise ToolError("paths must not be empty (omit it to use the default)")
    targets = []
    for p in paths:
        rel = ws.resolve(p)
        if not os.path.lexists(os.path.join(ws.root, rel)):
            raise ToolError(f"{p!r} does not exist")
        targets.append(rel)
    return targets


def run_tests(ws: Workspace, paths: list[str] | None = None) -> str:
    targets = _test_targets(ws, paths)
    # -B and no cacheprovider: pytest leaves no bytecode or cache files in the copy.
    argv = [ws.python, "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", *targets]
    return ws.format_result(ws.execute(argv, timeout=ws.limits.test_timeout))


# Runs in the copy through the executor: argv = the files to check (default: every .py file).
_LINT_SCRIPT = r'''
import os, sys
''' + _WALK + r'''
paths = sys.argv[1:] or [os.path.normpath(e.path) for e in walk(".") if e.name.endswith(".py")]
try:
    from pyflakes import api, reporter
except ImportError:
    print("pyflakes is not installed for this interpreter")
    sys.exit(2)
print("linter: pyflakes")
problems = sum(api.checkPath(p, reporter.Reporter(sys.stdout, sys.stdout)) for p in paths)
print(f"{problems} problem(s) in {len(paths)} file(s)")
sys.exit(1 if problems else 0)
'''


def lint(ws: Workspace, paths: list[str] | None = None) -> str:
    if paths is not None:
        if not paths:
            raise ToolError("paths must not be empty (omit it to lint every Python file)")
        targets = _test_targets(ws, paths)
    else:
        targets = []
    result = ws.execute([ws.python, "-B", "-c", _LINT_SCRIPT, *targets], timeout=ws.limits.lint_timeout)
    if result.status in _FINISHED and result.returncode in (0, 1):
        return _truncate(output_text(result.stdout).rstrip(), ws.limits.max_observation_chars)
    raise ToolError("lint failed:\n" + ws.format_result(result))


def submit(ws: Workspace) -> str:
    ws.submitted = True
    return "Submitted. The episode ends after this turn."


# ----------------------------------------------------------------------------------------------
# Registry and dispatch.

@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool: name, description and JSON schema of its arguments (rendered in the system
    prompt), and its implementation ``fn(workspace, **arguments) -> observation``."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def _params(required: Sequence[str] = (), **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}

TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
    ToolSpec("read_file", "Show a text file with numbered lines, optionally only lines start_line..end_line "
             "(1-based, inclusive).",
             _params(["path"], path=_STR, start_line={"type": "integer"}, end_line={"type": "integer"}), read_file),
    ToolSpec("write_file", "Create or overwrite a file with the given content.",
             _params(["path", "content"], path=_STR, content=_STR), write_file),
    ToolSpec("edit_file", "Replace the exact text `old` with `new` in a file; `old` must occur exactly once.",
             _params(["path", "old", "new"], path=_STR, old=_STR, new=_STR), edit_file),
    ToolSpec("list_dir", "List a directory (subdirectories end with /, symlinks with @).",
             _params([], path=_STR), list_dir),
    ToolSpec("grep", "Search files under `path` for lines containing `pattern` (a Python regular "
             "expression when regex is true).",
             _params(["pattern"], pattern=_STR, path=_STR, regex={"type": "boolean"}), grep),
    ToolSpec("run", "Run a shell command in the repository root; returns its exit code and output.",
             _params(["command"], command=_STR, timeout={"type": "number"}), run),
    ToolSpec("run_tests", "Run the visible tests (or the given test files) with pytest.",
             _params([], paths={"type": "array", "items": _STR}), run_tests),
    ToolSpec("lint", "Check Python files (default: all) for syntax errors, undefined names and unused imports.",
             _params([], paths={"type": "array", "items": _STR}), lint),
    ToolSpec("submit", "Submit the repository as it is now; ends the episode.", _params([]), submit),
)}


def tool_schemas(registry: Mapping[str, ToolSpec] = TOOLS) -> list[dict[str, Any]]:
    """The JSON schemas of the registry's tools, in registry order."""
    return [spec.schema() for spec in registry.values()]


def render_tool_docs(registry: Mapping[str, ToolSpec] = TOOLS) -> str:
    """One JSON line per tool, for the system prompt."""
    return "\n".join(json.dumps(s, sort_keys=True) for s in tool_schemas(registry))


def _type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and all(_type_ok(v, schema.get("items", {})) for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return True


def validate_arguments(spec: ToolSpec, arguments: Any) -> dict[str, Any]:
    """The arguments with optional nulls dropped; ValueError naming the first problem."""
    if not isinstance(arguments, Mapping):
        raise ValueError(f"arguments of {spec.name} must be an object, got {type(arguments).__name__}")
    props = spec.parameters["properties"]
    required = spec.parameters["required"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ValueError(f"{spec.name} got unexpected argument(s) {unknown}; it takes {sorted(props) or 'none'}")
    clean = {}
    for name, value in arguments.items():
        if value is None and name not in required:
            continue
        if not _type_ok(value, props[name]):
            kind = props[name]["type"] + (" of strings" if props[name]["type"] == "array" else "")
            raise ValueError(f"{spec.name}: argument {name!r} must be {kind}, got {type(value).__name__}")
        clean[name] = value
    missing = [n for n in required if n not in clean]
    if missing:
        raise ValueError(f"{spec.name} is missing required argument(s) {missing}")
    return clean


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """observation: the text returned to the policy. status: "ok" | "malformed" | "error" | "infra"."""

    observation: str
    status: str


def malformed(message: str) -> ToolOutcome:
    return ToolOutcome(f"Error (malformed tool call): {message}", "malformed")


def call_tool(ws: Workspace, name: Any, arguments: Any, registry: Mapping[str, ToolSpec] = TOOLS) -> ToolOutcome:
    """Validate and run one call; never raises (errors come back as observations)."""
    spec = registry.get(name) if isinstance(name, str) else None
    if spec is None:
        return malformed(f"unknown tool {name!r}; available: {', '.join(registry)}")
    try:
        args = validate_arguments(spec, arguments)
    except ValueError as e:
        return malformed(str(e))
    try:
        observation = spec.fn(ws, **args)
    except ToolError as e:
        return ToolOutcome(f"Error: {e}", "error")
    except InfraError as e:
        return ToolOutcome(f"Error: {e}", "infra")
    except Exception as e:  # a failure of the tool itself must not end the episode
        return ToolOutcome(f"Error: {name} failed: {type(e).__name__}: {e}", "error")
    return ToolOutcome(_truncate(observation, ws.limits.max_observation_chars + 200), "ok")
