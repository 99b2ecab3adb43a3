"""Multi-turn agent RL on repository tasks: SFT from scripted experts, then GRPO (rlcode.train.agent).

    python -m experiments.train --config=configs/agent_repo.py

The policy reads files, edits them, runs the tests and submits, through the tool-calling harness,
in the sandbox; the reward is whether the held-out tests pass (minus length, malformed-call and
per-turn penalties). Runs on a laptop CPU: the defaults use level-1 tasks (one-line fixes), the
recovering expert (read; a wrong edit, refused with the file's closest line; that line copied into
the edit; test; submit) and the 3.1M-parameter pretrained base (base=code); `train.max_minutes`
bounds the time spent in RL steps (evaluations excluded). The argument after ':' is a comma-separated list of choices:

  attention=squid (default) | dense   squid: files the agent reads are documents whose KV is
                  encoded once and reused across the G episodes of a group and across turns.
  loss=<recipe>   one of rlcode.recipes.RECIPES except ppo (default grpo).
  levels=1 | 12 | 123   task difficulties (default 1).
  base=<model>    what SFT starts from: code (default: checkpoints/code_base, the 3.1M-parameter
                  base pretrained on Python by configs/pretrain_code.py, with its 8,192-token BPE),
                  bytes (a fresh 0.8M-parameter byte-level policy of AGENT_SHAPE; a context of 3,072
                  and responses of 192 bytes) or a Hugging Face checkpoint directory of that kind
                  (its architecture is the checkpoint's; the shape fields of `model` take effect
                  only with base=bytes). With a BPE base the budgets are in its tokens, sized
                  on the scripted expert: a whole expert episode is at most 780 / 916 / 1,150
                  tokens at levels 1 / 2 / 3 (2,065 / 2,707 / 3,448 bytes; 24 train tasks per
                  level), one expert turn at most 74 / 88 / 178 tokens. The harness keeps room
                  for a response and a summary after every turn, so the context is 1,280 tokens
                  (1,792 with level 3): every expert episode of 48 train tasks per level then
                  fits one context (at 1,024 tokens 37 of 48 did at level 1). A response is 96
                  tokens (192 with level 3); the length penalty's midpoint is 224 generated
                  tokens (the expert generates 0.44 times as many BPE tokens as bytes). These
                  sizes were measured on the compact expert; the recovering expert's episodes
                  (one turn longer) fit them too: all 2,000 level-1 demonstrations (881 tokens
                  on average), and a test replays it at every level.

`--config.task.demo_bugs=varied` has the expert demonstrate each of its tasks with the bug drawn
from a much wider set (any wrong constant of 2-999, any one-operator, operand-order or parameter
change of the formula, any comparison near the threshold; `rlcode.envs.tasks.repo.generate_task`):
with the standard draw a function's broken line is one of 2-4 forms, so SFT can fit it from the
task's family without reading the file; RL and evaluation keep the standard tasks.
`--config.agent.expert_style=recover` (the default) has the expert first try a wrong line, which the
tool refuses showing the file's closest line (`agent.edit_hints`, required), then copy that line:
the policy learns to answer a refused edit by copying the line it is shown, and its fresh-task
success at the warm start roughly doubles (README, "Agent RL on repository tasks"). `compact`
(read, edit, test, submit) is the expert of the runs before it.

Any field can then be overridden: `--config.rollout.group_size=4`, `--config.train.max_minutes=60`,
`--config.seed=1 --config.workdir=runs/agent_repo/seed1`, `--config.resume=True`;
`--config.seed=1 --config.sft.seed=0` runs RL seed 1 from seed 0's (cached) warm start.

`resume=True` continues the run in `workdir` and refuses a config that differs from its saved
config.json, naming each changed field, except train.steps, train.max_minutes, sandbox.workers,
checkpoint.every / keep, workdir and sft.cache_dir; `resume_override=True` accepts the changes
(the old config is kept in config_history/).
"""

import ml_collections

from rlcode.checks import parse_config_arg
from rlcode.envs.rewards import reward_config
from rlcode.feedback.behaviour import behaviour_config
from rlcode.models.attention import attention_config
from rlcode.models.lora import lora_config
from rlcode.models.transformer import model_config
from rlcode.recipes import RECIPES, recipe
from rlcode.sharding import mesh_config
from rlcode.train.pretrain import start_from_base
from rlcode.train.sft import sft_config
from rlcode.train.step import optim_config

ARGS = ("attention=squid", "attention=dense") + tuple(f"loss={n}" for n in RECIPES if n != "ppo") + (
    "levels=1", "levels=12", "levels=123", "base=bytes", "base=bytes,levels=123")

# The pretrained base and the agent's budgets in its tokens (the docstring says how they were sized).
BPE_BUDGETS = {"max_context_tokens": (1280, 1792), "max_response_tokens": (96, 192), "length_midpoint": 224.0}

AGENT_SHAPE = dict(vocab_size=320, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                   ffw_dim=384)


