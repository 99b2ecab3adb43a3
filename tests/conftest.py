"""Fixtures shared by the whole suite, and its markers.

* `sandbox_pool`: one `SandboxPool` of 2 workers per test process (per xdist worker), for tests
  that drive the pool rather than test it (grading, rollouts, the jobs). Tests of the pool itself
  (tests/rlcode/sandbox) build the pools they examine.
* Helpers shared between test modules live in the `support` package beside this file (this
  directory is on sys.path while the suite runs): `support.tiny_job` (a seconds-long config of
  the main job, also a script), `support.step_check`, `support.field_checks`,
  `support.local_executor`.
* XLA's compilation cache is kept on disk in ``.cache/jax`` of the checkout (ignored by git) and
  shared by every test process and the jobs they start: the suite compiles the same tiny models
  many times, and a fresh checkout starts with an empty cache. Set JAX_COMPILATION_CACHE_DIR to
  put it elsewhere.
* XLA compiles with its cheapest backend settings (`FAST_COMPILE`, added to XLA_FLAGS): the
  suite compiles thousands of small programs and runs each a few times (backend compilation was
  about a fifth of the tests' time in a full run; tracing and whole-job subprocesses are most of
  the rest).
* Two tiers. ``pytest --slow`` is the full suite, what CI runs (README, Tests). ``pytest`` alone
  is the development run: it leaves out the tests marked ``slow`` (whole-job runs beyond one
  end-to-end test per job, scripts' quick modes, multi-process, Ray and multi-device subprocess
  tests, and any test that takes more than about two seconds on a 2-core machine) and runs only
  the first case of each parametrized test among those collected, so every other test function
  runs at least once. An explicit ``-m`` expression selects by marker instead, with every case.
"""

import importlib.metadata
import os
import sys
import warnings

import pytest

CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
# Set in the environment so that subprocesses (jobs, multi-device checks) share the cache too;
# every compilation is cached, however short.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite compiles thousands of small programs and runs each a few times, so compiling is most
# of its cost: XLA's cheapest backend settings, and the CPU backend's older (elemental) emitters
# for fusions instead of its MLIR fusion emitters, which cost more to compile than they save at
# these sizes (the full suite with a cold cache on 2 cores: 12.0 min with the first two flags,
# 9.3 min with all three). Every check compares against an oracle with a tolerance,
# which these settings stay well inside. Subprocesses inherit them (`support.xla_flags` adds fake
# devices without dropping them).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def _jaxlib_version() -> tuple[int, ...]:
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


# jaxlib 0.12 removed the flag (and XLA aborts on a flag it does not know), so only older
# releases get it.
if (0, 0) < _jaxlib_version() < (0, 11):
    FAST_COMPILE += ("--xla_cpu_use_fusion_emitters=false",)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_COMPILE if f not in _flags])


def pytest_configure(config):
    # jax reads the variables above when it is imported; a plugin may have imported it already.
    # (The suite does not import jax itself here: some sandbox tests check a process without it.)
    jax = sys.modules.get("jax")
    if jax is None:
        return
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


@pytest.fixture(scope="session")
def sandbox_pool():
    sandbox = pytest.importorskip("rlcode.sandbox")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. no delegated cgroups on this machine
        try:
            pool = sandbox.SandboxPool(2, sandbox.Limits(wall_seconds=60, cpu_seconds=30))
        except (RuntimeError, OSError) as e:
            pytest.skip(f"the sandbox pool cannot start on this machine: {e}")
    with pool:
        yield pool


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="the full suite, as CI runs it: the tests marked slow and every case of each "
                          "parametrized test (without it: the development run, see tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or config.getoption("markexpr"):
        return  # the full suite, or an explicit -m expression decides
    kept, left_out, functions = [], [], set()
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        if item.get_closest_marker("slow") or function in functions:
            left_out.append(item)
        else:
            functions.add(function)
            kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
