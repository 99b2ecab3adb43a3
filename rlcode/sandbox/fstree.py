"""Bounded, non-recursive, descriptor-relative operations on trees an untrusted program wrote.

A working copy comes back from the candidate's program and may hold anything a program can make:
symlinks pointing anywhere (or swapped in while we look), FIFOs, directories without
permissions, hundreds of thousands of entries, and trees thousands of levels deep whose absolute
paths are longer than PATH_MAX. Python 3.11's `os.walk`, `os.fwalk` and `shutil.rmtree` recurse
(RecursionError near 1000 levels), `os.fwalk` also holds one descriptor per level, and path-based
calls fail past PATH_MAX. Every function here instead

* never follows a symlink: a directory is opened relative to the tree's root descriptor with
  openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), or, where the kernel lacks openat2, one
  component at a time with O_NOFOLLOW; a symlink where a directory is expected makes that one
  entry fail, it is never entered. Paths longer than PATH_MAX are opened in chunks;
* uses an explicit stack and holds a few descriptors at a time, whatever the depth;
* is bounded where it reads (`max_entries`, `max_depth`, `max_bytes`) and says what it left out;
* reports failures inside the tree as data (`skipped`, `errors`); only a root that cannot be
  opened raises (OSError), and `remove` never raises.

    walk(root, max_entries=, max_depth=, exclude=)        -> Walk(entries, skipped, truncated)
    read_files(root, max_file_bytes=, max_files=, ...)    -> ({path: bytes}, [(path, reason)])
    read_file(root, path, max_bytes=)                     -> bytes
    write_files(root, {path: content}, uid=, gid=)       -> None
    copy(src, dst, uid=, gid=, max_entries=, max_bytes=)  -> Copy(entries, bytes, skipped, base)
    sync(src, dst, base, uid=, gid=)                      -> Sync(written, removed, skipped, ...)
    remove(path)                                          -> [error, ...]  (empty: all gone)

`root`, `src` and `dst` are a path (relative to `dir_fd` when given) or an open directory
descriptor (left open). Relative paths in results use "/" and never start with it. Modes are
copied without the set-user-ID, set-group-ID and sticky bits, and always with the owner's read
and write (and, for directories, search) bits, so that the trusted side can always read, walk and
delete what a program left behind.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import stat
from collections.abc import Callable

from rlcode.sandbox import _linux as L

FILE, DIR, SYMLINK, OTHER = "file", "dir", "symlink", "other"
DEFAULT_MAX_ENTRIES = 100_000
_CHUNK = 3000  # bytes of a relative path opened in one openat2 call (PATH_MAX is 4096)
_RESOLVE = L.RESOLVE_BENEATH | L.RESOLVE_NO_SYMLINKS | L.RESOLVE_NO_MAGICLINKS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_openat2_ok = True


def kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISLNK(mode):
        return SYMLINK
    return OTHER


def safe_mode(mode: int, kind: str) -> int:
    """Permission bits as copied: no setuid/setgid/sticky, owner always rw (rwx for a dir)."""
    return (stat.S_IMODE(mode) & 0o777) | (0o700 if kind == DIR else 0o600)


def _split(rel: str) -> tuple[str, str]:
    head, _, tail = rel.rpartition("/")
    return head, tail


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _open_stepwise(dir_fd: int, rel: bytes, flags: int) -> int:
    parts = rel.split(b"/")
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def _open_one(dir_fd: int, rel: bytes, flags: int) -> int:
    global _openat2_ok
    if _openat2_ok:
        try:
            return L.openat2(dir_fd, rel, flags, _RESOLVE)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM):
                raise
        fd = _open_stepwise(dir_fd, rel, flags)
        _openat2_ok = False  # openat2 is missing or filtered here; the stepwise open worked
        return fd
    return _open_stepwise(dir_fd, rel, flags)


def open_beneath(root_fd: int, rel: str, flags: int = _DIR_FLAGS) -> int:
    """Open `rel` below the directory `root_fd` (no "..", no absolute path, no symlink on the
    way or at the end); "" opens the root itself. Raises OSError (ELOOP for a symlink)."""
    if not rel:
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=root_fd)
    raw = os.fsencode(rel)
    framed = b"/" + raw + b"/"
    if b"//" in framed or b"/./" in framed or b"/../" in framed:
        raise OSError(errno.EINVAL, f"not a plain relative path: {rel[:200]!r}")
    fd = None
    try:
        while len(raw) > _CHUNK:  # past PATH_MAX: a directory at a time, a chunk of path each
            cut = raw.rfind(b"/", 0, _CHUNK)
            if cut <= 0:
                cut = raw.find(b"/")
                if cut <= 0:
                    break
            nxt = _open_one(root_fd if fd is None else fd, raw[:cut], os.O_PATH | os.O_DIRECTORY)
            if fd is not None:
                os.close(fd)
            fd, raw = nxt, raw[cut + 1:]
        return _open_one(root_fd if fd is None else fd, raw, flags)
    finally:
        if fd is not None:
            os.close(fd)


def _open_root(root, dir_fd: int | None) -> tuple[int, bool]:
    """(descriptor of the root directory, whether we opened it)."""
    if isinstance(root, int):
        return root, False
    return os.open(os.fspath(root), _DIR_FLAGS, dir_fd=dir_fd), True


def _listdir(fd: int, budget: int | None) -> tuple[list[tuple[str, os.stat_result]], bool, list[str]]:
    """Up to `budget` entries of the directory `fd` as (name, lstat), sorted by name; whether
    more were there; names that vanished or could not be stat'ed."""
    out, lost, more = [], [], False
    with os.scandir(fd) as it:
        for de in it:
            if budget is not None and len(out) >= budget:
                more = True
                break
            try:
                out.append((de.name, de.stat(follow_symlinks=False)))
            except OSError:
                lost.append(de.name)
    out.sort(key=lambda e: e[0])
    return out, more, lost


