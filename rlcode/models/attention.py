"""Attention: the one place that chooses the implementation (dense, nsa, squid).

An attention kind is an `nnx.Module` class listed under its name in
`rlcode.models.registry.ATTENTION` (`register_attention(kind)` adds one at run time); the model
builds `ATTENTION[cfg.attention.kind](cfg, rngs=rngs)` and never branches on the kind.
Every kind implements the same three calls:

* `__call__(x_btd, positions_bt, mask) -> (y_btd, KVCache)` – a full causal forward over a
  sequence (training, prefill); it returns the layer's keys/values so a sampler can cache them.
* `init_suffix_cache(batch, max_len)` – the empty per-row cache of generated tokens that `decode`
  fills (a KVCache for dense attention; a kind may keep more, e.g. NSA's compressed keys).
* `decode(x_bd, positions_b, prefix, prefix_lengths, suffix, step) -> (y_bd, suffix)` – one new
  token per row against a shared-prefix cache: `prefix` holds the keys/values of Pg prompts
  (prefilled once), row b of the B = Pg * G rows belongs to prompt b // G, and `suffix` holds
  each row's own generated keys/values (slot `step` is written by this call; dense and squid
  attention also take one step per row [B], each row's own slot, for continuous batching).

Squid attention adds `attend_context(x_btd, positions_bt, context, context_valid)`: a global
segment against cached document keys/values (`rlcode.sampling.encode_documents`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kernels import nsa as nsa_kernels
from kernels import squid as squid_kernels
from rlcode.models.layers import RMSNorm, apply_rope, fan_in_init, make_param, project
from rlcode.models.registry import ATTENTION
from rlcode.sharding import constrain

register_attention = ATTENTION.register
make_attention = ATTENTION.build


# Every option of each kind with its default; `attention_config` fills a config section from it.
ATTENTION_OPTIONS = {
    "dense": {},
    "squid": {"impl": "auto"},
    # docs/reference.md §7 defaults; cmp_hidden 0 = 2 * head_dim (width of the compression MLP).
    "nsa": {"block_len": 32, "stride": 16, "select_size": 64, "num_select": 16, "window": 512, "shared_kv": True,
            "cmp_hidden": 0, "impl": "auto"},
}


def attention_config(kind: str = "dense", **overrides: Any) -> dict[str, Any]:
    """The `model.attention` section of a kind with every option present (so each can be overridden
    from the command line), e.g. attention_config("nsa", window=64)."""
    if kind not in ATTENTION_OPTIONS:
        raise ValueError(f"unknown attention kind {kind!r}; known: {sorted(ATTENTION_OPTIONS)}")
    unknown = set(overrides) - set(ATTENTION_OPTIONS[kind])
    if unknown:
        raise ValueError(f"attention kind {kind!r} has no option(s) {sorted(unknown)}; it has {sorted(ATTENTION_OPTIONS[kind])}")
    return {"kind": kind, **ATTENTION_OPTIONS[kind], **overrides}


def _options(cfg: Any, kind: str) -> dict[str, Any]:
    return {**ATTENTION_OPTIONS[kind], **dict(cfg.attention)}


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
    is_global [B, T] bool: only read by squid attention, where segments are documents (-1 =
      padding) and a global token sees every document (docs/reference.md §8).
    """

    segment_ids: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    is_global: jax.Array | None = None


