"""Sampling many multi-turn sessions at once, each with a persistent KV cache.

The agent job generates the next turn of every live episode in one batch: `SessionSampler`
keeps one cache row per episode and extends it by what is new since the row's previous turn,
then samples one response per row (`rlcode.sampling.extend_session` / `sample_session`).

**Documents** (squid attention, docs/reference.md §8): the full observation of a successful
``read_file`` call is a document; in the training forward its tokens attend only within itself.
In ``documents`` mode the sampler therefore encodes each distinct document once per batch of
episodes (`rlcode.sampling.encode_documents`) and writes its keys, rotated to where the episode
placed it, into that episode's cache, across the episodes of a group and across turns.

**Prefill accounting** (`SessionSampler.stats`, reported by `prefill_metrics`): ``full`` = the
tokens a sampler that re-reads the whole context every turn prefills; ``incremental`` = the new
tokens of each turn (a dense per-episode KV cache); ``documents`` = new non-document tokens plus
each distinct document once. `replay_prefill` times recorded turns in each mode
(``python -m experiments.agent_report --runs=...``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlcode import sampling
from rlcode.envs import harness
from rlcode.tokenizer import Tokenizer

PREFILL_MODES = ("documents", "incremental", "full")


def _bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """Shapes for jit: powers of two up to `step`, then multiples of `step`."""
    n = max(int(n), 1)
    if n <= step:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // step) * step


def _span(n: int, minimum: int = 256) -> int:
    """Cache slots a call reads for contexts of up to n tokens: a power of two, so a whole
    episode compiles few shapes while attention costs at most twice what the contexts hold."""
    return max(minimum, 1 << (max(int(n), 1) - 1).bit_length())


class SessionSampler:
    """Generates the next turn of many episodes at once, each with a persistent KV cache.

    `generate({row: (context ids, document spans)})` extends each row's cache by the tokens that
    are new since its previous call (a context that does not start with the cached one, e.g. a
    fresh segment after a summary, starts over), then samples one response per row.

    mode: ``documents`` – document spans (squid models) are not prefilled but copied from a
    per-batch cache of encoded documents (keys rotated to their place); ``incremental`` – the
    new tokens are prefilled, documents included; ``full`` – every turn prefills the whole
    context (the cache is only used within a turn). All three give the same distribution on a
    dense model; on a squid model only ``documents`` matches the training forward. On a model
    without squid attention documents are not separable, so ``documents`` runs as
    ``incremental`` (`active_mode`, set by `start`; `mode` keeps what was asked for).

    bounded: every prefill and decode call reads only the first `_span` slots of the cache (a
    power of two >= the longest context of the call), so attention costs what the contexts hold;
    False reads the whole ``max_context + 512`` slots (same results, for comparison).
    """

    def __init__(self, graphdef: Any, tokenizer: Tokenizer, *, rows: int, max_context: int, max_response: int,
                 temperature: float = 1.0, mode: str = "documents", bounded: bool = True):
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {mode!r}")
        self.graphdef, self.tok, self.rows, self.mode = graphdef, tokenizer, rows, mode
        self.bounded = bounded  # read the cache slots the contexts hold (`_span`); False: every slot
        self.max_context = max_context
        self.capacity = max_context + 512  # bucketed writes run at most 511 slots past a context
        self.cfg = sampling.SamplingConfig(max_new_tokens=max_response, temperature=temperature,
                                           stop_ids=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id)
        self.cache: sampling.SessionCache | None = None
        # The batch of episodes in progress (`start` resets all of it).
        self.active_mode = mode
        self.params: Any = None
        self.model: Any = None
        self.key: jax.Array | None = None
        self.calls = 0
        self.lengths = np.zeros(rows + 1, np.int32)
        self.cached: list[list[int]] = [[] for _ in range(rows)]
        self.documents: dict[tuple[int, ...], sampling.DocKV] = {}
        self.stats: collections.Counter = collections.Counter()
        self.record: list[dict[int, tuple[list[int], list[tuple[int, int]]]]] | None = None
        self.logprobs: list[list[np.ndarray]] = [[] for _ in range(rows)]

    def start(self, params: Any, key: jax.Array, record: bool = False) -> None:
        """Begin a batch of episodes with `params`: empty contexts, no cached documents."""
        self.params, self.key, self.calls = params, key, 0
        self.model = nnx.merge(self.graphdef, params)
        squid = self.model.cfg.attention["kind"] == "squid"
        self.active_mode = "incremental" if self.mode == "documents" and not squid else self.mode
        if self.cache is None:
            self.cache = sampling.init_session_cache(self.model, self.rows, self.capacity)
        self.lengths = np.zeros(self.rows + 1, np.int32)
        self.cached = [[] for _ in range(self.rows)]
        self.documents = {}
        self.stats = collections.Counter()
        self.record = [] if record else None
        self.logprobs = [[] for _ in range(self.rows)]

    def _read_span(self, lengths: np.ndarray) -> int | None:
        return _span(lengths.max()) if self.bounded else None

    # ---- prefill
    def _plan(self, row: int, ids: list[int], spans: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Pieces of the new tokens: global, document, global, ..., global (odd = documents)."""
        prev = self.cached[row]
        keep = len(prev) if self.active_mode != "full" and len(prev) <= len(ids) and ids[: len(prev)] == prev else 0
        self.lengths[row] = keep
        pieces, cursor = [], keep
        if self.active_mode == "documents":
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
        self.cache, hidden = sampling.extend_session(self.graphdef, self.params, self.cache, rows, tokens, lengths, num,
                                                     span=self._read_span(lengths))
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
                                              stacked([kv.v for kv in docs]), doc_start, rope=self.model.cfg.rope)
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
        if self.active_mode == "documents":
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
        out = sampling.sample_session(self.graphdef, self.params, self.cache, rows, lengths, hidden, key, cfg=self.cfg,
                                      span=self._read_span(lengths))
        tokens, n, logp = np.asarray(out.tokens), np.asarray(out.lengths), np.asarray(out.logprobs)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["tokens_generated"] += int(n[: len(order)].sum())
        for i, r in enumerate(order):
            self.logprobs[r].append(logp[i, : n[i]])
        return {r: tokens[i, : n[i]].tolist() for i, r in enumerate(order)}


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
                   max_context: int, rows: int, bounded: bool = True) -> collections.Counter:
    """Prefill the recorded turns (`SessionSampler.record`: one {row: (ids, spans)} per
    generate call) in `mode`, without decoding; returns the sampler's counters (tokens, seconds)."""
    sampler = SessionSampler(graphdef, tokenizer, rows=rows, max_context=max_context, max_response=1, mode=mode,
                             bounded=bounded)
    sampler.start(params, jax.random.key(0))
    for requests in turns:
        sampler.prefill({int(r): (list(ids), [tuple(s) for s in spans]) for r, (ids, spans) in requests.items()})
    return sampler.stats
