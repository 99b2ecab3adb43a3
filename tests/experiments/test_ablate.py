"""experiments.ablate: sweep keys resolve to config fields or the config argument, the grid and its
commands are what the docstring promises, runs are skipped / resumed / recorded as failed, the
table's numbers are the hand-computed ones, and the real CLI runs a tiny grid end to end."""

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from experiments import ablate
from rlcode.train.metrics import EventWriter, read_jsonl
from support.cli import foreground, sigint_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "grpo_synth.py")


@pytest.fixture(scope="module")
def ctx():
    return ablate.ConfigContext.load(CONFIG)


# ------------------------------------------------------------------------------ keys and values


def test_key_resolution(ctx):
    leaf = ablate.parse_sweep("rollout.group_size:4,8,16", ctx)
    assert (leaf.target, leaf.kind, leaf.values) == ("rollout.group_size", "field", [4, 8, 16])
    suffix = ablate.parse_sweep("attention.kind:dense,nsa,squid", ctx)
    assert (suffix.target, suffix.kind, suffix.values) == ("model.attention.kind", "field", ["dense", "nsa", "squid"])
    alias = ablate.parse_sweep("rollout.async:True,false", ctx)  # experiments.cli's alias of a keyword field
    assert (alias.target, alias.values) == ("rollout.async_mode", [True, False])
    arg = ablate.parse_sweep("loss:grpo,dapo", ctx)
    assert (arg.target, arg.kind, arg.values) == ("loss", "arg", ["grpo", "dapo"])
    fixed = ablate.parse_set("optim.lr=1e-3", ctx)
    assert fixed.values == [1e-3] and isinstance(fixed.values[0], float)
    assert ablate.parse_set("train.steps=30", ctx).values == [30]


def test_key_resolution_without_ARGS_probes_get_config(ctx):
    class NoArgs:  # the same config file with no ARGS list: the argument is probed with get_config
        get_config = staticmethod(ctx.module.get_config)

    bare = ablate.ConfigContext(ctx.path, None, NoArgs(), ctx.leaves)
    assert ablate.parse_sweep("mlp:dense,moe", bare).kind == "arg"
    with pytest.raises(ablate.AblationError, match="unknown key 'mlpp'"):
        ablate.parse_sweep("mlpp:dense", bare)


@pytest.mark.parametrize("spec, message", [
    ("kind:a,b", r"ambiguous.*loss\.kind, model\.attention\.kind, model\.mlp\.kind"),
    ("steps:1", r"ambiguous.*sft\.steps, train\.steps"),
    ("atention.kind:dense", r"unknown key 'atention\.kind'.*nearest: model\.attention\.kind"),
    ("rollout.group_sise:4", r"unknown key 'rollout\.group_sise'.*nearest: rollout\.group_size"),
    ("loss:grpo,foo", r"rejects loss=foo: loss='foo' is not one of"),
    ("rollout.group_size:4,x", r"'x' is not a valid int"),
    ("eval.at_start:maybe", r"'maybe' is not a valid bool"),
    ("loss.dual_clip:3.0", r"holds None"),
    ("seed:1,2", r"--seeds"),
    ("workdir:a", r"--out_dir"),
    ("loss", r"expected KEY:VALUE1"),
    ("loss:grpo,grpo", r"listed twice"),
    ("loss:grpo,", r"no empty values"),
])
def test_key_errors(ctx, spec, message):
    with pytest.raises(ablate.AblationError, match=message):
        ablate.parse_sweep(spec, ctx)


