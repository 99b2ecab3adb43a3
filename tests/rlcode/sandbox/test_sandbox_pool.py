"""Tests of rlcode.sandbox: normal behaviour of the pool, then the threat model of docs/threat_model.md.

Every adversarial test is bounded by the sandbox's limits (short timeouts, small process and
output caps), checks that nothing of the execution is left running (a scan of /proc for the
execution's uids and for a per-test token in command lines), and where it matters runs a sibling
execution at the same time and checks that the sibling and the host were unaffected. Tests that
need a guarantee the machine does not provide (see `SandboxPool.guarantees()`) are skipped, never
weakened.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
import warnings

import pytest

from rlcode.sandbox import ExecResult, Limits, SandboxPool, SandboxWarning
from rlcode.sandbox import pool as pool_lib

SECRET_NAME = "RLCODE_SANDBOX_TEST_SECRET"
SECRET_VALUE = "s3cr3t-" + uuid.uuid4().hex

# A uid range of our own, so that a concurrently running pool elsewhere on the machine cannot be
# mistaken for our leftovers.
UID_BASE = 2_100_000_000 + (os.getpid() % 50_000) * 16
LIMITS = Limits(cpu_seconds=5, wall_seconds=10, address_space_bytes=2 * 2**30, processes=48,
                output_bytes=256 * 1024, tmp_bytes=64 * 2**20)


def _token() -> str:
    return "tok" + uuid.uuid4().hex[:16]


def leftover_processes(token: str | None = None, uid_base: int = UID_BASE, n: int = 16) -> list[str]:
    """Processes running as one of the pool's sandbox uids, or whose command line holds `token`."""
    found = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid_base <= uid < uid_base + n or (token and token in cmdline):
            found.append(f"{name}: uid={uid} {cmdline[:120]}")
    return found


def assert_no_leftovers(token: str | None = None, within: float = 2.0) -> None:
    end = time.monotonic() + within
    while True:
        left = leftover_processes(token)
        if not left or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def pool():
    os.environ[SECRET_NAME] = SECRET_VALUE  # set before the pool exists: it must not leak anyway
    try:
        with SandboxPool(2, LIMITS, uid_base=UID_BASE) as p:
            yield p
    finally:
        os.environ.pop(SECRET_NAME, None)
    assert_no_leftovers()


def need(pool: SandboxPool, *keys: str) -> None:
    g = pool.guarantees()
    missing = [k for k in keys if not g.get(k)]
    if missing:
        pytest.skip(f"this machine does not provide {missing} ({g.get('notes')})")


# ----------------------------------------------------------------------------------------------
# API and normal behaviour
# ----------------------------------------------------------------------------------------------


def test_exit_codes_and_statuses(pool):
    assert pool.run(["true"]).status == "ok"
    r = pool.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("error", 3, b"out\n", b"err\n")
    r = pool.run(["no-such-program-xyz"])
    assert (r.status, r.returncode) == ("error", 127) and b"cannot execute" in r.stderr
    r = pool.run(["sh", "-c", "kill -KILL $$"])
    assert (r.status, r.returncode) == ("error", -signal.SIGKILL)
    r = pool.run(["sleep", "30"], timeout=0.5)
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL and r.wall_time < 3
    assert isinstance(r, ExecResult) and (r.cpu_time is None or r.cpu_time >= 0)


def test_stdin_is_fed_and_large_outputs_round_trip(pool):
    data = os.urandom(300_000)  # larger than a pipe buffer in both directions
    r = pool.run(["cat"], stdin=data, limits=Limits(output_bytes=1 << 20))
    assert r.ok and r.stdout == data and not r.stdout_truncated
    assert pool.run(["cat"]).stdout == b""  # no stdin: /dev/null
    assert pool.run(["wc", "-c"], stdin="héllo").stdout.strip() == b"6"


def test_files_are_a_private_working_copy(pool):
    files = {"pkg/data.txt": "hello\n", "run.sh": "#!/bin/sh\ncat pkg/data.txt; pwd; echo x > new.txt; ls\n",
             "blob.bin": bytes(range(256))}
    r = pool.run(["./run.sh"], files=files)
    assert r.ok, r
    lines = r.stdout_text.split("\n")
    assert lines[0] == "hello" and lines[1] == "/tmp/work" and "new.txt" in r.stdout_text
    assert pool.run(["sh", "-c", "test -e /tmp/work/new.txt || test -e /tmp/work/run.sh"]).status == "error"
    assert pool.run(["python", "-c", "import sys; sys.stdout.buffer.write(open('blob.bin','rb').read())"],
                    files=files).stdout == bytes(range(256))
    with pytest.raises(ValueError):
        pool.run(["true"], files={"../escape": "x"})
    with pytest.raises(ValueError):
        pool.run(["true"], files={"/etc/x": "x"})


def test_workdir_is_the_working_copy_and_keeps_its_owner(pool, tmp_path):
    wd = tmp_path / "repo"
    (wd / "src").mkdir(parents=True)
    (wd / "src" / "a.py").write_text("A = 1\n")
    before = os.stat(wd)
    r = pool.run(["sh", "-c", "cat src/a.py; echo 'B = 2' > src/b.py; pwd"], workdir=str(wd),
                 files={"extra.txt": "e"})
    assert r.ok, r
    assert r.stdout_text.splitlines() == ["A = 1", str(wd)]
    assert (wd / "src" / "b.py").read_text() == "B = 2\n" and (wd / "extra.txt").read_text() == "e"
    for path in (wd, wd / "src" / "b.py", wd / "extra.txt"):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (before.st_uid, before.st_gid), path
    # Two executions on one workdir at once (on the two workers) both succeed.
    futs = [pool.submit(["sh", "-c", f"sleep 0.2; echo {i} >> log.txt"], workdir=str(wd)) for i in range(2)]
    assert all(f.result(timeout=30).ok for f in futs)
    assert sorted((wd / "log.txt").read_text().split()) == ["0", "1"]
    assert os.stat(wd / "log.txt").st_uid == before.st_uid


