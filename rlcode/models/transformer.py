"""Decoder-only Llama/Qwen-style policy in Flax NNX.

Token embedding -> L x [RMSNorm -> attention -> residual, RMSNorm -> MLP -> residual] -> RMSNorm.
Grouped-query attention with RoPE (configurable theta and Llama 3 scaling), optional q/k/v biases
and QK-norm; SwiGLU MLP; tied or
untied output embedding; optional scalar value head (PPO). Attention and MLP come from their
registries (`attention.kind`, `mlp.kind`), so variants plug in without touching this file.

The model returns final hidden states, not logits: `rlcode.models.logprobs` turns hidden states
and `unembedding()` into token log-probs without materialising [B, T, V]. Shapes: B batch, T
time, D model, N heads, K kv heads, H head dim, F ffw, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from rlcode.models.attention import AttentionMask, KVCache, make_attention
from rlcode.models.layers import RMSNorm, Rope, make_param
from rlcode.models.mlp import make_mlp
from rlcode.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Aux entries also reported per layer as "<name>_layer<i>" (besides their sum over layers): an MoE
# layer's expert load, which its own router-bias update needs.
PER_LAYER_AUX = ("moe_load",)


def model_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The `model` config section with defaults (a tiny model; configs/ override sizes)."""
    cfg = ml_collections.ConfigDict(
        {
            "vocab_size": 512,
            "d_model": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "ffw_dim": 192,
            "rope_theta": 10000.0,
            # RoPE frequency rescaling for long contexts: "none" or "llama3" (`layers.Rope`).
            "rope_scaling": "none",
            "rope_factor": 1.0,
            "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0,
            "rope_original_max_position": 8192,
            "norm_eps": 1e-6,
            "qk_norm": False,
            "qkv_bias": False,  # biases on the query, key and value projections (Qwen2)
            "tie_embeddings": True,
            "value_head": False,
            "dtype": "float32",
            "param_dtype": "float32",
            "attention": {"kind": "dense"},
            "mlp": {"kind": "dense"},
            # A Hugging Face checkpoint directory to start from (rlcode.models.hf); its config.json
            # then decides the architecture fields. "" = initialise from `seed`.
            "init_from": "",
        }
    )
    cfg.update(overrides)
    return cfg


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Frozen, validated model sizes derived from a `model` config section."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffw_dim: int
    rope_theta: float
    norm_eps: float
    qk_norm: bool
    tie_embeddings: bool
    value_head: bool
    dtype: Any
    param_dtype: Any
    attention: ml_collections.FrozenConfigDict
    mlp: ml_collections.FrozenConfigDict
    # Fields added later default to the behaviour of configs written before them.
    qkv_bias: bool = False
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192

    @classmethod
    def from_config(cls, config: Any) -> "ModelConfig":
        values = {f.name: config[f.name] for f in dataclasses.fields(cls)
                  if f.name in config or f.default is dataclasses.MISSING}
        for name in ("dtype", "param_dtype"):
            if values[name] not in DTYPES:
                raise ValueError(f"model.{name}={values[name]!r} is not one of {sorted(DTYPES)}")
            values[name] = DTYPES[values[name]]
        for name in ("attention", "mlp"):
            values[name] = ml_collections.FrozenConfigDict(values[name])
        out = cls(**values)
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffw_dim"):
            if getattr(out, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(out, name)}")
        if out.num_heads % out.num_kv_heads:
            raise ValueError(f"model.num_heads={out.num_heads} must be a multiple of num_kv_heads={out.num_kv_heads}")
        if out.head_dim % 2:
            raise ValueError(f"model.head_dim={out.head_dim} must be even (RoPE)")
        try:
            out.rope
        except ValueError as e:
            raise ValueError(f"model.rope_*: {e}") from None
        return out

    def to_section(self) -> dict[str, Any]:
        """The `model` section (plain values) that `from_config` turns back into this config."""
        names = {jnp.dtype(v): k for k, v in DTYPES.items()}
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("dtype", "param_dtype"):
                value = names[jnp.dtype(value)]
            elif f.name in ("attention", "mlp"):
                value = value.to_dict()
            out[f.name] = value
        return out

    @property
    def rope(self) -> Rope:
        """The rotary embedding of every attention layer."""
        return Rope(self.rope_theta, self.rope_scaling, self.rope_factor, self.rope_low_freq_factor,
                    self.rope_high_freq_factor, self.rope_original_max_position)


