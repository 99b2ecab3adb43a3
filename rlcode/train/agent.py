"""Multi-turn agent RL on repository tasks: SFT from scripted experts, then GRPO over episodes.

    python -m experiments.train --config=configs/agent_repo.py

The loop, warm start, resume, signals, checkpoints, the non-finite check, async sampling and the
summary are the engine's (`rlcode.train.engine`, shared with the synthesis job). This module
supplies the agent's config schema (`validate_config`), tasks (`build_tasks`) and `Plan`:

1. **Tasks** (`rlcode.envs.tasks.repo`): small Python repositories with a planted bug or a
   missing feature. Training uses the train families (seeds from `task.seed`); two evaluation
   sets are never trained on: ``eval_fresh`` (other seeds of the train families: new names,
   constants, variants and tests) and ``eval`` (the eval families: bug shapes never seen).
2. **SFT warm start** on scripted-expert episodes (`rlcode.train.demonstrations`).
3. **RL**: each step plays P tasks x G episodes concurrently (`rlcode.train.episodes`: every
   turn of every live episode generated in one batch by `rlcode.session_sampling`), grades the
   final copies on held-out checks and trains on one GRPO batch of their segments
   (`rlcode.train.demonstrations.training_batch`). Prefill counters per step: ``prefill/*``.
   Turns are recorded every ``log.record_every`` steps to ``episodes.jsonl`` (the prefill
   replay of experiments/agent_report.py reads them).

With ``rollout.async_mode`` the episodes of step t + 1 are played (with the parameters of step
t) while step t trains; evaluation then uses a sampler of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlcode.checks import ConfigError, config_errors, flag, integer, real, schema_from_defaults, sequence, text
from rlcode.envs import grading, rewards, tools
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.feedback.behaviour import BehaviourConfig, BehaviourWatch, behaviour_config
from rlcode.session_sampling import PREFILL_MODES, SessionSampler, prefill_metrics
from rlcode.tokenizer import Tokenizer, job_tokenizer
from rlcode.train import memory
from rlcode.train.demonstrations import ROW_MULTIPLE, expert_demonstrations, training_batch
from rlcode.train.engine import Context, Job, Plan, RunResult, train
from rlcode.train.episodes import Episode, episode_metrics, play_episodes
from rlcode.train.metrics import eval_summary, repair_json_lines
from rlcode.train.schema import MAX_SANDBOX_WORKERS, SEED, check_common, check_schema, mesh_sizes
from rlcode.train.step import make_logprob_fn


# --------------------------------------------------------------------------------------------
# Tasks and evaluation
# --------------------------------------------------------------------------------------------


def evaluate(tasks: Sequence[repo_tasks.RepoTask], sampler: SessionSampler, params: Any, key: jax.Array, pool: Any,
             tokenizer: Tokenizer, cfg: Any, prefix: str, keep: list[Episode] | None = None) -> dict[str, float]:
    """`eval.num_samples` episodes per task: success (= pass@1), pass@k, best-of-n, behaviour.
    `keep`: a list that receives the played episodes (task by task, n each)."""
    n = cfg.eval.num_samples
    flat = [t for t in tasks for _ in range(n)]
    episodes: list[Episode] = []
    for i in range(0, len(flat), sampler.rows):
        episodes += play_episodes(flat[i:i + sampler.rows], sampler, params, jax.random.fold_in(key, i), pool,
                                  tokenizer, cfg)
    if keep is not None:
        keep.extend(episodes)
    correct = np.array([e.success for e in episodes]).reshape(len(tasks), n)
    out = episode_metrics(episodes, prefix)
    out.update({f"{prefix}/{k}": v for k, v in eval_summary(correct, ks=(1, n)).items()})
    # Per level, and per task family (generated repository tasks): where the rate of guessing the
    # broken line differs by family, the overall success hides which one moved.
    for labels in ([f"L{t.difficulty}" for t in tasks], [getattr(t, "family", "") for t in tasks]):
        out.update({f"{prefix}/success_{label}": v for label, v in success_by(correct, labels).items()})
    return out


def success_by(correct: np.ndarray, labels: Sequence[str]) -> dict[str, float]:
    """{label: mean success of the tasks (rows of `correct`) with that label}, for every non-empty label."""
    labels = np.asarray(labels)
    return {label: float(correct[labels == label].mean()) for label in sorted(set(labels.tolist()) - {""})}


MINED_DIR = os.path.join(".cache", "mined")  # experiments.prepare_mined's default cache


TASK_SETS = ("train", "eval_fresh", "eval")


def build_tasks(cfg: Any, sets: Sequence[str] = TASK_SETS,
                num_train: int | None = None) -> dict[str, list[repo_tasks.RepoTask]]:
    """The train, fresh-eval and eval task sets. ``task.source="repo"`` (default): the generated
    repository tasks. ``"mined"``: the bug-fix tasks prepared in ``task.mined_dir``
    (`rlcode.envs.tasks.mined.load_prepared`): its train split for training and its test split
    (unseen projects and files) for evaluation, tasks of `task.levels`, no fresh set.

    `sets`: the sets built (any other is an empty list), e.g. ``("eval",)`` for an evaluation
    without generating the (thousands of) train tasks; `num_train`: only the first that many
    train tasks (at most ``task.num_train``; the same tasks as the full set's first ones)."""
    t = cfg.task
    levels = list(t.levels)
    unknown = set(sets) - set(TASK_SETS)
    if unknown:
        raise ValueError(f"unknown task sets {sorted(unknown)}; expected some of {TASK_SETS}")
    n_train = t.num_train if num_train is None else min(num_train, t.num_train)
    counts = {"train": n_train, "eval_fresh": t.num_fresh, "eval": t.num_eval}
    counts = {k: (v if k in sets else 0) for k, v in counts.items()}
    if t.get("source", "repo") == "mined":
        from rlcode.envs.tasks import mined

        prepared = mined.load_prepared(t.get("mined_dir", MINED_DIR))
        pick = lambda split, n: [x for x in prepared[split] if x.difficulty in levels][:n]  # noqa: E731
        train = pick("train", t.num_train)
        if not train and "train" in sets:
            raise ConfigError(f"task.mined_dir={t.get('mined_dir', MINED_DIR)!r}: no train task of levels {tuple(levels)}")
        return {"train": train[:counts["train"]], "eval_fresh": [], "eval": pick("test", counts["eval"])}

    def make(split, num, start):
        return [repo_tasks.generate_task(start + i, difficulty=levels[i % len(levels)], split=split)
                for i in range(num)]
    # Train and fresh-eval tasks share the train families with disjoint seeds.
    return {"train": make("train", counts["train"], t.seed),
            "eval_fresh": make("train", counts["eval_fresh"], t.seed + 10**6),
            "eval": make("eval", counts["eval"], t.seed)}


# Which train tasks RL draws its prompts from: "all", or "undemonstrated" (those after the first
# task.num_demos, which the SFT warm start never saw, so no reward can come from recalling a
# demonstration instead of reading the task).
RL_TASK_POOLS = ("all", "undemonstrated")


def rl_task_indices(cfg: Any) -> range:
    """The indices into the train set that RL steps draw prompts from (``task.rl_tasks``)."""
    pool = cfg.task.get("rl_tasks", "all")
    start = cfg.task.num_demos if pool == "undemonstrated" and cfg.sft.steps > 0 else 0
    return range(start, cfg.task.num_train)


def rl_prompts(cfg: Any, num_train_tasks: int, count: int) -> np.ndarray:
    """The `rollout.prompts_per_step` distinct train-task indices of RL batch `count`: a function
    of (seed, count), drawn from `rl_task_indices` (cut to the `num_train_tasks` that exist)."""
    pool = np.arange(num_train_tasks)[rl_task_indices(cfg).start:]
    P = cfg.rollout.prompts_per_step
    if len(pool) < P:
        mode = cfg.task.get("rl_tasks", "all")
        fix = (f"; the first task.num_demos={cfg.task.num_demos} are demonstrations: set task.rl_tasks=all or "
               "fewer demonstrations" if mode == "undemonstrated" else "")
        raise ConfigError(f"task.rl_tasks={mode!r}: {len(pool)} of the {num_train_tasks} train tasks to draw from, "
                          f"fewer than rollout.prompts_per_step={P}{fix}")
    return pool[np.random.default_rng([cfg.seed, count]).choice(len(pool), P, replace=False)]


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


AGENT_SECTIONS = {
    "job": text(("agent",)),
    "task": {"source": text(("repo", "mined"), required=False), "mined_dir": text(required=False),
             "levels": sequence(integer(choices=repo_tasks.LEVELS), min_len=1), "num_train": integer(1),
             "num_demos": integer(0), "num_fresh": integer(0), "num_eval": integer(0), "seed": SEED,
             "rl_tasks": text(RL_TASK_POOLS, required=False),
             "demo_bugs": text(repo_tasks.BUG_DRAWS, required=False)},
    "agent": {"max_turns": integer(1), "max_context_tokens": integer(1), "max_response_tokens": integer(1),
              "summarize": flag(), "compact_prompt": flag(), "expert_style": text(repo_tasks.EXPERT_STYLES),
              "prefill": text(PREFILL_MODES), "tools": sequence(text(tuple(tools.TOOLS))),
              "edit_hints": flag(required=False)},
    "sampling": {"temperature": real(0, low_open=True)},
    "rollout": {"prompts_per_step": integer(1), "group_size": integer(1), "async_mode": flag(required=False),
                "max_staleness": integer(0, required=False)},
    "sandbox": {"workers": integer(1, MAX_SANDBOX_WORKERS), "timeout": real(0, low_open=True)},
    # Ranges: `rewards.RewardConfig.from_config`, run by `validate_config`.
    "reward": schema_from_defaults(rewards.reward_config(), {"test_reward": text(rewards.TEST_REWARDS),
                                                             "hack_flags": sequence(text(grading.FLAGS)),
                                                             "hack_mode": text(rewards.HACK_MODES)}),
    "train": {"steps": integer(1), "max_minutes": real(0), "microbatches": integer(1), "epochs": integer(1, required=False)},
    "eval": {"every": integer(0), "num_samples": integer(1), "at_start": flag(), "at_end": flag(),
             "batch_rows": integer(1)},
    "log": {"text_every": integer(0), "record_every": integer(0)},
    "behaviour": schema_from_defaults(behaviour_config(), BehaviourConfig.SPECS),
}


def validate_config(cfg: Any, num_devices: int | None = None,
                    budget: Sequence[tuple[str, int]] | None = None) -> None:
    """Raise ConfigError naming the field for a config the agent job cannot run; called at start,
    before any task, demonstration or compilation. The same checks as the synthesis job's
    (`rlcode.train.schema`: every field's type and range, unknown fields, the shared sections'
    constraints, the mesh against `num_devices`, the memory estimate against `budget`), with
    the agent's own sections (`AGENT_SECTIONS`) and constraints."""
    # The behaviour section is optional (configs written before it have none).
    check_schema(cfg, {k: v for k, v in AGENT_SECTIONS.items() if k != "behaviour" or k in cfg})
    check_common(cfg, num_devices)
    tok = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
    if None in (tok.im_start_id, tok.im_end_id, tok.tool_call_start_id, tok.tool_call_end_id):
        raise ConfigError(f"tokenizer={cfg.get('tokenizer', 'byte')!r}: the agent job renders episodes in the built-in "
                          "<|im_start|> / <tool_call> chat format, whose tokens this vocabulary lacks")
    kind = cfg.model.attention.kind
    if kind not in ("dense", "squid"):
        raise ConfigError(f"model.attention.kind={kind!r}: the agent job supports 'dense' and 'squid' "
                          "(its sampler extends per-episode caches turn by turn)")
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if G < 2:
        raise ConfigError(f"rollout.group_size={G}: group advantages need >= 2 episodes per task")
    if P > cfg.task.num_train:
        raise ConfigError(f"rollout.prompts_per_step={P} > task.num_train={cfg.task.num_train} (each step draws "
                          "distinct tasks)")
    if cfg.sft.steps > 0 and not 1 <= cfg.task.num_demos <= cfg.task.num_train:
        raise ConfigError(f"task.num_demos={cfg.task.num_demos}: the warm start (sft.steps={cfg.sft.steps}) needs "
                          f"1 to task.num_train={cfg.task.num_train} demonstrations")
    if cfg.task.get("demo_bugs", "standard") != "standard" and cfg.task.get("source", "repo") != "repo":
        raise ConfigError(f"task.demo_bugs={cfg.task.demo_bugs!r}: varied bugs exist only for the generated "
                          f"tasks (task.source='repo'), not task.source={cfg.task.source!r}")
    if cfg.agent.expert_style == "recover" and not cfg.agent.get("edit_hints", False):
        raise ConfigError("agent.expert_style='recover' demonstrates copying the line a refused edit shows, which "
                          "needs agent.edit_hints=True (or use expert_style='compact')")
    if len(rl_task_indices(cfg)) < P and cfg.task.get("source", "repo") != "mined":
        raise ConfigError(f"task.rl_tasks='undemonstrated': task.num_train={cfg.task.num_train} leaves "
                          f"{len(rl_task_indices(cfg))} tasks after the task.num_demos={cfg.task.num_demos} "
                          f"demonstrations, fewer than rollout.prompts_per_step={P}")
    if cfg.agent.tools and "submit" not in cfg.agent.tools:
        raise ConfigError(f"agent.tools={tuple(cfg.agent.tools)}: 'submit' is required. "
                          f"Available: {sorted(tools.TOOLS)}")
    if cfg.agent.max_response_tokens >= cfg.agent.max_context_tokens:
        raise ConfigError(f"agent.max_response_tokens={cfg.agent.max_response_tokens}: must be < "
                          f"agent.max_context_tokens={cfg.agent.max_context_tokens}")
    if cfg.shaping.dynamic_sampling or cfg.shaping.overlong_cache_length:
        raise ConfigError("the agent job does not implement shaping.dynamic_sampling or shaping.overlong_cache_length "
                          "(episode length is shaped by reward.length_*); set both to False / 0")
    if cfg.advantage.estimator != "group":
        raise ConfigError(f"advantage.estimator={cfg.advantage.estimator!r}: the agent job computes group advantages "
                          "over each task's episodes ('group')")
    if cfg.loss.value_coef > 0:
        raise ConfigError(f"loss.value_coef={cfg.loss.value_coef}: the agent job trains no value head (use 0)")
    if cfg.loss.kl_coef > 0 and cfg.loss.kl_penalty != "loss":
        raise ConfigError(f"loss.kl_penalty={cfg.loss.kl_penalty!r}: the agent job applies the KL in the loss "
                          "(kl_penalty='loss')")
    if ROW_MULTIPLE % cfg.train.microbatches:
        raise ConfigError(f"train.microbatches={cfg.train.microbatches}: must divide {ROW_MULTIPLE} (the training "
                          f"batch is padded to a multiple of {ROW_MULTIPLE} rows)")
    with config_errors("reward"):
        reward = rewards.RewardConfig.from_config(cfg.reward)
    if reward.source == "reward_model" and not os.path.isdir(reward.reward_model):
        raise ConfigError(f"reward.reward_model={reward.reward_model!r}: no such directory")
    if num_devices is not None:
        sizes = mesh_sizes(cfg.mesh, num_devices)
        shards = sizes["data"] * sizes["fsdp"]
        if (ROW_MULTIPLE // cfg.train.microbatches) % shards:
            raise ConfigError(f"mesh: a micro-batch of {ROW_MULTIPLE} / train.microbatches rows does not divide over "
                              f"the mesh's data x fsdp = {shards} devices")
    memory.check(memory.estimate_agent(cfg, ROW_MULTIPLE), memory.limits(jax.devices()) if budget is None else budget)


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EpisodeBatch:
    """One step's played episodes, the policy version that played them, the sampler's prefill
    counters and the seconds spent playing and grading."""

    episodes: list[Episode]
    version: int
    stats: collections.Counter
    seconds: float


def setup(ctx: Context) -> tuple[Any, dict]:
    """(SFT demonstrations or None, the task sets of `build_tasks`)."""
    cfg = ctx.cfg
    tasks = build_tasks(cfg)
    ctx.say(f"tasks: {len(tasks['train'])} train, {len(tasks['eval_fresh'])} fresh (held-out seeds of the train "
            f"families), {len(tasks['eval'])} eval (held-out families); levels {tuple(cfg.task.levels)}")
    rl_prompts(cfg, len(tasks["train"]), 0)  # too few tasks to draw from fails before any demonstration
    demos = None
    if cfg.sft.steps > 0:
        demos = expert_demonstrations(demo_tasks(cfg, tasks["train"]), ctx.pool, ctx.tokenizer, cfg, log=ctx.say)
    return demos, tasks


def demo_tasks(cfg: Any, train: Sequence[repo_tasks.RepoTask]) -> list[repo_tasks.RepoTask]:
    """The tasks the scripted expert demonstrates: the first ``task.num_demos`` train tasks, or
    with ``task.demo_bugs="varied"`` the same seeds with their bug drawn from the wider set
    (`repo_tasks.generate_task`), so that SFT cannot fit the broken line from the family and has
    to copy it from the file the expert read. RL and evaluation keep the standard tasks."""
    first = list(train[: cfg.task.num_demos])
    if cfg.task.get("demo_bugs", "standard") == "standard":
        return first
    return [repo_tasks.generate_task(t.seed, difficulty=t.difficulty, split=t.split, bugs=cfg.task.demo_bugs)
            for t in first]


def plan(ctx: Context, tasks: dict) -> Plan:
    """Collect = play P tasks x G episodes; prepare = `training_batch` with old / reference
    log-probs; evaluate = `evaluate` on both held-out sets with common random numbers."""
    cfg, tok, pool = ctx.cfg, ctx.tokenizer, ctx.pool
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    temperature = ctx.sampling.temperature
    logprob_fn = make_logprob_fn(ctx.graphdef, temperature)

    def session_sampler(rows: int) -> SessionSampler:
        return SessionSampler(ctx.graphdef, tok, rows=rows, max_context=cfg.agent.max_context_tokens,
                              max_response=cfg.agent.max_response_tokens, temperature=temperature,
                              mode=cfg.agent.prefill)

    if ctx.schedule.async_mode:  # the sampler thread and evaluation each need their own
        sampler, eval_sampler = session_sampler(P * G), session_sampler(cfg.eval.batch_rows)
    else:
        sampler = eval_sampler = session_sampler(max(P * G, cfg.eval.batch_rows))
    base_key = jax.random.key(cfg.seed)
    eval_key = jax.random.fold_in(base_key, 2)
    episodes_path = os.path.join(ctx.workdir, "episodes.jsonl")
    repair_json_lines(episodes_path)  # a run killed mid-line left a torn record
    episodes_log = ctx.resources.enter_context(open(episodes_path, "a"))

    def collect(params, version, count):
        t0 = time.perf_counter()
        picked = rl_prompts(cfg, len(tasks["train"]), count)
        batch_tasks = [tasks["train"][i] for i in picked for _ in range(G)]
        record = cfg.log.record_every > 0 and count % cfg.log.record_every == 0
        episodes = play_episodes(batch_tasks, sampler, params, jax.random.fold_in(base_key, 10 + count), pool, tok,
                                 cfg, record=record)
        if record:
            episodes_log.write(json.dumps({"step": count, "turns": sampler.record}) + "\n")
            episodes_log.flush()
        return EpisodeBatch(episodes, version, collections.Counter(sampler.stats), time.perf_counter() - t0)

    def prepare(params, ref_params, b: EpisodeBatch):
        batch = {k: jnp.asarray(v) for k, v in training_batch(b.episodes, cfg, tok.pad_id).items()}
        batch["old_logp"], _ = logprob_fn(params, batch)
        if ref_params is not None:
            batch["ref_logp"], _ = logprob_fn(ref_params, batch)
        return batch

    def run_eval(params, step):
        t0 = time.perf_counter()
        out = {}
        for name in ("eval_fresh", "eval"):
            if tasks[name]:
                out.update(evaluate(tasks[name], eval_sampler, params, eval_key, pool, tok, cfg, name))
        out["time/eval_s"] = time.perf_counter() - t0
        ctx.writer.scalars(step, out)
        ctx.say(f"eval @ {step}: " + ", ".join(f"{k}={out[k]:.3f}" for k in ("eval_fresh/success", "eval/success")
                                                if k in out) + f" ({out['time/eval_s']:.0f} s)")
        return out

    behaviour = BehaviourWatch(cfg.get("behaviour"), ctx.say)

    def metrics(b: EpisodeBatch):
        out = episode_metrics(b.episodes, "rollout")
        out.update(prefill_metrics(b.stats))
        out.update(behaviour.observe(behaviour_rows([e for e in b.episodes if e.valid])))
        out["time/sample_s"] = b.seconds
        return out

    return Plan(collect=collect, prepare=prepare, evaluate=run_eval, metrics=metrics,
                progress=lambda s, last_eval: {"reward": s["rollout/reward"], "success": s["rollout/success"],
                                               "saved": s.get("prefill/saved_vs_incremental", 0.0)},
                texts=lambda b: {"rollout/episode": tok.decode(b.episodes[0].trajectory.ids)[-4000:]},
                control=lambda step, scalars: behaviour.control(step))


def behaviour_rows(episodes: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per-episode behaviour statistics (`rlcode.feedback.behaviour`): answered = ended with submit;
    malformed = the fraction of its actions (tool calls, and action turns without any call) that
    were malformed or missing; length = tokens generated. The agent has no question action, so no
    question rate."""
    trajs = [e.trajectory for e in episodes]
    actions = [len(t.tool_calls) + t.num_no_call_turns for t in trajs]
    return {"answer_rate": np.array([t.submitted for t in trajs], np.float64),
            "malformed_rate": np.array([(t.num_malformed_calls + t.num_no_call_turns) / max(a, 1)
                                        for t, a in zip(trajs, actions)], np.float64),
            "length": np.array([rewards.generated_tokens(t) for t in trajs], np.float64)}


def summary_metrics(cfg: Any) -> list[str]:
    """The held-out success (= pass@1) and pass@n (and the fresh pool's success), the rollout
    reward and success: the HParams tab's metric columns."""
    out = ["eval/success", f"eval/pass@{cfg.eval.num_samples}"]
    if cfg.task.get("num_fresh", 0) and cfg.task.get("source", "repo") != "mined":
        out.append("eval_fresh/success")
    return out + ["rollout/reward", "rollout/success"]


JOB = Job(name="agent-rl", validate=validate_config, pool_timeout=lambda cfg: cfg.sandbox.timeout, setup=setup,
          plan=plan, summary_metrics=summary_metrics)


def run(cfg: Any, *, pool: Any = None, log: Callable[[str], None] | None = None,
        hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run the agent job of `cfg` (configs/agent_repo.py) on the engine
    (`rlcode.train.engine.train`); writes tb/, checkpoints/, config.json, summary.json and
    episodes.jsonl (recorded turns for the prefill replay)."""
    return train(cfg, JOB, pool=pool, log=log, hooks=hooks)
