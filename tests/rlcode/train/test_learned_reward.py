"""The main job against a learned reward: the reward model's scores are the reward, the tests are
logged as gold, the KL from the start policy is measured, and the over-optimisation monitor's
actions (stop, raise the KL coefficient, refresh the reward model) take effect."""

import jax
import numpy as np
import pytest

from support import tiny_job
from support.reward_models import save_tiny_reward_model

from rlcode.checks import ConfigError
from rlcode.envs.rewards import SynthRewardConfig, synth_rewards
from rlcode.feedback import monitor as monitor_lib
from rlcode.feedback import reward_model as rm
from rlcode.train import loop
from rlcode.train.metrics import read_jsonl


@pytest.fixture(scope="module")
def pool(sandbox_pool):
    return sandbox_pool


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A tiny byte-level reward model with a random (nonzero) value head, saved."""
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def learned_config(tmp_path, reward_dir, steps=3, **overrides):
    cfg = tiny_job.tiny_config(tmp_path / "run", steps=steps, eval__at_start=False, eval__at_end=False, eval__every=0,
                               **overrides)
    cfg.reward.update(source="reward_model", reward_model=reward_dir)
    cfg.loss.kl_coef = 0.0  # the reference is kept anyway, to measure the KL from the start policy
    return cfg


def test_synth_rewards_pay_the_reward_model_and_not_the_tests():
    cfg = SynthRewardConfig(source="reward_model", reward_model="x", preference_weight=2.0, truncation_penalty=0.5)
    frac, valid = np.array([1.0, 0.0, 1.0]), np.array([True, True, False])
    rewards, terms = synth_rewards(frac, valid, np.array([False, True, False]), np.array([3, 9, 3]), 9, cfg,
                                   preference=np.array([0.25, -1.0, 7.0]))
    np.testing.assert_allclose(terms["preference"], [0.5, -2.0, 0.0])
    np.testing.assert_allclose(terms["tests"], 0.0)
    np.testing.assert_allclose(rewards, [0.5, -2.5, 0.0])
    with pytest.raises(ValueError, match="one reward-model score per row"):
        synth_rewards(frac, valid, np.zeros(3, bool), np.ones(3), 9, cfg)
    with pytest.raises(FloatingPointError, match="non-finite"):
        synth_rewards(frac, valid, np.zeros(3, bool), np.ones(3), 9, cfg, preference=np.array([np.nan, 0, 0]))
    with pytest.raises(ConfigError, match="needs reward.reward_model"):
        SynthRewardConfig(source="reward_model")


def test_config_errors_name_the_field(tmp_path, reward_dir):
    cfg = learned_config(tmp_path, reward_dir)
    cfg.reward.reward_model = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="reward.reward_model=.*no such directory"):
        loop.validate_config(cfg, budget=[])
    cfg = tiny_job.tiny_config(tmp_path / "run")
    cfg.monitor.update(enabled=True, action="refresh")
    with pytest.raises(ConfigError, match="needs reward.source='reward_model'"):
        loop.validate_config(cfg, budget=[])
    cfg = learned_config(tmp_path, reward_dir, rollout__async_mode=True)
    cfg.monitor.enabled = True
    with pytest.raises(ConfigError, match="rollout.async_mode=False"):
        loop.validate_config(cfg, budget=[])


@pytest.mark.slow
def test_the_reward_model_is_the_reward_and_the_kl_is_measured(tmp_path, reward_dir, pool):
    cfg = learned_config(tmp_path, reward_dir, steps=3)
    result = loop.run(cfg, pool=pool)
    assert result.completed
    rows = [r for r in read_jsonl(tmp_path / "run" / "tb") if "train/loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["rollout/reward_tests"] == 0.0 and r["rollout/reward_preference"] != 0.0
        assert abs(r["rollout/reward"] - r["rollout/reward_preference"] - r["rollout/reward_truncated"]
                   - r["rollout/reward_overlong"]) < 1e-5
        assert 0.0 <= r["rollout/pass_fraction"] <= 1.0  # gold is still measured
        assert "train/kl_ref" in r and r["rollout/kl_coef"] == 0.0
    # Step 1 samples with the start policy itself: its log-ratio to the reference is exactly 0.
    assert rows[0]["rollout/kl_from_start"] == 0.0
    assert rows[-1]["rollout/kl_from_start"] != 0.0


def _always_diverges(monkeypatch, after=1):
    """The monitor flags at every update from its `after`-th on (its statistics are tested alone)."""
    real = monitor_lib.OveroptimizationMonitor.update

    def update(self, step, proxy, gold):
        out, _ = real(self, step, proxy, gold)
        return out, step >= after and step > self.quiet_until

    monkeypatch.setattr(monitor_lib.OveroptimizationMonitor, "update", update)


@pytest.mark.slow
def test_monitor_actions_stop_and_raise_kl(tmp_path, reward_dir, pool, monkeypatch):
    _always_diverges(monkeypatch, after=1)
    cfg = learned_config(tmp_path, reward_dir, steps=4)
    cfg.monitor.update(enabled=True, action="stop", audit_size=3)
    result = loop.run(cfg, pool=pool)
    assert not result.completed and result.stopped == "monitor" and result.steps_done == 2
    rows = [r for r in read_jsonl(tmp_path / "run" / "tb") if "monitor/audit_rows" in r]
    assert [r["monitor/audit_rows"] for r in rows] == [3.0, 3.0]

    cfg = learned_config(tmp_path / "kl", reward_dir, steps=4)
    cfg.monitor.update(enabled=True, action="raise_kl", kl_floor=0.05, kl_factor=3.0, cooldown=1)
    result = loop.run(cfg, pool=pool)
    assert result.completed
    coefs = [r["rollout/kl_coef"] for r in read_jsonl(tmp_path / "kl" / "run" / "tb") if "rollout/kl_coef" in r]
    # flagged after step 2 (0 -> the floor), cooldown 1 skips step 3's verdict, flagged after step 4.
    assert coefs == [0.0, 0.0, 0.05, 0.05]


@pytest.mark.slow
def test_monitor_refresh_retrains_the_reward_model(tmp_path, reward_dir, pool, monkeypatch):
    _always_diverges(monkeypatch, after=0)
    before = rm.load_reward_model(reward_dir)
    trained = []
    real_train = rm.train_reward_model

    def spy(model, tokenizer, pairs, heldout, cfg, **kw):
        scorer, history = real_train(model, tokenizer, pairs, heldout, cfg, **kw)
        trained.append((len(pairs), scorer))
        return scorer, history

    monkeypatch.setattr(rm, "train_reward_model", spy)
    cfg = learned_config(tmp_path, reward_dir, steps=1)
    cfg.monitor.update(enabled=True, action="refresh", refresh_pairs=6, refresh_steps=2, user_bias=1.0)
    cfg.sampling.temperature = 2.0  # distinct completions within a group to compare
    result = loop.run(cfg, pool=pool)
    assert result.completed and len(trained) == 1
    n, scorer = trained[0]
    assert 2 <= n <= 6
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(scorer.params), jax.tree.leaves(before.params))]
    assert max(moved) > 0
