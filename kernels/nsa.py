"""NSA: Native Sparse Attention (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and
Natively Trainable Sparse Attention", arXiv 2502.11089), exactly as REFERENCE section 7 defines it.

Every query t mixes three attention branches with per-head gates g [B, T, N, 3] (cmp, slc, win):

  o_t = g_cmp * Attn(q_t, K_cmp, V_cmp) + g_slc * Attn(q_t, K_slc[sel_t]) + g_win * Attn(q_t, K_win[(t-w, t]])

* Compression (paper eq. 7): compressed block i (i = 0..Tc-1) summarises keys [i*d, i*d + l); the
  caller computes k_cmp/v_cmp [B, Tc, K, H] with its compression MLP. Query t attends block i only
  when the whole block is in its past, i*d + l - 1 <= t; a query with no complete block gets 0
  from this branch. Tc = `num_compressed_blocks(T, l, d)`.
* Selection scores (eqs. 8-10): p_cmp_t = softmax over the visible blocks of q_t . K_cmp * scale.
  Selection block j covers keys [j*l', (j+1)*l'); its score is the sum of p_cmp over the
  compression blocks overlapping it, summed over the query heads of a GQA group so that the group
  shares one set of blocks.
* Top-n (eq. 11): among the blocks not in the future (j*l' <= t), the n highest-scoring are selected.
  Block 0 and the local blocks (the block containing t and the one before it) are always selected
  and count towards n (they get score +inf). Ties between equal scores go to the lower block index
  (`lax.top_k` is stable), so the selection is deterministic. n >= 3 so that the forced blocks
  always fit. Attention over the selected tokens is causal at token level (key u <= t).
* Sliding window: keys (t - w, t], through `kernels.flash.flash_attention(window=w)`.

The selection and window branches read k, v [B, T, K, H] (shared) or dicts {"slc": ..., "win": ...}
(separate projections, paper section 3.3.3); the compression branch always reads k_cmp/v_cmp.
The selection indices are not differentiable (as in the paper); gradients flow to q, k, v, k_cmp,
v_cmp and the gates through the attention outputs.

Faces (ARCHITECTURE "Kernels: one op, three faces"):
* `nsa_attention_reference` - jax.numpy, sparse: query chunks under `lax.map`, each chunk scores
  its queries against the Tc compressed keys ([C, Tc]), picks top-n blocks per query and gathers
  only those n*l' keys; never a [T, T] score matrix.
* `nsa_attention_triton` - Triton kernels under `jax.custom_vjp`: flash-style compressed attention
  (forward with lse, backward), block selection in JAX from the kernel's lse, and the paper's
  selected-attention kernel (one program per (token, batch x kv head) loading the GQA group's query
  heads against the shared selected blocks; backward with dq per program and dk/dv by atomic adds
  into float32 buffers); the window branch is flash attention's Triton face.
* `nsa_attention(..., impl=)` - the dispatcher.
* `nsa_decode` - one query per row against a cache, reading only the compressed keys, the
  selected blocks and the window; equals the full forward at that position. The cache's layout is
  the caller's: plain arrays or any `TokenStore` (the sampler's, prompts shared by groups of rows,
  is `rlcode.models.attention.SharedPrefix`).

Shapes: B batch, T time, N query heads, K kv heads, R = N // K heads per group, H head dim,
Tc compressed blocks, Ns = cdiv(T, l') selection blocks, C query chunk.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels import _triton
from kernels._triton import cdiv, tl, triton
from kernels.flash import flash_attention

# ---------------------------------------------------------------------------------------------
# Sizes and argument checks
# ---------------------------------------------------------------------------------------------


class NSASizes(NamedTuple):
    """Static sizes of NSA: block_len l, stride d, select_size l', num_select n, window w."""

    block_len: int
    stride: int
    select_size: int
    num_select: int
    window: int


def check_sizes(block_len: int, stride: int, select_size: int, num_select: int, window: int) -> NSASizes:
    """Validate NSA's sizes (REFERENCE section 7); returns them as an `NSASizes`."""
    sizes = NSASizes(block_len, stride, select_size, num_select, window)
    for name, value in sizes._asdict().items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"NSA {name} must be a positive integer, got {value!r}")
    if block_len % stride:
        raise ValueError(f"NSA stride d={stride} must divide block_len l={block_len}")
    if select_size % stride:
        raise ValueError(f"NSA stride d={stride} must divide select_size l'={select_size}")
    if num_select < 3:
        # Block 0, the current block and the one before it are always selected and count towards n.
        raise ValueError(f"NSA num_select n={num_select} must be >= 3 (the three forced blocks count towards n)")
    return NSASizes(*(int(x) for x in sizes))


def num_compressed_blocks(length, block_len: int, stride: int):
    """Number of compression blocks i with i*d + l <= length (blocks wholly inside `length` keys).

    `length` may be a Python int (-> int) or an integer array (-> array of the same shape)."""
    n = (length - block_len) // stride + 1
    if isinstance(length, (int, np.integer)):
        return max(int(n), 0)
    return jnp.maximum(n, 0)


