"""The fork server: one long-lived process per pool slot that runs executions one at a time.

Started by the pool as a fresh interpreter (`python -s -m rlcode.sandbox.worker`) whose
environment holds only PATH, LANG, the socket fd and the pool's pid, so it has no secrets and no
model state; it imports only the standard library, this package's light modules and, optionally,
modules to pre-warm (pytest, warmed by one tiny session) for the in-place Python mode. It joins
its slot's cgroups once. For every request it forks the execution's init (see `isolation.py`),
feeds stdin, reads stdout/stderr through capped buffers, enforces the wall-clock deadline by
killing the execution's PID namespace, and replies with a result dict. Once the init reports
(after it has killed and reaped every other process of the execution) the reply goes out first
and the init's own exit is reaped after it.

At start it decides which isolation mechanisms work on this machine (`Plan`) by trying each one
in a throwaway child, then checks the whole plan end to end, dropping mechanisms one at a time
until a trivial execution succeeds (each drop noted); the pool turns that into
`SandboxPool.guarantees()` and warnings.

`python -m rlcode.sandbox.worker --oneshot` runs a single request read from stdin with the same
code (used by the benchmark as the fresh-process-per-execution baseline).
"""

from __future__ import annotations

import gc
import os
import resource
import select
import signal
import socket
import sys
import tempfile
import time
import traceback

from rlcode.sandbox import _linux as L
from rlcode.sandbox import _wire
from rlcode.sandbox import cgroups as cg_lib
from rlcode.sandbox import isolation

DRAIN_SECONDS = 2.0  # after a kill (or the init's exit), how long to wait for pipes to close
MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory",
                  b"failed to allocate")
SHAREABLE_NS = L.CLONE_NEWNET | L.CLONE_NEWUTS
NS_NAMES = {L.CLONE_NEWNS: "mount", L.CLONE_NEWNET: "net", L.CLONE_NEWIPC: "ipc",
            L.CLONE_NEWUTS: "uts", L.CLONE_NEWCGROUP: "cgroup"}


def _children_of(pid: int) -> list[int]:
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


def kill_all_children(reaped: dict | None = None) -> None:
    """SIGKILL and reap every child of this process, repeatedly (we are a child subreaper, so
    whatever a killed child leaves behind becomes our child in turn). Wait statuses and rusage of
    the reaped go into `reaped` (pid -> (status, rusage))."""
    me = os.getpid()
    reaped = {} if reaped is None else reaped
    for _ in range(1000):
        kids = _children_of(me)
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


