"""rlcode.feedback.reward_model: the Bradley-Terry loss and its gradient against a float64 numpy
oracle, the metrics against a per-pair loop, the reward read at each row's last token against a
forward of that row alone, and training that learns a planted preference on held-out prompts."""

import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode.feedback import reward_model as rm
from rlcode.feedback.preferences import PreferencePair
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer
from rlcode.train import checkpoint


def oracle_loss(rc, rr, tie, weight, margin):
    """Per pair in float64, from the definitions: -log sigmoid(d - m), or the tie's half-half."""
    out = []
    for c, r, t, m in zip(rc, rr, tie, margin):
        d = float(c) - float(r)
        sig = lambda x: 1.0 / (1.0 + math.exp(-x))
        out.append(-0.5 * (math.log(sig(d)) + math.log(sig(-d))) if t else -math.log(sig(d - float(m))))
    out = np.array(out)
    return float((np.asarray(weight, np.float64) * out).sum() / np.sum(weight)), out


@pytest.mark.parametrize("n", [1, 7, 64])
def test_loss_and_gradient_match_the_float64_oracle(n):
    rng = np.random.default_rng(n)
    rc, rr = rng.normal(0, 3, n), rng.normal(0, 3, n)
    tie = rng.random(n) < 0.3
    weight = rng.uniform(0.2, 2.0, n)
    margin = np.where(rng.random(n) < 0.5, rng.uniform(0, 1.5, n), 0.0)
    expected, _ = oracle_loss(rc, rr, tie, weight, margin)
    f = lambda a, b: rm.bradley_terry_loss(a, b, jnp.asarray(tie), jnp.asarray(weight, jnp.float32),
                                           jnp.asarray(margin, jnp.float32))
    a, b = jnp.asarray(rc, jnp.float32), jnp.asarray(rr, jnp.float32)
    np.testing.assert_allclose(float(f(a, b)), expected, rtol=1e-5)
    # Gradient: central differences of the float64 oracle.
    ga, gb = jax.grad(f, argnums=(0, 1))(a, b)
    eps = 1e-6
    for i in range(n):
        up, down = rc.copy(), rc.copy()
        up[i] += eps
        down[i] -= eps
        numeric = (oracle_loss(up, rr, tie, weight, margin)[0] - oracle_loss(down, rr, tie, weight, margin)[0]) / (2 * eps)
        np.testing.assert_allclose(float(ga[i]), numeric, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(float(gb[i]), -numeric, rtol=1e-3, atol=1e-6)


def test_tie_is_smallest_at_equal_rewards_and_large_deltas_stay_finite():
    d = jnp.linspace(-3, 3, 61)
    tie_loss = rm.pair_losses(d, jnp.ones(61, bool), jnp.zeros(61))
    assert int(jnp.argmin(tie_loss)) == 30 and np.isclose(float(tie_loss[30]), math.log(2), rtol=1e-6)
    big = rm.pair_losses(jnp.array([-200.0, 200.0]), jnp.zeros(2, bool), jnp.zeros(2))
    np.testing.assert_allclose(np.asarray(big), [200.0, 0.0], atol=1e-5)
    assert np.isfinite(np.asarray(jax.grad(lambda x: rm.pair_losses(x, jnp.zeros(2, bool), jnp.zeros(2)).sum())(
        jnp.array([-200.0, 200.0])))).all()


def test_metrics_match_a_per_pair_loop():
    rng = np.random.default_rng(0)
    delta = np.concatenate([rng.normal(0.5, 2.0, 500), [0.0, 0.0]])
    tie = np.concatenate([rng.random(500) < 0.1, [False, True]])
    m = rm.pairwise_metrics(delta, tie, bins=5)
    decided = [(d, 1.0 if d > 0 else 0.5 if d == 0 else 0.0) for d, t in zip(delta, tie) if not t]
    assert m["accuracy"] == pytest.approx(np.mean([c for _, c in decided]))
    # ECE by hand: each pair folded to its predicted winner, five bins over [0.5, 1].
    bins = [[] for _ in range(5)]
    for d, c in decided:
        conf = 1 / (1 + math.exp(-abs(d)))
        bins[min(int((conf - 0.5) * 10), 4)].append((conf, c))
    ece = sum(len(b) * abs(np.mean([c for _, c in b]) - np.mean([p for p, _ in b])) for b in bins if b) / len(decided)
    assert m["ece"] == pytest.approx(ece) and m["ties"] == tie.sum() and m["pairs"] == len(delta)
    # A calibrated predictor: outcomes drawn with the predicted probability have ECE near 0.
    d = rng.normal(0, 2, 20000)
    won = rng.random(d.size) < 1 / (1 + np.exp(-d))
    assert rm.pairwise_metrics(np.where(won, d, -d))["ece"] < 0.02


def tiny_model(seed=0, layers=1):
    cfg = model_config(vocab_size=ByteTokenizer().vocab_size, d_model=32, num_layers=layers, num_heads=2,
                       num_kv_heads=1, head_dim=16, ffw_dim=64, value_head=True)
    return init_model(cfg, seed)


@pytest.mark.slow
def test_the_reward_is_the_value_head_at_each_rows_last_token():
    tok = ByteTokenizer()
    model = tiny_model()
    gd, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params["value_w"] = jax.random.normal(jax.random.key(1), params["value_w"].shape)  # a head that is not zero
    prompts = ["def f(x):\n", "x", "a longer prompt " * 5]
    completions = ["    return x\n", "", "    pass\n"]
    scorer = rm.RewardModel(gd, params, tok, max_len=64, batch_size=2)
    got = scorer.score(prompts, completions)
    for p, c, r in zip(prompts, completions, got):
        ids = (tok.encode(p) + tok.encode(c) + [tok.eos_id])[-64:]
        out = nnx.merge(gd, params)(jnp.asarray([ids]))  # that row alone, unpadded
        np.testing.assert_allclose(r, float(out.values[0, -1]), rtol=1e-5, atol=1e-6)
    assert got[2] != got[0]
    tokens, lengths, truncated = rm.encode_texts(tok, prompts, completions, max_len=64)
    assert truncated == 1 and lengths[2] == 64 and tokens.shape == (3, 64)


@pytest.mark.slow
def test_training_learns_a_planted_preference_on_held_out_prompts():
    """People prefer completions that return a number over ones that return a string: the model
    must pick that up and rank held-out pairs of new prompts, and separate them calibratedly."""
    rng = random.Random(0)
    pairs = []
    for i in range(240):
        name = "".join(rng.choice("abcdefgh") for _ in range(4))
        good = f"    return {rng.randrange(100)}\n"
        bad = f"    return '{rng.choice('xyz')}{rng.randrange(100)}'\n"
        pairs.append(PreferencePair(f"def {name}(v):\n", good, bad, tie=i % 10 == 0))
    train, held = pairs[:200], pairs[200:]
    cfg = rm.train_config(steps=120, batch_pairs=16, eval_every=60, max_len=64)
    cfg.optim.update(lr=3e-3, total_steps=120, warmup_steps=10)
    scorer, history = rm.train_reward_model(tiny_model(), ByteTokenizer(), train, held, cfg, log=lambda m: None)
    assert [h["step"] for h in history] == [60, 120]
    final = history[-1]
    assert final["heldout/accuracy"] > 0.9 and final["heldout/ties"] == 4
    assert final["train/loss"] < 0.6 * math.log(2)
    # The scoring API agrees with the pairs' deltas.
    batch = rm.encode_pairs(ByteTokenizer(), held, 64)
    r = scorer.score([p.prompt for p in held], [p.chosen for p in held]) - scorer.score(
        [p.prompt for p in held], [p.rejected for p in held])
    np.testing.assert_allclose(r, scorer.deltas(batch), rtol=1e-4, atol=1e-5)


def test_saved_reward_model_scores_the_same(tmp_path):
    tok = ByteTokenizer()
    model = tiny_model(seed=3)
    gd, state = nnx.split(model)
    params = jax.tree.map(lambda x: x + 0.01, nnx.to_pure_dict(state))
    scorer = rm.RewardModel(gd, params, tok, max_len=48)
    scorer.save(str(tmp_path / "rm"), extra={"note": "x"})
    loaded = rm.load_reward_model(str(tmp_path / "rm"), tiny_model(seed=9), tok)
    assert loaded.max_len == 48
    texts = ["    return 1\n", "    return 'a'\n"]
    np.testing.assert_array_equal(loaded.score(["def f():\n"] * 2, texts), scorer.score(["def f():\n"] * 2, texts))
    # Alone: the architecture from the saved config, the tokenizer from the saved files.
    alone = rm.load_reward_model(str(tmp_path / "rm"))
    assert alone.graphdef == scorer.graphdef and rm.reward_model_extra(str(tmp_path / "rm"))["note"] == "x"
    np.testing.assert_array_equal(alone.score(["def f():\n"] * 2, texts), scorer.score(["def f():\n"] * 2, texts))
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        scorer.save(str(tmp_path / "rm"))
    with pytest.raises(checkpoint.CheckpointError, match="not a reward model"):
        checkpoint.save_params(str(tmp_path / "other" / "params"), params)
        rm.load_reward_model(str(tmp_path / "other"))


def test_a_model_without_value_head_and_too_few_pairs_are_refused():
    cfg = rm.train_config(batch_pairs=4)
    no_head = init_model(model_config(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                      head_dim=16, ffw_dim=64), 0)
    pair = PreferencePair("p", "a", "b")
    with pytest.raises(ValueError, match="value head"):
        rm.train_reward_model(no_head, ByteTokenizer(), [pair] * 8, [], cfg)
    with pytest.raises(ValueError, match="fewer than batch_pairs"):
        rm.train_reward_model(tiny_model(), ByteTokenizer(), [pair] * 3, [], cfg)
