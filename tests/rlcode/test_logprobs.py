"""rlcode.models.logprobs against float64 numpy oracles of the sampling rules, values and gradients.

The oracles are written from the docstrings' rules, not from the implementation: the support
uses "mass strictly more probable than v < top_p" (the implementation sorts and scans a cumulative
sum), and gradients are the closed-form derivatives of log-softmax and entropy, themselves checked
against central finite differences.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlcode import losses
from rlcode.models import logprobs as lp_lib

# --------------------------------------------------------------------------------------------
# Oracles (float64 numpy)
# --------------------------------------------------------------------------------------------


def np_support(x, top_k=None, top_p=None):
    """Boolean support of the sampler's rules on tempered logits x [R, V], row by row."""
    keep = np.ones(x.shape, bool)
    for r, row in enumerate(x):
        if top_k:
            kth = sorted(row, reverse=True)[min(top_k, len(row)) - 1]
            keep[r] = row >= kth
        if top_p is not None and top_p < 1:
            p = np.where(keep[r], np.exp(row - row[keep[r]].max()), 0.0)
            p /= p.sum()
            for v in np.flatnonzero(keep[r]):
                keep[r, v] = p[row > row[v]].sum() < top_p
    return keep


def top_p_margin(x, top_k, top_p):
    """Distance of top_p from the nearest 'mass strictly above v' (float32 cannot decide closer)."""
    keep = np_support(x, top_k, None)
    margins = [1.0]
    for r, row in enumerate(x):
        p = np.where(keep[r], np.exp(row - row[keep[r]].max()), 0.0)
        p /= p.sum()
        above = [p[row > row[v]].sum() for v in np.flatnonzero(keep[r])]
        margins += [abs(m - top_p) for m in above if m > 0]  # the argmax's 0 < top_p is exact
    return min(margins)


