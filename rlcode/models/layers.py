"""Building blocks shared by the model's modules: parameters with logical axes, RMSNorm, RoPE.

Every parameter carries `logical_axes` metadata (one name per dimension, e.g. ("embed", "mlp"));
`rlcode.sharding` maps those names to mesh axes with the rules from the config.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def fan_in_init(fan_in_axes: tuple[int, ...]) -> Initializer:
    """Truncated normal with variance 1 / fan_in, the fan-in being the product of `fan_in_axes`."""
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes, out_axis=())


def make_param(
    rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype
) -> nnx.Param:
    """A parameter with its logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, *, eps: float, axis_name: str, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """[H/2] inverse frequencies theta^(-2i/H) of rotary embeddings (Su et al. 2021)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (x_i, x_{i+H/2}) by angle position * freq_i (the non-interleaved layout).

    x [B, T, N, H], positions [B, T] (any integers: RoPE is relative, so a cached key at position
    p can be moved to p + d by rotating it by d).
    """
    freqs = rope_frequencies(x_btnh.shape[-1], theta)
    angles = positions_bt.astype(jnp.float32)[..., None] * freqs  # [B, T, H/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
