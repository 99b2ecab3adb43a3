"""Flash attention: exact softmax attention without materialising the [T, S] score matrix.

FlashAttention-2 (Dao 2023, arXiv 2307.08691): queries are processed in tiles, keys are streamed
tile by tile with an online softmax (running max and sum in float32), and the backward pass
recomputes the probabilities from the saved log-sum-exp instead of storing them.

Shapes: q [B, T, N, H]; k, v [B, S, K, H] with grouped-query attention (N % K == 0; query head n
reads kv head n // (N // K)). Query i sits at absolute position i + S - T (the queries are the
last T positions of the keys). Key j is visible to query i iff all of:

* causal: j <= i + S - T;
* window w: j > i + S - T - w (keys (t - w, t], REFERENCE section 7, the NSA sliding window);
* segments (q_segment_ids [B, T], kv_segment_ids [B, S] int32, both or neither): both ids are
  >= 0 (negative = padding) and they are equal or the query is global;
* is_global [B, T] bool (only with segments): a global query sees keys of every segment, which is
  document ("squid") attention of REFERENCE section 8 (documents attend causally within
  themselves, the global segment attends to all documents and causally to itself).

The output is o [B, T, N, H] in q's dtype and, optionally, lse [B, T, N] float32: the natural-log
sum-exp of the scaled scores over the visible keys, -inf for a query that sees no key (o = 0
there). The lse lets callers merge partial attentions (NSA branches, cached documents).

Three faces (ARCHITECTURE "Kernels: one op, three faces"):
* `flash_attention_reference` - jax.numpy, differentiable by autodiff, query chunks under
  `lax.map` (with a window and no segments each chunk reads only a (chunk + window) key slice);
* `flash_attention_triton` - Triton forward and backward kernels under `jax.custom_vjp`;
* `flash_attention(..., impl=)` - the dispatcher.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels import _triton
from kernels._triton import cdiv, tl, triton

# ---------------------------------------------------------------------------------------------
# Argument checks (shared by every face)
# ---------------------------------------------------------------------------------------------


def _check_args(q, k, v, causal, window, q_segment_ids, kv_segment_ids, is_global, scale):
    """Validate shapes and options; returns (B, T, N, H, S, K)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(f"{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]), got shape {jnp.shape(x)}")
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if Bk != B:
        raise ValueError(f"q and k must have the same batch size, got {B} and {Bk}")
    if Hk != H:
        raise ValueError(f"q and k must have the same head dim, got {H} and {Hk}")
    if K == 0 or N % K != 0:
        raise ValueError(f"the number of query heads ({N}) must be a multiple of the number of kv heads ({K})")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (both or neither)")
    if q_segment_ids is not None:
        if jnp.shape(q_segment_ids) != (B, T):
            raise ValueError(f"q_segment_ids must have shape [B, T] = {(B, T)}, got {jnp.shape(q_segment_ids)}")
        if jnp.shape(kv_segment_ids) != (B, S):
            raise ValueError(f"kv_segment_ids must have shape [B, S] = {(B, S)}, got {jnp.shape(kv_segment_ids)}")
        for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
                raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(x)}")
    if is_global is not None:
        if q_segment_ids is None:
            raise ValueError("is_global needs q_segment_ids and kv_segment_ids (it only relaxes the segment rule)")
        if jnp.shape(is_global) != (B, T):
            raise ValueError(f"is_global must have shape [B, T] = {(B, T)}, got {jnp.shape(is_global)}")
        if jnp.result_type(is_global) != jnp.bool_:
            raise ValueError(f"is_global must be a bool array, got dtype {jnp.result_type(is_global)}")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"scale must be a Python number or None, got {type(scale).__name__}")
    return B, T, N, H, S, K


def _visible(qpos, kpos, causal, window, qseg=None, kseg=None, glob=None):
    """Visibility mask from absolute positions qpos [..., C, 1] and kpos [..., 1, L] (and segments)."""
    mask = jnp.ones(jnp.broadcast_shapes(qpos.shape, kpos.shape), bool)
    if causal:
        mask &= kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if qseg is not None:
        same = qseg == kseg
        if glob is not None:
            same |= glob
        mask &= (qseg >= 0) & (kseg >= 0) & same
    return mask


