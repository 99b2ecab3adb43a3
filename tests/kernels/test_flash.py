"""kernels.flash: both faces against a naive float64 numpy oracle, forward (o, lse) and gradients."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _triton
from kernels.flash import flash_attention, flash_attention_reference, flash_attention_triton

TRITON_SKIP = pytest.mark.skipif(
    _triton.available() is not None, reason=f"Triton kernels cannot run here: {_triton.available()}"
)
IMPLS = ["xla", pytest.param("triton", marks=TRITON_SKIP)]
# Small tiles so the interpreted kernels cross several tiles (and pad partial ones) at small shapes.
BLOCK = 16


# ---------------------------------------------------------------------------------------------
# Oracle: the visibility rules written out element by element, dense softmax in float64.
# ---------------------------------------------------------------------------------------------


def oracle_mask(B, T, S, causal, window, q_seg=None, kv_seg=None, is_global=None):
    mask = np.zeros((B, T, S), bool)
    for b in range(B):
        for i in range(T):
            t = i + S - T
            for j in range(S):
                ok = True
                if causal:
                    ok &= j <= t
                if window is not None:
                    ok &= j > t - window
                if q_seg is not None:
                    glob = bool(is_global[b, i]) if is_global is not None else False
                    ok &= kv_seg[b, j] >= 0 and q_seg[b, i] >= 0 and (q_seg[b, i] == kv_seg[b, j] or glob)
                mask[b, i, j] = ok
    return mask


def oracle(q, k, v, mask, scale, do=None, dlse=None):
    """Returns o, lse and, with cotangents do [B,T,N,H] / dlse [B,T,N], (dq, dk, dv)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    K = k.shape[2]
    R = N // K
    kn = np.repeat(k, R, axis=2)  # query head n reads kv head n // R
    vn = np.repeat(v, R, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, kn) * scale
    m4 = mask[:, None]
    s = np.where(m4, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m4, np.exp(s - mx), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1.0)
    o = np.einsum("bnts,bsnh->btnh", p, vn)
    lse = np.where(den[..., 0] > 0, mx[..., 0] + np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)), -np.inf)
    lse = lse.transpose(0, 2, 1)
    if do is None:
        return o, lse
    do = np.asarray(do, np.float64)
    dlse = np.zeros(lse.shape) if dlse is None else np.asarray(dlse, np.float64)
    dv = np.einsum("bnts,btnh->bsnh", p, do)
    dp = np.einsum("btnh,bsnh->bnts", do, vn)
    # d lse / d s = p, so the lse cotangent adds to the softmax-jacobian term.
    ds = p * (dp - np.einsum("btnh,btnh->bnt", do, o)[..., None] + dlse.transpose(0, 2, 1)[..., None])
    dq = np.einsum("bnts,bsnh->btnh", ds, kn) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dk = dk.reshape(B, -1, K, R, H).sum(3)
    dv = dv.reshape(B, -1, K, R, H).sum(3)
    return o, lse, (dq, dk, dv)


def squid_segments(doc_lens, n_global, n_pad):
    """REFERENCE section 8 packing: documents 0..m-1, then the global segment m, then padding -1."""
    seg = np.concatenate(
        [np.full(n, d, np.int32) for d, n in enumerate(doc_lens)]
        + [np.full(n_global, len(doc_lens), np.int32), np.full(n_pad, -1, np.int32)]
    )
    return seg, seg == len(doc_lens)


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


def run_face(impl, q, k, v, **kw):
    if impl == "xla":
        # Small chunks so the chunked / key-sliced paths are exercised at test sizes.
        return flash_attention_reference(q, k, v, return_lse=True, chunk_size=BLOCK, **kw)
    return flash_attention_triton(q, k, v, return_lse=True, block_m=BLOCK, block_n=BLOCK, **kw)


def make_inputs(seed, B, T, S, N, K, H, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, H)).astype(dtype)
    do = rng.standard_normal((B, T, N, H)).astype(np.float32)
    dlse = rng.standard_normal((B, T, N)).astype(np.float32)
    return q, k, v, do, dlse


def fwd_and_grads(impl, q, k, v, do, dlse, **kw):
    """o, lse and the vjp (dq, dk, dv) for cotangents (do, dlse), traced and compiled once."""

    @jax.jit
    def run(q, k, v, do, dlse):
        (o, lse), vjp = jax.vjp(functools.partial(run_face, impl, **kw), q, k, v)
        return o, lse, vjp((do.astype(o.dtype), dlse))

    return run(*(jnp.asarray(x) for x in (q, k, v, do, dlse)))


