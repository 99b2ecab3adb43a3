"""Ready-made objective configs for the published recipes.

`recipe(name, max_new_tokens=...)` returns a ConfigDict with three sections that experiment
configs embed as they are and override field by field:

* `advantage`: estimator ("group" or "gae"), normalize (see `advantages.group_advantages`), eps,
  gamma, lam (GAE);
* `loss`: the fields of `losses.loss_config` (policy loss kind, clipping, aggregation, IS
  correction, KL / entropy / value coefficients);
* `shaping`: reward-side choices of the recipe – dynamic_sampling (DAPO: drop groups whose
  rewards are all equal and refill) and overlong_cache_length (DAPO's soft overlong punishment;
  0 = off).

Values are the papers' unless marked as a project default. Where a job reads its config, each
section becomes a frozen, validated dataclass: `rlcode.advantages.AdvantageConfig`,
`rlcode.losses.ObjectiveConfig` and `ShapingConfig`.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from rlcode.advantages import AdvantageConfig
from rlcode.checks import TypedSection, flag, integer, one_of
from rlcode.losses import loss_config

RECIPES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo")
SHAPING_SPECS = {"dynamic_sampling": flag(), "overlong_cache_length": integer(0)}

CITATIONS = {
    "grpo": "DeepSeekMath, arXiv 2402.03300",
    "dr_grpo": "Understanding R1-Zero-Like Training (Dr. GRPO), arXiv 2503.20783",
    "dapo": "DAPO, arXiv 2503.14476",
    "gspo": "Group Sequence Policy Optimization, arXiv 2507.18071",
    "cispo": "MiniMax-M1 (CISPO), arXiv 2506.13585",
    "ppo": "PPO, arXiv 1707.06347; GAE, arXiv 1506.02438",
}


@dataclasses.dataclass(frozen=True)
class ShapingConfig(TypedSection):
    """The `shaping` section, validated and frozen (hashable).

    dynamic_sampling: keep only groups whose valid rewards are not all equal, drawing new
    prompts to refill the batch (DAPO; `rlcode.train.rollout.RolloutCollector.collect`).
    overlong_cache_length: the band of DAPO's soft overlong punishment in tokens
    (`rlcode.advantages.overlong_penalty`); 0 = off.
    """

    SPECS = SHAPING_SPECS
    SECTION = "shaping"

    dynamic_sampling: bool = False
    overlong_cache_length: int = 0


def advantage_config(**overrides) -> ml_collections.ConfigDict:
    """Default `advantage` section: GRPO group normalisation (the `AdvantageConfig` defaults);
    an unknown or invalid field is an error naming it."""
    return AdvantageConfig.default_section(**overrides)


def shaping_config(**overrides) -> ml_collections.ConfigDict:
    """Default `shaping` section (the `ShapingConfig` defaults: both off)."""
    return ShapingConfig.default_section(**overrides)


def recipe(name: str, max_new_tokens: int) -> ml_collections.ConfigDict:
    """The objective config of a published recipe.

    Args:
      name: one of RECIPES.
      max_new_tokens: the generation length limit of the experiment; Dr. GRPO divides by it
        (seq-mean-token-sum-norm) and DAPO's overlong band is a fraction of it.
    """
    one_of(name, RECIPES, "recipe")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    adv = advantage_config()
    shaping = shaping_config()
    if name == "grpo":
        # Original GRPO: per-sequence token mean, KL to the reference in the loss (k3, beta 0.04).
        loss = loss_config(kind="ppo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean",
                           kl_coef=0.04, kl_kind="k3")
    elif name == "dr_grpo":
        # No std normalisation, no length normalisation: divide by the constant B * L_max.
        adv.normalize = "none"
        loss = loss_config(kind="ppo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum-norm",
                           norm_length=max_new_tokens)
    elif name == "dapo":
        # Clip-higher, token-level mean, no KL, dynamic sampling, soft overlong punishment
        # (the paper's cache band is 4096 of 20480 tokens: a fifth of the limit).
        loss = loss_config(kind="ppo", clip_low=0.2, clip_high=0.28, agg="token-mean")
        shaping.dynamic_sampling = True
        shaping.overlong_cache_length = max(1, max_new_tokens // 5)
    elif name == "gspo":
        loss = loss_config(kind="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean")
    elif name == "cispo":
        # The paper sets no lower bound (eps_low large) and tunes only eps_high; its value is not
        # published. clip_high=4.0 (IS weights capped at 5) is a project default.
        loss = loss_config(kind="cispo", clip_low=1.0, clip_high=4.0, agg="token-mean")
    else:  # ppo
        # Token-level PPO with a value head and GAE; gamma = 1 for episodic code rewards.
        # lam = 0.95, value clip 0.2 and value_coef 0.5 are the usual PPO settings.
        adv.estimator = "gae"
        loss = loss_config(kind="ppo", clip_low=0.2, clip_high=0.2, agg="token-mean",
                           value_coef=0.5, value_clip=0.2)
    return ml_collections.ConfigDict(
        {"name": name, "citation": CITATIONS[name], "advantage": adv, "loss": loss, "shaping": shaping}
    )