def _is_empty(root_fd: int, rel: str) -> bool:
    try:
        fd = open_beneath(root_fd, rel)
    except OSError:
        return True
    try:
        with os.scandir(fd) as it:
            return next(iter(it), None) is None
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# walking and reading


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a tree: its relative path, kind (file, dir, symlink, other) and lstat."""

    path: str
    kind: str
    stat: os.stat_result

    @property
    def name(self) -> str:
        return _split(self.path)[1]

    @property
    def depth(self) -> int:
        return self.path.count("/") + 1


@dataclasses.dataclass
class Walk:
    """entries: parents before children, siblings by name. skipped: (path, reason) of what was
    not listed or not entered. truncated: `max_entries` or `max_depth` cut something off."""

    entries: list[Entry]
    skipped: list[tuple[str, str]]
    truncated: bool


def walk(root, *, max_entries: int | None = DEFAULT_MAX_ENTRIES, max_depth: int | None = None,
         exclude: Callable[[Entry], bool] | None = None, dir_fd: int | None = None) -> Walk:
    """Every entry below `root` (not the root itself), without following symlinks.

    max_entries: stop after this many entries. max_depth: list entries down to this depth (1 =
    the root's children) and enter no directory below. exclude(entry) -> True leaves an entry
    out (a directory is then not entered either) and does not count it.
    Raises OSError only when `root` is not an openable directory.
    """
    rfd, owned = _open_root(root, dir_fd)
    entries: list[Entry] = []
    skipped: list[tuple[str, str]] = []
    truncated = False
    try:
        stack = [""]
        while stack:
            rel = stack.pop()
            try:
                fd = open_beneath(rfd, rel)
            except OSError as e:
                skipped.append((rel or ".", f"cannot open: {e.strerror}"))
                continue
            try:
                # With `exclude`, excluded entries do not count: list up to max_entries per directory.
                budget = None if max_entries is None else max_entries - (0 if exclude else len(entries))
                listing, more, lost = _listdir(fd, budget)
            except OSError as e:
                skipped.append((rel or ".", f"cannot list: {e.strerror}"))
                continue
            finally:
                os.close(fd)
            skipped += [(_join(rel, n), "vanished while listed") for n in lost]
            depth = rel.count("/") + 2 if rel else 1
            subdirs = []
            for name, st in listing:
                entry = Entry(_join(rel, name), kind_of(st.st_mode), st)
                if exclude is not None and exclude(entry):
                    continue
                if max_entries is not None and len(entries) >= max_entries:
                    more = True
                    break
                entries.append(entry)
                if entry.kind == DIR:
                    if max_depth is not None and depth >= max_depth:
                        if not _is_empty(rfd, entry.path):
                            truncated = True
                            skipped.append((entry.path, "deeper than max_depth"))
                    else:
                        subdirs.append(entry.path)
            if more:
                truncated = True
                skipped.append((rel or ".", "max_entries reached"))
                break
            stack.extend(reversed(subdirs))
    finally:
        if owned:
            os.close(rfd)
    return Walk(entries, skipped, truncated)


def _read_fd(fd: int, limit: int) -> bytes | None:
    """The content of `fd`, or None if it has more than `limit` bytes."""
    chunks, size = [], 0
    while size <= limit:
        chunk = os.read(fd, min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return None if size > limit else b"".join(chunks)


def read_file(root, path: str, *, max_bytes: int, dir_fd: int | None = None) -> bytes:
    """The content of the regular file `path` below `root`, never through a symlink. Raises
    OSError (ELOOP: a symlink; EFBIG: larger than max_bytes; EINVAL: not a regular file)."""
    rfd, owned = _open_root(root, dir_fd)
    try:
        fd = open_beneath(rfd, path, os.O_RDONLY | os.O_NONBLOCK)
    finally:
        if owned:
            os.close(rfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path!r} is not a regular file")
        data = _read_fd(fd, max_bytes)
        if data is None:
            raise OSError(errno.EFBIG, f"{path!r} has more than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)


def read_files(root, *, max_file_bytes: int = 1_000_000, max_files: int = 2000,
               max_entries: int | None = DEFAULT_MAX_ENTRIES, max_depth: int | None = None,
               exclude: Callable[[Entry], bool] | None = None,
               dir_fd: int | None = None) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """The regular files below `root` (relative path -> bytes) and what was not read, as
    (path, reason): "symlink", "not a regular file", "hard link", "too large", "too many
    files", "unreadable: ...", and the walk's own (`walk`). A file is read only if it is still,
    once opened, the regular single-link file the walk saw. Raises OSError only when `root` is
    not an openable directory."""
    rfd, owned = _open_root(root, dir_fd)
    try:
        tree = walk(rfd, max_entries=max_entries, max_depth=max_depth, exclude=exclude)
        files: dict[str, bytes] = {}
        skipped = list(tree.skipped)
        for e in tree.entries:
            if e.kind == DIR:
                continue
            if e.kind != FILE:
                skipped.append((e.path, "symlink" if e.kind == SYMLINK else "not a regular file"))
                continue
            if len(files) >= max_files:
                skipped.append((e.path, "too many files"))
                continue
            if e.stat.st_nlink > 1:
                skipped.append((e.path, "hard link"))
                continue
            if e.stat.st_size > max_file_bytes:
                skipped.append((e.path, "too large"))
                continue
            try:
                fd = open_beneath(rfd, e.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as err:
                skipped.append((e.path, f"unreadable: {err.strerror}"))
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (e.stat.st_dev, e.stat.st_ino):
                    skipped.append((e.path, "changed while read"))
                    continue
                if st.st_nlink > 1:
                    skipped.append((e.path, "hard link"))
                    continue
                data = _read_fd(fd, max_file_bytes)
            except OSError as err:
                skipped.append((e.path, f"unreadable: {err.strerror}"))
                continue
            finally:
                os.close(fd)
            if data is None:
                skipped.append((e.path, "too large"))
            else:
                files[e.path] = data
        return files, skipped
    finally:
        if owned:
            os.close(rfd)


# ----------------------------------------------------------------------------------------------
# writing


def write_files(root, files, *, uid: int | None = None, gid: int | None = None,
                scripts_executable: bool = False, dir_fd: int | None = None) -> None:
    """Write `files` ({relative path: str (as UTF-8) | bytes}) below the directory `root`,
    making parent directories (0o755) and replacing files' content (new ones 0o644, or 0o755
    for a script starting with "#!" when `scripts_executable`); never through a symlink: one in
    the way fails the write with OSError. uid/gid: owner of what is created (default: ours).
    Raises ValueError for a path that is absolute or leaves the root."""
    rfd, owned = _open_root(root, dir_fd)
    try:
        for rel, content in files.items():
            norm = os.path.normpath(rel) if isinstance(rel, str) and rel else ""
            if not norm or os.path.isabs(rel) or norm in (".", "..") or norm.startswith("../") or "\0" in rel:
                raise ValueError(f"file path must be relative and stay inside the root: {rel!r}")
            data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
            parent, name = _split(norm)
            fd = os.open(".", _DIR_FLAGS, dir_fd=rfd)
            try:
                for part in parent.split("/") if parent else ():
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        _chown(uid, gid, name=part, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = nxt
                mode = 0o755 if scripts_executable and data.startswith(b"#!") else 0o644
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                              mode, dir_fd=fd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view):]
                    _chown(uid, gid, fd=out)
                finally:
                    os.close(out)
            finally:
                os.close(fd)
    finally:
        if owned:
            os.close(rfd)


# ----------------------------------------------------------------------------------------------
# copying


@dataclasses.dataclass(frozen=True)
class Copied:
    """What `copy` recorded of one entry: its kind, its identity in the source when copied
    (device, inode, mtime, size; directories: device, inode) and the copy's identity right
    after copying (inode and ctime, which no program can set back; directories: inode, mode)."""

    kind: str
    origin: tuple
    copy: tuple


@dataclasses.dataclass
class Copy:
    """entries, bytes: what was copied. skipped: (path, reason). truncated: a bound was hit.
    base: relative path -> `Copied` of every copied entry ("" is the root), for `sync`."""

    entries: int = 0
    bytes: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    truncated: bool = False
    base: dict[str, Copied] = dataclasses.field(default_factory=dict)


def _origin(st: os.stat_result, kind: str) -> tuple:
    if kind == DIR:
        return (st.st_dev, st.st_ino)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _copy_data(src_fd: int, dst_fd: int, limit: int) -> int:
    """Copy at most `limit` bytes from src_fd to dst_fd; returns how many were copied, or
    limit + 1 if the source had more."""
    done = 0
    while done <= limit:
        try:
            n = os.sendfile(dst_fd, src_fd, None, min(1 << 24, limit + 1 - done))
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            data = os.read(src_fd, min(1 << 20, limit + 1 - done))
            n = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst_fd, view):]
        if n == 0:
            break
        done += n
    return done


def _chown(uid, gid, fd: int | None = None, name: str | None = None, dir_fd: int | None = None) -> None:
    if uid is None:
        return
    try:
        if fd is not None:
            os.fchown(fd, uid, -1 if gid is None else gid)
        else:
            os.chown(name, uid, -1 if gid is None else gid, dir_fd=dir_fd, follow_symlinks=False)
    except PermissionError:
        pass  # an owner we may not give files to (unmapped in our user namespace): keep ours
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def _write_file(src_fd: int, dst_dir: int, name: str, st: os.stat_result, limit: int, uid, gid) -> tuple[int, tuple]:
    """Create `name` in dst_dir with the content of src_fd (at most `limit` bytes), the mode and
    times of `st`; returns (bytes written, copy identity). Raises OSError; EFBIG past `limit`."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_dir)
    try:
        n = _copy_data(src_fd, out, limit)
        if n > limit:
            raise OSError(errno.EFBIG, "byte limit reached")
        _chown(uid, gid, fd=out)
        os.fchmod(out, safe_mode(st.st_mode, FILE))
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        cst = os.fstat(out)
        return n, (cst.st_ino, cst.st_ctime_ns)
    except BaseException:
        os.close(out)
        out = None
        try:
            os.unlink(name, dir_fd=dst_dir)
        except OSError:
            pass
        raise
    finally:
        if out is not None:
            os.close(out)