def test_run_python_fresh_interpreter_and_in_place(pool):
    for inprocess in (False, True):
        r = pool.run_python("import sys; print(sum(range(10)), sys.argv[1:])", args=("a", "b"),
                            inprocess=inprocess)
        assert r.ok and r.stdout == b"45 ['a', 'b']\n", (inprocess, r)
        r = pool.run_python("import sys; print(sys.stdin.read().upper()); sys.exit(4)", stdin="abc",
                            inprocess=inprocess)
        assert (r.status, r.returncode, r.stdout) == ("error", 4, b"ABC\n"), (inprocess, r)
        r = pool.run_python("raise ValueError('boom')", inprocess=inprocess)
        assert r.returncode == 1 and b"ValueError: boom" in r.stderr, (inprocess, r)
        r = pool.run_python("import os, random; print(os.getcwd(), random.random())", inprocess=inprocess)
        assert r.ok and r.stdout.startswith(b"/tmp/work "), r
    # In place, each execution is a fresh fork: state does not carry over, randomness differs.
    a = pool.run_python("import random, sys; sys.modules['json'] = None; print(random.random())", inprocess=True)
    b = pool.run_python("import random, json; print(random.random())", inprocess=True)
    assert a.ok and b.ok and a.stdout != b.stdout



def _zygotes(worker: int) -> dict[int, bool]:
    """The worker's children (its zygotes between executions): pid -> whether it is the lean one."""
    kids = []
    for task in os.listdir(f"/proc/{worker}/task"):
        with open(f"/proc/{worker}/task/{task}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return {pid: b"--zygote" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") for pid in kids}


def _reaped_faults(pid: int) -> int:
    """Minor faults of the reaped children of `pid` (cminflt): what its inits cost, programs
    included, once the last one is reaped (a zygote reaps an init after the reply went out)."""
    def read() -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[8])
    last, end = read(), time.monotonic() + 5
    while time.monotonic() < end:
        time.sleep(0.2)
        now = read()
        if now == last:
            break
        last = now
    return last


@pytest.mark.slow
def test_exec_and_in_place_executions_come_from_their_own_zygotes():
    """With modules preloaded (pytest, the default) a worker keeps two zygotes: one forked from its
    warm heap, for in-place executions, and a lean one, a fresh interpreter (``--zygote``), for
    exec'd programs, which gain nothing from the preloads but would pay for forking them. Each
    execution's init comes from its mode's zygote (seen in the minor faults of each zygote's
    reaped children), and the lean zygote's loss is the worker's, as the warm one's: an infra
    result, then a fresh worker."""
    with SandboxPool(1, LIMITS, uid_base=UID_BASE + 13) as p:
        worker = p.worker_pids()[0]
        zygotes = _zygotes(worker)
        assert sorted(zygotes.values()) == [False, True], zygotes
        lean = next(pid for pid, is_lean in zygotes.items() if is_lean)
        warm = next(pid for pid, is_lean in zygotes.items() if not is_lean)
        runs = {lean: lambda: p.run([p.python, "-I", "-S", "-c", "print(1)"]),
                warm: lambda: p.run_python("print(1)", inprocess=True)}
        for serving, run in runs.items():
            other = warm if serving == lean else lean
            before = {z: _reaped_faults(z) for z in zygotes}
            for _ in range(3):
                assert run().stdout == b"1\n"
            assert _reaped_faults(serving) - before[serving] >= 300, serving
            assert _reaped_faults(other) == before[other], other
        assert b"pytest" not in open(f"/proc/{lean}/cmdline", "rb").read()
        assert p.run_python("import sys; print('pytest' in sys.modules)", inprocess=True).stdout == b"True\n"
        os.kill(lean, signal.SIGKILL)
        r = p.run(["true"])
        assert r.status == "infra" and "zygote" in r.info, r
        assert p.run(["true"]).ok and p.run_python("print(2)", inprocess=True).stdout == b"2\n"
        assert p.worker_pids() != [worker]
        assert sorted(_zygotes(p.worker_pids()[0]).values()) == [False, True]

def test_programs_start_with_default_signal_dispositions(pool):
    """No signal ignored, blocked or caught when a program starts, in either mode (the worker's
    Python ignores SIGPIPE and SIGXFSZ, and an ignored signal survives execve: the zygote resets
    the dispositions once, for every init and program it forks)."""
    res = pool.run(["grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"], timeout=10)
    assert res.ok and res.stdout_text.split() == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16], res.stdout_text
    code = ("import signal\n"
            "bad = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)\n"
            "       and signal.getsignal(s) not in (signal.SIG_DFL, None)]\n"
            "print(bad, sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n")
    res = pool.run_python(code, inprocess=True, timeout=10)
    assert res.ok and res.stdout_text.strip() == "[] []", res.stdout_text + res.stderr_text


def test_pytest_in_place_and_fresh(pool):
    files = {"test_small.py": "def test_a():\n    assert 1 + 1 == 2\n\ndef test_b():\n    assert [] == [0]\n"}
    code = "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'test_small.py']))"
    for inprocess in (True, False):
        r = pool.run_python(code, files=files, inprocess=inprocess, timeout=60)
        assert r.status == "error" and r.returncode == 1, r
        assert b"1 failed, 1 passed" in r.stdout, r.stdout[-500:]


def test_submit_and_two_workers_run_concurrently(pool):
    # Each command prints when it started and ended; two workers: both started before either ended.
    stamp = "date +%s.%N"
    futs = [pool.submit(["sh", "-c", f"{stamp}; sleep 1; {stamp}; echo $0", str(i)]) for i in range(2)]
    results = [f.result(timeout=30) for f in futs]
    assert [r.stdout.splitlines()[-1] for r in results] == [b"0", b"1"]
    spans = [[float(v) for v in r.stdout.splitlines()[:2]] for r in results]
    assert max(s[0] for s in spans) < min(s[1] for s in spans), spans


def test_gather_min_fraction_returns_early_and_kills_stragglers(pool):
    tok = _token()
    futs = [pool.submit(["sh", "-c", "echo fast"]),
            pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60),
            pool.submit(["sh", "-c", "echo fast2"]),
            pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60)]
    t0 = time.monotonic()
    out = pool.gather(futs, min_fraction=0.5, deadline=30)
    assert time.monotonic() - t0 < 10
    assert [r.stdout if r else None for r in out] == [b"fast\n", None, b"fast2\n", None]
    cancelled = [f.result(timeout=20) if not f.cancelled() else None for f in futs[1::2]]
    assert all(r is None or (r.status == "infra" and r.info == "cancelled") for r in cancelled)
    assert_no_leftovers(tok)
    assert pool.run(["true"]).ok


def test_gather_deadline(pool):
    tok = _token()
    futs = [pool.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60) for _ in range(3)]
    t0 = time.monotonic()
    out = pool.gather(futs, min_fraction=1.0, deadline=1.0)
    assert 0.9 < time.monotonic() - t0 < 5 and out == [None, None, None]
    for f in futs:
        assert f.cancelled() or f.result(timeout=20).status == "infra"
    assert_no_leftovers(tok)
    assert pool.gather([], min_fraction=1.0) == []


