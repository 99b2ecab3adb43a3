"""The RL engine: one implementation of everything a training job does besides its own data.

A job (the synthesis job in `rlcode.train.loop`, the agent job in `rlcode.train.agent`) is a
`Job`: how to check its config, how to build its tasks (and the SFT demonstrations), and, once
the model exists, a `Plan` of three callables: collect a rollout batch, turn it into a train
batch, evaluate. `train(cfg, job)` owns the rest, with one definition of every shared concern:

* the run directory (`rlcode.train.workdir.prepare_workdir`: config.json, resume checks),
  TensorBoard writer (with the config as the run's hyperparameters, and the job's
  `Job.summary_metrics`, for the HParams tab), checkpointer, sandbox pool, signals and progress
  bar;
* the warm start: SFT on the job's demonstrations (cached), merged into a fresh model, LoRA
  adapters on it when ``lora.rank`` > 0 (then only the adapters and a value head train,
  `rlcode.models.lora`), the train state on the mesh, and the reference parameters when a KL
  term needs them;
* resume from the latest checkpoint (state, step, and the first evaluation, read from the
  checkpoint's metrics);
* sync or async sampling (`ParamStore`, `AsyncSampler`: the job's collect runs in a background
  thread with the latest published parameters; a batch staler than `rollout.max_staleness` is
  dropped);
* every step: ``train.epochs x train.minibatches`` optimizer steps (`split_groups` by default),
  metrics averaged over them (per-element metrics such as an MoE layer's per-expert load become
  ``<name>/<i>`` tags), a non-finite loss or gradient norm stops the run with
  `NonFiniteLossError` after saving the batch to ``nonfinite_batch_step<N>.npz`` (checkpoints are
  left as they were);
* evaluation before the first step (``eval.at_start``), every ``eval.every`` steps and after the
  last (``eval.at_end``, skipped when a signal stopped the run); checkpoints every
  ``checkpoint.every`` steps (0: only the last) and at the end;
* the stop conditions: ``train.steps`` reached, SIGINT / SIGTERM (the current step finishes, a
  checkpoint is saved; a second signal aborts at once), or ``train.max_minutes`` of RL steps
  (evaluation excluded);
* the summary (`RunResult`, also ``summary.json``): ``completed`` means all ``train.steps``
  were done, so a run stopped by a signal or by its time budget is not completed (a rerun of
  an ablation resumes it);
* cleanup on every exit path, including what the job registers in `Context.resources`.
"""

from __future__ import annotations

import contextlib
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
import ml_collections
import numpy as np
from flax import nnx

from rlcode.losses import ObjectiveConfig
from rlcode.models import hf
from rlcode.models.lora import LoraConfig, adapter_mask, add_lora
from rlcode.sampling import SamplingConfig
from rlcode.sharding import make_mesh, rules_from_config
from rlcode.tokenizer import Tokenizer, job_tokenizer
from rlcode.train import memory
from rlcode.train import sft as sft_lib
from rlcode.train.checkpoint import Checkpointer, save_params
from rlcode.train.metrics import EventWriter
from rlcode.train.progress import Progress
from rlcode.train.step import PROMPT_KEYS, init_train_state, make_optimizer, make_train_step, state_shardings
from rlcode.train.workdir import PARAMS_DIR, prepare_workdir


class NonFiniteLossError(FloatingPointError):
    """The loss (or gradient norm) of a train step was NaN or Inf."""


# ------------------------------------------------------------------------------ the job's side


@dataclasses.dataclass
class Context:
    """What the engine has built, handed to the job's `Job.setup` and `Job.plan`.

    The sections the engine has read (`schedule`, and the typed `objective` and `sampling` it
    builds the train step from) are there for the job to reuse, not to read again; `objective` is
    replaced when a `Plan.control` action changes the KL coefficient. The model fields
    (graphdef, mesh, rules) are set before `Job.plan` is called. A job registers what it opens
    (files, samplers) in `resources`; the engine closes them on every exit path."""

    cfg: Any
    workdir: str
    pool: Any
    writer: EventWriter
    say: Callable[[str], None]
    tokenizer: Tokenizer
    resources: contextlib.ExitStack
    schedule: Schedule
    objective: ObjectiveConfig
    sampling: SamplingConfig
    graphdef: Any = None
    mesh: Any = None
    rules: Any = None


