"""The fork server: one long-lived process per pool slot that runs executions one at a time.

Started by the pool as a fresh interpreter (`python -s -m rlcode.sandbox.worker`) whose
environment holds only PATH, LANG, the socket fd and the pool's pid, so it has no secrets and no
model state; it imports only the standard library, this package's light modules and, optionally,
modules to pre-warm (pytest, warmed by one tiny session) for the in-place Python mode. It joins
its slot's cgroups once, then forks the zygote (see `isolation.py`): a copy of itself taken before
any request arrived, which forks every execution's init. The worker itself forks no execution:
its heap holds every earlier request and result (freed, not zeroed), and a process forked from it
could read them. A zygote that dies is never replaced from this heap: the worker answers "infra"
and exits, and the pool starts a fresh one. When modules are preloaded, exec'd programs get a
second, lean zygote: a fresh interpreter the worker starts (``--zygote``) that runs the same
zygote code without the preloads, which an exec'd program never uses but would pay for in every
fork (page tables, copy-on-write faults, teardown).

For every request the worker hands the zygote the execution's pipes (SCM_RIGHTS) and receives a
pidfd of the init; it writes the request into the init's request pipe, feeds stdin, reads
stdout/stderr through capped buffers, and stops the execution on its wall-clock deadline, an
output flood or a cancel by asking the init through a pipe (the init kills every process of the
execution, brings the working copy back and reports); it SIGKILLs the init through the pidfd only
when that takes longer than `STOP_GRACE_SECONDS`. Once the init reports, the reply goes out first
and the zygote's word that it reaped the init is awaited after it. It also keeps, per set of view
rules, a template mount namespace holding the unchanging part of the filesystem view, which each
init copies instead of building it (`Worker._view`), and the rules below /tmp, worked out once.

At start it decides which isolation mechanisms work on this machine (`Plan`) by trying each one
in a throwaway child, then checks the whole plan end to end, dropping mechanisms one at a time
until a trivial execution succeeds (each drop noted); the first worker of a pool then runs the
start-up probe (`probe.py`), which measures from inside executions what the plan promises; the
pool turns both into `SandboxPool.guarantees()` and warnings. Before every execution the worker
checks its shared network namespace for sockets an earlier execution kept alive and replaces the
namespace if it finds one (`Worker._make_shared_namespaces`).

`python -m rlcode.sandbox.worker --oneshot` runs a single request read from stdin with the same
code (used by the benchmark as the fresh-process-per-execution baseline).
"""

from __future__ import annotations

import errno
import gc
import importlib.util
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

from rlcode.sandbox import _linux as L
from rlcode.sandbox import _wire
from rlcode.sandbox import cgroups as cg_lib
from rlcode.sandbox import fstree
from rlcode.sandbox import isolation
from rlcode.sandbox import probe as probe_lib
from rlcode.sandbox import seccomp

DRAIN_SECONDS = 2.0  # after the init reported (or died), how long to wait for pipes to close
# How long the init may take to stop an execution (kill, reap, bring the working copy back,
# report) before it is SIGKILLed; within the pool's grace for a silent worker.
STOP_GRACE_SECONDS = 10.0
SPAWN_SECONDS = 10.0  # how long the zygote may take to fork an init
MAX_TEMPLATES = 8  # template mount namespaces kept per worker (one per set of view rules)
MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory",
                  b"failed to allocate")
SHAREABLE_NS = L.CLONE_NEWNET | L.CLONE_NEWUTS
# /proc/net tables listing the sockets of a network namespace (those of its families a program
# may open, and more): read when its socket count is not zero.
SOCKET_TABLES = ("unix", "tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6",
                 "icmp", "icmp6", "packet", "netlink")
NS_NAMES = {L.CLONE_NEWNS: "mount", L.CLONE_NEWNET: "net", L.CLONE_NEWIPC: "ipc",
            L.CLONE_NEWUTS: "uts", L.CLONE_NEWCGROUP: "cgroup"}
# Zygote protocol (one SOCK_SEQPACKET message each). Worker -> zygote: b"S" + flags byte, with the
# init's descriptors attached. Zygote -> worker: b"P" + pid, with a pidfd of the init attached,
# or b"F" + errno when it could not fork; later b"D" + (pid, wait status, CPU seconds).
_PID = struct.Struct("!i")
_DONE = struct.Struct("!iid")
_FLAG_PIDNS, _FLAG_SETNS = 1, 2


# Where the rlcode package is imported from: the lean zygote is started there.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ZygoteLost(Exception):
    """The zygote died or broke protocol: this worker cannot run executions any more."""



