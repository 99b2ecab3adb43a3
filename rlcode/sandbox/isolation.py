"""What happens inside the sandbox: the per-execution init process and the program process.

Process tree of one execution (docs/threat_model.md), all forked, none exec'ing a new Python:

    worker W  (the fork server, `worker.py`: holds capabilities (real root, or root of a user
               namespace of its own); lives in its slot's cgroups; receives the requests and
               holds the results of every execution; feeds, monitors and stops executions, but
               forks none of them itself)
      `-- zygote Z  forked from W once, after warm-up and before any request, so its heap holds
            no execution's code, data or output, ever. Per execution W hands it descriptors
            (SCM_RIGHTS) and a one-byte command only; Z forks the init (unsharing CLONE_NEWPID
            for that one fork), sends W a pidfd of it, reaps it and reports its wait status.
            Every init, and so every program run in place, is a fork of this clean heap: an
            execution cannot read an earlier one's request or output from its own memory.
            (Exec'd programs' inits come from a lean zygote Z' instead when W preloads modules:
            a fresh interpreter W starts, running the same zygote code, whose heap never held
            the preloads or any request.)
            `-- init C = pid 1 of a fresh PID namespace
                  reads its request from a pipe W writes; enters fresh mount, IPC and cgroup
                  namespaces and the worker's network and UTS namespaces (see
                  `Worker._make_shared_namespaces`); builds the filesystem view and copies the
                  working copy in; forks P; reaps everything until P exits or W asks it to stop
                  (through a pipe); then SIGKILLs and reaps whatever is left (setsid'd daemons
                  included), brings the working copy's changes back to the host and reports.
                  C has no signal handlers, so the program cannot signal it (a namespace's init
                  only receives, from inside, signals it handles); it is non-dumpable and, as
                  root, a different uid (no ptrace, no /proc/1). Without a PID namespace C is a
                  child subreaper instead, which gives it every orphan of the execution to kill.
                  `-- program P
                        new session; stdio on the capped pipes; default signal dispositions; an
                        unprivileged host uid, distinct per worker slot and per pool (when W is
                        real root); its own user namespace (uid 1000 inside) that may not create
                        nested ones; hard rlimits; oom_score_adj 1000; no capability at all; no
                        new privileges; dies with C (PDEATHSIG); the seccomp filter; an empty
                        environment but PATH/HOME/LANG/TMPDIR; cwd = the working copy; then
                        execve(argv), or -- in the pre-warmed mode -- runs Python code in place
                        (the project's own modules dropped from `sys.modules` first).

P's privileges (`enter_program`), in this order, each with what it guarantees:
  * as host root (W real root): drop to the slot's host uid/gid with no supplementary groups
    (without a user namespace to follow, the securebits are locked and the bounding set emptied
    first, while that is still possible): the program is no host root, and programs of
    different slots (and, through `pool.UidRange`, of different pools on the host) never share a
    uid, so nothing the kernel keys by uid (RLIMIT_NPROC counts, keyrings, file ownership,
    signals, ptrace) is shared between them;
  * a user namespace of its own mapping only uid/gid 1000 to that uid (setgroups denied), whose
    max_user_namespaces is set to 0 while P may still write it: no nested user namespace, ever.
    When W is root of a user namespace of its own, that uid is W's, i.e. the pool's own uid:
    host root if the pool runs as root with the root mode disabled (the probe reports it:
    `guarantees()["unprivileged"]` False);
  * every capability dropped: securebits NOROOT, NO_SETUID_FIXUP (cleared) and
    NO_CAP_AMBIENT_RAISE set and every one of them locked; the bounding set emptied (every
    capability the kernel knows, up to /proc/sys/kernel/cap_last_cap); the ambient set cleared;
    the effective, permitted and inheritable sets emptied with capset. This matters most in
    place: creating the user namespace gave P every capability over it, and since P was already
    uid 1000 there, no uid change or execve would have cleared them (with them, a program could
    write max_user_namespaces back up, make nested user, network and mount namespaces and mount
    there);
  * no_new_privs: no execve gains privileges (set-uid bits, file capabilities, LSM transitions);
  * last, the seccomp filter of `seccomp.py`: namespaces, mounts, keyrings, bpf, ptrace and
    other processes' memory, perf, io_uring, userfaultfd, modules, kexec and the rest of the
    kernel surface a Python program does not need are refused, on x86-64 and arm64 (any other
    system-call ABI kills the process).
The pool checks all of this from inside an execution when it starts (`probe.py`):
`SandboxPool.guarantees()` reports what was measured, not what was meant.

Nothing carried from one execution to the next: the PID, mount (so /tmp, /dev/shm and the
working copy), IPC (SysV objects, POSIX message queues), cgroup and user namespaces are fresh per
execution; the session keyring is the worker's own, empty one (W leaves the pool's at start) and
key system calls are refused; the network and UTS namespaces are the worker's, reused, and
checked for sockets left alive (an SCM_RIGHTS message in flight keeps a socket, its abstract name
and its port alive after every process has gone) before every execution: W then replaces the
network namespace (`Worker._clear_network`).

Why RLIMIT_NPROC works per execution: the kernel counts processes per (user namespace, uid) and
checks the limit at every level of the namespace hierarchy. P creates a fresh user namespace after
dropping to a non-root uid, so its count starts at 1 and covers exactly the execution's processes
(threads included); host root would be exempt, hence the uid drop (or, without real root, the
caller's own uid). A pids cgroup, where delegated, bounds the same thing independently of uids.

Filesystem view: an allow-list, in C's private mount namespace (nothing propagates to the host),
on a fresh tmpfs that is the root (pivot_root; the host's root is detached, not covered). What
does not change between executions is built once per worker and set of rules in a template mount
namespace the worker keeps (all of it read-only, so nothing an execution does reaches the next
one through it); C enters a private copy of it and only adds its own /tmp, /dev/shm, /proc and
working copy (`build_root`, `finish_view`; without the mount API of Linux 5.2, C builds it all). Visible read-only (nosuid, nodev): the system's program and library directories (/usr,
/bin, /sbin, /lib*; where the host has symlinks, the same symlinks), the Python installation the
pool runs (its prefixes and every existing `sys.path` entry of the worker) and
`Limits.exposed_paths`; a minimal /etc (the dynamic linker's cache and configuration,
alternatives, the time zone, and synthetic passwd, group, hosts, hostname and nsswitch.conf that
name only root and the sandbox user). Private: tmpfs /tmp and /dev/shm, a /dev holding only null,
zero, full, random and urandom (no disk, GPU or kvm node), a fresh /proc of the new PID namespace
(the host's processes and their environ are invisible), and the working copy. Subtracted from
what is visible: `Limits.hidden_paths`, /root, /home, the pool's repository checkout and the
directories of the project's own packages (rlcode, kernels, experiments: a candidate able to
import the task generators could regenerate hidden expected results), each covered by an empty
read-only tmpfs (or an empty file). Of two rules on nested paths the deeper one wins, of two on
the same path hiding does. Mounts copied into the program's user namespace are locked by the
kernel, so even a process with capabilities there could not unmount a hiding mount.

Working copy: a private tmpfs of `Limits.workdir_bytes` bytes and `Limits.workdir_inodes` inodes
mounted at the caller's `workdir` path (with `files` only: /tmp/work on /tmp). C copies the host
workdir in before P starts and, once every process of the execution is gone, brings back what
changed (`fstree.copy` / `fstree.sync`: descriptor-relative, never following a symlink on either
side; new and modified entries written, deleted ones removed unless the host changed them
meanwhile, everything created with the host workdir owner's uid/gid and without set-ID bits). So
the program never writes the host disk, cannot exceed either bound (ENOSPC), and never leaves
files owned by a sandbox uid. Stopping an execution (timeout, output flood, cancel) is a request
to C, which kills, reaps, brings the copy back and reports, so the writes made until then are
kept; W SIGKILLs C only past a grace period (then nothing is brought back). Without a mount
namespace (`Plan.fs` false) the private copy is a host directory the worker makes, bounded only
when brought back.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import resource
import select
import signal
import sys
import time

from rlcode.sandbox import _linux as L
from rlcode.sandbox import _wire
from rlcode.sandbox import fstree
from rlcode.sandbox import seccomp

INNER_UID = 1000  # uid/gid of the program inside its user namespace
SANDBOX_USER = "sandbox"
ALWAYS_HIDDEN = ("/root", "/home")
# The trusted code of this project, hidden wherever it is installed.
PROJECT_PACKAGES = ("rlcode", "kernels", "experiments")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# From the host's /etc (if present): what the dynamic linker and the shell's tools read.
ETC_FROM_HOST = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FILES_WORKDIR = "/tmp/work"
STAGE = "/tmp"  # where the new root is assembled before pivot_root (every source is opened first)
EXIT_SETUP_FAILED = 71
# Descriptors the zygote hands to the init, in this order (then one per shared namespace).
INIT_FDS = ("request", "stdin", "stdout", "stderr", "report", "stop")


@dataclasses.dataclass
class Plan:
    """The isolation mechanisms a worker found usable (decided once, at worker start)."""

    mode: str = "none"  # "root": W is real root; "userns": W is root of its own user ns; "none"
    pidns: bool = False
    pidns_setns: bool = False  # the worker can unshare a PID namespace for one fork and return
    ns_flags: int = 0  # subset of NEWNS|NEWNET|NEWIPC|NEWUTS|NEWCGROUP given to every execution
    shared_ns: int = 0  # the part of ns_flags entered (setns) from one per-worker namespace
    #                     (informative: what is entered is what the worker holds fds of)
    fs: bool = False  # private mount namespace with the read-only view described above
    mount_setattr: bool = False  # else: per-mount read-only remounts
    program_userns: bool = False
    block_nested_userns: bool = False  # the program's user namespace may not have children
    seccomp: bool = False  # the program runs under `seccomp.py`'s filter
    drop_uid: bool = False
    uid: int = 0  # host uid/gid of the program (root mode)
    gid: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(**d)


# ----------------------------------------------------------------------------------------------
# helpers shared by Z, C and P


def close_fds_except(keep) -> None:
    """Close every fd >= 3 not in `keep` (close_range under the hood; cheap for any fd limit)."""
    prev = 3
    for fd in sorted(k for k in keep if k >= 3):
        if fd > prev:
            os.closerange(prev, fd)
        prev = fd + 1
    os.closerange(prev, 1 << 20)


# True in a process whose dispositions `reset_signals` has reset and that has set none since (the
# zygote, and so every init and program it forks): the reset is then skipped (~0.3 ms in a fork).
SIGNALS_RESET = False


def reset_signals(force: bool = False) -> None:
    """Default dispositions and an empty mask, as a freshly exec'd program expects. Only what
    differs is reset: `signal.getsignal` knows every disposition this interpreter inherited or set.
    Skipped where it already holds (`SIGNALS_RESET`), unless `force`."""
    global SIGNALS_RESET
    if SIGNALS_RESET and not force:
        return
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) != signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    SIGNALS_RESET = True


def minimal_env(python_bin_dir: str | None, extra: dict | None = None) -> dict[str, str]:
    path = DEFAULT_PATH if not python_bin_dir else f"{python_bin_dir}:{DEFAULT_PATH}"
    env = {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env


def validate_relpath(rel: str) -> str:
    norm = os.path.normpath(rel)
    if not rel or os.path.isabs(rel) or norm in (".", "..") or norm.startswith("../") or "\0" in rel:
        raise ValueError(f"file path must be relative and stay inside the working copy: {rel!r}")
    return norm


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def under(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies below it (both absolute and normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def children_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out


def kill_all_children(reaped: dict | None = None) -> dict:
    """SIGKILL and reap every child of this process, repeatedly (as a child subreaper, whatever
    a killed child leaves behind becomes our child in turn). Returns the wait statuses and rusage
    of the reaped (pid -> (status, rusage)), added to `reaped` if given."""
    me = os.getpid()
    reaped = {} if reaped is None else reaped
    for _ in range(1000):
        kids = children_of(me)
        if not kids:
            break
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        for k in kids:
            try:
                _, status, usage = os.wait4(k, 0)
                reaped[k] = (status, usage)
            except ChildProcessError:
                pass
    try:
        while True:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid <= 0:
                break
            reaped[pid] = (status, usage)
    except ChildProcessError:
        pass
    return reaped


# ----------------------------------------------------------------------------------------------
# the filesystem view (built in a fresh mount namespace, with caps)
#
# In two parts: `build_root` assembles at STAGE what every execution with the same rules shares
# and `enter_root` makes it the root; `finish_view` adds what is private to one execution. The
# worker builds the first part once per set of rules, in a mount namespace of its own that it
# keeps (a template: `Worker._template`); an init then enters a copy of it (setns, unshare) and
# only finishes it, attaching its proc and the sources below /tmp as detached mounts made in
# the host's namespace (`_linux.new_mount`, `open_tree`). Without the mount API of Linux 5.2 the
# init builds both parts itself.


def _readonly(plan: Plan, path: str, *, recursive: bool = False, nodev: bool = True) -> None:
    """The mount at `path` (and, if recursive, every mount below it) read-only and nosuid."""
    attrs = L.MOUNT_ATTR_RDONLY | L.MOUNT_ATTR_NOSUID | (L.MOUNT_ATTR_NODEV if nodev else 0)
    if plan.mount_setattr:
        L.mount_setattr(path, attrs, recursive=recursive)
        return
    points = [path]
    if recursive:
        with open("/proc/self/mountinfo") as f:
            points = [mp for mp in (line.split()[4].encode().decode("unicode_escape") for line in f)
                      if under(mp, path)]
    for mp in points:
        try:
            keep = L.MS_NOEXEC if os.statvfs(mp).f_flag & os.ST_NOEXEC else 0
        except OSError:
            continue
        L.mount(None, mp, None, L.MS_REMOUNT | L.MS_BIND | L.MS_RDONLY | L.MS_NOSUID | keep
                | (L.MS_NODEV if nodev else 0))


def view_rules(exposed, hidden) -> list[tuple[str, bool]]:
    """(real host path, visible) of every rule whose path exists, ancestors first; for one path,
    hiding wins."""
    rules: dict[str, bool] = {}
    for p in exposed:
        rp = os.path.realpath(p)
        if os.path.exists(rp):
            rules[rp] = True
    for p in hidden:
        rp = os.path.realpath(p)
        if os.path.lexists(rp):
            rules[rp] = False
    return sorted(rules.items(), key=lambda kv: (kv[0].rstrip("/").count("/"), kv[0]))


def _all_rules(exposed, hidden) -> tuple[list[tuple[str, bool, bool]], dict[str, str]]:
    """(path, visible, is a directory) of the view's rules (the system paths, then `exposed`
    minus `hidden`) and the system paths that are symlinks on the host (path -> target), which
    the view recreates as such (/bin -> usr/bin). /dev and /proc are always the private ones."""
    links, system = {}, []
    for p in SYSTEM_PATHS:
        if os.path.islink(p):
            links[p] = os.readlink(p)
            system.append(os.path.realpath(p))
        elif os.path.isdir(p):
            system.append(p)
    rules = [(p, vis, os.path.isdir(p)) for p, vis in view_rules([*system, *exposed], [*ALWAYS_HIDDEN, *hidden])
             if p != "/" and not (under(p, "/dev") or under(p, "/proc"))]
    return rules, links


def tmp_rules(exposed, hidden) -> list[tuple[str, bool, bool]]:
    """The rules below /tmp, which every execution applies to its private /tmp."""
    return [r for r in _all_rules(exposed, hidden)[0] if under(r[0], "/tmp")]


def _visible(path: str, applied: dict[str, bool]) -> bool:
    """Whether `path` is visible through the nearest enclosing rule in `applied` (default: no)."""
    best = None
    for q in applied:
        if q != path and under(path, q) and (best is None or len(q) > len(best)):
            best = q
    return applied[best] if best is not None else False


def program_ids(plan: Plan) -> tuple[int, int]:
    """uid and gid the program sees itself as (for /etc/passwd and /etc/group)."""
    if plan.program_userns:
        return INNER_UID, INNER_UID
    return (plan.uid, plan.gid) if plan.drop_uid else (os.getuid(), os.getgid())


def _etc_files(prog_uid: int, prog_gid: int) -> dict[str, str]:
    users = ["root:x:0:0:root:/root:/bin/sh"]
    groups = ["root:x:0:"]
    if prog_uid != 0:
        users.append(f"{SANDBOX_USER}:x:{prog_uid}:{prog_gid}:{SANDBOX_USER}:/tmp:/bin/sh")
        groups.append(f"{SANDBOX_USER}:x:{prog_gid}:")
    users.append("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin")
    groups.append("nogroup:x:65534:")
    dbs = ("passwd", "group", "shadow", "hosts", "networks", "protocols", "services")
    return {"passwd": "\n".join(users) + "\n", "group": "\n".join(groups) + "\n",
            "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n", "hostname": "sandbox\n",
            "nsswitch.conf": "".join(f"{db}: files\n" for db in dbs)}


def _mountpoint(target: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _apply(plan: Plan, root: str, rules, applied: dict[str, bool], attach, null: str | None,
           readonly_each: bool) -> None:
    """Mount `rules` (path, visible, is a directory, source) below `root`: a visible path whose
    parent is not gets its source attached (`attach(source, target)`), a hidden one whose
    parent is visible an empty read-only tmpfs (or, for a file, the null device at `null`)."""
    for p, vis, is_dir, source in rules:
        parent_visible = _visible(p, applied)
        applied[p] = vis
        target = root + p
        if vis and not parent_visible:
            _mountpoint(target, is_dir)
            attach(source, target)
            if readonly_each:
                _readonly(plan, target, recursive=True)
        elif not vis and parent_visible:
            if is_dir:
                L.mount("tmpfs", target, "tmpfs", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC,
                        "size=64k,nr_inodes=64,mode=755")
                if readonly_each:
                    _readonly(plan, target)
            elif null is not None:
                L.mount(null, target, None, L.MS_BIND)


def bind_from_fd(fd: int, target: str) -> None:
    L.mount(f"/proc/self/fd/{fd}", target, None, L.MS_BIND | L.MS_REC)


def build_root(plan: Plan, *, exposed: list[str], hidden: list[str], mountpoints=()) -> None:
    """In a fresh mount namespace, assemble at STAGE the part of the view that does not change
    between executions with these rules: a tmpfs root with the visible paths bound in and the
    hidden ones covered, the symlinks, /etc, /dev, and empty /proc and /tmp, all read-only.
    `mountpoints`: directories to make for later mounts (a working copy outside /tmp)."""
    L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)
    rules, links = _all_rules(exposed, hidden)
    rules = [r for r in rules if not under(r[0], "/tmp")]
    # Everything to be bound in is opened before anything is covered.
    opened: dict[str, int] = {}

    def opath(p: str) -> int:
        if p not in opened:
            opened[p] = os.open(p, os.O_PATH | os.O_CLOEXEC)
        return opened[p]

    dev_fds = {name: opath(f"/dev/{name}") for name in DEVICES if os.path.exists(f"/dev/{name}")}
    sourced = [(p, vis, is_dir, opath(p) if vis else None) for p, vis, is_dir in rules]
    by_path = {p: vis for p, vis, _ in rules}
    etc_copies, etc_binds, etc_links = {}, [], {}
    if not (_visible("/etc", by_path) or "/etc" in by_path):
        for name in ETC_FROM_HOST:
            src = f"/etc/{name}"
            if os.path.islink(src):
                etc_links[name] = os.readlink(src)
            elif os.path.isdir(src):
                etc_binds.append(name)
                opath(src)
            elif os.path.isfile(src) and os.path.getsize(src) <= (1 << 20):
                with open(src, "rb") as f:
                    etc_copies[name] = f.read()
        etc_copies.update({k: v.encode() for k, v in _etc_files(*program_ids(plan)).items()})

    R = STAGE
    L.mount("tmpfs", R, "tmpfs", L.MS_NOSUID | L.MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    applied: dict[str, bool] = {}
    null = f"/proc/self/fd/{dev_fds['null']}" if "null" in dev_fds else None
    _apply(plan, R, sourced, applied, bind_from_fd, null, readonly_each=False)
    for p, target in links.items():
        if not _visible(p, applied) and not os.path.lexists(R + p):
            os.symlink(target, R + p)
    if etc_copies or etc_binds or etc_links:
        os.makedirs(R + "/etc", 0o755, exist_ok=True)
        for name, data in etc_copies.items():
            fd = os.open(f"{R}/etc/{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        for name, target in etc_links.items():
            os.symlink(target, f"{R}/etc/{name}")
        for name in etc_binds:
            os.mkdir(f"{R}/etc/{name}", 0o755)
            bind_from_fd(opened[f"/etc/{name}"], f"{R}/etc/{name}")
    for d in ("/dev", "/proc", "/tmp", *mountpoints):
        os.makedirs(R + d, 0o755, exist_ok=True)
    _readonly(plan, R, recursive=True)

    # /dev: a small private tmpfs with the harmless device nodes bound in, then read-only.
    L.mount("tmpfs", R + "/dev", "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name, fd in dev_fds.items():
        target = f"{R}/dev/{name}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666))
        L.mount(f"/proc/self/fd/{fd}", target, None, L.MS_BIND)
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(dest, f"{R}/dev/{name}")
    os.mkdir(R + "/dev/shm")
    _readonly(plan, R + "/dev", nodev=False)
    for fd in opened.values():
        os.close(fd)


def enter_root() -> None:
    """Make STAGE the root of this mount namespace; the host's root is detached."""
    os.chdir(STAGE)
    L.pivot_root(".", ".")
    L.umount(".", L.MNT_DETACH)  # the host's root, which pivot_root stacked on ours
    os.chdir("/")