def get_config(arg=None):
    choices = parse_config_arg(arg, {"attention": "squid", "loss": "grpo", "levels": "1", "base": "code"})
    if choices["attention"] not in ("squid", "dense"):
        raise ValueError(f"attention={choices['attention']!r}: expected squid or dense")
    if choices["loss"] not in RECIPES or choices["loss"] == "ppo":
        raise ValueError(f"loss={choices['loss']!r}: expected one of {[n for n in RECIPES if n != 'ppo']}")
    if not choices["levels"] or set(choices["levels"]) - set("123"):
        raise ValueError(f"levels={choices['levels']!r}: expected digits among 1, 2, 3 (e.g. 12)")
    cfg = ml_collections.ConfigDict()
    cfg.job = "agent"
    cfg.seed = 0
    cfg.workdir = "runs/agent_repo"
    cfg.resume = False
    cfg.tokenizer = "byte"  # or a tokenizer.json / checkpoint directory, or "init_from" (model.init_from's files)
    cfg.resume_override = False  # resume with a changed config (see the docstring)
    cfg.model = model_config(**AGENT_SHAPE, attention=attention_config(choices["attention"]))
    from_base = start_from_base(cfg, choices["base"])
    cfg.mesh = mesh_config()

    # The first num_demos of the num_train tasks are SFT demonstrations; RL draws its prompts from
    # the rest (rl_tasks="undemonstrated"; "all": from every train task). Every demonstration is a
    # distinct task: with 400 the policy learnt the demonstrations' own package names instead of
    # copying the prompt's (0 of 512 fresh episodes succeeded; 2,000 and 600 SFT steps: 47% of 128).
    # RL on undemonstrated tasks cannot be rewarded for recalling a demonstration; at this scale
    # the rollout success was the same on both (README, "Agent RL on repository tasks").
    # source: "repo" (the generated repository tasks) or "mined" (bug-fix tasks in real projects,
    # prepared once into mined_dir by `python -m experiments.prepare_mined`; no fresh set).
    cfg.task = ml_collections.ConfigDict({"source": "repo", "mined_dir": ".cache/mined",
                                          "levels": tuple(int(c) for c in choices["levels"]), "num_train": 4000,
                                          "num_demos": 2000, "rl_tasks": "undemonstrated", "demo_bugs": "standard",
                                          "num_fresh": 32, "num_eval": 8, "seed": 0})
    cfg.agent = ml_collections.ConfigDict({
        "max_turns": 6, "max_context_tokens": 3072, "max_response_tokens": 192, "summarize": True,
        "compact_prompt": True, "expert_style": "recover", "prefill": "documents",
        "tools": ("read_file", "edit_file", "grep", "run_tests", "submit"),
        # A failed edit_file shows the file's closest text. A run saved before this field ran without
        # it (evaluated so), and resuming one with hints on is a config change.
        "edit_hints": True})
    cfg.sampling = ml_collections.ConfigDict({"temperature": 1.0})
    # async_mode: play the episodes of step t + 1 while step t trains (at most max_staleness
    # batches in flight; see rlcode.train.engine).
    cfg.rollout = ml_collections.ConfigDict({"prompts_per_step": 4, "group_size": 8, "async_mode": False,
                                             "max_staleness": 1})
    cfg.sandbox = ml_collections.ConfigDict({"workers": 2, "timeout": 10.0})
    # Success = every held-out test passes; small penalties per turn and per malformed call.
    cfg.reward = reward_config(test_reward="all_pass", turn_weight=0.02, malformed_weight=0.1,
                               length_midpoint=512.0)

    if from_base:
        long = 3 in cfg.task.levels
        cfg.agent.max_context_tokens = BPE_BUDGETS["max_context_tokens"][long]
        cfg.agent.max_response_tokens = BPE_BUDGETS["max_response_tokens"][long]
        cfg.reward.length_midpoint = BPE_BUDGETS["length_midpoint"]

    objective = recipe(choices["loss"], max_new_tokens=cfg.agent.max_turns * cfg.agent.max_response_tokens)
    cfg.objective = objective.name
    cfg.advantage = objective.advantage
    cfg.loss = objective.loss
    cfg.shaping = objective.shaping
    # DAPO's dynamic sampling and overlong band act on single completions; episode length is
    # shaped by the reward's length term here.
    cfg.shaping.dynamic_sampling = False
    cfg.shaping.overlong_cache_length = 0
    # The sampler's log-probs reach the loss: truncated IS corrects (and its statistics show) any
    # gap between the sampled and the trained distribution.
    cfg.loss.is_mode = "tis"

    cfg.sft = sft_config(steps=600, batch_size=8, lr=3e-3)
    cfg.train = ml_collections.ConfigDict({"steps": 200, "max_minutes": 30.0, "microbatches": 1, "epochs": 1})
    cfg.optim = optim_config(lr=1e-4, warmup_steps=5, weight_decay=0.0, grad_clip=1.0)
    cfg.optim.total_steps = cfg.train.get_ref("steps")
    # LoRA adapters (rank 0 = off: every parameter trains); e.g. --config.lora.rank=16.
    cfg.lora = lora_config()
    cfg.eval = ml_collections.ConfigDict({"every": 25, "num_samples": 2, "at_start": True, "at_end": True,
                                          "batch_rows": 40})
    cfg.log = ml_collections.ConfigDict({"text_every": 10, "record_every": 10})
    # Behaviour statistics (submit rate, malformed actions, length) against the run's first steps,
    # logged to TensorBoard; action "stop" ends the run at a shift (rlcode.feedback.behaviour).
    cfg.behaviour = behaviour_config()
    cfg.checkpoint = ml_collections.ConfigDict({"every": 10, "keep": 2})
    return cfg
