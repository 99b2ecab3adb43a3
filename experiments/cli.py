"""Command-line helpers shared by the experiment scripts (no flags are defined here)."""

from __future__ import annotations

import os
import sys
from typing import Any

# Config fields that are Python keywords cannot be addressed by config_flags (it parses the path
# as Python); the command line accepts them under their keyword name.
FLAG_ALIASES = {"--config.rollout.async": "--config.rollout.async_mode"}


def translate_aliases(argv: list[str]) -> list[str]:
    """argv with `--config.rollout.async[=v]` spelled as `--config.rollout.async_mode[=v]`."""
    out = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        out.append(FLAG_ALIASES[name] + sep + value if name in FLAG_ALIASES else arg)
    return out


def summary(doc: str | None) -> str:
    """The first paragraph of a module docstring as one line: a script's --help description
    (its first line alone is often half a sentence)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in first.splitlines())


PUBLISH_HELP = ("write the committed evidence (results/<name>.json, docs/figures/<name>.png) instead of the "
                "run directory runs/<name>/; only a full run (not --quick, no --out/--png) can be published")


def fail(message: str) -> None:
    """A command-line error: one line on stderr, exit status 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def output_paths(name: str, quick: bool, out: str | None, png: str | None, publish: bool = False) -> tuple[str, str]:
    """(JSON path, PNG path) of a benchmark or experiment script.

    By default a script writes into its run directory, runs/<name>/<name>.json (<name>_quick.json
    with --quick) with the PNG next to it, so a trial never replaces what the repository publishes.
    `publish` (the scripts' --publish) writes the committed evidence instead: results/<name>.json
    and docs/figures/<name>.png, the figure the README shows; it refuses --quick and explicit
    paths, which would publish something other than the documented run. An explicit --out puts
    the PNG next to it unless --png is given."""
    if publish:
        if quick:
            fail("--publish writes the committed results; a --quick run is never published")
        if out or png:
            fail("--publish writes results/ and docs/figures/; drop --out/--png (or drop --publish)")
        return os.path.join("results", f"{name}.json"), os.path.join("docs", "figures", f"{name}.png")
    out = out or os.path.join("runs", name, f"{name}_quick.json" if quick else f"{name}.json")
    return out, png or os.path.splitext(out)[0] + ".png"


# The main job with the fresh byte-level policy: the config the main job's published results/ files
# were measured with (its default warm start is now the pretrained base, base=code).
BYTE_LEVEL_MAIN_JOB = "configs/grpo_synth.py:base=bytes"


def add_synth_grid_options(p: Any, name: str, steps: int) -> None:
    """The options of a script that runs the main job (configs/grpo_synth.py) as experiments.ablate
    grids: --steps (default `steps`), --seeds, --smooth, --set, --out (runs/<name>), --table_only,
    --publish."""
    p.add_argument("--steps", type=int, default=steps, help="GRPO steps per run")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per run")
    p.add_argument("--smooth", type=int, default=5, help="steps per moving average in the table and figure")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="FIELD=VALUE",
                   help="override of configs/grpo_synth.py for every run (repeatable)")
    p.add_argument("--out", default=os.path.join("runs", name), help="run directory")
    p.add_argument("--table_only", action="store_true", help="no runs: the table and figure from the run directories")
    p.add_argument("--publish", action="store_true", help=PUBLISH_HELP)
