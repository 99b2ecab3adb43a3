"""Real-time RL from usage logs: the main job's policy, served to simulated users, trained on what
they did with its answers (rlcode.train.usage).

    python -m experiments.train --config=configs/usage_rl.py

The policy, tasks, SFT warm start (shared with configs/grpo_synth.py through the SFT cache) and
objective are the main job's, with the fresh byte-level policy unless the argument names a base
(`:base=code` for the pretrained one; results/usage_rl.json was measured with base=bytes); the batches are 32 settled interactions of the usage log, one
completion per request, rewarded from outcome events. A simulated deployment serves 32 requests
per 10 simulated minutes; an edit is checked for being kept 30 minutes after it was accepted, so
an interaction settles 40 minutes (4 windows) after it was served. Every 5 steps the candidate is
evaluated on the fixed suite (64 fresh tasks of the users' distribution, 8 samples each, the same
sampling key every time) and published only if it passes the regression gate.
experiments/usage_rl.py runs this job and reports the A/B comparisons between published versions.
"""

import os

from experiments.ablate import combine_args, load_config_module
from rlcode.feedback.deployment import deployment_config
from rlcode.train.usage import usage_config

MAIN_JOB = load_config_module(os.path.join(os.path.dirname(__file__), "grpo_synth.py"))
ARGS = MAIN_JOB.ARGS  # the main job's choices (configs/grpo_synth.py): objective, attention, MLP, base, tasks


def get_config(arg=None):
    cfg = MAIN_JOB.get_config(combine_args("base=bytes", arg))
    cfg.job = "usage"
    cfg.workdir = "runs/usage_rl"
    cfg.rollout.update({"prompts_per_step": 32, "group_size": 1, "max_draws": 1})
    # One completion per request: the batch is the baseline (no groups to normalise within).
    cfg.advantage.normalize = "batch"
    # The gate keeps a candidate out when its fixed-suite pass@1 is more than 0.02 below the live
    # version's (about 1.5 standard errors of a 512-sample estimate near 0.15); a rejected
    # candidate is rolled back.
    cfg.usage = usage_config(gate_margin=0.02)
    cfg.deployment = deployment_config()
    cfg.train.steps = 80
    cfg.eval.update({"every": 5, "num_samples": 8, "ks": (1, 8), "prompts_per_batch": 16})
    cfg.log.text_every = 10
    return cfg
