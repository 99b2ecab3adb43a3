"""`SandboxPool`: pre-started fork-server workers that run untrusted programs in isolation.

    from rlcode.sandbox import SandboxPool, Limits

    pool = SandboxPool(num_workers=8, limits=Limits(cpu_seconds=10, wall_seconds=20))  # early!
    import jax  # only after the pool exists (see below)
    res = pool.run_python("print(sum(range(10)))", timeout=5)
    futs = [pool.submit(["python", "-m", "pytest", "-q"], workdir=d, timeout=60) for d in dirs]
    results = pool.gather(futs, min_fraction=0.75, deadline=90)   # None = not finished in time

Workers. Each worker is a fresh interpreter started with an empty environment (it never sees the
trainer's secrets, parameters or accelerator state); a copy of it forked once, before any
request (the zygote, `worker.py`), forks one sandbox per execution; no Python interpreter is
started per execution unless the program itself is Python run with
`run_python(..., inprocess=False)` (an exec of the candidate's interpreter). With
`inprocess=True` the code runs in the forked, isolated child of that warm interpreter (pytest
imported and warmed up by one session), which is what makes short Python executions cheap;
since the zygote never holds a request or a result, no execution can find an earlier one's code,
data or output in its memory. A worker that dies mid-execution yields an "infra" result and is
restarted on the next execution; a worker silent past the timeout plus a grace period is killed
likewise.

Create the pool early, before importing JAX: the workers are spawned by fork+exec, so a pool
created later still works (it warns once), but spawning from a process that already holds XLA's
thread pools and device mappings is slower and keeps those mappings alive in the child until the
exec. Worker restarts happen whenever needed and are always fresh interpreters.

Results (`ExecResult`, see `spec.py`): stdout and stderr are bytes, each cut at
`Limits.output_bytes`. The worker reads both pipes as they fill; the moment either exceeds the
cap it kills the execution (status "output_limit", the first `output_bytes` bytes kept), so a
program printing gigabytes costs milliseconds, not the time to drain it.

Working copy: with `files` only, a fresh directory (/tmp/work) on the execution's private tmpfs,
gone afterwards. With `workdir`, the program works on a private copy of that host directory at its
own path: a tmpfs bounded by `Limits.workdir_bytes` and `Limits.workdir_inodes`, filled before the
program starts and whose changes (writes, deletions, renames, modes, symlinks) are brought back
to the host directory once every process of the execution is gone, also after a timeout, an
output flood or a cancel; what is created there belongs to the directory's owner. The program
never writes the host disk itself, and nothing is left owned by a sandbox uid. Executions on the
same workdir run one after another (the pool serialises them), so each sees the previous one's
changes. See `isolation.py`.

Isolation of every execution and what each mechanism guarantees: see `isolation.py` and
`guarantees()`, whose claims a probe checks from inside executions when the pool starts
(`probe.py`); the pool warns once per missing or contradicted mechanism. Each pool holds a range
of host uids no other pool on the host uses (`UidRange`). Optional cgroup layer: one leaf per
worker slot (pids.max, memory limit, CPU accounting, kill) where this process may create children
of its own cgroups (`cgroups.py`); the worker itself lives in it, which keeps the per-execution
cost of cgroups at zero.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import errno
import fcntl
import itertools
import logging
import math
import os
import queue
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import rlcode
from rlcode.sandbox import _linux as L
from rlcode.sandbox import _wire
from rlcode.sandbox import cgroups as cg_lib
from rlcode.sandbox import isolation
from rlcode.sandbox import probe as probe_lib
from rlcode.sandbox.spec import ExecResult, Limits

log = logging.getLogger("rlcode.sandbox")

WORKER_GRACE_SECONDS = 15.0  # past timeout + this, a silent worker is presumed hung and killed
START_TIMEOUT_SECONDS = 120.0
DEFAULT_UID_BASE = 2_100_000_000  # where the tests' and tools' explicit uid ranges live
AUTO_UID_BASE = 2_110_000_000  # automatic ranges start here (above explicit ones in use)
UID_ALIGN = 16
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel


def uid_lock_dirs() -> tuple[str, ...]:
    """Where the lock file of the host's uid ranges lives: the first of these that is (or can be
    made) a directory of ours that nobody else may write."""
    return "/run/rlcode-sandbox", os.path.join(tempfile.gettempdir(), f"rlcode-sandbox-{os.geteuid()}")


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


class UidRange:
    """Host uids [first, first + n) held by one pool for its whole life, so that no two pools on
    this host, in one process or in several, run programs under the same uid (the kernel keys
    keyrings, RLIMIT_NPROC counts, file ownership, signals and ptrace by uid).

    Every pool takes an open-file-description write lock (fcntl F_OFD_SETLK, Linux >= 3.15) on
    the bytes [first, first + n) of one lock file of the host (`uid_lock_dirs`); the kernel
    drops it when the pool closes it or its process ends, however it ends, so a crashed pool
    leaves nothing held. An automatic range is the lowest free one from `AUTO_UID_BASE` (aligned
    to `UID_ALIGN`); an explicit `first` is used as asked, and `exclusive` says whether it could
    be locked (False: another pool holds part of it, or no lock file could be trusted; see `note`).
    """

    _FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64): type, whence, start, len, pid

    def __init__(self, n: int, first: int | None = None):
        self.n = n
        self.exclusive = False
        self.note = ""
        self._fd: int | None = None
        try:
            self._fd = self._open_lock_file()
        except OSError as e:
            if first is None:
                raise RuntimeError(f"cannot allocate a uid range: {e}") from e
            self.first, self.note = first, f"uid range not locked ({e})"
            return
        if first is not None:
            self.first = first
            self.exclusive = self._lock(first)
            if not self.exclusive:
                self.note = (f"uids {first}..{first + n - 1} are in use by another pool on this host "
                             "(pass no uid_base to get a range of its own)")
            return
        start = AUTO_UID_BASE
        while start + n <= MAX_UID:
            held = self._conflict(start)
            if held is None:
                if self._lock(start):
                    self.first, self.exclusive = start, True
                    return
                continue  # taken in between: look again
            start = -(-held // UID_ALIGN) * UID_ALIGN
        self.release()
        raise RuntimeError("no free uid range left for a sandbox pool")

    @staticmethod
    def _open_lock_file() -> int:
        errors = []
        for d in uid_lock_dirs():
            try:
                os.makedirs(d, 0o700, exist_ok=True)
                st = os.lstat(d)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    errors.append(f"{d} is not a private directory of ours")
                    continue
                return os.open(os.path.join(d, "uids.lock"),
                               os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                errors.append(f"{d}: {e.strerror}")
        raise OSError(errno.EACCES, "; ".join(errors))

    def _flock(self, first: int) -> bytes:
        return self._FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, first, self.n, 0)

    def _lock(self, first: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._flock(first))
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _conflict(self, first: int) -> int | None:
        """End of a lock held by another pool over [first, first + n), or None if it is free."""
        got = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, self._flock(first))
        kind, _, start, length, _ = self._FLOCK.unpack(got)
        return None if kind == fcntl.F_UNLCK else start + max(length, 1)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.exclusive = False


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
               "limits": self.pool.limits.to_dict(), "python": self.pool.python,
               "hide": list(self.pool._hide),  # the probe runs with the view of the pool's executions
               "probe": self.index == 0 and self.restarts == 0}
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
        if msg[2].get("worker_exiting"):
            # It answered and exits (it lost a zygote): not sending it the next request, which
            # could reach it before its exit shows and come back as a second infra result.
            self._kill_worker()
        fields = ExecResult.__dataclass_fields__
        return ExecResult(**{k: v for k, v in msg[2].items() if k in fields})


class SandboxPool:
    """Pool of isolated executors (docs/threat_model.md). Thread-safe; use as a context manager.

    Args:
      num_workers: concurrent executions (one pre-started fork-server process each).
      limits: default `Limits` of every execution (overridable per call).
      uid_base: when the pool runs as real root, worker slot i runs programs as host uid/gid
        uid_base + i (unused ids; nothing on the host belongs to them). None (the default): a
        range of `num_workers` uids no other pool on this host holds, allocated for the pool's
        lifetime (`UidRange`); an explicit base is used as given, and reported (guarantees()
        "distinct_uid_per_pool" False, and a warning) if another pool holds part of it.
      preload: modules the workers import up front for `inprocess=True` Python (skipped when not
        installed).
      python: interpreter of the workers and of `run_python(..., inprocess=False)`.
      use_cgroups: create one leaf cgroup per slot where the machine allows it.
      hide_repository: hide this repository's checkout (trainer and grader code, configs, runs/
        with checkpoints and logs) from every execution, like a `Limits.hidden_paths` entry
        (a workdir inside it stays reachable). Only when rlcode runs from a source checkout; the
        project's packages themselves are hidden wherever they are installed, always.
      disable: mechanisms to switch off (diagnostics and tests), any of "userns", "uid", "pid",
        "mount", "net", "ipc", "uts", "cgroup", "fs", "mount_setattr", "program_userns", "seccomp",
        "cgroups", "template" (each execution builds its whole filesystem view), "zygote" (each
        execution is forked from a zygote forked anew from the worker's heap of the moment, which
        holds earlier requests and results: a fault for tests, which the start-up probe reports
        as a contradicted no_heap_carryover).
    """

    def __init__(self, num_workers: int = 2, limits: Limits = Limits(), *,
                 uid_base: int | None = None, preload: tuple[str, ...] = ("pytest",),
                 python: str | None = None, use_cgroups: bool = True, hide_repository: bool = True,
                 disable: tuple[str, ...] = ()):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        # A pool may be created after jax was imported: workers are fresh interpreters started by
        # subprocess (fork+exec), which inherit nothing of the parent's heap. Measured on 2 cores,
        # a 2-worker pool started in 1.4-1.6 s and ran /bin/true in 15-22 ms either way.
        self.limits = limits
        self.preload = tuple(preload)
        self.python = python or sys.executable
        self.disable = tuple(disable)
        self._uids: UidRange | None = None
        if os.geteuid() == 0 and not {"root", "uid"} & set(self.disable):
            self._uids = UidRange(num_workers, uid_base)  # programs run as these host uids
        self.uid_base = self._uids.first if self._uids is not None else (
            DEFAULT_UID_BASE if uid_base is None else uid_base)
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
        if self._uids is not None:  # no program of ours runs under them any more
            self._uids.release()

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
          `limits.wall_seconds`). workdir: existing host directory the program works on, through
          a bounded private copy at the same path whose changes are brought back at the end
          (otherwise the copy is a fresh directory /tmp/work on the execution's private tmpfs,
          gone afterwards). env: extra
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
        """Executions on one workdir take turns: each works on a private copy whose changes are
        brought back at its end, and two at once would undo each other's."""
        if workdir is None:
            return None
        with self._close_lock:
            return self._workdir_locks.setdefault(workdir, threading.Lock())

    def worker_pids(self) -> list[int | None]:
        return [s.proc.pid if s.alive() else None for s in self._slots]

    def probe_report(self) -> dict:
        """What the start-up probe measured (`probe.py`): per mode ("inprocess", "exec") the raw
        measurements, what the next execution found ("carried"), whether the process tree died
        ("tree_killed"), the probe's errors and its cost in seconds."""
        return copy.deepcopy(self._info.get("probe") or {})

    def guarantees(self) -> dict[str, bool | str]:
        """Which protections hold for every execution of this pool, on this machine.

        Each claim is what the worker's plan promises AND, where marked (m), what the start-up
        probe measured from inside an in-place and an exec'd execution (`probe.py`; run once, on
        the first worker, in about 0.12 s). A claim the probe contradicts is False, its evidence
        is in `notes`, and the pool warns once.

        mode: "root" (workers are real root), "userns" (workers are root of a user namespace of
          their own: the unprivileged set-up), "none" (no namespaces: rlimits, a cleared
          environment and process-tree killing only).
        *_namespace (m): the execution has a namespace of that kind other than the worker's (network
          and UTS: one per worker, reused by its executions one after another; the others: fresh
          per execution); user_namespace also means it runs as uid 1000 there.
        no_network (m): only a loopback interface, down; connects to 127.0.0.1, ::1 and a public
          address fail without reaching anything.
        readonly_host_filesystem (m): /, /usr and the Python prefix are read-only mounts and a file
          cannot be created in /. private_tmp (m): /tmp is a tmpfs of the execution (a file left
          there is gone for the next one). private_dev (m): /dev is a tmpfs with harmless nodes
          only. hidden_paths (m): /root and /home are absent or empty.
        allow_list_view (m): / shows only the system directories (as on the host), the exposed paths,
          a minimal /etc and the private ones; the checkout and this project's packages show (and
          import) nothing; a host directory made outside the view for the probe is not there.
        workdir_bounded (m): a workdir's private copy refuses bytes and entries past `workdir_bytes`
          and `workdir_inodes` (ENOSPC; small ones in the probe); what fits comes back to the host.
        no_heap_carryover (m, in place only): an in-place execution's scan of its own memory finds
          no marker the previous one held in its code or heap (and does find its own).
        host_processes_hidden (m): /proc shows the program and its init only.
        environment_cleared (m): no variable beyond PATH, HOME, LANG, TMPDIR (and `env`).
        unprivileged (m): the program's uid, mapped out to the pool's user namespace, is not 0.
        distinct_uid_per_worker (m): programs of slot i run as host uid uid_base + i.
        distinct_uid_per_pool: the pool holds its uid range exclusively on this host (`UidRange`).
        capabilities_dropped (m): CapInh, CapPrm, CapEff, CapBnd and CapAmb are all empty.
        no_new_privileges (m): NoNewPrivs is 1.
        seccomp_filter (m): Seccomp is 2 and the filter's answers come back (EPERM for calls the
          kernel would allow here, ENOSYS for clone3, EAFNOSUPPORT for AF_ALG; `seccomp.py`).
        nested_user_namespaces_blocked (m): unshare, clone and clone3 of a user namespace and
          raising max_user_namespaces fail. mount_blocked (m): a mount namespace, a tmpfs mount,
          fsopen and chroot fail. keyring_blocked (m): keyctl, add_key and request_key are refused.
        kernel_surface_blocked (m): bpf, ptrace, perf_event_open, io_uring, userfaultfd,
          process_vm_readv, kcmp, pidfd_getfd, fanotify, name_to_handle_at and open_tree fail.
        sockets_cleared (m): a unix socket and a TCP listener kept alive in flight by one
          execution are neither listed, reachable nor holding their port in the next.
        ipc_cleared (m): SysV objects and /dev/shm files of one execution are gone in the next.
        kill_whole_process_tree (m): a setsid'd daemon is gone when its execution has ended.
        rlimits (m): every hard and soft rlimit is the `Limits` value.
        processes_limit_per_execution: RLIMIT_NPROC counted per execution (measured rlimits, a
          non-root uid, and a user namespace or uid of its own), or a pids cgroup.
        output_capped: enforced by the worker, always. cgroup_*: the optional cgroup layer (as
          its files answered when created). prewarmed_python: modules in the warm workers.
        notes: why anything is missing or contradicted.
        """
        return self._evaluate()[0]

    def _evaluate(self) -> tuple[dict[str, bool | str], list[tuple[str, str]]]:
        """`guarantees()`, and the (claim, evidence) pairs the probe contradicted."""
        plan = isolation.Plan.from_dict(self._info["plan"])
        ns = plan.ns_flags
        cg = self._cgroup_caps
        fs = plan.fs
        promised = {
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
            "allow_list_view": fs,
            "workdir_bounded": fs,
            "no_heap_carryover": True,
            "host_processes_hidden": fs and plan.pidns,
            "environment_cleared": True,
            "unprivileged": plan.drop_uid or plan.mode != "root",
            "distinct_uid_per_worker": plan.drop_uid,
            "distinct_uid_per_pool": plan.drop_uid and self._uids is not None and self._uids.exclusive,
            "capabilities_dropped": plan.mode != "none",
            "no_new_privileges": True,
            "seccomp_filter": plan.seccomp,
            "nested_user_namespaces_blocked": plan.block_nested_userns or plan.seccomp,
            "mount_blocked": plan.mode != "none",
            "keyring_blocked": plan.seccomp,
            "kernel_surface_blocked": plan.seccomp,
            "sockets_cleared": bool(ns & L.CLONE_NEWNET),
            "ipc_cleared": bool(ns & L.CLONE_NEWIPC) and fs,
            "kill_whole_process_tree": plan.pidns or bool(cg.get("kill")),
            "rlimits": True,
        }
        measured = probe_lib.derive(self._info["plan"], self._info.get("probe") or {}, self.limits.to_dict(),
                                    plan.uid if plan.drop_uid else None)
        out: dict[str, bool | str] = {"mode": plan.mode}
        contradicted = []
        for key, value in promised.items():
            if key in measured:
                holds, why = measured[key]
                if value and not holds:
                    contradicted.append((key, why))
                value = value and holds
            out[key] = value
        # RLIMIT_NPROC counts per (user namespace, uid) and exempts host root: it is per execution
        # with a distinct host uid per worker, or with a fresh user namespace whose host uid is
        # not root; otherwise only a pids cgroup bounds an execution.
        out["processes_limit_per_execution"] = bool(cg.get("pids")) or (
            (plan.drop_uid or (plan.mode == "userns" and plan.program_userns))
            and out["rlimits"] and out["unprivileged"]
            and (out["user_namespace"] or out["distinct_uid_per_worker"]))
        out.update({
            "output_capped": True,
            "cgroup_pids_limit": bool(cg.get("pids")),
            "cgroup_memory_limit": bool(cg.get("memory")),
            "cgroup_cpu_accounting": bool(cg.get("cpu")),
            "cgroup_kill": bool(cg.get("kill")),
            "prewarmed_python": ",".join(self._info.get("preloaded", [])) or "none",
        })
        uid_note = [self._uids.note] if self._uids is not None and self._uids.note else []
        out["notes"] = "; ".join([*plan.notes, *uid_note,
                                  *(f"the start-up probe contradicts {k}: {why}" for k, why in contradicted)])
        return out, contradicted

    def _announce(self) -> None:
        g, contradicted = self._evaluate()
        consequences = {
            "pid_namespace": "leftover processes are killed through a subreaper (a process "
                             "that escapes it is not guaranteed to die)",
            "network_namespace": "programs can reach the network, including localhost services",
            "readonly_host_filesystem": "programs can write anywhere their uid may write, "
                                        "including other executions' files",
            "user_namespace": "RLIMIT_NPROC is not counted per execution",
            "unprivileged": "programs run as root",
            "host_processes_hidden": "programs can see host processes in /proc",
            "allow_list_view": "programs can read whatever host files their uid may read, this "
                               "project's code included",
        }
        if self._uids is not None and not self._uids.exclusive:
            consequences["distinct_uid_per_pool"] = ("programs of this pool may share uids (and what the "
                                                     "kernel keys by uid) with another pool's")
        for key, what in consequences.items():
            if not g[key]:
                _warn_once(f"missing:{key}", f"rlcode.sandbox: {key.replace('_', ' ')} unavailable "
                           f"on this machine: {what}. ({g['notes']})")
        for key, why in contradicted:
            _warn_once(f"contradicted:{key}", f"rlcode.sandbox: the start-up probe contradicts "
                       f"{key}, reported False: {why}")
        if not g["cgroup_memory_limit"] or not g["cgroup_pids_limit"]:
            _warn_once("cgroups", "rlcode.sandbox: no delegated cgroup for memory/pids: memory is "
                       "bounded per process (RLIMIT_AS) and processes by RLIMIT_NPROC only.")
