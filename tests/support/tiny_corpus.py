"""A tiny corpus of regular Python files, written in the layout of `rlcode.data.corpus.write`."""

from __future__ import annotations

import numpy as np

from rlcode.data import corpus


def texts(n: int, seed: int = 0) -> list[str]:
    """Small Python files: functions with numbered names and bodies, some long enough to be cut."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lines = [f"def f{i}_{j}(x, y={int(rng.integers(9))}):\n    return x * {int(rng.integers(99))} + y\n"
                 for j in range(int(rng.integers(1, 12)))]
        out.append("import math\n\n\n" + "\n\n".join(lines))
    return out


def write_corpus(directory, n: int = 40) -> corpus.Corpus:
    """`n` files, a fifth held out by hash, written to `directory`."""
    docs = [corpus.Document("stdlib", f"m{i}.py", "PSF-2.0", t) for i, t in enumerate(texts(n))]
    built = corpus.build(docs, heldout_fraction=0.2)
    corpus.write(built, str(directory))
    return built
