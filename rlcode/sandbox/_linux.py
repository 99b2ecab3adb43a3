"""Thin ctypes wrappers over the Linux system calls the sandbox needs (x86-64 and arm64).

Python 3.11 has no `os.unshare`/`os.setns`/`mount`; these wrappers raise `OSError` with the
kernel's errno like the `os` functions do. Only standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

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
PR_SET_NO_NEW_PRIVS = 38

_SYSCALLS = {
    # name: (x86_64, aarch64)
    "mount_setattr": (442, 442),
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


def prctl(option: int, arg2: int = 0) -> int:
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0),
                              ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")