def _check_args(q, k, v, k_cmp, v_cmp, gates, sizes: NSASizes):
    """Shapes of the full forward; returns (k_slc, v_slc, k_win, v_win)."""
    if jnp.ndim(q) != 4:
        raise ValueError(f"q must be [B, T, N, H], got shape {jnp.shape(q)}")
    B, T, N, H = q.shape
    k_slc, v_slc, k_win, v_win = _split_branches(k, v)
    for name, x in (("k_slc", k_slc), ("v_slc", v_slc), ("k_win", k_win), ("v_win", v_win)):
        if jnp.ndim(x) != 4 or x.shape[0] != B or x.shape[1] != T or x.shape[3] != H:
            raise ValueError(f"{name} must be [B={B}, T={T}, K, H={H}], got shape {jnp.shape(x)}")
    K = k_slc.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"num_heads N={N} must be a multiple of num_kv_heads K={K}")
    for name, x in (("v_slc", v_slc), ("k_win", k_win), ("v_win", v_win)):
        if x.shape != k_slc.shape:
            raise ValueError(f"{name} must have the shape of the selection keys {k_slc.shape}, got {x.shape}")
    Tc = num_compressed_blocks(T, sizes.block_len, sizes.stride)
    for name, x in (("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if jnp.shape(x) != (B, Tc, K, H):
            raise ValueError(
                f"{name} must be [B, Tc, K, H] = {(B, Tc, K, H)} (Tc = num_compressed_blocks(T={T}, "
                f"l={sizes.block_len}, d={sizes.stride})), got shape {jnp.shape(x)}"
            )
    if jnp.shape(gates) != (B, T, N, 3):
        raise ValueError(f"gates must be [B, T, N, 3] = {(B, T, N, 3)} (cmp, slc, win), got {jnp.shape(gates)}")
    return k_slc, v_slc, k_win, v_win


def _split_branches(k, v):
    """(k_slc, v_slc, k_win, v_win) from shared arrays or {"slc", "win"} dicts."""
    if isinstance(k, dict) != isinstance(v, dict):
        raise ValueError("k and v must both be arrays or both be dicts with keys 'slc' and 'win'")
    if isinstance(k, dict):
        for name, d in (("k", k), ("v", v)):
            if set(d) != {"slc", "win"}:
                raise ValueError(f"{name} as a dict must have exactly the keys 'slc' and 'win', got {sorted(d)}")
        return k["slc"], v["slc"], k["win"], v["win"]
    return k, v, k, v


# ---------------------------------------------------------------------------------------------
# Shared pieces: selection scores, top-n, attention over gathered keys
# ---------------------------------------------------------------------------------------------


def _selection_scores(p_cmp, num_sel_blocks: int, sizes: NSASizes):
    """Sum of p_cmp over the compression blocks overlapping each selection block (eq. 9).

    p_cmp [..., Tc] -> [..., Ns]. Block i covers [i*d, i*d + l) and selection block j covers
    [j*l', (j+1)*l'); they overlap iff j*c - l/d < i < (j+1)*c with c = l'/d, so selection block j
    sums the c + l/d - 1 consecutive compression blocks ending at (j+1)*c - 1 (a strided window sum).
    """
    c, span = sizes.select_size // sizes.stride, sizes.block_len // sizes.stride
    Tc = p_cmp.shape[-1]
    width = num_sel_blocks * c + c + span - 2
    pad = [(0, 0)] * (p_cmp.ndim - 1) + [(span - 1, width - Tc - (span - 1))]
    pp = jnp.pad(p_cmp, pad)
    total = pp[..., 0 : num_sel_blocks * c : c]
    for m in range(1, c + span - 1):
        total = total + pp[..., m : m + num_sel_blocks * c : c]
    return total


def _top_blocks(scores, t, sizes: NSASizes):
    """Indices [..., n_eff] of the selected blocks (-1 = none) from scores [..., Ns], positions t [...].

    Future blocks (j*l' > t) are excluded; block 0, the block holding t and the one before it are
    forced (+inf); among equal scores the lower block index wins (lax.top_k is stable).
    """
    Ns = scores.shape[-1]
    j = jnp.arange(Ns)
    t = t[..., None]
    cur = t // sizes.select_size
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    s = jnp.where(forced, jnp.inf, jnp.where(j * sizes.select_size <= t, scores, -jnp.inf))
    vals, idx = lax.top_k(lax.stop_gradient(s), min(sizes.num_select, Ns))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def _softmax_attend(s, valid, v, eq):
    """Masked softmax of float32 scores s [..., P] and its product with v (einsum `eq`).

    A row with no valid key gets zero probabilities (and zero output) instead of NaN. Returns
    (out, p)."""
    s = jnp.where(valid, s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    return jnp.einsum(eq, p, v.astype(jnp.float32)), p


def _gather_tokens(seq, pos_bkx):
    """Tokens at positions pos [B, K, X] of each row and kv head: [B, K, X, H].

    seq is [B, S, K, H] or a `TokenStore`. Out-of-range positions are clamped (callers mask them)."""
    if isinstance(seq, TokenStore):
        return seq.gather(pos_bkx)
    B, Kh = pos_bkx.shape[:2]
    b = jnp.arange(B)[:, None, None]
    kh = jnp.arange(Kh)[None, :, None]
    return jnp.asarray(seq)[b, jnp.clip(pos_bkx, 0, seq.shape[1] - 1), kh]


def _compressed_and_selected(q_bckrh, t_bc, kc_bkih, vc_bkih, k_slc, v_slc, sizes: NSASizes, num_sel_blocks, scale):
    """Compressed and selected branches for a chunk of queries: (o_cmp, o_slc) [B, C, K, R, H] f32.

    q [B, C, K, R, H] at positions t [B, C]; compressed keys/values [B, K, Tc, H]; k_slc/v_slc
    [B, S, K, H] or `TokenStore`, read only at the selected positions.
    """
    B, C, K, R, H = q_bckrh.shape
    Tc = kc_bkih.shape[2]
    l, d, ls = sizes.block_len, sizes.stride, sizes.select_size
    q32 = q_bckrh.astype(jnp.float32)
    # Compression branch: every query against all Tc blocks ([C, Tc] = [C, T/d] scores).
    s = jnp.einsum("bckrh,bkih->bckri", q32, kc_bkih.astype(jnp.float32)) * scale
    vis = (jnp.arange(Tc) * d + l - 1)[None, None, :] <= t_bc[:, :, None]  # [B, C, Tc]
    o_cmp, p_cmp = _softmax_attend(s, vis[:, :, None, None, :], vc_bkih, "bckri,bkih->bckrh")
    # Selection: the group's summed compression probabilities pick n blocks per query.
    p_slc = _selection_scores(lax.stop_gradient(p_cmp).sum(axis=3), num_sel_blocks, sizes)  # [B, C, K, Ns]
    idx = _top_blocks(p_slc, t_bc[:, :, None], sizes)  # [B, C, K, n]
    n = idx.shape[-1]
    pos = idx[..., None] * ls + jnp.arange(ls)  # [B, C, K, n, l']
    valid = (idx[..., None] >= 0) & (pos <= t_bc[:, :, None, None, None])
    # Masked slots read the query's own token, so entries past t (a cache's unwritten tail) are
    # never loaded.
    pos = jnp.where(valid, pos, t_bc[:, :, None, None, None]).reshape(B, C, K, n * ls)
    valid = valid.reshape(B, C, K, n * ls)
    pos_bkx = pos.transpose(0, 2, 1, 3).reshape(B, K, C * n * ls)
    ks = _gather_tokens(k_slc, pos_bkx).reshape(B, K, C, n * ls, H)
    vs = _gather_tokens(v_slc, pos_bkx).reshape(B, K, C, n * ls, H)
    s2 = jnp.einsum("bckrh,bkcph->bckrp", q32, ks.astype(jnp.float32)) * scale
    o_slc, _ = _softmax_attend(s2, valid[:, :, :, None, :], vs, "bckrp,bkcph->bckrh")
    return o_cmp, o_slc


def _mix(gates, o_cmp, o_slc, o_win, dtype):
    """g_cmp * o_cmp + g_slc * o_slc + g_win * o_win (float32), cast to dtype."""
    g = gates.astype(jnp.float32)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win.astype(jnp.float32)
    return o.astype(dtype)


def _default_chunk(T: int, select_size: int) -> int:
    """Query chunk: a multiple of l' near 64, no longer than the (l'-rounded) sequence."""
    c = select_size * max(1, 64 // select_size)
    return min(c, cdiv(T, select_size) * select_size)


def _window_branch(q, k_win, v_win, sizes: NSASizes, scale, impl):
    return flash_attention(q, k_win, v_win, causal=True, window=sizes.window, scale=scale, impl=impl)


# ---------------------------------------------------------------------------------------------
# XLA reference
# ---------------------------------------------------------------------------------------------


def nsa_attention_reference(
    q,
    k,
    v,
    k_cmp,
    v_cmp,
    gates,
    *,
    block_len=32,
    stride=16,
    select_size=64,
    num_select=16,
    window=512,
    scale=None,
    chunk_size=None,
):
    """NSA in jax.numpy, chunked over queries (see the module docstring for the definition).

    q [B, T, N, H]; k, v [B, T, K, H] or dicts {"slc", "win"} of those; k_cmp, v_cmp [B, Tc, K, H];
    gates [B, T, N, 3]. Returns [B, T, N, H] in q.dtype. chunk_size: queries per `lax.map` step
    (a multiple of select_size; default near 64). Memory per chunk is O(C * (Tc + n * l') * H).
    """
    sizes = check_sizes(block_len, stride, select_size, num_select, window)
    k_slc, v_slc, k_win, v_win = _check_args(q, k, v, k_cmp, v_cmp, gates, sizes)
    B, T, N, H = q.shape
    K = k_slc.shape[2]
    R = N // K
    scale = H**-0.5 if scale is None else float(scale)
    C = _default_chunk(T, select_size) if chunk_size is None else int(chunk_size)
    if C <= 0 or C % select_size:
        raise ValueError(f"chunk_size must be a positive multiple of select_size={select_size}, got {chunk_size}")
    nc = cdiv(T, C)
    Tp = nc * C
    Ns = cdiv(T, select_size)
    q_cbckrh = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, nc, C, K, R, H).swapaxes(0, 1)
    kc = k_cmp.transpose(0, 2, 1, 3)
    vc = v_cmp.transpose(0, 2, 1, 3)

    def one_chunk(args):
        ci, q_c = args
        t_bc = jnp.broadcast_to(ci * C + jnp.arange(C), (B, C))
        return _compressed_and_selected(q_c, t_bc, kc, vc, k_slc, v_slc, sizes, Ns, scale)

    # Rematerialise each chunk in the backward pass: its gathered [C, n*l'] keys are not stored.
    o_cmp, o_slc = lax.map(jax.checkpoint(one_chunk), (jnp.arange(nc), q_cbckrh))
    o_cmp = o_cmp.swapaxes(0, 1).reshape(B, Tp, N, H)[:, :T]
    o_slc = o_slc.swapaxes(0, 1).reshape(B, Tp, N, H)[:, :T]
    o_win = _window_branch(q, k_win, v_win, sizes, scale, "xla")
    return _mix(gates, o_cmp, o_slc, o_win, q.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if _triton.HAVE_TRITON:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b, accumulated in float32. IEEE (set for float32 inputs): full float32 products, as
        the XLA reference computes them; otherwise the hardware's default (TF32 on float32 inputs,
        which would be visibly less precise than the reference)."""
        if IEEE:
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _cmp_fwd_kernel(
        q_ptr, k_ptr, v_ptr, T, Tc, N, K, scale,
        o_ptr, lse_ptr,
        R: tl.constexpr, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Compressed attention, one program per (query tile, b * N + head); online softmax over
        the compressed blocks the tile can see (block i visible to t iff i*D + L - 1 <= t)."""
        pid_m = tl.program_id(0)
        pid_bn = tl.program_id(1)
        b = (pid_bn // N).to(tl.int64)  # int64 offsets: B*T*N*H can pass 2**31
        n = pid_bn % N
        kh = n // R
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.arange(0, BLOCK_H)
        q = tl.load(q_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :],
                    mask=(t[:, None] < T) & (h[None, :] < H), other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T - 1)
        # Blocks visible to the tile's last query: i*D + L - 1 <= t_last (0 when t_last < L - 1).
        n_vis = tl.minimum(tl.maximum(t_last - L + 1 + D, 0) // D, Tc)
        for c0 in range(0, n_vis, BLOCK_C):
            i = c0 + tl.arange(0, BLOCK_C)
            kv_mask = (i[:, None] < Tc) & (h[None, :] < H)
            k = tl.load(k_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * scale
            vis = (i[None, :] * D + L - 1 <= t[:, None]) & (i[None, :] < Tc)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(vis, tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], o, mask=(t[:, None] < T) & (h[None, :] < H))
        tl.store(lse_ptr + (b * T + t) * N + n, lse, mask=t < T)

    @triton.jit
    def _cmp_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, T, Tc, N, K, scale,
        dq_ptr,
        R: tl.constexpr, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
    ):
        """dq of compressed attention, one program per (query tile, b * N + head)."""
        pid_m = tl.program_id(0)
        pid_bn = tl.program_id(1)
        b = (pid_bn // N).to(tl.int64)  # int64 offsets: B*T*N*H can pass 2**31
        n = pid_bn % N
        kh = n // R
        t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.arange(0, BLOCK_H)
        qmask = (t[:, None] < T) & (h[None, :] < H)
        q = tl.load(q_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], mask=qmask, other=0.0)
        do = tl.load(do_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], mask=qmask, other=0.0)
        lse = tl.load(lse_ptr + (b * T + t) * N + n, mask=t < T, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + (b * T + t) * N + n, mask=t < T, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T - 1)
        n_vis = tl.minimum(tl.maximum(t_last - L + 1 + D, 0) // D, Tc)
        for c0 in range(0, n_vis, BLOCK_C):
            i = c0 + tl.arange(0, BLOCK_C)
            kv_mask = (i[:, None] < Tc) & (h[None, :] < H)
            k = tl.load(k_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * scale
            vis = (i[None, :] * D + L - 1 <= t[:, None]) & (i[None, :] < Tc) & (t[:, None] < T)
            p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
        tl.store(dq_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], dq * scale, mask=qmask)

    @triton.jit
    def _cmp_bwd_dkv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, T, Tc, N, K, scale,
        dk_ptr, dv_ptr,
        R: tl.constexpr, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
    ):
        """dk, dv of compressed attention, one program per (block tile, b * K + kv head): it loops
        over the group's R query heads and the query tiles that can see the tile's first block."""
        pid_c = tl.program_id(0)
        pid_bk = tl.program_id(1)
        b = (pid_bk // K).to(tl.int64)  # int64 offsets: B*T*N*H can pass 2**31
        kh = pid_bk % K
        i = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        h = tl.arange(0, BLOCK_H)
        kv_mask = (i[:, None] < Tc) & (h[None, :] < H)
        k = tl.load(k_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_C, BLOCK_H], tl.float32)
        dv = tl.zeros([BLOCK_C, BLOCK_H], tl.float32)
        t_first = pid_c * BLOCK_C * D + L - 1
        m_start = (t_first // BLOCK_M) * BLOCK_M
        for r in range(R):
            n = kh * R + r
            for m0 in range(m_start, T, BLOCK_M):
                t = m0 + tl.arange(0, BLOCK_M)
                qmask = (t[:, None] < T) & (h[None, :] < H)
                q = tl.load(q_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], mask=qmask, other=0.0)
                do = tl.load(do_ptr + ((b * T + t[:, None]) * N + n) * H + h[None, :], mask=qmask, other=0.0)
                lse = tl.load(lse_ptr + (b * T + t) * N + n, mask=t < T, other=0.0)
                lse = tl.where(lse == float("-inf"), 0.0, lse)
                delta = tl.load(delta_ptr + (b * T + t) * N + n, mask=t < T, other=0.0)
                s = _dot(q, tl.trans(k), IEEE) * scale
                vis = (i[None, :] * D + L - 1 <= t[:, None]) & (i[None, :] < Tc) & (t[:, None] < T)
                p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
                dv += _dot(tl.trans(p).to(do.dtype), do, IEEE)
                dp = _dot(do, tl.trans(v), IEEE)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE)
        tl.store(dk_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], dk * scale, mask=kv_mask)
        tl.store(dv_ptr + ((b * Tc + i[:, None]) * K + kh) * H + h[None, :], dv, mask=kv_mask)

    @triton.jit
    def _slc_fwd_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, T, N, K, scale,
        o_ptr, lse_ptr,
        R: tl.constexpr, LS: tl.constexpr, NSEL: tl.constexpr, H: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Selected-block attention (the paper's kernel, section 3.4): one program per (token t,
        b * K + kv head) holds the group's R query heads [BLOCK_R, H] and streams its NSEL selected
        blocks of LS keys (shared by the group), causal at token level."""
        t = tl.program_id(0)
        pid_bk = tl.program_id(1)
        b = (pid_bk // K).to(tl.int64)  # int64 offsets: B*T*N*H can pass 2**31
        kh = pid_bk % K
        r = tl.arange(0, BLOCK_R)
        h = tl.arange(0, BLOCK_H)
        u = tl.arange(0, BLOCK_S)
        qmask = (r[:, None] < R) & (h[None, :] < H)
        q_off = ((b * T + t) * N + kh * R + r[:, None]) * H + h[None, :]
        q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
        for sidx in range(NSEL):
            j = tl.load(idx_ptr + ((b * T + t) * K + kh) * NSEL + sidx)
            pos = j * LS + u
            kvalid = (pos >= 0) & (u < LS) & (pos <= t)  # j = -1 (no block) gives pos < 0
            kv_mask = kvalid[:, None] & (h[None, :] < H)
            k = tl.load(k_ptr + ((b * T + pos[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + ((b * T + pos[:, None]) * K + kh) * H + h[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * scale
            s = tl.where(kvalid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(kvalid[None, :], tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + q_off, o, mask=qmask)
        tl.store(lse_ptr + (b * T + t) * N + kh * R + r, lse, mask=r < R)

    @triton.jit
    def _slc_bwd_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, T, N, K, scale,
        dq_ptr, dk_ptr, dv_ptr,
        R: tl.constexpr, LS: tl.constexpr, NSEL: tl.constexpr, H: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Backward of selected attention per (token, b * K + kv head): dq in registers; dk, dv of
        the selected keys are atomically added to float32 buffers (many tokens share a block)."""
        t = tl.program_id(0)
        pid_bk = tl.program_id(1)
        b = (pid_bk // K).to(tl.int64)  # int64 offsets: B*T*N*H can pass 2**31
        kh = pid_bk % K
        r = tl.arange(0, BLOCK_R)
        h = tl.arange(0, BLOCK_H)
        u = tl.arange(0, BLOCK_S)
        rvalid = r < R
        qmask = rvalid[:, None] & (h[None, :] < H)
        q_off = ((b * T + t) * N + kh * R + r[:, None]) * H + h[None, :]
        q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
        do = tl.load(do_ptr + q_off, mask=qmask, other=0.0)
        lse = tl.load(lse_ptr + (b * T + t) * N + kh * R + r, mask=rvalid, other=0.0)
        delta = tl.load(delta_ptr + (b * T + t) * N + kh * R + r, mask=rvalid, other=0.0)
        dq = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
        for sidx in range(NSEL):
            j = tl.load(idx_ptr + ((b * T + t) * K + kh) * NSEL + sidx)
            pos = j * LS + u
            kvalid = (pos >= 0) & (u < LS) & (pos <= t)  # j = -1 (no block) gives pos < 0
            kv_mask = kvalid[:, None] & (h[None, :] < H)
            kv_off = ((b * T + pos[:, None]) * K + kh) * H + h[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * scale
            p = tl.where(rvalid[:, None] & kvalid[None, :], tl.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
            tl.atomic_add(dv_ptr + kv_off, _dot(tl.trans(p).to(do.dtype), do, IEEE), mask=kv_mask)
            tl.atomic_add(dk_ptr + kv_off, _dot(tl.trans(ds).to(q.dtype), q, IEEE) * scale, mask=kv_mask)
        tl.store(dq_ptr + q_off, dq * scale, mask=qmask)


def _pow2(x: int, minimum: int = 16) -> int:
    """Next power of two >= max(x, minimum) (tl.arange and tl.dot want powers of two >= 16)."""
    return max(minimum, 1 << (int(x) - 1).bit_length())


class _CmpStatic(NamedTuple):
    block_len: int
    stride: int
    scale: float


def _cmp_launch_sizes(T, Tc, H, dtype):
    return dict(BLOCK_H=_pow2(H), BLOCK_M=min(64, _pow2(T)), BLOCK_C=min(64, _pow2(Tc)), IEEE=bool(dtype == jnp.float32))


def _cmp_fwd(q, k_cmp, v_cmp, st: _CmpStatic):
    B, T, N, H = q.shape
    Tc, K = k_cmp.shape[1], k_cmp.shape[2]
    blocks = _cmp_launch_sizes(T, Tc, H, q.dtype)
    return _triton.triton_call(
        q, k_cmp, v_cmp, T, Tc, N, K, st.scale,
        kernel=_cmp_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, N, H), jnp.float32), jax.ShapeDtypeStruct((B, T, N), jnp.float32)),
        grid=(cdiv(T, blocks["BLOCK_M"]), B * N),
        R=N // K, L=st.block_len, D=st.stride, H=H, **blocks,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cmp_attention(q, k_cmp, v_cmp, st: _CmpStatic):
    """Compressed attention (Triton): (o [B, T, N, H] f32, lse [B, T, N] f32, -inf with no block)."""
    return _cmp_fwd(q, k_cmp, v_cmp, st)


def _cmp_attention_fwd(q, k_cmp, v_cmp, st):
    o, lse = _cmp_fwd(q, k_cmp, v_cmp, st)
    return (o, lse), (q, k_cmp, v_cmp, o, lse)


def _cmp_attention_bwd(st, res, cts):
    q, k_cmp, v_cmp, o, lse = res
    do, dlse = cts
    B, T, N, H = q.shape
    Tc, K = k_cmp.shape[1], k_cmp.shape[2]
    # d lse / d s = p, so an lse cotangent enters exactly like -delta.
    delta = jnp.sum(do * o, axis=-1) - dlse
    do = do.astype(q.dtype)
    blocks = _cmp_launch_sizes(T, Tc, H, q.dtype)
    common = dict(R=N // K, L=st.block_len, D=st.stride, H=H, **blocks)
    args = (q, k_cmp, v_cmp, do, lse, delta, T, Tc, N, K, st.scale)
    dq = _triton.triton_call(
        *args, kernel=_cmp_bwd_dq_kernel, out_shape=jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
        grid=(cdiv(T, blocks["BLOCK_M"]), B * N), **common,
    )
    dk, dv = _triton.triton_call(
        *args, kernel=_cmp_bwd_dkv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k_cmp.shape, jnp.float32), jax.ShapeDtypeStruct(v_cmp.shape, jnp.float32)),
        grid=(cdiv(Tc, blocks["BLOCK_C"]), B * K), **common,
    )
    return dq.astype(q.dtype), dk.astype(k_cmp.dtype), dv.astype(v_cmp.dtype)