class ModelOutput(NamedTuple):
    """hidden [B, T, D] after the final norm; values [B, T] float32 (value head) or None;
    aux: auxiliary losses/metrics of the MLPs summed over layers (plus PER_LAYER_AUX per layer);
    kv: per-layer KVCache when requested."""

    hidden: jax.Array
    values: jax.Array | None
    aux: dict[str, jax.Array]
    kv: list[KVCache] | None


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        kw = dict(eps=cfg.norm_eps, axis_name="embed", param_dtype=cfg.param_dtype, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, **kw)
        self.attn = make_attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **kw)
        self.mlp = make_mlp(cfg, rngs=rngs)

    def __call__(self, x, positions, mask):
        y, kv = self.attn(self.attn_norm(x), positions, mask)
        return self._mlp(x, y) + (kv,)

    def with_context(self, x, positions, context, context_valid):
        if not hasattr(self.attn, "attend_context"):
            raise ValueError(
                f"attention.kind={self.attn.cfg.attention['kind']!r} cannot attend to cached documents; "
                "documents are only independent of each other under attention.kind='squid'"
            )
        y, kv = self.attn.attend_context(self.attn_norm(x), positions, context, context_valid)
        return self._mlp(x, y) + (kv,)

    def shared(self, xp, pp, prefix_lengths, xc, pc):
        """Prompts shared by groups of rows and the rows' own tokens (`Transformer.forward_shared`)."""
        if not hasattr(self.attn, "shared_prefix"):
            raise ValueError(f"attention.kind={self.attn.cfg.attention['kind']!r} has no shared-prompt forward")
        yp, yc = self.attn.shared_prefix(self.attn_norm(xp), pp, prefix_lengths, self.attn_norm(xc), pc)
        xp, aux_p = self._mlp(xp, yp)
        xc, aux_c = self._mlp(xc, yc)
        return xp, xc, aux_p, aux_c

    def _mlp(self, x, y):
        x = constrain(x + y, ("batch", "seq", "embed"), self.placement)
        y, aux = self.mlp(self.mlp_norm(x))
        return constrain(x + y, ("batch", "seq", "embed"), self.placement), aux

    def decode(self, x_bd, positions_b, prefix, prefix_lengths, suffix, step):
        y, suffix = self.attn.decode(self.attn_norm(x_bd), positions_b, prefix, prefix_lengths, suffix, step)
        x = x_bd + y
        y, _ = self.mlp(self.mlp_norm(x)[:, None])
        return x + y[:, 0], suffix


