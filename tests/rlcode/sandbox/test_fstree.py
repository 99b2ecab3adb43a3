"""rlcode.sandbox.fstree: bounded, descriptor-relative tree operations on trees a program wrote.

The oracle for ordinary trees is the standard library (`os.walk`, `open`); the attacks are the
ones the standard library fails on: a tree deeper than the recursion limit whose paths are longer
than PATH_MAX (`shutil.rmtree` raises RecursionError), symlinks planted where a directory is
expected, FIFOs, hard links, directories without permissions, and a copy that changes while the
host side changes too. Every deep-tree test removes its tree, whatever happens, with the module
under test (the pytest temporary directory would otherwise hold a tree `shutil` cannot delete).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile

import pytest

from rlcode.sandbox import fstree

DEPTH = 1100
NAME = "dddd"  # 1100 levels of "dddd/": 5500 bytes of relative path, past PATH_MAX (4096)


def make_deep(root, depth: int = DEPTH, name: str = NAME) -> str:
    """A chain of `depth` directories below root with a file `leaf.txt` at the bottom; returns
    the leaf's relative path."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("leaf\n")
    os.close(fd)
    return "/".join([name] * depth + ["leaf.txt"])


@pytest.fixture
def deep(tmp_path):
    root = tmp_path / "deep"
    root.mkdir()
    leaf = make_deep(str(root))
    yield root, leaf
    fstree.remove(str(root))


@pytest.fixture(params=[True, False], ids=["openat2", "stepwise"])
def resolver(request, monkeypatch):
    """Run a test with openat2 and with the component-at-a-time fallback of older kernels."""
    if not request.param:
        monkeypatch.setattr(fstree, "_openat2_ok", False)
    return request.param


