"""Squid attention: document-level attention whose per-document keys and values are reusable.

A packed sequence holds documents D_1..D_m and one global segment (docs/reference.md §8):

* a document token attends causally within its own document only;
* a global token attends to every token of every document, and causally within the global
  segment (here: to every earlier non-padding token, causally, whatever its segment);
* padding tokens (segment id -1) see nothing and are seen by nobody; their output is 0.

So a document's keys and values at every layer depend on that document alone and can be cached
and reused in any subset and order; only the global segment is computed per request.

Shapes: q [B,T,N,H]; k, v [B,T,K,H] (GQA: query head n reads kv head n // (N // K));
segment_ids [B,T] int32 (document index, -1 = padding); is_global [B,T] bool.

Faces (docs/architecture.md, "Kernels"):

* `squid_attention_reference` – XLA. The sequence is cut into blocks of `block` tokens; each
  query block loops (a `while` loop with data-dependent bounds) only over the key blocks between
  the first key any of its queries can see and its own causal bound, with an online softmax
  (FlashAttention, Dao et al. 2022). Cost therefore scales with sum_d |D_d|^2 + |global| * T for
  contiguous documents, not T^2. Differentiable through a hand-written backward with the same
  loop structure (reverse-mode autodiff cannot go through loops with data-dependent bounds).
* `squid_attention_triton` – the varlen Triton flash kernel of `kernels.flash` with the squid
  mask; it never visits a fully masked key tile when documents are contiguous.
* `squid_attention(..., impl="auto")` – the dispatcher.

`global_attention` is the reuse path: global-segment queries against cached document keys
(T_q != T_kv, no causal mask) merged by log-sum-exp with the segment's own causal attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import _triton, flash


def _check(q, k, v, segment_ids, is_global):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B,T,N,H] / [B,T,K,H], got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    B, T, N, H = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != H:
        raise ValueError(f"k and v must be [B={B}, T={T}, K, H={H}], got {k.shape} and {v.shape}")
    if N % k.shape[2]:
        raise ValueError(f"num heads {N} must be a multiple of kv heads {k.shape[2]}")
    if segment_ids.shape != (B, T) or is_global.shape != (B, T):
        raise ValueError(f"segment_ids and is_global must be [B={B}, T={T}], got {segment_ids.shape}, {is_global.shape}")


def first_visible_key(segment_ids_t: jax.Array, is_global_t: jax.Array) -> jax.Array:
    """[T] index of the first key each query may see: 0 for global queries, else the first index of
    its segment (segments need not be contiguous); T for padding queries."""
    T = segment_ids_t.shape[0]
    order = jnp.argsort(segment_ids_t, stable=True)
    seg_sorted = segment_ids_t[order]
    new_group = jnp.concatenate([jnp.ones((1,), bool), seg_sorted[1:] != seg_sorted[:-1]])
    group_start = jax.lax.cummax(jnp.where(new_group, jnp.arange(T), 0))
    first_sorted = order[group_start]  # a stable sort puts each segment's smallest index first
    first = jnp.zeros((T,), jnp.int32).at[order].set(first_sorted.astype(jnp.int32))
    first = jnp.where(is_global_t, 0, first)
    return jnp.where(segment_ids_t < 0, T, first)


def _block_ranges(segment_ids_t, is_global_t, block):
    """Per query block, the half-open range of key blocks that holds every key it can see."""
    T = segment_ids_t.shape[0]
    nb = -(-T // block)
    pad = nb * block - T
    first = jnp.pad(first_visible_key(segment_ids_t, is_global_t), (0, pad), constant_values=T)
    last = jnp.where(segment_ids_t < 0, -1, jnp.arange(T))
    last = jnp.pad(last, (0, pad), constant_values=-1)
    lo = jnp.min(first.reshape(nb, block), axis=1) // block
    hi = jnp.max(last.reshape(nb, block), axis=1) // block + 1
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _visible(i, j, block, seg, glob):
    qpos = i * block + jnp.arange(block)
    kpos = j * block + jnp.arange(block)
    qseg = jax.lax.dynamic_slice_in_dim(seg, i * block, block)
    kseg = jax.lax.dynamic_slice_in_dim(seg, j * block, block)
    qglob = jax.lax.dynamic_slice_in_dim(glob, i * block, block)
    same = (qseg[:, None] == kseg[None, :]) | qglob[:, None]
    return (kpos[None, :] <= qpos[:, None]) & (kseg[None, :] >= 0) & (qseg[:, None] >= 0) & same  # [C, C]


def _prepare(q, k, v, segment_ids, is_global, block):
    """Pad one row to whole blocks (padding is segment -1) and group query heads by kv head."""
    T, N, H = q.shape
    K = k.shape[1]
    nb = -(-T // block)
    pad = nb * block - T
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nb * block, K, N // K, H)
    kp = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
    seg = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    glob = jnp.pad(is_global, (0, pad))
    return qp, kp, vp, seg, glob, nb


def _forward_row(q, k, v, segment_ids, is_global, scale, block):
    """One row: q [T,N,H], k/v [T,K,H] -> (o [T,N,H] float32, lse [T,N] float32)."""
    T, N, H = q.shape
    K = k.shape[1]
    R = N // K
    qp, kp, vp, seg, glob, nb = _prepare(q, k, v, segment_ids, is_global, block)
    lo, hi = _block_ranges(segment_ids, is_global, block)

    def query_block(i):
        q_ckrh = jax.lax.dynamic_slice_in_dim(qp, i * block, block).astype(jnp.float32)

        def body(j, carry):
            m, l, acc = carry
            k_ckh = jax.lax.dynamic_slice_in_dim(kp, j * block, block).astype(jnp.float32)
            v_ckh = jax.lax.dynamic_slice_in_dim(vp, j * block, block).astype(jnp.float32)
            s = jnp.einsum("ckrh,skh->krcs", q_ckrh, k_ckh) * scale
            vis = _visible(i, j, block, seg, glob)
            s = jnp.where(vis[None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
            l = l * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("krcs,skh->krch", p, v_ckh)
            return m_new, l, acc

        init = (
            jnp.full((K, R, block), -jnp.inf, jnp.float32),
            jnp.zeros((K, R, block), jnp.float32),
            jnp.zeros((K, R, block, H), jnp.float32),
        )
        m, l, acc = jax.lax.fori_loop(lo[i], hi[i], body, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + jnp.where(jnp.isfinite(m), m, 0.0), -jnp.inf)
        return o.transpose(2, 0, 1, 3).reshape(block, N, H), lse.transpose(2, 0, 1).reshape(block, N)

    o, lse = jax.lax.map(query_block, jnp.arange(nb))
    return o.reshape(nb * block, N, H)[:T], lse.reshape(nb * block, N)[:T]


def _backward_row(q, k, v, segment_ids, is_global, o, lse, do, scale, block):
    """Gradients of one row (FlashAttention-2's backward, Dao 2023, with the same block ranges)."""
    T, N, H = q.shape
    K = k.shape[1]
    R = N // K
    qp, kp, vp, seg, glob, nb = _prepare(q, k, v, segment_ids, is_global, block)
    lo, hi = _block_ranges(segment_ids, is_global, block)
    Tp = nb * block
    pad = Tp - T

    def grouped(x_tn):  # [T, N, ...] -> [Tp, K, R, ...] float32
        x = jnp.pad(x_tn.astype(jnp.float32), ((0, pad),) + ((0, 0),) * (x_tn.ndim - 1))
        return x.reshape((Tp, K, R) + x_tn.shape[2:])

    do_p = grouped(do)
    lse_p = grouped(jnp.where(jnp.isfinite(lse), lse, jnp.inf))  # exp(s - inf) = 0 for empty rows
    delta_p = grouped(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1))

    def query_block(carry, i):
        dk_all, dv_all = carry
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * block, block)  # noqa: E731
        q_ckrh = sl(qp).astype(jnp.float32)
        do_ckrh, lse_ckr, delta_ckr = sl(do_p), sl(lse_p), sl(delta_p)

        def body(j, inner):
            dq, dk_all, dv_all = inner
            k_ckh = jax.lax.dynamic_slice_in_dim(kp, j * block, block).astype(jnp.float32)
            v_ckh = jax.lax.dynamic_slice_in_dim(vp, j * block, block).astype(jnp.float32)
            s = jnp.einsum("ckrh,skh->krcs", q_ckrh, k_ckh) * scale
            vis = _visible(i, j, block, seg, glob)
            p = jnp.where(vis[None, None], jnp.exp(s - lse_ckr.transpose(1, 2, 0)[..., None]), 0.0)
            dv = jnp.einsum("krcs,ckrh->skh", p, do_ckrh)
            dp = jnp.einsum("ckrh,skh->krcs", do_ckrh, v_ckh)
            ds = p * (dp - delta_ckr.transpose(1, 2, 0)[..., None]) * scale
            dq = dq + jnp.einsum("krcs,skh->ckrh", ds, k_ckh)
            dk = jnp.einsum("krcs,ckrh->skh", ds, q_ckrh)
            upd = lambda buf, g: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                buf, jax.lax.dynamic_slice_in_dim(buf, j * block, block) + g, j * block, axis=0
            )
            return dq, upd(dk_all, dk), upd(dv_all, dv)

        dq0 = jnp.zeros((block, K, R, H), jnp.float32)
        dq, dk_all, dv_all = jax.lax.fori_loop(lo[i], hi[i], body, (dq0, dk_all, dv_all))
        return (dk_all, dv_all), dq

    zeros = jnp.zeros((Tp, K, H), jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(nb))
    dq = dq.reshape(Tp, N, H)[:T]
    return dq.astype(q.dtype), dk[:T].astype(k.dtype), dv[:T].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _squid_xla(q, k, v, segment_ids, is_global, scale, block):
    o, _ = jax.vmap(_forward_row, in_axes=(0, 0, 0, 0, 0, None, None))(q, k, v, segment_ids, is_global, scale, block)
    return o.astype(q.dtype)