class Transformer(nnx.Module):
    """The policy (and optional value) network."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        self.cfg = cfg
        V, D, pd = cfg.vocab_size, cfg.d_model, cfg.param_dtype
        self.embed = make_param(rngs, nnx.initializers.normal(D**-0.5), (V, D), ("vocab", "embed"), pd)
        self.num_layers = cfg.num_layers
        for i in range(cfg.num_layers):
            setattr(self, f"block_{i}", Block(cfg, rngs=rngs))
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, axis_name="embed", param_dtype=pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.unembed = make_param(rngs, nnx.initializers.normal(D**-0.5), (D, V), ("embed", "vocab"), pd)
        if cfg.value_head:
            self.value_w = make_param(rngs, nnx.initializers.zeros, (D,), ("embed",), jnp.float32)
            self.value_b = make_param(rngs, nnx.initializers.zeros, (), (), jnp.float32)

    def blocks(self) -> list[Block]:
        return [getattr(self, f"block_{i}") for i in range(self.num_layers)]

    def unembedding(self) -> tuple[jax.Array, str]:
        """The output projection and its layout: ("vd", [V, D]) when tied, else ("dv", [D, V])."""
        if self.cfg.tie_embeddings:
            return self.embed[...], "vd"
        return self.unembed[...], "dv"

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] for a few positions (sampling); training uses `logprobs`."""
        w, layout = self.unembedding()
        eq = "...d,vd->...v" if layout == "vd" else "...d,dv->...v"
        return jnp.einsum(eq, hidden, w, preferred_element_type=jnp.float32)

    def _embed(self, tokens):
        # Gather rows from a table whose model dimension is whole on every device (an all-gather
        # over fsdp), so the lookup needs no cross-device gather of token-indexed rows.
        table = constrain(self.embed[...], (None, None), self.placement)
        return jnp.take(table, tokens, axis=0).astype(self.cfg.dtype)

    def _value(self, hidden):
        if not self.cfg.value_head:
            return None
        return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), self.value_w[...]) + self.value_b[...]

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        mask: AttentionMask = AttentionMask(),
        return_kv: bool = False,
    ) -> ModelOutput:
        """Full causal forward. positions default to 0..T-1 per row."""
        if tokens_bt.ndim != 2:
            raise ValueError(f"tokens must be [B,T], got shape {tokens_bt.shape}")
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        x = constrain(self._embed(tokens_bt), ("batch", "seq", "embed"), self.placement)
        return self._run_blocks(x, lambda block, x: block(x, positions_bt, mask), return_kv)

    def forward_with_context(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        context: list[KVCache],
        context_valid: jax.Array,
        return_kv: bool = False,
    ) -> ModelOutput:
        """New tokens against cached keys/values: the global segment of squid attention
        (docs/reference.md §8) against cached documents, or chunked prefill after a cached prefix.

        tokens/positions [B, T] (right padding allowed); context: per layer the cached keys/values
        [B, S, K, H] (`rlcode.sampling.document_context`, a session cache); context_valid [B, S].
        Equals the full forward at the new positions without recomputing the context.
        """
        if len(context) != self.num_layers:
            raise ValueError(f"context has {len(context)} layers, the model {self.num_layers}")
        x = constrain(self._embed(tokens_bt), ("batch", "seq", "embed"), self.placement)
        layers = iter(context)
        return self._run_blocks(x, lambda block, x: block.with_context(x, positions_bt, next(layers), context_valid), return_kv)

    def forward_shared(self, prompts: jax.Array, prompt_lengths: jax.Array, tokens: jax.Array,
                       positions: jax.Array) -> tuple[ModelOutput, ModelOutput]:
        """Rows that share prompts, each prompt computed once: the training forward of a GRPO group.

        prompts [P, Lp] at positions 0..Lp-1 (right padding; prompt_lengths [P] valid tokens);
        tokens [B, Lc] the rows' own tokens (B = P * G, rows g*G..g*G+G-1 continue prompt g) at
        `positions` [B, Lc] (a row's token t usually at prompt_lengths[g] + t). Equals the causal
        forward of each row laid out as its prompt's valid tokens then its own (same positions)
        at every valid position, with G times fewer prompt tokens; gradients reach the prompt's
        activations from all its rows. Returns (prompt output [P, Lp], rows' output [B, Lc]).
        Dense or squid attention (without documents) and a dense MLP only
        (`supports_shared_prompts`): elsewhere a row's result would depend on the layout."""
        if not supports_shared_prompts(self.cfg):
            raise ValueError(f"forward_shared needs dense or squid attention and a dense MLP, not attention.kind="
                             f"{self.cfg.attention['kind']!r}, mlp.kind={self.cfg.mlp['kind']!r}")
        if prompts.ndim != 2 or tokens.ndim != 2 or tokens.shape[0] % prompts.shape[0]:
            raise ValueError(f"prompts [P, Lp] and tokens [B, Lc] with B a multiple of P, got {prompts.shape}, "
                             f"{tokens.shape}")
        P, Lp = prompts.shape
        pp = jnp.broadcast_to(jnp.arange(Lp), (P, Lp))
        xp = constrain(self._embed(prompts), ("batch", "seq", "embed"), self.placement)
        xc = constrain(self._embed(tokens), ("batch", "seq", "embed"), self.placement)
        aux_p, aux_c = {}, {}
        for block in self.blocks():
            xp, xc, ap, ac = block.shared(xp, pp, prompt_lengths, xc, positions)
            for total, part in ((aux_p, ap), (aux_c, ac)):
                for name, value in part.items():
                    total[name] = total.get(name, 0.0) + value
        hp, hc = self.final_norm(xp), self.final_norm(xc)
        return ModelOutput(hp, self._value(hp), aux_p, None), ModelOutput(hc, self._value(hc), aux_c, None)

    def _run_blocks(self, x, apply, return_kv):
        kvs, aux = [], {}
        for i, block in enumerate(self.blocks()):
            x, block_aux, kv = apply(block, x)
            kvs.append(kv)
            for name, value in block_aux.items():
                aux[name] = aux.get(name, 0.0) + value
                if name in PER_LAYER_AUX:
                    aux[f"{name}_layer{i}"] = value
        hidden = self.final_norm(x)
        return ModelOutput(hidden, self._value(hidden), aux, kvs if return_kv else None)

    def decode(
        self,
        tokens_b: jax.Array,
        positions_b: jax.Array,
        prefix: list[KVCache],
        prefix_lengths: jax.Array,
        suffix: list[KVCache],
        step: jax.Array,
    ) -> tuple[jax.Array, list[KVCache]]:
        """One token per row against the shared-prefix cache; returns (hidden [B, D], suffix)."""
        x = self._embed(tokens_b)
        new_suffix = []
        for block, pre, suf in zip(self.blocks(), prefix, suffix):
            x, suf = block.decode(x, positions_b, pre, prefix_lengths, suf, step)
            new_suffix.append(suf)
        return self.final_norm(x), new_suffix

    def init_suffix_cache(self, batch: int, max_len: int) -> list[Any]:
        """Each layer's empty cache for `max_len` generated tokens (its structure is the kind's)."""
        return [block.attn.init_suffix_cache(batch, max_len) for block in self.blocks()]


def supports_shared_prompts(cfg: Any) -> bool:
    """Whether `Transformer.forward_shared` equals the per-row forward for this model config:
    dense or squid attention (rows carry no documents) and a dense MLP (a mixture of experts
    routes, drops and balances over the tokens of a batch, so its result depends on the layout)."""
    return cfg.attention["kind"] in ("dense", "squid") and cfg.mlp["kind"] == "dense"


def init_model(config: Any, seed: int = 0) -> Transformer:
    """Build a Transformer from a `model` config section (ConfigDict) or a ModelConfig."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_config(config)
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def logical_axes(model: nnx.Module) -> Any:
    """Pure-dict tree of each variable's logical axis names (parameters and non-trained state such
    as an MoE router bias), matching `nnx.to_pure_dict(nnx.state(model))`."""
    state = nnx.state(model)
    axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(axes)
