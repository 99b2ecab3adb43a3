"""The usage job: rows from the log (staleness bound, waiting for a log another process writes),
the batch it builds, the regression gate, its config checks, the served log-probs against the
trainer's, and a whole tiny run with its report."""

import json
import math
import os

import numpy as np
import pytest
from support.tiny_job import tiny_config

from rlcode.checks import ConfigError
from rlcode.feedback import registry
from rlcode.feedback.deployment import deployment_config
from rlcode.feedback.usage_log import Interaction, LogWriter, Outcome, outcome_reward, read_log
from rlcode.train import usage
from rlcode.train.usage import (UsageConfig, UsageSource, build_rollout, regression_gate, updates_behind,
                               usage_config)


def interaction(i, version, t, prompt=(1, 2, 3), n=3):
    return Interaction(id=f"i{i}", version=version, time=t, user="u", request="def f(x):\n", prompt_ids=prompt,
                       completion="    return x\n", completion_ids=tuple(range(10, 10 + n)),
                       logprobs=tuple(-0.1 * (k + 1) for k in range(n)), logged_at=t)


def outcome(i, kind, t, value=1.0):
    return Outcome(id=f"i{i}-{kind}", interaction=f"i{i}", kind=kind, time=t, value=value, logged_at=t)


def test_rows_staler_than_the_bound_are_rejected(tmp_path):
    path = str(tmp_path / "usage.jsonl")
    with LogWriter(path) as w:
        for i in range(8):
            w.append(interaction(i, version=i, t=float(i)))
        w.append(outcome(7, "latency", 500.0))  # moves the watermark: everything settles
    src = UsageSource(UsageConfig(settle_s=100.0, max_staleness=3, min_rows=1), path)
    rows = src.next_rows(step=9, rows=8)
    assert [it.version for it, _ in rows] == [6, 7]
    assert src.stale == 6 and src.counters()["usage/stale_rejected"] == 6.0


def test_staleness_counts_the_updates_since_the_served_version_less_those_a_rollback_discarded():
    assert updates_behind(3, 10, []) == 7
    # Rolled back at step 10 to version 5: the updates of steps 5..10 are gone.
    assert [updates_behind(v, 12, [(5, 10)]) for v in (0, 5, 10, 11)] == [7, 2, 2, 1]
    assert updates_behind(5, 10, [(5, 10)]) == 0
    # Twice back to version 5 (steps 10 and 15): at step 17 version 5 is 2 updates behind.
    assert updates_behind(5, 17, [(5, 10), (5, 15)]) == 2 and updates_behind(0, 17, [(5, 10), (5, 15)]) == 7


def test_a_served_version_that_never_catches_up_stops_the_job_with_the_cause(tmp_path):
    path = str(tmp_path / "usage.jsonl")
    w = LogWriter(path)
    count = iter(range(10**6))

    def advance():  # every window serves version 0 only, and settles at once
        i = next(count)
        w.append(interaction(i, version=0, t=float(i)))
        w.append(outcome(i, "latency", float(i) + 1000.0))

    src = UsageSource(UsageConfig(settle_s=100.0, max_staleness=3, min_rows=2, max_idle_windows=5), path, advance)
    assert len(src.next_rows(step=2, rows=4)) >= 2
    with pytest.raises(RuntimeError, match="max_staleness=3.*on_reject='rollback'"):
        src.next_rows(step=20, rows=4)
    assert next(count) < 20  # it gave up, it did not spin


def test_following_a_log_written_elsewhere_waits_for_settled_rows_then_times_out(tmp_path):
    path = str(tmp_path / "usage.jsonl")
    w = LogWriter(path)
    clock = {"now": 0.0, "sleeps": 0}
    feed = iter([[interaction(0, 0, 0.0), interaction(1, 0, 5.0)], [outcome(0, "accepted", 20.0)],
                 [interaction(2, 0, 200.0)]])

    def sleep(s):  # another process appends while the trainer waits
        clock["now"] += s
        clock["sleeps"] += 1
        for rec in next(feed, []):
            w.append(rec)

    cfg = UsageConfig(settle_s=100.0, min_rows=2, poll_s=1.0, wait_minutes=0.5, max_staleness=5)
    src = UsageSource(cfg, path, sleep=sleep, clock=lambda: clock["now"])
    rows = src.next_rows(step=1, rows=4)
    assert [it.id for it, _ in rows] == ["i0", "i1"] and clock["sleeps"] == 3
    assert [o.kind for o in rows[0][1]] == ["accepted"]
    with pytest.raises(TimeoutError, match="usage.min_rows=2"):
        src.next_rows(step=2, rows=4)
    assert clock["now"] > 30


