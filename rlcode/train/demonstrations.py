"""The agent job's training data: expert demonstrations for the warm start, and the RL batch.

`expert_demonstrations` plays the scripted expert (`repo_tasks.expert_turns`) on training tasks
in the sandbox and keeps the episodes that fit the context and pass their held-out checks: the
token sequences, with only the expert's own tokens in the loss (tool output, prompts and
templates masked), are the SFT data. `training_batch` turns played episodes into a GRPO batch:
group advantages over the G episodes of a task, one row per segment of an episode (a summary
starts a new segment) carrying its episode's advantage, with only the sampled tokens in the loss.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlcode import advantages as adv_lib
from rlcode.envs import harness
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.sandbox import fstree
from rlcode.tokenizer import Tokenizer
from rlcode.train.episodes import Episode, episode_kwargs, grade_episode
from rlcode.train.step import with_score_index

ROW_MULTIPLE = 8  # training batches are padded to a multiple of this many rows (few shapes to compile)


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
        return with_score_index(b)


def expert_demonstrations(tasks: Sequence[repo_tasks.RepoTask], pool: Any, tokenizer: Tokenizer, cfg: Any,
                          log: Callable[[str], None] = print) -> Demonstrations:
    """Play the scripted expert on `tasks` (concurrently, in the sandbox) and keep the episodes
    that fit the context and pass their held-out tests; cached under sft.cache_dir by content
    (the tasks, the episode settings and the tokenizer's fingerprint)."""
    kwargs = episode_kwargs(cfg)
    documents = cfg.model.attention.kind == "squid"
    # The tool limits enter the key only through edit_hints, and only when off (the key of a
    # cache written before the hints existed is the key with hints on).
    hints = {} if kwargs["limits"].edit_hints else {"edit_hints": False}
    h = hashlib.sha256(json.dumps({"tasks": [t.task_id for t in tasks], "style": cfg.agent.expert_style,
                                   "kwargs": {k: v for k, v in kwargs.items() if k not in ("registry", "limits")},
                                   "tools": sorted(kwargs["registry"]), "documents": documents,
                                   "tokenizer": tokenizer.fingerprint(), **hints},
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
            ok = traj.end_reason == "submitted" and len(traj.segments) == 1 and grade_episode(task, traj, pool, cfg).success
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
    return with_score_index(batch)
