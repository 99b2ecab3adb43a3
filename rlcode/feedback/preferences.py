"""Pairwise preference data: which of two completions of a prompt a person preferred.

The format is JSON lines, one pair per line::

    {"prompt": "...", "chosen": "...", "rejected": "...",
     "tie": false, "weight": 1.0, "margin": 0.0, "id": "q17/a-b", "source": "user:42"}

* ``prompt``, ``chosen``, ``rejected``: strings (required). The reward model scores the prompt
  followed by each completion.
* ``tie`` (default false): the labeller judged the two equally good; which is ``chosen`` carries
  no information then.
* ``weight`` (default 1, > 0): the pair's weight in the loss (e.g. a labeller's reliability).
* ``margin`` (default 0, >= 0): how much better ``chosen`` must score (the loss is
  -log sigmoid(r_chosen - r_rejected - margin)); ignored for ties.
* ``id``, ``source`` (optional strings): provenance, carried through untouched.

Unknown fields are refused (a typo such as ``"rejcted"`` would otherwise drop the pair's label).
A last line cut short by a writer killed mid-line is skipped with a warning; any other malformed
line raises a ValueError naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence

from rlcode.train.metrics import numbered_json_lines

__all__ = ["PreferencePair", "read_preferences", "write_preferences", "split_by_prompt", "FIELDS"]

FIELDS = ("prompt", "chosen", "rejected", "tie", "weight", "margin", "id", "source")
_REQUIRED = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One labelled comparison (see the module docstring for the fields' meaning)."""

    prompt: str
    chosen: str
    rejected: str
    tie: bool = False
    weight: float = 1.0
    margin: float = 0.0
    id: str | None = None
    source: str | None = None

    def __post_init__(self):
        for name in _REQUIRED:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.tie, bool):
            raise ValueError(f"tie must be true or false, got {self.tie!r}")
        for name, low_ok in (("weight", False), ("margin", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and not low_ok):
                raise ValueError(f"{name} must be {'>= 0' if low_ok else '> 0'}, got {value!r}")
        for name in ("id", "source"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or absent, got {value!r}")

    def to_json(self) -> dict:
        """The record as written: defaults and absent provenance left out."""
        record = {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected}
        for f in dataclasses.fields(self)[3:]:
            value = getattr(self, f.name)
            if value != f.default:
                record[f.name] = value
        return record


def read_preferences(path: str | os.PathLike) -> list[PreferencePair]:
    """The pairs of a preference file (format in the module docstring), in file order."""
    path = os.fspath(path)
    pairs = []
    for number, record in numbered_json_lines(path):
        unknown = sorted(set(record) - set(FIELDS))
        missing = [f for f in _REQUIRED if f not in record]
        if unknown or missing:
            raise ValueError(f"{path}:{number}: " + "; ".join(
                ([f"unknown field(s) {unknown} (valid: {list(FIELDS)})"] if unknown else [])
                + ([f"missing field(s) {missing}"] if missing else [])))
        try:
            pairs.append(PreferencePair(**{k: float(v) if k in ("weight", "margin") and isinstance(v, int)
                                           and not isinstance(v, bool) else v for k, v in record.items()}))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from None
    return pairs


def write_preferences(path: str | os.PathLike, pairs: Iterable[PreferencePair]) -> int:
    """Write `pairs` to `path` (replaced atomically: a reader never sees half a file); returns
    the number written."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair.to_json(), ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def split_by_prompt(pairs: Sequence[PreferencePair], heldout_fraction: float,
                    salt: str = "") -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out): each prompt goes wholly to one side, chosen by a hash of the prompt (and
    `salt`), so no held-out prompt's completions are seen in training and the split does not
    depend on the order or number of pairs."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    train, heldout = [], []
    for pair in pairs:
        digest = hashlib.sha256((salt + "\0" + pair.prompt).encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2.0**64
        (heldout if u < heldout_fraction else train).append(pair)
    return train, heldout