def _write_symlink(target, dst_dir: int, name: str, st: os.stat_result, uid, gid) -> tuple:
    os.symlink(target, name, dir_fd=dst_dir)
    _chown(uid, gid, name=name, dir_fd=dst_dir)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst_dir, follow_symlinks=False)
    cst = os.stat(name, dir_fd=dst_dir, follow_symlinks=False)
    return (cst.st_ino, cst.st_ctime_ns)


def _finish_dirs(root_fd: int, dirs: list[tuple[str, os.stat_result]], base: dict | None) -> None:
    """Modes and times of copied directories, deepest first (a read-only directory can only be
    finished once everything inside exists)."""
    for rel, st in reversed(dirs):
        fd = open_beneath(root_fd, rel)
        try:
            os.fchmod(fd, safe_mode(st.st_mode, DIR))
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            if base is not None:
                cst = os.fstat(fd)
                base[rel] = Copied(DIR, _origin(st, DIR), (cst.st_ino, stat.S_IMODE(cst.st_mode)))
        finally:
            os.close(fd)


def copy(src, dst, *, uid: int | None = None, gid: int | None = None,
         max_entries: int | None = DEFAULT_MAX_ENTRIES, max_bytes: int | None = None,
         max_depth: int | None = None, exclude: Callable[[Entry], bool] | None = None,
         src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> Copy:
    """Copy the tree `src` into the empty (or missing: it is created) directory `dst`.

    Directories, regular files (content, mode, times) and symlinks (as symlinks) are copied;
    other kinds are skipped. uid/gid: owner of everything created (default: ours), the root
    included. max_entries / max_bytes (sum of file sizes) / max_depth: stop there, `truncated`.
    Read failures in `src` are skipped entries; write failures in `dst` (ENOSPC, EDQUOT, ...)
    raise OSError, leaving a partial copy. The result's `base` is what `sync` needs.
    """
    sfd, s_owned = _open_root(src, src_dir_fd)
    dfd = d_owned = None
    try:
        if isinstance(dst, int):
            dfd, d_owned = dst, False
        else:
            try:
                os.mkdir(os.fspath(dst), 0o700, dir_fd=dst_dir_fd)
            except FileExistsError:
                pass
            dfd, d_owned = _open_root(dst, dst_dir_fd)
        result = Copy()
        root_st = os.fstat(sfd)
        _chown(uid, gid, fd=dfd)
        dirs = [("", root_st)]
        limit = None if max_bytes is None else max_bytes
        tree = walk(sfd, max_entries=max_entries, max_depth=max_depth, exclude=exclude)
        result.skipped += tree.skipped
        result.truncated = tree.truncated
        current: tuple[str, int, int] | None = None  # (rel, src fd, dst fd) of the open directory
        try:
            for e in tree.entries:
                parent, name = _split(e.path)
                if current is None or current[0] != parent:
                    if current is not None:
                        os.close(current[1])
                        os.close(current[2])
                        current = None
                    try:
                        s_dir = open_beneath(sfd, parent)
                    except OSError as err:
                        result.skipped.append((e.path, f"cannot open its directory: {err.strerror}"))
                        continue
                    try:
                        d_dir = open_beneath(dfd, parent)
                    except BaseException:
                        os.close(s_dir)
                        raise
                    current = (parent, s_dir, d_dir)
                _, s_dir, d_dir = current
                if e.kind == DIR:
                    os.mkdir(name, 0o700, dir_fd=d_dir)
                    _chown(uid, gid, name=name, dir_fd=d_dir)
                    dirs.append((e.path, e.stat))
                elif e.kind == SYMLINK:
                    try:
                        target = os.readlink(name, dir_fd=s_dir)
                    except OSError as err:
                        result.skipped.append((e.path, f"unreadable: {err.strerror}"))
                        continue
                    result.base[e.path] = Copied(SYMLINK, _origin(e.stat, SYMLINK),
                                                 _write_symlink(target, d_dir, name, e.stat, uid, gid))
                elif e.kind == FILE:
                    if limit is not None and result.bytes + e.stat.st_size > limit:
                        result.truncated = True
                        result.skipped.append((e.path, "max_bytes reached"))
                        break
                    try:
                        in_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                        dir_fd=s_dir)
                    except OSError as err:
                        result.skipped.append((e.path, f"unreadable: {err.strerror}"))
                        continue
                    try:
                        st = os.fstat(in_fd)
                        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (e.stat.st_dev, e.stat.st_ino):
                            result.skipped.append((e.path, "changed while copied"))
                            continue
                        room = (1 << 62) if limit is None else limit - result.bytes
                        try:
                            n, ident = _write_file(in_fd, d_dir, name, st, room, uid, gid)
                        except OSError as err:
                            if err.errno != errno.EFBIG or limit is None:
                                raise
                            result.truncated = True
                            result.skipped.append((e.path, "max_bytes reached"))
                            break
                    finally:
                        os.close(in_fd)
                    result.bytes += n
                    result.base[e.path] = Copied(FILE, _origin(st, FILE), ident)
                else:
                    result.skipped.append((e.path, "not a regular file, directory or symlink"))
                    continue
                result.entries += 1
        finally:
            if current is not None:
                os.close(current[1])
                os.close(current[2])
        _finish_dirs(dfd, dirs, result.base)
        return result
    finally:
        if s_owned:
            os.close(sfd)
        if d_owned:
            os.close(dfd)


