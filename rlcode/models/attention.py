"""Attention: the one place that chooses the implementation (dense now; nsa and squid register).

An attention kind is an `nnx.Module` class registered under a name with `@register_attention`;
the model builds `ATTENTION[cfg.attention.kind](cfg, rngs=rngs)` and never branches on the kind.
Every kind implements the same two calls:

* `__call__(x_btd, positions_bt, mask) -> (y_btd, KVCache)` – a full causal forward over a
  sequence (training, prefill); it returns the layer's keys/values so a sampler can cache them.
* `init_suffix_cache(batch, max_len)` – the empty per-row cache of generated tokens that `decode`
  fills (a KVCache for dense attention; a kind may keep more, e.g. NSA's compressed keys).
* `decode(x_bd, positions_b, prefix, prefix_lengths, suffix, step) -> (y_bd, suffix)` – one new
  token per row against a shared-prefix cache: `prefix` holds the keys/values of Pg prompts
  (prefilled once), row b of the B = Pg * G rows belongs to prompt b // G, and `suffix` holds
  each row's own generated keys/values (slot `step` is written by this call).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlcode.models.layers import RMSNorm, apply_rope, fan_in_init, make_param
from rlcode.models.registry import Registry
from rlcode.sharding import constrain

ATTENTION = Registry("attention")
register_attention = ATTENTION.register
make_attention = ATTENTION.build


class KVCache(NamedTuple):
    """Keys and values of one layer: k, v [B, S, K, H]."""

    k: jax.Array
    v: jax.Array


class AttentionMask(NamedTuple):
    """What a query may see, on top of causality.

    segment_ids [B, T]: tokens attend only within their own segment (packed sequences; use 0 for
      padding). kv_lengths [B]: keys at positions >= length are padding (right padding). Either or
      neither may be given; with neither, every key is valid. The kv_lengths form keeps the mask
      implicit, which lets `jax.nn.dot_product_attention` pick a fused (cuDNN) kernel on GPU.
    """

    segment_ids: jax.Array | None = None
    kv_lengths: jax.Array | None = None


class QKVProjection(nnx.Module):
    """Grouped-query projections with optional QK-norm (RMSNorm over the head dim) and RoPE."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if N % K:
            raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
        pd = cfg.param_dtype
        self.cfg = cfg
        self.wq = make_param(rngs, fan_in_init((0,)), (D, N, H), ("embed", "heads", "head_dim"), pd)
        self.wk = make_param(rngs, fan_in_init((0,)), (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = make_param(rngs, fan_in_init((0,)), (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = make_param(rngs, fan_in_init((0, 1)), (N, H, D), ("heads", "head_dim", "embed"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, eps=cfg.norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(H, eps=cfg.norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)

    def qkv(self, x_btd: jax.Array, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = self.cfg.dtype
        x = x_btd.astype(dt)
        q = jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.wk[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.wv[...].astype(dt))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions_bt, self.cfg.rope_theta)
        k = apply_rope(k, positions_bt, self.cfg.rope_theta)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        return q, k, v

    def out(self, o_btnh: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        return jnp.einsum("btnh,nhd->btd", o_btnh.astype(dt), self.wo[...].astype(dt))


def _masked_partial_attention(q_bkrh, k_bskh, v_bskh, valid_bs, scale):
    """Softmax attention of grouped queries over a masked key set, with its log-sum-exp.

    q [B, K, R, H] (R = query heads per kv head), k/v [B, S, K, H], valid [B, S].
    Returns (out [B, K, R, H] float32, lse [B, K, R] float32); lse = -inf where no key is valid.
    """
    s = jnp.einsum("bkrh,bskh->bkrs", q_bkrh.astype(jnp.float32), k_bskh.astype(jnp.float32)) * scale
    s = jnp.where(valid_bs[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    denom = jnp.sum(p, axis=-1)
    out = jnp.einsum("bkrs,bskh->bkrh", p, v_bskh.astype(jnp.float32)) / jnp.maximum(denom, 1e-30)[..., None]
    lse = jnp.where(denom > 0, jnp.log(jnp.maximum(denom, 1e-30)) + m_safe[..., 0], -jnp.inf)
    return out, lse


def merge_attention(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Combine partial softmax attentions over disjoint key sets by their log-sum-exps."""
    lse = parts[0][1]
    for _, l in parts[1:]:
        lse = jnp.logaddexp(lse, l)
    return sum(jnp.exp(l - lse)[..., None] * o for o, l in parts)


@register_attention("dense")
class DenseAttention(nnx.Module):
    """Causal grouped-query attention through `jax.nn.dot_product_attention`."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.proj = QKVProjection(cfg, rngs=rngs)

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask: AttentionMask) -> tuple[jax.Array, KVCache]:
        q, k, v = self.proj.qkv(x_btd, positions_bt)
        T = x_btd.shape[1]
        if mask.segment_ids is not None:
            seg = mask.segment_ids
            causal = jnp.tril(jnp.ones((T, T), bool))
            full = causal[None] & (seg[:, :, None] == seg[:, None, :])
            if mask.kv_lengths is not None:
                full = full & (jnp.arange(T)[None, None, :] < mask.kv_lengths[:, None, None])
                # A padding query would see no key at all; let it see itself (its output is unused).
                full = full | jnp.eye(T, dtype=bool)[None]
            o = jax.nn.dot_product_attention(q, k, v, mask=full[:, None])
        else:
            lengths = None if mask.kv_lengths is None else jnp.maximum(mask.kv_lengths.astype(jnp.int32), 1)
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
        o = constrain(o, ("batch", "seq", "heads", "head_dim"))
        return self.proj.out(o), KVCache(k, v)

    def init_suffix_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return KVCache(jnp.zeros(shape, self.cfg.dtype), jnp.zeros(shape, self.cfg.dtype))

    def decode(
        self,
        x_bd: jax.Array,
        positions_b: jax.Array,
        prefix: KVCache,
        prefix_lengths: jax.Array,
        suffix: KVCache,
        step: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        B = x_bd.shape[0]
        Pg = prefix.k.shape[0]
        G = B // Pg
        K, R, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.proj.qkv(x_bd[:, None], positions_b[:, None])
        suffix = KVCache(
            jax.lax.dynamic_update_slice_in_dim(suffix.k, k.astype(suffix.k.dtype), step, axis=1),
            jax.lax.dynamic_update_slice_in_dim(suffix.v, v.astype(suffix.v.dtype), step, axis=1),
        )
        scale = H**-0.5
        q_bkrh = q[:, 0].reshape(B, K, R, H)
        # The prompt's keys are read once per group: G rows' queries are stacked against them.
        q_prefix = q_bkrh.reshape(Pg, G, K, R, H).transpose(0, 2, 1, 3, 4).reshape(Pg, K, G * R, H)
        S_p = prefix.k.shape[1]
        valid_p = jnp.arange(S_p)[None, :] < prefix_lengths[:, None]
        o_p, lse_p = _masked_partial_attention(q_prefix, prefix.k, prefix.v, valid_p, scale)
        o_p = o_p.reshape(Pg, K, G, R, H).transpose(0, 2, 1, 3, 4).reshape(B, K, R, H)
        lse_p = lse_p.reshape(Pg, K, G, R).transpose(0, 2, 1, 3).reshape(B, K, R)
        S_s = suffix.k.shape[1]
        valid_s = jnp.broadcast_to(jnp.arange(S_s)[None, :] <= step, (B, S_s))
        o_s, lse_s = _masked_partial_attention(q_bkrh, suffix.k, suffix.v, valid_s, scale)
        o = merge_attention([(o_p, lse_p), (o_s, lse_s)])
        y = self.proj.out(o.reshape(B, 1, K * R, H))
        return y[:, 0], suffix