_cmp_attention.defvjp(_cmp_attention_fwd, _cmp_attention_bwd)


class _SlcStatic(NamedTuple):
    select_size: int
    scale: float


def _slc_launch_sizes(R, LS, H, dtype):
    return dict(BLOCK_R=_pow2(R), BLOCK_S=_pow2(LS), BLOCK_H=_pow2(H), IEEE=bool(dtype == jnp.float32))


def _slc_fwd(q, k, v, idx, st: _SlcStatic):
    B, T, N, H = q.shape
    K, nsel = k.shape[2], idx.shape[-1]
    return _triton.triton_call(
        q, k, v, idx, T, N, K, st.scale,
        kernel=_slc_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, N, H), jnp.float32), jax.ShapeDtypeStruct((B, T, N), jnp.float32)),
        grid=(T, B * K),
        R=N // K, LS=st.select_size, NSEL=nsel, H=H, **_slc_launch_sizes(N // K, st.select_size, H, q.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _slc_attention(q, k, v, idx, st: _SlcStatic):
    """Selected-block attention (Triton): o [B, T, N, H] f32; idx [B, T, K, n] int32 (-1 = none)."""
    return _slc_fwd(q, k, v, idx, st)[0]


def _slc_attention_fwd(q, k, v, idx, st):
    o, lse = _slc_fwd(q, k, v, idx, st)
    return o, (q, k, v, idx, o, lse)


