"""Real-time RL from usage logs: learn from what users did with the served policy's answers.

    python -m experiments.train --config=configs/usage_rl.py

The job trains on the engine (`rlcode.train.engine`) like the synthesis job, but its batches come
from a usage log (`rlcode.feedback.usage_log`) instead of its own sampler:

1. **Collect.** Read the records appended since the last step, join outcome events to their
   interactions, and take the settled interactions (`usage.settle_s` past their time by the log's
   watermark), oldest first, up to ``rollout.prompts_per_step`` rows, waiting for at least
   `usage.min_rows`. With ``usage.simulate=True`` a simulated deployment
   (`rlcode.feedback.deployment`) serves one more window of requests with the registry's live
   version(s) before each read and writes the log; otherwise another process writes it and the
   job polls it every `usage.poll_s` seconds (giving up after `usage.wait_minutes` without enough
   rows).
2. **Reward** each row from its outcome events (`usage_log.outcome_reward` with the `usage`
   section's weights: accepted, kept, reverted, followup, latency per second).
3. **Correct for the logging policy.** A row served by version v (versions are the steps they
   were published at) is as stale as the optimizer updates between v's parameters and the
   trainer's: ``s - v`` at step s, minus updates a rollback discarded. A row staler than
   `usage.max_staleness` is rejected (counted in ``usage/stale_rejected``). The rest carry the
   served policy's log-probs as the behaviour log-probs, and the loss's importance-sampling
   correction (``loss.is_mode``, TIS by default) reweights them to the current policy. Each row
   is its own group (G = 1): advantages are normalised over the batch
   (``advantage.normalize="batch"``).
4. **Update** (the configured objective), then every ``eval.every`` steps **evaluate** on the
   fixed suite (the fresh pool, ``task.num_fresh`` tasks of the users' distribution never trained
   on, or the held-out eval pool without one; the same sampling key every time) and pass the
   **regression gate**: the candidate is published to the registry (`rlcode.feedback.registry`,
   the deployment serves it from its next window) only if its ``eval/pass@1`` is at least the
   live version's (``usage.gate_against="live"``) or the best released version's ("best") minus
   `usage.gate_margin`. The evaluation at step 0 publishes the warm start as
   version 0. A rejected candidate is rolled back (``usage.on_reject="rollback"``, the default):
   training continues from the live version's parameters, so the served policy and the trained
   one never drift further apart than the staleness bound allows. With "continue" the trainer
   keeps the rejected parameters; if the gate then keeps rejecting, every new row is too stale
   and the job stops with an error naming the cause after `usage.max_idle_windows` windows
   without a usable row.

Logged: ``usage/*`` (rows, rewards and outcome rates of the batch, staleness, the log's torn /
duplicate / late / orphan counters, the deployment's clock and backlog), ``gate/*`` at each
evaluation, and the behaviour monitor (length, malformed answers).

Resume is not supported: the log reader's position, the join state and the simulated deployment
are not checkpointed (validation refuses ``resume=True``); the log and the registry are kept.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from rlcode import advantages as adv_lib
from rlcode.checks import ConfigError, TypedSection, flag, integer, real, schema_from_defaults, text
from rlcode.feedback import registry
from rlcode.feedback.behaviour import BehaviourWatch
from rlcode.feedback.deployment import Deployment, DeploymentConfig
from rlcode.feedback.usage_log import OUTCOME_KINDS, Interaction, LogReader, Outcome, UsageWindows, outcome_reward
from rlcode.envs.rewards import SynthRewardConfig
from rlcode.recipes import ShapingConfig
from rlcode.train import loop
from rlcode.train.engine import Context, Job, Plan, RunResult, train
from rlcode.train.rollout import Grader, Rollout, RolloutCollector, RolloutConfig, compiles

__all__ = ["UsageConfig", "usage_config", "UsageSource", "build_rollout", "regression_gate", "updates_behind",
           "JOB", "run"]


REJECT_ACTIONS = ("rollback", "continue")
GATE_REFERENCES = ("live", "best")


@dataclasses.dataclass(frozen=True)
class UsageConfig(TypedSection):
    """The `usage` section (module docstring). log / registry: paths ('' = ``<workdir>/usage.jsonl``
    and ``<workdir>/registry``). key_env: the name of an environment variable holding the key the
    log's records are signed with (`rlcode.feedback.usage_log`: unsigned records are then
    skipped; '' = records carry a checksum only). max_idle_windows: simulated windows in a row that bring no row
    fresh enough before the job gives up with an error naming the cause. gate_against: the score
    a candidate is compared with ("live": the live version's; "best": the best released one's).
    on_reject: what the
    trainer does when the gate keeps a candidate out: "rollback" (continue from the live version's
    parameters) or "continue" (keep training the rejected parameters)."""

    SPECS = {"log": text(), "registry": text(), "key_env": text(), "simulate": flag(), "min_rows": integer(1),
             "settle_s": real(0),
             "max_staleness": integer(0), "poll_s": real(0, low_open=True), "wait_minutes": real(0, low_open=True),
             "max_idle_windows": integer(1), "gate_margin": real(0), "gate_against": text(GATE_REFERENCES),
             "on_reject": text(REJECT_ACTIONS),
             "accepted": real(), "kept": real(), "reverted": real(), "followup": real(), "latency": real()}
    SECTION = "usage"

    log: str = ""
    registry: str = ""
    key_env: str = ""
    simulate: bool = True
    min_rows: int = 16
    settle_s: float = 2400.0
    max_staleness: int = 12
    poll_s: float = 5.0
    wait_minutes: float = 30.0
    max_idle_windows: int = 50
    gate_margin: float = 0.0
    gate_against: str = "live"
    on_reject: str = "rollback"
    accepted: float = 1.0
    kept: float = 1.0
    reverted: float = -1.0
    followup: float = -0.5
    latency: float = -0.05

    @property
    def weights(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in OUTCOME_KINDS}


def usage_config(**overrides: Any) -> ml_collections.ConfigDict:
    return UsageConfig.default_section(**overrides)


USAGE_SECTIONS = {
    "job": text(("usage",)),
    "usage": schema_from_defaults(usage_config(), UsageConfig.SPECS),
    "deployment": schema_from_defaults(DeploymentConfig.default_section(), DeploymentConfig.SPECS),
}


def paths(cfg: Any) -> tuple[str, str]:
    """(log path, registry directory) of a config."""
    u = cfg.usage
    return (u.log or os.path.join(cfg.workdir, "usage.jsonl"), u.registry or os.path.join(cfg.workdir, "registry"))


def log_key(cfg: Any) -> bytes | None:
    """The key of the log's signed records (``usage.key_env``), or None."""
    name = cfg.usage.get("key_env", "")
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(f"usage.key_env={name!r}: the environment variable is not set (or empty)")
    return value.encode()