def _squid_xla_fwd(q, k, v, segment_ids, is_global, scale, block):
    o, lse = jax.vmap(_forward_row, in_axes=(0, 0, 0, 0, 0, None, None))(q, k, v, segment_ids, is_global, scale, block)
    return o.astype(q.dtype), (q, k, v, segment_ids, is_global, o, lse)


def _squid_xla_bwd(scale, block, res, do):
    q, k, v, segment_ids, is_global, o, lse = res
    dq, dk, dv = jax.vmap(_backward_row, in_axes=(0,) * 8 + (None, None))(
        q, k, v, segment_ids, is_global, o, lse, do, scale, block
    )
    return dq, dk, dv, None, None


_squid_xla.defvjp(_squid_xla_fwd, _squid_xla_bwd)


def squid_attention_reference(q, k, v, segment_ids, is_global, *, scale=None, block=128):
    """The XLA face; see the module docstring. Returns [B,T,N,H] in q.dtype."""
    _check(q, k, v, segment_ids, is_global)
    if block <= 0:
        raise ValueError(f"block must be > 0, got {block}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _squid_xla(q, k, v, segment_ids.astype(jnp.int32), is_global.astype(bool), scale, int(block))


def squid_attention_triton(q, k, v, segment_ids, is_global, *, scale=None, **block_sizes):
    """The Triton face: the varlen flash kernel with the squid mask."""
    _check(q, k, v, segment_ids, is_global)
    seg = segment_ids.astype(jnp.int32)
    return flash.flash_attention_triton(
        q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, is_global=is_global.astype(bool), scale=scale,
        **block_sizes,
    )


def squid_attention(q, k, v, segment_ids, is_global, *, scale=None, impl="auto"):
    """Squid attention over a packed sequence (docs/reference.md §8); impl 'auto' | 'xla' | 'triton'."""
    if _triton.use_triton(impl):
        return squid_attention_triton(q, k, v, segment_ids, is_global, scale=scale)
    return squid_attention_reference(q, k, v, segment_ids, is_global, scale=scale)


def merge_partials(parts):
    """Combine partial softmax attentions over disjoint key sets, [(out [...,H], lse [...]), ...],
    by their log-sum-exps. A part with lse = -inf (no visible key) contributes nothing."""
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = jnp.logaddexp(lse, part_lse)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    out = sum(jnp.where(jnp.isfinite(pl), jnp.exp(pl - lse_safe), 0.0)[..., None] * o.astype(jnp.float32) for o, pl in parts)
    return out, lse


def global_attention(q, k, v, doc_k, doc_v, doc_valid, *, scale=None, impl="auto"):
    """Global-segment attention against cached documents.

    q [B,Tg,N,H], k/v [B,Tg,K,H]: the global segment's own queries/keys/values (right-padded
    rows are fine: padding sits after the real tokens and causality hides it); doc_k/doc_v
    [B,S,K,H] the cached keys/values of the documents laid side by side; doc_valid [B,S] bool.
    Each global query sees every valid document key and, causally, the global segment; the two
    partial attentions are merged by log-sum-exp. Returns [B,Tg,N,H] in q.dtype.
    """
    B, Tg = q.shape[:2]
    if doc_k.shape != doc_v.shape or doc_k.shape[0] != B or doc_k.shape[2:] != k.shape[2:]:
        raise ValueError(f"doc_k/doc_v must be [B={B}, S, K, H] like k {k.shape}, got {doc_k.shape}, {doc_v.shape}")
    if doc_valid.shape != doc_k.shape[:2]:
        raise ValueError(f"doc_valid must be [B, S] = {doc_k.shape[:2]}, got {doc_valid.shape}")
    q_seg = jnp.zeros((B, Tg), jnp.int32)
    kv_seg = jnp.where(doc_valid, 0, -1).astype(jnp.int32)
    o_doc, lse_doc = flash.flash_attention(
        q, doc_k, doc_v, causal=False, q_segment_ids=q_seg, kv_segment_ids=kv_seg, scale=scale, impl=impl, return_lse=True
    )
    o_self, lse_self = flash.flash_attention(q, k, v, causal=True, scale=scale, impl=impl, return_lse=True)
    out, _ = merge_partials([(o_doc, lse_doc), (o_self, lse_self)])
    return out.astype(q.dtype)
