"""Squid attention against a dense float64 oracle built from docs/reference.md §8, both faces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _triton, squid

TRITON_REASON = _triton.available()


def squid_mask(seg, glob):
    """[T, T] visibility from the definition: causal, padding nowhere, documents alone, global sees all."""
    T = len(seg)
    vis = np.zeros((T, T), bool)
    for i in range(T):
        for j in range(i + 1):
            if seg[i] < 0 or seg[j] < 0:
                continue
            vis[i, j] = glob[i] or seg[i] == seg[j]
    return vis


def dense_oracle(q, k, v, vis, scale):
    """float64 masked softmax attention per row and head; rows with no visible key give 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            s = q[b, :, n] @ k[b, :, n // (N // K)].T * scale
            s = np.where(vis[b], s, -np.inf)
            m = np.max(s, axis=1, keepdims=True)
            p = np.where(vis[b], np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
            den = p.sum(1, keepdims=True)
            out[b, :, n] = np.where(den > 0, p @ v[b, :, n // (N // K)] / np.where(den > 0, den, 1), 0.0)
    return out


def packed_layout(doc_lens, global_len, pad, B=1):
    seg, glob = [], []
    for d, L in enumerate(doc_lens):
        seg += [d] * L
        glob += [False] * L
    seg += [len(doc_lens)] * global_len + [-1] * pad
    glob += [True] * global_len + [False] * pad
    return np.tile(np.array(seg, np.int32), (B, 1)), np.tile(np.array(glob, bool), (B, 1))


def random_qkv(rng, B, T, N, K, H, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]


LAYOUTS = [
    # doc lengths, global length, trailing padding, block, N, K
    ((5, 9, 3), 6, 2, 4, 4, 2),
    ((16, 16), 8, 0, 8, 2, 1),
    ((7,), 30, 3, 16, 4, 1),
    ((11, 1, 20), 0, 0, 8, 2, 2),
    ((), 13, 4, 4, 4, 2),
]


def _run(impl, q, k, v, seg, glob, block):
    if impl == "xla":
        return squid.squid_attention_reference(q, k, v, seg, glob, block=block)
    return squid.squid_attention_triton(q, k, v, seg, glob, block_m=16, block_n=16)


IMPLS = ["xla", pytest.param("triton", marks=pytest.mark.skipif(TRITON_REASON is not None, reason=f"{TRITON_REASON}"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_forward_and_gradients_match_dense_oracle(impl, layout):
    doc_lens, glen, pad, block, N, K = layout
    rng = np.random.default_rng(sum(doc_lens) * 31 + glen + N)
    seg, glob = packed_layout(doc_lens, glen, pad, B=2)
    # Row 1 has its documents in the other order: segments of different lengths per row.
    if len(doc_lens) > 1:
        seg1, glob1 = packed_layout(doc_lens[::-1], glen, pad)
        seg[1], glob[1] = seg1[0], glob1[0]
    T = seg.shape[1]
    H = 16
    q, k, v = random_qkv(rng, 2, T, N, K, H)
    vis = np.stack([squid_mask(seg[b], glob[b]) for b in range(2)])
    scale = H**-0.5
    want = dense_oracle(q, k, v, vis, scale)
    do = rng.standard_normal(q.shape).astype(np.float32)

    @jax.jit  # one compiled forward and backward (eagerly, each operation compiles on its own)
    def forward_and_grads(a, b, c):
        out, vjp = jax.vjp(lambda a, b, c: _run(impl, a, b, c, seg, glob, block), a, b, c)
        return out, vjp(do)

    got, grads = forward_and_grads(q, k, v)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[seg < 0] == 0)

    @jax.jit
    def dense64(a, b, c):
        s = jnp.einsum("btnh,bsnh->bnts", a, jnp.repeat(b, N // K, axis=2)) * scale
        s = jnp.where(vis[:, None], s, -jnp.inf)
        m = jnp.max(s, -1, keepdims=True)
        p = jnp.where(vis[:, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0.0)
        den = p.sum(-1, keepdims=True)
        p = p / jnp.where(den > 0, den, 1)
        return jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(c, N // K, axis=2))

    with jax.enable_x64(True):
        args64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        np.testing.assert_allclose(np.asarray(dense64(*args64)), want, rtol=1e-10, atol=1e-10)
        want_grads = jax.vjp(dense64, *args64)[1](jnp.asarray(do, jnp.float64))
    for name, g, w in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
        assert np.all(np.isfinite(np.asarray(g)))


def test_first_visible_key_handles_non_contiguous_segments():
    seg = jnp.array([2, 2, 0, 2, -1, 0, 5], jnp.int32)
    glob = jnp.array([False, False, False, False, False, False, True])
    got = np.asarray(squid.first_visible_key(seg, glob))
    np.testing.assert_array_equal(got, [0, 0, 2, 0, 7, 2, 0])
    # A non-contiguous document still sees all of its earlier tokens.
    rng = np.random.default_rng(0)
    seg2 = np.array([[0, 0, 1, 1, 0, 1, 0, 2, 2]], np.int32)
    glob2 = np.array([[False] * 7 + [True, True]])
    q, k, v = random_qkv(rng, 1, 9, 2, 1, 8)
    got = squid.squid_attention_reference(q, k, v, seg2, glob2, block=2)
    want = dense_oracle(q, k, v, squid_mask(seg2[0], glob2[0])[None], 8**-0.5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_reference_skips_blocks_outside_documents():
    """Work done = the key blocks between each query block's first visible key and itself."""
    seg, glob = packed_layout([64] * 8, 32, 0)
    lo, hi = squid._block_ranges(jnp.asarray(seg[0]), jnp.asarray(glob[0]), 16)
    visited = int(np.sum(np.asarray(hi) - np.asarray(lo)))
    nb = seg.shape[1] // 16
    # 8 documents of 4 blocks visit 1+2+3+4 blocks each; the 2 global blocks visit all before them.
    assert visited == 8 * 10 + (nb - 1) + nb
    assert visited < nb * (nb + 1) // 2 / 3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_global_attention_over_cached_documents_equals_packed_forward(impl):
    rng = np.random.default_rng(7)
    doc_lens, glen, H, N, K = (6, 10, 3), 9, 16, 4, 2
    seg, glob = packed_layout(doc_lens, glen, 0)
    T = seg.shape[1]
    q, k, v = random_qkv(rng, 1, T, N, K, H)
    full = np.asarray(squid.squid_attention_reference(q, k, v, seg, glob, block=4))
    S = sum(doc_lens)
    # The cache holds the documents in a padded buffer with holes between them.
    holes = np.zeros(S + 6, bool)
    holes[[1, 2, 6, 8, 9, 17]] = True
    n_slots = len(holes)
    idx = np.flatnonzero(~holes)
    dk = np.zeros((1, n_slots, K, H), np.float32)
    dv = rng.standard_normal((1, n_slots, K, H)).astype(np.float32) * 100  # garbage in the holes
    dk[0, idx], dv[0, idx] = k[0, :S], v[0, :S]
    got = squid.global_attention(q[:, S:], k[:, S:], v[:, S:], dk, dv, ~holes[None], impl=impl)
    np.testing.assert_allclose(np.asarray(got), full[:, S:], rtol=2e-5, atol=2e-5)


def test_dispatcher_and_errors():
    rng = np.random.default_rng(1)
    seg, glob = packed_layout((4, 4), 4, 0)
    q, k, v = random_qkv(rng, 1, 12, 2, 1, 8)
    np.testing.assert_allclose(
        np.asarray(squid.squid_attention(q, k, v, seg, glob, impl="xla")),
        np.asarray(squid.squid_attention_reference(q, k, v, seg, glob)),
    )
    with pytest.raises(ValueError, match="segment_ids"):
        squid.squid_attention_reference(q, k, v, seg[:, :5], glob)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        squid.squid_attention_reference(q[:, :, :1].repeat(3, 2), k.repeat(2, 2), v.repeat(2, 2), seg, glob)
    with pytest.raises(ValueError, match="impl"):
        squid.squid_attention(q, k, v, seg, glob, impl="cuda")
