"""Objectives demo: a published RL recipe trains a tabular policy on the sequence bandit.

    python -m experiments.objectives_demo --config=configs/objectives_demo.py:dapo

The argument after ':' is a recipe name from `rlcode.recipes.RECIPES` (default grpo). Any field
can be overridden, e.g. `--config.loss.clip_high=0.28 --config.train.staleness=2
--config.loss.is_mode=tis`.
"""

import ml_collections

from rlcode.recipes import RECIPES, recipe

# The arguments this config accepts after ':' (every config file lists its own; tests build each).
ARGS = RECIPES


def get_config(arg=None):
    cfg = ml_collections.ConfigDict()
    cfg.seed = 0
    cfg.task = ml_collections.ConfigDict({"num_prompts": 32, "max_len": 12, "vocab": 8})
    cfg.rollout = ml_collections.ConfigDict({"prompts_per_step": 8, "group_size": 8, "max_draws": 4})
    cfg.train = ml_collections.ConfigDict(
        {
            "steps": 120,
            "lr": 0.1,
            "epochs": 2,  # passes over each rollout batch
            "minibatches": 2,  # optimizer steps per pass
            "microbatches": 2,  # gradient accumulation inside one optimizer step
            "staleness": 0,  # sample with the parameters of this many steps ago
            "log_every": 10,
        }
    )
    objective = recipe(arg or "grpo", max_new_tokens=cfg.task.max_len)  # raises on an unknown name
    cfg.objective = objective.name
    cfg.advantage = objective.advantage
    cfg.loss = objective.loss
    cfg.shaping = objective.shaping
    cfg.workdir = "runs/objectives_demo"
    return cfg