def small_tree(root) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "sub" / "b.txt").write_text("b\n")
    (root / "top.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "top.sh", 0o755)
    (root / "empty").mkdir()


# ----------------------------------------------------------------------------------------------
# walking and reading


def test_walk_lists_what_os_walk_lists(tmp_path, resolver):
    small_tree(tmp_path)
    expected = set()
    for d, dirs, files in os.walk(tmp_path):
        rel = os.path.relpath(d, tmp_path)
        for n in dirs + files:
            expected.add(os.path.normpath(os.path.join(rel, n)))
    tree = fstree.walk(str(tmp_path))
    assert {e.path for e in tree.entries} == expected and not tree.truncated and not tree.skipped
    kinds = {e.path: e.kind for e in tree.entries}
    assert kinds["pkg"] == "dir" and kinds["pkg/a.py"] == "file" and kinds["top.sh"] == "file"
    paths = [e.path for e in tree.entries]
    assert paths.index("pkg") < paths.index("pkg/sub") < paths.index("pkg/sub/b.txt")  # parents first


def test_symlinks_are_listed_never_followed(tmp_path, resolver):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(str(outside), root / "dirlink")
    os.symlink(str(outside / "secret.txt"), root / "filelink")
    os.mkfifo(root / "fifo")
    tree = fstree.walk(str(root))
    assert {(e.path, e.kind) for e in tree.entries} == {
        ("dirlink", "symlink"), ("filelink", "symlink"), ("fifo", "other")}
    files, skipped = fstree.read_files(str(root))
    assert files == {} and sorted(skipped) == [("dirlink", "symlink"), ("fifo", "not a regular file"),
                                              ("filelink", "symlink")]
    rfd = os.open(root, os.O_RDONLY)
    try:
        for rel in ("dirlink/secret.txt", "dirlink", "../outside/secret.txt", "/etc/passwd", "a//b"):
            with pytest.raises(OSError):
                os.close(fstree.open_beneath(rfd, rel, os.O_RDONLY))
    finally:
        os.close(rfd)
    with pytest.raises(OSError) as err:
        fstree.read_file(str(root), "filelink", max_bytes=100)
    assert err.value.errno == errno.ELOOP


def test_walk_bounds_are_reported(tmp_path):
    small_tree(tmp_path)
    tree = fstree.walk(str(tmp_path), max_entries=3)
    assert len(tree.entries) == 3 and tree.truncated and [why for _, why in tree.skipped] == ["max_entries reached"]
    tree = fstree.walk(str(tmp_path), max_depth=1)
    assert {e.path for e in tree.entries} == {"pkg", "top.sh", "empty"}
    assert tree.truncated and tree.skipped == [("pkg", "deeper than max_depth")]  # "empty" has nothing
    tree = fstree.walk(str(tmp_path), exclude=lambda e: e.name == "pkg")
    assert {e.path for e in tree.entries} == {"top.sh", "empty"} and not tree.truncated


def test_read_files_reasons(tmp_path):
    (tmp_path / "ok.txt").write_text("ok\n")
    (tmp_path / "big.txt").write_text("x" * 101)
    (tmp_path / "linked.txt").write_text("l\n")
    os.link(tmp_path / "linked.txt", tmp_path / "hard.txt")
    for i in range(3):
        (tmp_path / f"n{i}.txt").write_text(str(i))
    files, skipped = fstree.read_files(str(tmp_path), max_file_bytes=100, max_files=3)
    assert files == {"n0.txt": b"0", "n1.txt": b"1", "n2.txt": b"2"}
    assert dict(skipped) == {"big.txt": "too large", "hard.txt": "hard link", "linked.txt": "hard link",
                             "ok.txt": "too many files"}
    with pytest.raises(OSError):
        fstree.walk(str(tmp_path / "missing"))


# ----------------------------------------------------------------------------------------------
# deep trees


def test_deep_tree_defeats_the_standard_library(deep):
    root, _ = deep
    with pytest.raises(RecursionError):
        shutil.rmtree(str(root), ignore_errors=True)  # ignore_errors does not cover RecursionError
    listed = sum(len(dirs) + len(files) for _, dirs, files in os.walk(root))
    assert listed < DEPTH  # os.walk silently stops where the paths pass PATH_MAX


def test_deep_tree_walk_read_copy_remove(tmp_path, resolver):
    # The component-at-a-time resolver opens every level of every path it resolves (quadratic in
    # the depth): it gets a shallower tree whose path is as far past PATH_MAX, with longer names.
    depth, name = (DEPTH, NAME) if resolver else (300, "d" * 16)  # 5,500 and 5,100 bytes of path
    root = tmp_path / "deep"
    root.mkdir()
    leaf = make_deep(str(root), depth, name)
    assert len(leaf) > 4096
    tree = fstree.walk(str(root), max_entries=None)
    assert len(tree.entries) == depth + 1 and tree.entries[-1].path == leaf and not tree.skipped
    files, skipped = fstree.read_files(str(root))
    assert files == {leaf: b"leaf\n"} and not skipped
    assert fstree.read_file(str(root), leaf, max_bytes=10) == b"leaf\n"
    copy = tmp_path / "copy"
    try:
        done = fstree.copy(str(root), str(copy))
        assert done.entries == depth + 1 and not done.truncated
        assert fstree.read_file(str(copy), leaf, max_bytes=10) == b"leaf\n"
    finally:
        assert fstree.remove(str(copy)) == [] and not copy.exists()
    assert fstree.remove(str(root)) == [] and not root.exists()
    assert fstree.remove(str(root)) == []  # already gone: not an error


def test_remove_never_raises_and_opens_up_directories(tmp_path):
    """A tree with directories without any permission, removed by their owner (not root, which
    needs no permission: as root the test drops to nobody in a forked child)."""
    parent = tempfile.mkdtemp(prefix="rlcode-fstree-")  # reachable by nobody, unlike tmp_path
    os.chmod(parent, 0o777)
    root = os.path.join(parent, "locked")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os.makedirs(root + "/a/b")
            open(root + "/a/b/f", "w").close()
            open(root + "/a/g", "w").close()
            os.chmod(root + "/a/b", 0)
            os.chmod(root + "/a", 0o500)
            os.write(w, repr((fstree.remove(root), os.path.exists(root))).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = os.read(r, 4096)
    os.close(r)
    os.waitpid(pid, 0)
    fstree.remove(parent)
    assert out == b"([], False)"
    assert fstree.remove(str(tmp_path / "never-there")) == []
    assert fstree.remove("") != [] and fstree.remove("/") != []  # refused, not raised


# ----------------------------------------------------------------------------------------------
# copying and bringing changes back


def test_copy_keeps_modes_times_and_symlinks_but_no_set_id_bits(tmp_path, resolver):
    src = tmp_path / "src"
    src.mkdir()
    small_tree(src)
    os.symlink("pkg/a.py", src / "link")
    os.chmod(src / "pkg" / "a.py", 0o4755)  # setuid
    os.mkfifo(src / "fifo")
    os.utime(src / "pkg" / "a.py", ns=(1_000_000_000, 2_000_000_000))
    done = fstree.copy(str(src), str(tmp_path / "dst"))
    dst = tmp_path / "dst"
    assert done.skipped == [("fifo", "not a regular file, directory or symlink")] and not done.truncated
    st = os.stat(dst / "pkg" / "a.py")
    assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_mtime_ns == 2_000_000_000
    assert stat.S_IMODE(os.stat(dst / "top.sh").st_mode) == 0o755
    assert os.readlink(dst / "link") == "pkg/a.py" and (dst / "empty").is_dir()
    assert set(done.base) == {"", "pkg", "pkg/sub", "pkg/a.py", "pkg/sub/b.txt", "top.sh", "empty", "link"}
    small = fstree.copy(str(src), str(tmp_path / "small"), max_bytes=8)  # top.sh has 10 bytes
    assert small.truncated and ("top.sh", "max_bytes reached") in small.skipped and small.bytes <= 8


def test_sync_brings_back_changes_and_keeps_concurrent_host_changes(tmp_path, resolver):
    host = tmp_path / "host"
    host.mkdir()
    small_tree(host)
    (host / "gone.txt").write_text("gone\n")
    (host / "host-edits.txt").write_text("v1\n")
    (host / "to-dir").write_text("file\n")
    (host / "dir-to-file").mkdir()
    (host / "dir-to-file" / "x").write_text("x\n")
    copy = tmp_path / "copy"
    base = fstree.copy(str(host), str(copy)).base
    untouched_ino = os.stat(host / "pkg" / "a.py").st_ino
    # The program's changes in the copy.
    (copy / "pkg" / "sub" / "b.txt").write_text("b2\n")
    os.rename(copy / "pkg" / "sub", copy / "pkg" / "moved")
    (copy / "new" / "deeper").mkdir(parents=True)
    (copy / "new" / "deeper" / "n.txt").write_text("n\n")
    os.chmod(copy / "top.sh", 0o644)
    os.unlink(copy / "gone.txt")
    os.unlink(copy / "host-edits.txt")
    os.unlink(copy / "to-dir")
    (copy / "to-dir").mkdir()
    shutil.rmtree(copy / "dir-to-file")
    (copy / "dir-to-file").write_text("now a file\n")
    os.symlink("top.sh", copy / "newlink")
    os.chmod(copy / "pkg" / "a.py", 0o6777)
    # Meanwhile on the host: an edit of a file the copy deletes, and a new file.
    (host / "host-edits.txt").write_text("v2, longer\n")
    (host / "host-new.txt").write_text("h\n")
    done = fstree.sync(str(copy), str(host), base)
    assert not done.truncated and not done.skipped, done
    tree = {e.path: e for e in fstree.walk(str(host)).entries}
    assert set(tree) == {"pkg", "pkg/a.py", "pkg/moved", "pkg/moved/b.txt", "top.sh", "empty", "new",
                         "new/deeper", "new/deeper/n.txt", "host-edits.txt", "host-new.txt", "to-dir",
                         "dir-to-file", "newlink"}
    assert (host / "pkg" / "moved" / "b.txt").read_text() == "b2\n"
    assert (host / "host-edits.txt").read_text() == "v2, longer\n" and done.kept == ["host-edits.txt"]
    assert tree["to-dir"].kind == "dir" and (host / "dir-to-file").read_text() == "now a file\n"
    assert os.readlink(host / "newlink") == "top.sh"
    assert stat.S_IMODE(tree["top.sh"].stat.st_mode) == 0o644
    assert stat.S_IMODE(tree["pkg/a.py"].stat.st_mode) == 0o777  # no set-ID bits on the host
    assert os.stat(host / "pkg" / "a.py").st_ino != untouched_ino  # rewritten (its mode changed)
    assert not [n for n in os.listdir(host) if n.startswith(".rlcode-sync-")]
    unchanged = fstree.copy(str(host), str(tmp_path / "copy2")).base
    again = fstree.sync(str(tmp_path / "copy2"), str(host), unchanged)
    assert not again.written and not again.removed  # an unchanged copy writes nothing


def test_sync_never_writes_through_a_host_symlink(tmp_path):
    host, outside = tmp_path / "host", tmp_path / "outside"
    (host / "d").mkdir(parents=True)
    outside.mkdir()
    copy = tmp_path / "copy"
    base = fstree.copy(str(host), str(copy)).base
    (copy / "d" / "f.txt").write_text("payload\n")
    shutil.rmtree(host / "d")
    os.symlink(str(outside), host / "d")  # swapped in on the host while the copy ran
    done = fstree.sync(str(copy), str(host), base)
    assert os.listdir(outside) == [] and [p for p, _ in done.skipped] == ["d/f.txt"]


def test_write_files_refuses_symlinks_and_escapes(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(str(outside), root / "link")
    fstree.write_files(str(root), {"a/b/c.txt": "c", "run.sh": "#!/bin/sh\n", "bin.dat": b"\x00\x01"},
                       scripts_executable=True)
    assert (root / "a" / "b" / "c.txt").read_text() == "c" and (root / "bin.dat").read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(os.stat(root / "run.sh").st_mode) == 0o755
    with pytest.raises(OSError):
        fstree.write_files(str(root), {"link/x.txt": "x"})
    for bad in ("../x", "/etc/x", ""):
        with pytest.raises(ValueError):
            fstree.write_files(str(root), {bad: "x"})
    assert os.listdir(outside) == []
