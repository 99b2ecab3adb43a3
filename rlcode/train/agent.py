"""Multi-turn agent RL on repository tasks: SFT from scripted experts, then GRPO over episodes.

    python -m experiments.train --config=configs/agent_repo.py

1. **Tasks** (`rlcode.envs.repo_tasks`): small Python repositories with a planted bug or a
   missing feature. Training uses the train families (seeds from `task.seed`); two evaluation
   sets are never trained on: ``eval_fresh`` (other seeds of the train families: new names,
   constants, variants and tests) and ``eval`` (the eval families: bug shapes never seen).
2. **SFT warm start**: the scripted expert (`repo_tasks.expert_turns`) plays each training task
   through the harness in the sandbox; the token sequences, with only the expert's own tokens
   in the loss (tool output, prompts and templates masked), train the policy by maximum
   likelihood (`rlcode.train.sft`, cached by content like the main job's warm start).
3. **RL**: each step plays P tasks x G episodes concurrently (one thread each) with
   `rlcode.envs.harness.run_episode`: tool calls run in the sandbox pool, malformed calls are
   answered with an error, a context that fills up is summarised by the policy and continued.
   Every turn of every live episode is generated in one batch (`TurnBatcher`, `SessionSampler`).
   The final copy is graded on held-out tests (`rlcode.envs.grading`) and scored by
   `rlcode.envs.rewards.compute_reward` (all held-out tests pass, minus length, malformed-call
   and per-turn penalties; a flagged hack scores no test reward). Group advantages are computed
   over the G episodes of a task; each segment of an episode is one training sequence carrying
   its episode's advantage, with only the sampled tokens in the loss.

**Documents** (`attention.kind="squid"`, docs/reference.md §8): the full observation of every
successful ``read_file`` call is a document. In the training forward its tokens attend only
within itself (segment ids), every other token attends causally to everything before it; the
sampler therefore encodes each distinct document once per batch of episodes (`encode_documents`)
and writes its keys, rotated to where the episode placed it, into that episode's cache, across
the G episodes of a group and across turns. Both sides use the same spans
(`harness.Segment.documents`), so sampling and training compute the same distribution.

**Prefill accounting**, per step, on the episodes actually played: ``full`` = tokens a sampler
that re-reads the whole context every turn prefills (what a stateless ``policy_fn(ids)`` does);
``incremental`` = tokens a dense sampler with a per-episode KV cache prefills (each turn's new
tokens); ``documents`` = what this sampler prefills with document reuse (new non-document
tokens plus each distinct document once). `replay_prefill` times the same recorded turns in
each mode (experiments/bench_agent_prefill.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlcode import advantages as adv_lib
from rlcode import losses, sampling
from rlcode.checks import ConfigError, config_errors, flag, integer, real, schema_from_defaults, sequence, text
from rlcode.envs import grading, harness, repo_tasks, rewards, tools
from rlcode.sandbox import fstree
from rlcode.models.transformer import init_model
from rlcode.sharding import make_mesh, rules_from_config
from rlcode.tokenizer import ByteTokenizer, Tokenizer
from rlcode.train import memory
from rlcode.train import sft as sft_lib
from rlcode.train.checkpoint import Checkpointer
from rlcode.train.loop import RunResult, _StopFlag, default_pool, prepare_workdir
from rlcode.train.metrics import EventWriter, eval_summary, repair_json_lines
from rlcode.train.schema import MAX_SANDBOX_WORKERS, SEED, check_common, check_schema, mesh_sizes
from rlcode.train.progress import Progress
from rlcode.train.rollout import SandboxConfig
from rlcode.train.step import (init_train_state, make_logprob_fn, make_optimizer, make_train_step,
                               state_shardings)

PREFILL_MODES = ("documents", "incremental", "full")
ROW_MULTIPLE = 8  # training batches are padded to a multiple of this many rows (few shapes to compile)


def _bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """Shapes for jit: powers of two up to `step`, then multiples of `step`."""
    n = max(int(n), 1)
    if n <= step:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // step) * step


# --------------------------------------------------------------------------------------------
# Sampling many episodes turn by turn
# --------------------------------------------------------------------------------------------


class SessionSampler:
    """Generates the next turn of many episodes at once, each with a persistent KV cache.

    `generate({row: (context ids, document spans)})` extends each row's cache by the tokens that
    are new since its previous call (a context that does not start with the cached one, e.g. a
    fresh segment after a summary, starts over), then samples one response per row.

    mode: ``documents`` – document spans (squid models) are not prefilled but copied from a
    per-batch cache of encoded documents (keys rotated to their place); ``incremental`` – the
    new tokens are prefilled, documents included; ``full`` – every turn prefills the whole
    context (the cache is only used within a turn). All three give the same distribution on a
    dense model; on a squid model only ``documents`` matches the training forward.
    """

    def __init__(self, graphdef: Any, tokenizer: Tokenizer, *, rows: int, max_context: int, max_response: int,
                 temperature: float = 1.0, mode: str = "documents"):
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {mode!r}")
        self.graphdef, self.tok, self.rows, self.mode = graphdef, tokenizer, rows, mode
        self.max_context = max_context
        self.capacity = max_context + 512  # bucketed writes run at most 511 slots past a context
        self.cfg = sampling.SamplingConfig(max_new_tokens=max_response, temperature=temperature,
                                           stop_ids=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id)
        self.cache: sampling.SessionCache | None = None
        self.record: list[dict[int, tuple[list[int], list[tuple[int, int]]]]] | None = None

    def start(self, params: Any, key: jax.Array, record: bool = False) -> None:
        """Begin a batch of episodes with `params`: empty contexts, no cached documents."""
        self.params, self.key, self.calls = params, key, 0
        self.model = nnx.merge(self.graphdef, params)
        if self.mode == "documents" and self.model.cfg.attention["kind"] != "squid":
            self.mode = "incremental"  # documents are only separable under squid attention
        if self.cache is None:
            self.cache = sampling.init_session_cache(self.model, self.rows, self.capacity)
        self.lengths = np.zeros(self.rows + 1, np.int32)
        self.cached: list[list[int]] = [[] for _ in range(self.rows)]
        self.documents: dict[tuple[int, ...], sampling.DocKV] = {}
        self.stats: collections.Counter = collections.Counter()
        self.record = [] if record else None
        self.logprobs: list[list[np.ndarray]] = [[] for _ in range(self.rows)]

    # ---- prefill
    def _plan(self, row: int, ids: list[int], spans: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Pieces of the new tokens: global, document, global, ..., global (odd = documents)."""
        prev = self.cached[row]
        keep = len(prev) if self.mode != "full" and len(prev) <= len(ids) and ids[: len(prev)] == prev else 0
        self.lengths[row] = keep
        pieces, cursor = [], keep
        if self.mode == "documents":
            for a, b in spans:
                if a >= keep:
                    pieces += [ids[cursor:a], ids[a:b]]
                    cursor = b
        pieces.append(ids[cursor:])
        self.stats["tokens_full"] += len(ids)
        self.stats["tokens_new"] += len(ids) - keep
        self.stats["tokens_new_documents"] += sum(len(p) for p in pieces[1::2])
        return pieces

    def _encode_new_documents(self, plans: dict[int, list[list[int]]]) -> None:
        new = list(dict.fromkeys(tuple(d) for p in plans.values() for d in p[1::2] if tuple(d) not in self.documents))
        for i in range(0, len(new), 16):
            chunk = new[i:i + 16]
            pad = _bucket(max(len(d) for d in chunk), 64)
            for d, kv in zip(chunk, sampling.encode_documents(self.model, [np.array(d) for d in chunk], pad_to=pad)):
                self.documents[d] = kv
            self.stats["tokens_documents_encoded"] += sum(len(d) for d in chunk)

    def _extend(self, items: list[tuple[int, list[int]]], last: dict) -> None:
        Rb, T = _bucket(len(items), 4), _bucket(max(len(t) for _, t in items))
        rows = np.full(Rb, self.rows, np.int32)
        tokens = np.full((Rb, T), self.tok.pad_id, np.int32)
        lengths = np.zeros(Rb, np.int32)
        num = np.ones(Rb, np.int32)
        for i, (r, t) in enumerate(items):
            rows[i], lengths[i], num[i] = r, self.lengths[r], len(t)
            tokens[i, : len(t)] = t
        self.cache, hidden = sampling.extend_session(self.graphdef, self.params, self.cache, rows, tokens, lengths, num)
        for i, (r, t) in enumerate(items):
            self.lengths[r] += len(t)
            last[r] = hidden[i]
        self.stats["tokens_prefilled"] += sum(len(t) for _, t in items)

    def _write_documents(self, items: list[tuple[int, list[int]]]) -> None:
        Nd, Ld = _bucket(len(items), 4), _bucket(max(len(t) for _, t in items), 64)
        docs = [self.documents[tuple(t)] for _, t in items]
        rows = np.full(Nd, self.rows, np.int32)
        starts = np.zeros(Nd, np.int32)
        doc_start = np.zeros(Nd, np.int32)
        for i, ((r, _), kv) in enumerate(zip(items, docs)):
            rows[i], starts[i], doc_start[i] = r, self.lengths[r], kv.start

        def stacked(arrays):  # [L, Nd, Ld, K, H], on the device the documents live on
            dtype = self.cache.k.dtype
            padded = [jnp.pad(a.astype(dtype), ((0, 0), (0, Ld - a.shape[1]), (0, 0), (0, 0))) for a in arrays]
            padded += [jnp.zeros_like(padded[0])] * (Nd - len(arrays))
            return jnp.stack(padded, axis=1)

        self.cache = sampling.write_documents(self.cache, rows, starts, stacked([kv.k for kv in docs]),
                                              stacked([kv.v for kv in docs]), doc_start, theta=self.model.cfg.rope_theta)
        for r, t in items:
            self.lengths[r] += len(t)

    def prefill(self, requests: dict[int, tuple[list[int], Sequence[tuple[int, int]]]]) -> dict[int, jax.Array]:
        """Bring every requested row's cache up to its context; returns each row's last hidden."""
        t0 = time.perf_counter()
        for r, (ids, _) in requests.items():
            if len(ids) > self.max_context:
                raise ValueError(f"row {r}: context of {len(ids)} tokens exceeds max_context={self.max_context}")
            if not ids:
                raise ValueError(f"row {r}: empty context")
        plans = {r: self._plan(r, list(ids), spans) for r, (ids, spans) in sorted(requests.items())}
        if self.mode == "documents":
            self._encode_new_documents(plans)
        last: dict[int, jax.Array] = {}
        for i in range(max(len(p) for p in plans.values())):
            items = [(r, p[i]) for r, p in plans.items() if i < len(p) and p[i]]
            if items and i % 2 == 0:
                self._extend(items, last)
            elif items:
                self._write_documents(items)
        for r, (ids, _) in requests.items():
            self.cached[r] = list(ids)
        jax.block_until_ready(self.cache)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        return last

    def generate(self, requests: dict[int, tuple[list[int], Sequence[tuple[int, int]]]]) -> dict[int, list[int]]:
        """One response per row (ids up to and including a stop id, or max_response ids)."""
        if self.record is not None:
            self.record.append({r: (list(ids), [tuple(s) for s in spans]) for r, (ids, spans) in requests.items()})
        last = self.prefill(requests)
        t0 = time.perf_counter()
        order = sorted(requests)
        Rb = _bucket(len(order), 4)
        rows = np.full(Rb, self.rows, np.int32)
        rows[: len(order)] = order
        lengths = self.lengths[rows]
        hidden = jnp.stack([last[r] for r in order] + [jnp.zeros_like(last[order[0]])] * (Rb - len(order)))
        key = jax.random.fold_in(self.key, self.calls)
        self.calls += 1
        out = sampling.sample_session(self.graphdef, self.params, self.cache, rows, lengths, hidden, key, cfg=self.cfg)
        tokens, n, logp = np.asarray(out.tokens), np.asarray(out.lengths), np.asarray(out.logprobs)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["tokens_generated"] += int(n[: len(order)].sum())
        for i, r in enumerate(order):
            self.logprobs[r].append(logp[i, : n[i]])
        return {r: tokens[i, : n[i]].tolist() for i, r in enumerate(order)}