def _trial(fn, timeout: float = 10.0) -> str | None:
    """Run fn in a forked child; None if it succeeded, else the error text."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(w, f"{type(e).__name__}: {e}".encode()[:4000])
            finally:
                os._exit(1)
    os.close(w)
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "timed out"
        time.sleep(0.002)
    msg = os.read(r, 4096).decode(errors="replace")
    os.close(r)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    return msg or f"wait status {status}"


def _grandchild_trial() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _warm_pytest(tmp_root: str) -> None:
    """Run one tiny pytest session in the worker, so that every in-place execution starts from an
    interpreter where pytest's plugins, hooks and lazy imports are already loaded (this halves the
    cost of `pytest.main` in the forked child). The session's traces in the worker's global state
    (import path, import hooks, its test module) are undone."""
    import shutil

    import pytest

    name = "test_rlcode_sandbox_warmup"
    d = tempfile.mkdtemp(prefix="rlcode-sandbox-warm-", dir=tmp_root)
    saved_path, saved_meta, saved_hooks = list(sys.path), list(sys.meta_path), list(sys.path_hooks)
    saved_fds = [os.dup(1), os.dup(2)]
    cwd = os.getcwd()
    try:
        with open(os.path.join(d, name + ".py"), "w") as f:
            f.write("def test_warm():\n    assert [1] == [1]\n")
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        os.chdir(d)
        pytest.main(["-q", "-p", "no:cacheprovider", name + ".py"])
    except Exception:  # noqa: BLE001 - warm-up is an optimisation only
        pass
    finally:
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(cwd)
        sys.path[:], sys.meta_path[:], sys.path_hooks[:] = saved_path, saved_meta, saved_hooks
        sys.path_importer_cache.clear()
        sys.modules.pop(name, None)
        shutil.rmtree(d, ignore_errors=True)


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _fork_init(fds: list[int], flags: int, self_pidns: int) -> int:
    """Fork the init of one execution (in a new PID namespace if asked); returns its pid."""
    pidns, dance = bool(flags & _FLAG_PIDNS), bool(flags & _FLAG_SETNS)
    if dance:
        L.unshare(L.CLONE_NEWPID)  # only our next child (the init) enters the new one
    try:
        pid = os.fork()
    except BaseException:
        if dance:
            L.setns(self_pidns, L.CLONE_NEWPID)
        raise
    if pid == 0:
        try:
            if pidns and not dance:
                # We may not re-enter our own PID namespace (it belongs to a user namespace we
                # have no capabilities in), so an intermediate process unshares and forks the
                # init; the init dies with it (PDEATHSIG).
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
                L.unshare(L.CLONE_NEWPID)
                if os.fork() != 0:
                    isolation.close_fds_except(set())
                    try:
                        os.wait()
                    finally:
                        os._exit(0)
            isolation.init_main(fds)
        finally:
            os._exit(isolation.EXIT_SETUP_FAILED)
    if dance:
        L.setns(self_pidns, L.CLONE_NEWPID)  # back to our own for the next unshare
    return pid


def _zygote_main(sock: socket.socket, self_pidns: int, parent_pid: int) -> None:
    """Body of the zygote (never returns): one init per command, reported and reaped."""
    try:
        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(0)
        # Orphans of an init that was SIGKILLed without a PID namespace come to us, to be killed.
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        isolation.close_fds_except({sock.fileno(), self_pidns})
        # Default dispositions and an empty mask once, here: every init and program inherits them
        # (and so skips its own reset), and the zygote installs no handler.
        isolation.reset_signals(force=True)
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 64)
            if not msg:
                os._exit(0)
            try:
                pid = _fork_init(fds, msg[1], self_pidns)
                pidfd = os.pidfd_open(pid)
            except OSError as e:
                sock.send(b"F" + _PID.pack(e.errno or 0))
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            socket.send_fds(sock, [b"P" + _PID.pack(pid)], [pidfd])
            os.close(pidfd)
            _, status, usage = os.wait4(pid, 0)
            if not msg[1] & _FLAG_PIDNS:
                isolation.kill_all_children()
            sock.send(b"D" + _DONE.pack(pid, status, usage.ru_utime + usage.ru_stime))
    except BaseException:  # noqa: BLE001 - the worker sees the socket close
        os._exit(1)


def _project_package_dirs() -> list[str]:
    """Where this project's packages are installed, wherever that is (hidden from executions)."""
    out = set()
    for name in isolation.PROJECT_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            out.update(p for p in spec.submodule_search_locations if os.path.isabs(p))
        elif spec.origin and os.path.isabs(spec.origin):
            out.add(spec.origin)
    return sorted(out)