def finish_view(plan: Plan, root: str, *, workdir: str | None, limits: dict, tmp, attach) -> tuple[str, int]:
    """Mount below `root` (STAGE before `enter_root`, "" in a copy of a template) what is
    private to one execution: /dev/shm, /tmp with the rules below it (`tmp_rules`, each with
    its source for `attach`), and the working copy's tmpfs. A working copy outside /tmp needs
    its mount point made by `build_root` (a template is used only for one below /tmp: making
    it there would leave it in the template for every later execution). Returns the program's
    working directory and a descriptor of the private working copy's root."""
    tmp_bytes, wd_bytes, wd_inodes = (int(limits["tmp_bytes"]), int(limits["workdir_bytes"]),
                                      int(limits["workdir_inodes"]))
    small = f"size={tmp_bytes},nr_inodes={wd_inodes},mode=1777"
    L.mount("tmpfs", root + "/dev/shm", "tmpfs", L.MS_NOSUID | L.MS_NODEV, small)
    L.mount("tmpfs", root + "/tmp", "tmpfs", L.MS_NOSUID | L.MS_NODEV, small)
    # /tmp is private whatever is above it: its rules start from "invisible".
    _apply(plan, root, tmp, {}, attach, root + "/dev/null", readonly_each=True)
    if workdir is None:
        cwd = FILES_WORKDIR
        os.mkdir(root + cwd, 0o755)
        os.chown(root + cwd, plan.uid if plan.drop_uid else os.geteuid(), plan.gid if plan.drop_uid else os.getegid())
    else:
        cwd = workdir
        target = root + workdir
        if under(workdir, "/tmp"):
            os.makedirs(target, 0o755, exist_ok=True)
        L.mount("tmpfs", target, "tmpfs", L.MS_NOSUID | L.MS_NODEV,
                f"size={wd_bytes},nr_inodes={wd_inodes + 1},mode=700")
    return cwd, os.open(root + cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


# ----------------------------------------------------------------------------------------------
# the program process P


def _write_proc(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _set_rlimit(res: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    resource.setrlimit(res, (soft, hard))


# Securebits of the program, locked: a uid 0 (if the program ever had it) gains nothing at execve,
# a uid change keeps clearing capabilities, and no capability can be kept or made ambient.
SECUREBITS = (L.SECBIT_NOROOT | L.SECBIT_NOROOT_LOCKED | L.SECBIT_NO_SETUID_FIXUP_LOCKED
              | L.SECBIT_KEEP_CAPS_LOCKED | L.SECBIT_NO_CAP_AMBIENT_RAISE
              | L.SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED)


def _tolerate(fn, *args, errnos: tuple[int, ...]) -> None:
    try:
        fn(*args)
    except OSError as e:
        if e.errno not in errnos:
            raise


def limit_capabilities() -> None:
    """Lock `SECUREBITS` and empty the bounding set, keeping the capabilities held now. Both
    need CAP_SETPCAP in the current user namespace and are skipped (EPERM) once it is gone."""
    _tolerate(L.prctl, L.PR_SET_SECUREBITS, SECUREBITS, errnos=(errno.EPERM,))
    _tolerate(L.drop_bounding_set, errnos=(errno.EPERM,))


def drop_capabilities() -> None:
    """Leave this process no capability in any set: `limit_capabilities`, then clear the
    ambient set and the effective, permitted and inheritable sets (capset)."""
    limit_capabilities()
    _tolerate(L.prctl, L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_CLEAR_ALL, errnos=(errno.EINVAL,))  # < 4.3
    L.clear_capabilities()


def enter_program(plan: Plan, limits: dict, cwd: str, *, stdin_fd: int, stdout_fd: int,
                  stderr_fd: int, err_fd: int, parent_pid: int) -> None:
    """Turn the current (forked) process into the sandboxed program, up to but excluding exec.

    `limits` is `Limits.to_dict()`. On return: fds 0-2 are the program's stdio, every other fd
    except `err_fd` (close-on-exec) is closed, rlimits are hard, every capability set is empty
    (bounding and ambient included, securebits locked), no_new_privs is set and, last, the
    seccomp filter is installed. The capabilities are dropped after the program's user namespace
    exists: creating it hands its creator every capability over it (and a full bounding set),
    and an in-place program is already uid 1000 there, so no uid change would clear them.
    """
    os.setsid()
    for src, dst in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
        if src != dst:
            os.dup2(src, dst)
    if err_fd != 3:
        os.dup2(err_fd, 3, inheritable=False)
        err_fd = 3
    close_fds_except({err_fd})
    reset_signals()
    try:
        _write_proc("/proc/self/oom_score_adj", "1000")  # under host memory pressure, die first
    except OSError:
        pass

    if plan.drop_uid:
        # RLIMIT_NPROC is set only once inside the user namespace: the namespace copies its
        # creator's value as a cap on all of the uid's processes in the parent namespace, which
        # must stay the (large) host value, not the per-execution one.
        # Still host root: the last moment the bounding set can be emptied and the securebits
        # locked in the host's user namespace (the uid change below clears the other sets).
        # Not needed when a user namespace follows: creating it resets both, and they are set
        # again inside it.
        if not plan.program_userns:
            limit_capabilities()
        os.setgroups([])
        os.setresgid(plan.gid, plan.gid, plan.gid)
        os.setresuid(plan.uid, plan.uid, plan.uid)
    # The init made itself non-dumpable (so the program cannot ptrace it) and we inherited that,
    # as we would from a setuid: non-dumpable makes /proc/self/* root-owned, uid_map included.
    L.prctl(L.PR_SET_DUMPABLE, 1)
    if plan.program_userns:
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        L.unshare(L.CLONE_NEWUSER)
        _write_proc("/proc/self/setgroups", "deny")
        _write_proc("/proc/self/uid_map", f"{INNER_UID} {outer_uid} 1\n")
        _write_proc("/proc/self/gid_map", f"{INNER_UID} {outer_gid} 1\n")
        # Still root of the new namespace: forbid nested user namespaces (the only way an
        # unprivileged process gains capabilities, and a large kernel attack surface); counts
        # are checked up the namespace hierarchy, so this binds everything the program starts.
        if plan.block_nested_userns:
            _write_proc("/proc/sys/user/max_user_namespaces", "0")
        os.setresgid(INNER_UID, INNER_UID, INNER_UID)
        os.setresuid(INNER_UID, INNER_UID, INNER_UID)

    cpu = max(1, int(-(-limits["cpu_seconds"] // 1)))
    _set_rlimit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _set_rlimit(resource.RLIMIT_AS, int(limits["address_space_bytes"]))
    _set_rlimit(resource.RLIMIT_FSIZE, int(limits["file_size_bytes"]))
    _set_rlimit(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    _set_rlimit(resource.RLIMIT_NPROC, int(limits["processes"]))
    _set_rlimit(resource.RLIMIT_CORE, 0)
    for name in ("RLIMIT_MSGQUEUE", "RLIMIT_MEMLOCK"):
        if hasattr(resource, name):
            try:
                _set_rlimit(getattr(resource, name), 0)
            except (ValueError, OSError):
                pass
    drop_capabilities()
    L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
    # Dies with the init (redundant inside a PID namespace; the backstop without one). Set last:
    # every credential change above resets it.
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(EXIT_SETUP_FAILED)
    os.chdir(cwd)
    os.umask(0o022)
    if plan.seccomp:
        seccomp.install()  # last: from here on, only what a program may do


def exec_program(argv: list[str], env: dict[str, str]) -> None:
    """execvpe with the sandbox's PATH; on failure print like a shell and exit 127/126."""
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        code = 126 if e.errno in (errno.EACCES, errno.ENOEXEC, errno.EISDIR) else 127
        try:
            os.write(2, f"sandbox: cannot execute {argv[0]!r}: {e.strerror}\n".encode())
        finally:
            os._exit(code)


def run_python_in_place(code: str, args: list[str], env: dict[str, str], sys_path: list[str]) -> None:
    """Run Python source in this (forked, already isolated) interpreter as `python -c` would."""
    import atexit
    import builtins
    import io
    import random
    import threading
    import traceback
    import types

    os.environ.clear()
    os.environ.update(env)
    random.seed()  # the worker's RNG state is shared by every fork
    sys.argv = ["-c", *args]
    sys.path[:] = ["", *sys_path]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), errors="backslashreplace", line_buffering=True)
    gc.enable()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    rc = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 - report like the interpreter would
        traceback.print_exc()
        rc = 1
    try:
        threading._shutdown()  # wait for non-daemon threads like interpreter exit does
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            rc = rc or 120
    os._exit(rc)


# ----------------------------------------------------------------------------------------------
# the init process C


class SetupError(Exception):
    """Why an execution could not start: reported as the sandbox's failure, not the program's."""


def report_line(fd: int, kind: str, text: str) -> None:
    data = (kind + text.replace("\n", " ") + "\n").encode()
    try:
        os.write(fd, data)
    except OSError:
        pass


def wait_status_to_returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _copy_in(host_fd: int, copy_fd: int, limits: dict, uid: int | None, gid: int | None) -> dict:
    n, size = int(limits["workdir_inodes"]), int(limits["workdir_bytes"])
    too_big = (f"the workdir does not fit in the private working copy (Limits.workdir_inodes = {n}, "
               f"Limits.workdir_bytes = {size}); nothing ran")
    try:
        copied = fstree.copy(host_fd, copy_fd, uid=uid, gid=gid, max_entries=n, max_bytes=size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SetupError(too_big) from None
        raise
    if copied.truncated:
        raise SetupError(too_big)
    return copied.base


def _copy_back(copy_fd: int, host_fd: int, base: dict, limits: dict, owner: os.stat_result,
               on_tmpfs: bool) -> list[str]:
    """Bring the private copy's changes to the host workdir; returns notes for the result."""
    n, size = int(limits["workdir_inodes"]), int(limits["workdir_bytes"])
    notes = []
    if on_tmpfs:
        vfs = os.fstatvfs(copy_fd)
        if vfs.f_bfree == 0:
            notes.append(f"the working copy reached Limits.workdir_bytes ({size} bytes)")
        if vfs.f_ffree == 0:
            notes.append(f"the working copy reached Limits.workdir_inodes ({n} entries)")
    done = fstree.sync(copy_fd, host_fd, base, uid=owner.st_uid, gid=owner.st_gid, max_entries=n, max_bytes=size)
    if done.truncated:
        notes.append(f"the working copy exceeded Limits.workdir_inodes ({n}) or Limits.workdir_bytes "
                     f"({size}): only part of it was brought back and nothing was removed")
    missed = [(p, why) for p, why in done.skipped if why != "not a regular file, directory or symlink"]
    if missed:
        notes.append(f"{len(missed)} entries of the working copy were not brought back "
                     f"(first: {missed[0][0][:200]}: {missed[0][1]})")
    return notes


def init_main(fds: list[int]) -> None:
    """Body of C (never returns). `fds`: the descriptors named by `INIT_FDS`, in that order, then
    one per entry of the request's "ns_flags" (the worker's long-lived namespaces to enter)."""
    stage = "init"
    report_fd = fds[INIT_FDS.index("report")]
    try:
        gc.disable()
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        # No signal handlers at all: a PID namespace's init receives, from inside it, only the
        # signals it handles, so the program can neither kill nor interrupt us (which would
        # turn its own failure into an "infra" result).
        reset_signals()
        req_fd, stdin_fd, stdout_fd, stderr_fd, report_fd, stop_fd = fds[:len(INIT_FDS)]
        close_fds_except(set(fds))
        stage = "request"
        raw = _read_all(req_fd)
        os.close(req_fd)
        req = _wire.loads(raw[8:])
        del raw
        plan = Plan.from_dict(req["plan"])
        limits = req["limits"]
        ns_fds = dict(zip(req["ns_flags"], fds[len(INIT_FDS):]))
        # Self-enforced deadline (if the worker vanished, the namespace still dies on time).
        deadline = time.monotonic() + float(req["timeout"]) + 5.0
        workdir = req.get("workdir")
        host_fd = owner = None
        if workdir is not None:
            stage = "workdir"
            host_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            owner = os.fstat(host_fd)
        stage = "namespaces"
        template = ns_fds.pop(L.CLONE_NEWNS, None)
        exposed = [*limits["exposed_paths"], *req.get("expose", ())]
        hidden = [*limits["hidden_paths"], *req.get("hide", ())]
        tmp = [tuple(r) for r in req["tmp_rules"]] if plan.fs else []  # `tmp_rules`, by the worker
        if template is not None:
            # What the copy of the template still lacks is made here, in the host's mount
            # namespace, as detached mounts: our proc and the sources below /tmp.
            proc = L.new_mount("proc") if plan.pidns else L.open_tree("/proc")
            tmp = [(p, vis, is_dir, L.open_tree(p) if vis else None) for p, vis, is_dir in tmp]
            L.setns(template, L.CLONE_NEWNS)
            os.close(template)
        shared = sum(ns_fds) & plan.ns_flags
        if plan.ns_flags & ~shared:
            L.unshare(plan.ns_flags & ~shared)  # a private copy of the template's or the host's mounts
        for flag, fd in ns_fds.items():
            L.setns(fd, flag)
            os.close(fd)
        if not plan.pidns:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)  # every orphan of the execution comes to us
        uid = plan.uid if plan.drop_uid else None
        gid = plan.gid if plan.drop_uid else None
        stage = "filesystem"
        if template is not None:
            os.chdir("/")
            L.move_mount(proc, "/proc")
            os.close(proc)
            cwd, copy_fd = finish_view(plan, "", workdir=workdir, limits=limits, tmp=tmp,
                                       attach=L.move_mount)
        elif plan.fs:
            tmp = [(p, vis, is_dir, os.open(p, os.O_PATH | os.O_CLOEXEC) if vis else None)
                   for p, vis, is_dir in tmp]
            outside = [workdir] if workdir is not None and not under(workdir, "/tmp") else []
            build_root(plan, exposed=exposed, hidden=hidden, mountpoints=outside)
            cwd, copy_fd = finish_view(plan, STAGE, workdir=workdir, limits=limits, tmp=tmp,
                                       attach=bind_from_fd)
            if plan.pidns:
                L.mount("proc", STAGE + "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
            else:
                L.mount("/proc", STAGE + "/proc", None, L.MS_BIND | L.MS_REC)
            enter_root()
        else:
            cwd = req["host_cwd"]
            copy_fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        for *_, fd in tmp:
            if fd is not None:
                os.close(fd)
        base = None
        if host_fd is not None:
            stage = "copying the workdir in"
            base = _copy_in(host_fd, copy_fd, limits, uid, gid)
        if req.get("files"):
            stage = "writing files"
            fstree.write_files(copy_fd, req["files"], uid=uid, gid=gid, scripts_executable=True)
        if plan.ns_flags & L.CLONE_NEWUTS & ~shared:
            L.sethostname("sandbox")
        L.prctl(L.PR_SET_DUMPABLE, 0)
        stage = "fork"
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _program_main(plan, req, cwd, stdin_fd, stdout_fd, stderr_fd, err_w,
                          [fd for fd in (report_fd, stop_fd, copy_fd, host_fd, err_r) if fd is not None], me)
        os.close(err_w)
        for fd in (stdin_fd, stdout_fd, stderr_fd):
            os.close(fd)
        stage = "wait"
        status = _wait_program(pid, deadline, stop_fd)
        # The program is done, or we were asked to stop it: end every process of the execution
        # (kill(-1) from a namespace's init reaches every other process in it; a process being
        # killed cannot complete a fork, so nothing slips through).
        if plan.pidns:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reaped = _reap_all()
        else:
            reaped = kill_all_children()
        if status is None:
            status = reaped[pid][0] if pid in reaped else signal.SIGKILL
        setup_error = os.read(err_r, 65536)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if setup_error:
            report_line(report_fd, "E", setup_error.decode("utf-8", "replace"))
        elif base is not None:
            stage = "bringing the working copy back"
            for note in _copy_back(copy_fd, host_fd, base, limits, owner, plan.fs):
                report_line(report_fd, "I", note)
        report_line(report_fd, "R", f"{status} {usage.ru_utime + usage.ru_stime}")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - every failure here is the sandbox's, not the program's
        what = str(e) if isinstance(e, SetupError) else f"sandbox setup failed at {stage}: {type(e).__name__}: {e}"
        report_line(report_fd, "E", what)
        os._exit(EXIT_SETUP_FAILED)


def note_project_modules() -> None:
    """Remember which of this project's modules are loaded; the worker calls it right before it
    forks the zygote, whose `sys.modules` stays exactly that."""
    global _project_modules
    dotted = tuple(p + "." for p in PROJECT_PACKAGES)
    _project_modules = tuple(m for m in sys.modules if m in PROJECT_PACKAGES or m.startswith(dotted))


def _forget_project_modules() -> None:
    """Drop this project's modules from `sys.modules` of the interpreter the program runs in:
    their files are hidden, and a module left there would still import. Written to touch next
    to nothing: every object whose reference count changes here is a copy-on-write fault on a
    page shared with the zygote (iterating `sys.modules`, or freeing the modules, would double
    an in-place execution's start-up), so the names come from `note_project_modules` and the
    modules stay referenced (`_forgotten`)."""
    if not _project_modules:
        note_project_modules()
    _forgotten.extend(m for m in (sys.modules.pop(n, None) for n in _project_modules) if m is not None)


_project_modules: tuple[str, ...] = ()
_forgotten: list = []


def _program_main(plan: Plan, req: dict, cwd: str, stdin_fd: int, stdout_fd: int, stderr_fd: int,
                  err_w: int, close: list[int], parent_pid: int) -> None:
    try:
        for fd in close:
            os.close(fd)
        enter_program(plan, req["limits"], cwd, stdin_fd=stdin_fd, stdout_fd=stdout_fd,
                      stderr_fd=stderr_fd, err_fd=err_w, parent_pid=parent_pid)
        env = minimal_env(req.get("python_bin_dir"), req.get("env"))
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(3, f"program setup failed: {type(e).__name__}: {e}".encode())
        finally:
            os._exit(EXIT_SETUP_FAILED)
    if req.get("inprocess_code") is not None:
        os.close(3)
        _forget_project_modules()
        run_python_in_place(req["inprocess_code"], list(req.get("args", ())), env, list(req["sys_path"]))
    exec_program(list(req["argv"]), env)


def _reap_all() -> dict[int, tuple]:
    reaped = {}
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return reaped
        reaped[pid] = (status, usage)


def _wait_program(main_pid: int, deadline: float, stop_fd: int) -> int | None:
    """Reap every child (orphans are re-parented to the init) until main_pid exits: its wait
    status. None when the worker asks us to stop (the stop pipe is readable or closed) or
    `deadline` passes first."""
    pidfd = os.pidfd_open(main_pid)
    try:
        while True:
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == main_pid:
                    return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([pidfd, stop_fd], [], [], min(left, 0.25))
            if stop_fd in ready:
                return None
    finally:
        os.close(pidfd)