class QKVProjection(nnx.Module):
    """Grouped-query projections with optional biases (`qkv_bias`), QK-norm (RMSNorm over the
    head dim, after the biases) and RoPE. `rlcode.models.lora.add_lora` may give a projection a
    low-rank adapter (attribute lora_q, lora_k, lora_v or lora_o)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if N % K:
            raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
        pd = cfg.param_dtype
        self.cfg = cfg
        self.wq = make_param(rngs, fan_in_init((0,)), (D, N, H), ("embed", "heads", "head_dim"), pd)
        self.wk = make_param(rngs, fan_in_init((0,)), (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = make_param(rngs, fan_in_init((0,)), (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = make_param(rngs, fan_in_init((0, 1)), (N, H, D), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.bq = make_param(rngs, zeros, (N, H), ("heads", "head_dim"), pd)
            self.bk = make_param(rngs, zeros, (K, H), ("kv_heads", "head_dim"), pd)
            self.bv = make_param(rngs, zeros, (K, H), ("kv_heads", "head_dim"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, eps=cfg.norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(H, eps=cfg.norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)

    def qkv(self, x_btd: jax.Array, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = self.cfg.dtype
        x = x_btd.astype(dt)
        q = project("btd,dnh->btnh", x, self.wq[...].astype(dt), getattr(self, "lora_q", None))
        k = project("btd,dkh->btkh", x, self.wk[...].astype(dt), getattr(self, "lora_k", None))
        v = project("btd,dkh->btkh", x, self.wv[...].astype(dt), getattr(self, "lora_v", None))
        if self.cfg.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions_bt, self.cfg.rope)
        k = apply_rope(k, positions_bt, self.cfg.rope)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"), self.placement)
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"), self.placement)
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"), self.placement)
        return q, k, v

    def out(self, o_btnh: jax.Array) -> jax.Array:
        dt = self.cfg.dtype
        return project("btnh,nhd->btd", o_btnh.astype(dt), self.wo[...].astype(dt), getattr(self, "lora_o", None))


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
    return squid_kernels.merge_partials(parts)[0]


class DenseAttention(nnx.Module):
    """Causal grouped-query attention through `jax.nn.dot_product_attention`."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
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
        o = constrain(o, ("batch", "seq", "heads", "head_dim"), self.placement)
        return self.proj.out(o), KVCache(k, v)

    def shared_prefix(self, xp: jax.Array, pp: jax.Array, prefix_lengths: jax.Array, xc: jax.Array,
                      pc: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Groups of rows that share a prompt, the prompt computed once per group.

        xp [P, Lp, D] prompts at positions pp (right padding; prefix_lengths [P] valid tokens),
        xc [B, Lc, D] the rows' own tokens at positions pc, B = P * G (rows b*G..b*G+G-1 share
        prompt b). A prompt attends causally within itself; a row's token attends to its prompt's
        valid tokens and causally to its own. Equals the causal attention of each row laid out as
        prompt + own tokens (`Transformer.forward_shared`). Returns (yp, yc)."""
        qp, kp, vp = self.proj.qkv(xp, pp)
        qc, kc, vc = self.proj.qkv(xc, pc)
        P, Lp = xp.shape[:2]
        B, Lc = xc.shape[:2]
        G = B // P
        lengths = jnp.maximum(prefix_lengths.astype(jnp.int32), 1)
        op = jax.nn.dot_product_attention(qp, kp, vp, is_causal=True, key_value_seq_lengths=lengths)
        k = jnp.concatenate([jnp.repeat(kp, G, axis=0), kc], axis=1)  # the prompt's gradients sum over its rows
        v = jnp.concatenate([jnp.repeat(vp, G, axis=0), vc], axis=1)
        prompt_valid = jnp.arange(Lp)[None, :] < jnp.repeat(lengths, G)[:, None]  # [B, Lp]
        mask = jnp.concatenate([jnp.broadcast_to(prompt_valid[:, None, :], (B, Lc, Lp)),
                                jnp.broadcast_to(jnp.tril(jnp.ones((Lc, Lc), bool))[None], (B, Lc, Lc))], axis=2)
        oc = jax.nn.dot_product_attention(qc, k, v, mask=mask[:, None])
        op = constrain(op, ("batch", "seq", "heads", "head_dim"), self.placement)
        oc = constrain(oc, ("batch", "seq", "heads", "head_dim"), self.placement)
        return self.proj.out(op), self.proj.out(oc)

    def attend_context(
        self, x_btd: jax.Array, positions_bt: jax.Array, context: KVCache, context_valid: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """New tokens x [B,T,D] (right padding allowed) against cached keys and values
        context.k/v [B,S,K,H] where context_valid [B,S], and causally among themselves; returns
        (y, own KVCache). Under squid attention the context is cached documents (the global
        segment's reuse path); for any causal attention it is the already processed prefix, so
        this is chunked (incremental) prefill."""
        q, k, v = self.proj.qkv(x_btd, positions_bt)
        impl = _options(self.cfg, "squid")["impl"] if self.cfg.attention["kind"] == "squid" else "xla"
        o = squid_kernels.global_attention(q, k, v, context.k, context.v, context_valid, impl=impl)
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
        step = jnp.asarray(step)
        if step.ndim == 0:
            suffix = KVCache(
                jax.lax.dynamic_update_slice_in_dim(suffix.k, k.astype(suffix.k.dtype), step, axis=1),
                jax.lax.dynamic_update_slice_in_dim(suffix.v, v.astype(suffix.v.dtype), step, axis=1),
            )
        else:  # one slot per row (continuous batching: rows at different steps)
            rows = jnp.arange(B)
            suffix = KVCache(suffix.k.at[rows, step].set(k[:, 0].astype(suffix.k.dtype)),
                             suffix.v.at[rows, step].set(v[:, 0].astype(suffix.v.dtype)))
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
        valid_s = jnp.broadcast_to(jnp.arange(S_s)[None, :] <= step.reshape(-1, 1), (B, S_s))
        o_s, lse_s = _masked_partial_attention(q_bkrh, suffix.k, suffix.v, valid_s, scale)
        o = merge_attention([(o_p, lse_p), (o_s, lse_s)])
        y = self.proj.out(o.reshape(B, 1, K * R, H))
        return y[:, 0], suffix


class SquidAttention(DenseAttention):
    """Document-level attention whose per-document keys/values are reusable (docs/reference.md §8).

    Training / full forward: `mask.segment_ids` are document indices (-1 padding) and
    `mask.is_global` marks the global segment; without segment ids the whole sequence is one
    global segment (plain causal attention). `attend_context` (inherited) is the reuse path:
    the global segment's tokens against cached document keys/values. Decoding is the dense decode: generated tokens are global and see every cached key.
    Config: attention.impl ('auto' | 'xla' | 'triton').
    """

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask: AttentionMask) -> tuple[jax.Array, KVCache]:
        B, T = x_btd.shape[:2]
        q, k, v = self.proj.qkv(x_btd, positions_bt)
        if mask.segment_ids is None:
            seg = jnp.zeros((B, T), jnp.int32)
            glob = jnp.ones((B, T), bool)
        else:
            seg = mask.segment_ids.astype(jnp.int32)
            glob = jnp.zeros((B, T), bool) if mask.is_global is None else mask.is_global.astype(bool)
        if mask.kv_lengths is not None:
            seg = jnp.where(jnp.arange(T)[None, :] < mask.kv_lengths[:, None], seg, -1)
        o = squid_kernels.squid_attention(q, k, v, seg, glob, impl=_options(self.cfg, "squid")["impl"])
        o = constrain(o, ("batch", "seq", "heads", "head_dim"), self.placement)
        return self.proj.out(o), KVCache(k, v)


# ---------------------------------------------------------------------------------------------
# NSA: Native Sparse Attention (Yuan et al. 2025, arXiv 2502.11089; docs/reference.md §7)
# ---------------------------------------------------------------------------------------------


class NSACache(NamedTuple):
    """One NSA layer's cache: everything decoding reads besides the new token.

    kv: keys/values of the selection branch [B, S, K, H] (of all three branches with shared_kv);
    win: the window branch's, None with shared_kv; raw_cmp: the per-token keys/values the
    compression MLP reads, None with shared_kv (it reads kv then); cmp: compressed blocks
    [B, Sc, K, H]. In a full-forward (prefix) cache, cmp slot i is block i, tokens
    [i*d, i*d + l); in a suffix cache, slot s is the s-th block completed during generation,
    block num_compressed_blocks(prompt_length) + s.
    """

    kv: KVCache
    win: KVCache | None
    raw_cmp: KVCache | None
    cmp: KVCache


class SharedPrefix(NamedTuple):
    """Per-row sequences stored as prompts shared by groups of rows plus each row's own tail: the
    sampler's cache layout (`rlcode.sampling`), read by `kernels.nsa.nsa_decode` as a `TokenStore`.

    prefix [Pg, Sp, K, H]; lengths [Pg] int (valid prefix entries); suffix [B, Ss, K, H] with
    B = Pg * G. Entry u of row b is prefix[b // G, u] when u < lengths[b // G], else
    suffix[b, u - lengths[b // G]]. The prompt's keys are stored once per group; for compressed
    keys, lengths counts the blocks complete inside the prompt
    (`num_compressed_blocks(prompt_length, l, d)`), and suffix slot s is the s-th block completed
    during generation (`NSACache`).
    """

    prefix: jax.Array
    lengths: jax.Array
    suffix: jax.Array

    @property
    def capacity(self) -> int:
        """An upper bound on any row's length: Sp + Ss."""
        return self.prefix.shape[1] + self.suffix.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.prefix.shape[2]

    def gather(self, pos_bkx: jax.Array) -> jax.Array:
        """Entries at positions pos [B, K, X] of each row and kv head -> [B, K, X, H] (positions
        are clamped to each part's range; the reader masks those past a row's end)."""
        B, Kh = pos_bkx.shape[:2]
        G = B // self.prefix.shape[0]
        b = jnp.arange(B)[:, None, None]
        kh = jnp.arange(Kh)[None, :, None]
        plen = jnp.asarray(self.lengths, jnp.int32)[b // G]
        prefix, suffix = jnp.asarray(self.prefix), jnp.asarray(self.suffix)
        from_prefix = prefix[b // G, jnp.clip(pos_bkx, 0, prefix.shape[1] - 1), kh]
        from_suffix = suffix[b, jnp.clip(pos_bkx - plen, 0, suffix.shape[1] - 1), kh]
        return jnp.where((pos_bkx < plen)[..., None], from_prefix, from_suffix)


class NSACompression(nnx.Module):
    """phi of NSA eq. 7 for each kv head: a block's l tokens [l, H] plus a learned intra-block
    position embedding [l, H], flattened (l*H) and mapped by a 2-layer MLP (SiLU) to one [H]."""

    def __init__(self, block_len: int, num_kv_heads: int, head_dim: int, hidden: int, cfg: Any, *, rngs: nnx.Rngs):
        l, K, H, F, pd = block_len, num_kv_heads, head_dim, hidden, cfg.param_dtype
        self.dtype = cfg.dtype
        self.pos = make_param(rngs, nnx.initializers.normal(0.02), (l, K, H), (None, "kv_heads", "head_dim"), pd)
        self.w1 = make_param(rngs, fan_in_init((0, 2)), (l, K, H, F), (None, "kv_heads", "head_dim", None), pd)
        self.b1 = make_param(rngs, nnx.initializers.zeros, (K, F), ("kv_heads", None), pd)
        self.w2 = make_param(rngs, fan_in_init((1,)), (K, F, H), ("kv_heads", None, "head_dim"), pd)
        self.b2 = make_param(rngs, nnx.initializers.zeros, (K, H), ("kv_heads", "head_dim"), pd)

    def __call__(self, blocks_bilkh: jax.Array) -> jax.Array:
        """Blocks of tokens [B, I, l, K, H] -> compressed keys (or values) [B, I, K, H]."""
        dt = self.dtype
        x = blocks_bilkh.astype(dt) + self.pos[...].astype(dt)
        h = jnp.einsum("bilkh,lkhf->bikf", x, self.w1[...].astype(dt)) + self.b1[...].astype(dt)
        h = jax.nn.silu(h)
        return jnp.einsum("bikf,kfh->bikh", h, self.w2[...].astype(dt)) + self.b2[...].astype(dt)


class NSAAttention(nnx.Module):
    """Native Sparse Attention (NSA, Yuan et al. 2025, arXiv 2502.11089) as a model layer.

    o_t = sum over branches c in (cmp, slc, win) of g_t^c * Attn(q_t, K^c, V^c) with gates
    g = sigmoid(x_t W_g + b_g) [N, 3] (a linear gate, the smallest "MLP"). Queries and keys come
    from `QKVProjection` (RoPE, optional QK-norm); with shared_kv its keys/values serve all three
    branches, otherwise the compression and window branches have their own K/V projections (paper
    section 3.3.3). The compression branch's keys/values are `NSACompression` of blocks of the
    (RoPE'd) per-token keys/values, so decoding compresses exactly what the cache holds.

    Config (model.attention): kind="nsa", block_len l (32), stride d (16), select_size l' (64),
    num_select n (16), window w (512), shared_kv (True), cmp_hidden (0 = 2 * head_dim: width of the
    compression MLP), impl ("auto" | "xla" | "triton", for the full forward; decoding is jax.numpy).
    Sequences are not packed (segment_ids are rejected); right padding (kv_lengths) needs no mask,
    since a query sees only its past. Blocks are laid out by token index in the row (0..L-1;
    prompt_length + step while decoding); RoPE uses the given positions, which equal that index
    in the sampler.
    """

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        a = _options(cfg, "nsa")
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.param_dtype
        self.cfg = cfg
        self.sizes = nsa_kernels.check_sizes(
            a["block_len"], a["stride"], a["select_size"], a["num_select"], a["window"]
        )
        self.shared_kv = bool(a["shared_kv"])
        if cfg.qkv_bias and not self.shared_kv:
            raise ValueError("model.qkv_bias with attention.shared_kv=False: the NSA branches' own key/value "
                             "projections have no biases")
        self.impl = a["impl"]
        self.proj = QKVProjection(cfg, rngs=rngs)
        if not self.shared_kv:
            for branch in ("cmp", "win"):
                for kind in ("k", "v"):
                    w = make_param(rngs, fan_in_init((0,)), (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
                    setattr(self, f"w{kind}_{branch}", w)
                if cfg.qk_norm:
                    norm = RMSNorm(H, eps=cfg.norm_eps, axis_name="head_dim", param_dtype=pd, rngs=rngs)
                    setattr(self, f"k_norm_{branch}", norm)
        hidden = int(a["cmp_hidden"]) or 2 * H
        self.k_compress = NSACompression(self.sizes.block_len, K, H, hidden, cfg, rngs=rngs)
        self.v_compress = NSACompression(self.sizes.block_len, K, H, hidden, cfg, rngs=rngs)
        self.w_gate = make_param(rngs, fan_in_init((0,)), (D, N, 3), ("embed", "heads", None), pd)
        self.b_gate = make_param(rngs, nnx.initializers.zeros, (N, 3), ("heads", None), pd)

    def _branch_kv(self, x_btd: jax.Array, positions_bt: jax.Array, branch: str) -> KVCache:
        """Keys (normed like QKVProjection's, RoPE'd) and values of a branch's own projection."""
        dt = self.cfg.dtype
        x = x_btd.astype(dt)
        k = jnp.einsum("btd,dkh->btkh", x, getattr(self, f"wk_{branch}")[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, getattr(self, f"wv_{branch}")[...].astype(dt))
        if self.cfg.qk_norm:
            k = getattr(self, f"k_norm_{branch}")(k)
        return KVCache(apply_rope(k, positions_bt, self.cfg.rope), v)

    def _gates(self, x_btd: jax.Array) -> jax.Array:
        """sigmoid gates [B, T, N, 3] (cmp, slc, win), float32."""
        g = jnp.einsum("btd,dnc->btnc", x_btd.astype(jnp.float32), self.w_gate[...].astype(jnp.float32))
        return jax.nn.sigmoid(g + self.b_gate[...].astype(jnp.float32))

    def _branches(self, k, v, win: KVCache | None):
        if win is None:
            return k, v
        return {"slc": k, "win": win.k}, {"slc": v, "win": win.v}

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask: AttentionMask) -> tuple[jax.Array, NSACache]:
        if mask.segment_ids is not None:
            raise ValueError("attention.kind='nsa' does not support packed sequences (segment_ids)")
        l, d = self.sizes.block_len, self.sizes.stride
        q, k, v = self.proj.qkv(x_btd, positions_bt)
        win = raw = None
        if not self.shared_kv:
            win = self._branch_kv(x_btd, positions_bt, "win")
            raw = self._branch_kv(x_btd, positions_bt, "cmp")
        src = KVCache(k, v) if raw is None else raw
        T = x_btd.shape[1]
        Tc = nsa_kernels.num_compressed_blocks(T, l, d)
        idx = jnp.arange(Tc)[:, None] * d + jnp.arange(l)[None, :]  # [Tc, l] tokens of each block
        cmp = KVCache(self.k_compress(src.k[:, idx]), self.v_compress(src.v[:, idx]))
        kk, vv = self._branches(k, v, win)
        o = nsa_kernels.nsa_attention(
            q, kk, vv, cmp.k, cmp.v, self._gates(x_btd), **self.sizes._asdict(), impl=self.impl
        )
        o = constrain(o, ("batch", "seq", "heads", "head_dim"), self.placement)
        return self.proj.out(o), NSACache(KVCache(k, v), win, raw, cmp)

    def init_suffix_cache(self, batch: int, max_len: int) -> NSACache:
        """Empty per-row cache for max_len generated tokens; at most cdiv(max_len, d) compression
        blocks complete while they are generated."""
        K, H, dt = self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.dtype

        def empty(length):
            return KVCache(jnp.zeros((batch, length, K, H), dt), jnp.zeros((batch, length, K, H), dt))

        return NSACache(
            kv=empty(max_len),
            win=None if self.shared_kv else empty(max_len),
            raw_cmp=None if self.shared_kv else empty(max_len),
            cmp=empty(-(-max_len // self.sizes.stride)),
        )

    def decode(
        self,
        x_bd: jax.Array,
        positions_b: jax.Array,
        prefix: NSACache,
        prefix_lengths: jax.Array,
        suffix: NSACache,
        step: jax.Array,
    ) -> tuple[jax.Array, NSACache]:
        """One new token per row (token index prefix_lengths[b // G] + step) against the shared
        prefix cache and the row's suffix; writes suffix slot `step` and, when the token completes
        a compression block (t - l + 1 a multiple of d), that block, which may straddle the
        prompt/generation boundary."""
        l, d = self.sizes.block_len, self.sizes.stride
        B = x_bd.shape[0]
        G = B // prefix.kv.k.shape[0]
        K = self.cfg.num_kv_heads
        x, pos = x_bd[:, None], positions_b[:, None]
        plen = prefix_lengths.astype(jnp.int32)
        t = jnp.repeat(plen, G) + step

        def write(cache: KVCache, new: KVCache) -> KVCache:
            return KVCache(
                jax.lax.dynamic_update_slice_in_dim(cache.k, new.k.astype(cache.k.dtype), step, axis=1),
                jax.lax.dynamic_update_slice_in_dim(cache.v, new.v.astype(cache.v.dtype), step, axis=1),
            )

        q, k, v = self.proj.qkv(x, pos)
        kv = write(suffix.kv, KVCache(k, v))
        win = raw = None
        if not self.shared_kv:
            win = write(suffix.win, self._branch_kv(x, pos, "win"))
            raw = write(suffix.raw_cmp, self._branch_kv(x, pos, "cmp"))

        # The block ending at t, gathered across the prompt/generation boundary and compressed.
        src_pre, src_suf = (prefix.kv, kv) if self.shared_kv else (prefix.raw_cmp, raw)
        start = t - l + 1
        completes = (start >= 0) & (start % d == 0)
        tokens = jnp.broadcast_to(jnp.maximum(start, 0)[:, None, None] + jnp.arange(l), (B, K, l))
        new_blocks = [
            compress(SharedPrefix(pre, plen, suf).gather(tokens).transpose(0, 2, 1, 3)[:, None])[:, 0]
            for compress, pre, suf in ((self.k_compress, src_pre.k, src_suf.k), (self.v_compress, src_pre.v, src_suf.v))
        ]
        n_prompt_blocks = nsa_kernels.num_compressed_blocks(plen, l, d)  # [Pg]
        slot = jnp.clip(start // d - jnp.repeat(n_prompt_blocks, G), 0, suffix.cmp.k.shape[1] - 1)
        rows = jnp.arange(B)

        def put(cache, new):
            return cache.at[rows, slot].set(jnp.where(completes[:, None, None], new.astype(cache.dtype), cache[rows, slot]))

        cmp = KVCache(put(suffix.cmp.k, new_blocks[0]), put(suffix.cmp.v, new_blocks[1]))

        def shared(pre, suf, lengths=plen):
            return SharedPrefix(pre, lengths, suf)

        k_slc, v_slc = shared(prefix.kv.k, kv.k), shared(prefix.kv.v, kv.v)
        if self.shared_kv:
            kk, vv = k_slc, v_slc
        else:
            kk = {"slc": k_slc, "win": shared(prefix.win.k, win.k)}
            vv = {"slc": v_slc, "win": shared(prefix.win.v, win.v)}
        o = nsa_kernels.nsa_decode(
            q[:, 0], kk, vv, shared(prefix.cmp.k, cmp.k, n_prompt_blocks), shared(prefix.cmp.v, cmp.v, n_prompt_blocks),
            self._gates(x)[:, 0], t, **self.sizes._asdict(),
        )
        y = self.proj.out(o[:, None])
        return y[:, 0], NSACache(kv, win, raw, cmp)