def validate_config(cfg: Any, num_devices: int | None = None, budget: Any = None) -> None:
    """The synthesis job's checks (the tasks, sampling, rollout, model and training sections are
    its), then the usage job's own."""
    loop.validate_config(cfg, num_devices, budget, extra_sections=USAGE_SECTIONS)
    u = UsageConfig.from_config(cfg.usage)
    d = DeploymentConfig.from_config(cfg.deployment)
    log_key(cfg)
    if cfg.resume:
        raise ConfigError("resume=True: the usage job does not resume (its log position and simulated deployment "
                          "are not checkpointed); start a new workdir")
    if cfg.rollout.group_size != 1:
        raise ConfigError(f"rollout.group_size={cfg.rollout.group_size}: a usage log has one completion per request; "
                          "set it to 1")
    if cfg.advantage.estimator == "group" and cfg.advantage.normalize not in ("batch", "none"):
        raise ConfigError(f"advantage.normalize={cfg.advantage.normalize!r}: with one row per group use 'batch' "
                          "(or 'none')")
    if cfg.rollout.async_mode:
        raise ConfigError("rollout.async_mode=True: the usage job's rows are already off-policy; set it to False")
    if u.min_rows > cfg.rollout.prompts_per_step:
        raise ConfigError(f"usage.min_rows={u.min_rows} must be <= rollout.prompts_per_step="
                          f"{cfg.rollout.prompts_per_step}")
    if not (cfg.eval.at_start and cfg.eval.every >= 1):
        raise ConfigError("eval.at_start=True and eval.every >= 1 are needed: the step-0 evaluation publishes the "
                          "first served version and later ones run the regression gate")
    if u.simulate and u.settle_s <= d.keep_after_s:
        raise ConfigError(f"usage.settle_s={u.settle_s} must exceed deployment.keep_after_s={d.keep_after_s}: "
                          "an interaction settled before its keep check would never see a 'kept' event")


