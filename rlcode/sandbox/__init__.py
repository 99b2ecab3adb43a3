"""Isolated execution of untrusted, model-written programs (REFERENCE.md §11).

    pool = SandboxPool(num_workers, limits=Limits(...))   # create before importing jax
    pool.run(argv, files=..., stdin=..., timeout=..., workdir=...)   -> ExecResult
    pool.run_python(code, inprocess=False|True, ...)                  -> ExecResult
    pool.submit(...) / pool.submit_python(...)                        -> Future[ExecResult]
    pool.gather(futures, min_fraction=..., deadline=...)              -> [ExecResult | None]
    pool.guarantees()                                                 -> {name: bool | str}

`pool.py` has the API, `isolation.py` the per-execution isolation, `worker.py` the fork server,
`cgroups.py` the optional cgroup layer, `spec.py` the value types. This package imports only the
standard library (and never jax), so importing it early is cheap.
"""

from rlcode.sandbox.spec import STATUSES, ExecResult, Limits

__all__ = ["SandboxPool", "SandboxFuture", "SandboxWarning", "Limits", "ExecResult", "STATUSES"]


def __getattr__(name):
    # The pool (threads, subprocess, logging) is imported on first use only, so that the worker
    # processes, which import this package too, start fast.
    if name in ("SandboxPool", "SandboxFuture", "SandboxWarning"):
        from rlcode.sandbox import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
