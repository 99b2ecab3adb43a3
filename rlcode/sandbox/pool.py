"""`SandboxPool`: pre-started fork-server workers that run untrusted programs in isolation.

    from rlcode.sandbox import SandboxPool, Limits

    pool = SandboxPool(num_workers=8, limits=Limits(cpu_seconds=10, wall_seconds=20))  # early!
    import jax  # only after the pool exists (see below)
    res = pool.run_python("print(sum(range(10)))", timeout=5)
    futs = [pool.submit(["python", "-m", "pytest", "-q"], workdir=d, timeout=60) for d in dirs]
    results = pool.gather(futs, min_fraction=0.75, deadline=90)   # None = not finished in time

Workers. Each worker is a fresh interpreter started with an empty environment (it never sees the
trainer's secrets, parameters or accelerator state) that forks one sandbox per execution; no
Python interpreter is started per execution unless the program itself is Python run with
`run_python(..., inprocess=False)` (an exec of the candidate's interpreter). With
`inprocess=True` the code runs in the forked, isolated child of the already warm worker
interpreter (pytest imported and warmed up by one session), which is what makes short Python
executions cheap. A worker that dies mid-execution yields an "infra" result and is restarted on
the next execution; a worker silent past the timeout plus a grace period is killed likewise.

Create the pool early, before importing JAX: the workers are spawned by fork+exec, so a pool
created later still works (it warns once), but spawning from a process that already holds XLA's
thread pools and device mappings is slower and keeps those mappings alive in the child until the
exec. Worker restarts happen whenever needed and are always fresh interpreters.

Results (`ExecResult`, see `spec.py`): stdout and stderr are bytes, each cut at
`Limits.output_bytes`. The worker reads both pipes as they fill; the moment either exceeds the
cap it kills the execution (status "output_limit", the first `output_bytes` bytes kept), so a
program printing gigabytes costs milliseconds, not the time to drain it.

Working copy: with `files` only, a fresh directory (/tmp/work) on the execution's private tmpfs,
gone afterwards. With `workdir`, that host directory is used in place (visible at its own path,
the only writable host path); when the pool runs as root, the tree is handed to the slot's
sandbox uid for the execution and given back to its owner afterwards, so one workdir cannot be
shared by two executions at once (the pool serialises executions on the same workdir). Only
RLIMIT_FSIZE (per file) bounds what is written there.

Isolation of every execution and what each mechanism guarantees: see `isolation.py` and
`guarantees()`; the pool warns once per missing mechanism. Optional cgroup layer: one leaf per
worker slot (pids.max, memory limit, CPU accounting, kill) where this process may create children
of its own cgroups (`cgroups.py`); the worker itself lives in it, which keeps the per-execution
cost of cgroups at zero.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import warnings

import rlcode
from rlcode.sandbox import _linux as L
from rlcode.sandbox import _wire
from rlcode.sandbox import cgroups as cg_lib
from rlcode.sandbox import isolation
from rlcode.sandbox.spec import ExecResult, Limits

log = logging.getLogger("rlcode.sandbox")

WORKER_GRACE_SECONDS = 15.0  # past timeout + this, a silent worker is presumed hung and killed
START_TIMEOUT_SECONDS = 120.0
DEFAULT_UID_BASE = 2_100_000_000


class SandboxWarning(UserWarning):
    """A sandbox guarantee does not hold on this machine, or the pool was created late."""


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message)
    warnings.warn(message, SandboxWarning, stacklevel=3)


class SandboxFuture(cf.Future):
    """A Future of an `ExecResult`; `job_id` identifies it for cancellation."""

    job_id: int = -1


class _Job:
    __slots__ = ("job_id", "request", "future", "timeout", "cancel_requested")

    def __init__(self, job_id: int, request: dict, timeout: float):
        self.job_id = job_id
        self.request = request
        self.timeout = timeout
        self.cancel_requested = False
        self.future = SandboxFuture()
        self.future.job_id = job_id
        self.future._job = self


def _is_source_checkout(root: str) -> bool:
    """A repository checkout (not an installed site-packages, which executions need to see)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    root = os.path.realpath(root)
    return (root != "/" and not any(root == p or root.startswith(p + os.sep) for p in prefixes)
            and any(os.path.exists(os.path.join(root, m)) for m in ("setup.py", "pyproject.toml", ".git")))


def _spawn_env() -> dict[str, str]:
    return {"PATH": isolation.DEFAULT_PATH, "LANG": "C.UTF-8"}