def test_killed_worker_reports_infra_then_recovers(pool):
    tok = _token()
    fut = pool.submit_python(f"import time; print('started', flush=True); time.sleep(60)  # {tok}",
                             timeout=60)
    end = time.monotonic() + 20
    while not leftover_processes(tok) and time.monotonic() < end:
        time.sleep(0.02)
    pids = pool.worker_pids()
    busy = [s for s in pool._slots if s.current is not None and s.current.future is fut]
    assert busy, "the execution should be running"
    os.kill(busy[0].proc.pid, signal.SIGKILL)
    r = fut.result(timeout=30)
    assert r.status == "infra" and "worker" in r.info and r.returncode is None
    assert_no_leftovers(tok)
    for _ in range(4):  # every slot works again, the dead one through a fresh worker
        assert pool.run(["true"]).ok
    assert pool.worker_pids() != pids


def test_close_leaves_nothing_behind(tmp_path):
    p = SandboxPool(1, LIMITS, uid_base=UID_BASE + 8)
    worker_pid = p.worker_pids()[0]
    cgroup_dirs = [d for s in p._slots if s.cgroup for _, d in s.cgroup.dirs]
    tok = _token()
    fut = p.submit_python(f"import time; time.sleep(60)  # {tok}", timeout=60)
    time.sleep(0.3)
    p.close()
    p.close()  # idempotent
    assert fut.done() and fut.result().status == "infra"
    with pytest.raises(RuntimeError):
        p.run(["true"])
    assert not os.path.exists(f"/proc/{worker_pid}") or open(f"/proc/{worker_pid}/stat").read().split()[2] == "Z"
    assert not any(os.path.exists(d) for d in cgroup_dirs)
    assert_no_leftovers(tok)
    assert not leftover_processes(uid_base=UID_BASE + 8, n=1)


def test_guarantees_are_reported(pool):
    g = pool.guarantees()
    for key in ("pid_namespace", "network_namespace", "mount_namespace", "user_namespace",
                "readonly_host_filesystem", "environment_cleared", "kill_whole_process_tree",
                "cgroup_pids_limit", "cgroup_memory_limit", "output_capped"):
        assert isinstance(g[key], bool), key
    assert g["mode"] in ("root", "userns", "none")
    assert all(isinstance(v, (bool, str)) for v in g.values())


def test_degraded_mechanism_is_reported_and_warned(pool):
    """With the network namespace switched off, guarantees() says so, a warning is raised, and
    the consequence is real (the host's localhost is reachable), i.e. the report is not decorative."""
    need(pool, "network_namespace")
    pool_lib._warned.discard("missing:network_namespace")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SandboxPool(1, LIMITS, uid_base=UID_BASE + 9, disable=("net",), preload=()) as p:
            assert p.guarantees()["network_namespace"] is False
            with socket.create_server(("127.0.0.1", 0)) as srv:
                port = srv.getsockname()[1]
                r = p.run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), 5); print('in')")
                assert r.ok and r.stdout == b"in\n", r
    assert any(issubclass(w.category, SandboxWarning) and "network" in str(w.message) for w in caught)


def test_creation_after_jax_import_is_silent(monkeypatch):
    """Workers are fork+exec'd fresh interpreters: a pool created by a process that imported jax
    (every entry point: configs import the model code) works the same and says nothing about it."""
    monkeypatch.setitem(sys.modules, "jax", sys.modules.get("jax") or type(sys)("jax"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SandboxWarning)
        pool_lib._warned.update({"cgroups", *(f"missing:{k}" for k in ("pid_namespace", "network_namespace",
                                 "readonly_host_filesystem", "user_namespace", "unprivileged",
                                 "host_processes_hidden"))})
        with SandboxPool(1, LIMITS, uid_base=UID_BASE + 10, preload=()) as p:
            assert p.run(["true"]).ok


def test_sandbox_package_does_not_import_jax():
    code = "import sys, rlcode.sandbox, rlcode.sandbox.worker; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------------------------
# Threat model (docs/threat_model.md)
# ----------------------------------------------------------------------------------------------


def _sibling(pool: SandboxPool) -> cf.Future:
    return pool.submit(["sh", "-c", "sleep 0.3; echo sibling-ok"], timeout=20)


def _assert_sibling_ok(fut: cf.Future) -> None:
    r = fut.result(timeout=30)
    assert r.ok and r.stdout == b"sibling-ok\n", r


@pytest.mark.slow
def test_fork_bomb_is_contained(pool):
    need(pool, "kill_whole_process_tree", "processes_limit_per_execution")
    tok = _token()
    code = textwrap.dedent(f"""
        import os  # {tok}
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    fut = pool.submit_python(code, timeout=3)
    sib = _sibling(pool)
    time.sleep(1.0)
    # While the bomb runs, the host can still start processes.
    assert subprocess.run(["true"], timeout=10).returncode == 0
    r = fut.result(timeout=30)
    assert r.status == "timeout" and r.wall_time < 6, r
    _assert_sibling_ok(sib)
    assert_no_leftovers(tok)


def test_setsid_grandchild_does_not_outlive_the_execution(pool):
    need(pool, "kill_whole_process_tree")
    tok = _token()
    code = textwrap.dedent(f"""
        import os, time  # {tok}
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.closerange(0, 3)  # fully detached daemon
                time.sleep(300)
            os._exit(0)
        time.sleep(0.2)
        print("parent exits")
    """)
    t0 = time.monotonic()
    r = pool.run_python(code, timeout=10)
    assert r.ok and r.stdout == b"parent exits\n" and time.monotonic() - t0 < 5, r
    assert_no_leftovers(tok, within=0.0)


@pytest.mark.slow
def test_spin_ignoring_signals_is_killed_at_the_deadline(pool):
    tok = _token()
    code = textwrap.dedent(f"""
        import signal  # {tok}
        for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
            signal.signal(s, signal.SIG_IGN)
        while True:
            pass
    """)
    for inprocess in (False, True):
        t0 = time.monotonic()
        r = pool.run_python(code, timeout=1.5, inprocess=inprocess)
        assert r.status == "timeout" and 1.4 < time.monotonic() - t0 < 5, r
    # The CPU rlimit is hard too: ignoring SIGXCPU ends in SIGKILL at the hard limit.
    r = pool.run_python(code, timeout=30, limits=Limits(cpu_seconds=1))
    assert r.status == "timeout" and r.info == "CPU time limit" and r.wall_time < 10, r
    assert_no_leftovers(tok)


def test_huge_allocation_and_raising_own_rlimit(pool):
    code = textwrap.dedent("""
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))          # allowed, but soft == hard
        try:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print("raised the hard limit")
        except (ValueError, OSError):
            print("cannot raise", hard)
        x = bytearray(8 * 2**30)
        print("allocated")
    """)
    for inprocess in (False, True):
        r = pool.run_python(code, timeout=20, inprocess=inprocess)
        assert r.status == "memory" and b"allocated" not in r.stdout, r
        assert r.stdout == f"cannot raise {LIMITS.address_space_bytes}\n".encode(), r


def test_memory_cgroup_kills_many_processes_allocating_together(pool):
    need(pool, "cgroup_memory_limit")
    code = textwrap.dedent("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                break
        blocks = []
        while True:                      # each process stays under RLIMIT_AS, together they do not
            blocks.append(bytearray(32 * 2**20))
            if sum(map(len, blocks)) > 1800 * 2**20:
                time.sleep(30)
    """)
    r = pool.run_python(code, timeout=15, limits=Limits(address_space_bytes=2 * 2**30, memory_bytes=256 * 2**20))
    assert r.status == "memory", r