# ------------------------------------------------------------------------------ rows from the log


class UsageSource:
    """The settled, fresh-enough interactions of a usage log, step by step.

    advance: called before each read when the log needs more rows (the simulated deployment's
    `advance`); None: another process writes the log, and `next_rows` polls it."""

    def __init__(self, cfg: UsageConfig, log_path: str, advance: Callable[[], Any] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 key: bytes | None = None):
        self.cfg, self.advance, self.sleep, self.clock = cfg, advance, sleep, clock
        self.reader = LogReader(log_path, key=key)
        self.windows = UsageWindows(cfg.settle_s)
        self.stale = 0

    def _read(self) -> None:
        self.windows.add(self.reader.poll())

    def next_rows(self, step: int, rows: int,
                  age: Callable[[int], int] | None = None) -> list[tuple[Interaction, list[Outcome]]]:
        """Up to `rows` settled interactions at most `max_staleness` updates behind the trainer, at
        least `min_rows` (TimeoutError after `wait_minutes` without them, when following;
        RuntimeError after `max_idle_windows` simulated windows without a fresh one). `age(v)`:
        the optimizer updates between served version v and the trainer's parameters (default
        ``step - v``; a job that rolls back subtracts the discarded updates)."""
        c = self.cfg
        age = age or (lambda v: step - v)
        if self.advance is not None:
            self.advance()  # traffic keeps arriving while the trainer works
        self._read()
        out: list[tuple[Interaction, list[Outcome]]] = []
        deadline = self.clock() + 60 * c.wait_minutes
        idle, newest = 0, None
        while True:
            fresh = 0
            for it, outs in self.windows.take(rows - len(out)):
                newest = it.version if newest is None else max(newest, it.version)
                if age(it.version) > c.max_staleness:
                    self.stale += 1
                else:
                    out.append((it, outs))
                    fresh += 1
            if len(out) >= c.min_rows:
                return out
            idle = 0 if fresh else idle + 1
            if self.advance is not None:
                if idle >= c.max_idle_windows:
                    raise RuntimeError(
                        f"usage log {self.reader.path}: {idle} windows in a row brought no interaction within "
                        f"usage.max_staleness={c.max_staleness} updates of the trainer (newest served version: "
                        f"{newest}, {None if newest is None else age(newest)} updates behind); the served version "
                        "is not catching up (a gate that rejects every candidate?): raise usage.max_staleness or "
                        "use usage.on_reject='rollback'")
                self.advance()
            else:
                if self.clock() > deadline:
                    raise TimeoutError(f"usage log {self.reader.path}: {len(out)} of usage.min_rows={c.min_rows} "
                                       f"settled interactions after usage.wait_minutes={c.wait_minutes}")
                self.sleep(c.poll_s)
            self._read()

    def counters(self) -> dict[str, float]:
        return {"usage/stale_rejected": float(self.stale), "usage/torn": float(self.reader.counts["torn"]),
                "usage/unauthenticated": float(self.reader.counts["unauthenticated"]),
                "usage/duplicates": float(self.reader.counts["duplicates"]),
                "usage/late_outcomes": float(self.windows.counts["late"]),
                "usage/orphan_outcomes": float(self.windows.counts["orphans"]),
                "usage/backlog": float(len(self.windows.pending)),
                "usage/settled_backlog": float(self.windows.settled())}


