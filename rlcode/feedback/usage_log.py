"""The usage log: what a served policy answered and what its users did next, append-only.

A deployed coding assistant produces two kinds of records, written by different processes at
different times:

* an *interaction*: the served checkpoint's version, the request (its text and the token ids the
  policy saw), the completion (text, token ids and the behaviour log-probs of each token under the
  served policy) and when it was served;
* *outcome events* about an interaction, arriving later and in any order: ``accepted`` (the user
  took the edit), ``kept`` (the edit was still there `keep_after` minutes later), ``reverted``,
  ``followup`` (a dissatisfied follow-up request), ``latency`` (seconds until the answer was shown;
  `value`).

## Format (one record per line)

    <crc32 of the JSON text, 8 hex digits> TAB <JSON object> LF
    h<HMAC-SHA256 of the JSON text under a shared key, 64 hex digits> TAB <JSON object> LF

The second form is an *authenticated* record: with a key, writers sign every record and the reader
accepts only records signed with that key, so whoever can append to the log but does not hold the
key (a client inventing "accepted" events, a program that found the file) cannot forge a reward;
complete records that are unsigned or wrongly signed are counted as ``unauthenticated`` and
skipped (a torn line still counts as torn).

Every record has ``type`` ("interaction" or "outcome"), a unique ``id`` and ``logged_at`` (when it
was appended, seconds; the writer's clock). An interaction has ``version``, ``time``, ``user``,
``request``, ``prompt_ids``, ``completion``, ``completion_ids`` and ``logprobs`` (as many as
completion ids); an outcome has ``interaction`` (an interaction's id), ``kind`` (`OUTCOME_KINDS`),
``time`` (when it happened) and ``value`` (a number; the latency's seconds, else 1).

## Robustness

Writers (`LogWriter`) append under an exclusive ``flock`` with one ``write`` per record; a
writer that finds the file not ending in a newline (another writer died mid-record) first ends
that torn record with one. The reader (`LogReader`) only consumes complete lines and skips any
line whose checksum, JSON or fields are wrong (counted as ``torn``: a torn record never reaches
training, and never takes a neighbouring record with it); a record whose id it has seen is a
``duplicate`` (at-least-once delivery re-sends) and is skipped. `UsageWindows` joins outcomes to
interactions in either order (an outcome may be logged before its interaction), decides when an
interaction is *settled* (the log's watermark, the latest ``logged_at`` seen, has passed the
interaction's time plus `settle_s`: later outcomes cannot change its reward any more) and hands
settled interactions to the trainer oldest first; an outcome that arrives after its interaction
was handed out is counted as ``late`` and dropped, never applied to a later batch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import hmac
import json
import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["OUTCOME_KINDS", "Interaction", "Outcome", "LogWriter", "LogReader", "UsageWindows", "encode_record",
           "decode_record", "outcome_reward", "read_log"]

OUTCOME_KINDS = ("accepted", "kept", "reverted", "followup", "latency")
_INTERACTION_FIELDS = {"version": int, "time": (int, float), "user": str, "request": str, "prompt_ids": list,
                       "completion": str, "completion_ids": list, "logprobs": list}
_OUTCOME_FIELDS = {"interaction": str, "kind": str, "time": (int, float), "value": (int, float)}


class LogFormatError(ValueError):
    """A line of the usage log that is not a complete, valid record."""


@dataclasses.dataclass(frozen=True)
class Interaction:
    """One served request. `logprobs[i]` is the served policy's log-probability of
    `completion_ids[i]` (under the sampling settings it was served with)."""

    id: str
    version: int
    time: float
    user: str
    request: str
    prompt_ids: tuple[int, ...]
    completion: str
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    logged_at: float = 0.0

    def record(self) -> dict:
        return {"type": "interaction", "id": self.id, "logged_at": self.logged_at, "version": self.version,
                "time": self.time, "user": self.user, "request": self.request, "prompt_ids": list(self.prompt_ids),
                "completion": self.completion, "completion_ids": list(self.completion_ids),
                "logprobs": list(self.logprobs)}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One event about interaction `interaction`."""

    id: str
    interaction: str
    kind: str
    time: float
    value: float = 1.0
    logged_at: float = 0.0

    def record(self) -> dict:
        return {"type": "outcome", "id": self.id, "logged_at": self.logged_at, "interaction": self.interaction,
                "kind": self.kind, "time": self.time, "value": self.value}


# ------------------------------------------------------------------------------ lines


def _signature(key: bytes, text: bytes) -> bytes:
    return b"h" + hmac.new(key, text, hashlib.sha256).hexdigest().encode()