def test_value_parsing():
    assert ablate.parse_value("3", 1) == 3 and type(ablate.parse_value("3", 1)) is int
    assert ablate.parse_value("3", 1.0) == 3.0 and type(ablate.parse_value("3", 1.0)) is float
    assert [ablate.parse_value(t, False) for t in ("True", "false", "1", "0")] == [True, False, True, False]
    assert ablate.parse_value("nsa", "dense") == "nsa"
    assert ablate.parse_value("(1,2)", (1,)) == (1, 2) and ablate.parse_value("(1,)", (1, 2)) == (1,)
    for text, current in (("3.5", 1), ("abc", 1.0), ("2", False), ("1", (1,)), ("(1,", (1,))):
        with pytest.raises(ValueError):
            ablate.parse_value(text, current)
    assert ablate.split_values("a,(1,2),[3, 4],b") == ["a", "(1,2)", "[3, 4]", "b"]
    assert ablate.combine_args("attention=nsa,loss=grpo", None, "loss=dapo") == "attention=nsa,loss=dapo"
    assert ablate.combine_args("loss=grpo,mlp=moe", "loss=dapo") == "mlp=moe,loss=dapo"  # the later one, last
    assert ablate.combine_args(None, None) is None


# ------------------------------------------------------------------------------ the grid


def test_grid_labels_and_commands(ctx):
    base = ablate.ConfigContext(ctx.path, "attention=squid", ctx.module, ctx.leaves)
    axes = [ablate.parse_sweep("loss:grpo,dapo", base), ablate.parse_sweep("rollout.group_size:4,8,16", base)]
    sets = [ablate.parse_set("train.steps=30", base), ablate.parse_set("mlp=moe", base)]
    variants = ablate.make_variants(base, axes, sets)
    assert [v.label for v in variants] == [f"loss={l},rollout.group_size={g}" for l in ("grpo", "dapo")
                                           for g in (4, 8, 16)]
    assert variants[4].variant == {"loss": "dapo", "rollout.group_size": 8}
    assert variants[4].arg == "attention=squid,mlp=moe,loss=dapo"
    runs = ablate.make_runs(variants, [0, 2], "out")
    assert len(runs) == 12 and [r.seed for r in runs] == [0] * 6 + [2] * 6  # seed-major
    run = runs[10]
    assert run.workdir == os.path.join("out", "loss=dapo,rollout.group_size=8", "seed2")
    assert ablate.run_command(run, "configs/grpo_synth.py", False, python="py") == [
        "py", "-m", "experiments.train", "--config=configs/grpo_synth.py:attention=squid,mlp=moe,loss=dapo",
        "--config.train.steps=30", "--config.rollout.group_size=8", "--config.seed=2",
        f"--config.workdir={run.workdir}"]
    assert ablate.run_command(run, "c.py", True, "fake_train", python="py")[-1] == "--config.resume=True"
    cfg = ablate.build_config(base.path, run.arg, run.fields)  # what the job will get
    assert (cfg.objective, cfg.model.attention.kind, cfg.model.mlp.kind) == ("dapo", "squid", "moe")
    assert (cfg.rollout.group_size, cfg.train.steps, cfg.optim.total_steps) == (8, 30, 30)

    assert ablate.safe_label("a/b c=1") == "a_b_c=1"
    long = ablate.safe_label("x=" + "y" * 300)
    assert len(long) < 120 and long != ablate.safe_label("x=" + "y" * 299)
    with pytest.raises(ablate.AblationError, match="same directory name"):
        ablate.make_variants(ctx, [ablate.parse_sweep("sft.cache_dir:a/b,a_b", ctx)], [])
    with pytest.raises(ablate.AblationError, match="both swept and fixed"):
        ablate.make_variants(ctx, axes[:1], [ablate.parse_set("loss=ppo", ctx)])


def test_bad_variant_fails_before_any_run(tmp_path, capsys):
    out = tmp_path / "runs"
    rc = ablate.main([f"--config={CONFIG}", "--sweep=rollout.group_size:4,1", f"--out_dir={out}",
                      f"--results_dir={tmp_path}"])
    assert rc == 2
    assert "variant rollout.group_size=1" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.json"))


