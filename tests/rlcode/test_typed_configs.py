"""The typed config sections: each section a job reads becomes a frozen, validated dataclass
through `from_config`, which refuses unknown and mistyped fields (naming the closest known one)
and values of the wrong type or range, and reads a ConfigDict and the same section as a dict
alike."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rlcode import losses, recipes
from rlcode.advantages import AdvantageConfig
from rlcode.checks import ConfigError
from rlcode.envs import rewards
from rlcode.models.lora import LoraConfig, lora_config
from rlcode.sampling import SamplingConfig
from rlcode.train import rollout
from support import job_config

SYNTH = job_config("grpo_synth")
AGENT = job_config("agent_repo")

# (id, class, section name, a section as a job's config holds it, a mistyped field, the field it
# should suggest, [(field, invalid value), ...]).
SECTIONS = [
    ("objective", losses.ObjectiveConfig, "loss", SYNTH.loss, "kl_cof", "kl_coef",
     [("kl_coef", -0.1), ("kl_kind", "k4"), ("kl_penalty", "both"), ("entropy_coef", float("nan")),
      ("value_clip", "0.2"), ("kind", "trpo"), ("clip_low", True), ("dual_clip", 0.5), ("norm_length", 2.5),
      ("is_cap", 0.0)]),
    ("policy", losses.PolicyLossConfig, "loss",
     {k: v for k, v in SYNTH.loss.items() if k in losses.POLICY_SPECS}, "clip_hihg", "clip_high",
     [("kind", "trpo"), ("clip_high", -0.2), ("agg", "mean"), ("is_level", None), ("norm_length", 0)]),
    ("advantage", AdvantageConfig, "advantage", SYNTH.advantage, "normalise", "normalize",
     [("estimator", "monte-carlo"), ("normalize", "z"), ("eps", 0.0), ("gamma", 1.5), ("lam", "0.9")]),
    ("shaping", recipes.ShapingConfig, "shaping", recipes.recipe("dapo", 80).shaping, "overlong_cache_len",
     "overlong_cache_length", [("dynamic_sampling", 1), ("overlong_cache_length", -1),
                               ("overlong_cache_length", 2.0)]),
    ("agent_reward", rewards.RewardConfig, "reward", AGENT.reward, "turn_weigth", "turn_weight",
     [("test_reward", "best"), ("hack_flags", "tests_edited"), ("hack_flags", ("tests_edited", "made_up")),
      ("length_growth", 0.5), ("malformed_cap", 1.5), ("turn_weight", -0.01)]),
    ("synth_reward", rewards.SynthRewardConfig, "reward", SYNTH.reward, "truncation_penality",
     "truncation_penalty", [("tests", "best"), ("truncation_penalty", -1.0), ("timeout", 0.0)]),
    ("synth_rollout", rollout.RolloutConfig, "rollout", SYNTH.rollout, "group_sise", "group_size",
     [("group_size", 0), ("prompts_per_step", 2.0), ("async_mode", "yes"), ("max_staleness", -1),
      ("max_draws", 0)]),
    ("agent_rollout", rollout.RolloutConfig, "rollout", AGENT.rollout, "prompts_per_stp", "prompts_per_step",
     [("prompts_per_step", 0)]),
    ("synth_sandbox", rollout.SandboxConfig, "sandbox", SYNTH.sandbox, "worker", "workers",
     [("workers", 0), ("workers", 100_000), ("timeout", -1.0)]),
    ("agent_sandbox", rollout.SandboxConfig, "sandbox", AGENT.sandbox, "timout", "timeout",
     [("timeout", 0.0), ("workers", "2")]),
    ("synth_sampling", SamplingConfig, "sampling", SYNTH.sampling, "temprature", "temperature",
     [("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_new_tokens", 0)]),
    ("agent_sampling", SamplingConfig, "sampling", AGENT.sampling, "top_pp", "top_p",
     [("temperature", -1.0), ("stop_ids", "2")]),
    ("synth_lora", LoraConfig, "lora", SYNTH.lora, "rnak", "rank",
     [("rank", -1), ("rank", 2.0), ("alpha", 0.0), ("targets", ("q", "x")), ("targets", ()), ("dtype", "float16")]),
    ("agent_lora", LoraConfig, "lora", AGENT.lora, "target", "targets", [("targets", "q")]),
]
IDS = [s[0] for s in SECTIONS]


def as_dict(section):
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


@pytest.mark.parametrize("cls, name, section, typo, right, _", [s[1:] for s in SECTIONS], ids=IDS)
def test_configdict_and_dict_agree(cls, name, section, typo, right, _):
    typed = cls.from_config(section)
    assert isinstance(typed, cls)
    assert cls.from_config(as_dict(section)) == typed
    assert cls.from_config(ml_collections.FrozenConfigDict(section)) == typed
    assert cls.from_config(typed) is typed
    # Every field of the section reaches the dataclass as it is in the config.
    for field, value in as_dict(section).items():
        got = getattr(typed.policy if cls is losses.ObjectiveConfig and field in losses.POLICY_SPECS else typed, field)
        assert got == (tuple(value) if isinstance(value, list) else value), field


@pytest.mark.parametrize("cls, name, section, typo, right, _", [s[1:] for s in SECTIONS], ids=IDS)
def test_unknown_or_mistyped_field_is_an_error_naming_it(cls, name, section, typo, right, _):
    value = as_dict(section).get(right, 1)
    hint = rf"unknown config field '{name}\.{typo}'; did you mean {name}\.{right}"
    with pytest.raises(ConfigError, match=hint):
        cls.from_config({**as_dict(section), typo: value})
    with pytest.raises(ConfigError, match=hint):
        cls.from_config({typo: value})  # the mistyped name alone: not silently dropped for the default
    extended = ml_collections.ConfigDict(as_dict(section))
    extended[typo] = value
    with pytest.raises(ConfigError, match=hint):
        cls.from_config(extended)
    with pytest.raises(ConfigError, match=rf"{name} section must be a config section"):
        cls.from_config([(right, value)])


@pytest.mark.parametrize("cls, name, section, _, __, bad", [s[1:] for s in SECTIONS], ids=IDS)
def test_wrong_type_or_range_is_an_error_naming_the_field(cls, name, section, _, __, bad):
    for field, value in bad:
        with pytest.raises(ConfigError, match=rf"^{name}\.{field}="):
            cls.from_config({**as_dict(section), field: value})
        if cls is not losses.ObjectiveConfig:  # constructing directly validates as well
            with pytest.raises(ConfigError, match=rf"^{name}\.{field}="):
                cls(**{field: value})


def test_constraints_between_loss_fields():
    with pytest.raises(ConfigError, match="norm_length"):
        losses.ObjectiveConfig.from_config({"agg": "seq-mean-token-sum-norm"})
    assert losses.ObjectiveConfig.from_config({"agg": "seq-mean-token-sum-norm", "norm_length": 80}).policy.norm_length == 80
    with pytest.raises(ConfigError, match="loss.is_low=2.0 must be <= loss.is_high=1.0"):
        losses.PolicyLossConfig(is_low=2.0, is_high=1.0)
    # The coefficients belong to the whole section: the policy part alone does not know them.
    with pytest.raises(ConfigError, match="unknown config field 'loss.kl_coef'"):
        losses.PolicyLossConfig.from_config({"kind": "ppo", "kl_coef": 0.1})
    with pytest.raises(TypeError, match="PolicyLossConfig"):
        losses.ObjectiveConfig(policy={"kind": "ppo"})


def test_builders_are_the_dataclass_defaults():
    """The default sections the configs embed hold exactly the dataclasses' fields and defaults."""
    pairs = [(losses.loss_config(), losses.ObjectiveConfig()), (recipes.advantage_config(), AdvantageConfig()),
             (recipes.shaping_config(), recipes.ShapingConfig()), (rewards.reward_config(), rewards.RewardConfig()),
             (rewards.synth_reward_config(), rewards.SynthRewardConfig()), (lora_config(), LoraConfig())]
    for section, default in pairs:
        assert type(default).from_config(section) == default
    with pytest.raises(ValueError, match="unknown advantage config field"):
        recipes.advantage_config(normalise="none")  # was silently added to the section
    with pytest.raises(ConfigError, match="shaping.overlong_cache_length"):
        recipes.shaping_config(overlong_cache_length=-5)


