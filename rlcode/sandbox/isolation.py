"""What happens inside the sandbox: the per-execution init process and the program process.

Process tree of one execution (REFERENCE.md §11), all forked from the worker (the fork server,
`worker.py`), none exec'ing a new Python:

    worker W  (holds capabilities: real root, or root of a user namespace of its own; lives in
               its slot's cgroups, so everything it forks is accounted and limited there)
      `-- init C = pid 1 of a fresh PID namespace (W unshares CLONE_NEWPID for this one fork)
            enters fresh mount, IPC and cgroup namespaces and the worker's network and UTS
            namespaces (see `Worker._make_shared_namespaces`), builds the filesystem view, forks
            P, reaps everything until P exits, then SIGKILLs and reaps whatever is left in the
            namespace (setsid'd daemons included) and reports. C has no signal handlers, so the
            program cannot signal it (a namespace's init only receives, from inside, signals it
            handles); it is non-dumpable and, as root, a different uid (no ptrace, no /proc/1).
            `-- program P
                  new session; stdio on the capped pipes; default signal dispositions; an
                  unprivileged host uid, distinct per worker slot (when W is real root); its own
                  user namespace (uid 1000 inside) that may not create nested ones; hard rlimits;
                  oom_score_adj 1000; no new privileges; dies with C (PDEATHSIG); an empty
                  environment but PATH/HOME/LANG/TMPDIR; cwd = the working copy; then
                  execve(argv), or -- in the pre-warmed mode -- runs Python code in place.

Why RLIMIT_NPROC works per execution: the kernel counts processes per (user namespace, uid) and
checks the limit at every level of the namespace hierarchy. P creates a fresh user namespace after
dropping to a non-root uid, so its count starts at 1 and covers exactly the execution's processes
(threads included); host root would be exempt, hence the uid drop (or, without real root, the
caller's own uid). A pids cgroup, where delegated, bounds the same thing independently of uids.

Filesystem view built by C in its private mount namespace (nothing propagates to the host):
every host mount read-only and nosuid (one recursive `mount_setattr`); private size-limited
tmpfs on /tmp (the working copy of `files` lives in /tmp/work), on /dev (null, zero, full,
random, urandom bound from the host: no disk, GPU or kvm device node is reachable) and /dev/shm;
empty read-only tmpfs over /root, /home, `Limits.hidden_paths` and the pool's own repository
checkout; read-only binds of the exposed paths (the Python installation) back into those; a
writable bind of the caller's `workdir` at its own path; a fresh /proc of the new PID namespace
(the host's processes and their environ are invisible). Mounts copied into the program's user namespace are locked by the kernel, so even a
process with capabilities there could not unmount a hiding mount.
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

INNER_UID = 1000  # uid/gid of the program inside its user namespace
ALWAYS_HIDDEN = ("/root", "/home")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FILES_WORKDIR = "/tmp/work"
EXIT_SETUP_FAILED = 71


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
# helpers shared by C and P


def close_fds_except(keep) -> None:
    """Close every fd >= 3 not in `keep` (close_range under the hood; cheap for any fd limit)."""
    prev = 3
    for fd in sorted(k for k in keep if k >= 3):
        if fd > prev:
            os.closerange(prev, fd)
        prev = fd + 1
    os.closerange(prev, 1 << 20)


def reset_signals() -> None:
    """Default dispositions and an empty mask, as a freshly exec'd program expects. Only what
    differs is reset: `signal.getsignal` knows every disposition this interpreter inherited or set."""
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) != signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


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


def write_files(root: str, files: dict, uid: int, gid: int, chown: bool) -> None:
    for rel, content in files.items():
        rel = validate_relpath(rel)
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        path = os.path.join(root, rel)
        parent = os.path.dirname(path)
        made = []
        d = parent
        while not os.path.isdir(d):
            made.append(d)
            d = os.path.dirname(d)
        for d in reversed(made):
            os.mkdir(d, 0o755)
            if chown:
                os.chown(d, uid, gid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o755 if data.startswith(b"#!") else 0o644)
        try:
            os.write(fd, data) if len(data) < (1 << 20) else _write_all(fd, data)
            if chown:
                os.fchown(fd, uid, gid)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _makedirs_root(path: str) -> None:
    if not os.path.isdir(path):
        _makedirs_root(os.path.dirname(path))
        os.mkdir(path, 0o755)


# ----------------------------------------------------------------------------------------------
# the filesystem view (runs in C, in its fresh mount namespace, with caps)


def _readonly_all(plan: Plan) -> None:
    if plan.mount_setattr:
        L.mount_setattr("/", L.MOUNT_ATTR_RDONLY | L.MOUNT_ATTR_NOSUID, recursive=True)
        return
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for mp in points:
        mp = mp.encode().decode("unicode_escape")
        try:
            st = os.statvfs(mp)
        except OSError:
            continue
        keep = 0
        for bit, flag in ((os.ST_NODEV, L.MS_NODEV), (os.ST_NOEXEC, L.MS_NOEXEC)):
            if st.f_flag & bit:
                keep |= flag
        try:
            L.mount(None, mp, None, L.MS_REMOUNT | L.MS_BIND | L.MS_RDONLY | L.MS_NOSUID | keep)
        except OSError:
            pass


def build_filesystem(plan: Plan, *, workdir: str | None, files: dict | None, hidden: list[str],
                     exposed: list[str], tmp_bytes: int) -> str:
    """Set up the mount namespace of one execution; returns the program's working directory."""
    owner_uid, owner_gid = (plan.uid, plan.gid) if plan.drop_uid else (os.geteuid(), os.getegid())
    L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)

    covered = ["/tmp", "/dev"]
    hide_before, hide_after = [], []  # hidden paths outside / inside the workdir
    for p in sorted({os.path.realpath(h) for h in (*ALWAYS_HIDDEN, *hidden)}, key=len):
        if p == "/" or any(_under(p, c) for c in covered) or not os.path.lexists(p):
            continue
        if workdir is not None and _under(workdir, p) and p != workdir:
            hide_after.append(p)  # must be mounted after the workdir bind, which would cover it
            continue
        hide_before.append(p)
        if os.path.isdir(p):
            covered.append(p)
    hide = hide_before + hide_after

    # Open everything we will bind back before covering it.
    opened: dict[str, int] = {}

    def opath(p: str) -> int:
        if p not in opened:
            opened[p] = os.open(p, os.O_PATH | os.O_CLOEXEC)
        return opened[p]

    dev_fds = {name: opath(f"/dev/{name}") for name in DEVICES if os.path.exists(f"/dev/{name}")}
    null_fd = dev_fds.get("null")
    expose = []  # (path, is_dir), decided now: once covered, the path no longer exists
    for p in sorted({os.path.realpath(e) for e in exposed}, key=len):
        if (os.path.exists(p) and any(_under(p, c) for c in covered if c != "/dev")
                and not any(_under(p, e) for e, _ in expose)):
            expose.append((p, os.path.isdir(p)))
            opath(p)
    wd_fd = opath(workdir) if workdir is not None else None

    _readonly_all(plan)
    if not plan.pidns and plan.mount_setattr:
        # No PID namespace, hence no private /proc to mount: keep the host's writable (its files
        # carry their own permissions) so that the program can set up its user namespace.
        L.mount_setattr("/proc", 0, L.MOUNT_ATTR_RDONLY)

    # /dev: a small private tmpfs with the harmless device nodes bound in, then read-only.
    L.mount("tmpfs", "/dev", "tmpfs", L.MS_NOSUID | L.MS_NOEXEC, "size=64k,mode=755")
    for name, fd in dev_fds.items():
        target = f"/dev/{name}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        L.mount(f"/proc/self/fd/{fd}", target, None, L.MS_BIND)
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(dest, f"/dev/{name}")
    os.mkdir("/dev/shm")
    if plan.mount_setattr:
        L.mount_setattr("/dev", L.MOUNT_ATTR_RDONLY)
    else:
        L.mount(None, "/dev", None, L.MS_REMOUNT | L.MS_BIND | L.MS_RDONLY | L.MS_NOSUID | L.MS_NOEXEC)
    L.mount("tmpfs", "/dev/shm", "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"size={tmp_bytes},mode=1777")

    L.mount("tmpfs", "/tmp", "tmpfs", L.MS_NOSUID | L.MS_NODEV, f"size={tmp_bytes},mode=1777")

    hide_is_dir = {p: os.path.isdir(p) for p in hide}

    def cover(p: str) -> None:
        if hide_is_dir[p]:
            L.mount("tmpfs", p, "tmpfs", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC, "size=64k,mode=755")
        elif null_fd is not None:
            L.mount(f"/proc/self/fd/{null_fd}", p, None, L.MS_BIND)

    for p in hide_before:
        cover(p)

    for p, is_dir in expose:
        if is_dir:
            _makedirs_root(p)
        else:
            _makedirs_root(os.path.dirname(p))
            os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
        L.mount(f"/proc/self/fd/{opened[p]}", p, None, L.MS_BIND | L.MS_REC)

    if workdir is not None:
        cwd = workdir
        if any(_under(workdir, c) for c in covered):
            _makedirs_root(workdir)
        L.mount(f"/proc/self/fd/{wd_fd}", workdir, None, L.MS_BIND)
        if plan.mount_setattr:
            L.mount_setattr(workdir, 0, L.MOUNT_ATTR_RDONLY)
        else:
            L.mount(None, workdir, None, L.MS_REMOUNT | L.MS_BIND | L.MS_NOSUID)
    else:
        cwd = FILES_WORKDIR
        os.mkdir(cwd, 0o755)
        os.chown(cwd, owner_uid, owner_gid)
    if files:
        write_files(cwd, files, owner_uid, owner_gid, chown=True)
    for p in hide_after:
        cover(p)

    for p in hide:
        if hide_is_dir[p]:
            if plan.mount_setattr:
                L.mount_setattr(p, L.MOUNT_ATTR_RDONLY)
            else:
                L.mount(None, p, None, L.MS_REMOUNT | L.MS_BIND | L.MS_RDONLY | L.MS_NOSUID
                        | L.MS_NODEV | L.MS_NOEXEC)
    for fd in opened.values():
        os.close(fd)
    if plan.pidns:
        L.mount("proc", "/proc", "proc", L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC)
    return cwd


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


def enter_program(plan: Plan, limits: dict, cwd: str, *, stdin_fd: int, stdout_fd: int,
                  stderr_fd: int, err_fd: int, parent_pid: int) -> None:
    """Turn the current (forked) process into the sandboxed program, up to but excluding exec.

    `limits` is `Limits.to_dict()`. On return: fds 0-2 are the program's stdio, every other fd
    except `err_fd` (close-on-exec) is closed, rlimits are hard, privileges dropped.
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
    L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
    # Dies with the init (redundant inside a PID namespace; the backstop without one). Set last:
    # every credential change above resets it.
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(EXIT_SETUP_FAILED)
    os.chdir(cwd)
    os.umask(0o022)


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


def init_main(plan: Plan, req: dict, *, stdin_fd: int, stdout_fd: int, stderr_fd: int,
              report_fd: int, ns_fds: dict[int, int]) -> None:
    """Body of C (never returns). `req` is the worker's request dict; `ns_fds` maps CLONE_NEW*
    flags of `plan.shared_ns` to fds of the worker's long-lived namespaces of that type."""
    stage = "init"
    try:
        gc.disable()
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        # No signal handlers at all: a PID namespace's init receives, from inside it, only the
        # signals it handles, so the program can neither kill nor interrupt us (which would
        # turn its own failure into an "infra" result).
        reset_signals()
        # Self-enforced deadline (if the worker vanished, the namespace still dies on time).
        deadline = time.monotonic() + float(req["timeout"]) + 5.0
        close_fds_except({stdin_fd, stdout_fd, stderr_fd, report_fd, *ns_fds.values()})
        stage = "namespaces"
        shared = sum(ns_fds) & plan.ns_flags
        if plan.ns_flags & ~shared:
            L.unshare(plan.ns_flags & ~shared)
        for flag, fd in ns_fds.items():
            L.setns(fd, flag)
            os.close(fd)
        stage = "filesystem"
        if plan.fs:
            cwd = build_filesystem(plan, workdir=req.get("workdir"), files=req.get("files"),
                                   hidden=list(req["limits"]["hidden_paths"]) + list(req.get("hide", ())),
                                   exposed=list(req["limits"]["exposed_paths"]) + list(req.get("expose", ())),
                                   tmp_bytes=int(req["limits"]["tmp_bytes"]))
        else:
            cwd = req["host_cwd"]
            if req.get("files"):
                write_files(cwd, req["files"], plan.uid, plan.gid, chown=plan.drop_uid)
        if plan.ns_flags & L.CLONE_NEWUTS & ~shared:
            L.sethostname("sandbox")
        L.prctl(L.PR_SET_DUMPABLE, 0)
        stage = "fork"
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _program_main(plan, req, cwd, stdin_fd, stdout_fd, stderr_fd, err_w, report_fd, me)
        os.close(err_w)
        for fd in (stdin_fd, stdout_fd, stderr_fd):
            os.close(fd)
        stage = "wait"
        status = _reap_until(pid, deadline)
        if plan.pidns:
            # The program is done: end everything else in the namespace now, so that the worker
            # may answer as soon as we report, while the namespace is still being torn down.
            # kill(-1) from a namespace's init reaches every other process in it; a process
            # being killed cannot complete a fork, so nothing slips through.
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap_all()
        setup_error = os.read(err_r, 65536)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if setup_error:
            report_line(report_fd, "E", setup_error.decode("utf-8", "replace"))
        report_line(report_fd, "R", f"{status} {usage.ru_utime + usage.ru_stime}")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - every failure here is the sandbox's, not the program's
        report_line(report_fd, "E", f"sandbox setup failed at {stage}: {type(e).__name__}: {e}")
        os._exit(EXIT_SETUP_FAILED)


def _program_main(plan: Plan, req: dict, cwd: str, stdin_fd: int, stdout_fd: int, stderr_fd: int,
                  err_w: int, report_fd: int, parent_pid: int) -> None:
    try:
        os.close(report_fd)
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
        run_python_in_place(req["inprocess_code"], list(req.get("args", ())), env, list(req["sys_path"]))
    exec_program(list(req["argv"]), env)


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _reap_until(main_pid: int, deadline: float) -> int:
    """Reap every child (orphans are re-parented to the init) until main_pid exits; return its
    wait status. Past `deadline`, exit (which, for a namespace's init, ends the namespace)."""
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
                os._exit(EXIT_SETUP_FAILED)
            select.select([pidfd], [], [], min(left, 0.25))
    finally:
        os.close(pidfd)