def encode_record(record: Mapping[str, Any], key: bytes | None = None) -> bytes:
    """One log line (checksum or signature, tab, JSON, newline) for a record dict; signed with
    HMAC-SHA256 under `key` when one is given."""
    text = json.dumps(record, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    head = _signature(key, text) if key else f"{zlib.crc32(text):08x}".encode()
    return head + b"\t" + text + b"\n"


class UnauthenticatedRecord(LogFormatError):
    """A line that is not signed with the reader's key."""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def decode_record(line: bytes, key: bytes | None = None) -> Interaction | Outcome:
    """The record of one complete line (without its newline); LogFormatError when the line is
    torn, corrupted or not a valid record; with a `key`, UnauthenticatedRecord when the line is
    not signed with it."""
    head, sep, text = line.partition(b"\t")
    if not sep or len(head) not in (8, 65):
        raise LogFormatError("no checksum field")
    if key and len(head) == 8:
        raise UnauthenticatedRecord("an unsigned record")
    try:
        if not key and int(head, 16) != zlib.crc32(text):
            raise LogFormatError("checksum mismatch")
        rec = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise LogFormatError(f"not a record: {e}") from None  # torn, or a corrupted checksum or JSON
    if key and not hmac.compare_digest(head, _signature(key, text)):
        raise UnauthenticatedRecord("not signed with the log's key")
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not _finite(rec.get("logged_at")):
        raise LogFormatError("a record needs a string id and a finite logged_at")
    kind = rec.get("type")
    fields = {"interaction": _INTERACTION_FIELDS, "outcome": _OUTCOME_FIELDS}.get(kind)
    if fields is None:
        raise LogFormatError(f"unknown record type {kind!r}")
    for name, typ in fields.items():
        value = rec.get(name)
        if not isinstance(value, typ) or isinstance(value, bool) or (typ == (int, float) and not _finite(value)):
            raise LogFormatError(f"{kind} record {rec['id']!r}: field {name!r} missing or invalid")
    if kind == "outcome":
        if rec["kind"] not in OUTCOME_KINDS:
            raise LogFormatError(f"outcome {rec['id']!r}: kind {rec['kind']!r} is not one of {OUTCOME_KINDS}")
        return Outcome(rec["id"], rec["interaction"], rec["kind"], float(rec["time"]), float(rec["value"]),
                       float(rec["logged_at"]))
    ids, logprobs, prompt = rec["completion_ids"], rec["logprobs"], rec["prompt_ids"]
    if (len(ids) != len(logprobs) or not all(isinstance(t, int) and t >= 0 for t in ids + prompt)
            or not all(_finite(x) and x <= 0 for x in logprobs)):
        raise LogFormatError(f"interaction {rec['id']!r}: token ids must be non-negative integers and the "
                             "log-probs as many finite numbers <= 0 as completion ids")
    return Interaction(rec["id"], rec["version"], float(rec["time"]), rec["user"], rec["request"], tuple(prompt),
                       rec["completion"], tuple(ids), tuple(float(x) for x in logprobs), float(rec["logged_at"]))


# ------------------------------------------------------------------------------ writer and reader


class LogWriter:
    """Appends records to the log at `path` (created if missing), signed when given a `key`. Safe
    with other writers in other processes: each record is one ``write`` under an exclusive
    ``flock`` of the file."""

    def __init__(self, path: str | os.PathLike, key: bytes | None = None):
        self.path = os.fspath(path)
        self.key = key
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: Interaction | Outcome | Mapping[str, Any]) -> None:
        self.write_raw(encode_record(record.record() if hasattr(record, "record") else record, self.key))

    def write_raw(self, data: bytes) -> None:
        """Append bytes as they are (a test or a simulation may write a torn record with it)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # end a record a dead writer left torn
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LogReader:
    """Reads the records appended to `path` since the last `poll`, from byte `offset` on; with a
    `key`, only records signed with it.

    Counters: ``records`` (valid, new), ``torn`` (lines that are not valid records: skipped),
    ``unauthenticated`` (not signed with the key: skipped), ``duplicates`` (a record id seen
    before: skipped)."""

    def __init__(self, path: str | os.PathLike, offset: int = 0, key: bytes | None = None):
        self.path = os.fspath(path)
        self.offset = offset
        self.key = key
        self.seen: set[str] = set()
        self.counts = {"records": 0, "torn": 0, "unauthenticated": 0, "duplicates": 0}

    def poll(self) -> list[Interaction | Outcome]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []  # nothing complete yet (a writer may be mid-record)
        self.offset += end + 1
        out = []
        for line in data[:end].split(b"\n"):
            try:
                rec = decode_record(line, self.key)
            except UnauthenticatedRecord:
                self.counts["unauthenticated"] += 1
                continue
            except LogFormatError:
                self.counts["torn"] += 1
                continue
            if rec.id in self.seen:
                self.counts["duplicates"] += 1
                continue
            self.seen.add(rec.id)
            self.counts["records"] += 1
            out.append(rec)
        return out


# ------------------------------------------------------------------------------ rewards and windows


def outcome_reward(outcomes: Iterable[Outcome], weights: Mapping[str, float]) -> float:
    """The reward of one interaction from its outcome events: each kind present counts once, with
    weight ``weights[kind]``; the latency counts its value (seconds) times ``weights["latency"]``."""
    total, seen = 0.0, set()
    for o in outcomes:
        if o.kind in seen:
            continue
        seen.add(o.kind)
        total += weights.get(o.kind, 0.0) * (o.value if o.kind == "latency" else 1.0)
    return total


class UsageWindows:
    """Joins outcomes to interactions and hands out settled interactions (module docstring).

    settle_s: an interaction is settled once the watermark (the latest ``logged_at`` read) is at
    least its time + settle_s. orphan_s: an outcome whose interaction has not been read once the
    watermark is `orphan_s` past the outcome's time is dropped (counted as ``orphans``).

    Counters: ``interactions`` read, ``outcomes`` joined, ``late`` (an outcome of an interaction
    already handed out), ``orphans``, ``handed`` (interactions handed out)."""

    def __init__(self, settle_s: float, orphan_s: float | None = None):
        if not settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.settle_s = float(settle_s)
        self.orphan_s = float(orphan_s) if orphan_s is not None else 2 * self.settle_s
        self.pending: dict[str, Interaction] = {}
        self.outcomes: dict[str, list[Outcome]] = {}
        self.handed: set[str] = set()
        self.watermark = -math.inf
        self.counts = {"interactions": 0, "outcomes": 0, "late": 0, "orphans": 0, "handed": 0}

    def add(self, records: Sequence[Interaction | Outcome]) -> None:
        for rec in records:
            self.watermark = max(self.watermark, rec.logged_at)
            if isinstance(rec, Interaction):
                if rec.id in self.handed or rec.id in self.pending:
                    continue  # the same interaction under a second record id
                self.pending[rec.id] = rec
                self.counts["interactions"] += 1
            elif rec.interaction in self.handed:
                self.counts["late"] += 1
            else:
                self.outcomes.setdefault(rec.interaction, []).append(rec)
                self.counts["outcomes"] += 1
        for iid in [i for i, evs in self.outcomes.items() if i not in self.pending
                    and self.watermark >= max(o.time for o in evs) + self.orphan_s]:
            self.counts["orphans"] += len(self.outcomes.pop(iid))

    def settled(self) -> int:
        """How many interactions are settled now."""
        return sum(1 for it in self.pending.values() if self.watermark >= it.time + self.settle_s)

    def take(self, max_rows: int) -> list[tuple[Interaction, list[Outcome]]]:
        """Up to `max_rows` settled interactions, oldest first, each with its outcomes; they leave
        the pending set for good."""
        ready = sorted((it for it in self.pending.values() if self.watermark >= it.time + self.settle_s),
                       key=lambda it: (it.time, it.id))[:max_rows]
        out = []
        for it in ready:
            del self.pending[it.id]
            self.handed.add(it.id)
            out.append((it, self.outcomes.pop(it.id, [])))
        self.counts["handed"] += len(out)
        return out


def read_log(path: str | os.PathLike, settle_s: float = 0.0,
             key: bytes | None = None) -> tuple[list[tuple[Interaction, list[Outcome]]], dict]:
    """A whole log read at once, as an analyst reads it: the interactions that settled before its
    end (`settle_s` before its last record: later ones may still miss outcomes, e.g. a keep check
    that never came), each with all its outcomes, and the counters of the read (the reader's,
    interactions and outcomes joined, ``unsettled_at_end``)."""
    reader = LogReader(path, key=key)
    windows = UsageWindows(settle_s=settle_s, orphan_s=math.inf)
    windows.add(reader.poll())
    rows = windows.take(len(windows.pending))
    unsettled = len(windows.pending)
    return rows, {**reader.counts, **{k: windows.counts[k] for k in ("interactions", "outcomes")},
                  "unsettled_at_end": unsettled}
