"""A tiny sequence-generation task for exercising RL objectives in seconds on a CPU.

Each prompt p has a hidden target: L_p <= T // 2 tokens from {1..V-1} followed by the stop
token 0. A policy emits up to T tokens; generation stops after the first 0, so masks are ragged
the way real completions are. The reward is the fraction of the L_p + 1 target slots (the tokens
and the stop token) that the completion gets right position by position, so 1.0 means an exact
match and stopping at once earns 1 / (L_p + 1). It
is a bandit over sequences: a policy that fits a table of logits[p, t, v] can solve it, and every
objective in `rlcode.losses` should improve it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STOP = 0


def make_targets(seed: int, num_prompts: int, max_len: int, vocab: int) -> np.ndarray:
    """[P, T] targets: L_p in [1, T // 2] tokens from 1..V-1, then STOP, then STOP padding."""
    if vocab < 2 or max_len < 2:
        raise ValueError(f"need vocab >= 2 and max_len >= 2, got {vocab}, {max_len}")
    rng = np.random.default_rng(seed)
    targets = np.full((num_prompts, max_len), STOP, np.int32)
    for p in range(num_prompts):
        length = rng.integers(1, max_len // 2 + 1)
        targets[p, :length] = rng.integers(1, vocab, size=length)
    return targets


def generation_mask(tokens: jax.Array) -> jax.Array:
    """[B, T] mask of generated tokens: everything up to and including the first STOP."""
    is_stop = (tokens == STOP).astype(jnp.int32)
    stops_before = jnp.cumsum(is_stop, axis=-1) - is_stop
    return stops_before == 0


def rewards(tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """[B] fraction of the target's L_p + 1 slots (tokens, then STOP) matched position by position.

    Positions after the completion's first STOP count as STOP (nothing was generated there).
    """
    produced = jnp.where(generation_mask(tokens), tokens, STOP)
    slots = generation_mask(targets)
    hits = jnp.sum((produced == targets) & slots, axis=-1)
    return (hits / jnp.sum(slots, axis=-1)).astype(jnp.float32)


def sample(key: jax.Array, logits_btv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample tokens from per-position logits; returns (tokens, log-probs, mask), each [B, T]."""
    tokens = jax.random.categorical(key, logits_btv, axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits_btv, -1), tokens[..., None], -1)[..., 0]
    return tokens, logp, generation_mask(tokens)
