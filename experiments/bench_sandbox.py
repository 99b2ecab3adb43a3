"""Benchmark: sandbox pool vs a fresh process per execution, same isolation.

    python -m experiments.bench_sandbox            # full run, writes runs/bench_sandbox/bench_sandbox.json
    python -m experiments.bench_sandbox --publish  # the same into results/ and docs/figures/ (the README's)
    python -m experiments.bench_sandbox --quick    # a few seconds per cell

Programs: `/bin/true` (argv), `python -c "print(1)"`, the same as `python -I -S -c "print(1)"`
(`python_min`: no site, no environment: the cheapest interpreter start), a small pytest file (two
tests), and a shell command that reads the 20 files of a workdir and writes one (the pool copies the workdir into the
execution's private tmpfs and the new file back; each client has a workdir of its own). Each is
run by

  pool            SandboxPool (fork-server workers, pytest pre-imported and warmed up for the
                  in-place mode); Python programs exec the interpreter.
  pool_lean       the same with `preload=()`: smaller workers fork faster (~2 ms less per
                  execution here), at the price of a cold pytest in the in-place mode.
  pool_inprocess  SandboxPool, Python code run in the isolated fork of the warm worker
                  interpreter (pytest pre-imported): no interpreter start-up per execution.
  fresh           a fresh `subprocess.run` per execution of `python -m rlcode.sandbox.worker
                  --oneshot`, i.e. the *same* isolation code (same namespaces, filesystem view,
                  rlimits, uid, cgroups) in a new interpreter, which then runs the program.
  unshare_cli     a fresh `subprocess.run` of util-linux `unshare --user --map-root-user --pid
                  --fork --kill-child --mount --mount-proc --net --ipc --uts` with the same rlimits
                  (set in a preexec_fn), an empty environment and a temporary directory: fewer
                  protections than the pool (no read-only root, private /dev and /tmp, uid drop or
                  cgroups), so an optimistic baseline.
  unshare_min     (`python_min` only) exactly `unshare -Urnpf --mount-proc python -I -S -c
                  "print(1)"` per execution (user, network, PID and mount namespaces, nothing
                  else): the cheapest isolated fresh interpreter, the bar the in-place mode is
                  measured against.

at 1 and 2 concurrent clients (pool: as many workers), each client looping run-and-wait. The
methods of one cell are measured in interleaved rounds so that load from elsewhere on the machine
falls on all of them alike. Reported: executions/s (all clients together), median and p99
latency of one execution as the client sees it, and the pool's speed-up over `fresh` and
`unshare_cli`. Every execution's result is checked (status ok, expected output). `plot(rows, path)`
draws executions/s vs concurrency per program and method (docs/figures/bench_sandbox.png) from
the JSON's rows.

`--profile` adds where an execution's CPU time goes, per process of the pool (one worker, run
back to back): the pool's own process (client and pool threads), the worker (fork server), the
zygote (which forks each init), and the inits with their programs (the zygote's reaped children),
in milliseconds and minor page faults per execution, from /proc and getrusage, for `print(1)` run
in place and exec'd as `python -I -S`; and the floor of any design that forks the warm worker
(`fork_floor`): an interpreter warmed as a worker is (pytest imported and run once, heap frozen)
forking a child that exits at once and reaping it, and the same with a grandchild (the two
nested forks of a sandboxed execution, zygote -> init -> program), with nothing else.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from experiments.cli import PUBLISH_HELP, output_paths
from rlcode.sandbox import Limits, SandboxPool
from rlcode.sandbox import _wire
from rlcode.sandbox import cgroups as cg_lib
from rlcode.sandbox import fstree

_QUICK = flags.DEFINE_bool("quick", False, "Few iterations per cell (seconds in total).")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Concurrency levels (pool workers = client threads).")
_CASES = flags.DEFINE_list("cases", ["true", "python", "python_min", "pytest", "workdir"], "Programs to run.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Interleaved rounds per cell.")
_OUT = flags.DEFINE_string("out", None, "JSON output (default runs/bench_sandbox/bench_sandbox[_quick].json).")
_PNG = flags.DEFINE_string("png", None, "PNG (default: next to the JSON).")
_PUBLISH = flags.DEFINE_bool("publish", False, PUBLISH_HELP)
_PROFILE = flags.DEFINE_bool("profile", False, "Also measure CPU time and page faults per process of the pool.")

LIMITS = Limits(cpu_seconds=20, wall_seconds=60, processes=64)
TEST_FILE = "def test_add():\n    assert 1 + 1 == 2\n\n\ndef test_sort():\n    assert sorted([3, 1, 2]) == [1, 2, 3]\n"
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "test_small.py"]
# executions per round and client, (full, quick)
PER_ROUND = {
    ("true", "pool"): (100, 10), ("true", "pool_lean"): (100, 10), ("true", "fresh"): (25, 3),
    ("true", "unshare_cli"): (50, 5), ("python", "pool_lean"): (30, 4),
    ("python", "pool"): (30, 4), ("python", "pool_inprocess"): (100, 10), ("python", "fresh"): (15, 2),
    ("python", "unshare_cli"): (25, 3),
    ("python_min", "pool"): (50, 5), ("python_min", "pool_lean"): (50, 5), ("python_min", "pool_inprocess"): (100, 10),
    ("python_min", "fresh"): (15, 2), ("python_min", "unshare_cli"): (50, 5), ("python_min", "unshare_min"): (100, 10),
    ("pytest", "pool"): (6, 1), ("pytest", "pool_inprocess"): (30, 4), ("pytest", "fresh"): (5, 1),
    ("pytest", "unshare_cli"): (5, 1),
    ("workdir", "pool"): (100, 10), ("workdir", "pool_lean"): (100, 10), ("workdir", "pool_inprocess"): (100, 10),
    ("workdir", "fresh"): (25, 3), ("workdir", "unshare_cli"): (50, 5),
}
# The workdir case: 20 modules of about 1 KB.
WORKDIR_FILES = {f"pkg/mod{i:02d}.py": f"# module {i}\n" + "".join(f"X{j} = {j}\n" for j in range(100))
                 for i in range(20)}
WORKDIR_BYTES = sum(len(v) for v in WORKDIR_FILES.values())


def _case(name: str, python: str) -> dict:
    """argv / in-process code / files / check of one program."""
    if name == "true":
        return dict(argv=["/bin/true"], code=None, files=None, check=lambda out: out == b"")
    if name == "python":
        return dict(argv=[python, "-c", "print(1)"], code="print(1)", files=None, check=lambda out: out == b"1\n")
    if name == "python_min":
        return dict(argv=[python, "-I", "-S", "-c", "print(1)"], code="print(1)", files=None,
                    check=lambda out: out == b"1\n")
    if name == "pytest":
        code = f"import sys, pytest; sys.exit(pytest.main({PYTEST_ARGS!r}))"
        return dict(argv=[python, "-m", "pytest", *PYTEST_ARGS], code=code, files={"test_small.py": TEST_FILE},
                    check=lambda out: b"2 passed" in out)
    if name == "workdir":
        code = ("import glob; print(sum(len(open(p).read()) for p in glob.glob('pkg/*.py'))); "
                "open('out.txt', 'w').write('x')")
        return dict(argv=["/bin/sh", "-c", "cat pkg/*.py | wc -c; echo x > out.txt"], code=code, files=None,
                    workdir=True, check=lambda out: out.strip() == str(WORKDIR_BYTES).encode())
    raise ValueError(name)


class _Fresh:
    """One client's fresh-process runner: the pool's isolation code in a new interpreter."""

    def __init__(self, plan: dict, index: int, python: str, package_root: str):
        self.python, self.package_root = python, package_root
        self.cgroup = cg_lib.SlotCgroup.create(f"rlcode-bench-fresh-{os.getpid()}-{index}", cg_lib.discover())
        self.cfg = {"slot": index, "uid": 2_100_000_000 + 1000 + index, "preload": [],
                    "cgroup_dirs": [d for _, d in self.cgroup.dirs], "limits": LIMITS.to_dict(), "python": python}
        self.plan = dict(plan, shared_ns=0)  # nothing survives between fresh processes

    def run(self, case: dict, workdir: str | None = None) -> bytes:
        req = {"argv": case["argv"], "files": case["files"], "timeout": 60.0, "limits": LIMITS.to_dict(),
               "workdir": workdir}
        proc = subprocess.run([self.python, "-s", "-m", "rlcode.sandbox.worker", "--oneshot"],
                              input=_wire.dumps((self.cfg, self.plan, req)), capture_output=True,
                              cwd=self.package_root, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, check=True)
        res = _wire.loads(proc.stdout[8:])
        if res["status"] != "ok":
            raise RuntimeError(f"fresh execution failed: {res['status']} {res['info']} {res['stderr'][-500:]!r}")
        return res["stdout"]

    def close(self):
        self.cgroup.remove()


def _unshare_cli_run(case: dict, workdir: str | None = None) -> bytes:
    def limits():
        for res, value in ((resource.RLIMIT_CPU, int(LIMITS.cpu_seconds)), (resource.RLIMIT_AS, LIMITS.address_space_bytes),
                           (resource.RLIMIT_FSIZE, LIMITS.file_size_bytes), (resource.RLIMIT_NOFILE, LIMITS.open_files),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))

    tmp = tempfile.mkdtemp(prefix="bench-unshare-")
    try:
        for rel, content in (case["files"] or {}).items():
            with open(os.path.join(tmp, rel), "w") as f:
                f.write(content)
        cwd = workdir or tmp  # in place: this baseline has no private copy
        cmd = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount",
               "--mount-proc", "--net", "--ipc", "--uts", "--", *case["argv"]]
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, preexec_fn=limits, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"unshare execution failed ({proc.returncode}): {proc.stderr[-500:]!r}")
        return proc.stdout
    finally:
        fstree.remove(tmp)


def _unshare_min_run(python: str) -> bytes:
    proc = subprocess.run(["unshare", "-Urnpf", "--mount-proc", python, "-I", "-S", "-c", "print(1)"],
                          env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, capture_output=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"unshare execution failed ({proc.returncode}): {proc.stderr[-500:]!r}")
    return proc.stdout


def _drive(fn, clients: int, per_client: int, check) -> tuple[float, list[float]]:
    """Run fn() per_client times in each of `clients` threads; (elapsed seconds, latencies)."""
    lat: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int):
        mine = []
        try:
            for _ in range(per_client):
                t0 = time.perf_counter()
                out = fn(i)
                mine.append(time.perf_counter() - t0)
                if not check(out):
                    raise RuntimeError(f"unexpected output {out[-300:]!r}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed, lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_cell(case_name: str, clients: int, pool: SandboxPool, lean: SandboxPool, fresh: list[_Fresh],
               quick: bool) -> list[dict]:
    case = _case(case_name, pool.python)
    wds = [None] * clients  # one workdir per client: the pool serialises executions on one workdir
    if case.get("workdir"):
        wds = [tempfile.mkdtemp(prefix="bench-workdir-") for _ in range(clients)]
        for wd in wds:
            fstree.write_files(wd, WORKDIR_FILES)
    try:
        return _bench_methods(case_name, case, clients, pool, lean, fresh, quick, wds)
    finally:
        for wd in wds:
            if wd is not None:
                fstree.remove(wd)


def _bench_methods(case_name, case, clients, pool, lean, fresh, quick, wds) -> list[dict]:
    methods = {
        "pool": lambda i: pool.run(case["argv"], files=case["files"], workdir=wds[i]).stdout,
        "fresh": lambda i: fresh[i].run(case, wds[i]),
    }
    if (case_name, "pool_lean") in PER_ROUND:
        methods["pool_lean"] = lambda i: lean.run(case["argv"], files=case["files"], workdir=wds[i]).stdout
    if case_name != "true":
        methods["pool_inprocess"] = lambda i: pool.run_python(case["code"], files=case["files"], workdir=wds[i],
                                                              inprocess=True).stdout
    if shutil.which("unshare"):
        methods["unshare_cli"] = lambda i: _unshare_cli_run(case, wds[i])
        if case_name == "python_min":
            methods["unshare_min"] = lambda i: _unshare_min_run(pool.python)
    stats = {m: {"elapsed": 0.0, "lat": []} for m in methods}
    for m, fn in methods.items():  # warm-up (page cache, worker first-run effects)
        _drive(fn, clients, 2, case["check"])
    for _ in range(_ROUNDS.value if not quick else min(_ROUNDS.value, 2)):
        for m, fn in methods.items():
            n = PER_ROUND[(case_name, m)][1 if quick else 0]
            elapsed, lat = _drive(fn, clients, n, case["check"])
            stats[m]["elapsed"] += elapsed
            stats[m]["lat"] += lat
    rows = []
    for m, s in stats.items():
        rows.append(dict(case=case_name, method=m, workers=clients, n=len(s["lat"]),
                         execs_per_s=len(s["lat"]) / s["elapsed"], p50_ms=1e3 * statistics.median(s["lat"]),
                         p99_ms=1e3 * _pct(s["lat"], 0.99)))
    by = {r["method"]: r for r in rows}
    for r in rows:
        for base in ("fresh", "unshare_cli", "unshare_min"):
            if base in by:
                r[f"speedup_vs_{base}"] = r["execs_per_s"] / by[base]["execs_per_s"]
    return rows


_CLK = os.sysconf("SC_CLK_TCK")


def _proc_counters(pid: int) -> dict[str, float]:
    """CPU seconds and minor faults of `pid` itself and of its reaped children (/proc/pid/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is the state, field 3 of stat(5)
    return {"cpu": (int(fields[11]) + int(fields[12])) / _CLK, "children_cpu": (int(fields[13]) + int(fields[14])) / _CLK,
            "faults": float(fields[7]), "children_faults": float(fields[8])}


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _zygote(worker: int, lean: bool) -> int:
    """The zygote of `worker` that forks in-place executions (lean False) or exec'd ones (lean
    True). Between executions the worker's children are its zygotes: one forked from the worker,
    and, when it preloads modules, a lean one (a fresh interpreter started with --zygote) for
    exec'd programs."""
    zygotes = {pid: b"--zygote" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
               for pid in _children(worker)}
    if not 1 <= len(zygotes) <= 2 or sum(zygotes.values()) != len(zygotes) - 1:
        raise RuntimeError(f"expected the worker's children to be its zygotes, found {zygotes}")
    wanted = [pid for pid, is_lean in zygotes.items() if is_lean == (lean and len(zygotes) == 2)]
    return wanted[0]


def profile(pool: SandboxPool, n: int) -> list[dict]:
    """Per process of a one-worker pool: CPU ms and minor faults per execution of `print(1)`, run
    in place and exec'd as `python -I -S`, n executions back to back; "zygote" is the zygote that
    served the mode (`_zygote`)."""
    worker = pool.worker_pids()[0]
    runs = {"inprocess": lambda: pool.run_python("print(1)", inprocess=True),
            "exec_python_min": lambda: pool.run([pool.python, "-I", "-S", "-c", "print(1)"])}
    rows = []
    for mode, fn in runs.items():
        for _ in range(5):
            fn()  # warm
        zygote = _zygote(worker, lean=mode != "inprocess")
        w0, z0, s0 = _proc_counters(worker), _proc_counters(zygote), resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(n):
            res = fn()
            if res.stdout != b"1\n":
                raise RuntimeError(f"unexpected result {res}")
        wall = time.perf_counter() - t0
        w1, z1, s1 = _proc_counters(worker), _proc_counters(zygote), resource.getrusage(resource.RUSAGE_SELF)
        per = lambda x: 1e3 * x / n
        roles = {
            "pool process": (s1.ru_utime + s1.ru_stime - s0.ru_utime - s0.ru_stime, s1.ru_minflt - s0.ru_minflt),
            "worker": (w1["cpu"] - w0["cpu"], w1["faults"] - w0["faults"]),
            "zygote": (z1["cpu"] - z0["cpu"], z1["faults"] - z0["faults"]),
            "inits + programs": (z1["children_cpu"] - z0["children_cpu"], z1["children_faults"] - z0["children_faults"]),
        }
        total = sum(c for c, _ in roles.values())
        for role, (cpu, faults) in roles.items():
            rows.append(dict(mode=mode, role=role, cpu_ms=per(cpu), faults=faults / n, share=cpu / total if total else 0.0,
                             wall_ms=per(wall), n=n))
    return rows


_FORK_FLOOR = r"""
import gc, json, os, resource, sys, tempfile, time
from rlcode.sandbox import worker
worker._warm_pytest(tempfile.gettempdir())
gc.freeze()
n = int(sys.argv[1])
out = []
for depth in (1, 2):
    s0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            if depth == 2:
                child = os.fork()
                if child == 0:
                    os._exit(0)
                os.waitpid(child, 0)
            os._exit(0)
        os.waitpid(pid, 0)
    wall = time.perf_counter() - t0
    s1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    for role, a, b in (("parent", s0, s1), ("children", c0, c1)):
        out.append({"depth": depth, "role": role, "cpu": b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime,
                    "faults": b.ru_minflt - a.ru_minflt, "wall": wall})
print(json.dumps(out))
"""


def fork_floor(n: int, package_root: str) -> list[dict]:
    """CPU ms and minor faults per execution of the bare forks of a warm worker's interpreter
    (one child; a child and a grandchild), n of each back to back, in rows like `profile`'s."""
    out = subprocess.run([sys.executable, "-s", "-c", _FORK_FLOOR, str(n)], cwd=package_root, check=True,
                         capture_output=True, text=True)
    measured = json.loads(out.stdout)
    rows = []
    for depth in (1, 2):
        mine = [m for m in measured if m["depth"] == depth]
        total = sum(m["cpu"] for m in mine)
        mode = "fork_floor_" + ("one" if depth == 1 else "two")
        for m in mine:
            rows.append(dict(mode=mode, role=m["role"], cpu_ms=1e3 * m["cpu"] / n, faults=m["faults"] / n,
                             share=m["cpu"] / total if total else 0.0, wall_ms=1e3 * m["wall"] / n, n=n))
    return rows


METHOD_ORDER = ("pool", "pool_lean", "pool_inprocess", "fresh", "unshare_cli", "unshare_min")
# What the figure's legend calls each method (the JSON keeps the short names).
METHOD_LABELS = {
    "pool": "sandbox pool: program exec'd (pytest preloaded)",
    "pool_lean": "sandbox pool, lean workers (nothing preloaded)",
    "pool_inprocess": "sandbox pool: Python run in the warm worker",
    "fresh": "new interpreter per execution, same isolation",
    "unshare_cli": "unshare(1) per execution, fewer protections",
    "unshare_min": "unshare -Urnpf --mount-proc python -I -S per execution",
}


def plot(rows, path):
    """Executions/s (all clients together, log scale) vs concurrent clients, one panel per program,
    one line per method (the pool's methods solid, the fresh-process baselines dashed), into the PNG
    `path`. Returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    cases = list(dict.fromkeys(r["case"] for r in rows))
    methods = sorted({r["method"] for r in rows}, key=lambda m: (METHOD_ORDER + (m,)).index(m))
    fig = Figure(figsize=(4.2 * max(1, len(cases)) + 0.5, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(cases)), squeeze=False).ravel()
    for ax, case in zip(axes, cases):
        for i, method in enumerate(methods):
            pts = sorted((r["workers"], r["execs_per_s"]) for r in rows if r["case"] == case and r["method"] == method)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if method in ("fresh", "unshare_cli") else "-",
                        marker="o", color=f"C{i}", label=METHOD_LABELS.get(method, method))
        workers = sorted({r["workers"] for r in rows if r["case"] == case})
        ax.set_xticks(workers)
        ax.set_xlabel("concurrent clients (= pool workers)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("executions / s (all clients, log scale)")
        ax.set_title({"true": "/bin/true", "python": 'python -c "print(1)"',
                      "python_min": 'python -I -S -c "print(1)"', "pytest": "pytest, 2 tests",
                      "workdir": "sh, 20-file workdir"}.get(case, case))
    legend = {}  # a method missing from one program (no in-process /bin/true) is still named
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    labels = [METHOD_LABELS.get(m, m) for m in methods]
    fig.legend([legend[m] for m in labels if m in legend], [m for m in labels if m in legend],
               loc="outside lower center", ncol=3, fontsize="small")
    fig.suptitle("sandbox: pool vs a fresh process per execution, same isolation (python -m experiments.bench_sandbox)",
                 fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def main(argv):
    del argv
    quick = _QUICK.value
    out_path, png = output_paths("bench_sandbox", quick, _OUT.value, _PNG.value, _PUBLISH.value)
    workers = [int(w) for w in _WORKERS.value]
    import rlcode
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(rlcode.__file__)))
    rows, guarantees = [], None
    for k in workers:
        with SandboxPool(k, LIMITS) as pool, SandboxPool(k, LIMITS, preload=(), uid_base=2_100_000_500) as lean:
            guarantees = pool.guarantees()
            plan = pool._info["plan"]
            fresh = [_Fresh(plan, i, pool.python, package_root) for i in range(k)]
            try:
                for case_name in _CASES.value:
                    cell = bench_cell(case_name, k, pool, lean, fresh, quick)
                    rows += cell
                    for r in cell:
                        print(f"{r['case']:7s} {r['method']:15s} workers={k} n={r['n']:4d} "
                              f"{r['execs_per_s']:8.1f}/s p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms", flush=True)
            finally:
                for f in fresh:
                    f.close()
    header = (f"{'program':8s} {'method':15s} {'workers':>7s} {'n':>5s} {'exec/s':>8s} {'p50 ms':>8s} "
              f"{'p99 ms':>8s} {'x fresh':>8s} {'x unshare':>9s} {'x unshare_min':>13s}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['case']:8s} {r['method']:15s} {r['workers']:7d} {r['n']:5d} {r['execs_per_s']:8.1f} "
              f"{r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r.get('speedup_vs_fresh', float('nan')):8.2f} "
              f"{r.get('speedup_vs_unshare_cli', float('nan')):9.2f} "
              f"{r.get('speedup_vs_unshare_min', float('nan')):13.2f}")
    prof = None
    if _PROFILE.value:
        with SandboxPool(1, LIMITS) as pool:
            prof = profile(pool, 40 if quick else 600)
        prof += fork_floor(40 if quick else 600, package_root)
        print(f"\n{'mode':16s} {'process':17s} {'CPU ms/exec':>11s} {'share':>6s} {'faults/exec':>11s}")
        for r in prof:
            print(f"{r['mode']:16s} {r['role']:17s} {r['cpu_ms']:11.2f} {r['share']:6.0%} {r['faults']:11.0f}")
        for mode in dict.fromkeys(r["mode"] for r in prof):
            mine = [r for r in prof if r["mode"] == mode]
            print(f"{mode}: {sum(r['cpu_ms'] for r in mine):.2f} ms CPU per execution in all, "
                  f"{mine[0]['wall_ms']:.2f} ms wall (" + ("bare forks of a warm interpreter" if mode.startswith("fork_floor")
                                                             else "one worker") + ", back to back)")
    record = dict(
        rows=rows, profile=prof, quick=quick, rounds=_ROUNDS.value, limits=LIMITS.to_dict(), guarantees=guarantees,
        machine=dict(cpus=os.cpu_count(), kernel=platform.release(), python=platform.python_version(),
                     loadavg_at_end=os.getloadavg()),
        notes=("speedup_vs_X = executions/s of this method / executions/s of X in the same cell. "
               "'pool' execs the Python interpreter for Python programs, so its advantage there is "
               "bounded by interpreter start-up; 'pool_inprocess' runs the code in the warm worker."),
    )
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)
    plot(rows, png)
    print(f"\nwrote {out_path} and {png}")


if __name__ == "__main__":
    app.run(main)
