"""The RL training job for program synthesis: SFT warm start, then sync or async RL.

`run(config)` is the whole job behind ``python -m experiments.train``; configs/grpo_synth.py
documents the config sections. The loop, warm start, resume, signals, checkpoints, the
non-finite check and the summary are the engine's (`rlcode.train.engine`, shared with the agent
job); this module supplies what is particular to program synthesis: its config schema
(`validate_config`), its task pools (`build_tasks`) and its `Plan`. One iteration ("step" in the
logs) consumes one rollout batch of P prompts x G samples:

  sample (policy version v) -> grade in the sandbox -> rewards -> old / reference log-probs
  (and values) under the current parameters -> advantages -> `epochs x minibatches` optimizer
  steps of the configured objective.

Sync mode samples with the current parameters (v = step). Async mode (``rollout.async_mode =
True``; ``--config.rollout.async=True`` on the command line of experiments/train.py) runs
sampling and grading in a background thread with the latest published parameters while the
trainer updates; each batch carries its version v, a batch with ``step - v >
rollout.max_staleness`` is dropped, and the loss sees the sampler's log-probs as
``behavior_logp`` so `loss.is_mode` (TIS/MIS) corrects the gap between the sampling policy and
the policy the ratio is taken against (the current parameters; decoupled PPO).

Evaluation every ``eval.every`` steps (and before the first and after the last step) samples
``eval.num_samples`` completions for every held-out task and reports pass@k (unbiased),
best-of-n, mean length and the reward terms, with the same key every time (common random
numbers). Scalars and a few completions go to TensorBoard (``<workdir>/tb``, with a
``metrics.jsonl`` copy); checkpoints go to ``<workdir>/checkpoints``.

Config checks: `validate_config` checks every field (type, range, finiteness, allowed values,
unknown fields), the constraints between fields and the memory estimate before anything is
built; a failure is a `rlcode.checks.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlcode import advantages as adv_lib
from rlcode import losses
from rlcode.checks import ConfigError, flag, integer, real, schema_from_defaults, sequence, text
from rlcode.envs.tasks import synth
from rlcode.envs.tasks.protocol import COMPLETION_SOURCES, QUESTION_DEMO
from rlcode.models.transformer import supports_shared_prompts
from rlcode.recipes import ShapingConfig
from rlcode.sampling import SampleOutput, SamplingConfig, supports_continuous_batching, to_training_batch
from rlcode.tokenizer import ByteTokenizer
from rlcode.train import memory
from rlcode.train.engine import Context, Job, Plan, RunResult, train
from rlcode.train.metrics import eval_summary
from rlcode.envs.rewards import SYNTH_REWARD_SPECS, SynthRewardConfig, synth_reward_config
from rlcode.feedback.behaviour import BehaviourConfig, BehaviourWatch, behaviour_config
from rlcode.feedback.monitor import MONITOR_ACTIONS, MonitorConfig, OveroptimizationMonitor, audit_rows, monitor_config
from rlcode.train.rollout import (EncodedTasks, Grader, Rollout, RolloutCollector, RolloutConfig, encode_tasks,
                                  trim_batch)
from rlcode.train.schema import MAX_SANDBOX_WORKERS, SEED, check_common, check_schema, mesh_sizes
from rlcode.train.step import make_logprob_fn, with_score_index, with_shared_prompts


# ------------------------------------------------------------------------------ validation


FRESH_SEED_OFFSET = 500_000  # task seeds of the fresh eval pool start here (see `build_tasks`)
OPTIONAL_SECTIONS = ("monitor", "behaviour")
SYNTH_SECTIONS = {
    "job": text(("synth",), required=False),
    "task": {"source": text(COMPLETION_SOURCES, required=False),
             "levels": sequence(integer(choices=synth.LEVELS), min_len=1), "num_train": integer(1, FRESH_SEED_OFFSET),
             "num_eval": integer(1), "num_fresh": integer(0), "max_prompt_len": integer(1), "seed": SEED,
             "allow_questions": flag(required=False), "question_demos": real(0, 1, required=False)},
    "sampling": {"max_new_tokens": integer(1), "temperature": real(0, low_open=True), "top_k": integer(0),
                 "top_p": real(0, 1, low_open=True), "slots": integer(0, required=False)},
    "rollout": {"prompts_per_step": integer(1), "group_size": integer(1), "async_mode": flag(),
                "max_staleness": integer(0), "max_draws": integer(1), "trim_multiple": integer(1, required=False)},
    "sandbox": {"workers": integer(1, MAX_SANDBOX_WORKERS)},
    "reward": schema_from_defaults(synth_reward_config(), SYNTH_REWARD_SPECS),
    "monitor": schema_from_defaults(monitor_config(), MonitorConfig.SPECS),
    "behaviour": schema_from_defaults(behaviour_config(), BehaviourConfig.SPECS),
    "train": {"steps": integer(1), "epochs": integer(1), "minibatches": integer(1), "microbatches": integer(1),
              "max_minutes": real(0, required=False), "shared_prompts": flag(required=False)},
    "eval": {"every": integer(0), "num_samples": integer(1), "ks": sequence(integer(1), min_len=1),
             "prompts_per_batch": integer(1), "at_start": flag(), "at_end": flag()},
    "log": {"text_every": integer(0), "num_texts": integer(0)},
}


def validate_config(cfg: Any, num_devices: int | None = None,
                    budget: Sequence[tuple[str, int]] | None = None, extra_sections: dict | None = None) -> None:
    """Raise ConfigError naming the field for a config the job cannot run; called at start, before
    any task, warm start or compilation. Checks every field (`SYNTH_SECTIONS` and
    `schema.common_schema`), the constraints between fields, the mesh against `num_devices` (when
    given) and the memory estimate (`rlcode.train.memory`) against `budget` ([(what, bytes)];
    default: the host's memory and the devices' where jax reports it). `extra_sections`: the
    schema of a job built on this one (`rlcode.train.usage`): its own sections, checked too."""
    # The monitor sections are optional (configs written before them have none).
    sections = {k: v for k, v in SYNTH_SECTIONS.items() if k not in OPTIONAL_SECTIONS or k in cfg}
    check_schema(cfg, {**sections, **(extra_sections or {})})
    check_common(cfg, num_devices)
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if cfg.advantage.estimator == "group" and cfg.advantage.normalize in ("std", "rloo") and G < 2:
        raise ConfigError(f"rollout.group_size={G}: advantage.normalize={cfg.advantage.normalize!r} needs at "
                          "least 2 samples per prompt (use normalize='batch' or a larger group)")
    if P > cfg.task.num_train:
        raise ConfigError(f"rollout.prompts_per_step={P} > task.num_train={cfg.task.num_train}")
    if P % cfg.train.minibatches:
        raise ConfigError(f"rollout.prompts_per_step={P} is not divisible by train.minibatches={cfg.train.minibatches}")
    rows = P * G // cfg.train.minibatches
    if rows % cfg.train.microbatches:
        raise ConfigError(f"a minibatch of {rows} rows is not divisible by train.microbatches={cfg.train.microbatches}")
    if use_shared_prompts(cfg) and (P // cfg.train.minibatches) % cfg.train.microbatches:
        raise ConfigError(f"with train.shared_prompts a micro-batch holds whole groups: the {P // cfg.train.minibatches} "
                          f"groups of a minibatch are not divisible by train.microbatches={cfg.train.microbatches} "
                          "(or set train.shared_prompts=False)")
    reward = SynthRewardConfig.from_config(cfg.reward)
    if reward.source == "reward_model" and not os.path.isdir(reward.reward_model):
        raise ConfigError(f"reward.reward_model={reward.reward_model!r}: no such directory")
    if "monitor" in cfg and cfg.monitor.enabled:
        if cfg.monitor.action == "refresh" and reward.source != "reward_model":
            raise ConfigError("monitor.action='refresh' retrains a reward model: it needs reward.source='reward_model'")
        if cfg.rollout.async_mode:
            raise ConfigError("monitor.enabled=True: the monitor acts between synchronous steps; set rollout.async_mode=False")
    if cfg.task.get("question_demos", 0.0) > 0 and not cfg.task.get("allow_questions", False):
        raise ConfigError(f"task.question_demos={cfg.task.question_demos}: demonstrations that ask need "
                          "task.allow_questions=True")
    if cfg.rollout.async_mode and cfg.rollout.max_staleness < 1:
        raise ConfigError("rollout.async_mode=True needs rollout.max_staleness >= 1")
    if cfg.sampling.top_k > cfg.model.vocab_size:
        raise ConfigError(f"sampling.top_k={cfg.sampling.top_k}: must be <= model.vocab_size={cfg.model.vocab_size} "
                          "(0 = off)")
    if cfg.shaping.overlong_cache_length > cfg.sampling.max_new_tokens:
        raise ConfigError(f"shaping.overlong_cache_length={cfg.shaping.overlong_cache_length}: must be <= "
                          f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} (0 = off)")
    bad_k = [k for k in cfg.eval.ks if not 1 <= k <= cfg.eval.num_samples]
    if bad_k:
        raise ConfigError(f"eval.ks={tuple(cfg.eval.ks)}: each k must be in [1, eval.num_samples="
                          f"{cfg.eval.num_samples}]")
    if num_devices is not None:
        sizes = mesh_sizes(cfg.mesh, num_devices)
        shards = sizes["data"] * sizes["fsdp"]
        n = rows // cfg.train.microbatches
        if n % shards:
            raise ConfigError(f"batch: rollout.prompts_per_step * rollout.group_size / train.minibatches / "
                              f"train.microbatches = {n} rows is not divisible by the mesh's data x fsdp = "
                              f"{shards} devices (mesh.data={sizes['data']}, mesh.fsdp={sizes['fsdp']})")
    memory.check(memory.estimate_synth(cfg), memory.limits(jax.devices()) if budget is None else budget)


# ------------------------------------------------------------------------------ tasks


def build_tasks(cfg: Any, tokenizer: ByteTokenizer) -> tuple[EncodedTasks, EncodedTasks, EncodedTasks | None]:
    """(train pool, held-out eval pool, fresh in-distribution pool or None).

    The train pool holds `task.num_train` tasks of the train split, task seeds
    ``task.seed * 1_000_003 + j`` cycling through `task.levels`; it serves as SFT demonstrations
    (their reference solutions) and as RL prompts. The eval pool is `synth.make_split("eval",
    task.num_eval, ...)`: distinct held-out behaviours, none of which occurs in training. The
    fresh pool (`task.num_fresh` > 0) holds train-split tasks with seeds from
    ``FRESH_SEED_OFFSET`` on, never trained on: new examples and tests, but programs of the
    training distribution (a program may recur), i.e. an in-distribution test set.

    With ``task.source="humaneval"`` the pools are HumanEval's fixed train and test splits
    (`rlcode.envs.tasks.humaneval.load`, problems of `task.levels`: the first `task.num_train` and
    `task.num_eval` of them, in the package's order, that fit the prompt and target lengths) and there is no fresh pool; `task.seed` does
    not apply."""
    levels = tuple(cfg.task.levels)
    M, Lp = cfg.sampling.max_new_tokens, cfg.task.max_prompt_len
    if cfg.task.get("source", "synth") == "humaneval":
        from rlcode.envs.tasks import humaneval

        def pool(split, n):  # the first n problems that fit the prompt and target lengths
            tasks = [t for t in humaneval.load(split) if t.difficulty in levels]
            enc = encode_tasks(tasks, tokenizer, Lp, M, what=f"HumanEval {split} tasks")
            return dataclasses.replace(enc, tasks=enc.tasks[:n], prompts=enc.prompts[:n],
                                       prompt_lengths=enc.prompt_lengths[:n], targets=enc.targets[:n],
                                       target_lengths=enc.target_lengths[:n])

        return pool("train", cfg.task.num_train), pool("test", cfg.task.num_eval), None
    base = cfg.task.seed * 1_000_003
    if cfg.task.num_train > FRESH_SEED_OFFSET:
        raise ConfigError(f"task.num_train={cfg.task.num_train} must be <= {FRESH_SEED_OFFSET}")
    train = [synth.generate_task(base + j, levels[j % len(levels)], "train") for j in range(cfg.task.num_train)]
    evals = synth.make_split("eval", cfg.task.num_eval, seed=cfg.task.seed, levels=levels)
    fresh = None
    if cfg.task.num_fresh:
        tasks = [synth.generate_task(base + FRESH_SEED_OFFSET + j, levels[j % len(levels)], "train")
                 for j in range(cfg.task.num_fresh)]
        fresh = encode_tasks(tasks, tokenizer, Lp, M, what="fresh tasks")
    return (encode_tasks(train, tokenizer, Lp, M, what="train tasks"),
            encode_tasks(evals, tokenizer, Lp, M, what="eval tasks"), fresh)


# ------------------------------------------------------------------------------ batches


def use_shared_prompts(cfg: Any) -> bool:
    """Whether the job's train batches compute each group's prompt once (``train.shared_prompts``,
    default True): where that forward equals the per-row one (`supports_shared_prompts`: dense or
    squid attention, a dense MLP), without a value head (values are read at every position) and
    with groups of more than one row."""
    return (bool(cfg.train.get("shared_prompts", True)) and supports_shared_prompts(cfg.model)
            and not cfg.model.get("value_head", False) and cfg.rollout.group_size > 1)


def make_prepare_fn(objective: losses.ObjectiveConfig, adv_cfg: adv_lib.AdvantageConfig, sampling: SamplingConfig,
                    graphdef: Any, group_size: int, pad_id: int, trim_multiple: int = 32, *,
                    shared_prompts: bool = False, on_policy: bool = False) -> Callable:
    """fn(params, ref_params, rollout, kl_coef=None) -> train batch: the training layout (time axis
    trimmed, see `trim_batch`), old log-probs and values under `params`, reference log-probs when
    `ref_params` is given, rewards with the KL penalty when it is a reward term (coefficient
    `kl_coef`, default the objective's: a controller may change it between steps without a
    recompilation), advantages (and returns for GAE).

    With reference parameters the batch also carries ``kl_from_start`` [B]: each row's summed
    log-ratio log pi(y|x) - log pi_ref(y|x) over its sampled tokens (under the parameters the
    rollout is scored with), whose mean over rows sampled from pi estimates KL(pi || pi_ref) per
    sequence; the job logs it and takes it out before training.

    shared_prompts: lay the batch out for the shared-prompt forward (`with_shared_prompts`: each
    group's prompt computed once in every pass; needs `supports_shared_prompts` and no value head).
    on_policy: the batch gets exactly one optimizer update from `params` (train.epochs =
    train.minibatches = 1), so the old log-probs are the train step's own and their pass is
    skipped (no ``old_logp``; kept when the KL is a reward term or values are needed, which read
    them before training); ``kl_from_start`` then comes from the train step (its
    ``kl_from_start_sum`` / ``kl_from_start_rows`` metrics)."""
    opts = dict(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    logprob = make_logprob_fn(graphdef, **opts)
    kl_in_reward = objective.kl_penalty == "reward"
    needs_values = adv_cfg.estimator == "gae" or objective.value_coef > 0
    skip_old = on_policy and not kl_in_reward and not needs_values

    @jax.jit
    def scores(params, ref_params, batch, rewards, valid, kl_coef):
        mask = batch["mask"]
        old_logp = values = None
        if not skip_old:
            old_logp, values = logprob(params, batch)
            old_logp = jnp.where(mask, old_logp, 0.0)
            batch["old_logp"] = old_logp
        if ref_params is not None:
            ref_logp, _ = logprob(ref_params, batch)
            ref_logp = jnp.where(mask, ref_logp, 0.0)
            batch["ref_logp"] = ref_logp
            if old_logp is not None:
                batch["kl_from_start"] = jnp.sum(old_logp - ref_logp, axis=-1)
            if kl_in_reward:
                rewards = losses.kl_reward_penalty(rewards, old_logp, ref_logp, mask, kl_coef)
        advantages, returns = adv_lib.compute_advantages(adv_cfg, rewards, mask, group_size,
                                                         values=values if needs_values else None, valid=valid)
        batch = dict(batch, advantages=advantages)
        if needs_values:
            batch.update(old_values=jnp.where(mask, values, 0.0), returns=returns)
        return batch

    def prepare(params, ref_params, r: Rollout, kl_coef: float | None = None) -> dict[str, jax.Array]:
        coef = objective.kl_coef if kl_coef is None else kl_coef
        if objective.kl_coef > 0 and ref_params is None:
            raise ValueError("loss.kl_coef > 0 needs the reference parameters")
        out = SampleOutput(jnp.asarray(r.tokens), jnp.asarray(r.logprobs), jnp.asarray(r.mask), jnp.asarray(r.lengths))
        tb = to_training_batch(jnp.asarray(r.prompts), jnp.asarray(r.prompt_lengths), out, group_size=group_size,
                               pad_id=pad_id)
        valid = jnp.asarray(r.valid)
        batch = {"inputs": tb.inputs, "targets": tb.targets, "positions": tb.positions,
                 "mask": tb.mask & valid[:, None], "kv_lengths": tb.kv_lengths, "behavior_logp": tb.behavior_logp}
        if shared_prompts:  # each group's prompt once; the time axis stays whole (shapes follow the completions)
            batch = with_shared_prompts(batch, r.prompts, r.prompt_lengths, r.tokens, trim_multiple)
        else:
            batch = trim_batch(batch, int(np.max(r.prompt_lengths.repeat(group_size) + r.lengths)) - 1, trim_multiple)
            batch = with_score_index(batch)  # the prompts' positions are not scored
        return scores(params, ref_params, batch, jnp.asarray(r.rewards), valid, jnp.float32(coef))

    return prepare


def rollout_metrics(r: Rollout, prefix: str = "rollout") -> dict[str, float]:
    """Reward terms, pass rates, lengths and the sandbox counters of a batch (valid rows)."""
    v = r.valid
    n = max(int(v.sum()), 1)
    mean = lambda x: float(np.where(v, x, 0).sum() / n)
    out = {f"{prefix}/reward": mean(r.rewards), f"{prefix}/pass@1": mean(r.passed.astype(np.float32)),
           f"{prefix}/pass_fraction": mean(r.pass_fraction), f"{prefix}/length": mean(r.lengths.astype(np.float32)),
           f"{prefix}/valid_fraction": float(v.mean())}
    for name, x in r.terms.items():
        out[f"{prefix}/reward_{name}"] = mean(x)
    G = r.group_size
    rew = r.rewards.reshape(-1, G)
    out[f"{prefix}/degenerate_groups"] = float(np.mean(np.ptp(rew, axis=1) == 0))
    for k in ("infra", "timeout", "crash", "early_exit", "forged_report", "truncated", "draws", "dropped_groups",
              "filled"):
        if k in r.stats:
            out[f"{prefix}/{k}"] = float(r.stats[k])
    return out


# ------------------------------------------------------------------------------ evaluation


def evaluate(collector: RolloutCollector, params: Any, cfg: Any, key: jax.Array,
             prefix: str = "eval") -> tuple[dict[str, float], list[str]]:
    """pass@k / best-of-n / length / reward terms on every task of the collector's pool, as
    ``<prefix>/<name>`` metrics.

    The same `key` at every evaluation (common random numbers), so a change between two
    evaluations comes from the parameters, not the sampling noise of the draw."""
    n, chunk = cfg.eval.num_samples, cfg.eval.prompts_per_batch
    E = len(collector.tasks)
    parts = []
    for c, start in enumerate(range(0, E, chunk)):
        ids = np.arange(start, start + chunk) % E  # the last chunk is padded (fixed shapes), then cut
        r = collector.sample_and_grade(params, ids, jax.random.fold_in(key, c), version=-1, group_size=n)
        keep = min(chunk, E - start)
        parts.append((r, keep))
    passed = np.concatenate([r.passed.reshape(-1, n)[:keep] for r, keep in parts])
    valid = np.concatenate([r.valid.reshape(-1, n)[:keep] for r, keep in parts])
    lengths = np.concatenate([r.lengths.reshape(-1, n)[:keep] for r, keep in parts])
    frac = np.concatenate([r.pass_fraction.reshape(-1, n)[:keep] for r, keep in parts])
    # An infrastructure failure is not a policy failure: grade such a sample as missing by
    # counting it incorrect only if nothing else is known (they are reported separately).
    metrics = {f"{prefix}/{k}": v for k, v in eval_summary(passed & valid, ks=tuple(cfg.eval.ks)).items()}
    metrics.update({
        f"{prefix}/length": float(lengths.mean()),
        f"{prefix}/question_rate": float(np.concatenate(
            [r.behaviour["question_rate"].reshape(-1, n)[:keep] for r, keep in parts]).mean()),
        f"{prefix}/pass_fraction": float(frac.mean()),
        f"{prefix}/infra": float((~valid).sum()),
        f"{prefix}/sample_s": float(sum(r.stats["sample_s"] for r, _ in parts)),
        f"{prefix}/execute_s": float(sum(r.stats["execute_s"] for r, _ in parts)),
    })
    for name in parts[0][0].terms:
        metrics[f"{prefix}/reward_{name}"] = float(np.concatenate(
            [r.terms[name].reshape(-1, n)[:keep] for r, keep in parts]).mean())
    by_level: dict[int, list[float]] = {}
    for task, row in zip(collector.tasks.tasks, passed):
        by_level.setdefault(task.difficulty, []).append(float(row.mean()))
    for level, vals in sorted(by_level.items()):
        metrics[f"{prefix}/pass@1_L{level}"] = float(np.mean(vals))
    r0 = parts[0][0]
    task = collector.tasks.tasks[int(r0.task_ids[0])]
    texts = [f"task {task.task_id}, prompt:\n\n```\n{task.completion_prompt()}\n```"]
    texts += [f"sample {i} (passed={bool(r0.passed[i])}):\n\n```\n{r0.texts[i]}\n```" for i in range(min(3, n))]
    return metrics, texts


# ------------------------------------------------------------------------------ the job


def setup(ctx: Context) -> tuple[EncodedTasks, tuple]:
    """(SFT demonstrations, task pools): the train pool's reference solutions are the
    demonstrations; the pools are `build_tasks`'s."""
    cfg = ctx.cfg
    tasks = build_tasks(cfg, ctx.tokenizer)
    train, evals, fresh = tasks
    if len(train) < cfg.rollout.prompts_per_step:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} > the {len(train)} train "
                          f"tasks within task.max_prompt_len={cfg.task.max_prompt_len}")
    devices = jax.devices()
    ctx.say(f"tasks ({cfg.task.get('source', 'synth')}): {len(train)} train (SFT demos and RL prompts), {len(evals)} held-out eval, "
            f"{len(fresh) if fresh else 0} fresh in-distribution eval; levels {tuple(cfg.task.levels)}; "
            f"devices: {len(devices)} x {devices[0].platform}")
    demos = train
    if cfg.task.get("question_demos", 0.0):
        demos = question_demos(train, cfg.task.question_demos, ctx.tokenizer, cfg.task.seed)
        ctx.say(f"SFT demonstrations: {int(round(cfg.task.question_demos * len(train)))} of {len(train)} ask "
                f"a clarifying question instead of answering (task.question_demos={cfg.task.question_demos})")
    return demos, tasks


