"""Packing tokenized documents into fixed-length rows with document masking.

A document of n tokens gives n - 1 next-token predictions: inputs ``d[:-1]``, targets ``d[1:]``.
A document longer than a row is cut into pieces of ``length + 1`` tokens that overlap by one, each
piece a segment of its own. Pieces are laid into rows of `length` either one after another in
order (``fit="greedy"``: a piece that does not fit the rest of a row starts the next row) or
longest first, each into the fullest row it still fits (``fit="best"``, best-fit decreasing: the
short tails of long files fill the gaps, so fewer slots are padding). In every row:

* ``segment_ids`` [N, L]: 1, 2, ... per segment, 0 on padding;
* ``positions`` [N, L]: 0, 1, ... restarting at each segment, so a document sees the same
  positions packed or alone;
* ``mask`` [N, L]: 1 on real predictions, 0 on padding;
* ``target_bytes`` [N, L]: the UTF-8 bytes of each target token (`token_bytes`), so a loss in
  nats converts to bits per byte: ``sum(nll * mask) / ln 2 / sum(target_bytes * mask)``.

`attention_mask` turns a packed batch into the model's `AttentionMask` for dense attention
(tokens attend only within their segment) or squid attention (each segment a document, no global
tokens); either way nothing attends across a file boundary, so packing changes no prediction.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rlcode.tokenizer import Tokenizer


class Packed(NamedTuple):
    inputs: np.ndarray  # [N, L] int32
    targets: np.ndarray  # [N, L] int32
    segment_ids: np.ndarray  # [N, L] int32, 0 = padding
    positions: np.ndarray  # [N, L] int32
    mask: np.ndarray  # [N, L] float32
    target_bytes: np.ndarray  # [N, L] int32


def token_bytes(tokenizer: Tokenizer) -> np.ndarray:
    """[vocab_size] the UTF-8 bytes each id stands for (`Tokenizer.byte_lengths`; 0 for special
    and unused ids, exact for byte-level BPE)."""
    return np.asarray(tokenizer.byte_lengths(), np.int32)


def _greedy(pieces: list[np.ndarray], length: int) -> list[list[np.ndarray]]:
    """In order: a piece that does not fit the rest of the current row starts the next one."""
    rows: list[list[np.ndarray]] = []
    used = length
    for p in pieces:
        if used + len(p) - 1 > length:
            rows.append([])
            used = 0
        rows[-1].append(p)
        used += len(p) - 1
    return rows


def _best_fit(pieces: list[np.ndarray], length: int) -> list[list[np.ndarray]]:
    """Best-fit decreasing: longest piece first (ties in order), into the row with the least room
    that still holds it, else a new row."""
    rows: list[list[np.ndarray]] = []
    room: list[tuple[int, int]] = []  # sorted (free slots, row) of rows with free slots
    for i in sorted(range(len(pieces)), key=lambda i: -len(pieces[i])):
        n = len(pieces[i]) - 1
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, r = room.pop(at)
        else:
            free, r = length, len(rows)
            rows.append([])
        rows[r].append(pieces[i])
        if free - n > 0:
            bisect.insort(room, (free - n, r))
    return rows


def pack(documents: Sequence[Sequence[int]], length: int, token_bytes: np.ndarray, *, pad_id: int = 0,
         fit: str = "greedy") -> Packed:
    """Pack `documents` (token id lists; each with at least 2 tokens is used, shorter ones
    predict nothing and are skipped) into rows of `length`, placing pieces by `fit` ("greedy"
    or "best"; module docstring)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if fit not in ("greedy", "best"):
        raise ValueError(f"fit must be 'greedy' or 'best', got {fit!r}")
    pieces: list[np.ndarray] = []
    for doc in documents:
        d = np.asarray(doc, np.int32)
        for start in range(0, max(len(d) - 1, 0), length):
            pieces.append(d[start:start + length + 1])
    rows = _best_fit(pieces, length) if fit == "best" else _greedy(pieces, length)
    shape = (len(rows), length)
    out = Packed(np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32),
                 np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.zeros(shape, np.int32))
    for r, row in enumerate(rows):
        at = 0
        for s, p in enumerate(row, start=1):
            n = len(p) - 1
            out.inputs[r, at:at + n] = p[:-1]
            out.targets[r, at:at + n] = p[1:]
            out.segment_ids[r, at:at + n] = s
            out.positions[r, at:at + n] = np.arange(n)
            out.mask[r, at:at + n] = 1.0
            out.target_bytes[r, at:at + n] = token_bytes[p[1:]]
            at += n
    return out


def attention_mask(packed: Packed, kind: str):
    """The model's `AttentionMask` for a packed batch under attention `kind` (dense or squid)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from rlcode.models.attention import AttentionMask  # noqa: PLC0415

    seg = jnp.asarray(packed.segment_ids)
    if kind == "dense":
        return AttentionMask(segment_ids=seg)
    if kind == "squid":  # documents 0, 1, ...; -1 padding; no global token
        return AttentionMask(segment_ids=seg - 1, is_global=jnp.zeros(seg.shape, bool))
    raise ValueError(f"packed sequences need attention.kind 'dense' or 'squid', got {kind!r}")
