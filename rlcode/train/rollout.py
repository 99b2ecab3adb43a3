"""Rollouts for program-synthesis RL: prompts -> G sampled bodies -> sandbox grading -> rewards.

One `collect` call is one rollout batch of P prompts x G samples: the sampler prefills each
prompt once and decodes its G rows against it (`rlcode.sampling.sample`), the bodies are graded
on the task's held-out tests in the sandbox pool (one isolated execution per sample), and each
row gets a reward made of logged terms. Rows keep the group-by-group layout that
`rlcode.advantages.group_advantages` expects (row b belongs to prompt b // G).

Rewards: `rlcode.envs.rewards.synth_rewards` (tests passed, DAPO's overlong punishment, the
truncation penalty), configured by the job's `reward` section read as a
`rlcode.envs.rewards.SynthRewardConfig`.

A sample whose execution failed for infrastructure reasons (status "infra": a worker died, the
sandbox could not start) is *masked*: ``valid[b] = False``, reward 0, excluded from the group
statistics and from the loss; it is never scored as a failure of the policy.

`collect` with ``dynamic_sampling`` (DAPO) keeps only groups whose valid rewards are not all
equal, drawing new prompts until P groups are kept or ``max_draws`` draws were made; a batch that
is still short is completed with the most recent dropped groups (their advantages are 0, so they
add no gradient) and the count is reported as ``dynamic/filled``.

The job converts its `reward`, `rollout` and `sandbox` sections once into the frozen dataclasses
`SynthRewardConfig`, `RolloutConfig` and `SandboxConfig` (and `shaping` into
`rlcode.recipes.ShapingConfig`); the collector takes those, never a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlcode.checks import TypedSection, expect_type, integer, real
from rlcode.checks import flag as boolean
from rlcode.envs import verdict
from rlcode.envs.rewards import SynthRewardConfig, synth_rewards
from rlcode.envs.tasks.protocol import CompletionTask, is_question
from rlcode.recipes import ShapingConfig
from rlcode.sampling import SamplingConfig, sample
from rlcode.tokenizer import Tokenizer
from rlcode.train.schema import MAX_SANDBOX_WORKERS

ROLLOUT_SPECS = {"prompts_per_step": integer(1), "group_size": integer(1), "async_mode": boolean(),
                 "max_staleness": integer(0), "max_draws": integer(1), "trim_multiple": integer(1, required=False)}
SANDBOX_SPECS = {"workers": integer(1, MAX_SANDBOX_WORKERS), "timeout": real(0, low_open=True, none_ok=True)}


@dataclasses.dataclass(frozen=True)
class RolloutConfig(TypedSection):
    """The `rollout` section, validated and frozen: P = prompts_per_step prompts x G =
    group_size samples per batch; async_mode samples in a background thread, dropping a batch
    more than max_staleness parameter versions old; max_draws bounds the draws of dynamic
    sampling (`RolloutCollector.collect`); trim_multiple: the train batch's time axis is cut to
    the longest row rounded up to this multiple (`trim_batch`: a larger multiple means fewer
    distinct shapes to compile, more padding to compute). The agent job's section holds only P
    and G."""

    SPECS = ROLLOUT_SPECS
    SECTION = "rollout"

    prompts_per_step: int = 8
    group_size: int = 8
    async_mode: bool = False
    max_staleness: int = 1
    max_draws: int = 4
    trim_multiple: int = 32


@dataclasses.dataclass(frozen=True)
class SandboxConfig(TypedSection):
    """The `sandbox` section, validated and frozen: workers, the processes of the sandbox pool;
    timeout, the seconds one execution may run (the agent job's; the synthesis job's is
    `SynthRewardConfig.timeout`, and its section leaves this None)."""

    SPECS = SANDBOX_SPECS
    SECTION = "sandbox"

    workers: int = 2
    timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class EncodedTasks:
    """A task pool as fixed-shape token arrays: prompts [N, Lp] right-padded with pad_id,
    prompt_lengths [N]; targets [N, M] the reference continuation + stop token (SFT),
    target_lengths [N]."""

    tasks: tuple[CompletionTask, ...]
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    targets: np.ndarray
    target_lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.tasks)


def encode_tasks(tasks: Sequence[CompletionTask], tokenizer: Tokenizer, max_prompt_len: int,
                 max_new_tokens: int, *, what: str = "tasks") -> EncodedTasks:
    """Tokenise each task's `completion_prompt` (after a BOS, when the tokenizer has one) and its
    `completion_target` (+ EOS): any `rlcode.envs.tasks.protocol.CompletionTask`.

    Tasks whose prompt is longer than `max_prompt_len`, or whose reference continuation does not
    fit `max_new_tokens`, are left out (the caller sees how many through ``len``); raises if none
    is left.
    """
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    kept, prompts, targets = [], [], []
    for task in tasks:
        p = ([] if bos is None else [bos]) + tokenizer.encode(task.completion_prompt())
        t = tokenizer.encode(task.completion_target()) + [eos]
        if len(p) <= max_prompt_len and len(t) <= max_new_tokens:
            kept.append(task)
            prompts.append(p)
            targets.append(t)
    if not kept:
        raise ValueError(f"no {what} fit max_prompt_len={max_prompt_len} and max_new_tokens={max_new_tokens}")

    def pad_to(rows, width):
        out = np.full((len(rows), width), pad, np.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out, np.asarray([len(r) for r in rows], np.int32)

    prompt_arr, prompt_len = pad_to(prompts, max_prompt_len)
    target_arr, target_len = pad_to(targets, max_new_tokens)
    return EncodedTasks(tuple(kept), prompt_arr, prompt_len, target_arr, target_len)


def trim_batch(batch: dict[str, jax.Array], needed: int, multiple: int) -> dict[str, jax.Array]:
    """Cut the time axis of a [B, T] batch to `needed` positions rounded up to `multiple` (at most
    T): the positions beyond every row's last target are padding, and dropping them saves their
    compute. Rounding keeps the number of distinct shapes (compilations) small."""
    T = batch["inputs"].shape[1]
    keep = min(T, -(-max(needed, 1) // multiple) * multiple)
    if keep == T:
        return batch
    return {k: v[:, :keep] if v.ndim == 2 and v.shape[1] == T else v for k, v in batch.items()}


@dataclasses.dataclass
class Rollout:
    """One rollout batch on the host (numpy), B = P * G rows group by group.

    task_ids [P] indices into the task pool; prompts [P, Lp], prompt_lengths [P];
    tokens, logprobs, mask [B, M] (the sampler's output, behaviour log-probs at temperature);
    lengths [B]; rewards [B]; terms {name: [B]}; valid [B] (False = infrastructure failure);
    passed [B] all tests passed; pass_fraction [B]; version: the parameter version sampled with;
    texts: the decoded completions; stats: counters and timings of the collection; behaviour:
    per-row behaviour statistics {name: [B]} (`rlcode.feedback.behaviour.BEHAVIOUR_STATS`).
    """

    task_ids: np.ndarray
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    terms: dict[str, np.ndarray]
    valid: np.ndarray
    passed: np.ndarray
    pass_fraction: np.ndarray
    version: int
    texts: list[str]
    stats: dict[str, float]
    behaviour: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return self.tokens.shape[0] // self.prompts.shape[0]


def _select_groups(r: Rollout, groups: Sequence[int]) -> Rollout:
    G = r.group_size
    rows = np.concatenate([np.arange(g * G, (g + 1) * G) for g in groups]).astype(np.int64)
    groups = np.asarray(groups, np.int64)
    return dataclasses.replace(
        r, task_ids=r.task_ids[groups], prompts=r.prompts[groups], prompt_lengths=r.prompt_lengths[groups],
        tokens=r.tokens[rows], logprobs=r.logprobs[rows], mask=r.mask[rows], lengths=r.lengths[rows],
        rewards=r.rewards[rows], terms={k: v[rows] for k, v in r.terms.items()}, valid=r.valid[rows],
        passed=r.passed[rows], pass_fraction=r.pass_fraction[rows], texts=[r.texts[i] for i in rows],
        behaviour={k: v[rows] for k, v in r.behaviour.items()})


def concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """Concatenate rollout batches (same G); stats are summed, version is the oldest."""
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])
    stats: dict[str, float] = {}
    for p in parts:
        for k, v in p.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    return Rollout(
        task_ids=cat("task_ids"), prompts=cat("prompts"), prompt_lengths=cat("prompt_lengths"), tokens=cat("tokens"),
        logprobs=cat("logprobs"), mask=cat("mask"), lengths=cat("lengths"), rewards=cat("rewards"),
        terms={k: np.concatenate([p.terms[k] for p in parts]) for k in parts[0].terms}, valid=cat("valid"),
        passed=cat("passed"), pass_fraction=cat("pass_fraction"), version=min(p.version for p in parts),
        texts=[t for p in parts for t in p.texts], stats=stats,
        behaviour={k: np.concatenate([p.behaviour[k] for p in parts]) for k in parts[0].behaviour})


class Grader:
    """Grades completions of completion tasks (`rlcode.envs.tasks.protocol.CompletionTask`: the
    synthesis tasks, HumanEval) in a sandbox pool, all executions in flight at once.

    Each completion is one execution of the trusted-verdict child (`rlcode.envs.verdict`) in the
    pool's in-process mode: the child gets the candidate's source and the task's inputs
    (`check_groups`), returns the values it computed, and this process judges them (`score`) with
    what never leaves it. A completion that writes into the child's report channel
    (`forged_report`) scores 0.

    pool: a `rlcode.sandbox.SandboxPool` (or anything with its `submit_python` / `gather`).
    """

    def __init__(self, pool: Any, timeout: float = 5.0):
        self.pool = pool
        self.timeout = timeout

    def grade(self, tasks: Sequence[CompletionTask], bodies: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
        """(pass_fraction [B] float, valid [B] bool, timed_out [B] bool, counts) for body b of task b."""
        runs = [(t.check_groups(body), verdict.new_nonce()) for t, body in zip(tasks, bodies)]
        futures = [self.pool.submit_python(verdict.CHILD_SOURCE, stdin=verdict.request_payload(groups, nonce),
                                           inprocess=True, timeout=self.timeout) for groups, nonce in runs]
        results = self.pool.gather(futures) if futures else []  # nothing to run: every counter 0
        frac = np.zeros(len(tasks), np.float32)
        valid = np.ones(len(tasks), bool)
        timed_out = np.zeros(len(tasks), bool)
        flagged = {flag: 0.0 for flag in ("crash", "early_exit", "forged_report")}
        for i, ((groups, nonce), res) in enumerate(zip(runs, results)):
            if res is None:  # never finished in time: its execution was cancelled
                valid[i] = False
                continue
            v = verdict.interpret(groups, res, nonce)
            if not v.valid:  # never ran, or its worker died: mask
                valid[i] = False
                continue
            timed_out[i] = v.status == "timeout"
            for flag in flagged:
                flagged[flag] += flag in v.flags
            if "forged_report" not in v.flags:
                frac[i] = tasks[i].score(v)
        counts = {"infra": float((~valid).sum()), "timeout": float(timed_out.sum()), "executions": float(len(tasks)),
                  **flagged}
        return frac, valid, timed_out, counts


def parses(task: CompletionTask, completion: str) -> bool:
    """Whether every program the task would run for `completion` compiles (the source is only
    compiled, never executed, in this process)."""
    return all(compiles(group.source or "") for group in task.check_groups(completion))


def compiles(source: str) -> bool:
    """Whether `source` compiles as a module (compiled only, never executed)."""
    try:
        with warnings.catch_warnings():  # e.g. SyntaxWarning: the candidate's, not this program's
            warnings.simplefilter("ignore")
            compile(source, "<candidate>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


class RolloutCollector:
    """Samples and grades rollout batches from a pool of encoded tasks.

    Args:
      graphdef: the policy's graph definition (`nnx.split`).
      tasks: the encoded task pool to draw prompts from.
      tokenizer: decodes completions (stop token = EOS).
      grader: a `Grader`.
      sampling: the sampler's `SamplingConfig` (its stop_ids must contain the EOS id).
      reward: the `SynthRewardConfig`; shaping: the recipe's `ShapingConfig`.
      group_size: G samples per prompt.
      sample_fn: the sampler (default `rlcode.sampling.sample`); the signature of that function.
      reward_model: the learned reward (`rlcode.feedback.reward_model.RewardModel`) that scores
        each completion after its task's prompt when ``reward.source="reward_model"``; the
        tests still run (the gold objective: ``pass_fraction``, ``passed``), but pay nothing.
      allow_questions: a completion that asks a clarifying question
        (`rlcode.envs.tasks.protocol.is_question`) is not executed; it earns the question reward.
        Otherwise every completion is graded as an answer.

    Each batch carries its rows' behaviour statistics (`Rollout.behaviour`): answered or asked,
    malformed (an answer whose program does not parse: compiled here, never run) and length.
    """

    def __init__(self, graphdef: Any, tasks: EncodedTasks, tokenizer: Tokenizer, grader: Grader,
                 sampling: SamplingConfig, reward: SynthRewardConfig, shaping: ShapingConfig, group_size: int,
                 sample_fn: Callable = sample, reward_model: Any = None, allow_questions: bool = False):
        expect_type(sampling, SamplingConfig, "sampling")
        expect_type(reward, SynthRewardConfig, "reward")
        expect_type(shaping, ShapingConfig, "shaping")
        if tokenizer.eos_id not in sampling.stop_ids:
            raise ValueError("the sampler's stop_ids must contain the tokenizer's EOS id")
        self.graphdef = graphdef
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.grader = grader
        self.sampling = sampling
        self.reward = reward
        self.shaping = shaping
        self.group_size = group_size
        self.sample_fn = sample_fn
        if (reward.source == "reward_model") != (reward_model is not None):
            raise ValueError(f"reward.source={reward.source!r} " + ("needs a reward model" if reward_model is None
                                                                    else "takes no reward model"))
        self.reward_model = reward_model
        self.allow_questions = allow_questions

    def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
        eos = self.tokenizer.eos_id
        out = []
        for row, n in zip(tokens, lengths):
            ids = [int(t) for t in row[:n] if int(t) != eos]
            out.append(self.tokenizer.decode(ids, skip_special=True))
        return out

    def sample_and_grade(self, params: Any, task_ids: np.ndarray, key: jax.Array, version: int,
                         group_size: int | None = None) -> Rollout:
        """One batch for the given task ids (no dynamic sampling)."""
        G = group_size or self.group_size
        task_ids = np.asarray(task_ids, np.int64)
        prompts = self.tasks.prompts[task_ids]
        prompt_lengths = self.tasks.prompt_lengths[task_ids]
        t0 = time.perf_counter()
        out = self.sample_fn(self.graphdef, params, jnp.asarray(prompts), jnp.asarray(prompt_lengths), key,
                             group_size=G, cfg=self.sampling)
        out = jax.device_get(out)
        t1 = time.perf_counter()
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        texts = self.decode(tokens, lengths)
        row_tasks = [self.tasks.tasks[i] for i in np.repeat(task_ids, G)]
        asked = np.array([self.allow_questions and is_question(t) for t in texts], bool)
        answers = np.flatnonzero(~asked)
        frac, valid = np.zeros(len(texts), np.float32), np.ones(len(texts), bool)
        timed_out = np.zeros(len(texts), bool)
        # Questions are not programs: only the answers run.
        frac[answers], valid[answers], timed_out[answers], counts = self.grader.grade(
            [row_tasks[i] for i in answers], [texts[i] for i in answers])
        t2 = time.perf_counter()
        preference = None
        if self.reward_model is not None:
            preference = self.reward_model.score([t.completion_prompt() for t in row_tasks], texts)
        t3 = time.perf_counter()

        M = self.sampling.max_new_tokens
        mask = np.asarray(out.mask, bool)
        stopped = np.isin(tokens, np.asarray(self.sampling.stop_ids)).any(-1)
        truncated = ~stopped & (lengths >= M)
        rewards, terms = synth_rewards(frac, valid, truncated, lengths, M, self.reward,
                                       self.shaping.overlong_cache_length, preference, questions=asked)
        stats = dict(counts, sample_s=t1 - t0, execute_s=t2 - t1, generated_tokens=float(mask.sum()),
                     truncated=float(truncated.sum()), questions=float(asked.sum()))
        behaviour = {"answer_rate": ~asked, "question_rate": asked,
                     "malformed_rate": np.array([not q and not parses(task, text)
                                                 for task, text, q in zip(row_tasks, texts, asked)]),
                     "length": lengths.astype(np.float32)}
        if preference is not None:
            stats["reward_model_s"] = t3 - t2
        return Rollout(task_ids=task_ids, prompts=prompts, prompt_lengths=prompt_lengths, tokens=tokens,
                       logprobs=np.asarray(out.logprobs, np.float32), mask=mask, lengths=lengths, rewards=rewards,
                       terms=terms, valid=valid, passed=(frac >= 1.0) & valid, pass_fraction=frac,
                       version=version, texts=texts, stats=stats, behaviour=behaviour)

    def collect(self, params: Any, rng: np.random.Generator, key: jax.Array, version: int,
                num_prompts: int, dynamic_sampling: bool = False, max_draws: int = 4) -> Rollout:
        """A batch of `num_prompts` groups; with `dynamic_sampling`, informative groups only
        (see the module docstring). Prompts are drawn without replacement within a draw."""
        if not dynamic_sampling:
            ids = rng.choice(len(self.tasks), size=num_prompts, replace=False)
            r = self.sample_and_grade(params, ids, key, version)
            r.stats.update(draws=1.0, dropped_groups=0.0, filled=0.0)
            return r
        kept: list[Rollout] = []
        dropped: list[Rollout] = []
        stats: dict[str, float] = {}
        n_kept = n_dropped = 0
        draws = 0
        for draws in range(1, max_draws + 1):
            ids = rng.choice(len(self.tasks), size=num_prompts, replace=False)
            r = self.sample_and_grade(params, ids, jax.random.fold_in(key, draws), version)
            for k, v in r.stats.items():
                stats[k] = stats.get(k, 0.0) + v
            G = r.group_size
            informative = []
            for g in range(num_prompts):
                rows = slice(g * G, (g + 1) * G)
                vals = r.rewards[rows][r.valid[rows]]
                informative.append(vals.size >= 2 and np.ptp(vals) > 0)
            good = [g for g, ok in enumerate(informative) if ok][: num_prompts - n_kept]
            bad = [g for g, ok in enumerate(informative) if not ok]
            if good:
                kept.append(_select_groups(r, good))
                n_kept += len(good)
            if bad:
                dropped.append(_select_groups(r, bad))
                n_dropped += len(bad)
            if n_kept >= num_prompts:
                break
        filled = num_prompts - n_kept
        parts = list(kept)
        if filled:
            spare = concat_rollouts(dropped[::-1])
            parts.append(_select_groups(spare, list(range(filled))))
        out = concat_rollouts(parts)
        # The per-draw counters and timings, each draw once (the parts copied them).
        out.stats = dict(stats, draws=float(draws), dropped_groups=float(n_dropped), filled=float(filled))
        return out
