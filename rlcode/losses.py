"""Policy losses, off-policy corrections, KL, value loss, entropy and aggregation.

Implements docs/reference.md §2–§5 exactly. Every loss is minimised and comes in two forms:

* `*_terms(...) -> (numerator, denominator, metrics)` – the contract of §5: summing numerators
  and denominators over micro-batches (and data-parallel shards) and dividing once reproduces the
  full-batch loss and gradient exactly, for every aggregation mode. Denominators depend only on
  the mask, never on parameters. Terms that share a mask and an aggregation mode share the
  denominator, so a total objective is `(num_pg + beta * num_kl + ...) / den`.
* `*_loss(...) -> (loss, metrics)` – the same, divided.

Shapes: B sequences, T tokens; `mask[b, t]` is 1 on tokens the policy generated. Log-ratios are
computed in log space, clamped to [-20, 20], in float32 (or wider) whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from rlcode.checks import (ConfigError, TypedSection, apply_overrides, check_values, expect_type, integer, one_of, real,
                           section_fields, text)

POLICY_KINDS = ("ppo", "gspo", "gspo_token", "cispo", "reinforce")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence", "geometric")
KL_KINDS = ("k1", "k2", "k3")
KL_PENALTIES = ("loss", "reward")
LOG_RATIO_CLAMP = 20.0

Metrics = dict[str, jax.Array]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


# The valid values of every field of the `loss` section; `rlcode.train.schema` checks a job's
# config with the same Specs.
POLICY_SPECS = {
    "kind": text(POLICY_KINDS), "clip_low": real(0), "clip_high": real(0),
    "dual_clip": real(1, low_open=True, none_ok=True), "agg": text(AGG_MODES),
    "norm_length": integer(1, none_ok=True), "is_mode": text(IS_MODES), "is_level": text(IS_LEVELS),
    "is_cap": real(0, low_open=True), "is_low": real(0), "is_high": real(0, low_open=True),
}
OBJECTIVE_SPECS = {
    "kl_coef": real(0), "kl_kind": text(KL_KINDS), "kl_penalty": text(KL_PENALTIES), "entropy_coef": real(0),
    "value_coef": real(0), "value_clip": real(0),
}


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(TypedSection):
    """The policy-loss fields of the `loss` section, validated and frozen (hashable: it can be a
    static argument of `jax.jit`). Build it from a section with `from_config`; constructing it
    directly validates as well.

    kind: ppo | gspo | gspo_token | cispo | reinforce.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    dual_clip: None, or c > 1: for A < 0 the loss is bounded by -c * A (ppo, gspo, gspo_token).
    agg: aggregation mode of docs/reference.md §5; norm_length: the L of seq-mean-token-sum-norm.
    is_mode: none | tis | mis – correction for the behaviour/old-policy mismatch (§3), needs
      `behavior_logp`; is_level: token | sequence | geometric; is_cap: the TIS cap C;
      is_low, is_high: the MIS acceptance interval.
    """

    SPECS = POLICY_SPECS
    SECTION = "loss"

    kind: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    norm_length: int | None = None
    is_mode: str = "none"
    is_level: str = "token"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        if self.agg == "seq-mean-token-sum-norm" and self.norm_length is None:
            raise ConfigError(
                "loss.agg='seq-mean-token-sum-norm' needs loss.norm_length > 0 (e.g. the maximum "
                f"generation length), got {self.norm_length}"
            )
        if self.is_low > self.is_high:
            raise ConfigError(f"loss.is_low={self.is_low} must be <= loss.is_high={self.is_high}")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The whole `loss` section, validated and frozen: the policy loss and the coefficients that
    combine it with the other terms in `objective_terms` (hashable, like `PolicyLossConfig`).

    policy: the `PolicyLossConfig`. kl_coef: beta of the KL to the reference policy; kl_kind:
    k1 | k2 | k3; kl_penalty: "loss" (beta * agg(k) in the loss) or "reward" (R - beta * sum_t k1
    in the reward, `kl_reward_penalty`). entropy_coef: the entropy bonus (subtracted).
    value_coef, value_clip: the PPO value loss and its clip range.
    """

    policy: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_penalty: str = "loss"
    entropy_coef: float = 0.0
    value_coef: float = 0.0
    value_clip: float = 0.2

    def __post_init__(self):
        expect_type(self.policy, PolicyLossConfig, "ObjectiveConfig.policy")
        check_values(self, OBJECTIVE_SPECS, "loss")

    @classmethod
    def from_config(cls, config: Any) -> ObjectiveConfig:
        """An ObjectiveConfig from a `loss` section (ConfigDict or mapping with the flat field
        names of `loss_config`), or an instance. An unknown field is a ConfigError naming the
        closest known ones; a missing field takes its default."""
        if isinstance(config, cls):
            return config
        values = section_fields(config, tuple(POLICY_SPECS) + tuple(OBJECTIVE_SPECS), "loss")
        policy = {k: values.pop(k) for k in POLICY_SPECS if k in values}
        return cls(policy=PolicyLossConfig(**policy), **values)


