"""Thin ctypes wrappers over the Linux system calls the sandbox needs (x86-64 and arm64).

Python 3.11 has no `os.unshare`/`os.setns`/`mount`/`capset`; these wrappers raise `OSError`
with the kernel's errno like the `os` functions do. Only standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# Resolved now, in the long-lived process: a forked child (where the sandbox makes most of these
# calls) then finds them cached instead of paying dlsym and a new function object per process.
for _name in ("mount", "umount2", "syscall", "prctl", "unshare", "setns", "sethostname"):
    getattr(_libc, _name)
del _name

# clone(2) / unshare(2) flags.
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags.
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

# mount_setattr(2).
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
AT_FDCWD = -100
AT_RECURSIVE = 0x8000

# prctl(2).
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_CAPBSET_DROP = 24
PR_GET_SECUREBITS = 27
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# securebits (capability(7)): each bit and its "_LOCKED" twin (bit + 1).
SECBIT_NOROOT = 1 << 0
SECBIT_NOROOT_LOCKED = 1 << 1
SECBIT_NO_SETUID_FIXUP = 1 << 2
SECBIT_NO_SETUID_FIXUP_LOCKED = 1 << 3
SECBIT_KEEP_CAPS_LOCKED = 1 << 5
SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 1 << 7

# keyctl(2).
KEYCTL_JOIN_SESSION_KEYRING = 1

_SYSCALLS = {
    # name: (x86_64, aarch64)
    "mount_setattr": (442, 442),
    "capset": (126, 91),
    "keyctl": (250, 219),
    "seccomp": (317, 277),
    "openat2": (437, 437),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
}
_ARCH_INDEX = 1 if platform.machine() in ("aarch64", "arm64") else 0


def _check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {source!r} on {target!r}")


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(os.fsencode(target), ctypes.c_int(flags)), f"umount {target!r}")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def mount_setattr(path: str, attr_set: int, attr_clr: int = 0, recursive: bool = False) -> None:
    """Change per-mount flags of the mount at `path` (and every mount below it if recursive)."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    nr = _SYSCALLS["mount_setattr"][_ARCH_INDEX]
    flags = AT_RECURSIVE if recursive else 0
    ret = _libc.syscall(
        ctypes.c_long(nr), ctypes.c_int(AT_FDCWD), os.fsencode(path), ctypes.c_uint(flags),
        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, f"mount_setattr {path!r}")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                              ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def syscall(name: str, *args) -> int:
    """A raw system call of `_SYSCALLS` by name; `args` must already be ctypes values."""
    return _check(_libc.syscall(ctypes.c_long(_SYSCALLS[name][_ARCH_INDEX]), *args), name)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


# Built once here: creating ctypes types and objects in every forked program costs more than the
# system call itself.
_CAP_HEADER = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
_CAP_EMPTY = (_CapData * 2)()
_CAPSET = (ctypes.c_long(_SYSCALLS["capset"][_ARCH_INDEX]), ctypes.byref(_CAP_HEADER), ctypes.byref(_CAP_EMPTY))


def _cap_last_cap() -> int | None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


CAP_LAST_CAP = _cap_last_cap()  # the highest capability number this kernel knows


def clear_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets of this thread (capset(2), 64-bit
    version 3 layout: two 32-bit words per set). Always allowed: it only drops."""
    _CAP_HEADER.version, _CAP_HEADER.pid = _LINUX_CAPABILITY_VERSION_3, 0  # the kernel may rewrite it
    _check(_libc.syscall(*_CAPSET), "capset")


def drop_bounding_set() -> int:
    """Remove every capability from the bounding set (needs CAP_SETPCAP in the current user
    namespace); returns how many were dropped: up to /proc/sys/kernel/cap_last_cap as read when
    this module was imported, then on until the first number the kernel does not know (EINVAL),
    so no table can go stale."""
    cap = 0
    if CAP_LAST_CAP is not None:
        for cap in range(CAP_LAST_CAP + 1):
            prctl(PR_CAPBSET_DROP, cap)
        cap = CAP_LAST_CAP + 1
    while cap < 64:
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno == errno.EINVAL:
                break
            raise
        cap += 1
    return cap


def join_session_keyring() -> int:
    """Replace this process's session keyring by a new anonymous one (inherited by its children
    from now on); returns its serial."""
    return syscall("keyctl", ctypes.c_int(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None))


# openat2(2) resolve flags.
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str | bytes, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2) (Linux >= 5.6): like `os.open(path, flags, mode, dir_fd=dir_fd)` with the
    `RESOLVE_*` restrictions on how the path is resolved; the descriptor is close-on-exec."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    return syscall("openat2", ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
                   ctypes.c_size_t(ctypes.sizeof(how)))


def pivot_root(new_root: str, put_old: str) -> None:
    syscall("pivot_root", os.fsencode(new_root), os.fsencode(put_old))


# The mount API of Linux >= 5.2: detached mounts, attachable in another mount namespace.
OPEN_TREE_CLONE = 0x1
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6


def open_tree(path: str, recursive: bool = True) -> int:
    """A detached copy of the mount tree at `path` (open_tree(OPEN_TREE_CLONE)), close-on-exec."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    return syscall("open_tree", ctypes.c_int(AT_FDCWD), os.fsencode(path), ctypes.c_uint(flags))


def move_mount(mount_fd: int, target: str) -> None:
    """Attach the detached mount `mount_fd` at `target` in the current mount namespace."""
    syscall("move_mount", ctypes.c_int(mount_fd), b"", ctypes.c_int(AT_FDCWD), os.fsencode(target),
            ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH))


def new_mount(fstype: str, options: dict[str, str] | None = None) -> int:
    """A new, detached mount of a `fstype` filesystem (fsopen, fsconfig, fsmount), close-on-exec.
    A proc made this way belongs to the caller's PID namespace."""
    fs_fd = syscall("fsopen", os.fsencode(fstype), ctypes.c_uint(1))  # FSOPEN_CLOEXEC
    try:
        for key, value in (options or {}).items():
            syscall("fsconfig", ctypes.c_int(fs_fd), ctypes.c_uint(FSCONFIG_SET_STRING), os.fsencode(key),
                    os.fsencode(value), ctypes.c_int(0))
        syscall("fsconfig", ctypes.c_int(fs_fd), ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0))
        return syscall("fsmount", ctypes.c_int(fs_fd), ctypes.c_uint(1), ctypes.c_uint(0))  # FSMOUNT_CLOEXEC
    finally:
        os.close(fs_fd)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")