class TurnBatcher:
    """Collects the policy calls of concurrently running episodes and answers them in batches.

    Each episode thread calls `policy(row)(ids, documents)` and blocks; `serve` (in the calling
    thread) waits until every live episode is waiting, generates all their turns in one
    `SessionSampler.generate` call, and hands the results back. `done(row)` removes an episode
    that ended. A failure of the sampler is raised in `serve` and in every waiting episode.
    """

    def __init__(self, sampler: SessionSampler, rows: Sequence[int]):
        self.sampler = sampler
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[list[int], list]] = {}
        self._results: dict[int, list[int]] = {}
        self._live = set(rows)
        self._error: BaseException | None = None

    def policy(self, row: int) -> Callable[..., list[int]]:
        def fn(ids, documents=()):
            with self._cv:
                self._pending[row] = (list(ids), list(documents))
                self._cv.notify_all()
                while row not in self._results:
                    if self._error is not None:
                        raise RuntimeError("the sampler failed") from self._error
                    self._cv.wait()
                return self._results.pop(row)
        return fn

    def done(self, row: int) -> None:
        with self._cv:
            self._live.discard(row)
            self._cv.notify_all()

    def serve(self) -> None:
        while True:
            with self._cv:
                while self._live and not self._live <= set(self._pending):
                    self._cv.wait()
                if not self._live:
                    return
                batch, self._pending = self._pending, {}
            try:
                out = self.sampler.generate(batch)
            except BaseException as e:
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                raise
            with self._cv:
                self._results.update(out)
                self._cv.notify_all()