def build_rollout(rows: Sequence[tuple[Interaction, Sequence[Outcome]]], size: int, max_prompt_len: int,
                  max_new_tokens: int, pad_id: int, weights: dict[str, float], step: int,
                  age: Callable[[int], int] | None = None) -> Rollout:
    """A rollout batch of `size` rows (G = 1) from logged interactions; rows beyond the logged
    ones, and logged rows whose prompt or completion does not fit the job's lengths, are invalid.
    ``terms`` holds each outcome kind (0/1, the latency in seconds); passed / pass_fraction are 0:
    the tests' verdict is not in a usage log. `age` as for `UsageSource.next_rows` (the
    staleness statistics)."""
    age = age or (lambda v: step - v)
    if not rows:
        raise ValueError("build_rollout needs at least one row")
    prompts = np.full((size, max_prompt_len), pad_id, np.int32)
    plen = np.ones(size, np.int32)
    tokens = np.full((size, max_new_tokens), pad_id, np.int32)
    logprobs = np.zeros((size, max_new_tokens), np.float32)
    lengths = np.zeros(size, np.int32)
    rewards = np.zeros(size, np.float32)
    valid = np.zeros(size, bool)
    terms = {k: np.zeros(size, np.float32) for k in OUTCOME_KINDS}
    versions = np.full(size, step, np.int64)
    texts = [""] * size
    for i, (it, outs) in enumerate(rows[:size]):
        P, L = len(it.prompt_ids), len(it.completion_ids)
        texts[i], versions[i] = it.completion, it.version
        if not (1 <= P <= max_prompt_len and 1 <= L <= max_new_tokens):
            continue
        prompts[i, :P], plen[i] = it.prompt_ids, P
        tokens[i, :L], logprobs[i, :L], lengths[i] = it.completion_ids, it.logprobs, L
        rewards[i] = outcome_reward(outs, weights)
        for o in outs:
            terms[o.kind][i] = o.value if o.kind == "latency" else 1.0
        valid[i] = True
    if not valid.any():  # keep the arrays well formed: one token, no weight
        lengths[0] = 1
    mask = np.arange(max_new_tokens)[None, :] < lengths[:, None]
    n = len(rows[:size])
    ages = np.array([age(int(v)) for v in versions[:n]], np.float64)
    stats = {"rows": float(valid.sum()), "rejected_lengths": float(n - valid.sum()),
             "staleness_mean": float(ages.mean()), "staleness_max": float(ages.max())}
    return Rollout(task_ids=np.zeros(size, np.int64), prompts=prompts, prompt_lengths=plen, tokens=tokens,
                   logprobs=logprobs, mask=mask, lengths=lengths, rewards=rewards, terms=terms, valid=valid,
                   passed=np.zeros(size, bool), pass_fraction=np.zeros(size, np.float32),
                   version=int(versions[:n][valid[:n]].min()) if valid.any() else step, texts=texts, stats=stats,
                   behaviour={"length": lengths.astype(np.float32)})


# ------------------------------------------------------------------------------ the gate


def updates_behind(version: int, step: int, rollbacks: Sequence[tuple[int, int]]) -> int:
    """The optimizer updates between the parameters of version `version` and the trainer's at
    `step`: ``step - version``, less the updates the rollbacks threw away. A rollback ``(v, s)``
    (at step s, back to version v) discards the updates of steps v+1..s still in the trainer's
    line; together the rollbacks discard the union of those ranges."""
    merged: list[list[int]] = []
    for v, s in sorted(rollbacks):
        if merged and v <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], s)
        else:
            merged.append([v, s])
    return (step - version) - sum(max(0, min(s, step) - max(v, version)) for v, s in merged)


def regression_gate(root: str, step: int, params: Any, score: float, margin: float,
                    against: str = "live") -> dict[str, float]:
    """Publish `params` as version `step` in the registry at `root` if its fixed-suite `score` is
    at least the reference score minus `margin` (the first candidate, with nothing live, always
    is); the reference is the live version's score (``against="live"``) or the best score of any
    version released so far ("best": releases cannot drift down by a margin each). Returns the
    ``gate/*`` scalars (the candidate's score, its difference from the reference, whether it was
    published, and the live version and score afterwards)."""
    live = registry.current(root)
    if live is None:
        ok, delta = True, 0.0
    else:
        reference = live["score"] if against == "live" else max(h["score"] for h in registry.history(root))
        delta = score - reference
        ok = step > live["version"] and delta >= -margin
    if ok:
        live = registry.publish(root, step, params, {"score": score, "delta": delta})
    return {"gate/score": score, "gate/delta": delta, "gate/published": float(ok),
            "gate/live_version": float(live["version"]), "gate/live_score": float(live["score"])}