# ---------------------------------------------------------------------------------------------
# XLA face
# ---------------------------------------------------------------------------------------------


def _chunk_attention(q_bckrh, k_blkh, v_blkh, mask_bcl, scale):
    """Exact attention of one query chunk over L keys; float32; empty rows give o = 0, lse = -inf.

    Returns o [B, C, K, R, H] and lse [B, C, K, R]."""
    s_bkrcl = jnp.einsum("bckrh,blkh->bkrcl", q_bckrh.astype(jnp.float32), k_blkh.astype(jnp.float32)) * scale
    mask = mask_bcl[:, None, None]
    s_bkrcl = jnp.where(mask, s_bkrcl, -jnp.inf)
    m_bkrc = jnp.max(s_bkrcl, axis=-1)
    # The shift only guards exp against overflow; the result does not depend on it, so no gradient.
    m_bkrc = lax.stop_gradient(jnp.where(jnp.isfinite(m_bkrc), m_bkrc, 0.0))
    p_bkrcl = jnp.where(mask, jnp.exp(s_bkrcl - m_bkrc[..., None]), 0.0)
    l_bkrc = jnp.sum(p_bkrcl, axis=-1)
    # Guard both the division and the log so empty rows have finite (zero) gradients.
    nonempty = l_bkrc > 0
    l_safe = jnp.where(nonempty, l_bkrc, 1.0)
    o_bkrch = jnp.einsum("bkrcl,blkh->bkrch", p_bkrcl, v_blkh.astype(jnp.float32)) / l_safe[..., None]
    lse_bkrc = jnp.where(nonempty, m_bkrc + jnp.log(l_safe), -jnp.inf)
    return o_bkrch.transpose(0, 3, 1, 2, 4), lse_bkrc.transpose(0, 3, 1, 2)


def flash_attention_reference(
    q,
    k,
    v,
    *,
    causal=True,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    is_global=None,
    scale=None,
    return_lse=False,
    chunk_size=128,
):
    """The XLA face: jax.numpy, differentiable by autodiff; see the module docstring for the rules.

    Queries are processed in chunks of `chunk_size` rows under `lax.map`, each chunk rematerialised
    in the backward pass (`jax.checkpoint`), so memory is O(chunk * keys) rather than O(T * S).
    With a causal window and no segments a chunk reads only the (chunk + window - 1) keys it can see,
    so time is O(T * (chunk + window)) as well."""
    B, T, N, H, S, K = _check_args(q, k, v, causal, window, q_segment_ids, kv_segment_ids, is_global, scale)
    R = N // K
    scale = float(H**-0.5 if scale is None else scale)
    out_dtype = q.dtype
    if T == 0 or S == 0:
        o = jnp.zeros((B, T, N, H), out_dtype)
        lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
        return (o, lse) if return_lse else o
    C = max(1, min(int(chunk_size), T))
    nc = cdiv(T, C)
    Tp = nc * C
    offset = S - T
    # Chunk-major stacks for lax.map: q [nc, B, C, K, R, H]; segment ids and is_global [nc, B, C].
    q_chunks = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, nc, C, K, R, H).swapaxes(0, 1)
    has_seg = q_segment_ids is not None
    if has_seg:
        qseg_chunks = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)
        qseg_chunks = qseg_chunks.reshape(B, nc, C).swapaxes(0, 1)
        glob = jnp.zeros((B, T), bool) if is_global is None else is_global
        glob_chunks = jnp.pad(glob, ((0, 0), (0, Tp - T))).reshape(B, nc, C).swapaxes(0, 1)
        kseg_bs = kv_segment_ids.astype(jnp.int32)
    else:
        qseg_chunks = glob_chunks = jnp.zeros((nc,), jnp.int32)  # placeholders: lax.map needs arrays

    sliced = causal and window is not None and not has_seg and C + window - 1 < S
    if sliced:
        L = C + window - 1
        pad_left = max(0, window - 1 - offset)
        pad_right = Tp - T
        k_pad = jnp.pad(k, ((0, 0), (pad_left, pad_right), (0, 0), (0, 0)))
        v_pad = jnp.pad(v, ((0, 0), (pad_left, pad_right), (0, 0), (0, 0)))

    def one_chunk(args):
        c, q_c, qseg_c, glob_c = args
        qpos = c * C + jnp.arange(C) + offset
        if sliced:
            # First key any query of this chunk can see: (chunk start) + offset - window + 1.
            start = c * C + offset - window + 1
            k_c = lax.dynamic_slice_in_dim(k_pad, start + pad_left, L, axis=1)
            v_c = lax.dynamic_slice_in_dim(v_pad, start + pad_left, L, axis=1)
            kpos = start + jnp.arange(L)
            mask = _visible(qpos[:, None], kpos[None, :], causal, window) & ((kpos >= 0) & (kpos < S))[None, :]
            mask = mask[None]
        else:
            k_c, v_c = k, v
            kpos = jnp.arange(S)
            if has_seg:
                mask = _visible(
                    qpos[None, :, None], kpos[None, None, :], causal, window,
                    qseg_c[:, :, None], kseg_bs[:, None, :], glob_c[:, :, None],
                )
            else:
                mask = _visible(qpos[:, None], kpos[None, :], causal, window)[None]
        return _chunk_attention(q_c, k_c, v_c, mask, scale)

    o_chunks, lse_chunks = lax.map(jax.checkpoint(one_chunk), (jnp.arange(nc), q_chunks, qseg_chunks, glob_chunks))
    o = o_chunks.swapaxes(0, 1).reshape(B, Tp, N, H)[:, :T].astype(out_dtype)
    if not return_lse:
        return o
    lse = lse_chunks.swapaxes(0, 1).reshape(B, Tp, N)[:, :T]
    return o, lse