@dataclasses.dataclass
class Episode:
    """One played and graded episode."""

    task: repo_tasks.RepoTask
    trajectory: harness.Trajectory
    reward: float
    terms: dict[str, float]
    flags: tuple[str, ...]
    valid: bool
    hacked: bool  # the grade raised one of reward.hack_flags
    success: bool  # every held-out test passed and no hack flag was raised
    behavior_logp: np.ndarray | None = None  # the sampler's log-probs of the sampled tokens, in order


def _episode_kwargs(cfg: Any) -> dict[str, Any]:
    a = cfg.agent
    registry = {name: tools.TOOLS[name] for name in a.tools} if a.tools else tools.TOOLS
    return dict(max_turns=a.max_turns, max_context_tokens=a.max_context_tokens,
                max_response_tokens=a.max_response_tokens,
                summary_prompt=harness.SUMMARY_PROMPT if a.summarize else None,
                system_prompt=harness.render_system_prompt(registry, compact=a.compact_prompt), registry=registry)


def _grade(task, traj, pool, cfg) -> Episode:
    grade = grading.grade(task, traj.workdir, pool, timeout=cfg.sandbox.timeout)
    reward_cfg = rewards.RewardConfig.from_config(cfg.reward)
    reward, terms, flags, valid = rewards.compute_reward(grade, traj, task, reward_cfg)
    hacked = bool(set(flags) & set(cfg.reward.hack_flags))
    success = valid and grade.status == "ok" and grade.all_passed and not hacked
    return Episode(task, traj, reward, terms, flags, valid, hacked, success)