def np_logsumexp(x):
    top = x.max(-1, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[..., 0]


def np_reference(h_nd, w_dv, tok_n, g_n, e_n, tau=1.0, top_k=None, top_p=None):
    """(logp, entropy, d hidden, d unembed) of L = sum g*logp + sum e*entropy, all float64.

    q = softmax over the support S of x = h W / tau; log q_v = x_v - lse; H = -sum_S q log q;
    dL/dx_v = g ([v = token][token in S] - q_v) - e q_v (log q_v + H) on S, 0 off S.
    """
    x = (h_nd @ w_dv) / tau
    keep = np_support(x, top_k, top_p)
    xm = np.where(keep, x, -np.inf)
    logq = xm - np_logsumexp(xm)[:, None]
    q = np.exp(logq)
    rows = np.arange(len(tok_n))
    logp = logq[rows, tok_n]
    logq0 = np.where(keep, logq, 0.0)
    ent = -(q * logq0).sum(-1)
    onehot = np.zeros_like(x)
    onehot[rows, tok_n] = keep[rows, tok_n]
    dx = g_n[:, None] * (onehot - q) - e_n[:, None] * q * (logq0 + ent[:, None])
    dlogits = dx / tau
    return logp, ent, dlogits @ w_dv.T, h_nd.T @ dlogits


def close(actual, expected, tol):
    actual = np.asarray(actual, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def make_inputs(seed, B, T, D, V, scale=2.0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D))
    w = rng.normal(size=(D, V)) * scale / np.sqrt(D)
    tok = rng.integers(0, V, size=(B, T))
    g = rng.normal(size=(B, T))
    e = rng.normal(size=(B, T))
    return h, w, tok, g, e


def run_vjp(fn, h, w, tok, g, e, *, layout, return_entropy, **kw):
    """Outputs and (d hidden, d unembed) of fn under cotangents g (logp) and e (entropy), jitted."""

    @jax.jit
    def outputs_and_grads(h_, w_, tok_, g_, e_):
        def f(hh, ww):
            out = fn(hh, ww, tok_, return_entropy=return_entropy, unembed_layout=layout, **kw)
            return out if return_entropy else (out,)

        out, vjp = jax.vjp(f, h_, w_)
        return out, vjp((g_, e_) if return_entropy else (g_,))

    out, (dh, dw) = outputs_and_grads(h, w if layout == "dv" else w.T, tok, g, e)
    return out, dh, (dw if layout == "dv" else dw.T)


# --------------------------------------------------------------------------------------------
# The oracle itself
# --------------------------------------------------------------------------------------------


def test_oracle_gradient_matches_finite_differences():
    h, w, tok, g, e = make_inputs(0, 1, 4, 3, 7)
    h, tok, g, e = h[0], tok[0], g[0], e[0]
    for tau, top_k, top_p in [(1.0, None, None), (0.7, 5, None), (0.7, None, 0.8)]:
        x = h @ w / tau
        tok_in = np.array([row.argmax() for row in x])  # in the support, away from its edge

        def objective(h_, w_):
            logp, ent, _, _ = np_reference(h_, w_, tok_in, g, e, tau, top_k, top_p)
            return (g * logp).sum() + (e * ent).sum()

        _, _, dh, dw = np_reference(h, w, tok_in, g, e, tau, top_k, top_p)
        eps = 1e-6
        for arr, grad in ((h, dh), (w, dw)):
            fd = np.zeros_like(arr)
            for idx in np.ndindex(arr.shape):
                plus, minus = arr.copy(), arr.copy()
                plus[idx] += eps
                minus[idx] -= eps
                args_p = (plus, w) if arr is h else (h, plus)
                args_m = (minus, w) if arr is h else (h, minus)
                fd[idx] = (objective(*args_p) - objective(*args_m)) / (2 * eps)
            np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# token_logprobs: values and gradients
# --------------------------------------------------------------------------------------------

# (B, T, D, V, chunk_size, layout, temperature, top_k, top_p, return_entropy)
CASES = [
    (2, 5, 8, 33, 4, "dv", 1.0, None, None, True),  # B*T = 10, not a chunk multiple
    (2, 5, 8, 33, 4, "vd", 0.7, None, None, False),
    (1, 7, 16, 50, 64, "dv", 0.7, None, None, True),  # chunk larger than B*T
    (3, 8, 8, 64, 8, "vd", 1.0, None, None, True),  # exact multiple
    (1, 1, 4, 9, 3, "dv", 1.0, None, None, True),  # a single token
    (2, 6, 8, 40, 5, "dv", 0.7, 6, None, True),
    (2, 6, 8, 40, 5, "vd", 1.0, None, 0.75, True),
    (2, 6, 8, 40, 16, "dv", 0.7, 10, 0.8, True),
    (2, 6, 8, 40, 7, "vd", 0.7, 1, None, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_token_logprobs_matches_oracle(case):
    B, T, D, V, chunk, layout, tau, top_k, top_p, with_ent = case
    h, w, tok, g, e = make_inputs(sum(case[:5]), B, T, D, V)
    x = h.reshape(-1, D) @ w / tau
    if top_p is not None:
        assert top_p_margin(x, top_k, top_p) > 1e-4, "test data too close to the top_p boundary"
    if top_k or top_p:
        # Mostly in-support tokens (their log-probs are finite), plus a few outside it.
        keep = np_support(x, top_k, top_p)
        rng = np.random.default_rng(1)
        flat = np.array([rng.choice(np.flatnonzero(k)) for k in keep])
        flat[::5] = tok.reshape(-1)[::5]
        tok = flat.reshape(B, T)
    ref_logp, ref_ent, ref_dh, ref_dw = np_reference(
        h.reshape(-1, D), w, tok.reshape(-1), g.reshape(-1), e.reshape(-1) * with_ent, tau, top_k, top_p
    )
    kw = dict(temperature=tau, top_k=top_k, top_p=top_p)
    args = (jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(tok), jnp.asarray(g, jnp.float32))
    for fn, extra in ((lp_lib.token_logprobs, dict(chunk_size=chunk)), (lp_lib.naive_token_logprobs, {})):
        out, dh, dw = run_vjp(fn, *args, jnp.asarray(e, jnp.float32), layout=layout, return_entropy=with_ent, **kw, **extra)
        logp = np.asarray(out[0]).reshape(-1)
        assert out[0].dtype == jnp.float32 and out[0].shape == (B, T)
        finite = np.isfinite(ref_logp)
        np.testing.assert_array_equal(np.isfinite(logp), finite)
        assert np.all(logp[~finite] == -np.inf)
        close(logp[finite], ref_logp[finite], 2e-5)
        if with_ent:
            close(np.asarray(out[1]).reshape(-1), ref_ent, 2e-5)
        close(dh, ref_dh.reshape(B, T, D), 2e-5)
        close(dw, ref_dw, 2e-5)


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_bfloat16_inputs(layout):
    B, T, D, V = 2, 9, 16, 48
    h, w, tok, g, e = make_inputs(7, B, T, D, V)
    h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    h_exact, w_exact = np.asarray(h16, np.float64), np.asarray(w16, np.float64)
    ref_logp, ref_ent, ref_dh, ref_dw = np_reference(
        h_exact.reshape(-1, D), w_exact, tok.reshape(-1), g.reshape(-1), e.reshape(-1), 0.7
    )
    for fn, extra in ((lp_lib.token_logprobs, dict(chunk_size=4)), (lp_lib.naive_token_logprobs, {})):
        (logp, ent), dh, dw = run_vjp(
            fn, h16, w16, jnp.asarray(tok), jnp.asarray(g, jnp.float32), jnp.asarray(e, jnp.float32),
            layout=layout, return_entropy=True, temperature=0.7, **extra,
        )
        assert logp.dtype == ent.dtype == jnp.float32
        assert dh.dtype == dw.dtype == jnp.bfloat16
        # Logits of bfloat16 inputs are float32-accumulated: values are float32-accurate.
        close(np.asarray(logp).reshape(-1), ref_logp, 2e-5)
        close(np.asarray(ent).reshape(-1), ref_ent, 2e-5)
        # Gradients are computed in float32 and rounded once to bfloat16 (8 mantissa bits).
        close(dh, ref_dh.reshape(B, T, D), 1e-2)
        close(dw, ref_dw, 1e-2)


def test_chunked_equals_naive_and_losses_helpers_without_support_mask():
    h, w, tok, _, _ = make_inputs(3, 3, 11, 8, 37)
    h, w, tok = jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(tok)

    @jax.jit
    def both(h, w, tok):
        logits = jnp.einsum("btd,dv->btv", h, w)
        return [
            (
                lp_lib.token_logprobs(h, w, tok, temperature=tau, chunk_size=8, return_entropy=True),
                (losses.logprobs_from_logits(logits, tok, tau), losses.entropy_from_logits(logits, tau)),
            )
            for tau in (1.0, 0.7)
        ]

    for chunked, expected in both(h, w, tok):
        for actual, want in zip(chunked, expected):
            close(actual, np.asarray(want, np.float64), 2e-6)


def test_support_masked_logprobs_normalised_and_minus_inf_outside():
    """Log-probs of every vocabulary token: -inf exactly off the support, probabilities sum to 1."""
    R, D, V = 4, 8, 30
    h, w, _, _, _ = make_inputs(11, 1, R, D, V, scale=3.0)
    hidden = jnp.asarray(np.repeat(h[0][:, None, :], V, axis=1), jnp.float32)  # [R, V, D]
    tokens = jnp.broadcast_to(jnp.arange(V), (R, V))
    w32 = jnp.asarray(w, jnp.float32)
    options = [(1.0, 5, None), (0.7, None, 0.6), (1.3, 12, 0.9), (1.0, 1, None)]

    @jax.jit
    def all_options(hidden, w32, tokens):
        return [
            (
                lp_lib.token_logprobs(hidden, w32, tokens, temperature=tau, top_k=k, top_p=p, chunk_size=16),
                lp_lib.process_logits(hidden[:, 0] @ w32, tau, k, p),
            )
            for tau, k, p in options
        ]

    for (tau, top_k, top_p), (logp, processed) in zip(options, all_options(hidden, w32, tokens)):
        logp = np.asarray(logp)
        support = np.isfinite(np.asarray(processed))
        np.testing.assert_array_equal(np.isfinite(logp), support)
        assert np.all(logp[~support] == -np.inf)
        np.testing.assert_allclose(np.exp(np.where(support, logp, -np.inf)).sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_array_equal(support, np_support(h[0] @ w / tau, top_k, top_p))


# --------------------------------------------------------------------------------------------
# process_logits: the sampler's rules
# --------------------------------------------------------------------------------------------


def support_of(logits, **kw):
    return np.isfinite(np.asarray(lp_lib.process_logits(jnp.asarray(logits, jnp.float32), **kw)))


@pytest.mark.parametrize(
    "tau,top_k,top_p",
    [
        (1.0, None, None),
        (0.7, 5, None),
        (1.0, 1, None),
        (1.0, 0, None),  # 0 is off
        (1.0, 100, None),  # k >= V is off
        (1.0, None, 0.9),
        (0.5, None, 0.5),
        (1.5, 8, 0.75),
        (1.0, None, 1e-9),  # only the argmax
        (1.0, None, 1.0),  # off
    ],
)
def test_process_logits_matches_oracle(tau, top_k, top_p):
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 40)) * 2.5
    x = logits.astype(np.float32).astype(np.float64) / tau
    if top_p is not None and top_p < 1:
        assert top_p_margin(x, top_k, top_p) > 1e-4
    out = np.asarray(lp_lib.process_logits(jnp.asarray(logits, jnp.float32), tau, top_k, top_p))
    keep = np_support(x, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(out), keep)
    np.testing.assert_allclose(out[keep], x[keep], rtol=1e-6)
    assert out.dtype == np.float32
    if top_p == 1e-9 or top_k == 1:
        np.testing.assert_array_equal(keep, x == x.max(-1, keepdims=True))
    if top_k in (None, 0, 100) and top_p in (None, 1.0):
        assert keep.all()


def test_process_logits_ties_are_kept_and_order_free():
    row = np.array([3.0, 1.0, 3.0, 0.0, 1.0, 1.0, -2.0])
    assert support_of(row, top_k=1).tolist() == [1, 0, 1, 0, 0, 0, 0]
    assert support_of(row, top_k=2).tolist() == [1, 0, 1, 0, 0, 0, 0]
    assert support_of(row, top_k=3).tolist() == [1, 1, 1, 0, 1, 1, 0]  # 5 tokens: ties at the k-th
    assert support_of(row, top_p=1e-6).tolist() == [1, 0, 1, 0, 0, 0, 0]
    # Both 3s hold ~0.79 of the mass: a top_p just above one of them still keeps the pair.
    assert support_of(row, top_p=0.5).tolist() == [1, 0, 1, 0, 0, 0, 0]
    # Crossing inside the tied 1s keeps all three 1s.
    assert support_of(row, top_p=0.85).tolist() == [1, 1, 1, 0, 1, 1, 0]
    perm = np.random.default_rng(0).permutation(len(row))
    for kw in (dict(top_k=3), dict(top_p=0.85), dict(top_k=4, top_p=0.8), dict(top_p=0.97)):
        np.testing.assert_array_equal(support_of(row[perm], **kw), support_of(row, **kw)[perm])
        np.testing.assert_array_equal(support_of(row, **kw), np_support(row[None], **kw)[0])


def test_process_logits_top_p_keeps_the_crossing_token_after_top_k_and_temperature():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert support_of(logits, top_p=0.35).tolist() == [1, 0, 0, 0]
    assert support_of(logits, top_p=0.45).tolist() == [1, 1, 0, 0]  # 0.4 < 0.45 <= 0.7
    assert support_of(logits, top_p=0.75).tolist() == [1, 1, 1, 0]
    assert support_of(logits, top_p=0.95).tolist() == [1, 1, 1, 1]
    # top_k first, then top_p on the renormalised top-2 distribution (4/7, 3/7).
    assert support_of(logits, top_k=2, top_p=0.5).tolist() == [1, 0, 0, 0]
    assert support_of(logits, top_k=2, top_p=0.6).tolist() == [1, 1, 0, 0]
    # top_p applies to the tempered distribution: at tau = 0.3 the first token holds 0.71.
    assert support_of(logits, temperature=0.3, top_p=0.6).tolist() == [1, 0, 0, 0]
    assert support_of(logits, temperature=3.0, top_p=0.6).tolist() == [1, 1, 1, 0]


def test_process_logits_is_jittable_with_static_options_and_batched():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 50)), jnp.bfloat16)
    fn = jax.jit(lp_lib.process_logits, static_argnames=("temperature", "top_k", "top_p"))
    out = fn(logits, temperature=0.8, top_k=7, top_p=0.9)
    eager = lp_lib.process_logits(logits, 0.8, 7, 0.9)
    assert out.shape == (2, 3, 50) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eager))
    x = np.asarray(logits.astype(jnp.float32), np.float64).reshape(6, 50) / 0.8
    np.testing.assert_array_equal(np.isfinite(np.asarray(out)).reshape(6, 50), np_support(x, 7, 0.9))


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=0.0), dict(temperature=-1.0), dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5)],
)
def test_process_logits_rejects_bad_options(kw):
    with pytest.raises(ValueError):
        lp_lib.process_logits(jnp.zeros((2, 5)), **kw)