@dataclasses.dataclass
class Plan:
    """A job's part of the RL step, built once the model exists.

    collect(params, version, count) -> rollout: one batch of samples, graded, from the policy
      with `params` (published as `version`); `count` numbers the batches (a resumed run
      continues it), so a job that seeds with it draws the same data again. The rollout must
      have a `version` attribute.
    prepare(params, ref_params, rollout) -> train batch: the arrays of `make_train_step`, old
      log-probs under `params` included (ref_params is None without a KL term).
    evaluate(params, step) -> metrics: one evaluation, logged by the job (texts) and returned.
    metrics(rollout) -> scalars logged each step (rewards, pass rates, sampler counters, ...).
    progress(scalars, last_eval) -> the fields shown on the progress bar.
    texts(rollout) -> {tag: text} logged every ``log.text_every`` steps.
    minibatches(batch, num, rng) -> `num` minibatches (default: `split_groups` by whole groups of
      ``rollout.group_size`` rows).
    derived(scalars) -> more scalars computed from the step's (rollout and ``train/``) scalars,
      logged and shown with them (e.g. a loss in bits per byte).
    control(step, scalars) -> None, or an action after the step is logged: {"stop": reason}
      ends the run (as a time budget does: evaluated and saved, not completed), {"kl_coef": x}
      sets the objective's KL coefficient from the next step on (the train step is rebuilt;
      the reference parameters must exist, see `Job.reference`), {"params": p} replaces the
      policy's parameters by `p` (same structure; placed like the current ones; the optimizer's
      moments and the step count are kept), e.g. a rollback to the last released version.
    """

    collect: Callable[[Any, int, int], Any]
    prepare: Callable[[Any, Any, Any], dict]
    evaluate: Callable[[Any, int], dict]
    metrics: Callable[[Any], dict]
    progress: Callable[[dict, dict | None], dict]
    texts: Callable[[Any], dict] = lambda rollout: {}
    minibatches: Callable[[dict, int, np.random.Generator], list] | None = None
    derived: Callable[[dict], dict] | None = None
    control: Callable[[int, dict], dict | None] | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """A training job: its name, config check, tasks and plan.

    validate(cfg, num_devices, budget): raise `ConfigError` naming the field for a config the
      job cannot run (called before anything is built).
    pool_timeout(cfg) -> seconds: the wall-clock limit of one sandbox execution; None: the job
      executes nothing and gets no pool (``Context.pool`` is None).
    setup(ctx) -> (demonstrations, data): the job's tasks (`data`, handed to `plan`) and the
      demonstrations of the SFT warm start (the `rlcode.train.sft` demos protocol; None: no warm
      start).
    plan(ctx, data) -> `Plan`.
    label(cfg) -> the progress bar's label (default: the name).
    objective(cfg) -> the `ObjectiveConfig` the train step optimises (default: from the ``loss``
      section); a job whose loss is fixed (pretraining's negative log-likelihood) has no such
      section.
    log_entropy: the train step reports the policy's entropy (one more pass over each log-prob
      chunk).
    summary_metrics(cfg) -> the scalar tags that sum a run up, besides ``train/loss``: the metric
      columns of TensorBoard's HParams tab, where runs are compared by their configs.
    reference(cfg) -> keep the start policy's parameters as the reference even with a KL
      coefficient of 0 (to measure the KL from it, or to let `Plan.control` raise the
      coefficient); with a coefficient > 0 they are always kept.
    resumable: a stopped run can continue from its checkpoint (``resume=True``); a job whose
      state is not all in the checkpoint (the usage job's log position) says so instead.
    """

    name: str
    validate: Callable[[Any, int | None, Any], None]
    pool_timeout: Callable[[Any], float]
    setup: Callable[[Context], tuple[Any, Any]]
    plan: Callable[[Context, Any], Plan]
    label: Callable[[Any], str] | None = None
    objective: Callable[[Any], ObjectiveConfig] | None = None
    log_entropy: bool = True
    summary_metrics: Callable[[Any], Sequence[str]] | None = None
    reference: Callable[[Any], bool] | None = None
    resumable: bool = True