def loss_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Default `loss` section of an experiment config (policy loss plus the other loss terms):
    the fields of `PolicyLossConfig` and the coefficients of `ObjectiveConfig`, with their
    defaults, checked by `ObjectiveConfig.from_config`."""
    cfg = ml_collections.ConfigDict()
    for field in dataclasses.fields(PolicyLossConfig):
        setattr(cfg, field.name, field.default)
    cfg.dual_clip = config_dict.placeholder(float)
    cfg.norm_length = config_dict.placeholder(int)
    for field in dataclasses.fields(ObjectiveConfig):
        if field.name != "policy":
            setattr(cfg, field.name, field.default)
    apply_overrides(cfg, overrides, "loss")
    ObjectiveConfig.from_config(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Aggregation (§5)
# --------------------------------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _float(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_bt(mask: jax.Array, **arrays: jax.Array) -> None:
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B,T], got shape {mask.shape}")
    for name, x in arrays.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {mask.shape}, got {x.shape}")


def aggregate(
    per_token: jax.Array, mask: jax.Array, agg: str, norm_length: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """(numerator, denominator) of a per-token quantity under an aggregation mode (§5).

    token-mean:              sum_{b,t} m*l            / sum_{b,t} m
    seq-mean-token-mean:     sum_b (sum_t m*l / sum_t m) / B
    seq-mean-token-sum:      sum_{b,t} m*l            / B
    seq-mean-token-sum-norm: sum_{b,t} m*l            / (B * norm_length)

    B counts the sequences with at least one masked token: a row with an empty mask (a padding
    row, or a sample masked out after an infrastructure failure) is not a sequence of the batch.
    Values at unmasked positions are ignored, even if they are NaN/Inf.
    """
    one_of(agg, AGG_MODES, "agg")
    _check_bt(mask, per_token=per_token)
    m = mask.astype(bool)
    x = jnp.where(m, _float(per_token), 0)
    dtype = x.dtype
    seq_len = m.sum(-1).astype(dtype)
    num_seqs = (seq_len > 0).sum().astype(dtype)
    if agg == "token-mean":
        return x.sum(), seq_len.sum()
    if agg == "seq-mean-token-mean":
        return (x.sum(-1) / jnp.maximum(seq_len, 1)).sum(), num_seqs
    if agg == "seq-mean-token-sum":
        return x.sum(), num_seqs
    if norm_length is None:
        raise ValueError("agg='seq-mean-token-sum-norm' needs norm_length")
    return x.sum(), num_seqs * norm_length


def divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0 (an empty batch contributes nothing, not NaN)."""
    safe = jnp.where(den > 0, den, 1)
    return jnp.where(den > 0, num / safe, 0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over mask (a metric helper; 0 for an empty mask)."""
    m = mask.astype(bool)
    return divide(jnp.where(m, _float(x), 0).sum(), m.sum().astype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Importance-sampling corrections (§3)
# --------------------------------------------------------------------------------------------


def importance_weights(
    old_logp: jax.Array, behavior_logp: jax.Array, mask: jax.Array, config: PolicyLossConfig
) -> tuple[jax.Array, Metrics]:
    """Per-token IS weights for the behaviour -> old-policy mismatch, with diagnostics.

    The raw weight is exp(old - beh) per token (`is_level="token"`), the product over the
    sequence's tokens ("sequence"), or its geometric mean ("geometric"); log-weights are clamped
    to [-20, 20]. TIS truncates: w = min(w, C). MIS masks: w = 0 outside [is_low, is_high].
    The returned weight is stop-gradient, [B, T], 0 off the mask, and 1 on the mask when
    `is_mode="none"` (diagnostics are still computed).

    Diagnostics are over units (tokens, or sequences for the sequence levels): raw weight mean,
    max and quantiles, ESS = (sum w)^2 / sum w^2 of the applied weights and ESS / units, and the
    fraction of units truncated (TIS) or masked (MIS). `config`: the `PolicyLossConfig` (its
    is_* fields).
    """
    cfg = expect_type(config, PolicyLossConfig, "config")
    _check_bt(mask, old_logp=old_logp, behavior_logp=behavior_logp)
    m = mask.astype(bool)
    log_w = jnp.where(m, _float(old_logp) - _float(behavior_logp), 0)
    if cfg.is_level == "token":
        log_w = jnp.clip(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        unit_log_w, unit_mask = log_w, m
    else:
        seq_log_w = log_w.sum(-1)
        if cfg.is_level == "geometric":
            seq_log_w = seq_log_w / jnp.maximum(m.sum(-1), 1)
        unit_log_w = jnp.clip(seq_log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        unit_mask = m.any(-1)
    raw = jnp.exp(unit_log_w)
    if cfg.is_mode == "tis":
        applied = jnp.minimum(raw, cfg.is_cap)
        clipped = raw > cfg.is_cap
    elif cfg.is_mode == "mis":
        keep = (raw >= cfg.is_low) & (raw <= cfg.is_high)
        applied = jnp.where(keep, raw, 0)
        clipped = ~keep
    else:
        applied = jnp.ones_like(raw)
        clipped = jnp.zeros_like(unit_mask)
    applied = jax.lax.stop_gradient(jnp.where(unit_mask, applied, 0))

    n_units = unit_mask.sum().astype(raw.dtype)
    sum_w = applied.sum()
    ess = divide(sum_w**2, (applied**2).sum())
    raw_nan = jnp.where(unit_mask, raw, jnp.nan)
    q05, q50, q95 = jnp.nanquantile(raw_nan, jnp.array([0.05, 0.5, 0.95]))
    any_unit = n_units > 0
    metrics = {
        "is_weight_mean": masked_mean(raw, unit_mask),
        "is_weight_max": jnp.max(jnp.where(unit_mask, raw, 0)),
        "is_weight_p05": jnp.where(any_unit, q05, 0),
        "is_weight_p50": jnp.where(any_unit, q50, 0),
        "is_weight_p95": jnp.where(any_unit, q95, 0),
        "is_ess": ess,
        "is_ess_frac": divide(ess, n_units),
        "is_frac_truncated": masked_mean(clipped, unit_mask) if cfg.is_mode == "tis" else jnp.zeros(()),
        "is_frac_masked": masked_mean(clipped, unit_mask) if cfg.is_mode == "mis" else jnp.zeros(()),
    }
    if cfg.is_level != "token":
        applied = jnp.where(m, applied[:, None], 0)
    return applied, metrics


# --------------------------------------------------------------------------------------------
# Policy losses (§2)
# --------------------------------------------------------------------------------------------


def _clipped_surrogate(
    ratio: jax.Array, adv: jax.Array, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """-min(r*A, clip(r)*A), optionally dual-clipped, and where each clip is active."""
    loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
    active = {
        "low": (adv < 0) & (ratio < 1 - clip_low),
        "high": (adv > 0) & (ratio > 1 + clip_high),
    }
    if dual_clip is not None:
        # For A < 0, -min(...) = max(-r*A, -clip(r)*A) grows without bound in r; cap at -c*A.
        active["dual"] = (adv < 0) & (-dual_clip * adv < loss)
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    else:
        active["dual"] = jnp.zeros_like(active["low"])
    return loss, active


def policy_loss_terms(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: PolicyLossConfig,
    behavior_logp: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Metrics]:
    """(numerator, denominator, metrics) of the policy loss; see `policy_loss`."""
    cfg = expect_type(config, PolicyLossConfig, "config")
    _check_bt(mask, logp=logp, old_logp=old_logp, behavior_logp=behavior_logp)
    if advantages.shape not in ((mask.shape[0],), mask.shape):
        raise ValueError(f"advantages must be [B] or [B,T] for mask {mask.shape}, got {advantages.shape}")
    if cfg.is_mode != "none" and behavior_logp is None:
        raise ValueError(f"loss.is_mode={cfg.is_mode!r} needs behavior_logp (the sampler's log-probs)")

    m = mask.astype(bool)
    # Sanitise off-mask entries first, so padding (e.g. logp = -inf) cannot leak NaN gradients.
    lp = jnp.where(m, _float(logp), 0)
    old = jax.lax.stop_gradient(jnp.where(m, _float(old_logp), 0))
    adv = _float(advantages)
    adv = jax.lax.stop_gradient(jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, m.shape))
    adv = jnp.where(m, adv, 0)
    log_ratio = jnp.clip(lp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)

    if cfg.kind == "ppo":
        per_token, active = _clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        shown_ratio = ratio
    elif cfg.kind in ("gspo", "gspo_token"):
        seq_len = jnp.maximum(m.sum(-1), 1)
        seq_log_ratio = jnp.clip((lp - old).sum(-1) / seq_len, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if cfg.kind == "gspo":
            seq_ratio = jnp.broadcast_to(jnp.exp(seq_log_ratio)[:, None], m.shape)
        else:
            # Value s_i, gradient per token: sg(s_i) * exp(logp_t - sg(logp_t)).
            seq_ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio))[:, None] * jnp.exp(
                lp - jax.lax.stop_gradient(lp)
            )
        per_token, active = _clipped_surrogate(seq_ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        shown_ratio = seq_ratio
    elif cfg.kind == "cispo":
        weight = jax.lax.stop_gradient(jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high))
        per_token = -weight * adv * lp
        active = {
            "low": ratio < 1 - cfg.clip_low,
            "high": ratio > 1 + cfg.clip_high,
            "dual": jnp.zeros_like(m),
        }
        shown_ratio = ratio
    else:  # reinforce
        per_token = -adv * lp
        active = {k: jnp.zeros_like(m) for k in ("low", "high", "dual")}
        shown_ratio = ratio

    metrics: Metrics = {}
    if behavior_logp is not None:
        weights, is_metrics = importance_weights(old_logp, behavior_logp, mask, cfg)
        metrics.update(is_metrics)
        if cfg.is_mode != "none":
            per_token = per_token * weights

    num, den = aggregate(per_token, m, cfg.agg, cfg.norm_length)
    sr = jax.lax.stop_gradient(shown_ratio)
    metrics.update(
        {
            "policy_loss": jax.lax.stop_gradient(divide(num, den)),
            "clip_frac_low": masked_mean(active["low"], m),
            "clip_frac_high": masked_mean(active["high"], m),
            "clip_frac_dual": masked_mean(active["dual"], m),
            "ratio_mean": masked_mean(sr, m),
            "ratio_max": jnp.max(jnp.where(m, sr, 0)),
            "ratio_min": jnp.where(m.any(), jnp.min(jnp.where(m, sr, jnp.inf)), 0),
            # k3 estimate of KL(pi_old || pi_theta) from samples of pi_old.
            "approx_kl": masked_mean(jax.lax.stop_gradient(ratio - 1 - log_ratio), m),
            "num_tokens": m.sum().astype(jnp.float32),
        }
    )
    return num, den, metrics


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: PolicyLossConfig,
    behavior_logp: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Policy-gradient loss of docs/reference.md §2 with the IS corrections of §3.

    Args:
      logp: [B, T] log pi_theta of the sampled tokens (differentiated).
      old_logp: [B, T] log pi_old, the policy the update starts from (constant).
      advantages: [B] (broadcast to every masked token) or [B, T].
      mask: [B, T], 1 on generated tokens.
      config: a `PolicyLossConfig` (`PolicyLossConfig.from_config`, or the `policy` of an
        `ObjectiveConfig`). kind="ppo": -min(r*A, clip(r)*A) [+ dual clip]; "gspo": the same with the sequence
        ratio s_i = exp(mean_t(logp - old)) for every token of sequence i (token-level
        advantages are allowed and multiply s_i); "gspo_token": value s_i, gradient per token;
        "cispo": -sg(clip(r)) * A * logp; "reinforce": -A * logp.
      behavior_logp: [B, T] log-probs of the sampler; required when is_mode != "none", and
        used for the IS diagnostics whenever given.

    Returns:
      (loss, metrics): the scalar loss under `config.agg` and a dict of scalars – policy_loss,
      clip_frac_low/high/dual (fractions of masked tokens where that clip is active),
      ratio_mean/max/min, approx_kl (k3 of KL(old || theta)), num_tokens, and with
      behavior_logp the is_* diagnostics of `importance_weights`.
    """
    num, den, metrics = policy_loss_terms(logp, old_logp, advantages, mask, config, behavior_logp)
    return divide(num, den), metrics


# --------------------------------------------------------------------------------------------
# KL, value, entropy (§2, §4)
# --------------------------------------------------------------------------------------------


def kl_divergence(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimator of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

    With log q = ref - logp (clamped to [-20, 20]): k1 = -log q; k2 = 0.5 (log q)^2;
    k3 = exp(log q) - 1 - log q (>= 0, unbiased, low variance). Gradients flow through logp.
    """
    one_of(kind, KL_KINDS, "kind")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {logp.shape} and ref_logp {ref_logp.shape} differ in shape")
    log_q = jnp.clip(_float(ref_logp) - _float(logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return -log_q
    if kind == "k2":
        return 0.5 * log_q**2
    return jnp.exp(log_q) - 1 - log_q


def kl_reward_penalty(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    beta: float,
    kind: str = "k1",
) -> jax.Array:
    """KL as a reward penalty (§4): R_b - beta * sum_t m * k_t, with no gradient. Returns [B]."""
    _check_bt(mask, logp=logp, ref_logp=ref_logp)
    k = jnp.where(mask.astype(bool), kl_divergence(logp, ref_logp, kind), 0)
    return _float(rewards) - beta * jax.lax.stop_gradient(k.sum(-1))


def value_loss_terms(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float | None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[jax.Array, jax.Array, Metrics]:
    """Clipped PPO value loss 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

    `clip=None` gives the plain 0.5 * (V - R)^2. All inputs [B, T]; `values` is differentiated.
    Metrics: value_loss, value_clip_frac (tokens where the clipped term is the larger),
    explained_variance 1 - Var(R - V) / Var(R) over masked tokens.
    """
    _check_bt(mask, values=values, old_values=old_values, returns=returns)
    m = mask.astype(bool)
    v = jnp.where(m, _float(values), 0)
    v_old = jax.lax.stop_gradient(jnp.where(m, _float(old_values), 0))
    ret = jax.lax.stop_gradient(jnp.where(m, _float(returns), 0))
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
        clipped_active = jnp.zeros_like(m)
    else:
        clipped = (jnp.clip(v, v_old - clip, v_old + clip) - ret) ** 2
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    num, den = aggregate(per_token, m, agg, norm_length)
    ret_mean = masked_mean(ret, m)
    var_ret = masked_mean((ret - ret_mean) ** 2, m)
    err = ret - v
    var_err = masked_mean((err - masked_mean(err, m)) ** 2, m)
    metrics = {
        "value_loss": jax.lax.stop_gradient(divide(num, den)),
        "value_clip_frac": masked_mean(clipped_active, m),
        "explained_variance": jax.lax.stop_gradient(1 - divide(var_err, var_ret)),
    }
    return num, den, metrics


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float | None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[jax.Array, Metrics]:
    """`value_loss_terms` divided: (scalar loss, metrics)."""
    num, den, metrics = value_loss_terms(values, old_values, returns, mask, clip, agg, norm_length)
    return divide(num, den), metrics


def _tempered_log_softmax(logits: jax.Array, temperature: float) -> jax.Array:
    if _is_number(temperature) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return jax.nn.log_softmax(_float(logits) / temperature, axis=-1)


def entropy_from_logits(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """H = -sum_v p_v log p_v of softmax(logits / temperature) over the last axis: [..., V] -> [...]."""
    logq = _tempered_log_softmax(logits, temperature)
    return -jnp.sum(jnp.exp(logq) * logq, axis=-1)


def logprobs_from_logits(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[token]: logits [..., V], tokens [...] -> [...]."""
    logq = _tempered_log_softmax(logits, temperature)
    return jnp.take_along_axis(logq, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


# --------------------------------------------------------------------------------------------
# Micro-batch / data-parallel accumulation (§5)
# --------------------------------------------------------------------------------------------


def accumulate_gradients(
    terms_fn: Callable[[Any, Any], tuple[jax.Array, jax.Array, Metrics]],
    params: Any,
    microbatches: Any,
    axis_name: str | None = None,
) -> tuple[jax.Array, Any, Metrics]:
    """Gradient of the full-batch loss from micro-batches, exactly.

    `terms_fn(params, microbatch) -> (num, den, metrics)` as the `*_terms` functions return.
    Because denominators do not depend on parameters, grad(sum_i num_i / sum_i den_i) =
    sum_i grad(num_i) / sum_i den_i: one pass, one gradient buffer, any aggregation mode.

    Args:
      terms_fn: the loss of one micro-batch as (numerator, denominator, metrics).
      params: pytree differentiated.
      microbatches: pytree whose leaves have a leading micro-batch axis M (scanned over).
      axis_name: when given (inside `shard_map`/`pmap`), numerators' gradients and denominators
        are also summed across that axis, so data-parallel shards divide by the global
        denominator.

    Returns:
      (loss, grads, metrics): metrics are the mean over micro-batches (and shards).
    """

    def body(carry, mb):
        grad_acc, num_acc, den_acc = carry
        (num, (den, metrics)), grads = jax.value_and_grad(
            lambda p: (lambda n, d, mt: (n, (d, mt)))(*terms_fn(p, mb)), has_aux=True
        )(params)
        grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
        return (grad_acc, num_acc + num, den_acc + den), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, num, den), metrics = jax.lax.scan(body, init, microbatches)
    metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), metrics)
    if axis_name is not None:
        grads, num, den = jax.lax.psum((grads, num, den), axis_name)
        metrics = jax.lax.pmean(metrics, axis_name)
    grads = jax.tree.map(lambda g, p: divide(g, den).astype(p.dtype), grads, params)
    return divide(num, den), grads, metrics


