"""Simulated users: preferences from a hidden ground truth, with label noise and a bias.

A `SimulatedUser` compares two completions a and b of a prompt whose hidden gold scores g (e.g.
the fraction of a synthesis task's held-out tests a completion passes) and surface features f
(e.g. the number of comment lines) are known to the experiment, not to the reward model:

    P(a chosen over b) = sigmoid(beta * (g_a - g_b) + bias * (f_a - f_b)),

then, with probability `flip`, the label is reversed (a careless click). When |g_a - g_b| <=
`tie_band` and the features are equal the user reports a tie. With `bias` != 0 the labels
systematically favour the feature, so a reward model fitted to them has a real gap to the gold
objective, which the experiments measure.

`candidates(task, rng)` makes completions of a synthesis task to compare: its reference body,
mutants of it (an operator, constant, literal or method swapped; a statement dropped), each
possibly made verbose with comment lines that change nothing it does.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence
from typing import Any

from rlcode.feedback.preferences import PreferencePair

__all__ = ["SimulatedUser", "features", "FEATURES", "mutate", "make_verbose", "candidates", "label_pairs"]

FEATURES = ("comment_lines", "lines", "chars")


def features(text: str) -> dict[str, float]:
    """Surface features a biased user may prefer: comment lines, non-empty lines, characters."""
    lines = [line for line in text.splitlines() if line.strip()]
    return {"comment_lines": float(sum(line.strip().startswith("#") for line in lines)),
            "lines": float(len(lines)), "chars": float(len(text))}


@dataclasses.dataclass(frozen=True)
class SimulatedUser:
    """beta: how sharply gold differences decide (large: nearly always the better one); bias: the
    preference per unit of `feature` (one of FEATURES); flip: probability a label is reversed;
    tie_band: gold differences up to this, with equal features, are reported as ties."""

    beta: float = 20.0
    bias: float = 0.0
    feature: str = "comment_lines"
    flip: float = 0.0
    tie_band: float = 0.0

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"feature={self.feature!r} is not one of {FEATURES}")
        if not 0.0 <= self.flip <= 0.5:
            raise ValueError(f"flip must be in [0, 0.5] (above 0.5 the labels are inverted), got {self.flip}")
        if self.beta < 0 or self.tie_band < 0:
            raise ValueError(f"beta and tie_band must be >= 0, got {self.beta}, {self.tie_band}")

    def prob_first(self, gold_a: float, gold_b: float, text_a: str, text_b: str) -> float:
        """P(a is chosen over b) before label noise."""
        x = self.beta * (gold_a - gold_b) + self.bias * (features(text_a)[self.feature] - features(text_b)[self.feature])
        return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0

    def is_tie(self, gold_a: float, gold_b: float, text_a: str, text_b: str) -> bool:
        return (self.tie_band > 0 and abs(gold_a - gold_b) <= self.tie_band
                and features(text_a)[self.feature] == features(text_b)[self.feature])

    def label(self, prompt: str, a: str, b: str, gold_a: float, gold_b: float, rng: random.Random,
              pair_id: str | None = None) -> PreferencePair:
        """One labelled pair for completions a and b of `prompt`."""
        source = f"simulated(beta={self.beta},bias={self.bias}:{self.feature},flip={self.flip})"
        if self.is_tie(gold_a, gold_b, a, b):
            return PreferencePair(prompt, a, b, tie=True, id=pair_id, source=source)
        first = rng.random() < self.prob_first(gold_a, gold_b, a, b)
        if rng.random() < self.flip:
            first = not first
        chosen, rejected = (a, b) if first else (b, a)
        return PreferencePair(prompt, chosen, rejected, id=pair_id, source=source)


def label_pairs(user: SimulatedUser, prompt: str, texts: Sequence[str], gold: Sequence[float], rng: random.Random,
                max_pairs: int | None = None, prefix: str = "") -> list[PreferencePair]:
    """Labelled pairs among the distinct completions `texts` of one prompt (all pairs, or a random
    `max_pairs` of them)."""
    seen: dict[str, float] = {}
    for text, g in zip(texts, gold):
        seen.setdefault(text, g)
    items = list(seen.items())
    index = [(i, j) for i in range(len(items)) for j in range(i + 1, len(items))]
    if max_pairs is not None and len(index) > max_pairs:
        index = rng.sample(index, max_pairs)
    out = []
    for i, j in index:
        (a, ga), (b, gb) = items[i], items[j]
        if rng.random() < 0.5:  # the order shown is random
            (a, ga), (b, gb), i, j = (b, gb), (a, ga), j, i
        out.append(user.label(prompt, a, b, ga, gb, rng, pair_id=f"{prefix}{i}-{j}"))
    return out


# --------------------------------------------------------------------------------------------
# Candidate completions of the synthesis tasks
# --------------------------------------------------------------------------------------------

_SWAPS = [("+", "-"), ("-", "+"), ("*", "+"), ("<=", "<"), ("<", "<="), (">=", ">"), (">", ">="), ("==", "!="),
          ("!=", "=="), ("%", "//"), ("//", "%"), ("min(", "max("), ("max(", "min("), (".upper()", ".lower()"),
          (".lower()", ".upper()"), (" and ", " or "), (" or ", " and "), ("reversed(", "sorted(")]
_INT = re.compile(r"(?<![\w.'\"])(\d+)(?![\w.])")
_STR = re.compile(r"'([^'\\]+)'")
_COMMENTS = ("# work on a copy of the input", "# compute the intermediate value", "# keep only what is needed",
             "# this step follows the examples", "# transform each element in turn", "# the result is returned below")


def mutate(body: str, rng: random.Random) -> str | None:
    """`body` with one random edit (operator / method swap, integer +-1, a string literal's first
    character changed, or a non-return statement dropped); None when no edit applies."""
    lines = body.splitlines()
    edits = []
    for n, line in enumerate(lines):
        for old, new in _SWAPS:
            start = line.find(old)
            while start >= 0:
                edits.append((n, start, len(old), new))
                start = line.find(old, start + 1)
        for m in _INT.finditer(line):
            edits.append((n, m.start(1), len(m.group(1)), str(int(m.group(1)) + rng.choice((-1, 1)))))
        for m in _STR.finditer(line):
            first = m.group(1)[0]
            edits.append((n, m.start(1), 1, "z" if first != "z" else "a"))
        if len(lines) > 1 and not line.strip().startswith("return"):
            edits.append((n, None, None, None))
    if not edits:
        return None
    n, start, size, new = rng.choice(edits)
    if start is None:
        out = lines[:n] + lines[n + 1:]
    else:
        out = lines[:n] + [lines[n][:start] + new + lines[n][start + size:]] + lines[n + 1:]
    text = "\n".join(out) + ("\n" if body.endswith("\n") else "")
    return text if text != body else None


def make_verbose(body: str, rng: random.Random, comments: int = 2) -> str:
    """`body` with `comments` comment lines inserted before statements (same indentation); what
    it computes is unchanged."""
    lines = body.splitlines()
    for _ in range(comments):
        at = rng.randrange(len(lines))
        indent = re.match(r"\s*", lines[at]).group(0)
        lines.insert(at, indent + rng.choice(_COMMENTS))
    return "\n".join(lines) + ("\n" if body.endswith("\n") else "")


def candidates(task: Any, rng: random.Random, mutants: int = 3, verbose: int = 2) -> list[str]:
    """Distinct completions of a synthesis task: the reference body, up to `mutants` mutants (one
    or two edits each), and `verbose` verbose copies of randomly chosen ones among them."""
    reference = task.reference_body
    out = [reference]
    for _ in range(8 * mutants):
        if len(out) > mutants:
            break
        text = mutate(reference, rng)
        if text is not None and rng.random() < 0.3:
            text = mutate(text, rng) or text
        if text is not None and text not in out:
            out.append(text)
    for base in rng.sample(out, min(verbose, len(out))):
        text = make_verbose(base, rng, comments=rng.choice((1, 2, 3)))
        if text not in out:
            out.append(text)
    return out