def check_against_oracle(
    impl, q, k, v, do, dlse, *, causal=True, window=None, segs=None, scale=None, tol=2e-5, grads=True
):
    B, T, N, H = q.shape
    S = k.shape[1]
    q_seg, kv_seg, glob = segs if segs is not None else (None, None, None)
    seg_kw = {}
    if segs is not None:
        seg_kw = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
        if glob is not None:
            seg_kw["is_global"] = jnp.asarray(glob)
    mask = oracle_mask(B, T, S, causal, window, q_seg, kv_seg, glob)
    eff_scale = H**-0.5 if scale is None else scale
    want_o, want_lse, want_grads = oracle(q, k, v, mask, eff_scale, do, dlse)

    kw = dict(causal=causal, window=window, scale=scale, **seg_kw)
    if grads:
        o, lse, got_grads = fwd_and_grads(impl, q, k, v, do, dlse, **kw)
    else:
        o, lse = jax.jit(functools.partial(run_face, impl, **kw))(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, T, N) and lse.dtype == jnp.float32
    o, lse = np.asarray(o, np.float64), np.asarray(lse)
    np.testing.assert_allclose(o, want_o, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=tol, atol=tol)
    if not grads:
        return
    # dlse is random also on empty rows (lse = -inf): it must not leak into any gradient.
    for name, got, want in zip(("dq", "dk", "dv"), got_grads, want_grads):
        got = np.asarray(got, np.float64)
        assert np.all(np.isfinite(got)), f"{name} has non-finite entries"
        np.testing.assert_allclose(got, want, rtol=5 * tol, atol=5 * tol, err_msg=name)


