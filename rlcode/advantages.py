"""Advantage estimators and reward shaping (docs/reference.md §1, §4).

All functions are pure, jittable and vmappable. Statistics are computed in float32 (or float64
when x64 is enabled and the input is float64) whatever the input dtype, and results are returned
in that computation dtype: advantages feed a loss, and bfloat16 group statistics lose the signal
of small reward differences.

Shapes: N rewards ordered group by group (N = num_groups * G), B sequences, T tokens, K turns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlcode.checks import TypedSection, check_finite, expect_type, one_of, real, text

NORMALIZE_MODES = ("std", "none", "rloo", "batch")
ESTIMATORS = ("group", "gae")
# The valid values of the `advantage` section's fields (`rlcode.train.schema` checks a job's
# config with the same Specs).
ADVANTAGE_SPECS = {"estimator": text(ESTIMATORS), "normalize": text(NORMALIZE_MODES),
                   "eps": real(0, low_open=True), "gamma": real(0, 1), "lam": real(0, 1)}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(TypedSection):
    """The `advantage` section, validated and frozen (hashable): what `compute_advantages` reads.

    estimator: "group" (`group_advantages` over the G samples of a prompt) or "gae" (`gae`,
    needs a value head). normalize, eps: the group normalisation and the epsilon added to the
    std (`group_advantages`). gamma, lam: discount and GAE lambda, each in [0, 1].
    """

    SPECS = ADVANTAGE_SPECS
    SECTION = "advantage"

    estimator: str = "group"
    normalize: str = "std"
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 0.95


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, jnp.float32)


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    normalize: str = "std",
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Sequence-level advantages from scalar rewards of G samples per prompt.

    Args:
      rewards: [N] rewards, ordered group by group: rewards[g * G + i] is sample i of prompt g.
      group_size: G, the number of samples per prompt; must divide N.
      normalize: "std" – GRPO (DeepSeekMath, arXiv 2402.03300): (R - mean) / (std + eps), sample
        std (ddof=1); "none" – Dr. GRPO (arXiv 2503.20783): R - mean; "rloo" – RLOO
        (arXiv 2402.14740): R_i - mean_{j != i} R_j; "batch" – REINFORCE++: (R - mean) / (std +
        eps) over the whole batch (ddof=1), ignoring groups.
      eps: added to the std.
      valid: optional [N] bool. Invalid samples (an infrastructure failure, not a wrong answer)
        are left out of every statistic and get advantage 0; their reward may be NaN.

    Returns:
      [N] advantages. A group whose valid rewards are all equal – or that has fewer than two
      valid samples when a std or leave-one-out is needed – gets exactly 0 (never NaN).

    Raises:
      ValueError: on a bad mode or shape, or a NaN/Inf reward at a valid position (under `jit`
        the error surfaces when the result is computed, as a JaxRuntimeError with this message).
    """
    one_of(normalize, NORMALIZE_MODES, "normalize")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {rewards.shape}")
    n = rewards.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide N={n}")
    if valid is None:
        valid = jnp.ones((n,), bool)
    elif valid.shape != (n,):
        raise ValueError(f"valid must have shape ({n},), got {valid.shape}")
    valid = valid.astype(bool)
    check_finite(rewards, "rewards", where=valid)

    dtype = _compute_dtype(rewards)
    r = jnp.where(valid, rewards.astype(dtype), 0)
    if normalize == "batch":
        r, w = r[None, :], valid[None, :]
    else:
        r, w = r.reshape(-1, group_size), valid.reshape(-1, group_size)
    wf = w.astype(dtype)

    count = wf.sum(-1, keepdims=True)
    total = r.sum(-1, keepdims=True)
    mean = total / jnp.maximum(count, 1)
    centred = jnp.where(w, r - mean, 0)
    # All-equal valid rewards: the advantage is exactly 0, not a rounding residue of the mean.
    big, small = jnp.finfo(dtype).max, jnp.finfo(dtype).min
    hi = jnp.max(jnp.where(w, r, small), -1, keepdims=True)
    lo = jnp.min(jnp.where(w, r, big), -1, keepdims=True)
    degenerate = hi <= lo

    if normalize == "none":
        adv = centred
    elif normalize == "rloo":
        # R_i - (sum - R_i) / (n - 1), requires n >= 2.
        loo_mean = (total - r) / jnp.maximum(count - 1, 1)
        adv = jnp.where(count >= 2, r - loo_mean, 0)
    else:  # "std" and "batch"
        var = jnp.sum(centred**2, -1, keepdims=True) / jnp.maximum(count - 1, 1)
        adv = jnp.where(count >= 2, centred / (jnp.sqrt(var) + eps), 0)
    adv = jnp.where(degenerate | ~w, 0, adv)
    return adv.reshape(n)


