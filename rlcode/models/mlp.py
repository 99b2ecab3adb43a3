"""Feed-forward layers: the one place that chooses the implementation (dense now; moe registers).

An MLP kind is an `nnx.Module` class registered with `@register_mlp(kind)`, built as
`MLP[cfg.mlp.kind](cfg, rngs=rngs)` and called as `mlp(x_btd) -> (y_btd, aux)`, where `aux` is a
dict of scalar auxiliary losses/metrics (empty for dense; load-balancing and z-loss for MoE) that
the model sums over layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlcode.models.layers import fan_in_init, make_param
from rlcode.sharding import constrain

MLP: dict[str, type[nnx.Module]] = {}


def register_mlp(kind: str) -> Callable[[type], type]:
    """Class decorator adding an MLP implementation to the registry under `kind`."""

    def add(cls: type) -> type:
        if kind in MLP:
            raise ValueError(f"mlp kind {kind!r} is already registered ({MLP[kind].__name__})")
        MLP[kind] = cls
        return cls

    return add


def make_mlp(cfg: Any, *, rngs: nnx.Rngs) -> nnx.Module:
    """Build the MLP module named by `cfg.mlp.kind`."""
    kind = cfg.mlp["kind"]
    if kind not in MLP:
        raise ValueError(f"unknown mlp.kind={kind!r}; registered: {sorted(MLP)}")
    return MLP[kind](cfg, rngs=rngs)


@register_mlp("dense")
class SwiGLU(nnx.Module):
    """y = W_down (silu(x W_gate) * (x W_up)) (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        D, F, pd = cfg.d_model, cfg.ffw_dim, cfg.param_dtype
        self.dtype = cfg.dtype
        self.w_gate = make_param(rngs, fan_in_init((0,)), (D, F), ("embed", "mlp"), pd)
        self.w_up = make_param(rngs, fan_in_init((0,)), (D, F), ("embed", "mlp"), pd)
        self.w_down = make_param(rngs, fan_in_init((0,)), (F, D), ("mlp", "embed"), pd)

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        dt = self.dtype
        x = x_btd.astype(dt)
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...].astype(dt))
        up = jnp.einsum("btd,df->btf", x, self.w_up[...].astype(dt))
        h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return jnp.einsum("btf,fd->btd", h, self.w_down[...].astype(dt)), {}
