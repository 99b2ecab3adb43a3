"""Every config file builds, through absl's config_flags, for every argument it declares."""

import glob
import os

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from experiments.ablate import load_config_module
from rlcode import losses, recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def parse(argv):
    values = flags.FlagValues()
    # config_flags discovers the override flags (--config.a.b=...) from the argv it is given.
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values, sys_argv=["prog", *argv])
    values(["prog", *argv])
    return values.config


def declared_args(path):
    module = load_config_module(path)
    assert callable(getattr(module, "get_config", None)), f"{path} has no get_config(arg=None)"
    assert module.__doc__ and "python -m" in module.__doc__, f"{path}: docstring must hold the launch command"
    return (None, *getattr(module, "ARGS", ()))


def test_there_are_config_files():
    assert CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_builds_for_every_argument(path):
    for arg in declared_args(path):
        cfg = parse([f"--config={path}" + (f":{arg}" if arg else "")])
        assert isinstance(cfg, ml_collections.ConfigDict)
        if "loss" in cfg:
            losses.ObjectiveConfig.from_config(cfg.loss)


def test_command_line_overrides_reach_the_config():
    path = os.path.join(ROOT, "configs", "objectives_demo.py")
    cfg = parse([f"--config={path}:dapo", "--config.loss.clip_high=0.31", "--config.loss.dual_clip=3.0",
                 "--config.train.steps=7", "--config.loss.is_mode=tis"])
    assert cfg.objective == "dapo"
    assert cfg.loss.clip_high == 0.31 and cfg.loss.dual_clip == 3.0 and cfg.train.steps == 7
    assert cfg.loss.is_mode == "tis"
    with pytest.raises(flags.IllegalFlagValueError):
        parse([f"--config={path}:grpo", "--config.loss.clip_high=wide"])
    with pytest.raises(flags.IllegalFlagValueError, match="recipe='trpo' is not one of"):
        parse([f"--config={path}:trpo"])


def test_recipes_match_the_papers():
    r = {name: recipes.recipe(name, max_new_tokens=1000) for name in recipes.RECIPES}
    assert (r["grpo"].advantage.normalize, r["grpo"].loss.agg) == ("std", "seq-mean-token-mean")
    assert r["grpo"].loss.kl_coef == 0.04 and r["grpo"].loss.kl_kind == "k3"
    assert r["dr_grpo"].advantage.normalize == "none"
    assert (r["dr_grpo"].loss.agg, r["dr_grpo"].loss.norm_length) == ("seq-mean-token-sum-norm", 1000)
    assert (r["dapo"].loss.clip_low, r["dapo"].loss.clip_high, r["dapo"].loss.agg) == (0.2, 0.28, "token-mean")
    assert r["dapo"].loss.kl_coef == 0 and r["dapo"].shaping.dynamic_sampling
    assert r["dapo"].shaping.overlong_cache_length == 200
    assert (r["gspo"].loss.kind, r["gspo"].loss.clip_low, r["gspo"].loss.clip_high) == ("gspo", 3e-4, 4e-4)
    assert (r["cispo"].loss.kind, r["cispo"].loss.clip_low, r["cispo"].loss.agg) == ("cispo", 1.0, "token-mean")
    assert r["ppo"].advantage.estimator == "gae" and r["ppo"].loss.value_coef > 0
    for cfg in r.values():
        losses.ObjectiveConfig.from_config(cfg.loss)
    with pytest.raises(ValueError, match="max_new_tokens"):
        recipes.recipe("grpo", max_new_tokens=0)


@pytest.mark.parametrize("name", ["grpo_synth", "agent_repo"])
def test_both_rl_jobs_start_from_the_committed_base_unless_told_bytes(name):
    from rlcode.models import hf
    from rlcode.train.pretrain import PUBLISHED

    path = os.path.join(ROOT, "configs", f"{name}.py")
    default, fresh = parse([f"--config={path}"]), parse([f"--config={path}:base=bytes"])
    assert default.model.init_from == PUBLISHED and default.tokenizer == "init_from"
    assert os.path.isfile(os.path.join(ROOT, PUBLISHED, "config.json"))  # the base is committed
    assert hf.read_config(os.path.join(ROOT, PUBLISHED))["vocab_size"] == 8192
    assert fresh.model.init_from == "" and fresh.tokenizer == "byte" and fresh.model.vocab_size == 320
    # The budgets follow the tokenizer: BPE tokens from the base are fewer than bytes.
    lengths = (("task", "max_prompt_len"), ("sampling", "max_new_tokens")) if name == "grpo_synth" else (
        ("agent", "max_context_tokens"), ("agent", "max_response_tokens"))
    for section, field in lengths:
        assert default[section][field] < fresh[section][field], (section, field)
