"""rlcode.losses against float64 numpy / python-loop oracles written from docs/reference.md §2-§5."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rlcode import losses

KINDS = losses.POLICY_KINDS
AGGS = losses.AGG_MODES
CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# Oracles (float64, python loops over sequences and tokens)
# --------------------------------------------------------------------------------------------


def np_is_weights(old, beh, mask, mode, level, cap, lo, hi):
    B, T = mask.shape
    w = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if not idx:
            continue
        if level == "token":
            raws = {t: np.exp(np.clip(old[b, t] - beh[b, t], -CLAMP, CLAMP)) for t in idx}
        else:
            s = sum(old[b, t] - beh[b, t] for t in idx)
            if level == "geometric":
                s /= len(idx)
            raw = np.exp(np.clip(s, -CLAMP, CLAMP))
            raws = {t: raw for t in idx}
        for t, raw in raws.items():
            if mode == "tis":
                w[b, t] = min(raw, cap)
            elif mode == "mis":
                w[b, t] = raw if lo <= raw <= hi else 0.0
            else:
                w[b, t] = 1.0
    return w


def np_per_token(logp, old, adv, mask, kind, lo, hi, dual):
    B, T = mask.shape
    A = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    out = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if not idx:
            continue
        seq_ratio = np.exp(np.clip(np.mean([logp[b, t] - old[b, t] for t in idx]), -CLAMP, CLAMP))
        for t in idx:
            r = np.exp(np.clip(logp[b, t] - old[b, t], -CLAMP, CLAMP))
            a = A[b, t]
            if kind in ("gspo", "gspo_token"):
                r = seq_ratio
            if kind in ("ppo", "gspo", "gspo_token"):
                loss = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
                if dual is not None and a < 0:
                    loss = min(loss, -dual * a)
            elif kind == "cispo":
                loss = -min(max(r, 1 - lo), 1 + hi) * a * logp[b, t]
            else:
                loss = -a * logp[b, t]
            out[b, t] = loss
    return out


def np_aggregate(x, mask, agg, L=None):
    B, T = mask.shape
    rows = [[x[b, t] for t in range(T) if mask[b, t]] for b in range(B)]
    rows = [r for r in rows if r]
    if not rows:
        return 0.0
    if agg == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if agg == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * L)


def ragged_mask(rng, B, T):
    """Random prompt offsets and lengths, plus a single-token row and an all-masked row."""
    mask = np.zeros((B, T), bool)
    for b in range(B):
        start = rng.integers(0, T)
        mask[b, start : start + rng.integers(1, T + 1)] = True
    if B >= 3:
        mask[1] = False
        mask[1, T - 1] = True
        mask[2] = False
    return mask


def random_inputs(seed, B, T, spread=0.3, seq_adv=True):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.7, (B, T)))
    old = logp + rng.normal(0, spread, (B, T))
    beh = old + rng.normal(0, spread, (B, T))
    adv = rng.normal(size=(B,)) if seq_adv else rng.normal(size=(B, T))
    return logp, old, beh, adv, ragged_mask(rng, B, T)


def cfg(**kw):
    """The `loss` section with these overrides, read as a job reads it: an `ObjectiveConfig`."""
    return losses.ObjectiveConfig.from_config(losses.loss_config(**kw))


def pcfg(**kw):
    """The policy-loss part of `cfg(**kw)`: what `policy_loss` takes."""
    return cfg(**kw).policy


# --------------------------------------------------------------------------------------------
# Values against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (6, 33)])
def test_policy_loss_matches_oracle(kind, agg, shape):
    B, T = shape
    for seq_adv in (True, False):
        logp, old, _, adv, mask = random_inputs(hash((kind, agg, shape, seq_adv)) % 2**31, B, T, seq_adv=seq_adv)
        c = pcfg(kind=kind, agg=agg, norm_length=T + 3, clip_low=0.1, clip_high=0.15)
        loss, metrics = losses.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), c)
        per_tok = np_per_token(logp, old, adv, mask, kind, 0.1, 0.15, None)
        expected = np_aggregate(per_tok, mask, agg, T + 3)
        np.testing.assert_allclose(float(loss), expected, rtol=2e-5, atol=1e-6)
        assert np.isfinite(float(metrics["policy_loss"]))


@pytest.mark.parametrize("kind", ["ppo", "gspo", "gspo_token"])
def test_dual_clip_matches_oracle_and_bounds_loss(kind):
    logp, old, _, adv, mask = random_inputs(3, 5, 9, spread=1.5, seq_adv=False)
    c = pcfg(kind=kind, dual_clip=3.0, clip_low=0.2, clip_high=0.2)
    loss, metrics = losses.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), c)
    per_tok = np_per_token(logp, old, adv, mask, kind, 0.2, 0.2, 3.0)
    np.testing.assert_allclose(float(loss), np_aggregate(per_tok, mask, "token-mean"), rtol=2e-5)
    neg = mask & (adv < 0)
    assert np.all(per_tok[neg] <= -3.0 * adv[neg] + 1e-12)
    if kind == "ppo":
        ratio = np.exp(logp - old)
        expected_frac = (neg & (ratio > 3.0)).sum() / mask.sum()
        assert expected_frac > 0, "test inputs must exercise the dual clip"
        np.testing.assert_allclose(float(metrics["clip_frac_dual"]), expected_frac, rtol=1e-6)


@pytest.mark.parametrize("mode", ["tis", "mis", "none"])
@pytest.mark.parametrize("level", losses.IS_LEVELS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_is_corrected_loss_matches_oracle(mode, level, agg):
    B, T = 5, 11
    logp, old, beh, adv, mask = random_inputs(7, B, T, spread=0.5)
    beh = beh + np.random.default_rng(70).normal(0, 0.9, (B, 1))  # per-sequence drift, for the sequence levels
    c = pcfg(kind="ppo", agg=agg, is_mode=mode, is_level=level, is_cap=1.5, is_low=0.7, is_high=1.4)
    loss, metrics = losses.policy_loss(
        jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), c, behavior_logp=jnp.asarray(beh)
    )
    w = np_is_weights(old, beh, mask, mode, level, 1.5, 0.7, 1.4)
    per_tok = np_per_token(logp, old, adv, mask, "ppo", 0.2, 0.2, None) * w
    np.testing.assert_allclose(float(loss), np_aggregate(per_tok, mask, agg), rtol=2e-5, atol=1e-7)

    # Diagnostics over units (tokens or sequences) of the raw and applied weights.
    if level == "token":
        raw = np.exp(np.clip(old - beh, -CLAMP, CLAMP))[mask]
        applied = w[mask]
    else:
        rows = [b for b in range(B) if mask[b].any()]
        s = np.array([(old[b] - beh[b])[mask[b]].sum() / (mask[b].sum() if level == "geometric" else 1) for b in rows])
        raw = np.exp(np.clip(s, -CLAMP, CLAMP))
        applied = np.array([w[b][mask[b]][0] for b in rows])
    np.testing.assert_allclose(float(metrics["is_weight_mean"]), raw.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_weight_max"]), raw.max(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_weight_p50"]), np.quantile(raw, 0.5), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_ess"]), applied.sum() ** 2 / (applied**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_ess_frac"]), applied.sum() ** 2 / (applied**2).sum() / len(raw), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["is_frac_truncated"]), (raw > 1.5).mean() if mode == "tis" else 0.0, atol=1e-7)
    np.testing.assert_allclose(
        float(metrics["is_frac_masked"]), ((raw < 0.7) | (raw > 1.4)).mean() if mode == "mis" else 0.0, atol=1e-7
    )
    if mode != "none":
        frac = metrics["is_frac_truncated"] if mode == "tis" else metrics["is_frac_masked"]
        assert 0 < float(frac) < 1, "test inputs must exercise the correction"


def test_metrics_match_oracle():
    B, T = 6, 13
    logp, old, _, adv, mask = random_inputs(11, B, T, spread=0.4)
    _, m = losses.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), pcfg(clip_high=0.28))
    r = np.exp(logp - old)
    A = np.broadcast_to(adv[:, None], (B, T))
    n = mask.sum()
    np.testing.assert_allclose(float(m["clip_frac_low"]), ((A < 0) & (r < 0.8) & mask).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_frac_high"]), ((A > 0) & (r > 1.28) & mask).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), r[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), r[mask].max(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_min"]), r[mask].min(), rtol=1e-5)
    np.testing.assert_allclose(float(m["approx_kl"]), (r - 1 - np.log(r))[mask].mean(), rtol=1e-4)
    assert float(m["num_tokens"]) == n


# --------------------------------------------------------------------------------------------
# Gradient identities
# --------------------------------------------------------------------------------------------


def grad_logp(c, logp, old, adv, mask, **kw):
    f = lambda lp: losses.policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), c, **kw)[0]
    return np.asarray(jax.grad(f)(jnp.asarray(logp, jnp.float32)), np.float64)


def test_ppo_gradient_zero_on_actively_clipped_tokens():
    B, T = 16, 20
    logp, old, _, adv, mask = random_inputs(5, B, T, spread=0.5, seq_adv=False)
    g = grad_logp(pcfg(kind="ppo", clip_low=0.2, clip_high=0.28), logp, old, adv, mask)
    r = np.exp(logp - old)
    clipped = mask & (((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)))
    live = mask & ~clipped & (adv != 0)
    assert clipped.sum() > 3 and live.sum() > 3
    assert np.all(g[clipped] == 0.0)
    # Elsewhere the gradient is the unclipped surrogate's: d(-r A)/dlogp / n = -r A / n.
    np.testing.assert_allclose(g[live], (-r * adv / mask.sum())[live], rtol=1e-5)
    assert np.all(g[~mask] == 0.0)


def test_dual_clip_gradient_zero_beyond_c():
    B, T = 4, 16
    logp, old, _, adv, mask = random_inputs(8, B, T, spread=1.5, seq_adv=False)
    g = grad_logp(pcfg(kind="ppo", dual_clip=3.0), logp, old, adv, mask)
    r = np.exp(logp - old)
    dual = mask & (adv < 0) & (r > 3.0)
    assert dual.sum() > 0
    assert np.all(g[dual] == 0.0)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    B, T = 5, 12
    logp, old, _, adv, mask = random_inputs(9, B, T, spread=0.6)
    g = grad_logp(pcfg(kind="cispo", clip_low=0.3, clip_high=0.25), logp, old, adv, mask)
    w = np.clip(np.exp(logp - old), 0.7, 1.25)
    expected = np.where(mask, -w * adv[:, None] / mask.sum(), 0)
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-9)
    # No token is dropped: every masked token with A != 0 has a gradient.
    assert np.all(g[mask] != 0)


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_token_gradient_equals_gspo(agg):
    B, T = 6, 15
    logp, old, _, adv, mask = random_inputs(12, B, T, spread=0.02)
    kw = dict(clip_low=0.015, clip_high=0.02, agg=agg, norm_length=T)
    g_seq = grad_logp(pcfg(kind="gspo", **kw), logp, old, adv, mask)
    g_tok = grad_logp(pcfg(kind="gspo_token", **kw), logp, old, adv, mask)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-9)
    assert np.abs(g_seq).max() > 0
    # Some sequences are clipped, some not: the identity covers both regimes.
    s = np.array([np.exp((logp[b] - old[b])[mask[b]].mean()) if mask[b].any() else 1.0 for b in range(B)])
    clipped = ((adv > 0) & (s > 1.02)) | ((adv < 0) & (s < 0.985))
    assert clipped.any() and (~clipped & mask.any(-1)).any()


def test_gspo_gradient_matches_sequence_ratio_oracle():
    B, T = 4, 9
    logp, old, _, adv, mask = random_inputs(13, B, T, spread=0.001)
    g = grad_logp(pcfg(kind="gspo", clip_low=1.0, clip_high=1.0, agg="seq-mean-token-mean"), logp, old, adv, mask)
    # Unclipped: loss = -mean_b s_b A_b, ds_b/dlogp_t = s_b / |y_b|.
    rows = mask.any(-1)
    expected = np.zeros((B, T))
    for b in np.flatnonzero(rows):
        s = np.exp((logp[b] - old[b])[mask[b]].mean())
        expected[b, mask[b]] = -adv[b] * s / mask[b].sum() / rows.sum()
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-10)


# --------------------------------------------------------------------------------------------
# Micro-batch accumulation reproduces the full-batch gradient (§5)
# --------------------------------------------------------------------------------------------


def _toy_problem(seed, B=8, T=10, V=5):
    rng = np.random.default_rng(seed)
    feats = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)))
    mask = jnp.asarray(ragged_mask(rng, B, T))
    params = {"w": jnp.asarray(rng.normal(size=(V,)), jnp.float32), "scale": jnp.ones((V,), jnp.float32)}

    def logp_fn(p, f, tok):
        return losses.logprobs_from_logits(f * p["scale"] + p["w"], tok)

    old = logp_fn(jax.tree.map(lambda x: x + 0.3 * jnp.asarray(rng.normal(size=x.shape), jnp.float32), params), feats, tokens)
    beh = old + jnp.asarray(rng.normal(0, 0.3, (B, T)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    batch = {"feats": feats, "tokens": tokens, "mask": mask, "old": old, "beh": beh, "adv": adv}
    return params, batch, logp_fn


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.slow
def test_microbatch_accumulation_equals_full_batch(agg, kind):
    params, batch, logp_fn = _toy_problem(21)
    c = cfg(kind=kind, agg=agg, norm_length=12, is_mode="tis", clip_low=0.1, clip_high=0.1,
            kl_coef=0.1, entropy_coef=0.01)

    def terms(p, mb):
        logits = mb["feats"] * p["scale"] + p["w"]
        lp = logp_fn(p, mb["feats"], mb["tokens"])
        return losses.objective_terms(c, lp, mb["old"], mb["adv"], mb["mask"], behavior_logp=mb["beh"],
                                      ref_logp=mb["old"] - 0.1, entropy=losses.entropy_from_logits(logits))

    def full(p):
        num, den, _ = terms(p, batch)
        return num / den

    loss_full, g_full = jax.value_and_grad(full)(params)
    for n_micro in (1, 2, 4):
        mbs = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)
        loss, g, _ = jax.jit(lambda p, m: losses.accumulate_gradients(terms, p, m))(params, mbs)
        np.testing.assert_allclose(float(loss), float(loss_full), rtol=1e-5)
        for k in params:
            np.testing.assert_allclose(np.asarray(g[k]), np.asarray(g_full[k]), rtol=2e-5, atol=1e-7)
    # The naive alternative (mean of per-micro-batch losses) differs for ragged masks: the test
    # would catch a per-micro-batch division.
    mbs = jax.tree.map(lambda x: x.reshape(4, -1, *x.shape[1:]), batch)
    per_micro = [terms(params, jax.tree.map(lambda x: x[i], mbs)) for i in range(4)]
    naive = np.mean([float(num / den) for num, den, _ in per_micro])
    assert abs(naive - float(loss_full)) > 1e-4


def test_data_parallel_accumulation_uses_global_denominator():
    """Shards (a named vmap axis standing in for devices) psum numerators and denominators."""
    params, batch, logp_fn = _toy_problem(22)
    c = pcfg(kind="ppo", agg="seq-mean-token-mean")

    def terms(p, mb):
        return losses.policy_loss_terms(logp_fn(p, mb["feats"], mb["tokens"]), mb["old"], mb["adv"], mb["mask"], c)

    full_loss, g_full = jax.value_and_grad(lambda p: (lambda n, d, _: n / d)(*terms(p, batch)))(params)
    shards = jax.tree.map(lambda x: x.reshape(2, 2, -1, *x.shape[1:]), batch)  # 2 shards x 2 micro-batches
    loss, g, _ = jax.vmap(lambda m: losses.accumulate_gradients(terms, params, m, axis_name="data"),
                          axis_name="data")(shards)
    np.testing.assert_allclose(np.asarray(loss), float(full_loss), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(g[k][0]), np.asarray(g_full[k]), rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(g[k][1]), np.asarray(g_full[k]), rtol=2e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Monte-Carlo: a baseline leaves the expected gradient unchanged and lowers its variance
# --------------------------------------------------------------------------------------------


def test_baseline_unbiased_and_lowers_variance():
    K, N = 6, 20000
    rng = np.random.default_rng(0)
    theta = jnp.asarray(rng.normal(size=(K,)), jnp.float32)
    reward_table = jnp.asarray(rng.uniform(2.0, 3.0, size=(K,)), jnp.float32)  # far from 0: baseline matters
    probs = np.asarray(jax.nn.softmax(theta), np.float64)
    R = np.asarray(reward_table, np.float64)
    # Exact gradient of E[R] w.r.t. theta: p_a (R_a - E[R]).
    exact = probs * (R - probs @ R)

    actions = jax.random.categorical(jax.random.key(1), theta, shape=(N,))
    c = pcfg(kind="reinforce", agg="token-mean")

    def per_sample_grad(a, adv):
        def loss(th):
            lp = jax.nn.log_softmax(th)[a].reshape(1, 1)
            return losses.policy_loss(lp, jax.lax.stop_gradient(lp), adv.reshape(1), jnp.ones((1, 1)), c)[0]
        return -jax.grad(loss)(theta)  # ascent direction

    grads = jax.jit(jax.vmap(per_sample_grad))
    rewards = reward_table[actions]
    g_plain = np.asarray(grads(actions, rewards), np.float64)
    g_base = np.asarray(grads(actions, rewards - float(probs @ R)), np.float64)
    for g in (g_plain, g_base):
        stderr = g.std(0, ddof=1) / np.sqrt(N)
        assert np.all(np.abs(g.mean(0) - exact) < 5 * stderr + 1e-6)
    assert g_base.var(0).sum() < 0.2 * g_plain.var(0).sum()

    # RLOO's leave-one-out baseline is also unbiased (it does not depend on the sample's own action).
    from rlcode.advantages import group_advantages

    G = 4
    adv_rloo = group_advantages(rewards, G, "rloo")
    g_rloo = np.asarray(grads(actions, adv_rloo), np.float64)
    stderr = g_rloo.std(0, ddof=1) / np.sqrt(N)
    assert np.all(np.abs(g_rloo.mean(0) - exact) < 5 * stderr + 1e-6)
    assert g_rloo.var(0).sum() < 0.5 * g_plain.var(0).sum()


# --------------------------------------------------------------------------------------------
# KL, value loss, entropy, log-probs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_estimators_match_oracle(kind):
    rng = np.random.default_rng(4)
    logp, ref = rng.normal(-1, 1, (3, 8)), rng.normal(-1, 1, (3, 8))
    lq = ref - logp
    expected = {"k1": -lq, "k2": 0.5 * lq**2, "k3": np.exp(lq) - 1 - lq}[kind]
    got = np.asarray(losses.kl_divergence(jnp.asarray(logp), jnp.asarray(ref), kind))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if kind == "k3":
        assert np.all(expected >= 0)


def test_kl_estimators_unbiased_on_categorical():
    """E_{x~p}[k1] = E[k3] = KL(p||q) exactly when summed against p."""
    rng = np.random.default_rng(5)
    logp = np.log(rng.dirichlet(np.ones(7)))
    logq = np.log(rng.dirichlet(np.ones(7)))
    p = np.exp(logp)
    kl = np.sum(p * (logp - logq))
    for kind in ("k1", "k3"):
        k = np.asarray(losses.kl_divergence(jnp.asarray(logp), jnp.asarray(logq), kind), np.float64)
        np.testing.assert_allclose(np.sum(p * k), kl, rtol=1e-5)


def test_kl_reward_penalty():
    rng = np.random.default_rng(6)
    logp, ref = rng.normal(-1, 1, (4, 5)), rng.normal(-1, 1, (4, 5))
    mask = ragged_mask(rng, 4, 5)
    r = rng.normal(size=4)
    got = losses.kl_reward_penalty(jnp.asarray(r), jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask), 0.1)
    np.testing.assert_allclose(np.asarray(got), r - 0.1 * np.where(mask, logp - ref, 0).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_matches_oracle(clip, agg):
    rng = np.random.default_rng(7)
    B, T = 5, 9
    v, v_old, ret = rng.normal(size=(B, T)), rng.normal(size=(B, T)), rng.normal(size=(B, T))
    mask = ragged_mask(rng, B, T)
    loss, m = losses.value_loss(jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask), clip, agg, 11)
    per = 0.5 * (v - ret) ** 2
    if clip is not None:
        per = np.maximum(per, 0.5 * (np.clip(v, v_old - clip, v_old + clip) - ret) ** 2)
    np.testing.assert_allclose(float(loss), np_aggregate(per, mask, agg, 11), rtol=1e-5)
    ev = 1 - np.var((ret - v)[mask]) / np.var(ret[mask])
    np.testing.assert_allclose(float(m["explained_variance"]), ev, rtol=1e-4)
    # Gradient: zero where the clipped branch is active (it does not depend on v there).
    g = np.asarray(jax.grad(lambda x: losses.value_loss(x, jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask), clip, agg, 11)[0])(jnp.asarray(v, jnp.float32)))
    if clip is not None:
        clipped_branch = mask & ((np.clip(v, v_old - clip, v_old + clip) - ret) ** 2 > (v - ret) ** 2)
        assert clipped_branch.any()
        assert np.all(g[clipped_branch] == 0)
    assert np.all(g[~mask] == 0)


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.3])
def test_entropy_and_logprobs_at_temperature(tau):
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 3, (3, 4, 11))
    tokens = rng.integers(0, 11, (3, 4))
    z = logits / tau
    logq = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    H = -(np.exp(logq) * logq).sum(-1)
    np.testing.assert_allclose(np.asarray(losses.entropy_from_logits(jnp.asarray(logits), tau)), H, rtol=1e-5)
    lp = np.take_along_axis(logq, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(losses.logprobs_from_logits(jnp.asarray(logits), jnp.asarray(tokens), tau)), lp, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        losses.entropy_from_logits(jnp.asarray(logits), 0.0)


# --------------------------------------------------------------------------------------------
# The combined objective
# --------------------------------------------------------------------------------------------


def test_objective_terms_combines_terms_with_shared_denominator():
    rng = np.random.default_rng(9)
    B, T = 4, 7
    logp, old, beh, adv, mask = random_inputs(10, B, T)
    ref = logp - rng.uniform(0, 0.5, (B, T))
    ent = rng.uniform(0, 2, (B, T))
    v, v_old, ret = rng.normal(size=(3, B, T))
    c = cfg(agg="seq-mean-token-mean", kl_coef=0.05, kl_kind="k3", entropy_coef=0.01, value_coef=0.5, value_clip=0.2)
    j = lambda x: jnp.asarray(x)
    num, den, m = losses.objective_terms(c, j(logp), j(old), j(adv), j(mask), ref_logp=j(ref), entropy=j(ent),
                                         values=j(v), old_values=j(v_old), returns=j(ret))
    pg = np_aggregate(np_per_token(logp, old, adv, mask, "ppo", 0.2, 0.2, None), mask, "seq-mean-token-mean")
    lq = ref - logp
    kl = np_aggregate(np.exp(lq) - 1 - lq, mask, "seq-mean-token-mean")
    h = np_aggregate(ent, mask, "seq-mean-token-mean")
    vl = np_aggregate(0.5 * np.maximum((v - ret) ** 2, (np.clip(v, v_old - 0.2, v_old + 0.2) - ret) ** 2), mask, "seq-mean-token-mean")
    np.testing.assert_allclose(float(num / den), pg + 0.05 * kl - 0.01 * h + 0.5 * vl, rtol=1e-5)
    np.testing.assert_allclose(float(m["kl_ref"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(m["entropy"]), h, rtol=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        losses.objective_terms(c, j(logp), j(old), j(adv), j(mask), entropy=j(ent), values=j(v), old_values=j(v_old), returns=j(ret))
    with pytest.raises(ValueError, match="entropy"):
        losses.objective_terms(c, j(logp), j(old), j(adv), j(mask), ref_logp=j(ref), values=j(v), old_values=j(v_old), returns=j(ret))
    with pytest.raises(ValueError, match="values"):
        losses.objective_terms(c, j(logp), j(old), j(adv), j(mask), ref_logp=j(ref), entropy=j(ent))


# --------------------------------------------------------------------------------------------
# Degenerate inputs, transformations, dtypes, config handling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGS)
def test_all_masked_batch_gives_zero_and_finite_grads(kind, agg):
    B, T = 3, 4
    logp = jnp.full((B, T), -jnp.inf).at[0, 0].set(-1.0)  # padding may hold -inf
    mask = jnp.zeros((B, T), bool)
    c = pcfg(kind=kind, agg=agg, norm_length=4)
    f = lambda lp: losses.policy_loss(lp, jnp.zeros((B, T)), jnp.ones((B,)), mask, c)[0]
    assert float(f(logp)) == 0.0
    g = jax.grad(f)(logp)
    assert np.all(np.asarray(g) == 0)
    # -inf on padding next to real tokens does not poison the gradient either.
    mask2 = mask.at[0, 0].set(True)
    g2 = jax.grad(lambda lp: losses.policy_loss(lp, jnp.zeros((B, T)) - 1.0, jnp.ones((B,)), mask2, c)[0])(logp)
    assert np.all(np.isfinite(np.asarray(g2)))
    _, metrics = losses.policy_loss(logp, jnp.zeros((B, T)), jnp.ones((B,)), mask, c, behavior_logp=jnp.zeros((B, T)))
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_extreme_log_ratios_are_clamped():
    logp = jnp.array([[0.0, -1e4]])
    old = jnp.array([[-1e4, 0.0]])
    loss, m = losses.policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)), pcfg(kind="cispo"))
    assert np.isfinite(float(loss)) and float(m["ratio_max"]) == pytest.approx(np.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_jit_vmap_and_bfloat16(kind):
    B, T = 4, 6
    logp, old, beh, adv, mask = random_inputs(14, B, T)
    c = pcfg(kind=kind, is_mode="tis")
    f = lambda lp, o, a, m, b: losses.policy_loss(lp, o, a, m, c, behavior_logp=b)[0]
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv)] + [jnp.asarray(mask), jnp.asarray(beh, jnp.float32)]
    eager = float(f(*args))
    np.testing.assert_allclose(float(jax.jit(f)(*args)), eager, rtol=1e-6)
    stacked = [jnp.stack([x, x]) for x in args]
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(*stacked)), [eager, eager], rtol=1e-6)
    bf = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in args]
    out = f(*bf)
    assert out.dtype == jnp.float32
    # bfloat16 inputs: the loss is computed in float32 from the rounded inputs.
    rounded = [np.asarray(x, np.float64) if x.dtype == jnp.bfloat16 else np.asarray(x) for x in bf]
    w = np_is_weights(rounded[1], rounded[4], mask, "tis", "token", 2.0, 0.5, 2.0)
    expected = np_aggregate(np_per_token(rounded[0], rounded[1], rounded[2], mask, kind, 0.2, 0.2, None) * w, mask, "token-mean")
    np.testing.assert_allclose(float(out), expected, rtol=1e-4, atol=1e-6)
    g = jax.grad(lambda lp: f(lp, *bf[1:]))(bf[0])
    assert g.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(g, np.float32)))


def test_config_forms_and_validation():
    logp, old, _, adv, mask = (jnp.asarray(x) for x in random_inputs(15, 3, 5))
    base = losses.policy_loss(logp, old, adv, mask, pcfg(kind="cispo", clip_high=0.3))[0]
    as_dc = losses.policy_loss(logp, old, adv, mask, losses.PolicyLossConfig(kind="cispo", clip_high=0.3))[0]
    from_dict = losses.PolicyLossConfig.from_config({"kind": "cispo", "clip_high": 0.3})
    as_dict = losses.policy_loss(logp, old, adv, mask, from_dict)[0]
    assert float(base) == float(as_dc) == float(as_dict)
    assert dataclasses.is_dataclass(losses.PolicyLossConfig) and losses.PolicyLossConfig.__dataclass_params__.frozen
    # The library takes the typed section only: a dict or a ConfigDict is refused, not read.
    for untyped in ({"kind": "cispo", "clip_high": 0.3}, losses.loss_config(kind="cispo")):
        with pytest.raises(TypeError, match="PolicyLossConfig.from_config"):
            losses.policy_loss(logp, old, adv, mask, untyped)
        with pytest.raises(TypeError, match="ObjectiveConfig.from_config"):
            losses.objective_terms(untyped, logp, old, adv, mask)

    bad = [
        (dict(kind="trpo"), "loss.kind"),
        (dict(agg="mean"), "loss.agg"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(agg="seq-mean-token-sum-norm"), "norm_length"),
        (dict(is_mode="vtrace"), "is_mode"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(is_low=2.0, is_high=1.0), "is_low"),
        (dict(kl_kind="k4"), "kl_kind"),
        (dict(nonsense=1), "unknown loss config field"),
    ]
    for overrides, match in bad:
        with pytest.raises(ValueError, match=match):
            losses.loss_config(**overrides)
    with pytest.raises(ValueError, match="behavior_logp"):
        losses.policy_loss(logp, old, adv, mask, pcfg(is_mode="tis"))
    with pytest.raises(ValueError, match="advantages"):
        losses.policy_loss(logp, old, adv[:2], mask, pcfg())
    with pytest.raises(ValueError, match="mask's shape"):
        losses.policy_loss(logp[:, :3], old, adv, mask, pcfg())


def test_config_dict_overrides_like_the_command_line():
    c = losses.loss_config()
    c.dual_clip = 3.0  # a placeholder field accepts its type
    c.norm_length = 512
    assert c.dual_clip == 3.0 and c.norm_length == 512
    with pytest.raises(TypeError):
        c.clip_high = "wide"
    assert isinstance(c, ml_collections.ConfigDict)
