"""Isolated execution of untrusted, model-written programs (docs/threat_model.md).

    pool = SandboxPool(num_workers, limits=Limits(...))   # workers are fresh interpreters (fork+exec)
    pool.run(argv, files=..., stdin=..., timeout=..., workdir=...)   -> ExecResult
    pool.run_python(code, inprocess=False|True, ...)                  -> ExecResult
    pool.submit(...) / pool.submit_python(...)                        -> Future[ExecResult]
    pool.gather(futures, min_fraction=..., deadline=...)              -> [ExecResult | None]
    pool.guarantees()                                                 -> {name: bool | str}

`RaySandboxPool` (`ray_pool.py`, the `distributed` extra) offers the same API over Ray actors,
one local pool per node; it is imported (with ray) only when first used.

`pool.py` has the API, `isolation.py` the per-execution isolation, `seccomp.py` the program's
system-call filter, `probe.py` the start-up measurement behind `guarantees()`, `worker.py` the
fork server, `cgroups.py` the optional cgroup layer, `spec.py` the value types, `fstree.py` the
bounded, descriptor-relative tree operations (walk, read, copy, sync back, remove) that every
trusted caller uses on a working copy a program wrote. This package imports only the standard
library (and never jax), so importing it early is cheap.
"""

from rlcode.sandbox.spec import STATUSES, ExecResult, Limits

# RaySandboxPool is left out of __all__ so that a star import never needs ray.
__all__ = ["SandboxPool", "SandboxFuture", "SandboxWarning", "Limits", "ExecResult", "STATUSES"]


def __getattr__(name):
    # The pool (threads, subprocess, logging) is imported on first use only, so that the worker
    # processes, which import this package too, start fast.
    if name in ("SandboxPool", "SandboxFuture", "SandboxWarning"):
        from rlcode.sandbox import pool

        return getattr(pool, name)
    if name == "RaySandboxPool":  # imports ray: only on first use
        from rlcode.sandbox import ray_pool

        return ray_pool.RaySandboxPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
