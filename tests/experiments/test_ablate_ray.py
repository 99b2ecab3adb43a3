"""experiments.ablate --launcher=ray on a local Ray cluster: the grid's runs execute as Ray tasks
and leave the same run directories and the same table as the local launcher; they overlap in time
as far as the resources they ask for allow; a run whose command fails is recorded, not retried; a
run whose worker dies under it is started again and completes; rerunning the command skips what
completed. A stand-in for experiments.train (on PYTHONPATH, picked with --train_module, as in
test_ablate.py) takes a few hundredths of a second and reads what to do from a file in --out_dir.
Without a cluster: the flags' errors, the launcher's flags left out of the recorded command, and
the one-line errors for a missing ray package and an unreachable address."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from experiments import ablate
from support.cli import foreground, sigint_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "grpo_synth.py")

STANDIN = textwrap.dedent('''
    """Stands in for experiments.train: reads --config* flags, logs like the loop. What else it does
    comes from <out_dir>/standin.json: {"fail": [label, ...]} exit 3; {"preempt": [label, ...]} on
    the first attempt kill the process that started it (the Ray worker); {"barrier": n} wait until
    n runs of the grid have started; {"sleep": s} sleep s seconds; {"hold": true} a fresh run waits
    (up to 60 s) for a SIGINT, records it (and any other arriving meanwhile) and stops unfinished."""
    import json, os, signal, sys, time

    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = flags["config.workdir"]
    label = os.path.basename(os.path.dirname(workdir))
    out_dir = os.path.dirname(os.path.dirname(workdir))
    try:
        mode = json.load(open(os.path.join(out_dir, "standin.json")))
    except OSError:
        mode = {}
    os.makedirs(os.path.join(workdir, "tb"), exist_ok=True)
    open(os.path.join(workdir, "config.json"), "w").write(json.dumps(flags))
    open(os.path.join(workdir, "started"), "w").write(repr(time.time()))
    print("stand-in", flags["config"], "resume" if flags.get("config.resume") == "True" else "fresh", flush=True)
    if label in mode.get("fail", ()):
        print("ValueError: simulated failure", file=sys.stderr)
        sys.exit(3)
    marker = os.path.join(workdir, "preempted")
    if label in mode.get("preempt", ()) and not os.path.exists(marker):
        open(marker, "w").write(str(os.getpid()))
        os.kill(os.getppid(), signal.SIGKILL)  # the worker dies, as with a lost node
        time.sleep(30)
        open(os.path.join(workdir, "outlived_its_worker"), "w").close()
        sys.exit(0)
    if mode.get("hold") and flags.get("config.resume") != "True":
        got = []

        def stop(signum, frame):
            got.append(signum)
            open(os.path.join(workdir, "signals"), "a").write(f"{signum}\\n")

        signal.signal(signal.SIGINT, stop)
        t0 = time.time()
        open(os.path.join(workdir, "holding"), "w").write(repr(t0))
        deadline = t0 + 60
        while not got and time.time() < deadline:
            time.sleep(0.02)
        print(f"stand-in held {time.time() - t0:.2f} s: {'signal' if got else 'no signal'}", flush=True)
        time.sleep(0.5)  # a second signal arriving meanwhile is recorded too
        json.dump({"completed": False, "interrupted": True, "seconds": 1.0},
                  open(os.path.join(workdir, "summary.json"), "w"))
        sys.exit(0 if got else 5)
    if "barrier" in mode:
        deadline = time.time() + 30
        while time.time() < deadline:
            names = [os.path.join(out_dir, d, s, "started") for d in os.listdir(out_dir)
                     if os.path.isdir(os.path.join(out_dir, d)) for s in os.listdir(os.path.join(out_dir, d))]
            if sum(map(os.path.exists, names)) >= mode["barrier"]:
                break
            time.sleep(0.02)
    time.sleep(mode.get("sleep", 0))
    seed = int(flags["config.seed"])
    bonus = 0.05 if "dapo" in flags["config"] else 0.0
    with open(os.path.join(workdir, "tb", "metrics.jsonl"), "a") as f:
        for step in (0, 1, 2):
            rec = {"step": step, "wall_time": 1000.0 + step, "eval/pass@1": 0.1 * step + 0.01 * seed + bonus,
                   "eval/best_of_4": 0.2 * step, "eval/length": 30.0 + step}
            f.write(json.dumps(rec) + "\\n")
    json.dump({"completed": True, "seconds": 90.0 + seed, "steps_done": 2},
              open(os.path.join(workdir, "summary.json"), "w"))
    open(os.path.join(workdir, "ended"), "w").write(repr(time.time()))
''')


@pytest.fixture(scope="module")
def standin_env(tmp_path_factory):
    """The environment variables under which runs find the stand-in (PYTHONPATH) and Ray stays quiet."""
    bin_dir = tmp_path_factory.mktemp("standin")
    (bin_dir / "standin_train.py").write_text(STANDIN)
    return {"PYTHONPATH": os.pathsep.join([str(bin_dir), ROOT, os.environ.get("PYTHONPATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def cluster(standin_env):
    """A 2-CPU local Ray cluster whose workers (and the local launcher's runs) find the stand-in."""
    ray = pytest.importorskip("ray")
    sigterm = signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in standin_env.items():
            mp.setenv(name, value)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            yield ray
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, sigterm)


