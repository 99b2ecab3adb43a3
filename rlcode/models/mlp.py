"""Feed-forward layers: the one place that chooses the implementation (dense, moe).

An MLP kind is an `nnx.Module` class listed in `rlcode.models.registry.MLP` (the built-in kinds:
"dense" here, "moe" in rlcode.models.moe; `register_mlp(kind)` adds one at run time), built as
`MLP[cfg.mlp.kind](cfg, rngs=rngs)` (`make_mlp(cfg, rngs=rngs)`) and called as
`mlp(x_btd) -> (y_btd, aux)`, where `aux` is a dict of auxiliary losses (names ending in "_loss",
added to the objective by the train step) and metrics (scalars or arrays such as MoE's per-expert
load) that the model sums over layers (empty for dense; see rlcode.models.moe).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from rlcode.models.layers import fan_in_init, make_param, project
from rlcode.models.registry import MLP
from rlcode.sharding import constrain

register_mlp = MLP.register
make_mlp = MLP.build


class SwiGLU(nnx.Module):
    """y = W_down (silu(x W_gate) * (x W_up)) (Shazeer 2020, arXiv 2002.05202). Each projection may
    have a low-rank adapter (lora_gate, lora_up, lora_down: `rlcode.models.lora.add_lora`)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.placement = None  # where activations are pinned: set by rlcode.sharding.place
        D, F, pd = cfg.d_model, cfg.ffw_dim, cfg.param_dtype
        self.dtype = cfg.dtype
        self.w_gate = make_param(rngs, fan_in_init((0,)), (D, F), ("embed", "mlp"), pd)
        self.w_up = make_param(rngs, fan_in_init((0,)), (D, F), ("embed", "mlp"), pd)
        self.w_down = make_param(rngs, fan_in_init((0,)), (F, D), ("mlp", "embed"), pd)

    def __call__(self, x_btd: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        dt = self.dtype
        x = x_btd.astype(dt)
        gate = project("btd,df->btf", x, self.w_gate[...].astype(dt), getattr(self, "lora_gate", None))
        up = project("btd,df->btf", x, self.w_up[...].astype(dt), getattr(self, "lora_up", None))
        h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"), self.placement)
        return project("btf,fd->btd", h, self.w_down[...].astype(dt), getattr(self, "lora_down", None)), {}
