"""The engine's shared behaviour, on a job with synthetic rollouts (no sandbox, no sampler).

Both jobs run on `rlcode.train.engine.train`; each test here pins one concern that the two jobs
used to implement differently: the non-finite check and its batch dump, the first evaluation on
resume, what `completed` means when a time budget stops a run, ``checkpoint.every = 0``, cleanup
of what a job opened when a step raises, and per-element metrics.
"""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from rlcode.train import agent, engine, loop
from rlcode.train.checkpoint import Checkpointer
from rlcode.train.metrics import flatten_hparams, read_scalars
from support import tiny_job

B, T = 8, 16  # prompts_per_step x group_size of the tiny config, tokens per row


@dataclasses.dataclass
class FakeRollout:
    version: int
    count: int


class FakeJob:
    """A job whose rollouts are random tokens with random advantages; it records what the engine
    asked of it."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.evals = []
        self.collected = []
        self.opened = None

    def setup(self, ctx):
        return None, {"note": "tasks"}

    def plan(self, ctx, data):
        assert data == {"note": "tasks"}
        self.opened = ctx.resources.enter_context(open(os.path.join(ctx.workdir, "job_log.txt"), "a"))

        def collect(params, version, count):
            if self.fail_at is not None and count == self.fail_at:
                raise RuntimeError("collect failed on purpose")
            self.collected.append((version, count))
            return FakeRollout(version, count)

        def prepare(params, ref_params, r):
            rng = np.random.default_rng(r.count)
            ids = rng.integers(3, 200, size=(B, T + 1)).astype(np.int32)
            mask = np.ones((B, T), bool)
            batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
                    "positions": jnp.asarray(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))),
                    "mask": jnp.asarray(mask), "kv_lengths": jnp.full((B,), T, jnp.int32),
                    "advantages": jnp.asarray(rng.normal(size=B).astype(np.float32)),
                    "old_logp": jnp.full((B, T), -5.0, jnp.float32), "behavior_logp": jnp.full((B, T), -5.0)}
            if ref_params is not None:  # a KL term: the engine made reference parameters
                batch["ref_logp"] = jnp.full((B, T), -5.0, jnp.float32)
            return batch

        def evaluate(params, step):
            self.evals.append(step)
            return {"eval/pass@1": 0.1 * (len(self.evals))}

        return engine.Plan(collect=collect, prepare=prepare, evaluate=evaluate,
                           metrics=lambda r: {"rollout/reward": float(r.count)},
                           progress=lambda s, e: {"reward": s["rollout/reward"]},
                           texts=lambda r: {"rollout/note": f"batch {r.count}"})

    def job(self):
        return engine.Job(name="fake", validate=loop.validate_config, pool_timeout=lambda cfg: 1.0,
                          setup=self.setup, plan=self.plan, summary_metrics=lambda cfg: ["eval/pass@1"])


def config(tmp_path, steps=3, **overrides):
    return tiny_job.tiny_config(tmp_path / "run", steps=steps, **overrides)


def run(cfg, job, **kw):
    return engine.train(cfg, job.job(), pool=object(), log=lambda m: None, **kw)


def test_both_jobs_are_engine_jobs(monkeypatch):
    for module in (loop, agent):
        seen = []
        monkeypatch.setattr(module, "train", lambda cfg, job, **kw: seen.append(job) or "ran")
        assert module.run("cfg") == "ran" and seen == [module.JOB]
        assert isinstance(module.JOB, engine.Job)


def test_a_nonfinite_loss_stops_the_run_saves_the_batch_and_keeps_the_checkpoints(tmp_path):
    cfg = config(tmp_path, steps=4)

    def poison(step, batch):
        return dict(batch, advantages=batch["advantages"].at[0].set(jnp.nan)) if step == 2 else batch

    with pytest.raises(engine.NonFiniteLossError, match="non-finite loss at step 2") as err:
        run(cfg, FakeJob(), hooks={"batch": poison})
    assert "rollout/reward" in str(err.value) and "last good checkpoint: step 2" in str(err.value)
    saved = np.load(tmp_path / "run" / "nonfinite_batch_step2.npz")
    assert np.isnan(saved["advantages"][0])
    assert Checkpointer(tmp_path / "run" / "checkpoints", read_only=True).all_steps() == [1, 2]


def test_a_nonfinite_gradient_norm_alone_stops_the_run(tmp_path):
    batch = {"mask": np.ones((2, 3), bool), "advantages": np.ones(2, np.float32)}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        engine.check_finite_step({"loss": 1.0, "grad_norm": 2.0}, batch, 5, str(tmp_path), ckpt, {})
        with pytest.raises(engine.NonFiniteLossError, match=r"grad_norm=inf"):
            engine.check_finite_step({"loss": 1.0, "grad_norm": math.inf}, batch, 5, str(tmp_path), ckpt, {})
    assert (tmp_path / "nonfinite_batch_step5.npz").exists()


def test_first_eval_survives_resume_and_comes_from_the_checkpoint(tmp_path):
    job = FakeJob()
    first = run(config(tmp_path, steps=2), job)
    assert first.first_eval == {"eval/pass@1": pytest.approx(0.1)} and job.evals == [0, 2]
    job2 = FakeJob()
    resumed = run(config(tmp_path, steps=4, resume=True), job2)
    assert job2.evals == [4]  # no evaluation at start on resume, one at the end (eval.every=2: step 4 is the last)
    assert resumed.first_eval == first.first_eval and resumed.steps_done == 4 and resumed.completed
    assert job2.collected == [(2, 2), (3, 3)]  # batch numbering continues


def test_first_eval_of_an_older_checkpoint_kept_in_extra(tmp_path):
    with Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(3, {"w": np.zeros(2)}, extra={"iteration": 3, "first_eval": {"eval/success": 0.5}}, force=True)
        ckpt.wait()
        assert engine._first_eval_of(ckpt, {"first_eval": {"eval/success": 0.5}}) == {"eval/success": 0.5}
        ckpt.save(4, {"w": np.zeros(2)}, metrics={"first/eval/success": 0.25}, extra={"iteration": 4}, force=True)
        ckpt.wait()
        assert engine._first_eval_of(ckpt, {}) == {"eval/success": 0.25}


def test_a_run_stopped_by_its_time_budget_is_not_completed(tmp_path):
    cfg = config(tmp_path, steps=5, train__max_minutes=1e-9)
    result = run(cfg, FakeJob())
    assert result.steps_done == 1 and not result.completed and result.stopped == "max_minutes"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped"] == "max_minutes"
    from experiments.ablate import run_state  # noqa: PLC0415

    assert run_state(str(tmp_path / "run")) == "started"  # an ablation rerun resumes it


def test_checkpoint_every_zero_saves_only_the_last_step(tmp_path):
    result = run(config(tmp_path, steps=3, checkpoint__every=0, eval__every=0), FakeJob())
    assert result.completed and result.steps_done == 3
    assert Checkpointer(tmp_path / "run" / "checkpoints", read_only=True).all_steps() == [3]


def test_what_the_job_opened_is_closed_when_a_step_raises(tmp_path):
    job = FakeJob(fail_at=1)
    with pytest.raises(RuntimeError, match="on purpose"):
        run(config(tmp_path, steps=3), job)
    assert job.opened is not None and job.opened.closed


def test_scalars_texts_hparams_and_per_element_metrics_are_logged(tmp_path):
    cfg = config(tmp_path, steps=2, eval__every=0)
    run(cfg, FakeJob())
    scalars = read_scalars(tmp_path / "run" / "tb")
    for tag in ("train/loss", "train/grad_norm", "rollout/reward", "time/rl_minutes", "train/tokens",
                "async/staleness"):
        assert [s for s, _ in scalars[tag]] == [1, 2], tag
    # The config as the run's hyperparameters, the job's summary metrics after train/loss.
    acc = plugin_event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    want = flatten_hparams(cfg)
    assert want["train.steps"] == 2 and want["workdir"] == str(tmp_path / "run")
    assert {name: getattr(v, v.WhichOneof("kind")) for name, v in start.hparams.items()} == want
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == ["train/loss", "eval/pass@1"]
    assert engine.mean_metrics({"load": [np.array([1.0, 3.0]), np.array([3.0, 5.0])], "loss": [1.0, 2.0]}) == {
        "load/0": 2.0, "load/1": 4.0, "loss": 1.5}


def test_async_mode_serves_any_job(tmp_path):
    job = FakeJob()
    result = run(config(tmp_path, steps=3, rollout__async_mode=True, rollout__max_staleness=1, eval__every=0), job)
    assert result.completed
    versions = [v for v, _ in job.collected[:3]]
    assert versions[0] == 0 and all(b - a in (0, 1) for a, b in zip(versions, versions[1:]))
    scalars = read_scalars(tmp_path / "run" / "tb")
    assert max(v for _, v in scalars["async/staleness"]) <= 1


def test_lora_trains_only_the_adapters(tmp_path):
    """lora.rank > 0: the engine adds adapters after the warm start and only they change."""
    import jax

    seen = []

    class Recording(FakeJob):
        def plan(self, ctx, data):
            plan = super().plan(ctx, data)

            def evaluate(params, step):
                seen.append(jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, params)))
                return plan.evaluate(params, step)

            return dataclasses.replace(plan, evaluate=evaluate)

    result = run(config(tmp_path, steps=2, lora__rank=4, lora__targets=("q", "v", "down")), Recording())
    assert result.completed and len(seen) == 2
    names = [jax.tree_util.keystr(path) for path, _ in seen[0]]
    assert sum("lora_" in n for n in names) == 2 * 3  # one layer, three targets, A and B each
    for (path, before), (_, after) in zip(*seen):
        name = jax.tree_util.keystr(path)
        if "lora_" not in name:
            np.testing.assert_array_equal(after, before, err_msg=name)
        elif name.endswith("['b']"):
            assert not np.array_equal(after, before), name


@pytest.mark.slow
def test_a_control_action_can_replace_the_parameters(tmp_path):
    """{"params": p} from Plan.control: the next step trains from p (a rollback to a released version)."""
    import jax  # noqa: PLC0415

    seen = {}

    class RollbackJob(FakeJob):
        def plan(self, ctx, data):
            p = super().plan(ctx, data)
            collect = p.collect

            def recording(params, version, count):
                seen[count] = jax.tree.map(np.array, params)  # a copy: the train step donates its buffers
                return collect(params, version, count)

            return dataclasses.replace(p, collect=recording,
                                       control=lambda step, s: {"params": seen[0]} if step == 2 else None)

    result = run(config(tmp_path, steps=4, eval__every=0), RollbackJob())
    assert result.completed
    leaves = lambda t: jax.tree.leaves(t)  # noqa: E731
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(leaves(seen[a]), leaves(seen[b])))  # noqa: E731
    # Batch 1 is sampled after one update, batch 2 after the rollback at step 2, batch 3 after one more update.
    assert sorted(seen) == [0, 1, 2, 3]
    assert not same(0, 1) and same(0, 2) and not same(2, 3)