def test_run_state_and_dry_run(tmp_path, capsys):
    out = tmp_path / "runs"
    done, started = out / "loss=grpo" / "seed0", out / "loss=dapo" / "seed0"
    done.mkdir(parents=True)
    started.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"completed": True, "seconds": 1.0}))
    (started / "config.json").write_text("{}")
    assert ablate.run_state(str(done)) == "completed"
    assert ablate.run_state(str(started)) == "started"
    assert ablate.run_state(str(out / "x")) == "new"
    (started / "summary.json").write_text(json.dumps({"completed": False, "interrupted": True}))
    assert ablate.run_state(str(started)) == "started"
    rc = ablate.main([f"--config={CONFIG}", "--sweep=loss:grpo,dapo,gspo", f"--out_dir={out}", "--dry_run",
                      "--config.train.steps=7"])  # experiments.train's override syntax means --set
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 4
    assert lines[0] == "# completed, skipped: loss=grpo seed 0" and lines[1].startswith("# ")
    assert lines[2].endswith(f"--config.workdir={started} --config.resume=True")
    assert ":loss=gspo --config.train.steps=7 --config.seed=0" in lines[3] and "resume" not in lines[3]
    assert not (out / "loss=gspo").exists()


# ------------------------------------------------------------------------------ the table


def fake_run(path, evals, rewards=(), seconds=60.0, completed=True, fresh=True, status=None):
    """A run directory as the loop leaves it: tb/metrics.jsonl (+ event file) and summary.json.
    evals: [(step, pass@1, best_of_16, length)]."""
    path.mkdir(parents=True)
    with EventWriter(path / "tb") as w:
        w.scalars(-2, {"sft/nll": 1.0})
        for step, reward in rewards:
            w.scalars(step, {"rollout/reward": reward, "rollout/pass@1": reward / 2, "train/loss": 0.1})
        for step, p1, best, length in evals:
            values = {"eval/pass@1": p1, "eval/best_of_16": best, "eval/length": length, "eval/pass@4": p1}
            if fresh:
                values.update({"eval_fresh/pass@1": p1 + 0.5, "eval_fresh/best_of_16": best,
                               "eval_fresh/length": length})
            w.scalars(step, values)
    (path / "summary.json").write_text(json.dumps({"completed": completed, "seconds": seconds,
                                                   "steps_done": evals[-1][0] if evals else 0}))
    if status:
        (path / ablate.STATUS_FILE).write_text(json.dumps(status))


SEEDS = {  # variant -> [(evals, seconds)] per seed
    "loss=grpo": [([(0, 0.00, 0.2, 40.0), (10, 0.05, 0.3, 38.0), (20, 0.12, 0.4, 30.0)], 120.0),
                  ([(0, 0.02, 0.2, 41.0), (10, 0.15, 0.5, 36.0), (20, 0.20, 0.5, 33.0)], 150.0),
                  ([(0, 0.01, 0.1, 42.0), (10, 0.08, 0.3, 35.0), (20, 0.09, 0.35, 31.0)], 90.0)],
    "loss=dapo": [([(0, 0.00, 0.2, 40.0), (10, 0.30, 0.6, 50.0), (20, 0.25, 0.7, 52.0)], 60.0),
                  ([(0, 0.10, 0.2, 40.0), (10, 0.20, 0.6, 48.0), (20, 0.35, 0.8, 49.0)], 66.0),
                  ([(0, 0.00, 0.0, 40.0), (10, 0.00, 0.0, 40.0)], 30.0)],  # failed at step 10
}


@pytest.fixture()
def grid(tmp_path):
    runs = []
    for label, seeds in SEEDS.items():
        for seed, (evals, seconds) in enumerate(seeds):
            workdir = tmp_path / "runs" / label / f"seed{seed}"
            failed = label == "loss=dapo" and seed == 2
            rewards = [(s, 0.01 * s + seed) for s in range(1, 251)] if not failed else [(1, 0.0)]
            fake_run(workdir, evals, rewards, seconds, completed=not failed, fresh=label != "loss=dapo" or seed != 1,
                     status={"status": "failed", "returncode": 1, "log_tail": "Traceback\nValueError: boom"}
                     if failed else None)
            runs.append({"label": label, "variant": {"loss": label.split("=")[1]}, "seed": seed,
                         "workdir": str(workdir)})
    return runs


