"""Building blocks shared by the model's modules: parameters with logical axes, projections,
RMSNorm, RoPE.

Every parameter carries `logical_axes` metadata (one name per dimension, e.g. ("embed", "mlp"));
`rlcode.sharding` maps those names to mesh axes with the rules from the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


# How fresh parameters are drawn; part of every cache key of trained results (`rlcode.train.sft`).
# "fan_in-2": every projection at variance 1 / fan_in (the first scheme divided by the whole size).
INIT_SCHEME = "fan_in-2"


def fan_in_init(fan_in_axes: tuple[int, ...]) -> Initializer:
    """Truncated normal with variance 1 / fan_in, the fan-in being the product of `fan_in_axes`
    (the dimensions a projection contracts); every other dimension is an output dimension.

    The output axes are named explicitly: variance scaling multiplies the fan-in by every
    dimension that is neither an input nor an output axis (a convolution's receptive field), so
    leaving them out would divide the variance by the whole size of the matrix."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        ins = tuple(a % len(shape) for a in fan_in_axes)
        outs = tuple(a for a in range(len(shape)) if a not in ins)
        scaling = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=ins, out_axis=outs)
        return scaling(key, shape, dtype)

    return init


def make_param(
    rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype
) -> nnx.Param:
    """A parameter with its logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def project(eq: str, x: jax.Array, w: jax.Array, adapter: Callable | None = None) -> jax.Array:
    """`einsum(eq, x, w)`, plus the low-rank update of a LoRA adapter when the projection has one
    (`rlcode.models.lora`: adapter(x, eq) = scale (x A) B, never materialising W + scale A B)."""
    y = jnp.einsum(eq, x, w)
    return y if adapter is None else y + adapter(x, eq)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, *, eps: float, axis_name: str, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


ROPE_SCALINGS = ("none", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding (Su et al. 2021): base `theta` and an optional rescaling of its
    frequencies for long contexts.

    scaling "llama3" (Llama 3.1): a frequency whose wavelength 2 pi / f is shorter than
    original_max_position / high_freq_factor is kept, one longer than original_max_position /
    low_freq_factor is divided by `factor`, and the ones between are interpolated linearly in
    s = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor):
    f' = (1 - s) f / factor + s f (docs/reference.md, "Rotary embeddings").
    """

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.scaling!r} is not one of {ROPE_SCALINGS}")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.scaling == "llama3" and not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                                             and self.original_max_position > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position > 0, got {self}")

    def frequencies(self, head_dim: int) -> jax.Array:
        """[H/2] inverse frequencies theta^(-2i/H), rescaled by `scaling`."""
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        freqs = 1.0 / (self.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
        if self.scaling == "llama3":
            wavelength = 2 * jnp.pi / freqs
            smooth = (self.original_max_position / wavelength - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            blended = (1 - smooth) * freqs / self.factor + smooth * freqs
            freqs = jnp.where(wavelength < self.original_max_position / self.high_freq_factor, freqs,
                              jnp.where(wavelength > self.original_max_position / self.low_freq_factor,
                                        freqs / self.factor, blended))
        return freqs


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, rope: Rope) -> jax.Array:
    """Rotate pairs (x_i, x_{i+H/2}) by angle position * freq_i (the non-interleaved layout).

    x [B, T, N, H], positions [B, T] (any integers: RoPE is relative, so a cached key at position
    p can be moved to p + d by rotating it by d).
    """
    freqs = rope.frequencies(x_btnh.shape[-1])
    angles = positions_bt.astype(jnp.float32)[..., None] * freqs  # [B, T, H/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