# ------------------------------------------------------------------------------ the job


def plan(ctx: Context, tasks: tuple) -> Plan:
    cfg, tok = ctx.cfg, ctx.tokenizer
    train_tasks, eval_tasks, fresh_tasks = tasks
    u, d = UsageConfig.from_config(cfg.usage), DeploymentConfig.from_config(cfg.deployment)
    log_path, root = paths(cfg)
    key = log_key(cfg)
    objective, options = ctx.objective, ctx.sampling
    advantage = adv_lib.AdvantageConfig.from_config(cfg.advantage)
    reward, shaping = SynthRewardConfig.from_config(cfg.reward), ShapingConfig.from_config(cfg.shaping)
    sampling = dataclasses.replace(options, top_k=options.top_k or None, stop_ids=(tok.eos_id,), pad_id=tok.pad_id)
    grader = Grader(ctx.pool, timeout=reward.timeout)
    # The fixed suite: the users' distribution (the fresh pool: train-split tasks never trained
    # on) when there is one, else the held-out eval pool.
    suite = fresh_tasks if fresh_tasks is not None else eval_tasks
    evaluator = RolloutCollector(ctx.graphdef, suite, tok, grader, sampling, reward, shaping, cfg.eval.num_samples)
    eval_key = jax.random.fold_in(jax.random.key(cfg.seed), 2)
    P, M, Lp = cfg.rollout.prompts_per_step, cfg.sampling.max_new_tokens, cfg.task.max_prompt_len
    behaviour = BehaviourWatch(cfg.get("behaviour"), ctx.say)
    make_batch = loop.make_prepare_fn(objective, advantage, options, ctx.graphdef, 1, tok.pad_id,
                                      RolloutConfig.from_config(cfg.rollout).trim_multiple)
    state: dict[str, Any] = {"deployment": None, "source": None, "rows": None, "template": None, "rollback": None}
    discarded: list[tuple[int, int]] = []  # (version, step): a rollback at `step` to `version`

    def age_at(step: int) -> Callable[[int], int]:
        return lambda v: updates_behind(v, step, discarded)
    if u.simulate and os.path.exists(log_path) and os.path.getsize(log_path):
        raise ConfigError(f"usage.simulate=True: the log {log_path} already has records; a simulated deployment "
                          "starts a new log (use a new workdir or usage.log)")
    if os.path.exists(os.path.join(root, registry.CURRENT)):
        raise ConfigError(f"the registry {root} already has a live version; the job starts a new one (use a new "
                          "workdir or usage.registry)")

    def source(params: Any) -> UsageSource:
        if state["source"] is None:
            advance = None
            if u.simulate:
                users = RolloutCollector(ctx.graphdef, train_tasks, tok, grader, sampling, reward, shaping, 1)
                state["deployment"] = Deployment(d, users, root, log_path, template=params, key=key)
                ctx.resources.callback(state["deployment"].close)
                advance = state["deployment"].advance
            state["source"] = UsageSource(u, log_path, advance, key=key)
        return state["source"]

    def collect(params, version, count):
        state["template"] = params
        rows = source(params).next_rows(version, P, age_at(version))
        state["rows"] = rows
        return build_rollout(rows, P, Lp, M, tok.pad_id, u.weights, version, age_at(version))

    def prepare(params, ref_params, r: Rollout) -> dict:
        batch = make_batch(params, ref_params, r, kl_coef=ctx.objective.kl_coef)
        batch.pop("kl_from_start", None)
        return batch

    def metrics(r: Rollout) -> dict[str, float]:
        v = r.valid
        n = max(int(v.sum()), 1)
        mean = lambda x: float(np.where(v, x, 0).sum() / n)
        out = {"usage/rows": float(v.sum()), "usage/reward": mean(r.rewards),
               "usage/staleness_mean": r.stats["staleness_mean"], "usage/staleness_max": r.stats["staleness_max"],
               "usage/rejected_lengths": r.stats["rejected_lengths"], "usage/length": mean(r.lengths)}
        for k in OUTCOME_KINDS:
            out[f"usage/{'latency_s' if k == 'latency' else k + '_rate'}"] = mean(r.terms[k])
        out.update(state["source"].counters())
        dep = state["deployment"]
        if dep is not None:
            out.update({"deployment/time_h": dep.now / 3600, "deployment/requests": float(dep.counts["requests"]),
                        "deployment/torn_writes": float(dep.counts["torn"]),
                        "deployment/duplicate_writes": float(dep.counts["duplicated"]),
                        "deployment/live_version": float(dep.served[-1][0])})
        # An answer is malformed when the request's code with it does not compile.
        rows = state["rows"]
        malformed = np.array([not compiles(rows[i][0].request + rows[i][0].completion) for i in np.flatnonzero(v)],
                             np.float32)
        out.update(behaviour.observe({"length": r.lengths[v].astype(np.float32), "malformed_rate": malformed}))
        return out

    def evaluate(params, step):
        t0 = time.perf_counter()
        m, texts = loop.evaluate(evaluator, params, cfg, eval_key, prefix="eval")
        m["eval/seconds"] = time.perf_counter() - t0
        m.update(regression_gate(root, step, params, m["eval/pass@1"], u.gate_margin, u.gate_against))
        rollback = step > 0 and not m["gate/published"] and u.on_reject == "rollback"
        m["gate/rollback"] = float(rollback)
        state["rollback"] = int(m["gate/live_version"]) if rollback else None
        ctx.writer.scalars(step, m)
        ctx.writer.text(step, "eval/samples", "\n\n".join(texts))
        ctx.say(f"eval @ step {step}: pass@1={m['eval/pass@1']:.3f}  gate: "
                + ("published" if m["gate/published"] else "kept the live version"
                   + (", rolled the trainer back to it" if rollback else ""))
                + f" (live v{int(m['gate/live_version'])}, score {m['gate/live_score']:.3f})")
        return m

    def progress(scalars, last_eval):
        fields = {"reward": scalars["usage/reward"], "accept": scalars["usage/accepted_rate"]}
        if last_eval is not None:
            fields["eval_pass@1"] = last_eval["eval/pass@1"]
        return fields

    def texts(r: Rollout) -> dict[str, str]:
        parts = []
        for i, (it, outs) in enumerate((state["rows"] or [])[:cfg.log.num_texts]):
            kinds = ", ".join(sorted({o.kind for o in outs})) or "no outcome"
            parts.append(f"v{it.version} ({kinds}; reward {r.rewards[i]:.2f}):\n\n```\n{it.request}{it.completion}\n```")
        return {"usage/samples": "\n\n".join(parts)}

    def control(step: int, scalars: dict) -> dict | None:
        action = dict(behaviour.control(step) or {})
        version, state["rollback"] = state["rollback"], None
        if version is not None and state["template"] is not None:
            action["params"] = registry.load(root, version, target=state["template"])
            discarded.append((version, step))
        return action or None

    return Plan(collect=collect, prepare=prepare, evaluate=evaluate, metrics=metrics, progress=progress, texts=texts,
                control=control)


def summary_metrics(cfg: Any) -> list[str]:
    return ["eval/pass@1", "gate/live_version", "usage/reward", "usage/accepted_rate"]


JOB = Job(name="usage", validate=validate_config, pool_timeout=lambda cfg: cfg.reward.timeout, setup=loop.setup,
          plan=plan, label=lambda cfg: f"{cfg.objective} from usage", summary_metrics=summary_metrics, resumable=False)


def run(cfg: Any, *, pool: Any = None, log: Callable[[str], None] | None = None,
        hooks: dict[str, Callable] | None = None) -> RunResult:
    """Run the usage job of `cfg` on the engine (`rlcode.train.engine.train`)."""
    return train(cfg, JOB, pool=pool, log=log, hooks=hooks)