# (name, B, T, S, N, K, H, causal, window). With 16-row tiles, windows 18 (T = S) and 3 (S - T = 33)
# put the last query a key tile can reach exactly at the start of a query tile, so an off-by-one
# in the dK/dV loop bounds skips a tile.
DENSE_CASES = [
    ("causal", 2, 37, 37, 4, 2, 16, True, None),
    ("causal_window_small", 1, 37, 37, 2, 1, 16, True, 5),
    ("causal_window_tile_edge", 1, 37, 37, 2, 1, 16, True, 18),
    ("causal_window_larger_than_T", 1, 20, 53, 2, 2, 16, True, 60),
    ("noncausal", 1, 37, 37, 2, 2, 16, False, None),
    ("t_less_than_s", 2, 20, 53, 4, 2, 16, True, None),
    ("t_less_than_s_window", 1, 20, 53, 4, 1, 16, True, 3),
    ("gqa_k1_h32", 1, 20, 53, 4, 1, 32, True, None),
    ("block_multiple", 1, 32, 64, 2, 1, 16, True, 16),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_matches_oracle(impl, case):
    _, B, T, S, N, K, H, causal, window = case
    q, k, v, do, dlse = make_inputs(sum(map(ord, case[0])), B, T, S, N, K, H)
    check_against_oracle(impl, q, k, v, do, dlse, causal=causal, window=window)


@pytest.mark.parametrize("impl", IMPLS)
def test_squid_segments_with_padding_and_global(impl):
    """Self-attention over a packed sequence: documents of different lengths, then a global segment
    that sees every document, then padding; the two batch rows pack differently."""
    seg0, glob0 = squid_segments([10, 7, 13], n_global=9, n_pad=3)
    seg1, glob1 = squid_segments([3, 20], n_global=12, n_pad=7)
    q_seg, glob = np.stack([seg0, seg1]), np.stack([glob0, glob1])
    B, T = q_seg.shape
    q, k, v, do, dlse = make_inputs(1, B, T, T, 4, 2, 16)
    check_against_oracle(impl, q, k, v, do, dlse, causal=True, segs=(q_seg, q_seg, glob))


@pytest.mark.parametrize("impl", IMPLS)
def test_squid_global_queries_over_cached_documents(impl):
    """Only the global segment is queried (T < S): its queries are the last T keys."""
    kv_seg, _ = squid_segments([11, 6, 9], n_global=14, n_pad=0)
    kv_seg = kv_seg[None]
    T = 14
    q_seg = kv_seg[:, -T:]
    glob = np.ones_like(q_seg, bool)
    q, k, v, do, dlse = make_inputs(2, 1, T, kv_seg.shape[1], 2, 1, 16)
    check_against_oracle(impl, q, k, v, do, dlse, causal=True, segs=(q_seg, kv_seg, glob))


# Packings that put segment edges one off 16-row tile edges, so an off-by-one in any segment bound
# skips a tile: doc 1 = rows 15..30 (its first row and key sit just before a tile start); doc 1 =
# rows 15..16 (the first query tile's last key is 16) and the global rows end at 48.
BIDIRECTIONAL_PACKINGS = [([15, 16, 9], 6, 2), ([15, 2, 14], 18, 2)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("packing", BIDIRECTIONAL_PACKINGS, ids=["starts", "ends"])
def test_bidirectional_documents(impl, packing):
    """Non-causal segments: only the segment bounds limit the tiles the kernels visit."""
    seg, glob = squid_segments(*packing)
    seg, glob = seg[None], glob[None]
    q, k, v, do, dlse = make_inputs(10, 1, seg.shape[1], seg.shape[1], 2, 1, 16)
    check_against_oracle(impl, q, k, v, do, dlse, causal=False, segs=(seg, seg, glob))


@pytest.mark.parametrize("impl", IMPLS)
def test_segments_without_global_and_with_window(impl):
    """Interleaved (non-contiguous) segment ids, a window and no is_global."""
    rng = np.random.default_rng(3)
    T = 29
    seg = rng.integers(-1, 3, size=(1, T)).astype(np.int32)
    q, k, v, do, dlse = make_inputs(3, 1, T, T, 2, 2, 16)
    check_against_oracle(impl, q, k, v, do, dlse, causal=True, window=6, segs=(seg, seg, None), scale=0.3)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_visible_keys(impl):
    """T > S with causal: the first queries precede every key; a padded query (-1) sees nothing."""
    B, T, S, N, K, H = 1, 21, 13, 2, 1, 16
    q, k, v, do, dlse = make_inputs(4, B, T, S, N, K, H)
    o, lse, (dq, dk, dv) = fwd_and_grads(impl, q, k, v, do, dlse, causal=True)
    empty = T - S  # queries 0 .. T-S-1 sit at negative positions
    assert np.all(np.asarray(o)[:, :empty] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :empty]))
    assert np.all(np.isfinite(np.asarray(lse)[:, empty:]))
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[:, :empty] == 0)
    check_against_oracle(impl, q, k, v, do, dlse, causal=True)

    # A query whose segment id is padding sees nothing, even as a global query.
    seg = np.zeros((1, S), np.int32)
    seg[0, 4] = -1
    glob = np.zeros((1, S), bool)
    glob[0, 4] = True
    q, k, v, do, dlse = make_inputs(5, 1, S, S, N, K, H)
    o, lse, (dq, dk, dv) = fwd_and_grads(
        impl, q, k, v, do, dlse, causal=True, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg),
        is_global=jnp.asarray(glob),
    )
    assert np.all(np.asarray(o)[0, 4] == 0) and np.all(np.isneginf(np.asarray(lse)[0, 4]))
    assert np.all(np.asarray(dq)[0, 4] == 0)
    # Key 4 is padding, so nothing flows into it either.
    assert np.all(np.asarray(dk)[0, 4] == 0) and np.all(np.asarray(dv)[0, 4] == 0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("layout", ["squid", "interleaved"])
def test_segment_tile_bounds_are_the_visibility_envelope(layout):
    """The per-tile [lo, hi) bounds the kernels loop over are exactly the envelope of what the
    tile's rows can see under the segment rules, so no visible pair is skipped and, with contiguous
    documents, no fully masked tile is visited."""
    from kernels.flash import _segment_tile_bounds

    if layout == "squid":
        seg0, glob0 = squid_segments([10, 7, 13], n_global=9, n_pad=3)
        seg1, glob1 = squid_segments([3, 20], n_global=12, n_pad=7)
        q_seg, glob = np.stack([seg0, seg1]), np.stack([glob0, glob1])
        kv_seg = q_seg
    else:
        rng = np.random.default_rng(9)
        kv_seg = rng.integers(-1, 4, size=(2, 53)).astype(np.int32)
        q_seg = kv_seg[:, -37:]
        glob = rng.random((2, 37)) < 0.1
    B, T = q_seg.shape
    S = kv_seg.shape[1]
    bm, bn = 16, 8
    bounds = jax.jit(_segment_tile_bounds, static_argnums=(3, 4))
    kv_lo, kv_hi, q_lo, q_hi = (
        np.asarray(x) for x in bounds(jnp.asarray(q_seg), jnp.asarray(kv_seg), jnp.asarray(glob), bm, bn)
    )
    visible = oracle_mask(B, T, S, False, None, q_seg, kv_seg, glob)
    for b in range(B):
        for tile in range(-(-T // bm)):
            rows = visible[b, tile * bm : (tile + 1) * bm]
            cols = np.nonzero(rows.any(0))[0]
            if cols.size:
                assert (kv_lo[b, tile], kv_hi[b, tile]) == (cols.min(), cols.max() + 1)
            else:
                assert kv_hi[b, tile] <= kv_lo[b, tile]
        for tile in range(-(-S // bn)):
            cols = visible[b, :, tile * bn : (tile + 1) * bn]
            rows = np.nonzero(cols.any(1))[0]
            if rows.size:
                assert (q_lo[b, tile], q_hi[b, tile]) == (rows.min(), rows.max() + 1)
            else:
                assert q_hi[b, tile] <= q_lo[b, tile]


@TRITON_SKIP
def test_triton_float16_forward():
    B, T, S, N, K, H = 1, 37, 37, 2, 1, 16
    q, k, v, do, dlse = make_inputs(6, B, T, S, N, K, H, dtype=np.float16)
    check_against_oracle("triton", q, k, v, do, dlse, causal=True, window=11, tol=2e-2, grads=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_dispatcher_and_jit(impl):
    """flash_attention(impl=...) with default blocks / chunks, under jit, equals the oracle."""
    B, T, S, N, K, H = 1, 20, 53, 4, 2, 16
    q, k, v, _, _ = make_inputs(7, B, T, S, N, K, H)
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, window=25, impl=impl))
    o = np.asarray(f(q, k, v))
    want, _ = oracle(q, k, v, oracle_mask(B, T, S, True, 25), H**-0.5)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)
    o_only = flash_attention(q, k, v, impl=impl)
    assert o_only.shape == q.shape


def _max_intermediate_size(jaxpr):
    """Largest number of elements of any value produced inside a jaxpr, sub-jaxprs included."""
    best = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            best = max(best, int(np.prod(getattr(var.aval, "shape", ()) or (1,))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            best = max(best, _max_intermediate_size(sub))
    return best


def test_reference_window_is_linear_in_t():
    """T = 2048 with a window: every intermediate of the forward and the backward is far below
    [T, S] (a chunk against all keys, chunk * T, would already fail the bound), and sampled rows
    match the oracle."""
    B, T, N, K, H, w = 1, 2048, 2, 1, 16, 64
    q, k, v, _, _ = make_inputs(8, B, T, T, N, K, H)

    def loss(q, k, v):
        o, lse = flash_attention(q, k, v, causal=True, window=w, impl="xla", return_lse=True)
        return jnp.sum(o * o) + jnp.sum(lse)

    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
        biggest = _max_intermediate_size(jax.make_jaxpr(fn)(q, k, v).jaxpr)
        assert biggest < T * T // 16, f"an intermediate of {biggest} elements (T*T = {T * T})"

    attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, window=w, impl="xla", return_lse=True))
    o, lse = attend(q, k, v)
    rows = np.array([0, 1, 63, 64, 500, 1337, 2047])
    mask = np.zeros((B, len(rows), T), bool)
    for r, i in enumerate(rows):
        mask[0, r, max(0, i - w + 1) : i + 1] = True
    # The sampled rows go to the oracle as queries with their mask written out directly.
    want_o, want_lse = oracle(q[:, rows], k, v, mask, H**-0.5)
    np.testing.assert_allclose(np.asarray(o)[:, rows], want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:, rows], want_lse, rtol=2e-5, atol=2e-5)


def _bad_calls():
    q = jnp.zeros((1, 8, 4, 16))
    k = jnp.zeros((1, 8, 2, 16))
    seg = jnp.zeros((1, 8), jnp.int32)
    glob = jnp.zeros((1, 8), bool)
    segs = dict(q_segment_ids=seg, kv_segment_ids=seg)
    return [
        ("rank", lambda: flash_attention(q[0], k, k)),
        ("same shape", lambda: flash_attention(q, k, k[..., :8])),
        ("batch", lambda: flash_attention(q, jnp.zeros((2, 8, 2, 16)), jnp.zeros((2, 8, 2, 16)))),
        ("head dim", lambda: flash_attention(q, k[..., :8], k[..., :8])),
        ("multiple", lambda: flash_attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)))),
        ("together", lambda: flash_attention(q, k, k, q_segment_ids=seg)),
        ("together", lambda: flash_attention(q, k, k, kv_segment_ids=seg)),
        ("is_global needs", lambda: flash_attention(q, k, k, is_global=glob)),
        ("is_global must have shape", lambda: flash_attention(q, k, k, **segs, is_global=glob[:, :4])),
        ("bool", lambda: flash_attention(q, k, k, **segs, is_global=seg)),
        ("kv_segment_ids must have shape", lambda: flash_attention(q, k, k, **dict(segs, kv_segment_ids=seg[:, :5]))),
        ("integer", lambda: flash_attention(q, k, k, q_segment_ids=seg.astype(jnp.float32), kv_segment_ids=seg)),
        ("window must be positive", lambda: flash_attention(q, k, k, window=0)),
        ("window must be a positive int", lambda: flash_attention(q, k, k, window=2.5)),
        ("impl must be", lambda: flash_attention(q, k, k, impl="cuda")),
    ]


@pytest.mark.parametrize("match,call", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments_raise(match, call):
    with pytest.raises(ValueError, match=match):
        call()