def _slc_attention_bwd(st, res, do):
    q, k, v, idx, o, lse = res
    B, T, N, H = q.shape
    K, nsel = k.shape[2], idx.shape[-1]
    delta = jnp.sum(do * o, axis=-1)
    dq, dk, dv = _triton.triton_call(
        q, k, v, idx, do.astype(q.dtype), lse, delta, T, N, K, st.scale,
        kernel=_slc_bwd_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
            jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
        ),
        grid=(T, B * K),
        R=N // K, LS=st.select_size, NSEL=nsel, H=H, **_slc_launch_sizes(N // K, st.select_size, H, q.dtype),
    )
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_slc_attention.defvjp(_slc_attention_fwd, _slc_attention_bwd)


def _select_blocks(q, k_cmp, lse, sizes: NSASizes, scale, chunk):
    """Selected block indices [B, T, K, n] (-1 = none) from the compressed attention's lse.

    Recomputes the [C, Tc] compressed scores per query chunk (no [T, Tc] tensor is kept) and
    p_cmp = exp(s - lse) over the visible blocks."""
    B, T, N, H = q.shape
    Tc, K = k_cmp.shape[1], k_cmp.shape[2]
    R = N // K
    l, d = sizes.block_len, sizes.stride
    nc = cdiv(T, chunk)
    Tp = nc * chunk
    Ns = cdiv(T, sizes.select_size)
    q_c = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, nc, chunk, K, R, H).swapaxes(0, 1)
    lse_c = jnp.pad(lse, ((0, 0), (0, Tp - T), (0, 0))).reshape(B, nc, chunk, K, R).swapaxes(0, 1)
    kc = lax.stop_gradient(k_cmp).astype(jnp.float32)

    def one_chunk(args):
        ci, qq, ll = args
        t = ci * chunk + jnp.arange(chunk)
        s = jnp.einsum("bckrh,bikh->bckri", qq.astype(jnp.float32), kc) * scale
        vis = ((jnp.arange(Tc) * d + l - 1)[None, :] <= t[:, None])[None, :, None, None, :]
        p = jnp.where(vis & jnp.isfinite(ll)[..., None], jnp.exp(s - ll[..., None]), 0.0)
        scores = _selection_scores(p.sum(axis=3), Ns, sizes)
        return _top_blocks(scores, jnp.broadcast_to(t[None, :, None], (B, chunk, K)), sizes)

    idx = lax.map(one_chunk, (jnp.arange(nc), lax.stop_gradient(q_c), lax.stop_gradient(lse_c)))
    return idx.swapaxes(0, 1).reshape(B, Tp, K, -1)[:, :T]