@pytest.mark.parametrize("newlines", [False, True])
def test_ten_gigabytes_of_output_stop_at_the_cap(pool, newlines):
    tok = _token()
    line = "b'y\\n' * (1 << 19)" if newlines else "b'x' * (1 << 20)"
    code = f"import sys  # {tok}\nb = {line}\nfor _ in range(10 * 1024):\n    sys.stdout.buffer.write(b)\n"
    t0 = time.monotonic()
    r = pool.run_python(code, timeout=60)
    assert r.status == "output_limit" and r.stdout_truncated and not r.stderr_truncated, r.info
    assert len(r.stdout) == LIMITS.output_bytes and time.monotonic() - t0 < 5
    r = pool.run(["sh", "-c", "yes >&2"], timeout=60)
    assert r.status == "output_limit" and r.stderr_truncated and len(r.stderr) == LIMITS.output_bytes
    assert_no_leftovers(tok)


def test_writes_outside_the_working_copy_fail(pool, tmp_path):
    need(pool, "readonly_host_filesystem", "private_tmp")
    mine, sibling = tmp_path / "mine", tmp_path / "sibling"
    mine.mkdir()
    sibling.mkdir()
    (sibling / "solution.py").write_text("ORIGINAL\n")
    host_tmp_marker = f"/tmp/rlcode-sandbox-escape-{uuid.uuid4().hex}"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    targets = [host_tmp_marker, os.path.join(repo, "ESCAPED"), "/etc/escaped", "/var/tmp/escaped",
               str(sibling / "solution.py"), str(sibling / "new.py"), str(mine / "ok.txt")]
    code = textwrap.dedent(f"""
        import os
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as e:
                print("denied", path, e.errno)
    """)
    sib = pool.submit(["sh", "-c", "sleep 0.5; cat solution.py"], workdir=str(sibling))
    r = pool.run_python(code, workdir=str(mine))
    assert r.ok, r
    assert (mine / "ok.txt").read_text() == "pwned"
    assert (sibling / "solution.py").read_text() == "ORIGINAL\n" and not (sibling / "new.py").exists()
    assert not os.path.exists(host_tmp_marker) and not os.path.exists(targets[1])
    assert not os.path.exists("/etc/escaped") and not os.path.exists("/var/tmp/escaped")
    assert sib.result(timeout=30).stdout == b"ORIGINAL\n"
    # The sandbox's own /tmp is private: the file written there is gone for the next execution.
    assert pool.run(["test", "-e", host_tmp_marker]).status == "error"


def test_hidden_paths_are_empty_and_workdir_inside_stays_visible(pool, tmp_path):
    need(pool, "hidden_paths")
    hidden = tmp_path / "heldout"
    (hidden / "tests").mkdir(parents=True)
    (hidden / "tests" / "test_secret.py").write_text("EXPECTED = 42\n")
    (hidden / "rollout").mkdir()
    code = "import os; print(sorted(os.listdir('..')), sorted(os.listdir('/root')), os.path.exists('/home'))"
    r = pool.run_python(code, workdir=str(hidden / "rollout"), limits=Limits(hidden_paths=(str(hidden),)))
    assert r.ok, r
    assert r.stdout.startswith(b"['rollout'] ")  # the held-out tests are not there
    r = pool.run(["cat", str(hidden / "tests" / "test_secret.py")], limits=Limits(hidden_paths=(str(hidden),)))
    assert r.status == "error"
    # This repository (trainer and grader code, runs/) is hidden by default too.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = pool.run(["ls", "-A", repo])
    # Only the Python installation stays visible (read-only) when it lives inside the repository,
    # as a virtual environment created in the checkout does. With the installation elsewhere,
    # nothing of the repository's parent may be mounted at all: absent is as hidden as empty.
    prefix = os.path.realpath(sys.prefix)
    if prefix.startswith(os.path.realpath(repo) + os.sep):
        expected = (os.path.relpath(prefix, os.path.realpath(repo)).split(os.sep)[0] + "\n").encode()
        assert r.ok and r.stdout == expected, r
    else:
        assert (r.ok and r.stdout == b"") or (not r.ok and b"No such file" in r.stderr and not r.stdout), r
    (hidden / "public.txt").write_text("shared\n")
    limits = Limits(hidden_paths=(str(hidden),), exposed_paths=(str(hidden / "public.txt"),))
    r = pool.run(["sh", "-c", f"cat {hidden}/public.txt; ls {hidden}; echo x > {hidden}/public.txt"], limits=limits)
    assert r.status == "error" and r.stdout == b"shared\npublic.txt\n", r  # visible, read-only
    assert (hidden / "public.txt").read_text() == "shared\n"


def test_host_environment_and_parent_environ_are_not_readable(pool):
    need(pool, "host_processes_hidden")
    code = textwrap.dedent(f"""
        import os, glob
        seen = [repr(dict(os.environ))]
        for path in ["/proc/self/environ", "/proc/1/environ", "/proc/{os.getpid()}/environ",
                     "/proc/{os.getppid()}/environ"] + glob.glob("/proc/*/environ"):
            try:
                seen.append(open(path, "rb").read().decode(errors="replace"))
            except OSError as e:
                seen.append(f"{{path}}: {{e.strerror}}")
        print("\\n".join(seen))
    """)
    for inprocess in (False, True):
        r = pool.run_python(code, inprocess=inprocess)
        assert r.ok, r
        assert SECRET_VALUE not in r.stdout_text and SECRET_NAME not in r.stdout_text
        assert "'PATH'" in r.stdout_text and "HOME" in r.stdout_text
    r = pool.run(["sh", "-c", "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"])
    assert SECRET_VALUE not in r.stdout_text
    assert os.environ[SECRET_NAME] == SECRET_VALUE