def question_demos(demos: EncodedTasks, fraction: float, tokenizer: ByteTokenizer, seed: int) -> EncodedTasks:
    """`demos` with the targets of round(fraction * N) of them, drawn at random (by `seed`),
    replaced by the clarifying question `QUESTION_DEMO` (+ EOS): demonstrations of a policy that
    sometimes asks instead of answering."""
    ids = tokenizer.encode(QUESTION_DEMO) + [tokenizer.eos_id]
    if len(ids) > demos.targets.shape[1]:
        raise ConfigError(f"the demonstrations' question takes {len(ids)} tokens: more than sampling.max_new_tokens="
                          f"{demos.targets.shape[1]}")
    n = int(round(fraction * len(demos)))
    rows = np.random.default_rng([seed, 17]).choice(len(demos), size=n, replace=False)
    targets, lengths = demos.targets.copy(), demos.target_lengths.copy()
    targets[rows] = tokenizer.pad_id
    targets[rows, :len(ids)] = ids
    lengths[rows] = len(ids)
    return dataclasses.replace(demos, targets=targets, target_lengths=lengths)


def plan(ctx: Context, tasks: tuple) -> Plan:
    """Collect = sample P prompts x G completions and grade them (`RolloutCollector`); prepare =
    `make_prepare_fn`; evaluate = `evaluate` on the eval pools with common random numbers."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    train_tasks, eval_tasks, fresh_tasks = tasks
    # The sections the library reads, converted once into their typed configs (the engine's for
    # the loss and sampling sections).
    objective, options = ctx.objective, ctx.sampling
    advantage = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    reward, shaping = SynthRewardConfig.from_config(cfg.reward), ShapingConfig.from_config(cfg.shaping)
    rollout = RolloutConfig.from_config(cfg.rollout)
    sampling = dataclasses.replace(options, top_k=options.top_k or None, stop_ids=(tok.eos_id,), pad_id=tok.pad_id)
    if sampling.slots and not supports_continuous_batching(cfg.model):
        ctx.say(f"sampling.slots={sampling.slots}: {cfg.model.attention['kind']} attention with a {cfg.model.mlp['kind']} "
                "MLP cannot decode with continuous batching (a row's tokens would depend on its neighbours or the "
                "decode has no per-row step); sampling one static batch")
        sampling = dataclasses.replace(sampling, slots=0)
    grader = Grader(ctx.pool, timeout=reward.timeout)
    G, P = rollout.group_size, rollout.prompts_per_step
    scorer = None
    if reward.source == "reward_model":
        from rlcode.feedback.reward_model import load_reward_model  # noqa: PLC0415

        scorer = load_reward_model(reward.reward_model, batch_size=min(P * G, 64))
        ctx.say(f"reward: the reward model in {reward.reward_model} (the tests are logged as gold, and pay nothing)")
    asks = bool(cfg.task.get("allow_questions", False))
    collector = RolloutCollector(ctx.graphdef, train_tasks, tok, grader, sampling, reward, shaping, G,
                                 reward_model=scorer, allow_questions=asks)
    eval_collectors = {name: RolloutCollector(ctx.graphdef, tasks, tok, grader, sampling, reward, shaping,
                                              cfg.eval.num_samples, reward_model=scorer, allow_questions=asks)
                       for name, tasks in (("eval", eval_tasks), ("eval_fresh", fresh_tasks)) if tasks is not None}
    monitor = Monitoring(ctx, collector, reward) if "monitor" in cfg and cfg.monitor.enabled else None
    behaviour = BehaviourWatch(cfg.get("behaviour"), ctx.say)
    base_key = jax.random.key(cfg.seed)
    sample_key, eval_key = jax.random.fold_in(base_key, 1), jax.random.fold_in(base_key, 2)

    def collect(params, version, count):
        # Deterministic per (seed, count): a resumed run draws the same prompts again.
        rng = np.random.default_rng([cfg.seed, count])
        return collector.collect(params, rng, jax.random.fold_in(sample_key, count), version, P,
                                 dynamic_sampling=shaping.dynamic_sampling, max_draws=rollout.max_draws)

    def run_eval(params, step):
        out = {}
        for name, col in eval_collectors.items():
            t0 = time.perf_counter()
            m, texts = evaluate(col, params, cfg, eval_key, prefix=name)
            m[f"{name}/seconds"] = time.perf_counter() - t0
            ctx.writer.scalars(step, m)
            ctx.writer.text(step, f"{name}/samples", "\n\n".join(texts))
            ks = "  ".join(f"pass@{k}={m[f'{name}/pass@{k}']:.3f}" for k in cfg.eval.ks)
            n = cfg.eval.num_samples
            ctx.say(f"{name} @ step {step}: {ks}  best_of_{n}={m[f'{name}/best_of_{n}']:.3f}  "
                    f"len={m[f'{name}/length']:.1f}  ({m[f'{name}/seconds']:.0f} s)")
            out.update(m)
        return out

    def metrics(r: Rollout) -> dict[str, float]:
        out = rollout_metrics(r)
        if monitor is not None:
            out.update(monitor.observe(r))
        out.update(behaviour.observe({k: v[r.valid] for k, v in r.behaviour.items()
                                      if k != "question_rate" or asks}))
        out.update({"time/sample_s": r.stats["sample_s"], "time/execute_s": r.stats["execute_s"],
                    "throughput/generated_tokens_per_s": r.stats.get("generated_tokens", 0.0)
                    / max(r.stats["sample_s"], 1e-9),
                    "throughput/sandbox_execs_per_s": r.stats["executions"] / max(r.stats["execute_s"], 1e-9)})
        return out

    def progress(scalars, last_eval):
        fields = {"reward": scalars["rollout/reward"], "pass@1": scalars["rollout/pass@1"]}
        if last_eval is not None:
            fields["eval_pass@1"] = last_eval["eval/pass@1"]
        return fields

    def texts(r: Rollout) -> dict[str, str]:
        # Each sample under the prompt it answers (rows are grouped G per prompt).
        parts, shown = [], None
        for i in range(min(cfg.log.num_texts, len(r.texts))):
            task = collector.tasks.tasks[int(r.task_ids[i // r.group_size])]
            if task.task_id != shown:
                parts.append(f"task {task.task_id}, prompt:\n\n```\n{task.completion_prompt()}\n```")
                shown = task.task_id
            parts.append(f"reward={r.rewards[i]:.2f}\n\n```\n{r.texts[i]}\n```")
        return {"rollout/samples": "\n\n".join(parts)}

    make_batch = make_prepare_fn(objective, advantage, options, ctx.graphdef, G, tok.pad_id, rollout.trim_multiple,
                                 shared_prompts=use_shared_prompts(cfg), on_policy=cfg.train.epochs * cfg.train.minibatches == 1)
    kl_logged: dict[str, float] = {}

    def prepare(params, ref_params, r: Rollout) -> dict:
        batch = make_batch(params, ref_params, r, kl_coef=ctx.objective.kl_coef)
        kl = batch.pop("kl_from_start", None)
        kl_logged.clear()
        if ref_params is not None:
            kl_logged["rollout/kl_coef"] = float(ctx.objective.kl_coef)
        if kl is not None:
            kl_logged["rollout/kl_from_start"] = float(np.asarray(kl)[r.valid].mean()) if r.valid.any() else 0.0
        return batch

    def derived(scalars: dict) -> dict:
        out = dict(kl_logged)
        total, rows = scalars.pop("train/kl_from_start_sum", None), scalars.pop("train/kl_from_start_rows", None)
        if total is not None:  # the old log-probs' pass was skipped: the train step measured it
            out["rollout/kl_from_start"] = total / rows if rows else 0.0
        return out

    def control(step: int, scalars: dict) -> dict | None:
        acted = monitor.act(step) if monitor is not None else None
        return behaviour.control(step) or acted

    return Plan(collect=collect, prepare=prepare, evaluate=run_eval, metrics=metrics, progress=progress, texts=texts,
                derived=derived, control=control)


class Monitoring:
    """The over-optimisation monitor of a job trained against a learned reward (the ``monitor``
    section, `rlcode.feedback.monitor`): each batch it reads the proxy (the reward-model term) and
    the gold score (the tests' pass fraction, or all-pass per ``reward.tests``) of `audit_size`
    random valid rows only, and when it flags a divergence it acts: "stop" ends the run, "raise_kl"
    multiplies the KL coefficient (from ``kl_floor`` when 0), "refresh" labels choices on the
    current batch's completions with the simulated users of the monitor's ``user_*`` fields and
    trains the reward model on them for ``refresh_steps`` steps, "log" only records the flag."""

    def __init__(self, ctx: Context, collector: RolloutCollector, reward: SynthRewardConfig):
        self.ctx, self.collector, self.reward = ctx, collector, reward
        self.cfg = MonitorConfig.from_config(ctx.cfg.monitor)
        self.monitor = OveroptimizationMonitor(self.cfg)
        self.rng = np.random.default_rng([ctx.cfg.seed, 11])
        self.flagged = False
        self.last: Rollout | None = None
        self.refreshes = 0
        self._step = 0  # batches observed

    def observe(self, r: Rollout) -> dict[str, float]:
        rows = audit_rows(len(r.rewards), self.cfg.audit_size, r.valid, self.rng)
        proxy = r.terms["preference"] if self.reward.source == "reward_model" else r.rewards
        gold = r.passed.astype(np.float32) if self.reward.tests == "all_pass" else r.pass_fraction
        out, self.flagged = self.monitor.update(self._step, proxy[rows], gold[rows])
        self._step += 1
        self.last = r
        return out

    def act(self, step: int) -> dict | None:
        if not self.flagged:
            return None
        self.flagged = False
        action = self.cfg.action
        self.monitor.acted(self._step - 1, action)
        self.ctx.writer.scalars(step, {"monitor/action": float(1 + MONITOR_ACTIONS.index(action))})
        if action == "log":
            self.ctx.say(f"monitor: proxy and gold diverge at step {step} (logged only)")
            return None
        if action == "stop":
            self.ctx.say(f"monitor: proxy and gold diverge at step {step}: stopping")
            return {"stop": "monitor"}
        if action == "raise_kl":
            coef = self.ctx.objective.kl_coef
            new = coef * self.cfg.kl_factor if coef > 0 else self.cfg.kl_floor
            self.ctx.say(f"monitor: proxy and gold diverge at step {step}: KL coefficient {coef:g} -> {new:g}")
            return {"kl_coef": new}
        self.refresh(step)
        return None

    def refresh(self, step: int) -> None:
        """New choices on the latest batch's completions, then more reward-model training on them."""
        from rlcode.feedback import reward_model as rm_lib  # noqa: PLC0415
        from rlcode.feedback.simulated_users import SimulatedUser, label_pairs  # noqa: PLC0415

        c, r, scorer = self.cfg, self.last, self.collector.reward_model  # validate_config: a reward model exists
        user = SimulatedUser(beta=c.user_beta, bias=c.user_bias, feature=c.user_feature, flip=c.user_flip)
        rng = random.Random(int(self.rng.integers(2**31)))
        pairs, G = [], r.group_size
        for g in range(len(r.task_ids)):
            task = self.collector.tasks.tasks[int(r.task_ids[g])]
            rows = [i for i in range(g * G, (g + 1) * G) if r.valid[i]]
            pairs += label_pairs(user, task.completion_prompt(), [r.texts[i] for i in rows],
                                 [float(r.pass_fraction[i]) for i in rows], rng, prefix=f"refresh{self.refreshes}-{g}-")
        rng.shuffle(pairs)
        pairs = pairs[:c.refresh_pairs]
        if len(pairs) < 2:
            self.ctx.say(f"monitor: at step {step} the batch has too few distinct completions to label; no refresh")
            return
        self.refreshes += 1
        train_cfg = rm_lib.train_config(steps=c.refresh_steps, batch_pairs=min(8, len(pairs)), eval_every=c.refresh_steps,
                                        max_len=scorer.max_len, seed=self.refreshes)
        train_cfg.optim.update(lr=c.refresh_lr, total_steps=c.refresh_steps, warmup_steps=min(5, c.refresh_steps))
        model = nnx.merge(scorer.graphdef, scorer.params)
        new, _ = rm_lib.train_reward_model(model, scorer.tokenizer, pairs, [], train_cfg, log=lambda m: None)
        scorer.params = new.params
        self.ctx.say(f"monitor: proxy and gold diverge at step {step}: reward model trained on {len(pairs)} new choices "
                     f"for {c.refresh_steps} steps")


def summary_metrics(cfg: Any) -> list[str]:
    """The held-out pass@k (and the fresh pool's pass@1), the rollout reward and pass@1: the
    HParams tab's metric columns."""
    out = [f"eval/pass@{k}" for k in cfg.eval.ks] + [f"eval/best_of_{cfg.eval.num_samples}"]
    if cfg.task.get("num_fresh", 0) and cfg.task.get("source", "synth") != "humaneval":  # `build_tasks`
        out.append("eval_fresh/pass@1")
    return out + ["rollout/reward", "rollout/pass@1"]


def keeps_reference(cfg: Any) -> bool:
    """A run against a learned reward logs its KL from the start policy, and a monitor may raise
    the KL coefficient: both need the start policy's parameters."""
    monitored = "monitor" in cfg and cfg.monitor.enabled
    return cfg.reward.get("source", "tests") == "reward_model" or monitored


JOB = Job(name="synth", validate=validate_config, pool_timeout=lambda cfg: cfg.reward.timeout, setup=setup,
          plan=plan, label=lambda cfg: str(cfg.objective), summary_metrics=summary_metrics, reference=keeps_reference)


def run(cfg: Any, *, pool: Any = None, log: Callable[[str], None] | None = None,
        hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run the synthesis job of `cfg` on the engine (`rlcode.train.engine.train`: pool, log and
    hooks are described there)."""
    return train(cfg, JOB, pool=pool, log=log, hooks=hooks)