class Worker:
    def __init__(self, cfg: dict, plan: isolation.Plan | None = None):
        self.cfg = cfg
        self.slot = cfg.get("slot", 0)
        self.python_bin_dir = os.path.dirname(cfg.get("python") or sys.executable)
        self.sys_path = [p for p in sys.path[1:] if p]
        # The Python installation (its prefixes and import path) is visible to every execution,
        # this project's own packages are not.
        self.expose = sorted({p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
                                          *self.sys_path)
                              if os.path.isabs(p) and os.path.realpath(p) != "/"})
        self.hide = _project_package_dirs()
        self.tmp_root = cfg.get("tmp_root") or tempfile.gettempdir()
        self.cgroup: cg_lib.SlotCgroup | None = None
        self._cg_limits = None
        if cfg.get("cgroup_dirs"):
            hs = cg_lib.discover()
            dirs = []
            for d in cfg["cgroup_dirs"]:
                h = next((h for h in hs if os.path.dirname(d.rstrip("/")) == h.base.rstrip("/")), None)
                if h is not None and os.path.isdir(d):
                    dirs.append((h, d))
            self.cgroup = cg_lib.SlotCgroup(dirs)
        self._me = frozenset({os.getpid()})  # processes of ours in the slot's cgroups
        # Zygotes by kind: "warm" forks the inits of in-place executions (and of all of them when
        # nothing is preloaded); "lean", a fresh interpreter holding none of the preloads, those
        # of exec'd programs (`_kind`). `_active`: the kind serving the current execution.
        self._zygotes: dict[str, tuple[int, socket.socket]] = {}
        self._active = "warm"
        self._templates: dict[tuple, tuple] = {}  # view rules -> (mount namespace, /tmp rules)
        self._mount_api: bool | None = False if "template" in cfg.get("disable", ()) else None
        # A fault for tests of the probe: a zygote forked anew before every execution, from a
        # heap that holds the earlier requests and results.
        self._fresh_zygotes = "zygote" in cfg.get("disable", ())
        self.stop_requested = False
        self._pending: tuple[int, int, str] | None = None  # (pid, pidfd, zygote kind) of an init not yet reaped
        self.preloaded = []
        for mod in cfg.get("preload", ()):
            try:
                __import__(mod)
                self.preloaded.append(mod)
            except Exception:  # noqa: BLE001 - optional warm-up only
                pass
        if "pytest" in self.preloaded:
            _warm_pytest(self.tmp_root)
        os.chdir("/")
        self.self_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.ns_fds: dict[int, int] = {}
        self._net_tables: dict[str, int] = {}  # socket tables of the shared network namespace
        self.plan = plan if plan is not None else self._decide_plan(set(cfg.get("disable", ())))
        if plan is None:
            self._make_shared_namespaces(self.plan.ns_flags & SHAREABLE_NS)
        gc.freeze()  # keep the forked children from dirtying the heap's pages in GC passes
        if self.cgroup is not None:
            # The worker lives in its slot's cgroups, so everything it forks starts there.
            # Moving each execution's init into them instead would cost an RCU grace period per
            # execution (cgroup migration takes a global rw-semaphore for writing; ~5-15 ms).
            # Joined last: the memory the worker allocated so far stays charged outside.
            self.cgroup.join()
        # The probes above ran through a zygote of their own; the one that serves requests is
        # forked now, in the slot's cgroups, from a heap that has seen no request.
        self.finish_pending()
        self._stop_zygote()
        self._drop_templates()  # made for the plans tried above
        self._start_zygote("warm")
        if self.preloaded:
            self._start_zygote("lean")

    # ------------------------------------------------------------------------------------------
    # deciding what works here

    def _decide_plan(self, disable: set[str]) -> isolation.Plan:
        plan = isolation.Plan()
        notes = plan.notes
        # Leave the session keyring inherited from the pool's process (the trainer's): every
        # execution is forked from here and would possess its keys (the filter refuses the key
        # system calls; this keeps even their names out of the executions' /proc/keys).
        try:
            L.join_session_keyring()
        except OSError as e:
            notes.append(f"kept the inherited session keyring ({e})")

        def seccomp_trial():
            L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
            seccomp.install()
            try:
                L.unshare(L.CLONE_NEWUTS)  # refused by the filter (with capabilities, only by it)
            except OSError as e:
                if e.errno != errno.EPERM:
                    raise
            else:
                raise RuntimeError("the filter let unshare through")
            _grandchild_trial()

        if "seccomp" in disable:
            err = "disabled"
        elif not seccomp.supported():
            err = f"no system-call table for {platform.machine()}"
        else:
            err = _trial(seccomp_trial)
        plan.seccomp = filter_ok = err is None
        if err:
            notes.append(f"no seccomp filter ({err})")
        if os.geteuid() == 0 and "root" not in disable:
            plan.mode = "root"
        elif "userns" not in disable:
            uid, gid = os.geteuid(), os.getegid()
            try:
                L.unshare(L.CLONE_NEWUSER)
                isolation._write_proc("/proc/self/setgroups", "deny")
                isolation._write_proc("/proc/self/uid_map", f"0 {uid} 1\n")
                isolation._write_proc("/proc/self/gid_map", f"0 {gid} 1\n")
                plan.mode = "userns"
            except OSError as e:
                notes.append(f"no user namespace for the worker: {e}")
        if plan.mode == "none":
            notes.append("no namespaces at all: only rlimits, a cleared environment, a private "
                         "directory and process-tree killing protect the host")
            return plan
        if plan.mode == "root" and "uid" not in disable:
            plan.drop_uid = True
            plan.uid = plan.gid = int(self.cfg.get("uid", 2_100_000_000))

        def pidns_trial():
            L.unshare(L.CLONE_NEWPID)
            _grandchild_trial()

        def pidns_setns_trial():
            pidns_trial()
            L.setns(self.self_pidns, L.CLONE_NEWPID)
            L.unshare(L.CLONE_NEWPID)
            _grandchild_trial()

        err = "disabled" if "pid" in disable else _trial(pidns_trial)
        plan.pidns = err is None
        if err:
            notes.append(f"PID namespace unavailable ({err})")
        else:
            plan.pidns_setns = _trial(pidns_setns_trial) is None
        for flag, name in NS_NAMES.items():
            err = "disabled" if name in disable else _trial(lambda f=flag: L.unshare(f))
            if err is None:
                plan.ns_flags |= flag
            else:
                notes.append(f"{name} namespace unavailable ({err})")

        def setattr_trial():
            L.unshare(L.CLONE_NEWNS)
            L.mount(None, "/", None, L.MS_REC | L.MS_PRIVATE)
            L.mount_setattr("/", L.MOUNT_ATTR_RDONLY | L.MOUNT_ATTR_NOSUID, recursive=True)

        if plan.ns_flags & L.CLONE_NEWNS and "fs" not in disable:
            plan.mount_setattr = "mount_setattr" not in disable and _trial(setattr_trial) is None
            plan.fs = True
        elif plan.ns_flags & L.CLONE_NEWNS:
            notes.append("no filesystem view of its own (disabled): executions see the host's "
                         "files and work on a host directory")

        def program_userns_trial():
            if plan.drop_uid:
                os.setgroups([])
                os.setresgid(plan.gid, plan.gid, plan.gid)
                os.setresuid(plan.uid, plan.uid, plan.uid)
                L.prctl(L.PR_SET_DUMPABLE, 1)
            u, g = os.geteuid(), os.getegid()
            L.unshare(L.CLONE_NEWUSER)
            isolation._write_proc("/proc/self/setgroups", "deny")
            isolation._write_proc("/proc/self/uid_map", f"{isolation.INNER_UID} {u} 1\n")
            isolation._write_proc("/proc/self/gid_map", f"{isolation.INNER_UID} {g} 1\n")

        def block_nested_trial():
            program_userns_trial()
            isolation._write_proc("/proc/sys/user/max_user_namespaces", "0")

        err = "disabled" if "program_userns" in disable else _trial(program_userns_trial)
        plan.program_userns = err is None
        if err:
            notes.append(f"per-execution user namespace unavailable ({err})")
        else:
            err = _trial(block_nested_trial)
            plan.block_nested_userns = err is None
            if err:
                notes.append(f"nested user namespaces cannot be forbidden ({err})")

        # End to end, degrading one mechanism at a time until a trivial execution succeeds (the
        # filter is tried away alone first, then kept while the others go one by one).
        for drop in (None, "seccomp", "fs", "program_userns", "ns_flags", "pidns"):
            if drop == "seccomp":
                if not filter_ok:
                    continue
                plan.seccomp = False
            else:
                plan.seccomp = filter_ok
            if drop == "fs":
                plan.fs = False
            elif drop == "program_userns":
                plan.program_userns = plan.block_nested_userns = False
            elif drop == "ns_flags":
                plan.ns_flags = 0
                plan.fs = False
            elif drop == "pidns":
                plan.pidns = False
            self.plan = plan
            if not plan.pidns:
                L.prctl(36, 1)
            res = self.execute({"inprocess_code": "pass", "timeout": 20.0,
                                "limits": self.cfg["limits"]}, probe=True)
            if res["status"] == "ok":
                if drop == "seccomp":
                    notes.append("the seccomp filter broke the end-to-end check: programs run without it")
                res = self.execute({"argv": [self.cfg.get("python") or sys.executable, "-c", "pass"],
                                    "timeout": 30.0, "limits": self.cfg["limits"]}, probe=True)
                if res["status"] != "ok":
                    notes.append("the pool's Python cannot be exec'd in the sandbox, "
                                 "run_python(inprocess=False) will fail: "
                                 f"{(res['info'] or res['stderr'][-300:].decode(errors='replace'))!r}")
                return plan
            notes.append(f"end-to-end check failed with {drop or 'the full plan'} "
                         f"({res['info'] or res['stderr'][-500:]!r}); dropping the next mechanism")
        raise RuntimeError("sandbox cannot run even a trivial program: " + "; ".join(notes))

    def _make_shared_namespaces(self, flags: int) -> None:
        """One network and one UTS namespace per worker, entered by each of its executions.

        Creating and destroying a network namespace per execution is the most expensive part of
        the isolation (and its teardown runs asynchronously, competing for CPU). Sharing one per
        worker keeps the guarantee: executions of a worker never overlap in time, the namespace
        has only a loopback device, down, that nobody in it may configure (no execution holds
        capabilities over it), so an execution cannot reach anything. One thing can outlive an
        execution's processes there: a socket kept alive by an SCM_RIGHTS message in flight (a
        unix socket holding its own descriptor in its receive queue, and whatever else that
        message carries), with its abstract name or port. So before every execution the worker
        checks the namespace (`_clear_network`) and replaces it when a socket is left. IPC,
        mount, PID, cgroup and user namespaces stay fresh per execution (SysV IPC objects, for
        one, would persist).
        """
        if not flags:
            return
        try:
            fds, tables = self._fresh_namespaces(flags)
        except OSError as e:
            self.plan.notes.append(f"no shared network/UTS namespace ({e}): a fresh one per execution")
            return
        self.ns_fds.update(fds)
        self._net_tables = tables
        self.plan.shared_ns = sum(self.ns_fds)

    def _fresh_namespaces(self, flags: int) -> tuple[dict[int, int], dict[str, int]]:
        """New namespaces of `flags` (NEWNET and/or NEWUTS), made by a child that unshares them:
        descriptors of each, and of the new network namespace's socket tables (/proc/net files
        opened through the child: each stays bound to that namespace, re-read with pread)."""
        go_r, go_w = os.pipe()
        ok_r, ok_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                L.unshare(flags)
                if flags & L.CLONE_NEWUTS:
                    L.sethostname("sandbox")
                os.write(ok_w, b"1")
                os.read(go_r, 1)
            finally:
                os._exit(0)
        os.close(go_r)
        os.close(ok_w)
        ok = os.read(ok_r, 1) == b"1"
        os.close(ok_r)
        fds: dict[int, int] = {}
        tables: dict[str, int] = {}
        try:
            if not ok:
                raise OSError(errno.EPERM, "cannot create the namespaces")
            for flag, name in ((L.CLONE_NEWNET, "net"), (L.CLONE_NEWUTS, "uts")):
                if flags & flag:
                    fds[flag] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            if flags & L.CLONE_NEWNET:
                for name in ("sockstat", *SOCKET_TABLES):
                    try:
                        tables[name] = os.open(f"/proc/{pid}/net/{name}", os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        pass
        except BaseException:
            for fd in (*fds.values(), *tables.values()):
                os.close(fd)
            raise
        finally:
            os.close(go_w)
            os.waitpid(pid, 0)
        return fds, tables

    def _sockets_left(self) -> list[str]:
        """Sockets alive in the shared network namespace, as "table: line" (empty when none).
        The socket count of /proc/net/sockstat is read first (~1 us); only when it is not zero
        are the tables read, since a closed netlink socket is counted until an RCU grace period
        has passed, though nothing can reach it any more."""
        fd = self._net_tables.get("sockstat")
        if fd is not None and os.pread(fd, 4096, 0).split(b"\n", 1)[0].split()[-1:] == [b"0"]:
            return []
        left = []
        for name in SOCKET_TABLES:
            fd = self._net_tables.get(name)
            if fd is None:
                continue
            data = b""
            while True:
                chunk = os.pread(fd, 1 << 16, len(data))
                if not chunk:
                    break
                data += chunk
            for line in data.decode(errors="replace").splitlines()[1:]:
                # Netlink sockets of the kernel itself (port id 0) are part of every namespace.
                if name == "netlink" and line.split()[2:3] == ["0"]:
                    continue
                left.append(f"{name}: {line.strip()}")
        return left

    def _clear_network(self) -> None:
        """Replace the shared network namespace if the last execution left a socket in it (the
        socket and its namespace live on, unreachable, until the kernel collects them)."""
        if L.CLONE_NEWNET not in self.ns_fds or not self._sockets_left():
            return
        try:
            fds, tables = self._fresh_namespaces(L.CLONE_NEWNET)
        except OSError:
            fds, tables = {}, {}  # executions then make a fresh one each (see `init_main`)
        for fd in (self.ns_fds.pop(L.CLONE_NEWNET), *self._net_tables.values()):
            os.close(fd)
        self.ns_fds.update(fds)
        self._net_tables = tables

    def describe(self) -> dict:
        return {"pid": os.getpid(), "plan": self.plan.to_dict(), "preloaded": self.preloaded,
                "cgroup": self.cgroup.capabilities if self.cgroup else {}, "kernel": os.uname().release,
                "python": sys.version.split()[0]}

    # ------------------------------------------------------------------------------------------
    # the zygote

    @property
    def _zygote(self) -> tuple[int, socket.socket] | None:
        """(pid, socket) of the zygote serving the current execution, if it runs."""
        return self._zygotes.get(self._active)

    def _kind(self, req: dict) -> str:
        """Which zygote forks this request's init. An exec'd program gains nothing from the
        preloaded modules, but forking them (twice per execution: the init, then the program)
        costs page-table copies, copy-on-write faults and teardown in proportion to the heap
        they fill: with pytest preloaded that made exec'd executions about 20% slower
        (experiments/bench_sandbox.py, case python_min)."""
        return "lean" if self.preloaded and req.get("inprocess_code") is None else "warm"

    def _start_zygote(self, kind: str) -> None:
        """Start the zygote of `kind`: "warm" is forked from this heap (every preload in it, no
        request yet); "lean" is a fresh interpreter (``python -s -m rlcode.sandbox.worker
        --zygote``) running the same `_zygote_main`, started from here so that it inherits the
        worker's namespaces, credentials, session keyring and cgroups, and nothing else."""
        isolation.note_project_modules()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                if kind == "lean":
                    keep = (theirs.fileno(), self.self_pidns)
                    for fd in keep:
                        os.set_inheritable(fd, True)
                    python = sys.executable
                    os.chdir(_PACKAGE_ROOT)
                    os.execve(python, [python, "-s", "-m", "rlcode.sandbox.worker", "--zygote", *map(str, keep),
                                       str(me)], {k: v for k, v in os.environ.items() if k in ("PATH", "LANG")})
                _zygote_main(theirs, self.self_pidns, me)
            finally:
                os._exit(1)
        theirs.close()
        self._zygotes[kind] = (pid, ours)
        self._me = frozenset({me, *(p for p, _ in self._zygotes.values())})

    def _stop_zygote(self) -> None:
        """End every zygote (an init not reaped yet dies with its zygote: PDEATHSIG)."""
        zygotes, self._zygotes = self._zygotes, {}
        self._me = frozenset({os.getpid()})
        if self._pending is not None:
            os.close(self._pending[1])
            self._pending = None
        for pid, sock in zygotes.values():
            sock.close()
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def _lose_zygote(self) -> None:
        """The zygote is gone or confused: end it, answer, then exit (see the module docstring)."""
        self._stop_zygote()
        self.stop_requested = True

    def _zygote_recv(self, timeout: float | None) -> tuple[bytes, list[int]] | None:
        """One message from the zygote (None on timeout); ZygoteLost if it is gone."""
        if self._zygote is None:
            raise ZygoteLost("no zygote")
        sock = self._zygote[1]
        sock.settimeout(timeout)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
        except TimeoutError:
            return None
        except OSError as e:
            raise ZygoteLost(f"zygote connection failed: {e}") from e
        finally:
            if self._zygote is not None:
                sock.settimeout(None)
        if not msg:
            raise ZygoteLost("the zygote exited")
        return msg, fds

    def _spawn(self, fds: list[int], init: list) -> None:
        """Have the zygote fork an init with `fds` (`isolation.INIT_FDS`, then namespaces). The
        answer is not awaited (the worker goes on feeding the execution meanwhile): `_spawned`
        reads it into `init` ([pid, pidfd]) when it is needed or arrives."""
        if self._zygote is None:
            self._start_zygote(self._active)
        flags = (_FLAG_PIDNS if self.plan.pidns else 0) | (
            _FLAG_SETNS if self.plan.pidns and self.plan.pidns_setns else 0)
        try:
            socket.send_fds(self._zygote[1], [b"S" + bytes([flags])], fds)
        except OSError as e:
            raise ZygoteLost(f"cannot reach the zygote: {e}") from e
        init.append(None)  # asked, not answered

    def _spawned(self, init: list, owned: set) -> None:
        """Read the zygote's answer to `_spawn` into `init`, if not read yet."""
        if init != [None]:
            return
        got = self._zygote_recv(SPAWN_SECONDS)
        if got is None:
            raise ZygoteLost("the zygote did not answer")
        msg, rfds = got
        if msg[:1] == b"F":
            init.clear()
            raise OSError(_PID.unpack(msg[1:5])[0], "the zygote could not fork the init")
        if msg[:1] != b"P" or len(rfds) != 1:
            for fd in rfds:
                os.close(fd)
            raise ZygoteLost(f"unexpected message from the zygote: {msg[:1]!r}")
        init[:] = [_PID.unpack(msg[1:5])[0], rfds[0]]
        owned.add(rfds[0])

    def _await_init(self, pid: int, timeout: float) -> tuple[int, float] | None:
        """(wait status, CPU seconds) of the init `pid` once the zygote has reaped it, or None
        if that did not happen within `timeout`."""
        end = time.monotonic() + timeout
        while True:
            got = self._zygote_recv(max(0.0, end - time.monotonic()))
            if got is None:
                return None
            msg, fds = got
            for fd in fds:
                os.close(fd)
            if msg[:1] != b"D":
                raise ZygoteLost(f"unexpected message from the zygote: {msg[:1]!r}")
            done_pid, status, cpu = _DONE.unpack(msg[1:])
            if done_pid == pid:
                return status, cpu

    def _hard_kill(self, pidfd: int) -> None:
        """SIGKILL the init (pid 1 of the execution's PID namespace: it takes everything with it;
        without one the zygote kills the orphans, and the slot's cgroup is emptied)."""
        if not self.plan.pidns and self.cgroup is not None and self.cgroup.dirs:
            self.cgroup.kill_all(timeout=1.0, exclude=self._me)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------------------------------
    # template mount namespaces

    def _view(self, req: dict) -> tuple[int | None, list]:
        """(template, rules below /tmp) of this request's filesystem view, made once per set of
        rules and kept. The template is a mount namespace holding the part of the view that
        does not change between executions (`isolation.build_root`): each init enters a copy of
        it and only adds its own /tmp, /proc and working copy, several times cheaper than
        building the view. None (the init builds the whole view) without the mount API of
        Linux 5.2 or if it cannot be made."""
        if self._mount_api is None:
            try:
                os.close(L.new_mount("tmpfs"))
                os.close(L.open_tree("/"))
                self._mount_api = True
            except OSError:
                self._mount_api = False
        limits = req["limits"]
        exposed = [*limits["exposed_paths"], *self.expose]
        hidden = [*limits["hidden_paths"], *req.get("hide", ()), *self.hide]
        key = (repr(self.plan.to_dict()), tuple(exposed), tuple(hidden))
        view = self._templates.get(key)
        if view is None:
            fd = self._build_template(exposed, hidden) if self._mount_api else None
            view = (fd, isolation.tmp_rules(exposed, hidden))
            if len(self._templates) >= MAX_TEMPLATES:
                old = self._templates.pop(next(iter(self._templates)))[0]
                if old is not None:
                    os.close(old)
            self._templates[key] = view
        return view

    def _build_template(self, exposed: list[str], hidden: list[str]) -> int | None:
        ok_r, ok_w = os.pipe2(os.O_CLOEXEC)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            try:
                L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
                isolation.close_fds_except({ok_w, go_r})
                L.unshare(L.CLONE_NEWNS)
                isolation.build_root(self.plan, exposed=exposed, hidden=hidden)
                isolation.enter_root()
                os.write(ok_w, b"1")
                os.read(go_r, 1)  # until the worker holds the namespace
                os._exit(0)
            except BaseException as e:  # noqa: BLE001
                try:
                    os.write(ok_w, f"{type(e).__name__}: {e}".encode()[:2000])
                finally:
                    os._exit(1)
        os.close(ok_w)
        os.close(go_r)
        fd = None
        try:
            ready, _, _ = select.select([ok_r], [], [], SPAWN_SECONDS)
            msg = os.read(ok_r, 4096) if ready else b"timed out"
            if msg == b"1":
                fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            elif not any(n.startswith("no template mount namespace") for n in self.plan.notes):
                self.plan.notes.append(f"no template mount namespace ({msg.decode(errors='replace')}): "
                                       "every execution builds its own filesystem view")
        finally:
            os.close(ok_r)
            os.close(go_w)
            try:
                if fd is None:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        return fd

    def _drop_templates(self) -> None:
        for fd, _ in self._templates.values():
            if fd is not None:
                os.close(fd)
        self._templates.clear()

    # ------------------------------------------------------------------------------------------
    # one execution

    def _prepare_cgroup(self, limits: dict) -> None:
        want = (int(limits["processes"]) + 8,  # + this worker, the zygote, the init and helpers
                int(limits["memory_bytes"] if limits.get("memory_bytes") else limits["address_space_bytes"]))
        if want != self._cg_limits:
            self.cgroup.set_limits(pids=want[0], memory_bytes=want[1])
            self._cg_limits = want

    def execute(self, req: dict, control: socket.socket | None = None, probe: bool = False,
                job_id=None) -> dict:
        self.finish_pending()
        if self._fresh_zygotes:
            self._stop_zygote()  # `_spawn` starts the next one
        self._active = self._kind(req)
        self._clear_network()
        plan = self.plan
        limits = req["limits"]
        timeout = float(req["timeout"])
        t0 = time.monotonic()
        stdin_data = req.get("stdin")
        cleanup_dir = None
        owned: set[int] = set()
        init: list = []  # [pid, pidfd] of the init once the zygote has answered
        try:
            if self.stop_requested and not self._zygotes:
                raise ZygoteLost("the zygote was lost earlier")
            ns = list(self.ns_fds.items())
            template, tmp_rules = self._view(req) if plan.fs else (None, [])
            if req.get("workdir") is not None and not isolation.under(req["workdir"], "/tmp"):
                template = None  # its mount point would stay in the template (`finish_view`)
            if template is not None:
                ns.append((L.CLONE_NEWNS, template))
            req = dict(req, stdin=None, plan=plan.to_dict(), python_bin_dir=self.python_bin_dir,
                       sys_path=self.sys_path, expose=self.expose, hide=[*req.get("hide", ()), *self.hide],
                       ns_flags=[flag for flag, _ in ns], tmp_rules=tmp_rules)
            if not plan.fs:
                # No mount namespace: the private working copy is a host directory of ours.
                cleanup_dir = tempfile.mkdtemp(prefix="rlcode-sandbox-", dir=self.tmp_root)
                if plan.drop_uid:
                    os.chown(cleanup_dir, plan.uid, plan.gid)
                req["host_cwd"] = cleanup_dir
            use_cg = self.cgroup is not None and self.cgroup.dirs and not probe
            if use_cg:
                self._prepare_cgroup(limits)
                oom0, cpu0, own0 = self.cgroup.oom_kills(), self.cgroup.cpu_seconds(), _own_cpu()

            def pipe() -> tuple[int, int]:
                r, w = os.pipe2(os.O_CLOEXEC)
                owned.update((r, w))
                return r, w

            rq_r, rq_w = pipe()
            out_r, out_w = pipe()
            err_r, err_w = pipe()
            rep_r, rep_w = pipe()
            stop_r, stop_w = pipe()
            if stdin_data is None:
                in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), None
                owned.add(in_r)
            else:
                in_r, in_w = pipe()
            # The request goes into its pipe before the init exists (up to a pipe's capacity), so
            # that the init finds it there at once; the zygote only passes the descriptor on.
            request = memoryview(_wire.dumps(req))
            os.set_blocking(rq_w, False)
            try:
                request = request[os.write(rq_w, request[:1 << 16]):]
            except BlockingIOError:
                pass
            outgoing = {rq_w: request}
            if in_w is not None:
                outgoing[in_w] = memoryview(bytes(stdin_data))
            child = [rq_r, in_r, out_w, err_w, rep_w, stop_r]
            self._spawn(child + [fd for _, fd in ns], init)
            for fd in child:
                os.close(fd)
                owned.discard(fd)
            res = self._monitor(init, t0, timeout, limits, out_r, err_r, rep_r, stop_w, outgoing,
                                control, job_id, owned)
            if use_cg:
                cpu1 = self.cgroup.cpu_seconds()
                if cpu0 is not None and cpu1 is not None:  # minus our own share of the cgroup
                    res["cpu_time"] = max(0.0, cpu1 - cpu0 - (_own_cpu() - own0))
                res["oom"] = self.cgroup.oom_kills() > oom0
                if self._pending is None:
                    self._sweep_cgroup()
            self._classify(res, limits)
            return res
        except Exception as e:  # noqa: BLE001 - the sandbox failed, not the program
            if isinstance(e, ZygoteLost):
                self._lose_zygote()
            return {"status": "infra", "info": f"worker error: {type(e).__name__}: {e}",
                    "stdout": b"", "stderr": traceback.format_exc().encode()[-4000:],
                    "returncode": None, "wall_time": time.monotonic() - t0, "cpu_time": None,
                    "stdout_truncated": False, "stderr_truncated": False}
        finally:
            if init and self._zygote is not None:
                # A failure of ours mid-execution: end the init, reap it before the next one.
                try:
                    self._spawned(init, owned)
                except (OSError, ZygoteLost):
                    init.clear()
                if init and init[1] in owned:
                    self._hard_kill(init[1])
                    owned.discard(init[1])
                    self._pending = (init[0], init[1], self._active)
            for fd in owned:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if cleanup_dir is not None:
                fstree.remove(cleanup_dir)

    def _sweep_cgroup(self) -> None:
        if self.cgroup is not None and self.cgroup.dirs and self.cgroup.pids() - self._me:
            self.cgroup.kill_all(exclude=self._me)

    def finish_pending(self) -> None:
        """Wait for the zygote to reap the init of the last execution, if that was left for
        after the reply; SIGKILL it if it lingers."""
        if self._pending is None:
            return
        pid, pidfd, self._active = self._pending
        self._pending = None
        try:
            if self._await_init(pid, DRAIN_SECONDS) is None:
                self._hard_kill(pidfd)
                if self._await_init(pid, DRAIN_SECONDS) is None:
                    raise ZygoteLost("the init of the last execution did not exit")
        except ZygoteLost:
            self._lose_zygote()
        finally:
            os.close(pidfd)
        self._sweep_cgroup()

    def _monitor(self, init, t0, timeout, limits, out_r, err_r, rep_r, stop_w, outgoing, control,
                 job_id, owned) -> dict:
        cap = int(limits["output_bytes"])
        bufs = {out_r: bytearray(), err_r: bytearray()}
        trunc = {out_r: False, err_r: False}
        report = bytearray()
        poller = select.poll()

        def close(fd: int) -> None:
            os.close(fd)
            owned.discard(fd)

        reading = {out_r, err_r, rep_r}
        for fd in reading:
            poller.register(fd, select.POLLIN)
        views = {}
        for fd, view in outgoing.items():
            if not view:
                close(fd)
                continue
            os.set_blocking(fd, False)
            views[fd] = view
            poller.register(fd, select.POLLOUT)
        if control is not None:
            poller.register(control.fileno(), select.POLLIN)
        zfd = self._zygote[1].fileno()  # the zygote's answer to `_spawn`: the init's pidfd
        poller.register(zfd, select.POLLIN)

        def spawned() -> None:
            if init == [None]:
                poller.unregister(zfd)
                self._spawned(init, owned)

        deadline = t0 + timeout
        killed = None  # why the execution was stopped before its end
        stop_at = None  # when the init was asked to stop it
        hard = False  # the init was SIGKILLed
        drain_until = None
        final_seen = False  # the init reported, after killing and reaping everything else

        def stop(why: str) -> None:
            nonlocal killed, stop_at
            killed = killed or why
            if stop_at is None:
                stop_at = time.monotonic()
                try:
                    os.write(stop_w, b"s")
                except OSError:
                    pass

        def kill_hard() -> None:
            nonlocal hard, drain_until
            hard = True
            spawned()
            self._hard_kill(init[1])
            drain_until = time.monotonic() + DRAIN_SECONDS

        while reading - ({rep_r} if final_seen else set()):
            now = time.monotonic()
            if killed is None and now >= deadline:
                stop("timeout")
            if stop_at is not None and not (hard or final_seen) and now >= stop_at + STOP_GRACE_SECONDS:
                kill_hard()
            if drain_until is not None and now >= drain_until:
                if hard:
                    break
                killed = killed or "lingering"
                kill_hard()
                continue
            times = [drain_until]
            if killed is None:
                times.append(deadline)
            if stop_at is not None and not (hard or final_seen):
                times.append(stop_at + STOP_GRACE_SECONDS)
            wait_ms = max(0, int((min(t for t in times if t is not None) - now) * 1000) + 1)
            for fd, _ in poller.poll(wait_ms):
                if fd == zfd:
                    spawned()
                    continue
                if fd in views:
                    try:
                        views[fd] = views[fd][os.write(fd, views[fd][:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        views[fd] = views[fd][:0]
                    if not views[fd]:
                        poller.unregister(fd)
                        close(fd)
                        del views[fd]
                    continue
                if control is not None and fd == control.fileno():
                    try:
                        msg = _wire.recv(control)
                    except (EOFError, OSError):
                        msg = ("cancel", "pool connection lost")
                        poller.unregister(fd)
                        control = None
                    if msg[0] == "stop":
                        self.stop_requested = True
                    if msg[0] == "stop" or msg[1] in (job_id, "pool connection lost"):
                        stop("cancelled")
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    poller.unregister(fd)
                    close(fd)
                    reading.discard(fd)
                    if fd == rep_r and drain_until is None:
                        drain_until = time.monotonic() + DRAIN_SECONDS  # the init is gone
                    continue
                if fd == rep_r:
                    report += chunk
                    if not final_seen and any(line.startswith(b"R") for line in bytes(report).split(b"\n")[:-1]):
                        final_seen = True
                        if drain_until is None:
                            drain_until = time.monotonic() + DRAIN_SECONDS
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if len(chunk) > room:
                    buf += chunk[:max(room, 0)]
                    trunc[fd] = True
                    stop("output_limit")
                else:
                    buf += chunk
        for fd in reading:
            poller.unregister(fd)
            close(fd)
        for fd in views:
            close(fd)
        wall = time.monotonic() - t0
        spawned()
        pid, pidfd = init
        init_status = cpu = None
        if final_seen:
            # Every process of the program is gone and the working copy is back; only the
            # init's own exit (and the teardown of its namespaces) is left: after the reply.
            owned.discard(pidfd)
            self._pending = (pid, pidfd, self._active)
        else:
            done = self._await_init(pid, DRAIN_SECONDS)
            if done is None:
                killed = killed or "lingering"
                self._hard_kill(pidfd)
                done = self._await_init(pid, DRAIN_SECONDS)
                if done is None:
                    raise ZygoteLost("the init did not exit after SIGKILL")
            init_status, cpu = done
            close(pidfd)
            wall = time.monotonic() - t0
        errors, notes, final = [], [], None
        for line in bytes(report).decode("utf-8", "replace").splitlines():
            if line.startswith("E"):
                errors.append(line[1:])
            elif line.startswith("I"):
                notes.append(line[1:])
            elif line.startswith("R"):
                try:
                    status, cpu_s = line[1:].split()
                    final = {"status": int(status), "cpu": float(cpu_s)}
                except ValueError:
                    errors.append("malformed report")
        res = {"stdout": bytes(bufs[out_r]), "stderr": bytes(bufs[err_r]),
               "stdout_truncated": trunc[out_r], "stderr_truncated": trunc[err_r],
               "wall_time": wall, "killed": killed, "setup_errors": errors, "notes": notes,
               "init_status": init_status, "returncode": None, "info": "", "cpu_time": cpu}
        if final is not None:
            res["returncode"] = isolation.wait_status_to_returncode(final["status"])
            res["cpu_time"] = max(final["cpu"], res["cpu_time"] or 0.0)
        return res

    @staticmethod
    def _classify(res: dict, limits: dict) -> None:
        killed = res.pop("killed")
        errors = res.pop("setup_errors")
        notes = res.pop("notes")
        init_status = res.pop("init_status")
        oom = res.pop("oom", False)
        rc = res["returncode"]
        if killed == "cancelled":
            res.update(status="infra", info="cancelled", returncode=None)
        elif errors:
            res.update(status="infra", info="; ".join(errors)[:2000], returncode=None)
        elif killed == "output_limit":
            which = " and ".join(n for n in ("stdout", "stderr") if res[f"{n}_truncated"])
            res.update(status="output_limit", info=f"{which} exceeded {limits['output_bytes']} bytes",
                       returncode=-signal.SIGKILL)
        elif killed == "timeout":
            res.update(status="timeout", info="wall-clock timeout", returncode=-signal.SIGKILL)
        elif oom:
            res.update(status="memory", info="memory cgroup limit (OOM kill)")
        elif rc is None:
            res.update(status="infra", info=f"sandbox init died (wait status {init_status}"
                       f"{', ' + killed if killed else ''})")
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and (
                rc == -signal.SIGXCPU or (res["cpu_time"] or 0.0) >= 0.9 * limits["cpu_seconds"]):
            res.update(status="timeout", info="CPU time limit")
        elif rc == -signal.SIGXFSZ:
            res.update(status="error", info="file size limit")
        elif rc != 0 and any(m in res["stderr"][-8192:] for m in MEMORY_MARKERS):
            res.update(status="memory", info="allocation failed under the address-space limit")
        elif rc == 0:
            res.update(status="ok")
        else:
            res.update(status="error")
        if notes:
            res["info"] = "; ".join(filter(None, [res["info"], *notes]))[:2000]


def serve(sock: socket.socket, parent_pid: int) -> None:
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)
    cfg = _wire.recv(sock)
    try:
        worker = Worker(cfg)
        info = worker.describe()
        if cfg.get("probe"):
            info["probe"] = probe_lib.run(worker, cfg.get("python") or sys.executable)
    except Exception as e:  # noqa: BLE001
        _wire.send(sock, ("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    _wire.send(sock, ("ready", info))
    while True:
        try:
            msg = _wire.recv(sock)
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "run":
            res = worker.execute(msg[1], control=sock, job_id=msg[2])
            if worker.stop_requested:  # e.g. a zygote was lost: the pool replaces us before its next request
                res["worker_exiting"] = True
            try:
                _wire.send(sock, ("result", msg[2], res))
            except OSError:
                return
            worker.finish_pending()
            if worker.stop_requested:
                return


def oneshot() -> None:
    """Read (cfg, plan, request) from stdin, run it, write the result to stdout."""
    raw = sys.stdin.buffer.read()
    cfg, plan, req = _wire.loads(raw[8:])
    worker = Worker(cfg, plan=isolation.Plan.from_dict(plan))
    res = worker.execute(req)
    worker.finish_pending()
    sys.stdout.buffer.write(_wire.dumps(res))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--oneshot"]:
        oneshot()
    elif sys.argv[1:2] == ["--zygote"]:  # the lean zygote (`Worker._start_zygote`)
        sock_fd, pidns_fd, parent = map(int, sys.argv[2:5])
        gc.freeze()
        _zygote_main(socket.socket(fileno=sock_fd), pidns_fd, parent)
    else:
        fd, parent = int(os.environ.pop("RLCODE_SANDBOX_FD")), int(os.environ.pop("RLCODE_SANDBOX_PARENT"))
        serve(socket.socket(fileno=fd), parent)
