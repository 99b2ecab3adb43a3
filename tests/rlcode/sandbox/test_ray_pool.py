"""Tests of rlcode.sandbox.ray_pool on a local Ray cluster (skipped where ray is not installed)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a local Ray cluster: multi-process

from rlcode.sandbox import ExecResult, Limits, SandboxPool  # noqa: E402
from rlcode.sandbox.ray_pool import RaySandboxPool  # noqa: E402

UID_BASE = 2_100_000_000 + (os.getpid() % 50_000) * 16 + 800_000_000
LIMITS = Limits(cpu_seconds=5, wall_seconds=10, address_space_bytes=2 * 2**30, processes=48,
                output_bytes=256 * 1024, tmp_bytes=64 * 2**20)


def _token() -> str:
    return "tok" + uuid.uuid4().hex[:16]


def _processes_with(token: str) -> list[str]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(name)
        except OSError:
            continue
    return found


def _wait_for(cond, within: float) -> bool:
    end = time.monotonic() + within
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _actor_alive(handle) -> bool:
    try:
        ray.get(handle.ready.remote(), timeout=10)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    with RaySandboxPool(num_actors=2, workers_per_actor=1, limits=LIMITS, uid_base=UID_BASE) as p:
        yield p


@pytest.fixture(scope="module")
def local_pool():
    with SandboxPool(1, LIMITS, uid_base=UID_BASE - 16) as p:
        yield p


def _key(r: ExecResult):
    return (r.status, r.returncode, r.stdout, r.stderr, r.stdout_truncated, r.stderr_truncated)


def test_results_equal_the_local_pool(pool, local_pool):
    calls = [
        ("run", (["sh", "-c", "echo out; echo err >&2; exit 3"],), {}),
        ("run", (["cat"],), {"stdin": "fed through stdin"}),
        ("run", (["sh", "-c", "cat a/b.txt"],), {"files": {"a/b.txt": "payload"}}),
        ("run", (["definitely-not-a-command"],), {}),
        ("run_python", ("import sys; print(sys.argv[1:]); sys.exit(0)",), {"args": ("x", "y")}),
        ("run_python", ("print(sum(range(10)))",), {"inprocess": True}),
        ("run_python", ("raise SystemExit(5)",), {"inprocess": True}),
        ("run_python", ("print('y' * 300_000)",), {}),
    ]
    for name, args, kwargs in calls:
        got, want = getattr(pool, name)(*args, **kwargs), getattr(local_pool, name)(*args, **kwargs)
        assert _key(got) == _key(want), (name, args, got, want)
    assert pool.run_python("print(1)").stdout == b"1\n"


def test_submit_and_gather(pool, local_pool):
    futs = [pool.submit(["sh", "-c", f"echo {i}"]) for i in range(5)]
    futs.append(pool.submit_python("print('py')", inprocess=True))
    out = pool.gather(futs)
    assert [r.stdout for r in out] == [b"0\n", b"1\n", b"2\n", b"3\n", b"4\n", b"py\n"]
    assert pool.gather([], min_fraction=1.0) == []

    tok = _token()
    futs = [pool.submit(["sh", "-c", "echo fast"]),
            pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60),
            pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60)]
    t0 = time.monotonic()
    out = pool.gather(futs, min_fraction=0.3, deadline=30)
    assert time.monotonic() - t0 < 10
    assert [r.stdout if r else None for r in out] == [b"fast\n", None, None]
    for f in futs[1:]:  # killed in the actor (running) or cancelled (still queued in the driver)
        assert f.cancelled() or (f.result(timeout=20).status == "infra" and f.result().info == "cancelled")
    assert _wait_for(lambda: not _processes_with(tok), 10)

    futs = [pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60) for _ in range(2)]
    t0 = time.monotonic()
    assert pool.gather(futs, deadline=1.0) == [None, None]
    assert 0.9 < time.monotonic() - t0 < 5
    for f in futs:
        assert f.cancelled() or f.result(timeout=20).status == "infra"
    assert pool.run(["true"]).ok


def test_timeout_is_enforced_inside_the_worker(pool):
    tok = _token()
    t0 = time.monotonic()
    r = pool.run_python(f"import time; time.sleep(60)  # {tok}", timeout=1.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 8
    r = pool.run(["sh", "-c", "while :; do :; done"], timeout=1.0)
    assert r.status == "timeout"
    assert not _processes_with(tok)


def test_workdir_on_the_local_node_and_missing_workdir_is_infra(pool, tmp_path):
    (tmp_path / "data.txt").write_text("in place\n")
    r = pool.run(["sh", "-c", "cat data.txt; echo new > out.txt"], workdir=str(tmp_path))
    assert r.ok and r.stdout == b"in place\n"
    assert (tmp_path / "out.txt").read_text() == "new\n"
    r = pool.run(["true"], workdir=str(tmp_path / "missing"))
    assert r.status == "infra" and "missing" in r.info
    with pytest.raises(ValueError):
        pool.submit(["true"], files={"../escape": "x"})
    with pytest.raises(TypeError):
        pool.submit("true")


def test_guarantees_aggregate_every_actor(pool, local_pool):
    g, local = pool.guarantees(), local_pool.guarantees()
    assert set(g) == set(local)
    for key, value in local.items():  # same machine: the same answers
        if isinstance(value, bool):
            assert g[key] == value, key
    assert g["mode"] == local["mode"]
    assert len(pool.actors()) == 2


def test_concurrency_limit_is_respected(cluster):
    code = ("import time, sys; t0 = time.time(); time.sleep(0.4); "
            "print(t0, time.time())")
    with RaySandboxPool(num_actors=2, workers_per_actor=2, limits=LIMITS, max_concurrency=3,
                        uid_base=UID_BASE) as p:
        out = p.gather([p.submit_python(code, inprocess=True) for _ in range(9)])
    spans = [tuple(map(float, r.stdout.split())) for r in out]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    assert peak == 3, spans


def test_killed_actor_gives_infra_and_is_replaced(cluster):
    tok = _token()
    with RaySandboxPool(num_actors=1, workers_per_actor=3, limits=LIMITS, uid_base=UID_BASE) as p:
        (victim,) = p.actors()
        old_pid = p.actor_info()[0]["pid"]
        futs = [p.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60) for _ in range(3)]
        queued = p.submit(["sh", "-c", "echo later"])  # waits in the driver for a free worker
        assert _wait_for(lambda: len(_processes_with(tok)) >= 3, 20), "executions should be running"
        t0 = time.monotonic()
        ray.kill(victim)
        results = [f.result(timeout=30) for f in futs]
        assert time.monotonic() - t0 < 15
        assert all(r.status == "infra" and r.returncode is None for r in results), results
        assert queued.result(timeout=60).stdout == b"later\n"  # served by the replacement
        assert p.run(["true"]).ok
        assert p.actor_info()[0]["pid"] != old_pid and p.actor_info()[0]["state"] == "ready"
        assert _wait_for(lambda: not _processes_with(tok), 10), "executions outlived their actor"


def test_close_leaves_no_actors(cluster):
    tok = _token()
    p = RaySandboxPool(num_actors=2, workers_per_actor=1, limits=LIMITS, uid_base=UID_BASE)
    handles = p.actors()
    fut = p.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60)
    queued = [p.submit(["sleep", "30"]) for _ in range(3)]
    assert _wait_for(lambda: bool(_processes_with(tok)), 20)
    p.close()
    p.close()  # idempotent
    assert fut.done() and fut.result().status == "infra"
    assert all(f.done() and f.result().status == "infra" for f in queued)
    with pytest.raises(RuntimeError):
        p.run(["true"])
    assert not any(_actor_alive(h) for h in handles)
    ids = {h._actor_id.hex() for h in handles}
    states = {k: v["State"] for k, v in ray._private.state.actors().items() if k in ids}
    assert all(s == "DEAD" for s in states.values()), states
    assert _wait_for(lambda: not _processes_with(tok), 10)


def test_per_node_default_places_one_actor_on_the_local_node(cluster):
    with RaySandboxPool(workers_per_actor=1, limits=LIMITS, uid_base=UID_BASE) as p:
        info = p.actor_info()
        assert len(info) == 1 and info[0]["node_id"] == ray.get_runtime_context().get_node_id()
        assert p.run(["sh", "-c", "echo hi"]).stdout == b"hi\n"


def test_silent_actor_is_given_up_after_the_deadline(cluster, monkeypatch):
    import signal

    from rlcode.sandbox import ray_pool

    monkeypatch.setattr(ray_pool, "WORKER_GRACE_SECONDS", 0.0)
    tok = _token()
    with RaySandboxPool(num_actors=1, workers_per_actor=1, limits=LIMITS, actor_grace=1.0,
                        uid_base=UID_BASE) as p:
        pid = p.actor_info()[0]["pid"]
        fut = p.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=2.0)
        assert _wait_for(lambda: bool(_processes_with(tok)), 20)
        os.kill(pid, signal.SIGSTOP)  # the actor stops answering (like a partitioned node)
        try:
            r = fut.result(timeout=20)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert r.status == "infra" and "lost" in r.info
        assert p.run(["true"]).ok and p.actor_info()[0]["pid"] != pid