@pytest.mark.parametrize("cls, name, section", [s[1:4] for s in SECTIONS], ids=IDS)
def test_frozen_and_hashable(cls, name, section):
    typed = cls.from_config(section)
    again = cls.from_config(as_dict(section))
    assert typed is not again and hash(typed) == hash(again)
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(typed, field, getattr(typed, field))
    # Usable as a static argument of jit: equal sections share one compilation.
    traces = []

    def body(cfg, x):
        traces.append(cfg)
        return x + 1

    f = jax.jit(body, static_argnums=0)
    f(typed, jnp.zeros(()))
    f(again, jnp.zeros(()))
    assert len(traces) == 1


def test_objective_as_a_static_argument_gives_the_eager_value():
    rng = np.random.default_rng(0)
    B, T = 3, 5
    logp = jnp.asarray(-np.abs(rng.normal(1, 0.5, (B, T))), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.2, (B, T)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(B,)), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8)
    objective = losses.ObjectiveConfig.from_config(recipes.recipe("grpo", T).loss)
    fn = jax.jit(lambda c, *a: losses.objective_terms(c, *a, ref_logp=a[0] - 0.1)[:2], static_argnums=0)
    eager = losses.objective_terms(objective, logp, old, adv, mask, ref_logp=logp - 0.1)[:2]
    np.testing.assert_allclose([float(x) for x in fn(objective, logp, old, adv, mask)],
                               [float(x) for x in eager], rtol=1e-6)
    assert objective.kl_coef == 0.04 and objective.policy.agg == "seq-mean-token-mean"
