"""The RL training job for program synthesis: SFT warm start, then sync or async RL.

`run(config)` is the whole job behind ``python -m experiments.train``; configs/grpo_synth.py
documents the config sections. One iteration ("step" in the logs) consumes one rollout batch of
P prompts x G samples:

  sample (policy version v) -> grade in the sandbox -> rewards -> old / reference log-probs
  (and values) under the current parameters -> advantages -> `epochs x minibatches` optimizer
  steps of the configured objective.

Sync mode samples with the current parameters (v = step). Async mode (``rollout.async_mode =
True``; ``--config.rollout.async=True`` on the command line of experiments/train.py) runs
sampling and grading in a background thread with the latest
published parameters while the trainer updates; each batch carries its version v, a batch with
``step - v > rollout.max_staleness`` is dropped, and the loss sees the sampler's log-probs as
``behavior_logp`` so `loss.is_mode` (TIS/MIS) corrects the gap between the sampling policy and
the policy the ratio is taken against (the current parameters; decoupled PPO).

Evaluation every ``eval.every`` steps (and before the first and after the last step) samples
``eval.num_samples`` completions for every held-out task and reports pass@k (unbiased),
best-of-n, mean length and the reward terms. Scalars and a few completions go to TensorBoard
(``<workdir>/tb``, with a ``metrics.jsonl`` copy); checkpoints go to ``<workdir>/checkpoints``.

Config checks: `validate_config` checks every field (type, range, finiteness, allowed values,
unknown fields), the constraints between fields and the memory estimate before anything is
built; a failure is a `rlcode.checks.ConfigError` naming the field.

Interruptions: SIGINT / SIGTERM finish the current step, save a checkpoint and return
(a second signal aborts at once); ``resume = True`` continues from the latest checkpoint,
also after SIGKILL (at most the steps since the last checkpoint are redone), and refuses a
config that differs from the run's config.json except in `RESUME_MUTABLE` fields unless
``resume_override = True`` (`prepare_workdir`). A non-finite loss stops the run with
`NonFiniteLossError` naming the step and the batch statistics, saves the offending batch to
``<workdir>/nonfinite_batch_step<N>.npz`` and leaves the checkpoints as they were.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlcode import advantages as adv_lib
from rlcode import losses
from rlcode.checks import ConfigError, flag, flatten, integer, real, schema_from_defaults, sequence, text
from rlcode.envs.tasks import synth
from rlcode.models.transformer import init_model
from rlcode.recipes import ShapingConfig
from rlcode.sampling import SampleOutput, SamplingConfig, to_training_batch
from rlcode.sharding import make_mesh, rules_from_config
from rlcode.tokenizer import ByteTokenizer
from rlcode.train import memory
from rlcode.train import sft as sft_lib
from rlcode.train.checkpoint import Checkpointer
from rlcode.train.metrics import EventWriter, eval_summary
from rlcode.train.progress import Progress
from rlcode.train.rollout import (TEST_REWARDS, EncodedTasks, Grader, Rollout, RolloutCollector, RolloutConfig,
                                  SandboxConfig, SynthRewardConfig, encode_tasks, reward_config, trim_batch)
from rlcode.train.schema import MAX_SANDBOX_WORKERS, SEED, check_common, check_schema, mesh_sizes
from rlcode.train.step import init_train_state, make_logprob_fn, make_optimizer, make_train_step, state_shardings


class NonFiniteLossError(FloatingPointError):
    """The loss (or gradient norm) of a train step was NaN or Inf."""


# ------------------------------------------------------------------------------ validation


FRESH_SEED_OFFSET = 500_000  # task seeds of the fresh eval pool start here (see `build_tasks`)
SYNTH_SECTIONS = {
    "job": text(("synth",), required=False),
    "task": {"levels": sequence(integer(choices=synth.LEVELS), min_len=1), "num_train": integer(1, FRESH_SEED_OFFSET),
             "num_eval": integer(1), "num_fresh": integer(0), "max_prompt_len": integer(1), "seed": SEED},
    "sampling": {"max_new_tokens": integer(1), "temperature": real(0, low_open=True), "top_k": integer(0),
                 "top_p": real(0, 1, low_open=True)},
    "rollout": {"prompts_per_step": integer(1), "group_size": integer(1), "async_mode": flag(),
                "max_staleness": integer(0), "max_draws": integer(1)},
    "sandbox": {"workers": integer(1, MAX_SANDBOX_WORKERS)},
    "reward": schema_from_defaults(reward_config(), {"tests": text(TEST_REWARDS), "truncation_penalty": real(0),
                                                     "timeout": real(0, low_open=True)}),
    "train": {"steps": integer(1), "epochs": integer(1), "minibatches": integer(1), "microbatches": integer(1)},
    "eval": {"every": integer(0), "num_samples": integer(1), "ks": sequence(integer(1), min_len=1),
             "prompts_per_batch": integer(1), "at_start": flag(), "at_end": flag()},
    "log": {"text_every": integer(0), "num_texts": integer(0)},
}


def validate_config(cfg: Any, num_devices: int | None = None,
                    budget: Sequence[tuple[str, int]] | None = None) -> None:
    """Raise ConfigError naming the field for a config the job cannot run; called at start, before
    any task, warm start or compilation. Checks every field (`SYNTH_SECTIONS` and
    `schema.common_schema`), the constraints between fields, the mesh against `num_devices` (when
    given) and the memory estimate (`rlcode.train.memory`) against `budget` ([(what, bytes)];
    default: the host's memory and the devices' where jax reports it)."""
    check_schema(cfg, SYNTH_SECTIONS)
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
    training distribution (a program may recur), i.e. an in-distribution test set."""
    levels = tuple(cfg.task.levels)
    base = cfg.task.seed * 1_000_003
    if cfg.task.num_train > FRESH_SEED_OFFSET:
        raise ConfigError(f"task.num_train={cfg.task.num_train} must be <= {FRESH_SEED_OFFSET}")
    train = [synth.generate_task(base + j, levels[j % len(levels)], "train") for j in range(cfg.task.num_train)]
    evals = synth.make_split("eval", cfg.task.num_eval, seed=cfg.task.seed, levels=levels)
    M, Lp = cfg.sampling.max_new_tokens, cfg.task.max_prompt_len
    fresh = None
    if cfg.task.num_fresh:
        tasks = [synth.generate_task(base + FRESH_SEED_OFFSET + j, levels[j % len(levels)], "train")
                 for j in range(cfg.task.num_fresh)]
        fresh = encode_tasks(tasks, tokenizer, Lp, M, what="fresh tasks")
    return (encode_tasks(train, tokenizer, Lp, M, what="train tasks"),
            encode_tasks(evals, tokenizer, Lp, M, what="eval tasks"), fresh)