def test_the_batch_holds_the_logged_tokens_log_probs_and_outcome_rewards():
    weights = UsageConfig().weights
    rows = [(interaction(0, 2, 0.0), [outcome(0, "accepted", 1.0), outcome(0, "kept", 2.0),
                                      outcome(0, "latency", 0.5, value=3.0)]),
            (interaction(1, 1, 1.0, prompt=tuple(range(1, 9))), [outcome(1, "followup", 3.0)]),  # prompt too long
            (interaction(2, 3, 2.0, n=5), [outcome(2, "followup", 3.0)])]
    r = build_rollout(rows, size=4, max_prompt_len=6, max_new_tokens=6, pad_id=0, weights=weights, step=4)
    assert r.valid.tolist() == [True, False, True, False]
    assert r.prompts[0, :3].tolist() == [1, 2, 3] and r.prompt_lengths[0] == 3
    assert r.tokens[2, :5].tolist() == [10, 11, 12, 13, 14] and r.lengths[2] == 5
    assert np.allclose(r.logprobs[2, :5], [-0.1, -0.2, -0.3, -0.4, -0.5]) and (r.logprobs[2, 5:] == 0).all()
    assert r.mask[2].tolist() == [True] * 5 + [False]
    assert r.rewards[0] == pytest.approx(outcome_reward(rows[0][1], weights)) == pytest.approx(2.0 - 0.15)
    assert r.rewards[2] == -0.5 and r.rewards[1] == 0.0
    assert r.terms["latency"][0] == 3.0 and r.terms["kept"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert r.version == 2 and r.stats["staleness_max"] == 3.0 and r.stats["rejected_lengths"] == 1.0
    with pytest.raises(ValueError):
        build_rollout([], 4, 6, 6, 0, weights, 0)


def test_the_gate_publishes_only_candidates_within_the_margin(tmp_path):
    root = str(tmp_path / "registry")
    p = lambda x: {"w": np.full(3, x, np.float32)}  # noqa: E731
    first = regression_gate(root, 0, p(0), score=0.20, margin=0.02)
    assert first["gate/published"] == 1.0 and registry.current(root)["version"] == 0
    worse = regression_gate(root, 5, p(5), score=0.17, margin=0.02)
    assert worse["gate/published"] == 0.0 and worse["gate/live_version"] == 0.0
    assert registry.current(root)["version"] == 0 and not os.path.exists(os.path.join(root, "v000005"))
    close = regression_gate(root, 10, p(10), score=0.185, margin=0.02)
    assert close["gate/published"] == 1.0 and close["gate/delta"] == pytest.approx(-0.015)
    assert registry.current(root)["score"] == 0.185
    better = regression_gate(root, 15, p(15), score=0.3, margin=0.0)
    assert better["gate/live_version"] == 15.0
    assert float(registry.load(root, 15, target=p(0))["w"][0]) == 15.0
    assert [h["version"] for h in registry.history(root)] == [0, 10, 15]


def test_a_gate_against_the_best_release_stops_a_slow_drift_down(tmp_path):
    # Each candidate 0.015 below the previous one: within the margin of the live version every time,
    # but the best release's margin stops the second step down.
    p = {"w": np.zeros(2, np.float32)}
    live, best = str(tmp_path / "live"), str(tmp_path / "best")
    for root, against in ((live, "live"), (best, "best")):
        for step, score in ((0, 0.30), (5, 0.285), (10, 0.27), (15, 0.255)):
            regression_gate(root, step, p, score, margin=0.02, against=against)
    assert [h["version"] for h in registry.history(live)] == [0, 5, 10, 15]
    assert [h["version"] for h in registry.history(best)] == [0, 5]


def usage_tiny(workdir, steps=4, **usage_fields):
    cfg = tiny_config(workdir, steps)
    cfg.job = "usage"
    cfg.rollout.update(prompts_per_step=8, group_size=1, max_draws=1)
    cfg.advantage.normalize = "batch"
    cfg.usage = usage_config(**{"min_rows": 4, "settle_s": 300.0, "max_staleness": 6, **usage_fields})
    cfg.deployment = deployment_config(requests_per_window=8, window_s=100.0, keep_after_s=200.0, torn_rate=0.1,
                                       duplicate_rate=0.1)
    cfg.eval.update(every=2)
    return cfg


@pytest.mark.parametrize("field,value,match", [
    ("rollout.group_size", 2, "group_size"), ("resume", True, "does not resume"),
    ("advantage.normalize", "std", "batch"), ("usage.min_rows", 9, "min_rows"),
    ("usage.settle_s", 150.0, "keep_after_s"), ("eval.every", 0, "eval.every"), ("usage.gate_margin", -0.1, "gate"),
    ("deployment.bar_high", 0.4, "bar_high=0.4"), ("usage.unknown", 1, "unknown"),
    ("usage.key_env", "RLCODE_TEST_UNSET_KEY", "not set"),
])
def test_config_errors_name_the_field(tmp_path, field, value, match):
    cfg = usage_tiny(tmp_path)
    usage.validate_config(cfg)
    *path, last = field.split(".")
    node = cfg
    for name in path:
        node = node[name]
    if last not in node:
        node.unlock() if hasattr(node, "unlock") else None
    node[last] = value
    with pytest.raises(ConfigError, match=match):
        usage.validate_config(cfg)


@pytest.mark.slow
def test_the_served_log_probs_are_the_trainers_under_the_same_parameters(tmp_path, sandbox_pool):
    # The deployment samples and logs token ids and log-probs; the trainer re-scores the logged
    # tokens. Under the served parameters the two must agree, or the IS correction is wrong.
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from rlcode import advantages as adv_lib  # noqa: PLC0415
    from rlcode.envs.rewards import SynthRewardConfig  # noqa: PLC0415
    from rlcode.feedback.deployment import Deployment, DeploymentConfig  # noqa: PLC0415
    from rlcode.losses import ObjectiveConfig  # noqa: PLC0415
    from rlcode.models import hf  # noqa: PLC0415
    from rlcode.recipes import ShapingConfig  # noqa: PLC0415
    from rlcode.sampling import SamplingConfig  # noqa: PLC0415
    from rlcode.tokenizer import ByteTokenizer  # noqa: PLC0415
    from rlcode.train import loop  # noqa: PLC0415
    from rlcode.train.rollout import Grader, RolloutCollector  # noqa: PLC0415

    cfg = usage_tiny(tmp_path)
    tok = ByteTokenizer()
    train_tasks, _, _ = loop.build_tasks(cfg, tok)
    graphdef, params = nnx.split(hf.initial_model(cfg.model, 0))
    options = SamplingConfig.from_config(cfg.sampling)
    import dataclasses  # noqa: PLC0415

    sampling = dataclasses.replace(options, stop_ids=(tok.eos_id,), pad_id=tok.pad_id, top_k=None)
    collector = RolloutCollector(graphdef, train_tasks, tok, Grader(sandbox_pool, timeout=5.0), sampling,
                                 SynthRewardConfig.from_config(cfg.reward), ShapingConfig.from_config(cfg.shaping), 1)
    root, log = str(tmp_path / "registry"), str(tmp_path / "usage.jsonl")
    registry.publish(root, 0, params)
    dep = Deployment(DeploymentConfig(requests_per_window=6, window_s=100.0, keep_after_s=200.0, torn_rate=0.2,
                                      duplicate_rate=0.2), collector, root, log, template=params)
    src = UsageSource(UsageConfig(settle_s=300.0, min_rows=6), log, dep.advance)
    rows = src.next_rows(step=0, rows=6)
    r = build_rollout(rows, 6, cfg.task.max_prompt_len, cfg.sampling.max_new_tokens, tok.pad_id,
                      UsageConfig().weights, 0)
    assert r.valid.all() and src.reader.counts["torn"] + src.reader.counts["duplicates"] > 0
    objective = ObjectiveConfig.from_config(cfg.loss)
    prepare = loop.make_prepare_fn(dataclasses.replace(objective, kl_coef=0.0), adv_lib.AdvantageConfig(
        normalize="batch"), options, graphdef, 1, tok.pad_id)
    batch = jax.device_get(prepare(params, None, r))
    m = np.asarray(batch["mask"], bool)
    assert m.sum() == r.lengths.sum()
    np.testing.assert_allclose(np.asarray(batch["old_logp"])[m], np.asarray(batch["behavior_logp"])[m], atol=2e-4)
    # The batch's behaviour log-probs are the logged ones, token for token.
    logged = np.concatenate([it.logprobs for it, _ in rows])
    np.testing.assert_allclose(np.sort(np.asarray(batch["behavior_logp"])[m]), np.sort(logged), atol=1e-6)


@pytest.mark.slow
def test_a_tiny_usage_run_trains_gates_publishes_and_reports(tmp_path, sandbox_pool, monkeypatch):
    from experiments import usage_rl  # noqa: PLC0415

    out = tmp_path / "exp"
    workdir = str(out / "run")
    cfg = usage_tiny(workdir, steps=4, key_env="RLCODE_TEST_LOG_KEY")
    monkeypatch.setenv("RLCODE_TEST_LOG_KEY", "a key the deployment signs with")
    gate = usage.regression_gate
    # The candidate of step 2 scores far below the live version: kept out, and the trainer rolls back.
    monkeypatch.setattr(usage, "regression_gate", lambda root, step, params, score, margin, against: gate(
        root, step, params, score - (1.0 if step == 2 else 0.0), margin, against))
    result = usage.run(cfg, pool=sandbox_pool, log=lambda m: None)
    assert result.completed and result.steps_done == 4
    with open(os.path.join(workdir, "tb", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "usage/rows" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 4 <= r["usage/rows"] <= 8 and r["usage/staleness_max"] <= 6
        assert math.isfinite(r["train/loss"]) and "train/is_weight_mean" in r and "behaviour/length" in r
    assert steps[-1]["usage/torn"] > 0 and steps[-1]["usage/duplicates"] > 0
    assert steps[-1]["usage/unauthenticated"] == 0  # every record is signed with the key (torn ones aside)
    with open(os.path.join(workdir, "usage.jsonl"), "rb") as f:
        lines = f.read().splitlines()
    assert sum(line.startswith(b"h") for line in lines) > 0.8 * len(lines)
    gates = [r for r in records if "gate/score" in r]
    assert [r["step"] for r in gates] == [0, 2, 4]
    assert (gates[1]["gate/published"], gates[1]["gate/rollback"], gates[1]["gate/live_version"]) == (0.0, 1.0, 0.0)
    # After the rollback at step 2 the trainer holds version 0 again: its rows are 0 updates stale.
    assert steps[2]["usage/staleness_max"] == 0.0 and steps[1]["usage/staleness_max"] == 1.0
    history = registry.history(os.path.join(workdir, "registry"))
    assert history[0]["version"] == 0
    assert [h["version"] for h in history] == [0] + [int(r["step"]) for r in gates[1:] if r["gate/published"]]
    # A second run into the same log and registry is refused.
    with pytest.raises(ConfigError, match="already has"):
        usage.run(usage_tiny(workdir, steps=1, log=os.path.join(workdir, "usage.jsonl")), pool=sandbox_pool,
                  log=lambda m: None)
    assert usage_rl.main(["--out", str(out), "--report_only"]) == 0
    with open(out / "usage_rl.json") as f:
        data = json.load(f)
    assert data["completed"] and [g["step"] for g in data["gates"]] == [0, 2, 4]
    assert data["log"]["torn"] > 0 and data["log"]["interactions"] >= 32
    rows, counts = read_log(os.path.join(workdir, "usage.jsonl"), 300.0, b"a key the deployment signs with")
    assert counts["unsettled_at_end"] > 0 and len(rows) + counts["unsettled_at_end"] == counts["interactions"]
    served = {it.version for it, _ in rows}
    assert len(data["ab_tests"]) == len(served) - 1
    assert all(t["n_a"] + t["n_b"] > 0 for t in data["ab_tests"])
    assert os.path.getsize(out / "usage_rl.png") > 0
