"""`RaySandboxPool`: the `SandboxPool` interface spread over a Ray cluster.

    import ray
    from rlcode.sandbox.ray_pool import RaySandboxPool
    from rlcode.sandbox import Limits

    ray.init(address="auto")                                   # or a local ray.init()
    pool = RaySandboxPool(limits=Limits(cpu_seconds=10, wall_seconds=20))   # one actor per node
    futs = [pool.submit_python(code, timeout=10) for code in programs]
    results = pool.gather(futs, min_fraction=0.9, deadline=60)

Needs the `distributed` extra (`pip install rlcode[distributed]`, i.e. ray) and rlcode importable
on every node (installed there, or shipped with `runtime_env={"py_modules": ...}`).

Actors. Each actor is a Ray actor process that owns a local `SandboxPool` (pre-started fork-server
workers, the same isolation as on the driver's machine: see `pool.py` and `isolation.py`). By
default there is one actor per alive node that has CPUs, pinned to it, with as many workers as the
node has CPUs; `num_actors=` gives a fixed number of actors spread over the cluster instead.
Every actor runs its workers under a uid range of its own, so several actors may share a node.

Concurrency limit: enforced in the driver. Executions wait in this object's queue (not in Ray)
and are handed to an actor only while (a) fewer than `max_concurrency` executions are in flight
cluster-wide and (b) that actor has fewer in flight than it has workers; the least busy ready
actor gets the next one. So no execution ever queues inside an actor, and an execution's timeout
starts when it reaches its actor.

Deadlines are enforced inside the actor: its local pool kills the execution at its timeout (Ray
cannot cancel a running actor task). `cancel()` and `gather()` likewise ask the actor's pool to
kill the execution. As a backstop against an actor that stops answering (a partitioned node that
Ray has not declared dead yet), an execution with no answer `actor_grace` seconds past its
timeout plus the worker grace resolves to "infra" and its actor is killed and replaced.

Lost actors: when an actor dies (its process killed, its node lost) every execution in flight on
it resolves to an `ExecResult` with status "infra" (mask it, never score it), and a replacement
actor is started (on the same node while it is alive, else on an eligible node without an actor,
else anywhere); queued work waits for it, and later calls work as before. An actor that fails to
start three times in a row is given up; when no actor is left, queued and new executions resolve
to "infra" at once.

Files: `files=` travel with the request and work anywhere. `workdir=` is a path on the node of
the actor that runs the execution: rollouts that use working copies in place must create them on
that node (e.g. inside a Ray task pinned to the same node), or pass the tree as `files=`. With one
(local) node this is the driver's filesystem and just works. A workdir missing on the actor's node
resolves to "infra" naming the node, never to a program failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlcode.sandbox import isolation
from rlcode.sandbox.pool import WORKER_GRACE_SECONDS, SandboxFuture, SandboxPool
from rlcode.sandbox.spec import ExecResult, Limits

log = logging.getLogger("rlcode.sandbox")

ACTOR_GRACE_SECONDS = 30.0  # past timeout + worker grace + this, a silent actor is presumed lost
ACTOR_START_TIMEOUT_SECONDS = 180.0
MAX_START_FAILURES = 3
_serials = itertools.count()  # actor incarnations started by this process
_uid_lock = threading.Lock()
_uid_next = 0  # next free uid offset: every actor of this process gets a range of its own


def _uid_block(n: int) -> int:
    global _uid_next
    with _uid_lock:
        start, _uid_next = _uid_next, _uid_next + n
    return start
_LOST_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError)


class _PoolActor:
    """Ray actor (made remote in `RaySandboxPool`): one local `SandboxPool` on its node."""

    def __init__(self, num_workers: int, limits: Limits, pool_kwargs: dict):
        self.pool = SandboxPool(num_workers, limits, **pool_kwargs)
        self.num_workers = num_workers
        self.lock = threading.Lock()
        self.futures: dict[int, cf.Future] = {}
        self.cancelled: dict[int, float] = {}  # cancels that arrived before their execution

    @ray.method(concurrency_group="control")
    def ready(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "pid": os.getpid(), "num_workers": self.num_workers,
                "guarantees": self.pool.guarantees()}

    def execute(self, rid: int, kind: str, args: tuple, kwargs: dict) -> ExecResult:
        try:
            fut = getattr(self.pool, kind)(*args, **kwargs)
        except FileNotFoundError as e:
            return ExecResult.infra(f"on node {socket.gethostname()}: {e}")
        except Exception as e:  # noqa: BLE001
            return ExecResult.infra(f"sandbox actor on {socket.gethostname()} could not submit: "
                                    f"{type(e).__name__}: {e}")
        with self.lock:
            self.futures[rid] = fut
            cancel = self.cancelled.pop(rid, None) is not None
        try:
            if cancel:
                self.pool.cancel(fut)
            return fut.result()
        except cf.CancelledError:
            return ExecResult.infra("cancelled")
        finally:
            with self.lock:
                self.futures.pop(rid, None)

    @ray.method(concurrency_group="control")
    def cancel(self, rid: int) -> None:
        with self.lock:
            fut = self.futures.get(rid)
            if fut is None:
                now = time.monotonic()
                self.cancelled[rid] = now
                if len(self.cancelled) > 1000:
                    self.cancelled = {k: t for k, t in self.cancelled.items() if now - t < 600}
        if fut is not None:
            self.pool.cancel(fut)

    @ray.method(concurrency_group="control")
    def guarantees(self) -> dict:
        return self.pool.guarantees()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        self.pool.close()


_RemoteActor = None


def _remote_actor_class():
    global _RemoteActor
    if _RemoteActor is None:
        _RemoteActor = ray.remote(max_restarts=0, max_task_retries=0,
                                  concurrency_groups={"control": 2})(_PoolActor)
    return _RemoteActor


class _Job:
    __slots__ = ("job_id", "kind", "args", "kwargs", "timeout", "future", "cancel_requested",
                 "actor", "started")

    def __init__(self, job_id: int, kind: str, args: tuple, kwargs: dict, timeout: float):
        self.job_id, self.kind, self.args, self.kwargs, self.timeout = job_id, kind, args, kwargs, timeout
        self.cancel_requested = False
        self.actor: _Actor | None = None
        self.started = 0.0
        self.future = SandboxFuture()
        self.future.job_id = job_id
        self.future._job = self


class _Actor:
    """One actor incarnation in a slot; a replacement is a new `_Actor` in the same slot."""

    def __init__(self, slot: int, serial: int, node_id: str | None, failures: int = 0):
        self.slot, self.serial, self.node_id, self.failures = slot, serial, node_id, failures
        self.handle = None
        self.state = "starting"  # -> "ready" -> "dead"; "starting" -> "failed"
        self.since = time.monotonic()
        self.capacity = 0
        self.in_flight: dict[int, _Job] = {}
        self.info: dict = {}


class RaySandboxPool:
    """`SandboxPool` interface over Ray actors, each owning a local `SandboxPool`. Thread-safe.

    Requires `ray.init(...)` to have been called (or calls it with defaults).

    Args:
      num_actors: None = one actor per alive node with CPUs (and with every custom resource named
        in `actor_options["resources"]`), pinned to that node; an int = that many actors, spread.
      workers_per_actor: workers of each actor's local pool. None = the node's CPU count in the
        per-node mode, else the cluster's CPUs divided among the actors (at least 1).
      limits: default `Limits` of every execution (overridable per call).
      max_concurrency: executions in flight cluster-wide (driver-side bound); None = the sum of
        the actors' workers.
      uid_base: None (the default): each actor's pool allocates a uid range no other pool on its
        node holds (see `SandboxPool`). An int: first uid of the actors' workers; every actor this
        process starts, replacements included, takes the next `workers_per_actor` uids from
        there, so the pools of one driver never share a uid on a node (a pool whose range another
        pool of the node holds reports it in `guarantees()["distinct_uid_per_pool"]`).
      actor_options: extra `.options()` of the actors (num_cpus, resources, runtime_env, ...).
      actor_grace: seconds past timeout + worker grace before a silent actor is given up.
      start_timeout: seconds an actor may take to start its pool.
      **pool_kwargs: passed to each actor's `SandboxPool` (preload, use_cgroups, disable,
        hide_repository, python: a path on the actor's node).
    """

    gather = SandboxPool.gather  # generic over futures + self.cancel: identical semantics

    def __init__(self, num_actors: int | None = None, workers_per_actor: int | None = None,
                 limits: Limits = Limits(), *, max_concurrency: int | None = None,
                 uid_base: int | None = None, actor_options: dict | None = None,
                 actor_grace: float = ACTOR_GRACE_SECONDS,
                 start_timeout: float = ACTOR_START_TIMEOUT_SECONDS, **pool_kwargs):
        if not ray.is_initialized():
            ray.init()
        self.limits = limits
        self.actor_options = dict(actor_options or {})
        self.actor_grace = float(actor_grace)
        self.start_timeout = float(start_timeout)
        self.pool_kwargs = pool_kwargs
        self.uid_base = uid_base
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._ids = itertools.count()
        self._closed = False
        self._per_node = num_actors is None
        nodes = self._eligible_nodes()
        if self._per_node:
            if not nodes:
                raise RuntimeError("RaySandboxPool: no alive node with CPUs (and the requested resources)")
            slots_nodes = [n["NodeID"] for n in nodes]
            wpa = workers_per_actor or max(1, min(int(n["Resources"].get("CPU", 1)) for n in nodes))
        else:
            if num_actors < 1:
                raise ValueError("num_actors must be >= 1")
            slots_nodes = [None] * num_actors
            cpus = int(ray.cluster_resources().get("CPU", 1))
            wpa = workers_per_actor or max(1, cpus // num_actors)
        if wpa < 1:
            raise ValueError("workers_per_actor must be >= 1")
        self.workers_per_actor = wpa
        self._actors: list[_Actor] = [_Actor(i, next(_serials), node) for i, node in enumerate(slots_nodes)]
        self.max_concurrency = max_concurrency or wpa * len(self._actors)
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        for a in self._actors:
            self._start(a)
        with self._cv:
            self._cv.wait_for(lambda: all(a.state != "starting" for a in self._actors),
                              timeout=self.start_timeout + 10)
            failed = [a for a in self._actors if a.state != "ready"]
        if failed:
            errors = "; ".join(f"actor {a.slot}: {a.info.get('error', 'did not start in time')}"
                               for a in failed)
            self.close()
            raise RuntimeError("RaySandboxPool failed to start: " + errors)
        self._thread = threading.Thread(target=self._dispatch_loop, name="ray-sandbox-dispatch", daemon=True)
        self._thread.start()

    # -- actors ----------------------------------------------------------------------------------

    def _eligible_nodes(self) -> list[dict]:
        need = self.actor_options.get("resources") or {}
        return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0
                and all(n["Resources"].get(k, 0) >= v for k, v in need.items())]

    def _start(self, a: _Actor) -> None:
        """Create the actor of `a` and watch its start-up (no blocking)."""
        opts = dict(self.actor_options)
        opts.setdefault("max_concurrency", self.workers_per_actor + 1)
        if a.node_id is not None:
            opts.setdefault("scheduling_strategy", NodeAffinitySchedulingStrategy(a.node_id, soft=False))
        else:
            opts.setdefault("scheduling_strategy", "SPREAD")
        kwargs = dict(self.pool_kwargs, uid_base=None if self.uid_base is None
                      else self.uid_base + _uid_block(self.workers_per_actor))
        try:
            a.handle = _remote_actor_class().options(**opts).remote(
                self.workers_per_actor, self.limits, kwargs)
            ref = a.handle.ready.remote()
        except Exception as e:  # noqa: BLE001
            self._started(a, None, e)
            return
        ref.future().add_done_callback(lambda f: self._started(a, f, None))

    def _started(self, a: _Actor, f, error) -> None:
        try:
            info = f.result() if error is None else None
        except Exception as e:  # noqa: BLE001
            error = e
        with self._cv:
            if a.state != "starting":
                return
            if error is None:
                a.state, a.info, a.capacity = "ready", info, int(info["num_workers"])
                a.node_id = info["node_id"]
                a.failures = 0
            else:
                a.state, a.info = "failed", {"error": f"{type(error).__name__}: {error}"}
                log.warning("sandbox actor %d failed to start: %s", a.slot, a.info["error"])
            self._cv.notify_all()
        if error is not None and a.handle is not None:
            _kill(a.handle)

    def _replacement(self, old: _Actor) -> _Actor | None:
        """The next incarnation of a dead or failed slot, or None to give the slot up. Needs _cv."""
        failures = old.failures + (old.state == "failed")
        if failures >= MAX_START_FAILURES:
            return None
        node = old.node_id
        if self._per_node:
            try:
                alive = {n["NodeID"] for n in self._eligible_nodes()}
            except Exception:  # noqa: BLE001
                alive = {node}
            if node not in alive:
                used = {b.node_id for b in self._actors if b is not old}
                free = [n for n in alive if n not in used]
                node = free[0] if free else None
        return _Actor(old.slot, next(_serials), node, failures)

    def _lose(self, a: _Actor, reason: str) -> list[tuple[_Job, ExecResult]]:
        """Mark actor `a` dead; its in-flight executions resolve to infra. Needs _cv."""
        if a.state == "dead":
            return []
        a.state = "dead"
        jobs = list(a.in_flight.values())
        a.in_flight.clear()
        log.warning("sandbox actor %d (%s) lost: %s; %d executions -> infra", a.slot,
                    a.info.get("host", "?"), reason, len(jobs))
        self._cv.notify_all()
        return [(j, ExecResult.infra(f"sandbox actor lost: {reason}",
                                     wall_time=time.monotonic() - j.started)) for j in jobs]

    # -- dispatch --------------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while True:
            to_start, to_kill, to_send, to_resolve = [], [], [], []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                wake = now + 1.0
                for a in self._actors:
                    if a.state == "starting" and now - a.since > self.start_timeout:
                        a.state, a.info = "failed", {"error": "did not start in time"}
                        to_kill.append(a.handle)
                    for j in list(a.in_flight.values()) if a.state == "ready" else ():
                        due = j.started + j.timeout + WORKER_GRACE_SECONDS + self.actor_grace
                        if now > due:
                            to_resolve += self._lose(a, "no answer past the execution's deadline")
                            to_kill.append(a.handle)
                            break
                        wake = min(wake, due)
                    if a.state in ("dead", "failed"):
                        new = self._replacement(a)
                        if new is not None:
                            self._actors[a.slot] = new
                            to_start.append(new)
                        else:
                            a.state = "gone"
                if all(a.state == "gone" for a in self._actors):
                    while self._queue:
                        to_resolve.append((self._queue.popleft(),
                                           ExecResult.infra("no sandbox actor available")))
                in_flight = sum(len(a.in_flight) for a in self._actors)
                while self._queue and in_flight < self.max_concurrency:
                    ready = [a for a in self._actors if a.state == "ready" and len(a.in_flight) < a.capacity]
                    if not ready:
                        break
                    job = self._queue.popleft()
                    if not job.future.set_running_or_notify_cancel():
                        continue
                    a = min(ready, key=lambda b: len(b.in_flight) / b.capacity)
                    job.actor, job.started = a, time.monotonic()
                    a.in_flight[job.job_id] = job
                    in_flight += 1
                    to_send.append((a, job))
                if not (to_start or to_kill or to_send or to_resolve):
                    self._cv.wait(timeout=max(0.01, wake - time.monotonic()))
                    continue
            for h in to_kill:
                _kill(h)
            for a in to_start:
                self._start(a)
            for a, job in to_send:
                self._send(a, job)
            for job, res in to_resolve:
                _resolve(job, res)

    def _send(self, a: _Actor, job: _Job) -> None:
        try:
            ref = a.handle.execute.remote(job.job_id, job.kind, job.args, job.kwargs)
        except Exception as e:  # noqa: BLE001
            with self._cv:
                lost = self._lose(a, f"{type(e).__name__}: {e}")
            for j, res in lost:
                _resolve(j, res)
            return
        ref.future().add_done_callback(lambda f: self._finished(a, job, f))
        if job.cancel_requested:
            self._send_cancel(a, job)

    def _finished(self, a: _Actor, job: _Job, f: cf.Future) -> None:
        lost = []
        try:
            res = f.result()
            if not isinstance(res, ExecResult):
                res = ExecResult.infra(f"sandbox actor returned {type(res).__name__}")
        except _LOST_ERRORS as e:
            res = ExecResult.infra(f"sandbox actor lost: {type(e).__name__}",
                                   wall_time=time.monotonic() - job.started)
            if not isinstance(e, ray.exceptions.ActorUnavailableError):
                with self._cv:
                    lost = self._lose(a, type(e).__name__)
        except Exception as e:  # noqa: BLE001
            res = ExecResult.infra(f"sandbox actor error: {type(e).__name__}: {e}")
        with self._cv:
            a.in_flight.pop(job.job_id, None)
            self._cv.notify_all()
        _resolve(job, res)
        for j, r in lost:
            _resolve(j, r)

    def _send_cancel(self, a: _Actor, job: _Job) -> None:
        try:
            a.handle.cancel.remote(job.job_id)
        except Exception:  # noqa: BLE001
            pass

    # -- the SandboxPool interface ---------------------------------------------------------------

    def _enqueue(self, kind: str, args: tuple, kwargs: dict) -> SandboxFuture:
        if self._closed:
            raise RuntimeError("RaySandboxPool is closed")
        if kwargs.get("files") is not None:
            for rel in kwargs["files"]:
                isolation.validate_relpath(rel)
            kwargs["files"] = dict(kwargs["files"])
        if isinstance(kwargs.get("stdin"), str):
            kwargs["stdin"] = kwargs["stdin"].encode("utf-8")
        limits = kwargs.get("limits") or self.limits
        timeout = float(limits.wall_seconds if kwargs.get("timeout") is None else kwargs["timeout"])
        job = _Job(next(self._ids), kind, args, kwargs, timeout)
        with self._cv:
            if self._closed:
                raise RuntimeError("RaySandboxPool is closed")
            if all(a.state == "gone" for a in self._actors):
                _resolve(job, ExecResult.infra("no sandbox actor available"))
                return job.future
            self._queue.append(job)
            self._cv.notify_all()
        return job.future

    def submit(self, argv: list[str], *, files: dict | None = None, stdin: bytes | str | None = None,
               timeout: float | None = None, workdir: str | None = None, env: dict | None = None,
               limits: Limits | None = None) -> SandboxFuture:
        """As `SandboxPool.submit`; `workdir` is a path on the node of the actor that runs it."""
        if not argv or isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
            raise TypeError("argv must be a non-empty list of str")
        return self._enqueue("submit", (list(argv),), dict(files=files, stdin=stdin, timeout=timeout,
                                                           workdir=workdir, env=env, limits=limits))

    def run(self, argv: list[str], **kwargs) -> ExecResult:
        """`submit(...).result()`."""
        return self.submit(argv, **kwargs).result()

    def submit_python(self, code: str, *, args: tuple[str, ...] = (), inprocess: bool = False,
                      files: dict | None = None, stdin: bytes | str | None = None,
                      timeout: float | None = None, workdir: str | None = None,
                      env: dict | None = None, limits: Limits | None = None) -> SandboxFuture:
        """As `SandboxPool.submit_python` (the interpreter is the actor's pool's, on its node)."""
        return self._enqueue("submit_python", (str(code),),
                             dict(args=tuple(str(a) for a in args), inprocess=inprocess, files=files,
                                  stdin=stdin, timeout=timeout, workdir=workdir, env=env, limits=limits))

    def run_python(self, code: str, **kwargs) -> ExecResult:
        """`submit_python(...).result()`."""
        return self.submit_python(code, **kwargs).result()

    def cancel(self, future: cf.Future) -> bool:
        """Cancel a queued execution or kill a running one (it then resolves to status "infra",
        info "cancelled"). Returns True if it was still queued."""
        if future.cancel():
            return True
        job = getattr(future, "_job", None)
        if job is None:
            return False
        job.cancel_requested = True
        with self._cv:
            a = job.actor
            running = a is not None and job.job_id in a.in_flight
        if running:
            self._send_cancel(a, job)
        return False

    def guarantees(self) -> dict[str, bool | str]:
        """`SandboxPool.guarantees()` over all ready actors: a boolean holds only if it holds on
        every actor; a string is the common value, or the distinct values joined with "|" where
        they differ ("prewarmed_python": the modules prewarmed on every actor; "notes": every
        distinct note)."""
        with self._cv:
            gs = [a.info["guarantees"] for a in self._actors if a.state == "ready"]
        if not gs:
            raise RuntimeError("RaySandboxPool: no ready actor")
        out: dict[str, bool | str] = {}
        for key in gs[0]:
            vals = [g.get(key) for g in gs]
            if key == "prewarmed_python":
                sets = [set(v.split(",")) - {"none"} for v in vals]
                common = [m for m in vals[0].split(",") if all(m in s for s in sets)]
                out[key] = ",".join(common) or "none"
            elif key == "notes":
                out[key] = "; ".join(dict.fromkeys(n for v in vals for n in v.split("; ") if n))
            elif all(isinstance(v, bool) for v in vals):
                out[key] = all(vals)
            else:
                out[key] = "|".join(dict.fromkeys(str(v) for v in vals))
        return out

    def actors(self) -> list:
        """Handles of the current ready actors (diagnostics and tests)."""
        with self._cv:
            return [a.handle for a in self._actors if a.state == "ready"]

    def actor_info(self) -> list[dict]:
        """Per slot: state, node, host, pid, workers, executions in flight."""
        with self._cv:
            return [{"slot": a.slot, "state": a.state, "node_id": a.node_id, "host": a.info.get("host"),
                     "pid": a.info.get("pid"), "num_workers": a.capacity, "in_flight": len(a.in_flight)}
                    for a in self._actors]

    def __enter__(self) -> "RaySandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Fail queued executions, stop every actor's pool (killing running executions, which
        resolve to "infra"), kill the actors. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            actors = list(self._actors)
            self._cv.notify_all()
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(ExecResult.infra("pool closed"))
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        refs = []
        for a in actors:
            if a.handle is not None and a.state == "ready":
                try:
                    refs.append(a.handle.close.remote())
                except Exception:  # noqa: BLE001
                    pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=60)
            except Exception:  # noqa: BLE001
                pass
        killed = [a.handle for a in actors if a.handle is not None]
        for handle in killed:
            _kill(handle)
        # ray.kill only requests the kill; wait until the actors are gone so that a closed pool
        # holds no actor (and no execution) once close() returns.
        _wait_dead(killed, timeout=20.0)
        with self._cv:
            left = [j for a in actors for j in a.in_flight.values()]
            for a in actors:
                a.in_flight.clear()
                a.state = "gone"
        for job in left:
            _resolve(job, ExecResult.infra("pool closed"))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _resolve(job: _Job, res: ExecResult) -> None:
    """Set the result of a queued or running job unless it is already resolved or cancelled."""
    fut = job.future
    try:
        if fut.running() or fut.set_running_or_notify_cancel():
            fut.set_result(res)
    except (cf.InvalidStateError, RuntimeError):  # resolved (or started) concurrently
        pass


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass


def _wait_dead(handles, timeout: float) -> None:
    """Return once every actor in `handles` answers a call with RayActorError (it is dead), or
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for handle in handles:
        while time.monotonic() < deadline:
            try:
                ray.get(handle.ready.remote(), timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except ray.exceptions.RayActorError:
                break
            except Exception:  # noqa: BLE001  (a timeout: not answered yet, ask again)
                continue
            time.sleep(0.05)
