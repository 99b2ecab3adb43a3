"""The main job end to end on a tiny config: logging, checkpoints, resume, signals, NaN, async,
PPO, config validation, a device mesh, and a sandbox worker dying mid-step."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from support import tiny_job, xla_flags  # the tiny config; also the script the subprocess tests run
from support.field_checks import check_every_field

from rlcode.checks import ConfigError
from rlcode.train import engine, loop
from rlcode.train import workdir as workdir_lib
from rlcode.train.checkpoint import Checkpointer
from rlcode.train.metrics import read_jsonl, read_scalars



@pytest.fixture(scope="module")
def pool(sandbox_pool):
    return sandbox_pool


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "overrides, devices, message",
    [
        ({"loss__kind": "nope"}, None, "loss.kind"),
        ({"rollout__group_size": 1}, None, "rollout.group_size=1"),
        ({"advantage__estimator": "gae"}, None, "model.value_head"),
        ({"advantage__estimator": "bootstrap"}, None, "advantage.estimator"),
        ({"rollout__group_size": 3}, 8, "not divisible by the mesh"),
        ({"mesh__data": 3}, 8, "does not fit 8 devices"),
        ({"eval__ks": (1, 8)}, None, "eval.ks"),
        ({"train__minibatches": 3}, None, "train.minibatches"),
        ({"task__levels": (1, 9)}, None, "task.levels"),
        ({"rollout__async_mode": True, "rollout__max_staleness": 0}, None, "max_staleness"),
    ],
)
def test_bad_config_fails_at_start_naming_the_field(tmp_path, overrides, devices, message):
    cfg = tiny_job.tiny_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        loop.validate_config(cfg, devices)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"task__num_train": 0}, "task.num_train=0: must be an integer >= 1"),
        ({"seed": -1}, "seed=-1: must be an integer >= 0"),
        ({"task__seed": -3}, "task.seed=-3"),
        ({"optim__lr": math.nan}, "optim.lr=nan: must be a finite number > 0"),
        ({"optim__lr": math.inf}, "optim.lr=inf"),
        ({"sampling__temperature": 0.0}, "sampling.temperature=0.0"),
        ({"sampling__top_p": 1.5}, "sampling.top_p=1.5"),
        ({"eval__num_samples": 0}, "eval.num_samples=0"),
        ({"reward__timeout": 0.0}, "reward.timeout=0.0"),
        ({"reward__tests": "most"}, "reward.tests='most'"),
        ({"sandbox__workers": 0}, "sandbox.workers=0"),
        ({"model__dtype": "float64"}, "model.dtype='float64'"),
        ({"model__num_kv_heads": 3}, "num_kv_heads=3"),
        ({"loss__dual_clip": 0.5}, "loss.dual_clip=0.5"),
        ({"rollout__grup_size": 4}, "unknown config field 'rollout.grup_size'; did you mean rollout.group_size?"),
        ({"optimizer": 0.1}, "unknown config field 'optimizer'; did you mean optim?"),
        ({"shaping__overlong_cache_length": 100}, "shaping.overlong_cache_length=100"),
        ({"rollout__prompts_per_step": 30}, "task.num_train=24"),
        ({"rollout__group_size": 10**6}, "reduce rollout.group_size"),
    ],
)
def test_every_bad_value_is_a_config_error_naming_the_field(tmp_path, overrides, message):
    cfg = tiny_job.tiny_config(tmp_path, **overrides)
    with pytest.raises(ConfigError) as e:
        loop.validate_config(cfg, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_field_of_the_synthesis_job_is_checked(tmp_path):
    paths = check_every_field(tiny_job.tiny_config(tmp_path, arg="loss=ppo"), lambda c: loop.validate_config(c, 1))
    assert "loss.dual_clip" in paths and "mesh.rules" in paths and len(paths) > 80


def test_an_absurd_group_size_is_refused_before_the_warm_start(tmp_path):
    cfg = tiny_job.tiny_config(tmp_path / "run", sft__steps=2, rollout__group_size=10**6)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"estimated peak memory .* reduce rollout\.group_size"):
        loop.run(cfg)
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "run").exists()  # no workdir, no warm start, no sandbox


def test_resume_refuses_a_changed_config_naming_every_field(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_job.tiny_config(run, steps=2)
    workdir_lib.prepare_workdir(cfg)
    saved = (run / "config.json").read_text()
    changed = tiny_job.tiny_config(run, steps=2, seed=1, optim__lr=1e-5, reward__tests="all_pass",
                                   task__levels=(1, 2), resume=True)
    with pytest.raises(ConfigError) as e:
        loop.run(changed)  # refused before anything is built
    message = str(e.value)
    assert "differs from the run's" in message and "in 4 field(s)" in message and "\n" not in message
    for change in ("seed 0 -> 1", "optim.lr 0.0003 -> 1e-05", 'reward.tests "pass_fraction" -> "all_pass"',
                   "task.levels [1] -> [1, 2]", "--config.resume_override=True"):
        assert change in message, message
    assert (run / "config.json").read_text() == saved  # never overwritten before the check passes
    assert not (run / "config_history").exists()

    # A longer run, another sandbox size: allowed (the schedule length follows train.steps).
    longer = tiny_job.tiny_config(run, steps=5, sandbox__workers=1, resume=True)
    workdir_lib.prepare_workdir(longer)
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 5
    (first,) = sorted((run / "config_history").glob("*.json"))
    record = json.loads(first.read_text())
    assert set(record["changes"]) == {"resume", "train.steps", "optim.total_steps", "sandbox.workers"}
    assert record["config"] == json.loads(saved) and record["override"] is False

    # An explicit override is accepted and recorded with the config it replaced.
    changed = tiny_job.tiny_config(run, steps=5, seed=1, optim__lr=1e-5, resume=True, resume_override=True)
    said = []
    workdir_lib.prepare_workdir(changed, log=said.append)
    new = json.loads((run / "config.json").read_text())
    assert new["seed"] == 1 and new["optim"]["lr"] == 1e-5
    second = sorted((run / "config_history").glob("*.json"))[1]
    record = json.loads(second.read_text())
    assert record["override"] is True and record["changes"]["seed"] == [0, 1]
    assert record["config"]["train"]["steps"] == 5 and record["config"]["seed"] == 0
    assert "resume_override" in said[0] and "seed" in said[0]

    # The schedule length may not change on its own.
    alone = ml_collections.ConfigDict(tiny_job.tiny_config(run, steps=5, seed=1, optim__lr=1e-5, resume=True).to_dict())
    alone.optim.total_steps = 50  # no longer the reference to train.steps
    with pytest.raises(ConfigError, match="optim.total_steps 5 -> 50"):
        workdir_lib.prepare_workdir(alone)


def test_unknown_recipe_in_config_argument_names_it():
    with pytest.raises(ValueError, match="loss='nope'"):
        tiny_job.load_config("loss=nope")
    with pytest.raises(ValueError, match="expected one of"):
        tiny_job.load_config("objective=grpo")


# --------------------------------------------------------------------------- end to end


REQUIRED_TAGS = [
    "train/loss", "train/policy_loss", "train/entropy", "train/kl_ref", "train/clip_frac_low", "train/clip_frac_high",
    "train/is_ess_frac", "train/is_frac_truncated", "train/grad_norm", "rollout/reward", "rollout/reward_tests",
    "rollout/pass@1", "rollout/length", "eval/pass@1", "eval/pass@4", "eval/best_of_4", "eval/length",
    "eval/reward_tests", "time/sample_s", "time/execute_s", "time/train_s", "throughput/generated_tokens_per_s",
    "throughput/sandbox_execs_per_s", "async/staleness", "sft/nll", "eval_fresh/pass@1", "eval_fresh/best_of_4",
]


def test_job_runs_logs_checkpoints_and_resumes(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path / "run", steps=3, sft__steps=2, task__num_fresh=4)
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == 3 and not result.interrupted
    assert not result.sft["cached"]
    scalars = read_scalars(tmp_path / "run" / "tb")
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, missing
    # The HParams tab's metric columns are tags the job logs.
    assert [t for t in loop.JOB.summary_metrics(cfg) if t not in scalars] == []
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [s for s, _ in scalars["eval/pass@1"]] == [0, 2, 3]  # start, every 2, end
    for tag in ("eval/pass@1", "eval/best_of_4", "rollout/pass@1"):
        assert all(0.0 <= v <= 1.0 for _, v in scalars[tag])
    assert all(np.isfinite(v) for _, v in scalars["train/loss"])
    # pass@1 <= pass@4 = best_of_4 for n = 4 samples.
    for (_, p1), (_, p4), (_, b4) in zip(scalars["eval/pass@1"], scalars["eval/pass@4"], scalars["eval/best_of_4"]):
        assert p1 <= p4 + 1e-6 and abs(p4 - b4) < 1e-6
    text = open(next((tmp_path / "run" / "tb").glob("events.out.tfevents.*")), "rb").read()
    assert b"rollout/samples" in text and b"eval/samples" in text
    # Sampled text comes with the prompt it answers (a synthesis prompt is a function signature).
    assert text.count(b", prompt:") >= 2 and b"def " in text
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["completed"] and summary["first_eval"]["eval/pass@1"] == scalars["eval/pass@1"][0][1]
    assert Checkpointer(tmp_path / "run" / "checkpoints", read_only=True).latest_step() == 3

    # The run exists: starting it again without resume=True is refused.
    with pytest.raises(ValueError, match="resume=True"):
        loop.run(cfg, pool=pool)

    # Resume with a longer schedule: continues at step 3, the SFT warm start comes from its cache.
    cfg.train.steps = 5
    cfg.resume = True
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == 5
    assert result.sft["cached"]
    assert result.first_eval["eval/pass@1"] == summary["first_eval"]["eval/pass@1"]
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "tb") if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "attention",
    [
        {"kind": "nsa", "block_len": 8, "stride": 4, "select_size": 16, "num_select": 4, "window": 32,
         "shared_kv": False, "impl": "xla"},
        {"kind": "squid", "impl": "xla"},
    ],
    ids=["nsa", "squid"],
)
@pytest.mark.slow
def test_job_trains_with_each_attention_kind(tmp_path, pool, attention):
    """The whole job (sampling with the kind's decode cache, grading, train steps) with NSA and squid."""
    cfg = tiny_job.tiny_config(tmp_path, steps=2, eval__at_start=False, eval__at_end=False)
    cfg.model.attention = attention
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == 2
    scalars = read_scalars(tmp_path / "tb")
    assert all(np.isfinite(v) for _, v in scalars["train/loss"])
    # At step 1 the trainer's recomputed log-probs equal the sampler's (same parameters), so every
    # importance weight is 1: the kind's decode cache reproduces its full forward.
    assert abs(scalars["train/is_weight_max"][0][1] - 1) < 1e-3
    assert abs(scalars["train/is_weight_p05"][0][1] - 1) < 1e-3


@pytest.mark.slow
def test_job_trains_an_moe_policy_and_logs_router_statistics(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path, steps=2, arg="mlp=moe", eval__at_start=False, eval__at_end=False)
    cfg.model.mlp.update(num_experts=4, router="sigmoid", precision="mxfp8", impl="xla")
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == 2
    scalars = read_scalars(tmp_path / "tb")
    for tag in ("train/aux_moe_aux_loss", "train/aux_moe_z_loss", "train/aux_moe_dropped_frac",
                "train/aux_moe_bias_abs_mean"):
        assert all(np.isfinite(v) for _, v in scalars[tag]), tag
    # Per-expert load, summed over the one layer: fractions of the assignments, summing to 1.
    loads = [scalars[f"train/aux_moe_load/{e}"][-1][1] for e in range(4)]
    assert abs(sum(loads) - 1) < 1e-5 and all(0 <= x <= 1 for x in loads)
    assert scalars["train/aux_moe_bias_abs_mean"][-1][1] > 0  # the bias moved after the steps


@pytest.mark.slow
def test_nonfinite_loss_stops_with_statistics_and_keeps_checkpoints(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path, steps=4, eval__at_start=False)

    def poison(step, batch):
        if step == 1:
            batch = dict(batch, behavior_logp=batch["behavior_logp"].at[0, :].set(jnp.nan))
        return batch

    with pytest.raises(engine.NonFiniteLossError) as err:
        loop.run(cfg, pool=pool, hooks={"batch": poison})
    msg = str(err.value)
    assert "non-finite loss at step 1" in msg and "behavior_logp" in msg and '"nonfinite"' in msg
    assert "last good checkpoint: step 1" in msg
    saved = np.load(tmp_path / "nonfinite_batch_step1.npz")
    assert np.isnan(saved["behavior_logp"]).any()
    ckpt = Checkpointer(tmp_path / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [1]
    state, extra = ckpt.restore()
    assert extra["iteration"] == 1
    floats = [np.asarray(x) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(np.isfinite(x).all() for x in floats)


@pytest.mark.slow
def test_ppo_with_value_head_and_gae(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path, steps=2, arg="loss=ppo", eval__at_start=False, eval__at_end=False)
    assert cfg.model.value_head and cfg.advantage.estimator == "gae"
    result = loop.run(cfg, pool=pool)
    assert result.completed
    scalars = read_scalars(tmp_path / "tb")
    assert "train/value_loss" in scalars and "train/explained_variance" in scalars
    assert all(np.isfinite(v) for _, v in scalars["train/value_loss"])


@pytest.mark.slow
def test_async_mode_bounds_staleness(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path, steps=4, rollout__async_mode=True, rollout__max_staleness=1,
                               eval__every=0, eval__at_start=False, eval__at_end=False)
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == 4
    rows = [r for r in read_jsonl(tmp_path / "tb") if "async/staleness" in r]
    assert len(rows) == 4
    assert all(0 <= r["async/staleness"] <= 1 for r in rows)
    assert rows[0]["async/staleness"] == 0  # the first batch was sampled with the initial parameters
    assert rows[-1]["async/dropped_stale"] == 0  # the sampler never runs ahead of the bound
    assert all("train/is_weight_mean" in r for r in rows)


@pytest.mark.slow
def test_dynamic_sampling_runs(tmp_path, pool):
    cfg = tiny_job.tiny_config(tmp_path, steps=2, arg="loss=dapo", eval__at_start=False, eval__at_end=False)
    assert cfg.shaping.dynamic_sampling
    loop.run(cfg, pool=pool)
    rows = [r for r in read_jsonl(tmp_path / "tb") if "rollout/draws" in r]
    assert rows and all(1 <= r["rollout/draws"] <= cfg.rollout.max_draws for r in rows)
    assert all("rollout/dropped_groups" in r and 0 <= r["rollout/filled"] <= cfg.rollout.prompts_per_step for r in rows)


# --------------------------------------------------------------------------- subprocesses


def _start(workdir, steps, *extra, env=None):
    return subprocess.Popen([sys.executable, tiny_job.__file__, str(workdir), str(steps), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_checkpoint(workdir, step, proc, timeout=240):
    path = os.path.join(workdir, "checkpoints", str(step))
    t0 = time.time()
    while not os.path.isdir(path):
        if proc.poll() is not None:
            raise AssertionError(f"job exited early: {proc.communicate()}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no checkpoint {step} after {timeout} s")
        time.sleep(0.2)


@pytest.mark.slow
def test_ctrl_c_saves_and_sigkill_resumes(tmp_path, pool):
    workdir = tmp_path / "run"
    no_eval = ("eval.every=0", "eval.at_start=False", "eval.at_end=False")  # only steps and checkpoints matter
    # Ctrl-C: the job finishes its step, saves a checkpoint (off the every-2 schedule) and exits cleanly.
    proc = _start(workdir, 40, *no_eval, "checkpoint.every=2")
    _wait_for_checkpoint(workdir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["interrupted"] and not result["completed"]
    stopped_at = result["steps_done"]
    assert stopped_at >= 2 and "continue with --config.resume=True" in err
    assert Checkpointer(workdir / "checkpoints", read_only=True).latest_step() == stopped_at

    # SIGKILL after the next checkpoint: nothing to clean up, resume continues from the last one.
    proc = _start(workdir, 40, *no_eval, "checkpoint.every=1", "resume=True")
    _wait_for_checkpoint(workdir, stopped_at + 1, proc)
    proc.kill()
    proc.communicate()
    latest = Checkpointer(workdir / "checkpoints", read_only=True).latest_step()
    assert latest >= stopped_at + 1

    cfg = tiny_job.tiny_config(workdir, steps=latest + 2, resume=True, eval__every=0, eval__at_start=False,
                               eval__at_end=False)
    result = loop.run(cfg, pool=pool)
    assert result.completed and result.steps_done == latest + 2
    steps = [r["step"] for r in read_jsonl(workdir / "tb") if "train/loss" in r]
    assert steps[-2:] == [latest + 1, latest + 2]


@pytest.mark.slow
def test_job_on_eight_fake_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = _start(tmp_path, 2, "mesh.data=4", "mesh.fsdp=2", "eval.every=0", env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["completed"]
    assert "devices: 8 x cpu" in err
    rows = [r for r in read_jsonl(tmp_path / "tb") if "train/loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["train/loss"]) for r in rows)


def test_task_pools_are_disjoint(tmp_path):
    from rlcode.tokenizer import ByteTokenizer

    cfg = tiny_job.tiny_config(tmp_path, task__levels=(1, 2), task__num_train=200, task__num_eval=20,
                               task__num_fresh=20, task__max_prompt_len=256, sampling__max_new_tokens=80)
    train, evals, fresh = loop.build_tasks(cfg, ByteTokenizer())
    train_ids = {t.task_id for t in train.tasks}
    assert not train_ids & {t.task_id for t in fresh.tasks}
    assert not {t.behaviour for t in train.tasks} & {t.behaviour for t in evals.tasks}
    assert {t.split for t in evals.tasks} == {"eval"} and {t.split for t in fresh.tasks} == {"train"}