def play_episodes(tasks: Sequence[repo_tasks.RepoTask], sampler: SessionSampler, params: Any, key: jax.Array,
                  pool: Any, tokenizer: Tokenizer, cfg: Any, *, record: bool = False) -> list[Episode]:
    """Play and grade one episode per entry of `tasks` (len <= sampler.rows), concurrently."""
    if len(tasks) > sampler.rows:
        raise ValueError(f"{len(tasks)} episodes > the sampler's {sampler.rows} rows")
    sampler.start(params, key, record=record)
    batcher = TurnBatcher(sampler, range(len(tasks)))
    kwargs = _episode_kwargs(cfg)
    root = tempfile.mkdtemp(prefix="rlcode_agent_")

    def play(row: int) -> Episode:
        task = tasks[row]
        try:
            traj = harness.run_episode(task, batcher.policy(row), pool, tokenizer, root=root, pass_documents=True,
                                       **kwargs)
        finally:
            batcher.done(row)
        try:
            episode = _grade(task, traj, pool, cfg)
        finally:
            fstree.remove(traj.workdir)
        episode.behavior_logp = np.concatenate(sampler.logprobs[row] or [np.zeros(0, np.float32)])
        return episode

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(tasks), thread_name_prefix="rlcode-episode") as ex:
            futures = [ex.submit(play, row) for row in range(len(tasks))]
            batcher.serve()
            return [f.result() for f in futures]
    finally:
        fstree.remove(root)


# --------------------------------------------------------------------------------------------
# Training sequences
# --------------------------------------------------------------------------------------------