@dataclasses.dataclass
class RunResult:
    """What `train` returns (also written to <workdir>/summary.json).

    completed: all ``train.steps`` done. stopped: why the run ended before that ("signal",
    "max_minutes", or the reason a `Plan.control` gave, e.g. "monitor"), else None. interrupted: stopped by a signal."""

    workdir: str
    steps_done: int
    completed: bool
    interrupted: bool
    sft: dict
    first_eval: dict | None
    last_eval: dict | None
    seconds: float
    stopped: str | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The engine's reading of a config: how long, how often, how many updates per batch."""

    steps: int
    epochs: int = 1
    minibatches: int = 1
    microbatches: int = 1
    max_minutes: float = 0.0
    eval_every: int = 0
    eval_at_start: bool = True
    eval_at_end: bool = True
    checkpoint_every: int = 0
    checkpoint_keep: int | None = None
    text_every: int = 0
    async_mode: bool = False
    max_staleness: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> Schedule:
        """From the train / eval / checkpoint / log / rollout sections (absent optional fields
        take the defaults above; the job's schema has checked types and ranges)."""
        def get(section: str, name: str, default: Any) -> Any:
            node = cfg.get(section) if hasattr(cfg, "get") else None
            return node.get(name, default) if node is not None and hasattr(node, "get") else default
        return cls(steps=int(cfg.train.steps), epochs=int(get("train", "epochs", 1)),
                   minibatches=int(get("train", "minibatches", 1)), microbatches=int(get("train", "microbatches", 1)),
                   max_minutes=float(get("train", "max_minutes", 0.0)), eval_every=int(get("eval", "every", 0)),
                   eval_at_start=bool(get("eval", "at_start", True)), eval_at_end=bool(get("eval", "at_end", True)),
                   checkpoint_every=int(get("checkpoint", "every", 0)), checkpoint_keep=get("checkpoint", "keep", None),
                   text_every=int(get("log", "text_every", 0)), async_mode=bool(get("rollout", "async_mode", False)),
                   max_staleness=int(get("rollout", "max_staleness", 1)))

    def eval_due(self, step: int) -> bool:
        """An evaluation after `step` (1-based count of steps done); the last step's is `eval_at_end`."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.steps

    def checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint after `step`; the last step's is always written by the engine."""
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0 and step < self.steps


# ------------------------------------------------------------------------------ pieces