# ----------------------------------------------------------------------------------------------
# bringing a copy's changes back


@dataclasses.dataclass
class Sync:
    """written / removed: relative paths created or replaced in / removed from the destination.
    kept: paths the copy removed but the destination had changed meanwhile (left alone).
    skipped: (path, reason) not brought back. truncated: a bound was hit (then nothing is
    removed: what was not seen cannot be told from what was deleted)."""

    written: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    truncated: bool = False
    bytes: int = 0


def _clear_slot(dir_fd: int, name: str, keep_dir: bool) -> bool:
    """Make room for a new entry `name` in dir_fd; True if a directory is there and was kept."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if keep_dir:
            return True
        errors = remove(name, dir_fd=dir_fd)
        if errors:
            raise OSError(errno.ENOTEMPTY, f"cannot replace directory {name!r}: {errors[0]}")
        return False
    if not keep_dir:
        return False  # a file or symlink is replaced atomically by rename
    os.unlink(name, dir_fd=dir_fd)
    return False


def sync(src, dst, base: dict[str, Copied], *, uid: int | None = None, gid: int | None = None,
         max_entries: int | None = DEFAULT_MAX_ENTRIES, max_bytes: int | None = None,
         max_depth: int | None = None, src_dir_fd: int | None = None,
         dst_dir_fd: int | None = None) -> Sync:
    """Bring into `dst` what changed in its copy `src` since `copy(dst, src)` returned `base`.

    Entries new or modified in `src` (a different inode or ctime than right after the copy) are
    written to `dst` (a file or symlink through a temporary name renamed over the old one;
    uid/gid own what is created); entries gone from `src` are removed from `dst` unless `dst`
    changed them meanwhile; entries of `dst` that `base` does not know (added there meanwhile)
    are left alone. Kinds other than file, directory and symlink are not brought back. `src` must
    not change during the call. Failures are recorded in `skipped`; raises OSError only when a
    root cannot be opened.
    """
    sfd, s_owned = _open_root(src, src_dir_fd)
    dfd, d_owned = None, False
    result = Sync()
    try:
        dfd, d_owned = _open_root(dst, dst_dir_fd)
        tree = walk(sfd, max_entries=max_entries, max_depth=max_depth)
        result.truncated = tree.truncated
        result.skipped += tree.skipped
        unsure = [p for p, _ in tree.skipped]
        present: set[str] = set()
        dirs: list[tuple[str, os.stat_result]] = []
        failed: list[str] = []  # directories not brought back: nothing below them is either
        root_st = os.fstat(sfd)
        root_base = base.get("")
        if root_base is not None and stat.S_IMODE(root_st.st_mode) != root_base.copy[1]:
            os.fchmod(dfd, safe_mode(root_st.st_mode, DIR))
        for e in tree.entries:
            if e.kind == OTHER:
                result.skipped.append((e.path, "not a regular file, directory or symlink"))
                continue
            present.add(e.path)
            if any(e.path.startswith(f + "/") for f in failed):
                continue
            b = base.get(e.path)
            if b is not None and b.kind == e.kind:
                if e.kind == DIR and b.copy == (e.stat.st_ino, stat.S_IMODE(e.stat.st_mode)):
                    continue
                if e.kind != DIR and b.copy == (e.stat.st_ino, e.stat.st_ctime_ns):
                    continue
            parent, name = _split(e.path)
            try:
                pfd = open_beneath(dfd, parent)
            except OSError as err:
                result.skipped.append((e.path, f"cannot open its directory: {err.strerror}"))
                if e.kind == DIR:
                    failed.append(e.path)
                continue
            try:
                if e.kind == DIR:
                    if not _clear_slot(pfd, name, keep_dir=True):
                        os.mkdir(name, 0o700, dir_fd=pfd)
                        _chown(uid, gid, name=name, dir_fd=pfd)
                    dirs.append((e.path, e.stat))
                    result.written.append(e.path)
                    continue
                tmp = f".rlcode-sync-{secrets.token_hex(8)}"
                if e.kind == SYMLINK:
                    s_dir = open_beneath(sfd, parent)
                    try:
                        target = os.readlink(name, dir_fd=s_dir)
                    finally:
                        os.close(s_dir)
                    _write_symlink(target, pfd, tmp, e.stat, uid, gid)
                else:
                    room = (1 << 62) if max_bytes is None else max_bytes - result.bytes
                    in_fd = open_beneath(sfd, e.path, os.O_RDONLY | os.O_NONBLOCK)
                    try:
                        try:
                            n, _ = _write_file(in_fd, pfd, tmp, os.fstat(in_fd), room, uid, gid)
                        except OSError as err:
                            if err.errno == errno.EFBIG and max_bytes is not None:
                                result.truncated = True
                                result.skipped.append((e.path, "max_bytes reached"))
                                continue
                            raise
                    finally:
                        os.close(in_fd)
                    result.bytes += n
                try:
                    _clear_slot(pfd, name, keep_dir=False)
                    os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=pfd)
                    except OSError:
                        pass
                    raise
                result.written.append(e.path)
            except OSError as err:
                result.skipped.append((e.path, f"not written: {err.strerror or err}"))
                if e.kind == DIR:
                    failed.append(e.path)
            finally:
                os.close(pfd)
        for rel, st in reversed(dirs):
            try:
                fd = open_beneath(dfd, rel)
                try:
                    os.fchmod(fd, safe_mode(st.st_mode, DIR))
                    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(fd)
            except OSError as err:
                result.skipped.append((rel, f"mode not set: {err.strerror}"))
        if not result.truncated:
            _remove_gone(dfd, base, present, unsure, result)
        return result
    finally:
        if s_owned:
            os.close(sfd)
        if d_owned:
            os.close(dfd)


def _remove_gone(dfd: int, base: dict[str, Copied], present: set[str], unsure: list[str], result: Sync) -> None:
    gone = [rel for rel in base if rel and rel not in present
            and not any(rel == u or rel.startswith(u + "/") for u in unsure)]
    for rel in sorted(gone, key=lambda r: (-r.count("/"), r)):  # deepest first
        b = base[rel]
        parent, name = _split(rel)
        try:
            pfd = open_beneath(dfd, parent)
        except OSError:
            continue  # its directory is gone or replaced: so is the entry
        try:
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            kind = kind_of(st.st_mode)
            if kind != b.kind or _origin(st, kind) != b.origin:
                result.kept.append(rel)
                continue
            try:
                if kind == DIR:
                    os.rmdir(name, dir_fd=pfd)
                else:
                    os.unlink(name, dir_fd=pfd)
                result.removed.append(rel)
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    result.kept.append(rel)  # something was added to it meanwhile
                else:
                    result.skipped.append((rel, f"not removed: {err.strerror}"))
        finally:
            os.close(pfd)


# ----------------------------------------------------------------------------------------------
# removing


def _chmod_dir(parent_fd: int, name: str) -> None:
    """Give a directory we own its owner's rwx bits, without following a symlink."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def remove(path, *, dir_fd: int | None = None) -> list[str]:
    """Remove `path` (a file, symlink or whole tree, never following a symlink) however deep
    or wide it is; a directory without permissions that we own is opened up first. Returns the
    errors (empty: `path` is gone or was never there); never raises."""
    errors: list[str] = []
    try:
        path = os.fspath(path)
        head, name = os.path.split(path.rstrip("/") or "/")
        if name in ("", ".", ".."):
            return [f"refusing to remove {path!r}"]
        pfd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return []
    except (OSError, TypeError, ValueError) as e:
        return [f"{path!r}: {e}"]
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return []
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=pfd)
            return []
        _remove_tree(pfd, name, errors)
    except OSError as e:
        errors.append(f"{path!r}: {e.strerror or e}")
    except Exception as e:  # noqa: BLE001 - callers clean up after untrusted code: never raise
        errors.append(f"{path!r}: {type(e).__name__}: {e}")
    finally:
        os.close(pfd)
    return errors