# ------------------------------------------------------------------------------ batches


def make_prepare_fn(objective: losses.ObjectiveConfig, adv_cfg: adv_lib.AdvantageConfig, sampling: SamplingConfig,
                    graphdef: Any, group_size: int, pad_id: int, trim_multiple: int = 32) -> Callable:
    """fn(params, ref_params, rollout) -> train batch: the training layout (time axis trimmed,
    see `trim_batch`), old log-probs and values under `params`, reference log-probs, rewards with
    the KL penalty when it is a reward term, advantages (and returns for GAE)."""
    opts = dict(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    logprob = make_logprob_fn(graphdef, **opts)
    use_ref = objective.kl_coef > 0
    kl_in_reward = use_ref and objective.kl_penalty == "reward"
    needs_values = adv_cfg.estimator == "gae" or objective.value_coef > 0

    @jax.jit
    def scores(params, ref_params, batch, rewards, valid):
        mask = batch["mask"]
        old_logp, values = logprob(params, batch)
        old_logp = jnp.where(mask, old_logp, 0.0)
        if use_ref:
            ref_logp, _ = logprob(ref_params, batch)
            ref_logp = jnp.where(mask, ref_logp, 0.0)
            batch["ref_logp"] = ref_logp
            if kl_in_reward:
                rewards = losses.kl_reward_penalty(rewards, old_logp, ref_logp, mask, objective.kl_coef)
        advantages, returns = adv_lib.compute_advantages(adv_cfg, rewards, mask, group_size,
                                                         values=values if needs_values else None, valid=valid)
        batch = dict(batch, advantages=advantages, old_logp=old_logp)
        if needs_values:
            batch.update(old_values=jnp.where(mask, values, 0.0), returns=returns)
        return batch

    def prepare(params, ref_params, r: Rollout) -> dict[str, jax.Array]:
        out = SampleOutput(jnp.asarray(r.tokens), jnp.asarray(r.logprobs), jnp.asarray(r.mask), jnp.asarray(r.lengths))
        tb = to_training_batch(jnp.asarray(r.prompts), jnp.asarray(r.prompt_lengths), out, group_size=group_size,
                               pad_id=pad_id)
        valid = jnp.asarray(r.valid)
        batch = {"inputs": tb.inputs, "targets": tb.targets, "positions": tb.positions,
                 "mask": tb.mask & valid[:, None], "kv_lengths": tb.kv_lengths, "behavior_logp": tb.behavior_logp}
        batch = trim_batch(batch, int(np.max(r.prompt_lengths.repeat(group_size) + r.lengths)) - 1, trim_multiple)
        return scores(params, ref_params, batch, jnp.asarray(r.rewards), valid)

    return prepare


def minibatches(batch: dict[str, jax.Array], num: int, group_size: int, rng: np.random.Generator):
    """Split a batch into `num` minibatches of whole groups (random group order)."""
    if num == 1:
        return [batch]
    B = batch["inputs"].shape[0]
    groups = rng.permutation(B // group_size).reshape(num, -1)
    out = []
    for gs in groups:
        rows = (gs[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
        out.append({k: v[rows] for k, v in batch.items()})
    return out


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
    texts = [f"task {collector.tasks.tasks[int(r0.task_ids[0])].task_id} sample {i} "
             f"(passed={bool(r0.passed[i])}):\n\n```\n{r0.texts[i]}\n```" for i in range(min(3, n))]
    return metrics, texts


# ------------------------------------------------------------------------------ async sampling


class ParamStore:
    """The latest published policy parameters and their version, shared with the sampler thread.
    Publishing copies the arrays: the train step donates (deletes) the buffers it was given."""

    def __init__(self, params: Any, version: int):
        self._lock = threading.Lock()
        self.publish(params, version)

    def publish(self, params: Any, version: int) -> None:
        copy = jax.tree.map(jnp.copy, params)
        with self._lock:
            self._params, self._version = copy, version

    def get(self) -> tuple[Any, int]:
        with self._lock:
            return self._params, self._version


class AsyncSampler:
    """A background thread that samples rollout batches with the latest published parameters
    while the trainer updates.

    At most `max_staleness` batches are in flight (being sampled or waiting): the thread starts a
    batch only when the trainer has taken one, so a batch sampled with version v is consumed by
    step v + max_staleness at the latest and none has to be dropped for staleness (the trainer
    still checks). With max_staleness = 1 this is one-step off-policy sampling: batch t + 1 is
    sampled with the parameters of step t while step t trains.
    """

    def __init__(self, collect: Callable[[Any, int, int], Rollout], store: ParamStore, max_staleness: int):
        self._collect = collect
        self._store = store
        self._slots = threading.Semaphore(max(1, max_staleness))
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._count = 0
        self._thread = threading.Thread(target=self._loop, name="rollout-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.1):
                    continue
                params, version = self._store.get()
                r = self._collect(params, version, self._count)
                self._count += 1
                self._queue.put(r)
        except BaseException as e:  # surfaced to the trainer by get()
            self._error = e

    def get(self) -> Rollout:
        while True:
            if self._error is not None:
                raise RuntimeError(f"the rollout sampler thread failed: {self._error!r}") from self._error
            try:
                r = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._error is None:
                    raise RuntimeError("the rollout sampler thread stopped")
                continue
            self._slots.release()
            return r

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


# ------------------------------------------------------------------------------ signals


class _StopFlag:
    """SIGINT/SIGTERM set a flag the loop checks between steps; a second signal raises
    KeyboardInterrupt at once."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------ the job


@dataclasses.dataclass
class RunResult:
    """What `run` returns (also written to <workdir>/summary.json)."""

    workdir: str
    steps_done: int
    completed: bool
    interrupted: bool
    sft: dict
    first_eval: dict | None
    last_eval: dict | None
    seconds: float


def _stats_text(batch: dict[str, Any], r: Rollout) -> dict[str, Any]:
    host = jax.device_get(batch)
    m = np.asarray(host["mask"], bool)
    out: dict[str, Any] = {"rows": int(m.shape[0]), "masked_tokens": int(m.sum()),
                           "reward_mean": float(np.mean(r.rewards)), "reward_std": float(np.std(r.rewards))}
    for k, v in host.items():
        v = np.asarray(v)
        if v.dtype.kind != "f":
            continue
        sel = v[m] if v.shape == m.shape else v
        finite = np.isfinite(sel)
        out[k] = {"nonfinite": int((~finite).sum()),
                  "min": float(sel[finite].min()) if finite.any() else None,
                  "max": float(sel[finite].max()) if finite.any() else None}
    return out


# Fields a resumed run may change without resume_override: where the run and its warm-start
# cache live, how long it runs (extending train.steps also stretches the learning-rate schedule
# when optim.total_steps follows train.steps, as in the shipped configs), its time budget, the
# sandbox's parallelism, how often and how many checkpoints are kept, and the resume switches
# themselves. Any other change (seeds, learning rate, rewards, model, batch shape, evaluation,
# ...) would make the resumed run a different experiment.
RESUME_MUTABLE = ("resume", "resume_override", "workdir", "train.steps", "train.max_minutes", "sandbox.workers",
                  "sft.cache_dir", "checkpoint.every", "checkpoint.keep")
CONFIG_HISTORY = "config_history"
_ABSENT = "(absent)"


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """path -> (old value, new value) for every leaf that differs between two configs as JSON;
    a field only one of them has shows "(absent)" on the other side."""
    a, b = flatten(old), flatten(new)
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _mutable_on_resume(path: str, old: dict, new: dict) -> bool:
    if path in RESUME_MUTABLE:
        return True
    # optim.total_steps may follow train.steps (a reference in the configs) and nothing else.
    if path == "optim.total_steps":
        a, b = flatten(old), flatten(new)
        return a.get(path) == a.get("train.steps") and b.get(path) == b.get("train.steps")
    return False


def _archive_config(workdir: str, old: Any, changes: dict, *, resume: bool, override: bool) -> str:
    """Keep a replaced config.json as config_history/<n>.json with what changed; returns the path."""
    folder = os.path.join(workdir, CONFIG_HISTORY)
    os.makedirs(folder, exist_ok=True)
    n = 1 + sum(1 for name in os.listdir(folder) if name.endswith(".json"))
    path = os.path.join(folder, f"{n:03d}.json")
    record = {"replaced_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resume": resume, "override": override,
              "changes": {k: list(v) for k, v in changes.items()}, "config": old}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    return path


def _format_value(value: Any) -> str:
    return value if value == _ABSENT else json.dumps(value)


def prepare_workdir(cfg: Any, log: Callable[[str], None] | None = None) -> tuple[str, str]:
    """(workdir, checkpoint dir) of a job: created, refused when it holds checkpoints and
    cfg.resume is off, with the config written to config.json.

    Resuming compares the config with the run's saved config.json and raises a ConfigError
    naming every changed field (old -> new) unless only `RESUME_MUTABLE` fields changed or
    ``resume_override`` is set. config.json is replaced only after that check passes, and a
    replaced config is kept in ``config_history/<n>.json`` with its changes, so the run's
    history of configs stays complete."""
    workdir = os.path.abspath(cfg.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if has_ckpt and not cfg.resume:
        raise ConfigError(f"workdir {workdir} already has checkpoints: pass --config.resume=True to continue "
                          "that run, or choose another --config.workdir")
    path = os.path.join(workdir, "config.json")
    text_new = cfg.to_json_best_effort(indent=2, sort_keys=True)
    new = json.loads(text_new)
    override = bool(cfg.get("resume_override", False))
    if os.path.exists(path):
        with open(path) as f:
            raw = f.read()
        try:
            old = json.loads(raw)
        except ValueError:
            old = None
        if old is None or not isinstance(old, dict):
            if cfg.resume and not override:
                raise ConfigError(f"resume: {path} is not a readable config, so the resumed config cannot be "
                                  "compared with it; restore it, or pass --config.resume_override=True to resume "
                                  f"with the given config (the unreadable file is kept in {CONFIG_HISTORY}/)")
            _archive_config(workdir, raw, {}, resume=bool(cfg.resume), override=override)
        else:
            changes = config_changes(old, new)
            refused = {k: v for k, v in changes.items() if not _mutable_on_resume(k, old, new)}
            if cfg.resume and refused and not override:
                listed = ", ".join(f"{k} {_format_value(a)} -> {_format_value(b)}" for k, (a, b) in refused.items())
                raise ConfigError(
                    f"resume: the config differs from the run's {path} in {len(refused)} field(s): {listed}; "
                    "resume with the saved values, or pass --config.resume_override=True to continue with the new "
                    f"ones (the saved config is then kept in {CONFIG_HISTORY}/). Fields that may change on resume: "
                    f"{', '.join(RESUME_MUTABLE)}")
            if changes:
                kept = _archive_config(workdir, old, changes, resume=bool(cfg.resume), override=bool(refused))
                if cfg.resume and refused and log is not None:
                    log(f"resume_override: continuing with {len(refused)} changed field(s) "
                        f"({', '.join(refused)}); the previous config is in {kept}")
    with open(path + ".tmp", "w") as f:
        f.write(text_new)
    os.replace(path + ".tmp", path)
    return workdir, ckpt_dir


def default_pool(workers: int, timeout: float) -> Any:
    """A `SandboxPool` of `workers` with a wall-clock limit of `timeout` seconds per execution."""
    import warnings

    from rlcode.sandbox import Limits, SandboxPool  # noqa: PLC0415 (lazy: workers start here)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # workers are fresh interpreters; jax being loaded is harmless
        return SandboxPool(workers, Limits(wall_seconds=timeout))


def run(cfg: Any, *, pool: Any = None, log: Callable[[str], None] | None = None,
        hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run the job of `cfg` (see the module docstring and configs/grpo_synth.py).

    pool: a sandbox pool to grade in (default: a `SandboxPool` of `sandbox.workers`, closed at
      the end). log: message sink (default: the progress bar's). hooks: test seams,
      {"batch": fn(step, batch) -> batch} applied to each train batch.
    """
    t_start = time.perf_counter()
    hooks = hooks or {}
    devices = jax.devices()
    validate_config(cfg, len(devices), memory.limits(devices))
    # Each section the library reads, converted once into its frozen, validated dataclass.
    objective = losses.ObjectiveConfig.from_config(cfg.loss)
    advantage = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    reward, shaping = SynthRewardConfig.from_config(cfg.reward), ShapingConfig.from_config(cfg.shaping)
    rollout, sandbox = RolloutConfig.from_config(cfg.rollout), SandboxConfig.from_config(cfg.sandbox)
    sopts = SamplingConfig.from_config(cfg.sampling)
    workdir, ckpt_dir = prepare_workdir(cfg, log or (lambda m: print(m, file=sys.stderr, flush=True)))
    own_pool = pool is None
    if own_pool:
        pool = default_pool(sandbox.workers, reward.timeout)
    stop = _StopFlag()
    sampler: AsyncSampler | None = None
    writer = EventWriter(os.path.join(workdir, "tb"))
    ckpt = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=True)
    progress = None
    try:
        tokenizer = ByteTokenizer()
        train_tasks, eval_tasks, fresh_tasks = build_tasks(cfg, tokenizer)
        if len(train_tasks) < cfg.rollout.prompts_per_step:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} > the {len(train_tasks)} train "
                              f"tasks within task.max_prompt_len={cfg.task.max_prompt_len}")
        say = log or (lambda m: progress.write(m) if progress is not None else print(m, file=sys.stderr, flush=True))
        say(f"tasks: {len(train_tasks)} train (SFT demos and RL prompts), {len(eval_tasks)} held-out eval, "
            f"{len(fresh_tasks) if fresh_tasks else 0} fresh in-distribution eval; "
            f"levels {tuple(cfg.task.levels)}; devices: {len(devices)} x {devices[0].platform}")

        # ---- SFT warm start (cached)
        if cfg.sft.steps > 0:
            sft_bar = Progress(cfg.sft.steps, desc="sft")
            sft_params, sft_info = sft_lib.load_or_train(
                cfg.model, cfg.sft, train_tasks, cfg.seed,
                on_step=lambda s, m: sft_bar.update(s + 1, nll=m["nll"]), log=say)
            sft_bar.close()
            if not sft_info["cached"]:
                say(f"SFT: {cfg.sft.steps} steps in {sft_info['seconds']:.0f} s, final NLL "
                    f"{sft_info['history'][-1]['nll']:.3f}; cached at {sft_info['path']}")
            for rec in sft_info["history"][:: max(1, cfg.sft.log_every)] + sft_info["history"][-1:]:
                writer.scalars(rec["step"] - cfg.sft.steps, {"sft/nll": rec["nll"]})
        else:
            sft_params, sft_info = None, {"cached": False, "seconds": 0.0, "history": []}

        # ---- model, optimizer, mesh, train state
        mesh = make_mesh(cfg.mesh)
        rules = rules_from_config(cfg.mesh)
        model = init_model(cfg.model, cfg.seed)
        if sft_params is not None:
            gd, st = nnx.split(model)
            nnx.replace_by_pure_dict(st, sft_lib.merge_params(nnx.to_pure_dict(st), sft_params))
            model = nnx.merge(gd, st)
        optimizer = make_optimizer(cfg.optim)
        graphdef, state = init_train_state(model, optimizer, cfg.seed, mesh, rules)
        shardings = state_shardings(state)
        ref_params = jax.tree.map(jnp.copy, state.params) if objective.kl_coef > 0 else None
        start = 0
        if cfg.resume:
            restored = ckpt.restore_or_none(target=state)
            if restored is not None:
                state, extra = restored
                start = int(extra["iteration"])
                say(f"resumed from {ckpt_dir} at step {start}")
            else:
                say(f"resume: no checkpoint in {ckpt_dir}; starting from the warm start")
        total = cfg.train.steps
        train_step = make_train_step(
            graphdef, objective, optimizer, microbatches=cfg.train.microbatches, temperature=sopts.temperature,
            top_k=sopts.top_k or None, top_p=sopts.top_p, mesh=mesh, rules=rules, shardings=shardings,
            log_entropy=True)
        G, P = rollout.group_size, rollout.prompts_per_step
        prepare = make_prepare_fn(objective, advantage, sopts, graphdef, G, tokenizer.pad_id)
        sampling = dataclasses.replace(sopts, top_k=sopts.top_k or None, stop_ids=(tokenizer.eos_id,),
                                       pad_id=tokenizer.pad_id)
        grader = Grader(pool, timeout=reward.timeout)
        collector = RolloutCollector(graphdef, train_tasks, tokenizer, grader, sampling, reward, shaping, G)
        eval_pools = {"eval": eval_tasks, "eval_fresh": fresh_tasks}
        eval_collectors = {name: RolloutCollector(graphdef, tasks, tokenizer, grader, sampling, reward, shaping,
                                                  cfg.eval.num_samples)
                           for name, tasks in eval_pools.items() if tasks is not None}
        base_key = jax.random.key(cfg.seed)
        sample_key, eval_key = jax.random.fold_in(base_key, 1), jax.random.fold_in(base_key, 2)

        def collect(params, version, count):
            # Deterministic per (seed, count): a resumed run draws the same prompts again.
            rng = np.random.default_rng([cfg.seed, count])
            return collector.collect(params, rng, jax.random.fold_in(sample_key, count), version, P,
                                     dynamic_sampling=shaping.dynamic_sampling, max_draws=rollout.max_draws)

        def run_eval(step):
            out = {}
            for name, col in eval_collectors.items():
                t0 = time.perf_counter()
                m, texts = evaluate(col, state.params, cfg, eval_key, prefix=name)
                m[f"{name}/seconds"] = time.perf_counter() - t0
                writer.scalars(step, m)
                writer.text(step, f"{name}/samples", "\n\n".join(texts))
                ks = "  ".join(f"pass@{k}={m[f'{name}/pass@{k}']:.3f}" for k in cfg.eval.ks)
                say(f"{name} @ step {step}: {ks}  best_of_{cfg.eval.num_samples}="
                    f"{m[f'{name}/best_of_{cfg.eval.num_samples}']:.3f}  len={m[f'{name}/length']:.1f}  "
                    f"({m[f'{name}/seconds']:.0f} s)")
                out.update(m)
            return out

        first_eval = last_eval = None
        prev = ckpt.metrics(ckpt.latest_step()) if start and ckpt.latest_step() is not None else None
        if prev:
            first_eval = {k[len("first/"):]: v for k, v in prev.items() if k.startswith("first/")} or None
        if start == 0 and cfg.eval.every >= 0 and cfg.eval.at_start:
            first_eval = last_eval = run_eval(0)

        async_mode = bool(rollout.async_mode)
        if async_mode:
            store = ParamStore(state.params, start)
            sampler = AsyncSampler(collect, store, rollout.max_staleness)
        mb_rng = np.random.default_rng([cfg.seed, 7, start])
        progress = Progress(total, desc=f"{cfg.objective}" + (" async" if async_mode else ""), start=start)
        interrupted = False
        last_saved = start if start else None
        step = start
        dropped_stale = 0
        with stop:
            while step < total:
                if stop.signal is not None:
                    interrupted = True
                    break
                t0 = time.perf_counter()
                if async_mode:
                    while True:
                        r = sampler.get()
                        staleness = step - r.version
                        if staleness <= rollout.max_staleness:
                            break
                        dropped_stale += 1
                else:
                    r = collect(state.params, step, step)
                    staleness = 0
                t_wait = time.perf_counter() - t0
                t1 = time.perf_counter()
                batch = prepare(state.params, ref_params, r)
                if "batch" in hooks:
                    batch = hooks["batch"](step, batch)
                metrics_acc: dict[str, list] = {}
                for _ in range(cfg.train.epochs):
                    for mb in minibatches(batch, cfg.train.minibatches, G, mb_rng):
                        state, m = train_step(state, mb)
                        for k, v in m.items():
                            metrics_acc.setdefault(k, []).append(v)
                m = {}
                for k, v in metrics_acc.items():
                    mean = np.mean(np.stack(jax.device_get(v)), axis=0)
                    if mean.ndim == 0:
                        m[k] = float(mean)
                    else:  # per-element tags, e.g. an MoE layer's load per expert: aux_moe_load/3
                        m.update({f"{k}/{i}": float(x) for i, x in enumerate(mean.ravel())})
                t_train = time.perf_counter() - t1
                if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
                    ckpt.wait()
                    path = os.path.join(workdir, f"nonfinite_batch_step{step}.npz")
                    np.savez(path, **{k: np.asarray(v) for k, v in jax.device_get(batch).items()})
                    stats = _stats_text(batch, r)
                    last = ckpt.latest_step()
                    raise NonFiniteLossError(
                        f"non-finite loss at step {step} (loss={m['loss']}, grad_norm={m['grad_norm']}); batch "
                        f"statistics: {json.dumps(stats)}; batch saved to {path}; last good checkpoint: "
                        f"{'none' if last is None else f'step {last} in {ckpt_dir}'} (resume with --config.resume=True)")
                step += 1
                if async_mode:
                    store.publish(state.params, step)
                wall = time.perf_counter() - t0
                scal = {f"train/{k}": v for k, v in m.items()}
                scal.update(rollout_metrics(r))
                gen_tokens = r.stats.get("generated_tokens", 0.0)
                scal.update({
                    "time/step_s": wall, "time/sample_s": r.stats["sample_s"], "time/execute_s": r.stats["execute_s"],
                    "time/train_s": t_train, "time/wait_for_rollout_s": t_wait,
                    "throughput/generated_tokens_per_s": gen_tokens / max(r.stats["sample_s"], 1e-9),
                    "throughput/train_tokens_per_s": float(np.asarray(batch["mask"]).sum()) * cfg.train.epochs / max(t_train, 1e-9),
                    "throughput/sandbox_execs_per_s": r.stats["executions"] / max(r.stats["execute_s"], 1e-9),
                    "async/staleness": float(staleness), "async/dropped_stale": float(dropped_stale),
                })
                writer.scalars(step, scal)
                if cfg.log.text_every and step % cfg.log.text_every == 0:
                    writer.text(step, "rollout/samples", "\n\n".join(
                        f"reward={r.rewards[i]:.2f}\n\n```\n{r.texts[i]}\n```" for i in range(min(cfg.log.num_texts, len(r.texts)))))
                fields = {"reward": scal["rollout/reward"], "pass@1": scal["rollout/pass@1"]}
                if last_eval is not None:
                    fields["eval_pass@1"] = last_eval["eval/pass@1"]
                progress.update(step, **fields)
                if cfg.eval.every and step % cfg.eval.every == 0 and step < total:
                    last_eval = run_eval(step)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total:
                    _save(ckpt, step, state, last_eval, first_eval)
                    last_saved = step
        if interrupted:
            say(f"stopping on signal {stop.signal} after step {step}: saving a checkpoint")
        else:
            if cfg.eval.every >= 0 and cfg.eval.at_end:
                last_eval = run_eval(step)
        if step != last_saved and step > 0:
            _save(ckpt, step, state, last_eval, first_eval)
        ckpt.wait()
        if interrupted:
            say(f"checkpoint at step {step} saved in {ckpt_dir}; continue with --config.resume=True")
        result = RunResult(workdir=workdir, steps_done=step, completed=step >= total, interrupted=interrupted,
                           sft={k: v for k, v in sft_info.items() if k != "history"}, first_eval=first_eval,
                           last_eval=last_eval, seconds=time.perf_counter() - t_start)
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=2, sort_keys=True)
        return result
    finally:
        if progress is not None:
            progress.close()
        if sampler is not None:
            sampler.close()
        writer.close()
        ckpt.close()
        if own_pool:
            pool.close()


def _save(ckpt: Checkpointer, step: int, state: Any, last_eval: dict | None, first_eval: dict | None) -> None:
    metrics = dict(last_eval or {})
    metrics.update({f"first/{k}": v for k, v in (first_eval or {}).items()})
    ckpt.save(step, state, metrics=metrics, extra={"iteration": step}, force=True)