def test_network_and_host_localhost_are_unreachable(pool):
    need(pool, "no_network")
    accepted = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        srv.settimeout(0.2)

        done = threading.Event()

        def accept():
            while not done.is_set():
                try:
                    accepted.append(srv.accept())
                except (socket.timeout, OSError):
                    pass

        th = threading.Thread(target=accept)
        th.start()
        code = textwrap.dedent(f"""
            import socket
            for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
                try:
                    socket.create_connection(addr, timeout=2)
                    print("connected", addr)
                except OSError as e:
                    print("refused", addr, e.errno)
            try:
                socket.getaddrinfo("example.com", 80)
                print("resolved")
            except OSError:
                print("no dns")
        """)
        r = pool.run_python(code, timeout=20)
        done.set()
        th.join()
    assert r.ok and b"connected" not in r.stdout and b"resolved" not in r.stdout, r
    assert not accepted


def test_thousand_zombies_then_the_pool_keeps_working(pool):
    need(pool, "kill_whole_process_tree")
    tok = _token()
    code = textwrap.dedent(f"""
        import os  # {tok}
        n = 0
        for _ in range(1000):
            if os.fork() == 0:
                os._exit(0)
            n += 1
        print(n, "unreaped children")
    """)
    r = pool.run_python(code, timeout=30, limits=Limits(processes=1100, cpu_seconds=20))
    assert r.ok and r.stdout == b"1000 unreaped children\n", r
    assert_no_leftovers(tok)
    results = [pool.run(["true"]) for _ in range(4)]
    assert all(x.ok for x in results)


def test_no_capabilities_and_unprivileged_identity(pool):
    need(pool, "unprivileged", "user_namespace")
    code = ("import os; s = open('/proc/self/status').read(); "
            "print(os.getuid(), open('/proc/self/uid_map').read().split(), "
            "[l for l in s.splitlines() if l.startswith(('CapEff', 'NoNewPrivs'))])")
    r = pool.run_python(code)
    assert r.ok, r
    uid, rest = r.stdout_text.split(" ", 1)
    assert uid == "1000" and "CapEff:\\t0000000000000000" in rest and "NoNewPrivs:\\t1" in rest, rest
    host_uid = int(rest.split("]")[0].strip("[").split(",")[1].strip(" '"))
    assert host_uid != 0  # not root outside its namespace either (host root escapes RLIMIT_NPROC)
    if pool.guarantees()["nested_user_namespaces_blocked"]:
        # The one way to regain capabilities (in a user namespace of its own) is closed too.
        code = "import ctypes; print(ctypes.CDLL(None, use_errno=True).unshare(0x10000000), ctypes.get_errno())"
        # EPERM from the seccomp filter, else ENOSPC from the user namespace count limit.
        assert pool.run_python(code).stdout in (b"-1 1\n", b"-1 28\n")


def test_program_cannot_kill_interrupt_or_impersonate_its_init(pool):
    """A failure must stay the program's failure: signalling the sandbox's init, or writing into
    its report channel, must not turn it into a masked "infra" result (nor fake a success)."""
    need(pool, "pid_namespace")
    code = textwrap.dedent("""
        import glob, os, signal, sys
        for sig in (signal.SIGINT, signal.SIGALRM, signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL):
            try:
                os.kill(1, sig)
            except OSError:
                pass
        for fd in glob.glob("/proc/1/fd/*"):
            try:
                with open(fd, "w") as f:
                    f.write("R0 0.0\\n")
            except OSError:
                pass
        try:
            os.kill(-1, signal.SIGKILL)  # everything it may signal in its namespace but itself
        except OSError:
            pass
        print("still here")
        sys.exit(3)
    """)
    for inprocess in (False, True):
        r = pool.run_python(code, inprocess=inprocess)
        assert (r.status, r.returncode, r.stdout) == ("error", 3, b"still here\n"), r


def test_nothing_persists_from_one_execution_to_the_next(pool):
    """Each execution leaves SysV IPC objects, an abstract unix socket held by a daemon and a file
    in /tmp and /dev/shm; every later execution (whichever worker runs it) must see none of them."""
    need(pool, "ipc_namespace", "network_namespace", "private_tmp", "kill_whole_process_tree")
    code = textwrap.dedent("""
        import ctypes, os, socket, time
        libc = ctypes.CDLL(None, use_errno=True)
        ipc = sum(len(open(f"/proc/sysvipc/{k}").read().splitlines()) - 1 for k in ("shm", "msg", "sem"))
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind("\\0rlcode-sandbox-persist")
            bound = True
        except OSError:
            bound = False
        files = [p for p in ("/tmp/left", "/dev/shm/left") if os.path.exists(p)]
        print(ipc, bound, files)
        libc.shmget(0x5EED, 4096, 0o1666)
        libc.msgget(0x5EED, 0o1666)
        for p in ("/tmp/left", "/dev/shm/left"):
            open(p, "w").close()
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
    """)
    outs = [pool.run_python(code).stdout for _ in range(6)]
    assert outs == [b"0 True []\n"] * 6, outs


def test_devices_of_the_host_are_not_reachable(pool):
    need(pool, "private_dev")
    r = pool.run(["sh", "-c", "ls /dev; echo x > /dev/null && head -c 4 /dev/urandom | wc -c"])
    assert r.ok, r
    names = set(r.stdout_text.split())
    assert {"null", "zero", "urandom", "shm"} <= names
    assert not names & {"vda", "sda", "nvidia0", "nvidiactl", "kvm", "mem", "kmsg"}


# ----------------------------------------------------------------------------------------------
# Nothing carried between executions through the worker's heap
# ----------------------------------------------------------------------------------------------