def segment_arrays(segments: Sequence[harness.Segment], documents: bool, pad_id: int, multiple: int = 64,
                   length: int | None = None) -> dict[str, np.ndarray]:
    """Train-step arrays of whole segments (next-token layout, [N, T] with T the longest rounded
    up to `multiple`, or `length`): inputs, targets, positions, mask (the policy's sampled
    tokens), kv_lengths; with `documents`, segment_ids (0 global, j + 1 for the j-th document
    span) and is_global."""
    n = len(segments)
    T = length or -(-max(len(s.ids) - 1 for s in segments) // multiple) * multiple
    out = {"inputs": np.full((n, T), pad_id, np.int32), "targets": np.full((n, T), pad_id, np.int32),
           "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (n, T)).copy(),
           "mask": np.zeros((n, T), bool), "kv_lengths": np.zeros(n, np.int32)}
    if documents:
        out["segment_ids"] = np.zeros((n, T), np.int32)
    for i, s in enumerate(segments):
        ids = np.asarray(s.ids, np.int32)
        L = len(ids) - 1
        out["inputs"][i, :L], out["targets"][i, :L] = ids[:-1], ids[1:]
        out["mask"][i, :L] = np.asarray(s.policy_mask[1:], bool)
        out["kv_lengths"][i] = L
        if documents:
            for j, (a, b) in enumerate(s.documents):
                out["segment_ids"][i, a:min(b, L)] = j + 1
    if documents:
        out["is_global"] = out["segment_ids"] == 0
    return out


@dataclasses.dataclass(frozen=True)
class Demonstrations:
    """Expert episodes as SFT data (the `rlcode.train.sft` demos protocol)."""

    arrays_: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.arrays_["inputs"].shape[0])

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(self.arrays_[k] for k in sorted(self.arrays_))

    def batch(self, ids: np.ndarray) -> dict[str, jax.Array]:
        ids = np.asarray(ids)
        T = int(-(-self.arrays_["kv_lengths"][ids].max() // 64) * 64)
        b = {k: jnp.asarray(v[ids][:, :T] if v.ndim == 2 else v[ids]) for k, v in self.arrays_.items()}
        b["advantages"] = jnp.ones(len(ids), jnp.float32)
        b["old_logp"] = jnp.zeros(b["mask"].shape, jnp.float32)
        return b


def expert_demonstrations(tasks: Sequence[repo_tasks.RepoTask], pool: Any, tokenizer: Tokenizer, cfg: Any,
                          log: Callable[[str], None] = print) -> Demonstrations:
    """Play the scripted expert on `tasks` (concurrently, in the sandbox) and keep the episodes
    that fit the context and pass their held-out tests; cached under sft.cache_dir by content."""
    kwargs = _episode_kwargs(cfg)
    documents = cfg.model.attention.kind == "squid"
    h = hashlib.sha256(json.dumps({"tasks": [t.task_id for t in tasks], "style": cfg.agent.expert_style,
                                   "kwargs": {k: v for k, v in kwargs.items() if k != "registry"},
                                   "tools": sorted(kwargs["registry"]), "documents": documents},
                                  sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = os.path.join(cfg.sft.cache_dir, f"agent_demos_{h}.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return Demonstrations({k: f[k] for k in f.files})
    t0 = time.perf_counter()
    root = tempfile.mkdtemp(prefix="rlcode_demos_")

    def one(task):
        turns = repo_tasks.expert_turns(task, cfg.agent.expert_style)
        policy = harness.ScriptedPolicy(tokenizer, turns)
        kw = dict(kwargs, max_turns=len(turns))
        traj = harness.run_episode(task, policy, pool, tokenizer, root=root, **kw)
        try:
            ok = traj.end_reason == "submitted" and len(traj.segments) == 1 and _grade(task, traj, pool, cfg).success
            return traj.segments[0] if ok else None
        finally:
            fstree.remove(traj.workdir)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as ex:
            segments = list(ex.map(one, tasks))
    finally:
        fstree.remove(root)
    kept = [s for s in segments if s is not None]
    if not kept:
        raise RuntimeError("no expert demonstration succeeded; check the sandbox and agent.max_context_tokens")
    log(f"SFT data: {len(kept)} of {len(tasks)} expert episodes kept ({time.perf_counter() - t0:.0f} s); "
        f"mean {np.mean([len(s.ids) for s in kept]):.0f} tokens, {np.mean([sum(s.policy_mask) for s in kept]):.0f} trained")
    demos = Demonstrations(segment_arrays(kept, documents, tokenizer.pad_id))
    os.makedirs(cfg.sft.cache_dir, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **demos.arrays_)
    os.replace(tmp, path)
    return demos


def training_batch(episodes: Sequence[Episode], cfg: Any, pad_id: int, row_multiple: int = ROW_MULTIPLE,
                   length_multiple: int = 512) -> dict[str, np.ndarray]:
    """GRPO batch: group advantages over the G episodes of each task (invalid ones masked), one
    row per segment with its episode's advantage, and the sampler's log-probs at the sampled
    tokens (``behavior_logp``); padded with empty rows to a multiple of `row_multiple` and in
    time to a multiple of `length_multiple` (few distinct shapes: each one compiles the step)."""
    G = cfg.rollout.group_size
    r = np.array([e.reward for e in episodes], np.float32)
    valid = np.array([e.valid for e in episodes])
    adv = np.asarray(adv_lib.group_advantages(jnp.asarray(np.where(valid, r, 0.0)), G, cfg.advantage.normalize,
                                              valid=jnp.asarray(valid)))
    segs, seg_adv, streams = [], [], []
    for e, a, ok in zip(episodes, adv, valid):
        if ok:
            segs += e.trajectory.segments
            seg_adv += [a] * len(e.trajectory.segments)
            streams.append((len(e.trajectory.segments), e.behavior_logp))
    pad = (-len(segs)) % row_multiple
    empty = harness.Segment(ids=[pad_id, pad_id], policy_mask=[0, 0], turn_index=[0, 0])
    T = -(-max(len(s.ids) - 1 for s in segs + [empty]) // length_multiple) * length_multiple
    batch = segment_arrays(segs + [empty] * pad, cfg.model.attention.kind == "squid", pad_id, length=T)
    batch["advantages"] = np.array(seg_adv + [0.0] * pad, np.float32)
    behavior = np.zeros(batch["mask"].shape, np.float32)
    row = 0
    for count, logp in streams:
        if logp is None:
            raise ValueError(f"episode rows {row}..{row + count}: no behaviour log-probs (play it with play_episodes)")
        sampled = batch["mask"][row:row + count]
        if int(sampled.sum()) != len(logp):
            raise ValueError(f"episode rows {row}..{row + count}: {int(sampled.sum())} sampled tokens but "
                             f"{len(logp)} behaviour log-probs")
        behavior[row:row + count][sampled] = logp
        row += count
    batch["behavior_logp"] = behavior
    return batch


# --------------------------------------------------------------------------------------------
# Evaluation and metrics
# --------------------------------------------------------------------------------------------


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    trajs = [e.trajectory for e in episodes]
    out = {
        f"{prefix}/success": float(np.mean([e.success for e in episodes])),
        f"{prefix}/reward": float(np.mean([e.reward for e in episodes])),
        f"{prefix}/turns": float(np.mean([t.num_turns for t in trajs])),
        f"{prefix}/generated_tokens": float(np.mean([rewards.generated_tokens(t) for t in trajs])),
        f"{prefix}/malformed_calls": float(np.mean([t.num_malformed_calls for t in trajs])),
        f"{prefix}/submitted": float(np.mean([t.submitted for t in trajs])),
        f"{prefix}/summaries": float(np.mean([t.num_summaries for t in trajs])),
        f"{prefix}/invalid": float(np.mean([not e.valid for e in episodes])),
        f"{prefix}/hack_flagged": float(np.mean([e.hacked for e in episodes])),
    }
    for term in rewards.TERMS:
        out[f"{prefix}/reward_{term}"] = float(np.mean([e.terms.get(term, 0.0) for e in episodes]))
    return out


def prefill_metrics(stats: collections.Counter, prefix: str = "prefill") -> dict[str, float]:
    """Prefill tokens of the three samplers on the same turns, and the seconds spent."""
    documents = stats["tokens_new"] - stats["tokens_new_documents"] + stats["tokens_documents_encoded"]
    out = {f"{prefix}/tokens_full": float(stats["tokens_full"]),
           f"{prefix}/tokens_incremental": float(stats["tokens_new"]),
           f"{prefix}/tokens_documents": float(documents),
           f"{prefix}/document_tokens_in_context": float(stats["tokens_new_documents"]),
           f"{prefix}/document_tokens_encoded": float(stats["tokens_documents_encoded"]),
           f"{prefix}/seconds": float(stats["prefill_s"]), "decode/seconds": float(stats["decode_s"])}
    if stats["tokens_new"]:
        out[f"{prefix}/saved_vs_incremental"] = 1.0 - documents / stats["tokens_new"]
        out[f"{prefix}/saved_vs_full"] = 1.0 - documents / stats["tokens_full"]
    return out


def evaluate(tasks: Sequence[repo_tasks.RepoTask], sampler: SessionSampler, params: Any, key: jax.Array, pool: Any,
             tokenizer: Tokenizer, cfg: Any, prefix: str) -> dict[str, float]:
    """`eval.num_samples` episodes per task: success (= pass@1), pass@k, best-of-n, behaviour."""
    n = cfg.eval.num_samples
    flat = [t for t in tasks for _ in range(n)]
    episodes: list[Episode] = []
    for i in range(0, len(flat), sampler.rows):
        episodes += play_episodes(flat[i:i + sampler.rows], sampler, params, jax.random.fold_in(key, i), pool,
                                  tokenizer, cfg)
    correct = np.array([e.success for e in episodes]).reshape(len(tasks), n)
    out = episode_metrics(episodes, prefix)
    out.update({f"{prefix}/{k}": v for k, v in eval_summary(correct, ks=(1, n)).items()})
    for level in sorted({t.difficulty for t in tasks}):
        sel = [i for i, t in enumerate(tasks) if t.difficulty == level]
        out[f"{prefix}/success_L{level}"] = float(correct[sel].mean())
    return out


def build_tasks(cfg: Any) -> dict[str, list[repo_tasks.RepoTask]]:
    t = cfg.task
    levels = list(t.levels)

    def make(split, num, start):
        return [repo_tasks.generate_task(start + i, difficulty=levels[i % len(levels)], split=split)
                for i in range(num)]
    # Train and fresh-eval tasks share the train families with disjoint seeds.
    return {"train": make("train", t.num_train, t.seed), "eval_fresh": make("train", t.num_fresh, t.seed + 10**6),
            "eval": make("eval", t.num_eval, t.seed)}


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


AGENT_SECTIONS = {
    "job": text(("agent",)),
    "task": {"levels": sequence(integer(choices=repo_tasks.LEVELS), min_len=1), "num_train": integer(1),
             "num_demos": integer(0), "num_fresh": integer(0), "num_eval": integer(0), "seed": SEED},
    "agent": {"max_turns": integer(1), "max_context_tokens": integer(1), "max_response_tokens": integer(1),
              "summarize": flag(), "compact_prompt": flag(), "expert_style": text(repo_tasks.EXPERT_STYLES),
              "prefill": text(PREFILL_MODES), "tools": sequence(text(tuple(tools.TOOLS)))},
    "sampling": {"temperature": real(0, low_open=True)},
    "rollout": {"prompts_per_step": integer(1), "group_size": integer(1)},
    "sandbox": {"workers": integer(1, MAX_SANDBOX_WORKERS), "timeout": real(0, low_open=True)},
    # Ranges: `rewards.RewardConfig.from_config`, run by `validate_config`.
    "reward": schema_from_defaults(rewards.reward_config(), {"test_reward": text(rewards.TEST_REWARDS),
                                                             "hack_flags": sequence(text(grading.FLAGS)),
                                                             "hack_mode": text(rewards.HACK_MODES)}),
    "train": {"steps": integer(1), "max_minutes": real(0), "microbatches": integer(1)},
    "eval": {"every": integer(0), "num_samples": integer(1), "at_start": flag(), "at_end": flag(),
             "batch_rows": integer(1)},
    "log": {"text_every": integer(0), "record_every": integer(0)},
}


def validate_config(cfg: Any, num_devices: int | None = None,
                    budget: Sequence[tuple[str, int]] | None = None) -> None:
    """Raise ConfigError naming the field for a config the agent job cannot run; called at start,
    before any task, demonstration or compilation. The same checks as the synthesis job's
    (`rlcode.train.schema`: every field's type and range, unknown fields, the shared sections'
    constraints, the mesh against `num_devices`, the memory estimate against `budget`), with
    the agent's own sections (`AGENT_SECTIONS`) and constraints."""
    check_schema(cfg, AGENT_SECTIONS)
    check_common(cfg, num_devices)
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
        rewards.RewardConfig.from_config(cfg.reward)
    if num_devices is not None:
        sizes = mesh_sizes(cfg.mesh, num_devices)
        shards = sizes["data"] * sizes["fsdp"]
        if (ROW_MULTIPLE // cfg.train.microbatches) % shards:
            raise ConfigError(f"mesh: a micro-batch of {ROW_MULTIPLE} / train.microbatches rows does not divide over "
                              f"the mesh's data x fsdp = {shards} devices")
    memory.check(memory.estimate_agent(cfg, ROW_MULTIPLE), memory.limits(jax.devices()) if budget is None else budget)


def run(cfg: Any, *, pool: Any = None, log: Callable[[str], None] | None = None) -> RunResult:
    """Run the agent job of `cfg` (configs/agent_repo.py); writes tb/, checkpoints/,
    config.json, summary.json and episodes.jsonl (recorded turns for the prefill replay)."""
    t_start = time.perf_counter()
    devices = jax.devices()
    validate_config(cfg, len(devices), memory.limits(devices))
    # The sections the library reads, converted once into their frozen, validated dataclasses.
    objective, sandbox = losses.ObjectiveConfig.from_config(cfg.loss), SandboxConfig.from_config(cfg.sandbox)
    temperature = sampling.SamplingConfig.from_config(cfg.sampling).temperature
    workdir, ckpt_dir = prepare_workdir(cfg, log or (lambda m: print(m, file=sys.stderr, flush=True)))
    own_pool = pool is None
    if own_pool:
        pool = default_pool(sandbox.workers, sandbox.timeout)
    writer = EventWriter(os.path.join(workdir, "tb"))
    ckpt = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=True)
    progress: Progress | None = None
    say = log or (lambda m: progress.write(m) if progress is not None else print(m, file=sys.stderr, flush=True))
    stop = _StopFlag()
    first_eval = last_eval = None
    done = start = 0
    interrupted = False
    try:
        tokenizer = ByteTokenizer()
        tasks = build_tasks(cfg)
        say(f"tasks: {len(tasks['train'])} train, {len(tasks['eval_fresh'])} fresh (held-out seeds of the train "
            f"families), {len(tasks['eval'])} eval (held-out families); levels {tuple(cfg.task.levels)}")

        # ---- SFT warm start from the scripted expert
        sft_params, sft_info = None, {"cached": False, "seconds": 0.0, "history": []}
        if cfg.sft.steps > 0:
            demos = expert_demonstrations(tasks["train"][: cfg.task.num_demos], pool, tokenizer, cfg, log=say)
            bar = Progress(cfg.sft.steps, desc="sft")
            sft_params, sft_info = sft_lib.load_or_train(cfg.model, cfg.sft, demos, cfg.seed,
                                                         on_step=lambda s, m: bar.update(s + 1, nll=m["nll"]), log=say)
            bar.close()
            for rec in sft_info["history"][:: max(1, cfg.sft.log_every)] + sft_info["history"][-1:]:
                writer.scalars(rec["step"] - cfg.sft.steps, {"sft/nll": rec["nll"]})

        model = init_model(cfg.model, cfg.seed)
        if sft_params is not None:
            gd, st = nnx.split(model)
            nnx.replace_by_pure_dict(st, sft_lib.merge_params(nnx.to_pure_dict(st), sft_params))
            model = nnx.merge(gd, st)
        mesh, rules = make_mesh(cfg.mesh), rules_from_config(cfg.mesh)
        optimizer = make_optimizer(cfg.optim)
        graphdef, state = init_train_state(model, optimizer, cfg.seed, mesh, rules)
        ref_params = jax.tree.map(jnp.copy, state.params) if objective.kl_coef > 0 else None
        if cfg.resume:
            restored = ckpt.restore_or_none(target=state)
            if restored is not None:
                state, extra = restored
                start = int(extra["iteration"])
                first_eval = extra.get("first_eval")
                say(f"resumed from {ckpt_dir} at step {start}")
        train_step = make_train_step(graphdef, objective, optimizer, microbatches=cfg.train.microbatches,
                                     temperature=temperature, mesh=mesh, rules=rules,
                                     shardings=state_shardings(state), log_entropy=True)
        logprob_fn = make_logprob_fn(graphdef, temperature)
        P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        rows = max(P * G, cfg.eval.batch_rows)
        sampler = SessionSampler(graphdef, tokenizer, rows=rows, max_context=cfg.agent.max_context_tokens,
                                 max_response=cfg.agent.max_response_tokens, temperature=temperature,
                                 mode=cfg.agent.prefill)
        base_key = jax.random.key(cfg.seed)
        eval_key = jax.random.fold_in(base_key, 2)

        def run_eval(at: int) -> dict[str, float]:
            t0 = time.perf_counter()
            out = {}
            for name in ("eval_fresh", "eval"):
                if tasks[name]:
                    out.update(evaluate(tasks[name], sampler, state.params, eval_key, pool, tokenizer, cfg, name))
            out["time/eval_s"] = time.perf_counter() - t0
            writer.scalars(at, out)
            say(f"eval @ {at}: " + ", ".join(f"{k}={out[k]:.3f}" for k in ("eval_fresh/success", "eval/success")
                                               if k in out) + f" ({out['time/eval_s']:.0f} s)")
            return out

        total = cfg.train.steps
        progress = Progress(total, desc="agent-rl", start=start)
        budget = 60 * cfg.train.max_minutes if cfg.train.max_minutes else None
        rl_seconds = 0.0  # time in RL steps (evaluation excluded), checked against train.max_minutes
        with stop:
            if cfg.eval.at_start and start == 0:
                first_eval = last_eval = run_eval(0)
            done = start
            episodes_path = os.path.join(workdir, "episodes.jsonl")
            repair_json_lines(episodes_path)  # a run killed mid-line left a torn record
            episodes_log = open(episodes_path, "a")
            for step in range(start, total):
                if stop.signal is not None:
                    interrupted = True
                    break
                if budget is not None and rl_seconds > budget:
                    say(f"train.max_minutes={cfg.train.max_minutes} reached after {step - start} steps")
                    break
                t0 = time.perf_counter()
                rng = np.random.default_rng([cfg.seed, step])
                picked = rng.choice(len(tasks["train"]), P, replace=False)
                batch_tasks = [tasks["train"][i] for i in picked for _ in range(G)]
                record = cfg.log.record_every > 0 and step % cfg.log.record_every == 0
                episodes = play_episodes(batch_tasks, sampler, state.params, jax.random.fold_in(base_key, 10 + step),
                                         pool, tokenizer, cfg, record=record)
                t_sample = time.perf_counter() - t0
                if record:
                    episodes_log.write(json.dumps({"step": step, "turns": sampler.record}) + "\n")
                    episodes_log.flush()
                batch = training_batch(episodes, cfg, tokenizer.pad_id)
                batch = {k: jnp.asarray(v) for k, v in batch.items()}
                batch["old_logp"], _ = logprob_fn(state.params, batch)
                if ref_params is not None:
                    batch["ref_logp"], _ = logprob_fn(ref_params, batch)
                state, m = train_step(state, batch)
                m = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"non-finite loss at step {step}: {m}")
                metrics = {f"train/{k}": v for k, v in m.items()}
                metrics.update(episode_metrics(episodes, "rollout"))
                metrics.update(prefill_metrics(sampler.stats))
                rl_seconds += time.perf_counter() - t0
                metrics.update({"time/step_s": time.perf_counter() - t0, "time/sample_s": t_sample,
                                "time/rl_minutes": rl_seconds / 60,
                                "time/train_s": time.perf_counter() - t0 - t_sample,
                                "train/rows": float(batch["inputs"].shape[0]),
                                "train/tokens": float(batch["kv_lengths"].sum())})
                writer.scalars(step + 1, metrics)
                if cfg.log.text_every and step % cfg.log.text_every == 0:
                    e = episodes[0]
                    writer.text(step + 1, "rollout/episode", tokenizer.decode(e.trajectory.ids)[-4000:])
                progress.update(step + 1, reward=metrics["rollout/reward"], success=metrics["rollout/success"],
                                saved=metrics.get("prefill/saved_vs_incremental", 0.0))
                if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < total:
                    last_eval = run_eval(step + 1)
                done = step + 1
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0:
                    ckpt.save(done, state, extra={"iteration": done, "first_eval": first_eval})
            episodes_log.close()
            if cfg.eval.at_end and not interrupted:
                last_eval = run_eval(done)
            ckpt.save(done, state, extra={"iteration": done, "first_eval": first_eval}, force=True)
    finally:
        if progress is not None:
            progress.close()
        ckpt.close()
        writer.close()
        if own_pool:
            pool.close()
    result = RunResult(workdir=workdir, steps_done=done, completed=not interrupted, interrupted=interrupted,
                       sft={k: v for k, v in sft_info.items() if k != "history"}, first_eval=first_eval,
                       last_eval=last_eval, seconds=time.perf_counter() - t_start)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(dataclasses.asdict(result), f, indent=2)
    return result


# --------------------------------------------------------------------------------------------
# Replaying recorded turns: prefill cost of each sampler on the same episodes
# --------------------------------------------------------------------------------------------


def turns_from_segments(rows: Sequence[harness.Segment]) -> list[dict[int, tuple[list[int], list[tuple[int, int]]]]]:
    """The requests a sampler received while generating these segments (one per row, the
    episodes of one batch): call k holds, for every row with a k-th generation, the context
    before it and the document spans inside that context (`SessionSampler.record`'s format)."""
    calls: list[dict] = []
    for row, seg in enumerate(rows):
        starts = [i for i, m in enumerate(seg.policy_mask) if m and (i == 0 or not seg.policy_mask[i - 1])]
        for k, i in enumerate(starts):
            while len(calls) <= k:
                calls.append({})
            calls[k][row] = (list(seg.ids[:i]), [(a, b) for a, b in seg.documents if b <= i])
    return calls


def replay_prefill(graphdef: Any, params: Any, tokenizer: Tokenizer, turns: Sequence[dict], *, mode: str,
                   max_context: int, rows: int) -> collections.Counter:
    """Prefill the recorded turns (`SessionSampler.record`: one {row: (ids, spans)} per
    generate call) in `mode`, without decoding; returns the sampler's counters (tokens, seconds)."""
    sampler = SessionSampler(graphdef, tokenizer, rows=rows, max_context=max_context, max_response=1, mode=mode)
    sampler.start(params, jax.random.key(0))
    for requests in turns:
        sampler.prefill({int(r): (list(ids), [tuple(s) for s in spans]) for r, (ids, spans) in requests.items()})
    return sampler.stats
