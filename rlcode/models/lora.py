"""LoRA: low-rank adapters on the model's projections (Hu et al. 2021, arXiv 2106.09685).

A projection y = x W, with W [in..., out...], gets two small matrices A [in..., r] and
B [r, out...] and computes

    y = x W + (alpha / r) (x A) B,

the product W + (alpha / r) A B never being formed. A starts as a fan-in normal (std
1 / sqrt(in)) and B at zero, so a model with fresh adapters computes exactly what it computed
before. Training only A and B (`adapter_mask` for `rlcode.train.step.make_optimizer` and
`make_train_step`) keeps optimizer moments and weight gradients for the adapters alone; the base
may then be stored in bfloat16 while the adapters stay float32 (`LoraConfig.dtype`), QLoRA's
recipe without its 4-bit quantisation.

Targets are named by projection: q, k, v, o (`rlcode.models.attention.QKVProjection`, which the
dense, squid and NSA attentions share; NSA's branch key/value projections get none) and gate, up,
down (the dense `rlcode.models.mlp.SwiGLU`; MoE experts have no adapters). An adapter lives beside
its weight as the attribute ``lora_<target>`` of that module and its parameters are
`nnx.LoRAParam`s (a subclass of `nnx.Param`), so `nnx.state(model, nnx.LoRAParam)` holds them
alone; they carry logical axes like every parameter (A: the weight's input axes then None; B:
None then its output axes).

`merge_lora` folds the adapters into the weights (a model `rlcode.models.hf.save_checkpoint`
exports); `save_adapters` / `load_adapters` write and read the adapters alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlcode.checks import ConfigError, TypedSection, integer, real, sequence, text
from rlcode.models.attention import QKVProjection
from rlcode.models.mlp import SwiGLU
from rlcode.models.safetensors_file import SafetensorsFile, write_file

# target -> (the weight it adapts, the number of that weight's input dimensions).
TARGETS = {"q": ("wq", 1), "k": ("wk", 1), "v": ("wv", 1), "o": ("wo", 2),
           "gate": ("w_gate", 1), "up": ("w_up", 1), "down": ("w_down", 1)}
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
ADAPTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

LORA_SPECS = {"rank": integer(0), "alpha": real(0, low_open=True),
              "targets": sequence(text(tuple(TARGETS)), min_len=1), "dtype": text(tuple(ADAPTER_DTYPES))}

WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"


@dataclasses.dataclass(frozen=True)
class LoraConfig(TypedSection):
    """The `lora` section: rank r (0 = no adapters), alpha (the update is scaled by alpha / r),
    the targeted projections, and the adapters' parameter dtype."""

    SPECS = LORA_SPECS
    SECTION = "lora"

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora.targets={self.targets!r}: a target is named twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_config(**overrides: Any) -> Any:
    """The `lora` config section (rank 0: off), e.g. lora_config(rank=8, targets=("q", "v"))."""
    return LoraConfig.default_section(**overrides)


class Adapter(nnx.Module):
    """The low-rank update of one weight W [in..., out...]: `adapter(x, eq)` = scale (x A) B for
    the projection einsum(eq, x, W), computed in x's dtype."""

    def __init__(self, a: jax.Array, b: jax.Array, a_axes: tuple, b_axes: tuple, scale: float):
        self.a = nnx.LoRAParam(a, logical_axes=a_axes)
        self.b = nnx.LoRAParam(b, logical_axes=b_axes)
        self.scale = scale

    def __call__(self, x: jax.Array, eq: str) -> jax.Array:
        xs, rest = eq.split(",")
        ws, out = rest.split("->")
        ins, outs = "".join(c for c in ws if c in xs), "".join(c for c in ws if c not in xs)
        if ws != ins + outs:
            raise ValueError(f"projection {eq!r}: the weight's input dimensions must come before its outputs")
        batch = "".join(c for c in xs if c not in ws)
        r = next(c for c in "rzyxwuabcdefghijklmnopqstv" if c not in eq)
        xa = jnp.einsum(f"{xs},{ins}{r}->{batch}{r}", x, self.a[...].astype(x.dtype)) * self.scale
        return jnp.einsum(f"{batch}{r},{r}{outs}->{out}", xa.astype(x.dtype), self.b[...].astype(x.dtype))

    def delta(self) -> jax.Array:
        """scale A B [in..., out...] in float32."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return self.scale * jnp.tensordot(a, b, axes=1)


def _owner(block: Any, target: str) -> Any:
    """The module of `block` that holds `target`'s weight."""
    if target in ATTENTION_TARGETS:
        proj = getattr(block.attn, "proj", None)
        if not isinstance(proj, QKVProjection):
            raise ValueError(f"lora.targets has {target!r} but attention {type(block.attn).__name__} has no "
                             "QKVProjection")
        return proj
    if not isinstance(block.mlp, SwiGLU):
        raise ValueError(f"lora.targets has {target!r} but the MLP is {type(block.mlp).__name__}: only the dense "
                         f"SwiGLU MLP takes adapters; use targets among {ATTENTION_TARGETS}")
    return block.mlp


def adapters(model: Any) -> list[tuple[str, Any, str, Adapter]]:
    """Every adapter of `model` as (name, owner module, weight attribute, adapter), the name being
    its path, e.g. "block_0.attn.proj.lora_q"."""
    out = []
    for path, module in nnx.iter_modules(model):
        for target, (weight, _) in TARGETS.items():
            adapter = getattr(module, f"lora_{target}", None)
            if isinstance(adapter, Adapter):
                out.append((".".join(map(str, (*path, f"lora_{target}"))), module, weight, adapter))
    return out