# ---------------------------------------------------------------------------------------------
# Triton face
# ---------------------------------------------------------------------------------------------

if _triton.HAVE_TRITON:

    @triton.jit
    def _tile_mask(offs_m, offs_n, qseg, glob, kseg, T, S, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   HAS_SEG: tl.constexpr):
        """[BLOCK_M, BLOCK_N] visibility of keys offs_n to queries offs_m (the module's rules)."""
        qpos = offs_m + (S - T)
        mask = (offs_m[:, None] < T) & (offs_n[None, :] < S)
        if CAUSAL:
            mask = mask & (offs_n[None, :] <= qpos[:, None])
        if WINDOW > 0:
            mask = mask & (offs_n[None, :] > qpos[:, None] - WINDOW)
        if HAS_SEG:
            same = (qseg[:, None] == kseg[None, :]) | (glob[:, None] != 0)
            mask = mask & same & (qseg[:, None] >= 0) & (kseg[None, :] >= 0)
        return mask

    @triton.jit
    def _key_range(b, start_m, kv_lo_ptr, kv_hi_ptr, T, S, NUM_Q_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr):
        """[lo, hi) of the key tiles the query tile at start_m can see; lo is a multiple of BLOCK_N."""
        lo = 0
        hi = S
        last_m = tl.minimum(start_m + BLOCK_M, T) - 1
        if CAUSAL:
            hi = tl.minimum(hi, last_m + (S - T) + 1)
        if WINDOW > 0:
            lo = tl.maximum(lo, start_m + (S - T) - WINDOW + 1)
        if HAS_SEG:
            tile = b * NUM_Q_TILES + start_m // BLOCK_M
            lo = tl.maximum(lo, tl.load(kv_lo_ptr + tile))
            hi = tl.minimum(hi, tl.load(kv_hi_ptr + tile))
        return (lo // BLOCK_N) * BLOCK_N, hi

    @triton.jit
    def _flash_fwd_kernel(
        q_ptr, k_ptr, v_ptr, qseg_ptr, glob_ptr, kseg_ptr, kv_lo_ptr, kv_hi_ptr, scale,
        o_ptr, lse_ptr,
        T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_Q_TILES: tl.constexpr,
        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BLOCK_M
        pid_bn = tl.program_id(1)
        b = pid_bn // N
        n = pid_bn % N
        kh = n // (N // K)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_h = tl.arange(0, BLOCK_H)
        # int64 bases: B * T * N * H can exceed int32 for long packed batches.
        q_base = (b.to(tl.int64) * T * N + n) * H
        kv_base = (b.to(tl.int64) * S * K + kh) * H
        row_ok = offs_m < T
        h_ok = offs_h < H
        q = tl.load(q_ptr + q_base + offs_m[:, None] * (N * H) + offs_h[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        qseg = offs_m
        glob = offs_m
        if HAS_SEG:
            qseg = tl.load(qseg_ptr + b * T + offs_m, mask=row_ok, other=-1)
            glob = tl.load(glob_ptr + b * T + offs_m, mask=row_ok, other=0)
        lo, hi = _key_range(b, start_m, kv_lo_ptr, kv_hi_ptr, T, S, NUM_Q_TILES, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                            HAS_SEG)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < S
            kv_off = kv_base + offs_n[:, None] * (K * H) + offs_h[None, :]
            kv_mask = col_ok[:, None] & h_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            kseg = offs_n
            if HAS_SEG:
                kseg = tl.load(kseg_ptr + b * S + offs_n, mask=col_ok, other=-1)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            mask = _tile_mask(offs_m, offs_n, qseg, glob, kseg, T, S, CAUSAL, WINDOW, HAS_SEG)
            s = tl.where(mask, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps m = -inf; shift it by 0 so exp gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_shift[:, None])
            alpha = tl.exp(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
        tl.store(o_ptr + q_base + offs_m[:, None] * (N * H) + offs_h[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & h_ok[None, :])
        tl.store(lse_ptr + (b * T + offs_m) * N + n, lse, mask=row_ok)

    @triton.jit
    def _flash_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qseg_ptr, glob_ptr, kseg_ptr, kv_lo_ptr, kv_hi_ptr, scale,
        dq_ptr,
        T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_Q_TILES: tl.constexpr,
        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BLOCK_M
        pid_bn = tl.program_id(1)
        b = pid_bn // N
        n = pid_bn % N
        kh = n // (N // K)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_h = tl.arange(0, BLOCK_H)
        q_base = (b.to(tl.int64) * T * N + n) * H
        kv_base = (b.to(tl.int64) * S * K + kh) * H
        row_ok = offs_m < T
        h_ok = offs_h < H
        q_off = q_base + offs_m[:, None] * (N * H) + offs_h[None, :]
        q_mask = row_ok[:, None] & h_ok[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + (b * T + offs_m) * N + n, mask=row_ok, other=0.0)
        # Rows that see nothing have lse = -inf; every score there is masked, any finite shift works.
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + (b * T + offs_m) * N + n, mask=row_ok, other=0.0)
        qseg = offs_m
        glob = offs_m
        if HAS_SEG:
            qseg = tl.load(qseg_ptr + b * T + offs_m, mask=row_ok, other=-1)
            glob = tl.load(glob_ptr + b * T + offs_m, mask=row_ok, other=0)
        lo, hi = _key_range(b, start_m, kv_lo_ptr, kv_hi_ptr, T, S, NUM_Q_TILES, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                            HAS_SEG)

        dq = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < S
            kv_off = kv_base + offs_n[:, None] * (K * H) + offs_h[None, :]
            kv_mask = col_ok[:, None] & h_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            kseg = offs_n
            if HAS_SEG:
                kseg = tl.load(kseg_ptr + b * S + offs_n, mask=col_ok, other=-1)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(v))
            mask = _tile_mask(offs_m, offs_n, qseg, glob, kseg, T, S, CAUSAL, WINDOW, HAS_SEG)
            p = tl.exp(tl.where(mask, s * scale, float("-inf")) - lse[:, None])
            ds = p * (dp - delta[:, None])
            if IEEE:
                dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
        tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qseg_ptr, glob_ptr, kseg_ptr, q_lo_ptr, q_hi_ptr, scale,
        dk_ptr, dv_ptr,
        T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_K_TILES: tl.constexpr,
        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, IEEE: tl.constexpr,
    ):
        start_n = tl.program_id(0) * BLOCK_N
        pid_bk = tl.program_id(1)
        b = pid_bk // K
        kh = pid_bk % K
        R = N // K
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_h = tl.arange(0, BLOCK_H)
        kv_base = (b.to(tl.int64) * S * K + kh) * H
        col_ok = offs_n < S
        h_ok = offs_h < H
        kv_off = kv_base + offs_n[:, None] * (K * H) + offs_h[None, :]
        kv_mask = col_ok[:, None] & h_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        kseg = offs_n
        if HAS_SEG:
            kseg = tl.load(kseg_ptr + b * S + offs_n, mask=col_ok, other=-1)

        # Query rows that can see this key tile: the transpose of _key_range.
        lo = 0
        hi = T
        last_n = tl.minimum(start_n + BLOCK_N, S) - 1
        if CAUSAL:
            lo = tl.maximum(lo, start_n - (S - T))
        if WINDOW > 0:
            hi = tl.minimum(hi, last_n - (S - T) + WINDOW)
        if HAS_SEG:
            tile = b * NUM_K_TILES + start_n // BLOCK_N
            lo = tl.maximum(lo, tl.load(q_lo_ptr + tile))
            hi = tl.minimum(hi, tl.load(q_hi_ptr + tile))
        lo = (lo // BLOCK_M) * BLOCK_M

        dk = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
        for r in range(R):
            n = kh * R + r
            q_base = (b.to(tl.int64) * T * N + n) * H
            for start_m in range(lo, hi, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                row_ok = offs_m < T
                q_off = q_base + offs_m[:, None] * (N * H) + offs_h[None, :]
                q_mask = row_ok[:, None] & h_ok[None, :]
                q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
                do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
                lse = tl.load(lse_ptr + (b * T + offs_m) * N + n, mask=row_ok, other=0.0)
                lse = tl.where(lse == float("-inf"), 0.0, lse)
                delta = tl.load(delta_ptr + (b * T + offs_m) * N + n, mask=row_ok, other=0.0)
                qseg = offs_m
                glob = offs_m
                if HAS_SEG:
                    qseg = tl.load(qseg_ptr + b * T + offs_m, mask=row_ok, other=-1)
                    glob = tl.load(glob_ptr + b * T + offs_m, mask=row_ok, other=0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                    dp = tl.dot(do, tl.trans(v))
                mask = _tile_mask(offs_m, offs_n, qseg, glob, kseg, T, S, CAUSAL, WINDOW, HAS_SEG)
                p = tl.exp(tl.where(mask, s * scale, float("-inf")) - lse[:, None])
                ds = p * (dp - delta[:, None])
                if IEEE:
                    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
                    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
                else:
                    dv += tl.dot(tl.trans(p).to(do.dtype), do)
                    dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        tl.store(dk_ptr + kv_off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def _first_last_match(needle_bt, hay_bs):
    """For each needle, the first and last index of an equal value in hay; (S, -1) when absent.

    Sorting hay stably by value keeps equal values in index order, so the matches of a value are a
    contiguous run of the sorted order whose ends are the first and last index; ids can be any ints."""
    S = hay_bs.shape[-1]
    order_bs = jnp.argsort(hay_bs, axis=-1, stable=True)
    sorted_bs = jnp.take_along_axis(hay_bs, order_bs, axis=-1)
    left_bt = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(sorted_bs, needle_bt)
    right_bt = jax.vmap(functools.partial(jnp.searchsorted, side="right"))(sorted_bs, needle_bt)
    found = right_bt > left_bt
    first = jnp.take_along_axis(order_bs, jnp.clip(left_bt, 0, S - 1), axis=-1)
    last = jnp.take_along_axis(order_bs, jnp.clip(right_bt - 1, 0, S - 1), axis=-1)
    return jnp.where(found, first, S), jnp.where(found, last, -1)


def _tile_bounds(lo_bx, hi_bx, block, empty_lo):
    """Per-tile [min lo, max hi) of per-row bounds (rows padded as empty)."""
    B, X = lo_bx.shape
    pad = cdiv(X, block) * block - X
    lo = jnp.pad(lo_bx, ((0, 0), (0, pad)), constant_values=empty_lo).reshape(B, -1, block).min(-1)
    hi = jnp.pad(hi_bx, ((0, 0), (0, pad)), constant_values=0).reshape(B, -1, block).max(-1)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _segment_tile_bounds(qseg_bt, kseg_bs, glob_bt, block_m, block_n):
    """Which keys each query tile may see, and which queries each key tile may be seen by, from
    segments alone (causal and window bounds are applied inside the kernels).

    Returns kv_lo, kv_hi [B, cdiv(T, block_m)] and q_lo, q_hi [B, cdiv(S, block_n)], int32, [lo, hi)."""
    T, S = qseg_bt.shape[1], kseg_bs.shape[1]
    # Keys a query sees: its own segment's first..last key, or, when global, every non-padding key.
    first_bt, last_bt = _first_last_match(qseg_bt, kseg_bs)
    kvalid_bs = kseg_bs >= 0
    any_first_b = jnp.where(kvalid_bs.any(-1), jnp.argmax(kvalid_bs, -1), S)
    any_last_b = jnp.where(kvalid_bs.any(-1), S - 1 - jnp.argmax(kvalid_bs[:, ::-1], -1), -1)
    lo_bt = jnp.where(glob_bt, any_first_b[:, None], first_bt)
    hi_bt = jnp.where(glob_bt, any_last_b[:, None], last_bt) + 1
    seen = (qseg_bt >= 0) & (hi_bt > lo_bt)
    kv_lo, kv_hi = _tile_bounds(jnp.where(seen, lo_bt, S), jnp.where(seen, hi_bt, 0), block_m, S)
    # Queries that see a key: those of its segment, and every global non-padding query.
    first_bs, last_bs = _first_last_match(kseg_bs, qseg_bt)
    gvalid_bt = glob_bt & (qseg_bt >= 0)
    g_first_b = jnp.where(gvalid_bt.any(-1), jnp.argmax(gvalid_bt, -1), T)
    g_last_b = jnp.where(gvalid_bt.any(-1), T - 1 - jnp.argmax(gvalid_bt[:, ::-1], -1), -1)
    lo_bs = jnp.minimum(first_bs, g_first_b[:, None])
    hi_bs = jnp.maximum(last_bs, g_last_b[:, None]) + 1
    seen = kvalid_bs & (hi_bs > lo_bs)
    q_lo, q_hi = _tile_bounds(jnp.where(seen, lo_bs, T), jnp.where(seen, hi_bs, 0), block_n, T)
    return kv_lo, kv_hi, q_lo, q_hi


def _launch_config(q, k, causal, window, has_seg, block_m, block_n):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    return dict(
        T=T, S=S, N=N, K=K, H=H, BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), WINDOW=int(window or 0), HAS_SEG=bool(has_seg),
        # float32 inputs get exact float32 products (Triton's default for them on GPU is TF32).
        IEEE=bool(q.dtype == jnp.float32),
    )


def _fwd_launch(cfg, q, k, v, seg, scale):
    qseg, glob, kseg, kv_lo, kv_hi, _, _ = seg
    B, T, N, H = q.shape
    num_q_tiles = cdiv(T, cfg["BLOCK_M"])
    return _triton.triton_call(
        q, k, v, qseg, glob, kseg, kv_lo, kv_hi, scale,
        kernel=_flash_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, T, N), jnp.float32)),
        grid=(num_q_tiles, B * N),
        NUM_Q_TILES=num_q_tiles,
        **cfg,
    )


def _bwd_launch(cfg, q, k, v, o, lse, seg, scale, do, dlse):
    qseg, glob, kseg, kv_lo, kv_hi, q_lo, q_hi = seg
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    # FlashAttention-2 preprocessing: delta = rowsum(dO * O). d lse / d s = p, so an lse cotangent
    # enters as ds = p * (dp - delta + dlse), i.e. it is folded into delta.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
    # Rows that see no key have p = 0 everywhere; keep a non-finite dlse there from making 0 * inf.
    delta = jnp.where(jnp.isneginf(lse), 0.0, delta)
    num_q_tiles, num_k_tiles = cdiv(T, cfg["BLOCK_M"]), cdiv(S, cfg["BLOCK_N"])
    do = do.astype(q.dtype)
    dq = _triton.triton_call(
        q, k, v, do, lse, delta, qseg, glob, kseg, kv_lo, kv_hi, scale,
        kernel=_flash_bwd_dq_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_q_tiles, B * N),
        NUM_Q_TILES=num_q_tiles,
        **cfg,
    )
    dk, dv = _triton.triton_call(
        q, k, v, do, lse, delta, qseg, glob, kseg, q_lo, q_hi, scale,
        kernel=_flash_bwd_dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(num_k_tiles, B * K),
        NUM_K_TILES=num_k_tiles,
        **cfg,
    )
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_triton(cfg_items, scale, q, k, v, seg):
    return _fwd_launch(dict(cfg_items), q, k, v, seg, scale)


def _flash_triton_fwd(cfg_items, scale, q, k, v, seg):
    o, lse = _fwd_launch(dict(cfg_items), q, k, v, seg, scale)
    return (o, lse), (q, k, v, o, lse, seg)


def _flash_triton_bwd(cfg_items, scale, res, cotangents):
    q, k, v, o, lse, seg = res
    do, dlse = cotangents
    dq, dk, dv = _bwd_launch(dict(cfg_items), q, k, v, o, lse, seg, scale, do, dlse)
    return dq, dk, dv, None


_flash_triton.defvjp(_flash_triton_fwd, _flash_triton_bwd)


def flash_attention_triton(
    q,
    k,
    v,
    *,
    causal=True,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    is_global=None,
    scale=None,
    return_lse=False,
    block_m=64,
    block_n=64,
):
    """The Triton face: FlashAttention-2 forward and backward kernels under `jax.custom_vjp`.

    Rules and shapes as in the module docstring. Programs: forward and dQ one per (query tile,
    b * N + n), dK/dV one per (key tile, b * K + kv head) looping over the N // K query heads of its
    group. Each program visits only the tiles its causal / window bounds allow and, with segments,
    the tiles inside [lo, hi) bounds computed per tile in JAX, so with contiguous documents fully
    masked tiles are skipped. block_m / block_n: tile sizes (powers of two, >= 16)."""
    _triton.require()
    B, T, N, H, S, K = _check_args(q, k, v, causal, window, q_segment_ids, kv_segment_ids, is_global, scale)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(blk, int) or blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk!r}")
    if T == 0 or S == 0:
        o = jnp.zeros((B, T, N, H), q.dtype)
        lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
        return (o, lse) if return_lse else o
    scale = float(H**-0.5 if scale is None else scale)
    has_seg = q_segment_ids is not None
    if has_seg:
        qseg = q_segment_ids.astype(jnp.int32)
        kseg = kv_segment_ids.astype(jnp.int32)
        glob = jnp.zeros((B, T), bool) if is_global is None else is_global
        bounds = _segment_tile_bounds(qseg, kseg, glob, block_m, block_n)
        seg = (qseg, glob.astype(jnp.int32), kseg) + bounds
    else:
        # Never read (HAS_SEG is off) but the kernels take a pointer for each.
        dummy = jnp.zeros((1,), jnp.int32)
        seg = (dummy,) * 7
    cfg = _launch_config(q, k, causal, window, has_seg, block_m, block_n)
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    o, lse = _flash_triton(tuple(sorted(cfg.items())), scale, q, k, v, seg)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def flash_attention(
    q,
    k,
    v,
    *,
    causal=True,
    window=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    is_global=None,
    scale=None,
    impl="auto",
    return_lse=False,
):
    """q [B,T,N,H]; k, v [B,S,K,H] (GQA: N % K == 0, query head n uses kv head n // (N//K)).

    Returns o [B,T,N,H] (q.dtype), and with return_lse also lse [B,T,N] float32 (natural-log
    sum-exp of the scaled scores over visible keys; -inf where no key is visible, o = 0 there).
    Query i sits at absolute position i + (S - T) (queries are the last T positions of the keys).
    Key j is visible to query i iff all of:
      causal: j <= i + S - T
      window (int w): j > i + S - T - w          (keys (t-w, t], REFERENCE section 7)
      segments (q_segment_ids [B,T], kv_segment_ids [B,S] int32, both or neither):
          kv_segment_ids[j] >= 0 and q_segment_ids[i] >= 0 and
          (q_segment_ids[i] == kv_segment_ids[j] or is_global[i])
      is_global [B,T] bool (optional, only with segments): a global query sees keys of every segment.
    scale defaults to H**-0.5. impl: "auto" (Triton on a CUDA device, XLA elsewhere), "xla" or
    "triton"."""
    kwargs = dict(
        causal=causal, window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        is_global=is_global, scale=scale, return_lse=return_lse,
    )
    if _triton.use_triton(impl):
        return flash_attention_triton(q, k, v, **kwargs)
    return flash_attention_reference(q, k, v, **kwargs)