def grid(out, mode=None, seeds=2):
    """The argv of a 2-variant grid in `out` with the stand-in; `mode` goes to its standin.json."""
    out.mkdir(parents=True, exist_ok=True)
    if mode is not None:
        (out / "standin.json").write_text(json.dumps(mode))
    return [f"--config={CONFIG}", "--sweep=loss:grpo,dapo", f"--seeds={seeds}", f"--out_dir={out}",
            "--set", "train.steps=7", "--train_module=standin_train"]


RAY = ["--launcher=ray", "--cpus_per_run=1"]


def run_dirs(out):
    return sorted(p.parent for p in out.glob("*/seed*/command.txt"))


def attempts(workdir):
    return (workdir / "log.txt").read_text().count("==== ")


def span(workdir):
    return float((workdir / "started").read_text()), float((workdir / "ended").read_text())


def without_headers(text):
    """A log without the attempts' '==== <date> <command>' lines (their dates differ)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("==== "))


def same_outputs(a, b):
    """The run directories and the table files of two grids run in the same --out_dir (moved
    aside in between) hold the same things, attempt dates and durations aside."""
    assert [d.relative_to(a) for d in run_dirs(a)] == [d.relative_to(b) for d in run_dirs(b)]
    for da, db in zip(run_dirs(a), run_dirs(b)):
        for name in ("command.txt", "config.json", "summary.json", "tb/metrics.jsonl"):
            if (da / name).exists() or (db / name).exists():
                assert (da / name).read_text() == (db / name).read_text(), (da, name)
        assert without_headers((da / "log.txt").read_text()) == without_headers((db / "log.txt").read_text())
        status_a, status_b = (json.loads((d / ablate.STATUS_FILE).read_text()) for d in (da, db))
        for s in (status_a, status_b):
            s.pop("seconds")
            s["log_tail"] = without_headers(s["log_tail"])
        assert status_a == status_b
    for suffix in ("md", "csv"):
        assert (a / f"ablate_loss.{suffix}").read_text() == (b / f"ablate_loss.{suffix}").read_text()
    data_a, data_b = (json.loads((d / "ablate_loss.json").read_text()) for d in (a, b))
    for data in (data_a, data_b):
        for r in data["runs"]:
            r["log_tail"] = without_headers(r.get("log_tail", ""))
    assert data_a == data_b


# ------------------------------------------------------------------------------ without a cluster
# (first: the module's cluster, once started, stays up until the module's last test)


def test_launcher_flags_are_checked_and_left_out_of_the_recorded_command(capsys):
    for argv, message in ((["--ray_address=auto"], "--ray_address: only with --launcher=ray"),
                          (["--gpus_per_run=1", "--max_retries=1"], "--gpus_per_run, --max_retries: only with"),
                          (["--launcher=ray", "--cpus_per_run=0"], "--cpus_per_run=0: must be > 0"),
                          (["--launcher=ray", "--max_retries=-1"], "--max_retries=-1: must be >= 0"),
                          (["--launcher=ray", "--ray_address=headnode"], "expected auto, HOST:PORT or ray://"),
                          (["--launcher=slurm"], "invalid choice: 'slurm'")):
        with pytest.raises(SystemExit) as e:
            ablate.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    for address in ("", "auto", "10.0.0.1:6379", "ray://head:10001", "[::1]:6379"):
        assert ablate.parse_args(["--launcher=ray", f"--ray_address={address}"]).ray_address == address
    argv = ["--sweep=loss:grpo,dapo", "--launcher=ray", "--ray_address", "auto", "--cpus_per_run=4",
            "--gpus_per_run", "1", "--max_retries=2", "--seeds=2", "--launcher", "ray", "--dry_run"]
    assert ablate.recorded_command(argv) == "python -m experiments.ablate --sweep=loss:grpo,dapo --seeds=2"


def test_missing_ray_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    out = tmp_path / "runs"
    assert ablate.main([f"--config={CONFIG}", "--sweep=loss:grpo", f"--out_dir={out}", "--launcher=ray"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --launcher=ray needs the ray package") and err.count("\n") == 1
    assert 'pip install -e ".[distributed]"' in err and not out.exists()


def test_an_unreachable_address_is_one_line_before_any_run(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already")
    out = tmp_path / "runs"
    t0 = time.monotonic()
    assert ablate.main([f"--config={CONFIG}", "--sweep=loss:grpo", f"--out_dir={out}", "--launcher=ray",
                        "--ray_address=127.0.0.1:1"]) == 2
    assert time.monotonic() - t0 < 60  # not ray.init's minutes of retrying
    err = capsys.readouterr().err
    assert err.startswith("error: --ray_address=127.0.0.1:1: cannot reach the Ray cluster: ") and err.count("\n") == 1
    assert not ray.is_initialized() and not out.exists()


def test_a_stop_file_sends_the_run_one_sigint_and_a_task_that_finds_it_does_not_start(standin_env, tmp_path,
                                                                                      monkeypatch):
    """How a Ray task is stopped (Ray's own cancellation of a running task is not reliably
    delivered): the stop file appearing while the run holds makes `execute` send it one SIGINT and
    record it interrupted; a task started after the file exists runs nothing."""
    for name, value in standin_env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "runs"
    grid(out, {"hold": True})
    run = ablate.Run(label="loss=grpo", variant={}, seed=0, workdir=str(out / "loss=grpo" / "seed0"), arg=None,
                      fields=[])
    cmd = [sys.executable, "-m", "standin_train", f"--config={CONFIG}", "--config.seed=0",
           f"--config.workdir={run.workdir}"]
    stop = tmp_path / ".stop"
    holding = out / "loss=grpo" / "seed0" / "holding"

    def request_stop():
        deadline = time.time() + 60
        while not holding.exists() and time.time() < deadline:
            time.sleep(0.02)
        stop.write_text("stop\n")

    waiter = threading.Thread(target=request_stop)
    waiter.start()
    said = []
    with pytest.raises(ablate.Interrupted) as info:
        ablate.execute(run, cmd, say=said.append, in_ray_task=True, stop_file=str(stop))
    waiter.join()
    assert info.value.args[0]["status"] == "interrupted" and info.value.args[0]["returncode"] == 0
    assert (holding.parent / "signals").read_text() == f"{int(signal.SIGINT)}\n"
    assert "s: signal" in (holding.parent / "log.txt").read_text() and "interrupted: stopping" in said[0]
    assert json.loads((holding.parent / ablate.STATUS_FILE).read_text())["status"] == "interrupted"

    other = ablate.Run(label="loss=dapo", variant={}, seed=0, workdir=str(out / "loss=dapo" / "seed0"), arg=None,
                       fields=[])
    assert ablate.run_in_ray_task(dataclasses.asdict(other), cmd, ROOT, str(stop)) is None
    assert not (out / "loss=dapo").exists()


@pytest.mark.slow
def test_without_an_address_a_ray_instance_is_started_for_the_grid_and_stopped(standin_env, tmp_path,
                                                                              monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already")
    for name, value in standin_env.items():
        monkeypatch.setenv(name, value)
    sigterm = signal.getsignal(signal.SIGTERM)
    assert ablate.main([*grid(tmp_path / "runs", seeds=1), "--launcher=ray"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Ray cluster: 1 node\(s\), \d+ CPUs, \d+ GPUs; 2 run\(s\) of 1 CPU\(s\) \+ 0 GPU\(s\)", out)
    assert len(re.findall(r"^\[\d/2\] loss=\w+ seed 0: completed in", out, re.M)) == 2
    assert not ray.is_initialized() and signal.getsignal(signal.SIGTERM) is sigterm


# ------------------------------------------------------------------------------ on a local cluster


@pytest.mark.slow
def test_ray_grid_leaves_what_the_local_launcher_leaves(cluster, tmp_path, capsys):
    argv = grid(tmp_path / "runs")
    assert ablate.main([*argv, *RAY, "--max_retries=1"]) == 0
    out = capsys.readouterr().out
    assert "4 run(s) of 1 CPU(s) + 0 GPU(s) each, up to 2 at a time" in out
    finished = re.findall(r"^\[(\d)/4\] (loss=\w+) seed (\d): completed in", out, re.M)
    assert [n for n, _, _ in finished] == ["1", "2", "3", "4"]  # a line as each run ends
    assert sorted((label, seed) for _, label, seed in finished) == [
        ("loss=dapo", "0"), ("loss=dapo", "1"), ("loss=grpo", "0"), ("loss=grpo", "1")]
    assert "grid done" in out
    table = (tmp_path / "runs" / "ablate_loss.md").read_text()
    assert "| loss=dapo | 2/2 |" in table and "--launcher" not in table
    (tmp_path / "runs").rename(tmp_path / "ray_runs")

    assert ablate.main(argv) == 0  # the local launcher, the same grid in the same directory
    capsys.readouterr()
    same_outputs(tmp_path / "ray_runs", tmp_path / "runs")


@pytest.mark.slow
def test_runs_overlap_as_far_as_their_resources_allow(cluster, tmp_path):
    # 1 CPU each on 2 CPUs: each run waits (up to 30 s) until both have started.
    out = tmp_path / "one_cpu"
    assert ablate.main([*grid(out, {"barrier": 2}, seeds=1), *RAY]) == 0
    (a_start, a_end), (b_start, b_end) = sorted(span(d) for d in run_dirs(out))
    assert b_start < a_end  # the second started before the first ended
    # 2 CPUs each: one at a time.
    out = tmp_path / "two_cpus"
    assert ablate.main([*grid(out, {"sleep": 0.3}, seeds=1), "--launcher=ray", "--cpus_per_run=2"]) == 0
    (a_start, a_end), (b_start, b_end) = sorted(span(d) for d in run_dirs(out))
    assert a_end <= b_start
    # More than a node holds: an error before any run, not a wait for ever.
    out = tmp_path / "too_big"
    assert ablate.main([*grid(out, seeds=1), "--launcher=ray", "--cpus_per_run=3"]) == 2
    assert not run_dirs(out)


@pytest.mark.slow
def test_a_failing_command_is_recorded_not_retried(cluster, tmp_path, capsys):
    argv = grid(tmp_path / "runs", {"fail": ["loss=dapo"]})
    assert ablate.main([*argv, *RAY, "--max_retries=2"]) == 1
    out = capsys.readouterr().out
    assert len(re.findall(r"^\[\d/4\] loss=dapo seed \d: FAILED \(exit 3\)", out, re.M)) == 2
    assert len(re.findall(r"^\[\d/4\] loss=grpo seed \d: completed", out, re.M)) == 2
    assert "retrying" not in out and "ValueError: simulated failure" in out
    for seed in (0, 1):
        run = tmp_path / "runs" / "loss=dapo" / f"seed{seed}"
        assert attempts(run) == 1
        status = json.loads((run / ablate.STATUS_FILE).read_text())
        assert (status["status"], status["returncode"]) == ("failed", 3)
    data = json.loads((tmp_path / "runs" / "ablate_loss.json").read_text())
    assert [(row["completed"], row["failed"]) for row in data["table"]] == [(2, 0), (0, 2)]
    (tmp_path / "runs").rename(tmp_path / "ray_runs")

    assert ablate.main(grid(tmp_path / "runs", {"fail": ["loss=dapo"]})) == 1  # as the local launcher records it
    capsys.readouterr()
    same_outputs(tmp_path / "ray_runs", tmp_path / "runs")


@pytest.mark.slow
def test_a_run_whose_worker_dies_is_retried_and_completes(cluster, tmp_path, capsys):
    argv = grid(tmp_path / "runs", {"preempt": ["loss=dapo"]}, seeds=1)
    assert ablate.main([*argv, *RAY, "--max_retries=1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[\d/2\] loss=dapo seed 0: lost \(WorkerCrashedError: .*\); retrying \(1 of 1\)$", out, re.M)
    assert re.search(r"^\[\d/2\] loss=dapo seed 0: completed in", out, re.M)
    run = tmp_path / "runs" / "loss=dapo" / "seed0"
    assert attempts(run) == 2 and attempts(run.parent.parent / "loss=grpo" / "seed0") == 1
    assert (run / "command.txt").read_text().strip().endswith("--config.resume=True")  # the retry resumes
    assert json.loads((run / ablate.STATUS_FILE).read_text())["status"] == "completed"
    # The first attempt's process went with its worker instead of running on beside the retry.
    pid = int((run / "preempted").read_text())
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}/cmdline") or b"standin_train" not in open(
        f"/proc/{pid}/cmdline", "rb").read()
    assert not (run / "outlived_its_worker").exists()
    data = json.loads((tmp_path / "runs" / "ablate_loss.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["completed", "completed"]


@pytest.mark.slow
def test_a_run_lost_more_often_than_max_retries_is_recorded_failed(cluster, tmp_path, capsys):
    argv = grid(tmp_path / "runs", {"preempt": ["loss=dapo"]}, seeds=1)
    assert ablate.main([*argv, *RAY, "--max_retries=0"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[\d/2\] loss=dapo seed 0: FAILED \(WorkerCrashedError: ", out, re.M)
    run = tmp_path / "runs" / "loss=dapo" / "seed0"
    status = json.loads((run / ablate.STATUS_FILE).read_text())
    assert status["status"] == "failed" and status["returncode"] is None
    assert "stand-in" in status["log_tail"]  # the run's own last lines, then why it ended
    assert status["log_tail"].splitlines()[-1].startswith("ablate: the run's Ray task was lost: WorkerCrashedError")
    assert "loss=dapo seed 0: failed: `ablate: the run's Ray task was lost" in (
        tmp_path / "runs" / "ablate_loss.md").read_text()


@pytest.mark.slow
def test_rerunning_skips_completed_runs_and_resumes_the_rest(cluster, tmp_path, capsys):
    out_dir = tmp_path / "runs"
    argv = [*grid(out_dir, {"fail": ["loss=dapo"]}), *RAY]
    assert ablate.main(argv) == 1
    capsys.readouterr()
    logs = {d: (d / "log.txt").read_text() for d in out_dir.glob("loss=grpo/seed*")}

    (out_dir / "standin.json").write_text("{}")
    assert ablate.main(argv) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^\[(\d)/4\] (loss=\w+) seed (\d): completed before, skipped$", out, re.M) == [
        ("1", "loss=grpo", "0"), ("3", "loss=grpo", "1")]
    assert "2 run(s) of 1 CPU(s)" in out
    assert {d: (d / "log.txt").read_text() for d in logs} == logs  # not run again
    for seed in (0, 1):
        run = out_dir / "loss=dapo" / f"seed{seed}"
        assert attempts(run) == 2 and (run / "command.txt").read_text().strip().endswith("--config.resume=True")
    data = json.loads((out_dir / "ablate_loss.json").read_text())
    assert [(row["completed"], row["runs"]) for row in data["table"]] == [(2, 2), (2, 2)]

    assert ablate.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("completed before, skipped") == 4 and "Ray cluster" not in out


@pytest.mark.slow
def test_the_cli_joins_a_cluster_by_address_and_ctrl_c_stops_its_runs_once(cluster, tmp_path, capsys):
    """A driver that joins a running cluster (the module's, by HOST:PORT), stopped with Ctrl-C
    while two runs run and one waits: each running run gets exactly one SIGINT (it saves and
    stops), the partial table is written, the status is 130; the same command again resumes them."""
    address = cluster.get_runtime_context().gcs_address
    out = tmp_path / "runs"
    argv = [*grid(out, {"hold": True}, seeds=1), *RAY]
    argv[argv.index("--sweep=loss:grpo,dapo")] = "--sweep=loss:grpo,dapo,gspo"
    # Its own process group, like a shell job: Ctrl-C in a terminal signals the whole group.
    proc = subprocess.Popen(foreground([sys.executable, "-m", "experiments.ablate", *argv, f"--ray_address={address}"]),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while len(list(out.glob("*/seed0/holding"))) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(list(out.glob("*/seed0/holding"))) == 2, proc.communicate()[0]
        assert sigint_state(proc.pid) == "deliverable"
        sent = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout[-3000:]
    assert "Ray cluster: 1 node(s), 2 CPUs, 0 GPUs; 3 run(s)" in stdout and "up to 2 at a time" in stdout
    assert "interrupted: stopping 3 run(s)" in stdout and "writing the partial table" in stdout
    data = json.loads((out / "ablate_loss.json").read_text())
    status = {r["label"]: r["status"] for r in data["runs"]}
    logs = {d.parent.name: (d / "log.txt").read_text() for d in out.glob("*/seed0") if (d / "log.txt").exists()}
    held_since = {d.parent.parent.name: sent - float(d.read_text()) for d in out.glob("*/seed0/holding")}
    assert sorted(status.values()) == ["interrupted", "interrupted", "missing"], (status, held_since, logs, stdout[-3000:])
    held = [out / label / "seed0" for label, s in status.items() if s == "interrupted"]
    assert [(d / "signals").read_text() for d in held] == [f"{int(signal.SIGINT)}\n"] * 2
    assert not list(out.glob(".ablate_stop*"))  # the stop file is gone with the grid

    (out / "standin.json").write_text("{}")
    assert ablate.main(argv) == 0  # in this process: through its own connection to the cluster
    assert "3 run(s) of 1 CPU(s)" in capsys.readouterr().out
    for d in held:
        assert (d / "command.txt").read_text().strip().endswith("--config.resume=True") and attempts(d) == 2
    data = json.loads((out / "ablate_loss.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["completed"] * 3