class _Slot:
    """One worker process and the thread that feeds it jobs."""

    def __init__(self, pool: "SandboxPool", index: int):
        self.pool = pool
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.info: dict | None = None
        self.start_error: str | None = None
        self.ready = threading.Event()
        self.send_lock = threading.Lock()
        self.current: _Job | None = None
        self.cgroup: cg_lib.SlotCgroup | None = None
        self.restarts = 0
        self.thread = threading.Thread(target=self._loop, name=f"sandbox-slot-{index}", daemon=True)

    # The worker is always spawned from this slot's own thread: PR_SET_PDEATHSIG in the worker
    # fires when the *thread* that forked it exits, and this thread lives exactly as long as the
    # slot does.
    def _start_worker(self) -> None:
        self.start_error = None
        if self.cgroup is not None:
            self.cgroup.kill_all()
        parent_sock, child_sock = socket.socketpair()
        try:
            env = dict(_spawn_env(), RLCODE_SANDBOX_FD=str(child_sock.fileno()),
                       RLCODE_SANDBOX_PARENT=str(os.getpid()))
            proc = subprocess.Popen(
                [self.pool.python, "-s", "-m", "rlcode.sandbox.worker"],
                pass_fds=(child_sock.fileno(),), env=env, cwd=self.pool._package_root,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            child_sock.close()
        self.proc, self.sock = proc, parent_sock
        cfg = {"slot": self.index, "uid": self.pool.uid_base + self.index,
               "cgroup_dirs": [d for _, d in self.cgroup.dirs] if self.cgroup else [],
               "preload": list(self.pool.preload), "disable": list(self.pool.disable),
               "limits": self.pool.limits.to_dict(), "python": self.pool.python}
        try:
            parent_sock.settimeout(START_TIMEOUT_SECONDS)
            _wire.send(parent_sock, cfg)
            kind, payload = _wire.recv(parent_sock)
            parent_sock.settimeout(None)
        except (OSError, EOFError) as e:
            self._kill_worker()
            raise RuntimeError(f"sandbox worker {self.index} did not start: {e}") from e
        if kind != "ready":
            self._kill_worker()
            raise RuntimeError(f"sandbox worker {self.index} failed to start: {payload}")
        self.info = payload

    def _kill_worker(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.sock is not None:
            self.sock.close()
        self.proc = self.sock = None
        if self.cgroup is not None:
            self.cgroup.kill_all()

    def _stop_worker(self) -> None:
        if self.proc is None:
            return
        try:
            with self.send_lock:
                _wire.send(self.sock, ("stop",))
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill_worker()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cancel(self, job_id: int) -> None:
        job = self.current
        if job is None or job.job_id != job_id or self.sock is None:
            return
        try:
            with self.send_lock:
                _wire.send(self.sock, ("cancel", job_id))
        except OSError:
            pass

    def _loop(self) -> None:
        try:
            self._start_worker()
        except Exception as e:  # noqa: BLE001
            self.start_error = str(e)
        finally:
            self.ready.set()
        q = self.pool._queue
        while True:
            job = q.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            res = self._run(job)
            job.future.set_result(res)
        self._stop_worker()

    def _run(self, job: _Job) -> ExecResult:
        if not self.alive():
            if self.proc is not None:
                self._kill_worker()
            try:
                self.restarts += 1
                log.warning("restarting sandbox worker %d", self.index)
                self._start_worker()
            except Exception as e:  # noqa: BLE001
                return ExecResult.infra(f"sandbox worker could not be (re)started: {e}")
        workdir_lock = self.pool._workdir_lock(job.request["workdir"])
        if workdir_lock is not None:
            workdir_lock.acquire()
        if job.cancel_requested:  # while it waited for its workdir
            if workdir_lock is not None:
                workdir_lock.release()
            return ExecResult.infra("cancelled")
        self.current = job
        t0 = time.monotonic()
        try:
            with self.send_lock:
                _wire.send(self.sock, ("run", job.request, job.job_id))
            if job.cancel_requested:  # a cancel that raced with our taking the job
                self.cancel(job.job_id)
            self.sock.settimeout(job.timeout + WORKER_GRACE_SECONDS)
            while True:
                msg = _wire.recv(self.sock)
                if msg[0] == "result" and msg[1] == job.job_id:
                    break
            self.sock.settimeout(None)
        except (OSError, EOFError) as e:
            what = "hung" if isinstance(e, TimeoutError) else "died"
            self._kill_worker()
            return ExecResult.infra(f"sandbox worker {what} during the execution ({e})",
                                    wall_time=time.monotonic() - t0)
        finally:
            self.current = None
            if workdir_lock is not None:
                workdir_lock.release()
        fields = ExecResult.__dataclass_fields__
        return ExecResult(**{k: v for k, v in msg[2].items() if k in fields})


class SandboxPool:
    """Pool of isolated executors (REFERENCE.md §11). Thread-safe; use as a context manager.

    Args:
      num_workers: concurrent executions (one pre-started fork-server process each).
      limits: default `Limits` of every execution (overridable per call).
      uid_base: when the pool runs as real root, worker slot i runs programs as host uid/gid
        uid_base + i (unused ids; nothing on the host belongs to them).
      preload: modules the workers import up front for `inprocess=True` Python (skipped when not
        installed).
      python: interpreter of the workers and of `run_python(..., inprocess=False)`.
      use_cgroups: create one leaf cgroup per slot where the machine allows it.
      hide_repository: hide this repository's checkout (trainer and grader code, configs, runs/
        with checkpoints and logs) from every execution, like a `Limits.hidden_paths` entry
        (a workdir inside it stays reachable). Only when rlcode runs from a source checkout.
      disable: mechanisms to switch off (diagnostics and tests), any of "userns", "uid", "pid",
        "mount", "net", "ipc", "uts", "cgroup", "fs", "mount_setattr", "program_userns", "cgroups".
    """

    def __init__(self, num_workers: int = 2, limits: Limits = Limits(), *,
                 uid_base: int = DEFAULT_UID_BASE, preload: tuple[str, ...] = ("pytest",),
                 python: str | None = None, use_cgroups: bool = True, hide_repository: bool = True,
                 disable: tuple[str, ...] = ()):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if any(m in sys.modules for m in ("jax", "jaxlib")):
            _warn_once("jax", "rlcode.sandbox: SandboxPool created after jax was imported; it works "
                       "(workers are fork+exec'd fresh interpreters) but create the pool before "
                       "importing jax so workers are spawned from a small process.")
        self.limits = limits
        self.uid_base = uid_base
        self.preload = tuple(preload)
        self.python = python or sys.executable
        self.disable = tuple(disable)
        self._package_root = os.path.dirname(os.path.dirname(os.path.abspath(rlcode.__file__)))
        self._hide = [self._package_root] if hide_repository and _is_source_checkout(self._package_root) else []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._closed = False
        self._close_lock = threading.Lock()
        self._workdir_locks: dict[str, threading.Lock] = {}
        self._slots = [_Slot(self, i) for i in range(num_workers)]
        self._cgroup_caps: dict[str, bool] = {}
        if use_cgroups and "cgroups" not in self.disable:
            hierarchies = cg_lib.discover()
            cg_lib.remove_stale(hierarchies, "rlcode-sandbox-")
            for slot in self._slots:
                cg = cg_lib.SlotCgroup.create(f"rlcode-sandbox-{os.getpid()}-{id(self):x}-{slot.index}",
                                              hierarchies)
                slot.cgroup = cg if cg.dirs else None
            if self._slots[0].cgroup is not None:
                self._cgroup_caps = self._slots[0].cgroup.capabilities
        for slot in self._slots:
            slot.thread.start()
        for slot in self._slots:
            slot.ready.wait()
        errors = [s.start_error for s in self._slots if s.start_error]
        if errors:
            self.close()
            raise RuntimeError("sandbox pool failed to start: " + "; ".join(errors))
        self._info = self._slots[0].info
        self._announce()

    # ------------------------------------------------------------------------------------------

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop all workers, kill anything still running, remove the pool's cgroups. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for slot in self._slots:
            job = slot.current
            if job is not None:
                slot.cancel(job.job_id)
        # Fail whatever is still queued, then stop each slot thread.
        pending = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                pending.append(job)
        for job in pending:
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(ExecResult.infra("pool closed"))
        for _ in self._slots:
            self._queue.put(None)
        for slot in self._slots:
            if slot.thread.is_alive():
                slot.thread.join(timeout=60)
            slot._kill_worker()
            if slot.cgroup is not None:
                slot.cgroup.remove()

    # ------------------------------------------------------------------------------------------

    def submit(self, argv: list[str], *, files: dict | None = None, stdin: bytes | str | None = None,
               timeout: float | None = None, workdir: str | None = None, env: dict | None = None,
               limits: Limits | None = None) -> SandboxFuture:
        """Queue one execution; the Future resolves to an `ExecResult` (never raises for the
        program's failures: those are statuses).

        argv: program and arguments, resolved on the sandbox's PATH (the pool's Python bin dir,
          then the system's). files: {relative path: str | bytes} written into the working copy
          before the program starts (a script starting with "#!" is made executable).
          stdin: fed through a pipe (None: /dev/null). timeout: wall seconds (default
          `limits.wall_seconds`). workdir: existing host directory used as the working copy
          (visible at its own path, the only writable host path; otherwise the copy is a fresh
          directory /tmp/work on the execution's private tmpfs, gone afterwards). env: extra
          environment variables on top of PATH/HOME/LANG/TMPDIR. limits: this execution's
          `Limits` (default: the pool's).
        """
        if not argv or isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
            raise TypeError("argv must be a non-empty list of str")
        return self._enqueue({"argv": list(argv)}, files, stdin, timeout, workdir, env, limits)

    def _enqueue(self, what: dict, files, stdin, timeout, workdir, env, limits) -> SandboxFuture:
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        limits = limits or self.limits
        if files is not None:
            for rel in files:
                isolation.validate_relpath(rel)
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8")
        if workdir is not None:
            workdir = os.path.realpath(workdir)
            if not os.path.isdir(workdir):
                raise FileNotFoundError(f"workdir does not exist or is not a directory: {workdir}")
        timeout = float(limits.wall_seconds if timeout is None else timeout)
        request = {"argv": None, "inprocess_code": None, "args": [], **what,
                   "files": dict(files) if files else None, "stdin": stdin, "timeout": timeout,
                   "workdir": workdir, "env": dict(env) if env else None, "limits": limits.to_dict(),
                   "hide": self._hide}
        job = _Job(next(self._ids), request, timeout)
        self._queue.put(job)
        return job.future

    def run(self, argv: list[str], **kwargs) -> ExecResult:
        """Run `argv` in a sandbox and wait for it; see `submit` for the arguments."""
        return self.submit(argv, **kwargs).result()

    def submit_python(self, code: str, *, args: tuple[str, ...] = (), inprocess: bool = False,
                      **kwargs) -> SandboxFuture:
        """Python source as `python -c code *args` would run it.

        inprocess=False: exec's the pool's interpreter in the sandbox (a fresh interpreter, the
        exact semantics of `python -c`). inprocess=True: runs the code in the isolated fork of the
        warm worker interpreter (same isolation, no interpreter start-up, modules in `preload`
        already imported; differences: the worker's hash seed and already-imported modules are
        shared by all executions of that worker, and `sys.flags` are the worker's).
        """
        if not inprocess:
            return self.submit([self.python, "-c", code, *args], **kwargs)
        opts = {k: kwargs.pop(k, None) for k in ("files", "stdin", "timeout", "workdir", "env", "limits")}
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        return self._enqueue({"inprocess_code": str(code), "args": [str(a) for a in args]}, **opts)

    def run_python(self, code: str, **kwargs) -> ExecResult:
        """`submit_python(...).result()`."""
        return self.submit_python(code, **kwargs).result()

    def cancel(self, future: cf.Future) -> bool:
        """Cancel a queued execution or kill a running one (it then resolves to status "infra",
        info "cancelled"). Returns True if it was still queued."""
        if future.cancel():
            return True
        job = getattr(future, "_job", None)
        if job is not None:
            job.cancel_requested = True
        job_id = getattr(future, "job_id", None)
        for slot in self._slots:
            job = slot.current
            if job is not None and job.job_id == job_id:
                slot.cancel(job_id)
        return False

    def gather(self, futures: list[cf.Future], *, min_fraction: float = 1.0,
               deadline: float | None = None) -> list[ExecResult | None]:
        """Partial-group acceptance: wait until at least ceil(min_fraction * n) of `futures` have
        finished, or until `deadline` seconds from now, whichever comes first.

        Returns one entry per future, in order: its `ExecResult` if it had finished by then, else
        None. Unfinished ones are cancelled (queued) or killed (running) so that they free their
        worker at once; their futures then resolve to a "infra"/"cancelled" result (or are
        cancelled), which this call does not wait for.
        """
        if not 0.0 <= min_fraction <= 1.0:
            raise ValueError("min_fraction must be in [0, 1]")
        need = math.ceil(min_fraction * len(futures) - 1e-9)
        end = None if deadline is None else time.monotonic() + deadline
        done: set = {f for f in futures if f.done()}
        while len(done) < need:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            newly, _ = cf.wait([f for f in futures if f not in done], timeout=left,
                               return_when=cf.FIRST_COMPLETED)
            done |= newly
        done = {f for f in futures if f.done()}
        out = [f.result() if f in done and not f.cancelled() else None for f in futures]
        for f in futures:
            if f not in done:
                self.cancel(f)
        return out

    # ------------------------------------------------------------------------------------------

    def _workdir_lock(self, workdir: str | None) -> threading.Lock | None:
        """When programs run as per-slot uids, a workdir is handed to the slot's uid for each
        execution: executions on one workdir must then take turns (they are serialised here)."""
        if workdir is None or not self._info["plan"]["drop_uid"]:
            return None
        with self._close_lock:
            return self._workdir_locks.setdefault(workdir, threading.Lock())

    def worker_pids(self) -> list[int | None]:
        return [s.proc.pid if s.alive() else None for s in self._slots]

    def guarantees(self) -> dict[str, bool | str]:
        """Which protections hold for every execution of this pool, on this machine.

        mode: "root" (workers are real root), "userns" (workers are root of a user namespace of
          their own: the unprivileged set-up), "none" (no namespaces: rlimits, a cleared
          environment and process-tree killing only).
        *_namespace: the execution gets that namespace (network and UTS: one per worker, reused
          by its executions one after another; the others: fresh per execution).
        no_network: nothing reachable, the host's localhost included.
        readonly_host_filesystem, private_tmp, private_dev, hidden_paths: the filesystem view of
          `isolation.py`; host_processes_hidden: /proc shows the execution's processes only.
        environment_cleared: always. unprivileged: the program is not (host) root.
        distinct_uid_per_worker: programs of different slots run as different host uids.
        no_new_privileges, nested_user_namespaces_blocked: no way to regain capabilities.
        kill_whole_process_tree: every process of an execution dies at its end or timeout.
        rlimits, output_capped: always. processes_limit_per_execution: see `Limits.processes`.
        cgroup_*: the optional cgroup layer. prewarmed_python: modules in the warm workers.
        notes: why anything is missing.
        """
        plan = isolation.Plan.from_dict(self._info["plan"])
        ns = plan.ns_flags
        cg = self._cgroup_caps
        fs = plan.fs
        return {
            "mode": plan.mode,
            "user_namespace": plan.program_userns,
            "pid_namespace": plan.pidns,
            "mount_namespace": bool(ns & L.CLONE_NEWNS),
            "network_namespace": bool(ns & L.CLONE_NEWNET),
            "ipc_namespace": bool(ns & L.CLONE_NEWIPC),
            "uts_namespace": bool(ns & L.CLONE_NEWUTS),
            "cgroup_namespace": bool(ns & L.CLONE_NEWCGROUP),
            "no_network": bool(ns & L.CLONE_NEWNET),
            "readonly_host_filesystem": fs,
            "private_tmp": fs,
            "private_dev": fs,
            "hidden_paths": fs,
            "host_processes_hidden": fs and plan.pidns,
            "environment_cleared": True,
            "unprivileged": plan.drop_uid or plan.mode != "root",
            "distinct_uid_per_worker": plan.drop_uid,
            "no_new_privileges": True,
            "nested_user_namespaces_blocked": plan.block_nested_userns,
            "kill_whole_process_tree": plan.pidns or bool(cg.get("kill")),
            "rlimits": True,
            # RLIMIT_NPROC counts per (user namespace, uid) and exempts host root: it is per
            # execution with a distinct host uid per worker, or with a fresh user namespace whose
            # host uid is not root; otherwise only a pids cgroup bounds an execution.
            "processes_limit_per_execution": (plan.drop_uid or (plan.mode == "userns" and plan.program_userns)
                                              or bool(cg.get("pids"))),
            "output_capped": True,
            "cgroup_pids_limit": bool(cg.get("pids")),
            "cgroup_memory_limit": bool(cg.get("memory")),
            "cgroup_cpu_accounting": bool(cg.get("cpu")),
            "cgroup_kill": bool(cg.get("kill")),
            "prewarmed_python": ",".join(self._info.get("preloaded", [])) or "none",
            "notes": "; ".join(plan.notes),
        }

    def _announce(self) -> None:
        g = self.guarantees()
        consequences = {
            "pid_namespace": "leftover processes are killed through a subreaper (a process "
                             "that escapes it is not guaranteed to die)",
            "network_namespace": "programs can reach the network, including localhost services",
            "readonly_host_filesystem": "programs can write anywhere their uid may write, "
                                        "including other executions' files",
            "user_namespace": "RLIMIT_NPROC is not counted per execution",
            "unprivileged": "programs run as root",
            "host_processes_hidden": "programs can see host processes in /proc",
        }
        for key, what in consequences.items():
            if not g[key]:
                _warn_once(f"missing:{key}", f"rlcode.sandbox: {key.replace('_', ' ')} unavailable "
                           f"on this machine: {what}. ({g['notes']})")
        if not g["cgroup_memory_limit"] or not g["cgroup_pids_limit"]:
            _warn_once("cgroups", "rlcode.sandbox: no delegated cgroup for memory/pids: memory is "
                       "bounded per process (RLIMIT_AS) and processes by RLIMIT_NPROC only.")