def nsa_attention_triton(
    q,
    k,
    v,
    k_cmp,
    v_cmp,
    gates,
    *,
    block_len=32,
    stride=16,
    select_size=64,
    num_select=16,
    window=512,
    scale=None,
):
    """NSA with Triton kernels (same arguments and result as `nsa_attention_reference`).

    Compressed attention and selected attention are Triton kernels with Triton backward passes
    (`jax.custom_vjp`); the block selection runs in JAX between them from the compressed
    attention's lse; the window branch is `flash_attention(impl="triton")`; gates mix in JAX.
    """
    _triton.require()
    sizes = check_sizes(block_len, stride, select_size, num_select, window)
    k_slc, v_slc, k_win, v_win = _check_args(q, k, v, k_cmp, v_cmp, gates, sizes)
    B, T, N, H = q.shape
    scale = H**-0.5 if scale is None else float(scale)
    if k_cmp.shape[1] > 0:
        o_cmp, lse = _cmp_attention(q, k_cmp, v_cmp, _CmpStatic(block_len, stride, scale))
    else:
        o_cmp = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    idx = _select_blocks(q, k_cmp, lax.stop_gradient(lse), sizes, scale, _default_chunk(T, select_size))
    o_slc = _slc_attention(q, k_slc, v_slc, idx, _SlcStatic(select_size, scale))
    o_win = _window_branch(q, k_win, v_win, sizes, scale, "triton")
    return _mix(gates, o_cmp, o_slc, o_win, q.dtype)


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def nsa_attention(
    q,
    k,
    v,
    k_cmp,
    v_cmp,
    gates,
    *,
    block_len=32,
    stride=16,
    select_size=64,
    num_select=16,
    window=512,
    scale=None,
    impl="auto",
):
    """Native Sparse Attention (REFERENCE section 7; arXiv 2502.11089, eqs. 5-11).

    q [B, T, N, H]; k, v [B, T, K, H] shared by the selection and window branches, or dicts
    {"slc": [B, T, K, H], "win": [B, T, K, H]}; k_cmp, v_cmp [B, Tc, K, H] compressed keys/values of
    blocks [i*stride, i*stride + block_len), Tc = num_compressed_blocks(T, block_len, stride);
    gates [B, T, N, 3] (cmp, slc, win) in [0, 1]. Returns [B, T, N, H] in q.dtype. scale defaults
    to H**-0.5. impl: "auto" (Triton on a CUDA device, XLA elsewhere), "xla" or "triton".
    """
    kwargs = dict(block_len=block_len, stride=stride, select_size=select_size, num_select=num_select,
                  window=window, scale=scale)
    if _triton.use_triton(impl):
        return nsa_attention_triton(q, k, v, k_cmp, v_cmp, gates, **kwargs)
    return nsa_attention_reference(q, k, v, k_cmp, v_cmp, gates, **kwargs)


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class TokenStore(Protocol):
    """Per-row keys or values that `nsa_decode` reads only by position, whatever their layout.

    `capacity`: an upper bound on any row's length; `num_kv_heads`: K; `gather(pos [B, K, X])`:
    the entries [B, K, X, H] at those positions of each row and kv head (a position outside a row
    may give anything finite or not: the decode masks it). A plain [B, S, K, H] array is read
    directly; the sampler's cache (prompts shared by groups of rows) is
    `rlcode.models.attention.SharedPrefix`.
    """

    @property
    def capacity(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    def gather(self, pos_bkx: jax.Array) -> jax.Array: ...


def _capacity(seq) -> int:
    return seq.capacity if isinstance(seq, TokenStore) else seq.shape[1]


def nsa_decode(
    q,
    k,
    v,
    k_cmp,
    v_cmp,
    gates,
    positions,
    *,
    block_len=32,
    stride=16,
    select_size=64,
    num_select=16,
    window=512,
    scale=None,
):
    """NSA for one new query per row against a cache (jax.numpy; it reads only what NSA selects).

    q [B, N, H] at absolute positions [B] (t); k, v: the selection/window keys and values of each
    row for positions 0..t (the current token included), as [B, S, K, H] arrays, `TokenStore`s,
    or dicts {"slc": ..., "win": ...} of those; k_cmp, v_cmp: compressed blocks 0..(t - l + 1)//d
    of each row, as [B, Sc, K, H] or `TokenStore`; gates [B, N, 3]. Entries past a row's
    position (keys after t, blocks not complete at t) are never used, even if NaN. Returns
    [B, N, H] in q.dtype, equal to `nsa_attention` at position t. Loads the compressed blocks,
    n * l' selected keys and w window keys per row (paper section 5.2).
    """
    sizes = check_sizes(block_len, stride, select_size, num_select, window)
    if jnp.ndim(q) != 3:
        raise ValueError(f"q must be [B, N, H], got shape {jnp.shape(q)}")
    B, N, H = q.shape
    k_slc, v_slc, k_win, v_win = _split_branches(k, v)
    K = k_slc.num_kv_heads if isinstance(k_slc, TokenStore) else k_slc.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"num_heads N={N} must be a multiple of num_kv_heads K={K}")
    if jnp.shape(gates) != (B, N, 3):
        raise ValueError(f"gates must be [B, N, 3] = {(B, N, 3)}, got {jnp.shape(gates)}")
    if jnp.shape(positions) != (B,):
        raise ValueError(f"positions must be [B] = {(B,)}, got {jnp.shape(positions)}")
    R = N // K
    scale = H**-0.5 if scale is None else float(scale)
    t = positions.astype(jnp.int32)
    q_bckrh = q.reshape(B, 1, K, R, H)
    Tc = _capacity(k_cmp)
    blocks = jnp.broadcast_to(jnp.arange(Tc), (B, K, Tc))
    # Blocks not complete at t are zeroed (`where`, so an unwritten NaN slot cannot leak through).
    done = jnp.arange(Tc)[None, :] * stride + block_len - 1 <= t[:, None]
    kc = jnp.where(done[:, None, :, None], _gather_tokens(k_cmp, blocks), 0)
    vc = jnp.where(done[:, None, :, None], _gather_tokens(v_cmp, blocks), 0)
    Ns = cdiv(_capacity(k_slc), select_size)
    o_cmp, o_slc = _compressed_and_selected(q_bckrh, t[:, None], kc, vc, k_slc, v_slc, sizes, Ns, scale)
    W = min(window, _capacity(k_win))
    pos = jnp.broadcast_to((t[:, None] - W + 1 + jnp.arange(W))[:, None, :], (B, K, W))
    kw = _gather_tokens(k_win, jnp.maximum(pos, 0))
    vw = _gather_tokens(v_win, jnp.maximum(pos, 0))
    s = jnp.einsum("bkrh,bkwh->bkrw", q_bckrh[:, 0].astype(jnp.float32), kw.astype(jnp.float32)) * scale
    o_win, _ = _softmax_attend(s, (pos >= 0)[:, :, None, :], vw, "bkrw,bkwh->bkrh")
    o = _mix(gates, o_cmp[:, 0].reshape(B, N, H), o_slc[:, 0].reshape(B, N, H), o_win.reshape(B, N, H), q.dtype)
    return o