# --------------------------------------------------------------------------------------------
# The full RL objective
# --------------------------------------------------------------------------------------------


def objective_terms(
    config: ObjectiveConfig,
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    behavior_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    old_values: jax.Array | None = None,
    returns: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Metrics]:
    """(num, den, metrics) of policy loss + kl_coef * KL - entropy_coef * H + value_coef * V.

    `config` is the `ObjectiveConfig` of the `loss` section. All terms share `config.policy.agg`
    and the mask, hence the denominator. The KL term is included when kl_coef > 0 and
    kl_penalty == "loss" (for "reward", apply `kl_reward_penalty` to the rewards before the
    advantages). Inputs a nonzero coefficient needs are required; a KL or entropy input given
    with a zero coefficient is still reported as a metric.
    """
    config = expect_type(config, ObjectiveConfig, "config")
    pol = config.policy
    num, den, metrics = policy_loss_terms(logp, old_logp, advantages, mask, pol, behavior_logp)

    kl_coef = config.kl_coef
    kl_in_loss = kl_coef > 0 and config.kl_penalty == "loss"
    if kl_in_loss and ref_logp is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
    if ref_logp is not None:
        kl_num, _ = aggregate(kl_divergence(logp, ref_logp, config.kl_kind), mask, pol.agg, pol.norm_length)
        metrics["kl_ref"] = jax.lax.stop_gradient(divide(kl_num, den))
        if kl_in_loss:
            num = num + kl_coef * kl_num

    entropy_coef = config.entropy_coef
    if entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the per-token entropy")
    if entropy is not None:
        ent_num, _ = aggregate(entropy, mask, pol.agg, pol.norm_length)
        metrics["entropy"] = jax.lax.stop_gradient(divide(ent_num, den))
        if entropy_coef > 0:
            num = num - entropy_coef * ent_num

    value_coef = config.value_coef
    if value_coef > 0:
        if values is None or old_values is None or returns is None:
            raise ValueError("loss.value_coef > 0 needs values, old_values and returns")
        v_num, _, v_metrics = value_loss_terms(
            values, old_values, returns, mask, config.value_clip, pol.agg, pol.norm_length
        )
        metrics.update(v_metrics)
        num = num + value_coef * v_num
    metrics["loss"] = jax.lax.stop_gradient(divide(num, den))
    return num, den, metrics