# Counts the places in this process's memory where `prefix` is followed by bytes whose SHA-256 is
# `digest`: the secret itself is never in the scanner's own code or arguments.
MEMORY_SCAN = textwrap.dedent("""
    import hashlib, re, sys
    prefix, digest, n = bytes.fromhex(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    hits = 0
    with open("/proc/self/maps") as f:
        regions = [line.split()[:2] for line in f]
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        for span, perms in regions:
            if "r" not in perms:
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except (OSError, OverflowError, ValueError):
                continue
            for m in re.finditer(re.escape(prefix), data):
                if hashlib.sha256(data[m.end():m.end() + n]).hexdigest() == digest:
                    hits += 1
            del data
    print(hits)
""")


def test_no_heap_content_carries_over_to_the_next_execution():
    """Execution N holds a secret in its code, stdin, files, output and a large string; the next
    execution on the same worker scans all of its own memory for it (/proc/self/maps and
    /proc/self/mem) and must find nothing, whether either runs in place or exec's Python."""
    import hashlib

    prefix = b"RLCODE-HEAP-"
    with SandboxPool(1, LIMITS, uid_base=UID_BASE + 11) as p:
        for first_inprocess in (True, False):
            for second_inprocess in (True, False):
                suffix = uuid.uuid4().hex.encode()
                secret = (prefix + suffix).decode()
                scan_args = (prefix.hex(), hashlib.sha256(suffix).hexdigest(), str(len(suffix)))
                code = (f"import sys\ns = {secret!r}\nbig = (s + '|') * 100_000\n"
                        "data = sys.stdin.read() + open('secret.txt').read()\nprint(s, len(big), len(data))\n")
                r = p.run_python(code, stdin=secret * 50, files={"secret.txt": secret * 50},
                                 inprocess=first_inprocess)
                assert r.ok and r.stdout.startswith(secret.encode()), r
                # The oracle: the scan does find a secret that is in its own execution.
                r = p.run_python(f"s = {secret!r}\n" + MEMORY_SCAN, args=scan_args, inprocess=second_inprocess)
                assert r.ok and int(r.stdout) >= 1, r
                # Run N again (the check above overwrote nothing of the worker), then N + 1.
                assert p.run_python(code, stdin=secret * 50, files={"secret.txt": secret * 50},
                                    inprocess=first_inprocess).ok
                r = p.run_python(MEMORY_SCAN, args=scan_args, inprocess=second_inprocess, timeout=60)
                assert r.ok and r.stdout == b"0\n", (first_inprocess, second_inprocess, r)


# ----------------------------------------------------------------------------------------------
# Bounded working copies
# ----------------------------------------------------------------------------------------------

def _tree(root) -> dict[str, tuple]:
    """relative path -> (kind, content or link target, mode, uid) of every entry below root."""
    from rlcode.sandbox import fstree

    out = {}
    for e in fstree.walk(str(root), max_entries=None).entries:
        data = None
        if e.kind == "file" and e.stat.st_size < 4096:
            data = fstree.read_file(str(root), e.path, max_bytes=4096)
        elif e.kind == "symlink":
            data = os.readlink(os.path.join(str(root), e.path))
        out[e.path] = (e.kind, data, e.stat.st_mode & 0o7777, e.stat.st_uid)
    return out


def _sandbox_owned(root) -> list[str]:
    from rlcode.sandbox import fstree

    return [e.path for e in fstree.walk(str(root), max_entries=None).entries
            if UID_BASE <= e.stat.st_uid < UID_BASE + 16 or UID_BASE <= e.stat.st_gid < UID_BASE + 16]


def _du(root) -> tuple[int, int]:
    from rlcode.sandbox import fstree

    entries = fstree.walk(str(root), max_entries=None).entries
    return sum(e.stat.st_size for e in entries if e.kind == "file"), len(entries)


@pytest.mark.parametrize("inprocess", [False, True])
def test_byte_flood_in_the_workdir_stops_at_the_limit(pool, tmp_path, inprocess):
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "keep.txt").write_text("keep\n")
    limits = dataclasses.replace(LIMITS, workdir_bytes=8 * 2**20, file_size_bytes=64 * 2**20)
    code = textwrap.dedent("""
        import os
        n = 0
        try:
            for i in range(4096):                 # 4 GiB in 1 MiB files, each under RLIMIT_FSIZE
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * 2**20)
                n += 1
        except OSError as e:
            print("stopped", e.errno)
    """)
    r = pool.run_python(code, workdir=str(wd), limits=limits, inprocess=inprocess, timeout=30)
    assert r.ok and r.stdout.startswith(b"stopped 28"), r  # ENOSPC
    assert "workdir_bytes" in r.info, r.info
    size, _ = _du(wd)
    assert size <= limits.workdir_bytes and (wd / "keep.txt").read_text() == "keep\n"
    assert not _sandbox_owned(wd)