def broadcast_to_tokens(seq_values: jax.Array, mask: jax.Array) -> jax.Array:
    """Broadcast a per-sequence value [B] to every masked token: returns [B, T] (0 off the mask)."""
    if seq_values.ndim != 1 or mask.ndim != 2 or seq_values.shape[0] != mask.shape[0]:
        raise ValueError(f"expected [B] and [B,T], got {seq_values.shape} and {mask.shape}")
    return jnp.where(mask.astype(bool), seq_values[:, None], 0).astype(_compute_dtype(seq_values))


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float,
    lam: float,
    bootstrap_value: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438).

    The time steps of a sequence are its masked (generated) tokens only: prompt tokens, tool output
    in the middle of a multi-turn episode and padding are skipped, so the "next" value of a token
    is the value of the next generated token, not of the next position. Rewards at unmasked
    positions are ignored: put a turn's reward on a generated token of that turn.

      delta_t = r_t + gamma * V_next - V_t
      A_t     = delta_t + gamma * lam * A_next
      returns = A + V

    V_next after the last generated token is `bootstrap_value` (default 0, a finished episode).

    Args:
      rewards, values, mask: [B, T].
      gamma, lam: discount and GAE lambda (Python floats or scalars).
      bootstrap_value: optional [B] value of the state after the last generated token.

    Returns:
      (advantages, returns), each [B, T], 0 at unmasked positions.
    """
    if rewards.ndim != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards, values, mask must all be [B,T]; got {rewards.shape}, {values.shape}, {mask.shape}"
        )
    batch = rewards.shape[0]
    dtype = jnp.promote_types(_compute_dtype(rewards), values.dtype)
    r = rewards.astype(dtype)
    v = values.astype(dtype)
    m = mask.astype(bool)
    next_v = jnp.zeros((batch,), dtype) if bootstrap_value is None else bootstrap_value.astype(dtype)
    if next_v.shape != (batch,):
        raise ValueError(f"bootstrap_value must be [B]=({batch},), got {next_v.shape}")

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0)

    init = (next_v, jnp.zeros((batch,), dtype))
    _, adv_tb = jax.lax.scan(step, init, (r.T, v.T, m.T), reverse=True)
    adv = adv_tb.T
    returns = jnp.where(m, adv + v, 0)
    return adv, returns


def potential_shaping(
    potentials: jax.Array,
    gamma: float = 1.0,
    initial: jax.Array | float = 0.0,
    turn_mask: jax.Array | None = None,
) -> jax.Array:
    """Potential-based turn rewards (Ng, Harada & Russell 1999) for multi-turn agents.

    With Phi_k the potential after turn k (e.g. the fraction of tests passing) and Phi_0 =
    `initial`, turn k earns r_k = gamma * Phi_k - Phi_{k-1}. Shaping of this form leaves the
    optimal policy unchanged.

    Args:
      potentials: [B, K] Phi_1..Phi_K.
      gamma: discount.
      initial: scalar or [B] potential before the first turn.
      turn_mask: optional [B, K] bool; turns past the end of an episode get reward 0 (mark only a
        prefix of turns as valid).

    Returns:
      [B, K] shaped turn rewards.
    """
    if potentials.ndim != 2:
        raise ValueError(f"potentials must be [B,K], got {potentials.shape}")
    dtype = _compute_dtype(potentials)
    phi = potentials.astype(dtype)
    phi0 = jnp.broadcast_to(jnp.asarray(initial, dtype), (phi.shape[0],))
    prev = jnp.concatenate([phi0[:, None], phi[:, :-1]], axis=1)
    shaped = gamma * phi - prev
    if turn_mask is not None:
        shaped = jnp.where(turn_mask.astype(bool), shaped, 0)
    return shaped


def overlong_penalty(lengths: jax.Array, max_length: int, cache_length: int) -> jax.Array:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the task reward.

    0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the cache band;
    -1 for |y| > L_max.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    length = lengths.astype(jnp.float32)
    start = max_length - cache_length
    band = (start - length) / cache_length
    return jnp.where(length <= start, 0.0, jnp.where(length <= max_length, band, -1.0))


def reward_at_last_token(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Place a sequence reward [B] on the last masked token of each row: returns [B, T].

    The per-token reward layout that `gae` expects for an episode scored once at the end.
    """
    if rewards.ndim != 1 or mask.ndim != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"expected [B] and [B,T], got {rewards.shape} and {mask.shape}")
    m = mask.astype(bool)
    t = jnp.arange(m.shape[1])
    last = jnp.max(jnp.where(m, t, -1), axis=-1)
    return jnp.where(t[None, :] == last[:, None], rewards[:, None], 0).astype(_compute_dtype(rewards))


def compute_advantages(
    config: AdvantageConfig,
    rewards: jax.Array,
    mask: jax.Array,
    group_size: int,
    values: jax.Array | None = None,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Per-token advantages for a batch of B = num_groups * G sequences scored once each.

    Args:
      config: the `AdvantageConfig` (estimator, normalize, eps, gamma, lam).
      rewards: [B] sequence rewards, group by group.
      mask: [B, T] generated tokens.
      group_size: G.
      values: [B, T] value predictions, required by estimator="gae".
      valid: optional [B] bool, see `group_advantages` (for GAE, invalid rows get 0).

    Returns:
      (advantages [B, T], returns [B, T] or None for the group estimator).
    """
    config = expect_type(config, AdvantageConfig, "config")
    if config.estimator == "group":
        adv = group_advantages(rewards, group_size, config.normalize, config.eps, valid=valid)
        return broadcast_to_tokens(adv, mask), None
    if values is None:
        raise ValueError("advantage.estimator='gae' needs values (a value head)")
    m = mask.astype(bool)
    if valid is not None:
        m = m & valid.astype(bool)[:, None]
    check_finite(rewards, "rewards", where=m.any(-1))
    safe_rewards = jnp.where(m.any(-1), rewards, 0)
    return gae(reward_at_last_token(safe_rewards, m), values, m, config.gamma, config.lam)