def test_table_aggregation(grid, tmp_path):
    data = ablate.summarize_grid(grid, threshold=0.1, command="python -m experiments.ablate --sweep=loss:grpo,dapo")
    # One run lacks eval_fresh/: eval/pass@1 is the metric of all of them.
    assert data["metric"] == "eval/pass@1" and data["best_of"] == "eval/best_of_16"
    assert data["length"] == "eval/length"
    grpo, dapo = data["table"]
    assert (grpo["label"], grpo["completed"], grpo["runs"], grpo["failed"]) == ("loss=grpo", 3, 3, 0)
    assert (dapo["completed"], dapo["runs"], dapo["failed"]) == (2, 3, 1)
    finals = [0.12, 0.20, 0.09]
    assert grpo["final"]["mean"] == pytest.approx(np.mean(finals))
    assert grpo["final"]["std"] == pytest.approx(np.std(finals, ddof=1))
    assert grpo["best_of"]["mean"] == pytest.approx(np.mean([0.4, 0.5, 0.35]))
    assert grpo["length"]["mean"] == pytest.approx(np.mean([30.0, 33.0, 31.0]))
    assert grpo["minutes"]["mean"] == pytest.approx(2.0) and grpo["minutes"]["std"] == pytest.approx(0.5)
    # Steps to pass@1 >= 0.1: seed0 at 20, seed1 at 10, seed2 never (0.09).
    steps = grpo["steps_to_threshold"]
    assert (steps["reached"], steps["n"]) == (2, 3)
    assert steps["mean"] == pytest.approx(15.0) and steps["std"] == pytest.approx(np.std([20, 10], ddof=1))
    # dapo: the failed seed is left out; seed1 reaches 0.1 at step 0 (the SFT start).
    assert dapo["final"]["mean"] == pytest.approx(0.30) and dapo["final"]["n"] == 2
    assert dapo["steps_to_threshold"]["mean"] == pytest.approx(5.0)
    assert dapo["minutes"]["mean"] == pytest.approx(63 / 60)

    runs = {(r["label"], r["seed"]): r for r in data["runs"]}
    failed = runs[("loss=dapo", 2)]
    assert failed["status"] == "failed" and "ValueError: boom" in failed["log_tail"]
    curve = runs[("loss=grpo", 1)]["curves"]
    assert curve["eval/pass@1"] == [[0, 0.02], [10, 0.15], [20, 0.20]]
    assert curve["eval/best_of_16"][-1] == [20, 0.5]
    # 250 training steps thinned to windows of 3: the mean of steps 1-3 at step 3, ... step 250 alone.
    reward = curve["rollout/reward"]
    assert len(reward) == 84 and reward[0] == [3, pytest.approx(1 + 0.02)] and reward[-1] == [250, pytest.approx(3.5)]
    assert curve["rollout/pass@1"][1] == [6, pytest.approx((1 + 0.05) / 2)]
    assert all(s >= 0 for s, _ in reward)

    fresh = ablate.summarize_grid(grid[:3], threshold=0.6)  # every grpo run logged eval_fresh/
    assert fresh["metric"] == "eval_fresh/pass@1" and fresh["best_of"] == "eval_fresh/best_of_16"
    assert fresh["table"][0]["final"]["mean"] == pytest.approx(np.mean(finals) + 0.5)
    assert fresh["table"][0]["steps_to_threshold"]["reached"] == 2  # 0.62 at 20; 0.65 at 10; 0.59 never

    # The JSON round trip keeps everything the table and the figure need.
    data = json.loads(json.dumps(data, allow_nan=False))
    md = ablate.markdown_table(data)
    assert md.startswith("`python -m experiments.ablate --sweep=loss:grpo,dapo`")
    row = next(line for line in md.splitlines() if line.startswith("| loss=grpo"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3/3"
    assert cells[2] == f"{np.mean(finals):.3f} ± {np.std(finals, ddof=1):.3f}"
    assert cells[4] == f"2/3 reached, 15 ± {np.std([20, 10], ddof=1):.0f}"
    assert cells[6] == "2.0 ± 0.5"
    assert "| loss=dapo | 2/3 (1 failed) |" in md
    assert "loss=dapo seed 2: failed (exit 1): `ValueError: boom`" in md
    rows = list(csv.DictReader(io.StringIO(ablate.csv_table(data))))
    assert [r["label"] for r in rows] == ["loss=grpo", "loss=dapo"]
    assert rows[0]["loss"] == "grpo" and rows[1]["completed"] == "2" and rows[1]["failed"] == "1"
    assert float(rows[0]["final_mean"]) == pytest.approx(np.mean(finals))
    assert float(rows[0]["final_std"]) == pytest.approx(np.std(finals, ddof=1))
    assert rows[0]["steps_to_threshold_reached"] == "2"
    png = tmp_path / "fig" / "ablate.png"
    assert ablate.plot_ablation(data, str(png)) == str(png)
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000


def test_single_seed_and_missing_runs(tmp_path):
    fake_run(tmp_path / "a", [(0, 0.3, 0.5, 10.0)], fresh=False)
    runs = [{"label": "x=1", "variant": {"x": 1}, "seed": 0, "workdir": str(tmp_path / "a")},
            {"label": "x=2", "variant": {"x": 2}, "seed": 0, "workdir": str(tmp_path / "nothing")}]
    data = ablate.summarize_grid(runs)
    md = ablate.markdown_table(data)
    assert "| x=1 | 1/1 | 0.300 | 0.500 | 1/1 reached, 0 | 10.0 | 1.0 |" in md  # one seed: no ±
    assert "| x=2 | 0/1 | — | — | 0/0 reached | — | — |" in md
    assert "1 run(s) not started: x=2 seed 0" in md
    assert data["table"][0]["final"] == {"mean": 0.3, "std": None, "n": 1}
    rows = list(csv.DictReader(io.StringIO(ablate.csv_table(data))))
    assert (rows[0]["final_mean"], rows[0]["final_std"], rows[1]["final_mean"]) == ("0.3", "", "")
    ablate.plot_ablation(data, str(tmp_path / "f.png"))


def test_table_only_reads_a_run_killed_mid_line_and_resumed(tmp_path, capsys):
    run = tmp_path / "runs" / "loss=grpo" / "seed0"
    fake_run(run, [(0, 0.1, 0.2, 30.0)], completed=False, fresh=False)
    with open(run / "tb" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "eval/pa')  # killed mid-line
    with pytest.warns(RuntimeWarning):
        writer = EventWriter(run / "tb")  # the resumed run
    with writer:
        writer.scalars(10, {"eval/pass@1": 0.3, "eval/best_of_16": 0.5, "eval/length": 28.0})
    (run / "summary.json").write_text(json.dumps({"completed": True, "seconds": 60.0, "steps_done": 10}))
    rc = ablate.main([f"--config={CONFIG}", "--sweep=loss:grpo", f"--out_dir={tmp_path / 'runs'}",
                      f"--results_dir={tmp_path / 'results'}", "--table_only"])
    assert rc == 0
    data = json.loads((tmp_path / "results" / "ablate_loss.json").read_text())
    assert data["runs"][0]["curves"]["eval/pass@1"] == [[0, 0.1], [10, 0.3]]
    assert "| loss=grpo | 1/1 | 0.300 |" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_the_trainer_refuses_is_recorded_with_its_one_line_reason(tmp_path, capsys, monkeypatch):
    """The real trainer refuses to resume a started run whose saved config differs (exit 2); the
    grid records the failure with that line and goes on."""
    run = tmp_path / "runs" / "loss=grpo" / "seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 3}))
    monkeypatch.chdir(ROOT)
    rc = ablate.main(["--config=configs/grpo_synth.py", "--sweep=loss:grpo", f"--out_dir={tmp_path / 'runs'}",
                      f"--results_dir={tmp_path / 'results'}"])
    assert rc == 1
    status = json.loads((run / ablate.STATUS_FILE).read_text())
    assert status["status"] == "failed" and status["returncode"] == 2
    assert status["log_tail"].splitlines()[-1].startswith("config error: resume: the config differs")
    md = (tmp_path / "results" / "ablate_loss.md").read_text()
    assert "loss=grpo seed 0: failed (exit 2): `config error: resume:" in md
    assert json.loads((run / "config.json").read_text()) == {"seed": 3}


# ------------------------------------------------------------------------------ running (a fake trainer)


FAKE_TRAIN = textwrap.dedent('''
    """Stands in for experiments.train: reads --config* flags, logs like the loop, obeys $FAKE_MODE."""
    import json, os, signal, sys, time

    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = flags["config.workdir"]
    os.makedirs(os.path.join(workdir, "tb"), exist_ok=True)
    open(os.path.join(workdir, "config.json"), "w").write(json.dumps(flags))
    mode = os.environ.get("FAKE_MODE", "")
    print("fake trainer", flags["config"], "resume" if flags.get("config.resume") == "True" else "fresh")
    if mode.startswith("fail:") and mode[5:] in flags["config"]:
        print("ValueError: simulated failure", file=sys.stderr)
        sys.exit(3)
    if mode == "sleep":  # a long run: one SIGINT saves and stops it (after finishing its "step")
        got = []

        def stop(signum, frame):
            got.append(signum)
            open(os.path.join(workdir, "signals"), "a").write(f"{signum}\\n")

        signal.signal(signal.SIGINT, stop)
        open(os.path.join(workdir, "started"), "w").close()
        deadline = time.time() + 60
        while not got and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # a second signal arriving meanwhile is recorded too
        summary = {"completed": False, "interrupted": True, "seconds": 1.0}
        json.dump(summary, open(os.path.join(workdir, "summary.json"), "w"))
        sys.exit(0 if got else 5)
    seed = int(flags["config.seed"])
    with open(os.path.join(workdir, "tb", "metrics.jsonl"), "a") as f:
        for step in (0, 1, 2):
            rec = {"step": step, "wall_time": 1000.0 + step, "eval/pass@1": 0.1 * step + 0.01 * seed,
                   "eval/best_of_4": 0.2 * step, "eval/length": 30.0 + step}
            f.write(json.dumps(rec) + "\\n")
            if step:
                f.write(json.dumps({"step": step, "wall_time": 1000.5 + step, "rollout/reward": 0.5 * step}) + "\\n")
    json.dump({"completed": True, "seconds": 90.0, "steps_done": 2}, open(os.path.join(workdir, "summary.json"), "w"))
''')


@pytest.fixture()
def fake_trainer(tmp_path, monkeypatch):
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_failed_run_is_recorded_then_resumed(fake_trainer, monkeypatch, capsys):
    tmp = fake_trainer
    argv = [f"--config={CONFIG}", "--sweep=loss:grpo,dapo", "--seeds=2", f"--out_dir={tmp / 'runs'}",
            f"--results_dir={tmp / 'results'}", "--set", "train.steps=7", "--train_module=fake_train"]
    monkeypatch.setenv("FAKE_MODE", "fail:loss=dapo")
    assert ablate.main(argv) == 1  # the grid goes on past the failures, then reports them
    out = capsys.readouterr().out
    assert "[4/4] loss=dapo seed 1: FAILED (exit 3)" in out and "ValueError: simulated failure" in out
    assert "[3/4] loss=grpo seed 1: completed" in out
    data = json.loads((tmp / "results" / "ablate_loss.json").read_text())
    assert data["command"].startswith("python -m experiments.ablate --config=")
    assert data["sweep"] == [{"key": "loss", "target": "loss", "kind": "arg", "values": ["grpo", "dapo"]}]
    assert data["overrides"] == {"train.steps": 7} and data["seeds"] == [0, 1]
    status = {(r["label"], r["seed"]): r["status"] for r in data["runs"]}
    assert status == {("loss=grpo", 0): "completed", ("loss=dapo", 0): "failed", ("loss=grpo", 1): "completed",
                      ("loss=dapo", 1): "failed"}
    assert data["table"][0]["final"]["mean"] == pytest.approx(0.205)  # 0.2 + 0.01 * seed, seeds 0 and 1
    assert data["table"][0]["best_of"]["mean"] == pytest.approx(0.4) and data["best_of"] == "eval/best_of_4"
    assert data["table"][0]["minutes"]["mean"] == pytest.approx(1.5)
    run = tmp / "runs" / "loss=dapo" / "seed1"
    assert "simulated failure" in next(r for r in data["runs"] if r["workdir"] == str(run))["log_tail"]
    command = (run / "command.txt").read_text()
    assert f"fake_train --config={CONFIG}:loss=dapo --config.train.steps=7 --config.seed=1" in command
    assert "resume" not in command
    assert (tmp / "results" / "ablate_loss.md").read_text().count("failed (exit 3)") == 2
    assert (tmp / "results" / "ablate_loss.png").is_file()  # next to the JSON with --results_dir
    grpo_log = (tmp / "runs" / "loss=grpo" / "seed0" / "log.txt").read_text()

    monkeypatch.setenv("FAKE_MODE", "")
    assert ablate.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("completed before, skipped") == 2
    assert "[2/4] loss=dapo seed 0: resuming" in out
    assert (run / "command.txt").read_text().strip().endswith("--config.resume=True")
    log = (run / "log.txt").read_text()
    assert log.count("==== ") == 2 and "simulated failure" in log and log.rstrip().endswith("resume")
    assert (tmp / "runs" / "loss=grpo" / "seed0" / "log.txt").read_text() == grpo_log  # not rerun
    data = json.loads((tmp / "results" / "ablate_loss.json").read_text())
    assert [(row["completed"], row["runs"]) for row in data["table"]] == [(2, 2), (2, 2)]

    (tmp / "results" / "ablate_loss.csv").unlink()
    assert ablate.main([*argv, "--table_only"]) == 0
    assert (tmp / "results" / "ablate_loss.csv").read_text().count("\n") == 3
    assert "--table_only" not in json.loads((tmp / "results" / "ablate_loss.json").read_text())["command"]


@pytest.mark.slow
def test_ctrl_c_stops_the_child_once_and_writes_the_partial_table(fake_trainer):
    tmp = fake_trainer
    env = dict(os.environ, FAKE_MODE="sleep")
    cmd = [sys.executable, "-m", "experiments.ablate", f"--config={CONFIG}", "--sweep=loss:grpo,dapo",
           f"--out_dir={tmp / 'runs'}", f"--results_dir={tmp / 'results'}", "--train_module=fake_train"]
    # Its own process group, like a shell job: Ctrl-C in a terminal signals the whole group.
    proc = subprocess.Popen(foreground(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    started = tmp / "runs" / "loss=grpo" / "seed0" / "started"
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert started.exists(), proc.communicate()[0]
    assert sigint_state(proc.pid) == "deliverable"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted: writing the partial table" in out
    # The child got exactly one SIGINT, not the terminal's plus the forwarded one (a second
    # signal makes the job abort without its checkpoint).
    assert (started.parent / "signals").read_text() == f"{int(signal.SIGINT)}\n"
    data = json.loads((tmp / "results" / "ablate_loss.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["interrupted", "missing"]
    assert ablate.run_state(str(started.parent)) == "started"  # the next invocation resumes it


# ------------------------------------------------------------------------------ end to end


TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.ffw_dim=64", "task.levels=(1,)", "task.num_train=24", "task.num_eval=4", "task.num_fresh=0",
        "task.max_prompt_len=160", "sampling.max_new_tokens=48", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "sft.steps=0", "train.steps=1", "eval.num_samples=4", "eval.ks=(1,4)",
        "eval.prompts_per_batch=4", "sandbox.workers=1"]


@pytest.mark.slow
def test_cli_end_to_end_then_skips_completed_runs(tmp_path, monkeypatch, capsys):
    args = ["--config=configs/grpo_synth.py:base=bytes", "--sweep=loss:grpo,dapo", "--seeds=1", f"--out_dir={tmp_path / 'runs'}",
            f"--results_dir={tmp_path / 'results'}", f"--fig_dir={tmp_path / 'fig'}", "--name=tiny", "--threshold=0"]
    for item in TINY:
        args += ["--set", item]
    cmd = [sys.executable, "-m", "experiments.ablate", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[1/2] loss=grpo seed 0: starting" in out.stdout and "[2/2] loss=dapo seed 0: completed" in out.stdout
    data = json.loads((tmp_path / "results" / "ablate_tiny.json").read_text())
    assert data["metric"] == "eval/pass@1" and data["best_of"] == "eval/best_of_4"  # no fresh eval set
    assert [r["status"] for r in data["runs"]] == ["completed", "completed"]
    for r in data["runs"]:
        run = r["workdir"]
        records = read_jsonl(os.path.join(run, "tb"))
        evals = [(x["step"], x["eval/pass@1"]) for x in records if "eval/pass@1" in x]
        assert [s for s, _ in evals] == [0, 1]  # at the start and the end
        assert r["curves"]["eval/pass@1"] == [[s, v] for s, v in evals]
        assert r["final"]["length"] == records[-1]["eval/length"]
        assert r["final"]["steps_to_threshold"] == 0
        summary = json.load(open(os.path.join(run, "summary.json")))
        assert math.isclose(r["final"]["minutes"], summary["seconds"] / 60)
        assert [s for s, _ in r["curves"]["rollout/reward"]] == [1]
        command = open(os.path.join(run, "command.txt")).read()
        spec = next(a for a in command.split() if a.startswith("--config="))
        assert spec.startswith("--config=configs/grpo_synth.py:") and f"--config.workdir={run}" in command
        assert sorted(spec.split(":", 1)[1].split(",")) == sorted(["base=bytes", r["label"]])
        assert "eval @ step 1" in open(os.path.join(run, "log.txt")).read()
    assert json.load(open(os.path.join(data["runs"][1]["workdir"], "config.json")))["objective"] == "dapo"
    assert [row["completed"] for row in data["table"]] == [1, 1]
    md = (tmp_path / "results" / "ablate_tiny.md").read_text()
    assert "| loss=dapo | 1/1 |" in md and "--sweep=loss:grpo,dapo" in md.splitlines()[0]
    assert (tmp_path / "results" / "ablate_tiny.csv").read_text().count("\n") == 3
    assert (tmp_path / "fig" / "ablate_tiny.png").stat().st_size > 10_000

    logs = {r["workdir"]: open(os.path.join(r["workdir"], "log.txt")).read() for r in data["runs"]}
    monkeypatch.chdir(ROOT)  # the same command again (in-process: no second interpreter start)
    assert ablate.main(args) == 0
    assert capsys.readouterr().out.count("completed before, skipped") == 2
    assert {w: open(os.path.join(w, "log.txt")).read() for w in logs} == logs


def test_table_and_figure_go_next_to_the_runs_by_default(fake_trainer, capsys):
    tmp = fake_trainer
    committed = os.path.join(ROOT, "results", "ablate_loss.json")
    before = open(committed).read() if os.path.exists(committed) else None
    argv = [f"--config={CONFIG}", "--sweep=loss:grpo", f"--out_dir={tmp / 'runs'}", "--set", "train.steps=7",
            "--train_module=fake_train"]
    assert ablate.main(argv) == 0
    for suffix in ("json", "md", "csv", "png"):
        assert (tmp / "runs" / f"ablate_loss.{suffix}").is_file(), suffix
    assert f"wrote {tmp / 'runs' / 'ablate_loss.json'}" in capsys.readouterr().out
    assert (open(committed).read() if os.path.exists(committed) else None) == before
