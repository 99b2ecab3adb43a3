"""The seccomp filter of every sandboxed program: kernel surface a Python program never needs.

Installed by `isolation.enter_program` as the program's last step before it runs (after the
capabilities are gone and no_new_privs is set); inherited by every process and thread the program
starts and kept across execve, so nothing in the execution can remove it. A classic BPF program
assembled here with ctypes (no libseccomp), for x86-64 and arm64:

  * architecture: the filter knows the system-call tables of x86-64 and arm64 only; a call made
    under any other audit architecture (e.g. the i386 entry `int 0x80` on x86-64) kills the
    process, and x32 calls (x86-64 numbers with bit 30 set) are refused;
  * refused with EPERM (`DENIED`, grouped by what they give access to): namespaces (unshare,
    setns), mounts (mount, umount2, pivot_root, chroot, the new mount API, statmount/listmount),
    keyrings, tracing or reading other processes (ptrace, process_vm_*, kcmp, pidfd_getfd,
    process_madvise, move_pages, migrate_pages), kernel programs and event sources (bpf,
    perf_event_open, userfaultfd, io_uring, fanotify), and administration (modules, kexec,
    reboot, swap, acct, quotas, clocks, host/domain names, syslog, file handles, x86 I/O ports
    and LDT, obsolete calls);
  * clone: refused with EPERM when its flags ask for any new namespace (CLONE_NEWNS, NEWCGROUP,
    NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET); plain clone (fork, vfork, threads) is allowed;
  * clone3: answered ENOSYS, so that the C library falls back to clone (glibc >= 2.34 tries
    clone3 first for threads and posix_spawn); its flags sit in memory a filter cannot read;
  * socket, socketpair: only AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK; other families
    (packet, alg, vsock, bluetooth, xdp, ...) are answered EAFNOSUPPORT.

Everything else is allowed: the filter is a deny list sized to what the kernel offers beyond a
Python program's needs (subprocess, threads, multiprocessing, asyncio, pytest keep working).
Calls decided by number alone are cached by the kernel (constant-action bitmap, Linux >= 5.11),
so the filter costs nothing on the hot path; it is installed with SECCOMP_FILTER_FLAG_SPEC_ALLOW
(no forced speculative-store-bypass mitigation: the program's own memory is no secret from it).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys

from rlcode.sandbox import _linux as L

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1 << 2
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

CLONE_NEW_ANY = (L.CLONE_NEWNS | L.CLONE_NEWCGROUP | L.CLONE_NEWUTS | L.CLONE_NEWIPC
                 | L.CLONE_NEWUSER | L.CLONE_NEWPID | L.CLONE_NEWNET)
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK

# name: (x86_64, aarch64); None where that architecture has no such call.
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "unshare": (272, 97), "setns": (308, 268), "clone": (56, 220), "clone3": (435, 435),
    "socket": (41, 198), "socketpair": (53, 199),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "statmount": (457, 457), "listmount": (458, 458),
    "open_tree_attr": (467, 467),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    "move_pages": (279, 239), "migrate_pages": (256, 238),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "fanotify_init": (300, 262),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "syslog": (103, 116), "vhangup": (153, 58), "sethostname": (170, 161),
    "setdomainname": (171, 162), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "lookup_dcookie": (212, 18),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    "ustat": (136, None), "sysfs": (139, None), "_sysctl": (156, None),
}

DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "mounts": ("mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
               "fsconfig", "fsmount", "fspick", "mount_setattr", "statmount", "listmount",
               "open_tree_attr"),
    "keyrings": ("keyctl", "add_key", "request_key"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
                        "process_madvise", "move_pages", "migrate_pages"),
    "kernel programs and event sources": ("bpf", "perf_event_open", "userfaultfd",
                                          "io_uring_setup", "io_uring_enter", "io_uring_register",
                                          "fanotify_init"),
    "administration": ("kexec_load", "kexec_file_load", "init_module", "finit_module",
                       "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl",
                       "quotactl_fd", "open_by_handle_at", "name_to_handle_at", "syslog",
                       "vhangup", "sethostname", "setdomainname", "settimeofday", "clock_settime",
                       "clock_adjtime", "adjtimex", "lookup_dcookie", "iopl", "ioperm",
                       "modify_ldt", "uselib", "ustat", "sysfs", "_sysctl"),
}

ARCHES = (("x86_64", AUDIT_ARCH_X86_64, 0), ("aarch64", AUDIT_ARCH_AARCH64, 1))

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (host byte order).
_OFF_NR, _OFF_ARCH = 0, 4
_OFF_ARG0_LOW = 16 if sys.byteorder == "little" else 20

# Classic BPF opcodes.
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06


def _errno(code: int) -> int:
    return SECCOMP_RET_ERRNO | code


def _program() -> list[tuple]:
    """The filter as (opcode, k, true-label, false-label) and ("label", name) items."""
    prog: list[tuple] = [(_LD_W_ABS, _OFF_ARCH, None, None)]
    prog += [(_JEQ_K, audit, name, None) for name, audit, _ in ARCHES]
    prog.append((_RET_K, SECCOMP_RET_KILL_PROCESS, None, None))
    denied = [n for names in DENIED.values() for n in names]
    for name, _, idx in ARCHES:
        nr = {k: v[idx] for k, v in SYSCALLS.items() if v[idx] is not None}
        p = name + ":"
        prog.append(("label", name))
        prog.append((_LD_W_ABS, _OFF_NR, None, None))
        if name == "x86_64":
            prog.append((_JGE_K, X32_SYSCALL_BIT, p + "eperm", None))
        for n in sorted((n for n in denied if n in nr), key=nr.get):
            prog.append((_JEQ_K, nr[n], p + "eperm", None))
        prog += [(_JEQ_K, nr["clone3"], p + "enosys", None), (_JEQ_K, nr["clone"], p + "clone", None),
                 (_JEQ_K, nr["socket"], p + "socket", None),
                 (_JEQ_K, nr["socketpair"], p + "socket", None),
                 (_RET_K, SECCOMP_RET_ALLOW, None, None),
                 ("label", p + "clone"), (_LD_W_ABS, _OFF_ARG0_LOW, None, None),
                 (_JSET_K, CLONE_NEW_ANY, p + "eperm", None),
                 (_RET_K, SECCOMP_RET_ALLOW, None, None),
                 ("label", p + "socket"), (_LD_W_ABS, _OFF_ARG0_LOW, None, None)]
        prog += [(_JEQ_K, fam, p + "allow", None) for fam in ALLOWED_SOCKET_FAMILIES]
        prog += [(_RET_K, _errno(errno.EAFNOSUPPORT), None, None),
                 ("label", p + "allow"), (_RET_K, SECCOMP_RET_ALLOW, None, None),
                 ("label", p + "eperm"), (_RET_K, _errno(errno.EPERM), None, None),
                 ("label", p + "enosys"), (_RET_K, _errno(errno.ENOSYS), None, None)]
    return prog


def assemble(prog: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve labels into the relative jump offsets of `struct sock_filter` (code, jt, jf, k);
    a missing label or a jump past 255 instructions is an error, not a silent wrap."""
    labels, insns = {}, []
    for item in prog:
        if item[0] == "label":
            labels[item[1]] = len(insns)
        else:
            insns.append(item)
    out = []
    for i, (code, k, t, f) in enumerate(insns):
        offs = []
        for target in (t, f):
            off = 0 if target is None else labels[target] - (i + 1)
            if not 0 <= off <= 255:
                raise ValueError(f"seccomp filter: jump to {target!r} out of range ({off})")
            offs.append(off)
        out.append((code, offs[0], offs[1], k))
    return out


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


INSTRUCTIONS = assemble(_program())
_FILTER = (_SockFilter * len(INSTRUCTIONS))(*INSTRUCTIONS)
_FPROG = _SockFprog(len(INSTRUCTIONS), ctypes.cast(_FILTER, ctypes.POINTER(_SockFilter)))


def supported() -> bool:
    """Whether this machine's architecture is one the filter knows (elsewhere it would kill)."""
    return platform.machine() in ("x86_64", "aarch64", "arm64")


def install() -> None:
    """Install the filter on the calling thread (needs no_new_privs or CAP_SYS_ADMIN). Built once
    at import, so that this is one system call in the forked program."""
    try:
        L.syscall("seccomp", ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                  ctypes.c_uint(SECCOMP_FILTER_FLAG_SPEC_ALLOW), ctypes.byref(_FPROG))
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: a kernel older than the flag (< 4.17)
            raise
        L.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_FPROG))