def test_token_logprobs_rejects_bad_inputs():
    h, w, tok = jnp.zeros((2, 3, 4)), jnp.zeros((4, 10)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="unembed_layout"):
        lp_lib.token_logprobs(h, w, tok, unembed_layout="vv")
    with pytest.raises(ValueError, match="does not match"):
        lp_lib.token_logprobs(h, w, tok, unembed_layout="vd")
    with pytest.raises(ValueError, match="integer"):
        lp_lib.token_logprobs(h, w, tok.astype(jnp.float32))
    with pytest.raises(ValueError, match="chunk_size"):
        lp_lib.token_logprobs(h, w, tok, chunk_size=0)
    with pytest.raises(AssertionError):
        lp_lib.token_logprobs(h, w, tok[:, :2])


# --------------------------------------------------------------------------------------------
# Memory: no [B*T, V] float32 tensor, forward or backward
# --------------------------------------------------------------------------------------------


def compiled_temp_bytes(fn, B, T, D, V, **kw):
    def objective(h, w, tok):
        logp, ent = fn(h, w, tok, return_entropy=True, **kw)
        return jnp.mean(jnp.where(jnp.isfinite(logp), logp, 0.0)) + 0.01 * jnp.mean(ent)

    shapes = (
        jax.ShapeDtypeStruct((B, T, D), jnp.float32),
        jax.ShapeDtypeStruct((D, V), jnp.float32),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
    )
    compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_is_chunk_sized():
    B, T, D, V, chunk = 4, 1024, 64, 8192, 512
    logits_bytes = B * T * V * 4
    chunk_bytes = chunk * V * 4
    naive = compiled_temp_bytes(lp_lib.naive_token_logprobs, B, T, D, V)
    chunked = compiled_temp_bytes(lp_lib.token_logprobs, B, T, D, V, chunk_size=chunk)
    # The float32 d(unembed) accumulator is D*V*4 bytes; everything else is O(chunk * V).
    assert naive > logits_bytes
    assert chunked < 2 * chunk_bytes + D * V * 4
    assert chunked < logits_bytes / 4
    # top_p sorts inside each chunk: a few more [C, V] buffers, still far below one [B*T, V].
    masked = compiled_temp_bytes(lp_lib.token_logprobs, B, T, D, V, chunk_size=chunk, top_k=64, top_p=0.9)
    assert masked < 6 * chunk_bytes
    assert masked < logits_bytes / 2