def _open_dir_for_removal(root_fd: int, rel: str) -> int:
    try:
        return open_beneath(root_fd, rel)
    except PermissionError:
        parent, name = _split(rel)
        pfd = open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
        try:
            _chmod_dir(pfd, name)
        finally:
            os.close(pfd)
        return open_beneath(root_fd, rel)


def _remove_tree(parent_fd: int, name: str, errors: list[str]) -> None:
    try:
        root = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        _chmod_dir(parent_fd, name)
        root = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)

    def rmdir(rel: str) -> None:
        if not rel:
            os.rmdir(name, dir_fd=parent_fd)
            return
        head, tail = _split(rel)
        pfd = open_beneath(root, head)
        try:
            os.rmdir(tail, dir_fd=pfd)
        finally:
            os.close(pfd)

    try:
        # (directory, emptied already, attempts): a directory is removed once everything pushed
        # after it (its subdirectories) is gone; one that gained entries meanwhile is emptied again.
        stack: list[tuple[str, bool, int]] = [("", False, 0)]
        while stack:
            rel, emptied, tries = stack.pop()
            if emptied:
                try:
                    rmdir(rel)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno == errno.ENOTEMPTY and tries < 3:
                        stack.append((rel, False, tries + 1))
                    else:
                        errors.append(f"{rel or name}: {e.strerror}")
                continue
            try:
                fd = _open_dir_for_removal(root, rel)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    errors.append(f"{rel or name}: {e.strerror}")
                continue
            stack.append((rel, True, tries))
            try:
                opened_up = False
                with os.scandir(fd) as it:
                    for de in it:
                        try:
                            is_dir = de.is_dir(follow_symlinks=False)
                        except OSError:
                            is_dir = False
                        if is_dir:
                            stack.append((_join(rel, de.name), False, 0))
                            continue
                        try:
                            os.unlink(de.name, dir_fd=fd)
                        except FileNotFoundError:
                            pass
                        except PermissionError:
                            if opened_up:
                                raise
                            os.fchmod(fd, 0o700)
                            opened_up = True
                            os.unlink(de.name, dir_fd=fd)
            except OSError as e:
                errors.append(f"{rel or name}: {e.strerror}")
            finally:
                os.close(fd)
    finally:
        os.close(root)