def add_lora(model: Any, cfg: LoraConfig, seed: int) -> Any:
    """Give each block's targeted projections a fresh adapter (A fan-in normal, B zero, so the
    forward is unchanged); modifies `model` and returns it. rank 0: the model as it is."""
    cfg = LoraConfig.from_config(cfg)
    if cfg.rank == 0:
        return model
    if getattr(model, "lora", None) is not None or adapters(model):
        raise ValueError("the model already has LoRA adapters")
    dtype = ADAPTER_DTYPES[cfg.dtype]
    key = jax.random.key(seed)
    owners = [[_owner(block, target) for target in cfg.targets] for block in model.blocks()]  # (checks first)
    for i, modules in enumerate(owners):
        for module, target in zip(modules, cfg.targets):
            weight, num_in = TARGETS[target]
            w = getattr(module, weight)
            axes = w.get_metadata()["logical_axes"]
            in_shape, out_shape = w.shape[:num_in], w.shape[num_in:]
            k = jax.random.fold_in(jax.random.fold_in(key, i), list(TARGETS).index(target))
            a = jax.random.normal(k, (*in_shape, cfg.rank), jnp.float32) / math.sqrt(math.prod(in_shape))
            b = jnp.zeros((cfg.rank, *out_shape), dtype)
            setattr(module, f"lora_{target}",
                    Adapter(a.astype(dtype), b, (*axes[:num_in], None), (None, *axes[num_in:]), cfg.scale))
    model.lora = cfg
    return model


def adapter_mask(model: Any, also: tuple[str, ...] = ()) -> Any:
    """Pure-dict tree matching `nnx.to_pure_dict(nnx.state(model))`: True at adapter parameters
    and at parameters whose path has a name in `also` (e.g. a new value head), False elsewhere;
    the `trainable` argument of `make_optimizer` and `make_train_step`."""
    state = nnx.state(model)
    flags = nnx.to_pure_dict(jax.tree.map(lambda v: isinstance(v, nnx.LoRAParam), state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return jax.tree_util.tree_map_with_path(
        lambda path, flag: flag or any(getattr(k, "key", None) in also for k in path), flags)


def merge_lora(model: Any) -> Any:
    """A copy of `model` without adapters whose weights are W + scale A B (summed in float32,
    stored in W's dtype); `model` is left as it is."""
    merged = nnx.clone(model)
    for _, module, weight, adapter in adapters(merged):
        w = getattr(module, weight)
        w.set_value((w[...].astype(jnp.float32) + adapter.delta()).astype(w.dtype))
    for name, module, _, _ in adapters(merged):
        delattr(module, name.rsplit(".", 1)[1])
    if hasattr(merged, "lora"):
        del merged.lora
    return merged


def _config_record(cfg: LoraConfig) -> dict[str, Any]:
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.targets), "dtype": cfg.dtype}


def save_adapters(model: Any, path: str | os.PathLike) -> None:
    """Write the adapters of `model` alone to directory `path` (created if needed): their
    parameters (``adapters.safetensors``, named by path, e.g. "block_0.attn.proj.lora_q.a") and
    the LoRA config (``adapter_config.json``)."""
    cfg = getattr(model, "lora", None)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {}
    for name, _, _, adapter in adapters(model):
        tensors[f"{name}.a"] = np.asarray(jax.device_get(adapter.a[...]))
        tensors[f"{name}.b"] = np.asarray(jax.device_get(adapter.b[...]))
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    write_file(os.path.join(path, WEIGHTS_FILE), tensors, {"format": "rlcode-lora"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(_config_record(cfg), f, indent=2, sort_keys=True)


def load_adapters(model: Any, path: str | os.PathLike) -> Any:
    """Set the adapters of `model` (which `add_lora` gave the same config) to those saved in
    directory `path`; modifies `model` and returns it. A different rank, alpha, targets or dtype,
    or a tensor missing, extra or of another shape, is a ValueError naming it."""
    cfg = getattr(model, "lora", None)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters to load into (add_lora first)")
    path = os.fspath(path)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        saved = json.load(f)
    ours = _config_record(cfg)
    for field in ("rank", "alpha", "targets", "dtype"):
        if saved.get(field) != ours[field]:
            raise ValueError(f"{path}: adapters saved with lora.{field}={saved.get(field)!r}, the model has "
                             f"lora.{field}={ours[field]!r}")
    stored = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
    params = {f"{name}.{p}": getattr(adapter, p) for name, _, _, adapter in adapters(model) for p in ("a", "b")}
    missing, extra = sorted(set(params) - set(stored.names)), sorted(set(stored.names) - set(params))
    if missing or extra:
        raise ValueError(f"{path}: adapter tensors do not match the model's: missing {missing[:8]}, "
                         f"unexpected {extra[:8]}")
    for name, param in params.items():
        if tuple(stored.shape(name)) != tuple(param.shape):
            raise ValueError(f"{path}: adapter tensor {name!r} has shape {list(stored.shape(name))}, the model's "
                             f"is {list(param.shape)}")
    for name, param in params.items():
        value = jnp.asarray(np.array(stored.array(name)), dtype=param.dtype)
        sharding = getattr(param[...], "sharding", None)
        param.set_value(jax.device_put(value, sharding) if sharding is not None else value)
    return model