def split_groups(batch: dict[str, jax.Array], num: int, group_size: int, rng: np.random.Generator) -> list[dict]:
    """Split a batch into `num` minibatches of whole groups (random group order)."""
    if num == 1:
        return [batch]
    B = batch["inputs"].shape[0]
    groups = rng.permutation(B // group_size).reshape(num, -1)
    out = []
    for gs in groups:
        rows = (gs[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
        out.append({k: v[gs] if k in PROMPT_KEYS else v[rows] for k, v in batch.items()})
    return out


def mean_metrics(collected: dict[str, list]) -> dict[str, float]:
    """Means over the optimizer steps of one RL step; an array-valued metric (e.g. an MoE
    layer's load per expert, ``aux_moe_load``) becomes one scalar per element, ``<name>/<i>``."""
    out = {}
    for k, v in collected.items():
        mean = np.mean(np.stack(jax.device_get(v)), axis=0)
        if mean.ndim == 0:
            out[k] = float(mean)
        else:
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(mean.ravel())})
    return out


def batch_statistics(batch: dict[str, Any]) -> dict[str, Any]:
    """Rows, tokens in the loss and, per float array, its non-finite count and finite range
    (over the loss tokens for [B, T] arrays): what a non-finite loss report shows."""
    host = jax.device_get(batch)
    m = np.asarray(host["mask"], bool)
    out: dict[str, Any] = {"rows": int(m.shape[0]), "masked_tokens": int(m.sum())}
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


def check_finite_step(m: dict[str, float], batch: dict[str, Any], step: int, workdir: str, ckpt: Checkpointer,
                      context: dict[str, float]) -> None:
    """Raise `NonFiniteLossError` when the step's loss or gradient norm is not finite, after
    saving the batch to ``<workdir>/nonfinite_batch_step<step>.npz``; the message holds the batch
    statistics, `context` (the rollout's metrics) and the last good checkpoint."""
    if np.isfinite(m["loss"]) and np.isfinite(m.get("grad_norm", 0.0)):
        return
    ckpt.wait()
    path = os.path.join(workdir, f"nonfinite_batch_step{step}.npz")
    np.savez(path, **{k: np.asarray(v) for k, v in jax.device_get(batch).items()})
    stats = batch_statistics(batch)
    stats["rollout"] = {k: v for k, v in context.items() if k.endswith("/reward") or k.endswith("/length")}
    last = ckpt.latest_step()
    raise NonFiniteLossError(
        f"non-finite loss at step {step} (loss={m['loss']}, grad_norm={m.get('grad_norm')}); batch statistics: "
        f"{json.dumps(stats)}; batch saved to {path}; last good checkpoint: "
        f"{'none' if last is None else f'step {last} in {ckpt.directory}'} (resume with --config.resume=True)")


def default_pool(workers: int, timeout: float) -> Any:
    """A `SandboxPool` of `workers` with a wall-clock limit of `timeout` seconds per execution."""
    import warnings

    from rlcode.sandbox import Limits, SandboxPool  # noqa: PLC0415 (lazy: workers start here)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # workers are fresh interpreters; jax being loaded is harmless
        return SandboxPool(workers, Limits(wall_seconds=timeout))


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
    """A background thread that collects rollout batches with the latest published parameters
    while the trainer updates.

    At most `max_staleness` batches are in flight (being sampled or waiting): the thread starts a
    batch only when the trainer has taken one, so a batch sampled with version v is consumed by
    step v + max_staleness at the latest and none has to be dropped for staleness (the trainer
    still checks). With max_staleness = 1 this is one-step off-policy sampling: batch t + 1 is
    sampled with the parameters of step t while step t trains. `start` numbers the batches (the
    `count` given to collect) from a resumed run's step on.
    """

    def __init__(self, collect: Callable[[Any, int, int], Any], store: ParamStore, max_staleness: int,
                 start: int = 0):
        self._collect = collect
        self._store = store
        self._slots = threading.Semaphore(max(1, max_staleness))
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._count = start
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

    def get(self) -> Any:
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


class StopFlag:
    """SIGINT/SIGTERM set a flag the loop checks between steps; a second signal raises
    KeyboardInterrupt at once. Installed only in the main thread."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
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


# ------------------------------------------------------------------------------ the engine


def _save(ckpt: Checkpointer, step: int, state: Any, last_eval: dict | None, first_eval: dict | None) -> None:
    metrics = dict(last_eval or {})
    metrics.update({f"first/{k}": v for k, v in (first_eval or {}).items()})
    ckpt.save(step, state, metrics=metrics, extra={"iteration": step}, force=True)


def _first_eval_of(ckpt: Checkpointer, extra: dict) -> dict | None:
    """The run's first evaluation as saved with the checkpoint it resumes from (`_save` keeps it
    in the metrics as first/<name>; older agent checkpoints kept it in `extra`)."""
    step = ckpt.latest_step()
    saved = ckpt.metrics(step) if step is not None else None
    first = {k[len("first/"):]: v for k, v in (saved or {}).items() if k.startswith("first/")}
    return first or extra.get("first_eval") or None


def _warm_start(ctx: Context, demos: Any) -> tuple[Any, dict]:
    cfg = ctx.cfg
    if demos is None or cfg.sft.steps <= 0:
        return None, {"cached": False, "seconds": 0.0, "history": []}
    bar = Progress(cfg.sft.steps, desc="sft")
    try:
        params, info = sft_lib.load_or_train(cfg.model, cfg.sft, demos, sft_lib.warm_start_seed(cfg),
                                             on_step=lambda s, m: bar.update(s + 1, nll=m["nll"]), log=ctx.say)
    finally:
        bar.close()
    if not info["cached"]:
        ctx.say(f"SFT: {cfg.sft.steps} steps in {info['seconds']:.0f} s, final NLL {info['history'][-1]['nll']:.3f}; "
                f"cached at {info['path']}")
    for rec in info["history"][:: max(1, cfg.sft.log_every)] + info["history"][-1:]:
        ctx.writer.scalars(rec["step"] - cfg.sft.steps, {"sft/nll": rec["nll"]})
    return params, info


def resolve_config(cfg: Any) -> Any:
    """`cfg` as the engine runs it: with ``model.init_from`` set, a copy whose model section has
    the checkpoint's architecture (`hf.resolve_model_section`), so the job's config check and
    memory estimate see the model that will be loaded; else `cfg` itself."""
    if not cfg.model.get("init_from", ""):
        return cfg
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.model = hf.resolve_model_section(cfg.model)
    return cfg


def train(cfg: Any, job: Job, *, pool: Any = None, log: Callable[[str], None] | None = None,
          hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run `job` with `cfg` (see the module docstring).

    pool: a sandbox pool to grade in (default: a `SandboxPool` of ``sandbox.workers``, closed at
      the end). log: message sink (default: the progress bar's). hooks: test seams,
      {"batch": fn(step, batch) -> batch} applied to each train batch.
    """
    t_start = time.perf_counter()
    hooks = hooks or {}
    devices = jax.devices()
    cfg = resolve_config(cfg)
    job.validate(cfg, len(devices), memory.limits(devices))
    sched = Schedule.from_config(cfg)
    # The sections the engine hands to the library, converted once into their typed configs.
    objective = job.objective(cfg) if job.objective is not None else ObjectiveConfig.from_config(cfg.loss)
    sampling = SamplingConfig.from_config(cfg.sampling) if "sampling" in cfg else SamplingConfig()
    progress: Progress | None = None
    say = log or (lambda m: progress.write(m) if progress is not None else print(m, file=sys.stderr, flush=True))
    workdir, ckpt_dir = prepare_workdir(cfg, say)
    with contextlib.ExitStack() as resources:
        timeout = job.pool_timeout(cfg)
        if pool is None and timeout is not None:
            pool = default_pool(cfg.sandbox.workers, timeout)
            resources.callback(pool.close)
        writer = EventWriter(os.path.join(workdir, "tb"))
        resources.callback(writer.close)
        summary = list(job.summary_metrics(cfg)) if job.summary_metrics is not None else []
        writer.hparams(cfg, metrics=["train/loss", *summary])
        ckpt = Checkpointer(ckpt_dir, keep=sched.checkpoint_keep, async_save=True)
        resources.callback(ckpt.close)
        resources.callback(lambda: progress.close() if progress is not None else None)
        tokenizer = job_tokenizer(cfg.get("tokenizer", "byte"), cfg.model.get("init_from", ""))
        ctx = Context(cfg, workdir, pool, writer, say, tokenizer, resources, sched, objective, sampling)

        # ---- tasks, warm start, model, train state, resume
        demos, data = job.setup(ctx)
        sft_params, sft_info = _warm_start(ctx, demos)
        ctx.mesh, ctx.rules = make_mesh(cfg.mesh), rules_from_config(cfg.mesh)
        model = hf.initial_model(cfg.model, cfg.seed, mesh=ctx.mesh, rules=ctx.rules)
        if sft_params is not None:
            gd, st = nnx.split(model)
            nnx.replace_by_pure_dict(st, sft_lib.merge_params(nnx.to_pure_dict(st), sft_params))
            model = nnx.merge(gd, st)
        # LoRA: adapters on the (warm-started) model; only they train (and the value head, new).
        lora = LoraConfig.from_config(cfg.lora) if "lora" in cfg else LoraConfig()
        trainable = None
        if lora.rank > 0:
            model = add_lora(model, lora, cfg.seed)
            trainable = adapter_mask(model, also=("value_w", "value_b"))
        optimizer = make_optimizer(cfg.optim, trainable)
        ctx.graphdef, state = init_train_state(model, optimizer, cfg.seed, ctx.mesh, ctx.rules)
        keep_ref = objective.kl_coef > 0 or (job.reference is not None and job.reference(cfg))
        ref_params = jax.tree.map(jnp.copy, state.params) if keep_ref else None
        start, first_eval = 0, None
        if cfg.resume:
            restored = ckpt.restore_or_none(target=state)
            if restored is None:
                say(f"resume: no checkpoint in {ckpt_dir}; starting from the warm start")
            else:
                state, extra = restored
                start, first_eval = int(extra["iteration"]), _first_eval_of(ckpt, extra)
                say(f"resumed from {ckpt_dir} at step {start}")
        def build_train_step(objective: ObjectiveConfig) -> Callable:
            return make_train_step(ctx.graphdef, objective, optimizer, microbatches=sched.microbatches,
                                   temperature=sampling.temperature, top_k=sampling.top_k or None,
                                   top_p=sampling.top_p, mesh=ctx.mesh, rules=ctx.rules,
                                   shardings=state_shardings(state), log_entropy=job.log_entropy,
                                   trainable=trainable)

        train_step = build_train_step(objective)
        plan = job.plan(ctx, data)
        split = plan.minibatches or (lambda batch, num, rng: split_groups(batch, num, cfg.rollout.group_size, rng))

        def evaluate(step: int) -> dict:
            return plan.evaluate(state.params, step)

        last_eval = None
        if start == 0 and sched.eval_at_start:
            first_eval = last_eval = evaluate(0)

        sampler = None
        if sched.async_mode:
            store = ParamStore(state.params, start)
            sampler = AsyncSampler(plan.collect, store, sched.max_staleness, start=start)
            resources.callback(sampler.close)
        mb_rng = np.random.default_rng([cfg.seed, 7, start])
        label = job.label(cfg) if job.label is not None else job.name
        progress = Progress(sched.steps, desc=label + (" async" if sched.async_mode else ""), start=start)
        budget = 60 * sched.max_minutes if sched.max_minutes else None
        step, last_saved, stopped, dropped_stale, rl_seconds = start, (start or None), None, 0, 0.0
        with StopFlag() as stop:
            while step < sched.steps:
                if stop.signal is not None:
                    stopped = "signal"
                    break
                if budget is not None and rl_seconds > budget:
                    stopped = "max_minutes"
                    say(f"train.max_minutes={sched.max_minutes} reached after {step - start} steps")
                    break
                t0 = time.perf_counter()
                if sampler is not None:
                    while True:
                        r = sampler.get()
                        staleness = step - r.version
                        if staleness <= sched.max_staleness:
                            break
                        dropped_stale += 1
                else:
                    r, staleness = plan.collect(state.params, step, step), 0
                t_wait = time.perf_counter() - t0
                scalars = dict(plan.metrics(r))
                t1 = time.perf_counter()
                batch = plan.prepare(state.params, ref_params, r)
                if "batch" in hooks:
                    batch = hooks["batch"](step, batch)
                collected: dict[str, list] = {}
                for _ in range(sched.epochs):
                    for mb in split(batch, sched.minibatches, mb_rng):
                        state, m = train_step(state, mb)
                        for k, v in m.items():
                            collected.setdefault(k, []).append(v)
                m = mean_metrics(collected)
                t_train = time.perf_counter() - t1
                check_finite_step(m, batch, step, workdir, ckpt, scalars)
                step += 1
                if sampler is not None:
                    store.publish(state.params, step)
                wall = time.perf_counter() - t0
                rl_seconds += wall
                tokens = float(np.asarray(batch["mask"]).sum())
                scalars.update({f"train/{k}": v for k, v in m.items()})
                scalars.update({
                    "train/rows": float(batch["inputs"].shape[0]), "train/tokens": tokens,
                    "time/step_s": wall, "time/train_s": t_train, "time/wait_for_rollout_s": t_wait,
                    "time/rl_minutes": rl_seconds / 60,
                    "throughput/train_tokens_per_s": tokens * sched.epochs / max(t_train, 1e-9),
                    "async/staleness": float(staleness), "async/dropped_stale": float(dropped_stale)})
                if plan.derived is not None:
                    scalars.update(plan.derived(scalars))
                writer.scalars(step, scalars)
                if sched.text_every and step % sched.text_every == 0:
                    for tag, text in plan.texts(r).items():
                        writer.text(step, tag, text)
                progress.update(step, **plan.progress(scalars, last_eval))
                if sched.eval_due(step):
                    last_eval = evaluate(step)
                if sched.checkpoint_due(step):
                    _save(ckpt, step, state, last_eval, first_eval)
                    last_saved = step
                action = plan.control(step, scalars) if plan.control is not None else None
                if action and "kl_coef" in action:
                    if ref_params is None:
                        raise RuntimeError("a controller set the KL coefficient, but the job keeps no reference "
                                           "parameters (Job.reference)")
                    objective = ctx.objective = dataclasses.replace(objective, kl_coef=float(action["kl_coef"]))
                    train_step = build_train_step(objective)
                if action and "params" in action:
                    placed = jax.tree.map(lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
                                          action["params"], state.params)
                    state = state._replace(params=placed)
                    if sampler is not None:
                        store.publish(state.params, step)
                if action and "stop" in action:
                    stopped = str(action["stop"])
                    say(f"stopped by {stopped} after step {step}")
                    break
        if stopped == "signal":
            say(f"stopping on signal {stop.signal} after step {step}: saving a checkpoint")
        elif sched.eval_at_end:
            last_eval = evaluate(step)
        if step != last_saved and step > 0:
            _save(ckpt, step, state, last_eval, first_eval)
        ckpt.wait()
        if stopped == "signal":
            say(f"checkpoint at step {step} saved in {ckpt_dir}"
                + ("; continue with --config.resume=True" if job.resumable else " (this job does not resume)"))
        elif step > 0:  # the final parameters alone, for inference (evaluate, sample, export)
            save_params(os.path.join(workdir, PARAMS_DIR), state.params, extra={"step": step}, force=True)
        result = RunResult(workdir=workdir, steps_done=step, completed=step >= sched.steps,
                           interrupted=stopped == "signal", sft={k: v for k, v in sft_info.items() if k != "history"},
                           first_eval=first_eval, last_eval=last_eval, seconds=time.perf_counter() - t_start,
                           stopped=stopped)
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=2, sort_keys=True)
        return result