def _chown_tree(root: str, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                os.lchown(os.path.join(dirpath, name), uid, gid)
            except FileNotFoundError:
                pass


class Worker:
    def __init__(self, cfg: dict, plan: isolation.Plan | None = None):
        self.cfg = cfg
        self.slot = cfg.get("slot", 0)
        self.python_bin_dir = os.path.dirname(cfg.get("python") or sys.executable)
        self.sys_path = [p for p in sys.path[1:] if p]
        self.expose = sorted({p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                          sys.base_exec_prefix,
                                          os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
                              if p and p != "/"})
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
        self._me = frozenset({os.getpid()})
        self.stop_requested = False
        self._reaped: dict[int, tuple] = {}
        self._pending: tuple[int, int] | None = None
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
        self.plan = plan if plan is not None else self._decide_plan(set(cfg.get("disable", ())))
        if plan is None:
            self._make_shared_namespaces(self.plan.ns_flags & SHAREABLE_NS)
        gc.freeze()  # keep the forked children from dirtying the worker's heap pages in GC passes
        if not self.plan.pidns:
            L.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: leftovers of an execution come back to us
        if self.cgroup is not None:
            # The worker lives in its slot's cgroups, so every execution it forks starts there.
            # Moving each execution's init into them instead would cost an RCU grace period per
            # execution (cgroup migration takes a global rw-semaphore for writing; ~5-15 ms).
            # Joined last: the memory the worker allocated so far stays charged outside.
            self.cgroup.join()

    # ------------------------------------------------------------------------------------------
    # deciding what works here

    def _decide_plan(self, disable: set[str]) -> isolation.Plan:
        plan = isolation.Plan()
        notes = plan.notes
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

        # End to end, degrading one mechanism at a time until a trivial execution succeeds.
        for drop in (None, "fs", "program_userns", "ns_flags", "pidns"):
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
        worker keeps the guarantee: executions of a worker never overlap in time, nothing in the
        namespace outlives the processes of an execution (it has only a loopback device, down,
        that nobody in it may configure: no execution holds capabilities over it), so an
        execution cannot reach anything, nor leave anything behind for the next one. IPC, mount,
        PID, cgroup and user namespaces stay fresh per execution (SysV IPC objects, for one,
        would persist).
        """
        if not flags:
            return
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
        try:
            if ok:
                for flag, name in ((L.CLONE_NEWNET, "net"), (L.CLONE_NEWUTS, "uts")):
                    if flags & flag:
                        self.ns_fds[flag] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
                self.plan.shared_ns = sum(self.ns_fds)
        finally:
            os.close(go_w)
            os.waitpid(pid, 0)

    def describe(self) -> dict:
        return {"pid": os.getpid(), "plan": self.plan.to_dict(), "preloaded": self.preloaded,
                "cgroup": self.cgroup.capabilities if self.cgroup else {}, "kernel": os.uname().release,
                "python": sys.version.split()[0]}

    # ------------------------------------------------------------------------------------------
    # one execution

    def _prepare_cgroup(self, limits: dict) -> None:
        want = (int(limits["processes"]) + 8,  # + this worker, the init and helpers
                int(limits["memory_bytes"] if limits.get("memory_bytes") else limits["address_space_bytes"]))
        if want != self._cg_limits:
            self.cgroup.set_limits(pids=want[0], memory_bytes=want[1])
            self._cg_limits = want

    def execute(self, req: dict, control: socket.socket | None = None, probe: bool = False,
                job_id=None) -> dict:
        self.finish_pending()
        plan = self.plan
        limits = req["limits"]
        timeout = float(req["timeout"])
        t0 = time.monotonic()
        req = dict(req, python_bin_dir=self.python_bin_dir, sys_path=self.sys_path, expose=self.expose)
        cleanup_dir = None
        workdir = req.get("workdir")
        restore_owner = None
        fds: list[int] = []
        try:
            if workdir is not None:
                st = os.stat(workdir)
                if plan.drop_uid and (st.st_uid, st.st_gid) != (plan.uid, plan.gid):
                    restore_owner = (st.st_uid, st.st_gid)
                    _chown_tree(workdir, plan.uid, plan.gid)
            if not plan.fs:
                if workdir is None:
                    cleanup_dir = tempfile.mkdtemp(prefix="rlcode-sandbox-", dir=self.tmp_root)
                    if plan.drop_uid:
                        os.chown(cleanup_dir, plan.uid, plan.gid)
                req["host_cwd"] = workdir or cleanup_dir
            use_cg = self.cgroup is not None and self.cgroup.dirs and not probe
            if use_cg:
                self._prepare_cgroup(limits)
                oom0, cpu0, own0 = self.cgroup.oom_kills(), self.cgroup.cpu_seconds(), _own_cpu()
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
            fds += [out_r, out_w, err_r, err_w, rep_r, rep_w]
            stdin_data = req.get("stdin")
            if stdin_data is None:
                in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), None
                fds.append(in_r)
            else:
                in_r, in_w = os.pipe2(os.O_CLOEXEC)
                fds += [in_r, in_w]
                os.set_blocking(in_w, False)
            dance = plan.pidns and plan.pidns_setns
            if dance:
                L.unshare(L.CLONE_NEWPID)  # only our next child (the init) enters the new one
            try:
                pid = os.fork()
            except BaseException:
                if dance:
                    L.setns(self.self_pidns, L.CLONE_NEWPID)
                raise
            if pid == 0:
                try:
                    if plan.pidns and not dance:
                        # We may not re-enter our own PID namespace (it belongs to a user
                        # namespace we have no capabilities in), so an intermediate process
                        # unshares and forks the init; the init dies with it (PDEATHSIG).
                        L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
                        L.unshare(L.CLONE_NEWPID)
                        if os.fork() != 0:
                            isolation.close_fds_except(set())
                            try:
                                os.wait()
                            finally:
                                os._exit(0)
                    isolation.init_main(plan, req, stdin_fd=in_r, stdout_fd=out_w, stderr_fd=err_w,
                                        report_fd=rep_w, ns_fds=self.ns_fds)
                finally:
                    os._exit(isolation.EXIT_SETUP_FAILED)
            if dance:
                L.setns(self.self_pidns, L.CLONE_NEWPID)  # back to our own for the next unshare
            for fd in (in_r, out_w, err_w, rep_w):
                os.close(fd)
                fds.remove(fd)
            res = self._monitor(pid, t0, timeout, limits, out_r, err_r, rep_r, in_w,
                                bytes(stdin_data) if stdin_data is not None else b"", control, job_id)
            for fd in (out_r, err_r, rep_r, in_w):
                if fd is not None and fd in fds:
                    fds.remove(fd)
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
            return {"status": "infra", "info": f"worker error: {type(e).__name__}: {e}",
                    "stdout": b"", "stderr": traceback.format_exc().encode()[-4000:],
                    "returncode": None, "wall_time": time.monotonic() - t0, "cpu_time": None,
                    "stdout_truncated": False, "stderr_truncated": False}
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if not plan.pidns:
                kill_all_children(self._reaped)
                self._reaped.clear()
            if restore_owner is not None:
                try:
                    _chown_tree(workdir, *restore_owner)
                except OSError:
                    pass
            if cleanup_dir is not None:
                import shutil
                shutil.rmtree(cleanup_dir, ignore_errors=True)

    def _sweep_cgroup(self) -> None:
        if self.cgroup is not None and self.cgroup.dirs and self.cgroup.pids() - self._me:
            self.cgroup.kill_all(exclude=self._me)

    def finish_pending(self) -> None:
        """Reap the init of the last execution if its exit was left for after the reply."""
        if self._pending is None:
            return
        pid, fd = self._pending
        self._pending = None
        os.close(fd)
        status, _ = self._reap(pid)
        if status is None:
            self._kill(pid)
            self._reap(pid)
        self._sweep_cgroup()

    def _kill(self, pid: int) -> None:
        if not self.plan.pidns and self.cgroup is not None and self.cgroup.dirs:
            self.cgroup.kill_all(timeout=1.0, exclude=self._me)
        try:
            os.kill(pid, signal.SIGKILL)  # pid 1 of the execution's PID namespace: takes all with it
        except ProcessLookupError:
            pass
        if not self.plan.pidns:
            kill_all_children(self._reaped)

    def _reap(self, pid: int, timeout: float = DRAIN_SECONDS):
        """(wait status, rusage) of child `pid` once it exits within `timeout`, else (None, None)."""
        if pid in self._reaped:
            return self._reaped.pop(pid)
        try:
            wpid, wstatus, usage = os.wait4(pid, os.WNOHANG)
            if not wpid:
                pidfd = os.pidfd_open(pid)
                try:
                    ready, _, _ = select.select([pidfd], [], [], timeout)
                finally:
                    os.close(pidfd)
                if not ready:
                    return None, None
                wpid, wstatus, usage = os.wait4(pid, 0)
            return wstatus, usage
        except ChildProcessError:
            return self._reaped.pop(pid, (-1, None))

    def _monitor(self, pid, t0, timeout, limits, out_r, err_r, rep_r, in_w, stdin_data, control,
                 job_id) -> dict:
        cap = int(limits["output_bytes"])
        bufs = {out_r: bytearray(), err_r: bytearray()}
        trunc = {out_r: False, err_r: False}
        report = bytearray()
        poller = select.poll()
        open_fds = {out_r, err_r, rep_r}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        view = memoryview(stdin_data)
        if in_w is not None:
            if view:
                poller.register(in_w, select.POLLOUT)
            else:
                os.close(in_w)
                in_w = None
        if control is not None:
            poller.register(control.fileno(), select.POLLIN)
        deadline = t0 + timeout
        killed = None
        drain_until = None
        final_seen = False  # the init reported, after killing and reaping everything else
        while open_fds - ({rep_r} if final_seen else set()):
            now = time.monotonic()
            if killed is None and now >= deadline:
                killed = "timeout"
                self._kill(pid)
                drain_until = now + DRAIN_SECONDS
            if drain_until is not None and now >= drain_until:
                if killed is None:
                    killed = "lingering"
                    self._kill(pid)
                    drain_until = now + DRAIN_SECONDS
                    continue
                break
            limit = min(deadline, drain_until or deadline) if killed is None else drain_until
            wait_ms = max(0, int((limit - now) * 1000) + 1)
            for fd, ev in poller.poll(wait_ms):
                if fd == in_w:
                    try:
                        n = os.write(in_w, view[:65536])
                        view = view[n:]
                    except BlockingIOError:
                        continue
                    except OSError:
                        view = view[:0]
                    if not view:
                        poller.unregister(in_w)
                        os.close(in_w)
                        in_w = None
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
                    if killed is None and (msg[0] == "stop" or msg[1] in (job_id, "pool connection lost")):
                        killed = "cancelled"
                        self._kill(pid)
                        drain_until = time.monotonic() + DRAIN_SECONDS
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    open_fds.discard(fd)
                    if fd == rep_r and drain_until is None:
                        drain_until = time.monotonic() + DRAIN_SECONDS  # init is gone
                    continue
                if fd == rep_r:
                    report += chunk
                    if self.plan.pidns and not final_seen and any(
                            line.startswith(b"R") for line in bytes(report).split(b"\n")[:-1]):
                        final_seen = True
                        if drain_until is None:
                            drain_until = time.monotonic() + DRAIN_SECONDS
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if len(chunk) > room:
                    buf += chunk[:max(room, 0)]
                    trunc[fd] = True
                    if killed is None:
                        killed = "output_limit"
                        self._kill(pid)
                        drain_until = time.monotonic() + DRAIN_SECONDS
                else:
                    buf += chunk
        deferred = final_seen and rep_r in open_fds and killed is None
        for fd in open_fds:
            poller.unregister(fd)
            if not (deferred and fd == rep_r):
                os.close(fd)
        if in_w is not None:
            os.close(in_w)
        wall = time.monotonic() - t0
        if deferred:
            # Every process of the program is gone; only the init's own exit (and the teardown
            # of its namespaces) is left: reap it after the result has been sent.
            self._pending = (pid, rep_r)
            wstatus, usage = None, None
        else:
            wstatus, usage = self._reap(pid)
            if wstatus is None:
                self._kill(pid)
                killed = killed or "lingering"
                wstatus, usage = self._reap(pid, DRAIN_SECONDS)
            wall = time.monotonic() - t0
        errors, final = [], None
        for line in bytes(report).decode("utf-8", "replace").splitlines():
            if line.startswith("E"):
                errors.append(line[1:])
            elif line.startswith("R"):
                try:
                    status, cpu = line[1:].split()
                    final = {"status": int(status), "cpu": float(cpu)}
                except ValueError:
                    errors.append("malformed report")
        res = {"stdout": bytes(bufs[out_r]), "stderr": bytes(bufs[err_r]),
               "stdout_truncated": trunc[out_r], "stderr_truncated": trunc[err_r],
               "wall_time": wall, "killed": killed, "setup_errors": errors,
               "init_status": wstatus, "returncode": None, "info": "",
               "cpu_time": (usage.ru_utime + usage.ru_stime) if usage else None}
        if final is not None:
            res["returncode"] = isolation.wait_status_to_returncode(final["status"])
            res["cpu_time"] = max(final["cpu"], res["cpu_time"] or 0.0)
        return res

    @staticmethod
    def _classify(res: dict, limits: dict) -> None:
        killed = res.pop("killed")
        errors = res.pop("setup_errors")
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


def serve(sock: socket.socket, parent_pid: int) -> None:
    L.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)
    cfg = _wire.recv(sock)
    try:
        worker = Worker(cfg)
    except Exception as e:  # noqa: BLE001
        _wire.send(sock, ("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    _wire.send(sock, ("ready", worker.describe()))
    while True:
        try:
            msg = _wire.recv(sock)
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "run":
            res = worker.execute(msg[1], control=sock, job_id=msg[2])
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
    else:
        fd, parent = int(os.environ.pop("RLCODE_SANDBOX_FD")), int(os.environ.pop("RLCODE_SANDBOX_PARENT"))
        serve(socket.socket(fileno=fd), parent)