def test_inode_flood_in_the_workdir_stops_at_the_limit(pool, tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    limits = dataclasses.replace(LIMITS, workdir_inodes=1000)
    code = textwrap.dedent("""
        n = 0
        try:
            for i in range(100_000):
                open(f"e{i}", "w").close()
                n += 1
        except OSError as e:
            print("stopped", e.errno, n)
    """)
    t0 = time.monotonic()
    r = pool.run_python(code, workdir=str(wd), limits=limits, timeout=60)
    assert r.ok and r.stdout.startswith(b"stopped 28"), r
    assert "workdir_inodes" in r.info, r.info
    _, count = _du(wd)
    assert count <= limits.workdir_inodes and time.monotonic() - t0 < 20
    assert not _sandbox_owned(wd)


def test_workdir_changes_come_back_to_the_host(pool, tmp_path):
    """Writes, deletions, renames, new subdirectories, modes and symlinks made in the sandbox's
    private copy are in the host workdir afterwards, owned by the workdir's owner."""
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    (wd / "a.txt").write_text("a\n")
    (wd / "b.txt").write_text("b\n")
    (wd / "sub" / "c.txt").write_text("c\n")
    (wd / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(wd / "run.sh", 0o755)
    (wd / "same.txt").write_text("same\n")
    owner = os.stat(wd)
    script = ("echo A >> a.txt; rm b.txt; mkdir sub2 && mv sub/c.txt sub2/c.txt && rmdir sub; "
              "mkdir -p deep/x && echo y > deep/x/y.txt; printf '#!/bin/sh\\necho new\\n' > new.sh; "
              "chmod 755 new.sh; chmod 644 run.sh; ln -s a.txt link; ./new.sh")
    r = pool.run(["sh", "-c", script], workdir=str(wd))
    assert r.ok and r.stdout == b"new\n", r
    tree = _tree(wd)
    assert {p: v[:3] for p, v in tree.items()} == {
        "a.txt": ("file", b"a\nA\n", 0o644), "sub2": ("dir", None, 0o755), "sub2/c.txt": ("file", b"c\n", 0o644),
        "deep": ("dir", None, 0o755), "deep/x": ("dir", None, 0o755), "deep/x/y.txt": ("file", b"y\n", 0o644),
        "new.sh": ("file", b"#!/bin/sh\necho new\n", 0o755), "run.sh": ("file", b"#!/bin/sh\necho run\n", 0o644),
        "link": ("symlink", "a.txt", 0o777), "same.txt": ("file", b"same\n", 0o644)}
    assert {v[3] for v in tree.values()} == {owner.st_uid}
    assert not _sandbox_owned(wd)


def test_workdir_outside_tmp_leaves_no_trace(pool):
    """A working copy outside /tmp gets a mount point in the view of its own execution only."""
    from rlcode.sandbox import fstree

    parent = next((d for d in ("/var/tmp", "/srv", "/opt") if os.path.isdir(d) and os.access(d, os.W_OK)), None)
    if parent is None:
        pytest.skip("no writable directory outside /tmp")
    wd = tempfile.mkdtemp(prefix="rlcode-sandbox-wd-", dir=parent)
    try:
        with open(os.path.join(wd, "a.txt"), "w") as f:
            f.write("a\n")
        for _ in range(2):  # both workers
            r = pool.run(["sh", "-c", "cat a.txt; echo b > b.txt; pwd"], workdir=wd)
            assert r.ok and r.stdout == f"a\n{wd}\n".encode(), r
        assert open(os.path.join(wd, "b.txt")).read() == "b\n"
        for _ in range(2):
            assert pool.run(["test", "-e", parent]).status == "error"
    finally:
        fstree.remove(wd)


@pytest.mark.slow
def test_writes_before_a_timeout_an_output_flood_or_a_cancel_are_kept(pool, tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    r = pool.run(["sh", "-c", "echo early > timeout.txt; sleep 60"], workdir=str(wd), timeout=3)
    assert r.status == "timeout", r
    r = pool.run(["sh", "-c", "echo early > flood.txt; yes"], workdir=str(wd), timeout=20)
    assert r.status == "output_limit", r
    # A sleep running means the write before it is done. The shell computes the sleep's argument,
    # so its own command line (which runs before the write) does not hold the token waited for.
    a, b = uuid.uuid4().int % 10**8, uuid.uuid4().int % 10**8
    nap = f"sleep 60.{a + b}"
    fut = pool.submit(["sh", "-c", f"echo early > cancel.txt; exec sleep 60.$(({a} + {b}))"], workdir=str(wd),
                      timeout=60)
    end = time.monotonic() + 20
    while not leftover_processes(nap, uid_base=0, n=0) and time.monotonic() < end:
        time.sleep(0.01)
    pool.cancel(fut)
    assert fut.result(timeout=30).info == "cancelled"
    assert {p: v[1] for p, v in _tree(wd).items()} == {
        "timeout.txt": b"early\n", "flood.txt": b"early\n", "cancel.txt": b"early\n"}
    assert not _sandbox_owned(wd)


# ----------------------------------------------------------------------------------------------
# Deep trees (thousands of levels, paths past PATH_MAX) in a working copy
# ----------------------------------------------------------------------------------------------

DEPTH = 1100
DEEP_MAKER = textwrap.dedent(f"""
    import os
    fd = os.open(".", os.O_RDONLY)
    for i in range({DEPTH}):                      # 1100 levels of 'dddd/': 5500 bytes of path
        os.mkdir("dddd", dir_fd=fd)
        nxt = os.open("dddd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("leaf.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    print("made")
""")


def _make_deep(root) -> None:
    subprocess.run([sys.executable, "-c", DEEP_MAKER], cwd=str(root), check=True, timeout=60)


def test_deep_tree_in_a_workdir_through_the_pool(pool, tmp_path):
    """A tree past Python's recursion limit and PATH_MAX, planted on the host or made by the
    program, kills no worker, raises nothing, leaves nothing owned by a sandbox uid, and can be
    removed."""
    from rlcode.sandbox import fstree

    pids = pool.worker_pids()
    planted, made = tmp_path / "planted", tmp_path / "made"
    try:
        planted.mkdir()
        _make_deep(planted)
        for _ in range(2):  # every worker touches it
            r = pool.run(["sh", "-c", "ls; echo ok"], workdir=str(planted), timeout=30)
            assert r.ok and r.stdout == b"dddd\nok\n", r
        made.mkdir()
        r = pool.run_python(DEEP_MAKER, workdir=str(made), timeout=30)
        assert r.ok and r.stdout == b"made\n", r
        for root in (planted, made):
            entries = fstree.walk(str(root), max_entries=None).entries
            assert len(entries) == DEPTH + 1 and entries[-1].path.endswith("dddd/leaf.py")
            assert not _sandbox_owned(root)
        assert pool.worker_pids() == pids
        assert [pool.run(["true"]).ok for _ in range(2)] == [True, True]
        for root in (planted, made):
            assert fstree.remove(str(root)) == [] and not root.exists()
    finally:
        fstree.remove(str(planted))
        fstree.remove(str(made))


@pytest.mark.slow
def test_deep_tree_through_the_agent_tools(pool, tmp_path):
    from rlcode.envs import tools
    from rlcode.sandbox import fstree

    pids = pool.worker_pids()
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "mod.py").write_text("X = 1\n")
    (root / "tests" / "test_mod.py").write_text("from mod import X\n\ndef test_x():\n    assert X == 1\n")
    try:
        _make_deep(root)
        ws = tools.Workspace(root, pool, test_paths=["tests/test_mod.py"])
        deep = "/".join(["dddd"] * DEPTH)
        calls = [("list_dir", {}), ("read_file", {"path": deep + "/leaf.py"}), ("list_dir", {"path": deep}),
                 ("write_file", {"path": deep + "/new.py", "content": "x = 1\n"}), ("grep", {"pattern": "X"}),
                 ("run", {"command": "find . | wc -l"}), ("lint", {}), ("run_tests", {}),
                 ("write_file", {"path": "top.py", "content": "Y = 2\n"})]
        for name, arguments in calls:
            out = tools.call_tool(ws, name, arguments)  # never raises
            assert out.status in ("ok", "error"), (name, out)
        assert tools.call_tool(ws, "run_tests", {}).status == "ok"
        assert (root / "top.py").read_text() == "Y = 2\n"
        assert not _sandbox_owned(root) and pool.worker_pids() == pids
    finally:
        fstree.remove(str(root))


# ----------------------------------------------------------------------------------------------
# The filesystem view is an allow-list
# ----------------------------------------------------------------------------------------------

def test_only_the_allow_list_is_visible(pool):
    need(pool, "readonly_host_filesystem", "hidden_paths")
    import rlcode  # noqa: PLC0415
    project_root = os.path.dirname(os.path.dirname(os.path.realpath(rlcode.__file__)))
    planted = []
    for parent in ("/opt", "/var/tmp", "/srv", "/work", "/mnt"):
        if os.path.isdir(parent) and os.access(parent, os.W_OK):
            d = tempfile.mkdtemp(prefix="rlcode-sandbox-visible-", dir=parent)
            with open(os.path.join(d, "secret.txt"), "w") as f:
                f.write("host data\n")
            planted.append(d)
    assert planted
    try:
        code = textwrap.dedent(f"""
            import os, pwd
            for d in {planted!r}:
                print(d, os.path.exists(d), os.path.exists(os.path.join(d, "secret.txt")))
            print(sorted(os.listdir("/")))
            print(os.path.exists("/etc/shadow"), pwd.getpwuid(os.getuid()).pw_name,
                  sorted(p.pw_name for p in pwd.getpwall()))
            for name in ("rlcode", "kernels", "experiments"):
                try:
                    m = __import__(name)
                    print("imported", name, os.path.realpath(m.__file__ or ""))
                except Exception as e:
                    print("no", name, type(e).__name__)
        """)
        for inprocess in (False, True):
            r = pool.run_python(code, inprocess=inprocess)
            assert r.ok, r
            lines = r.stdout_text.splitlines()
            assert lines[:len(planted)] == [f"{d} False False" for d in planted], (inprocess, lines)
            top = eval(lines[len(planted)])  # noqa: S307 - our own printed list
            assert not {"opt", "srv", "var", "mnt", "home", "boot", "media"} & set(top), top
            assert lines[len(planted) + 1].startswith("False sandbox "), lines
            # A package of the same name from elsewhere (a third-party distribution may ship a
            # top-level `kernels`) is not this project's code; one under the project's root is.
            imported = [line.split(" ", 2)[1:] for line in lines if line.startswith("imported ")]
            assert not [f for n, f in imported if f.startswith(os.path.join(project_root, n) + os.sep)], (
                inprocess, r.stdout_text)
        host_users = {line.split(":")[0] for line in open("/etc/passwd")} - {"root", "nobody"}
        r = pool.run(["cat", "/etc/passwd", "/etc/group"])
        assert r.ok and not any(u and u + ":" in r.stdout_text for u in host_users), r.stdout_text
    finally:
        for d in planted:
            from rlcode.sandbox import fstree
            fstree.remove(d)


def test_programs_and_libraries_still_work_in_the_allow_list(pool):
    r = pool.run(["sh", "-c", "ls / | grep -c usr; echo hi | grep -q hi && echo grep-ok; command -v python"])
    assert r.ok and r.stdout_text.splitlines()[:2] == ["1", "grep-ok"], r
    code = textwrap.dedent("""
        import subprocess, sys, ssl, sqlite3, json, ctypes, time
        print(subprocess.run(["ls", "/usr"], capture_output=True).returncode,
              subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True).stdout,
              time.strftime("%Z"))
    """)
    for inprocess in (False, True):
        r = pool.run_python(code, inprocess=inprocess)
        assert r.ok and r.stdout.startswith(b"0 b'2\\n' "), (inprocess, r)


@pytest.mark.parametrize("disable", [("template",), ("pid",), ("fs",)], ids=lambda d: "no-" + d[0])
def test_fallbacks_keep_the_guarantees(tmp_path, disable):
    """Without template mount namespaces (each init builds its view), without a PID namespace
    (the init is a subreaper) and without a mount namespace (the private copy is a host
    directory), executions still work, bring their working copy back, keep a timed-out
    execution's writes, leave nothing running and carry no heap content to the next one."""
    import hashlib

    with SandboxPool(1, LIMITS, uid_base=UID_BASE + 12, disable=disable, preload=()) as p:
        plan = p._info["plan"]
        assert ("pid" not in disable or not plan["pidns"]) and ("fs" not in disable or not plan["fs"])
        assert p.run(["true"]).ok
        wd = tmp_path / "wd"
        wd.mkdir()
        (wd / "a.txt").write_text("a\n")
        r = p.run(["sh", "-c", "echo b > b.txt; rm a.txt; mkdir d; echo c > d/c.txt"], workdir=str(wd))
        assert r.ok, r
        r = p.run(["sh", "-c", "echo early > t.txt; sleep 30"], workdir=str(wd), timeout=1)
        assert r.status == "timeout", r
        assert {k: v[1] for k, v in _tree(wd).items()} == {
            "b.txt": b"b\n", "d": None, "d/c.txt": b"c\n", "t.txt": b"early\n"}
        assert not _sandbox_owned(wd)
        tok = _token()
        code = textwrap.dedent(f"""
            import os, time  # {tok}
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(300)
                os._exit(0)
            print("parent exits")
        """)
        r = p.run_python(code, timeout=10, inprocess=True)  # without a mount namespace the
        assert r.ok and r.stdout == b"parent exits\n", r       # pool's Python may be unreachable
        assert_no_leftovers(tok, within=2.0)
        suffix = uuid.uuid4().hex.encode()
        assert p.run_python(f"s = {(b'RLCODE-HEAP-' + suffix).decode()!r} * 2; print(len(s))", inprocess=True).ok
        args = (b"RLCODE-HEAP-".hex(), hashlib.sha256(suffix).hexdigest(), str(len(suffix)))
        r = p.run_python(MEMORY_SCAN, args=args, inprocess=True, timeout=60)
        assert r.ok and r.stdout == b"0\n", r
        if plan["fs"]:
            hidden = tmp_path / "heldout"
            hidden.mkdir()
            (hidden / "secret.txt").write_text("secret\n")
            (hidden / "public.txt").write_text("shared\n")
            limits = Limits(hidden_paths=(str(hidden),), exposed_paths=(str(hidden / "public.txt"),))
            r = p.run(["sh", "-c", f"cat {hidden}/public.txt; ls {hidden}; ls /opt 2>&1 | wc -l"], limits=limits)
            assert r.ok and r.stdout == b"shared\npublic.txt\n1\n", r
            r = p.run_python("import rlcode", inprocess=True)
            assert r.status == "error" and b"ModuleNotFoundError" in r.stderr, r
