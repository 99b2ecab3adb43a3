"""Command-line helpers shared by the experiment scripts (no flags are defined here)."""

from __future__ import annotations

import os

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


def output_paths(name: str, quick: bool, out: str | None, png: str | None) -> tuple[str, str]:
    """(JSON path, PNG path) of a benchmark or experiment script.

    Defaults: results/<name>.json and docs/figures/<name>.png (the figure the README shows); with
    --quick, results/<name>_quick.json; with --quick or an explicit --out, the PNG goes next to the
    JSON so a trial run never replaces the committed figure."""
    out = out or os.path.join("results", f"{name}_quick.json" if quick else f"{name}.json")
    if png is None:
        png = os.path.splitext(out)[0] + ".png" if quick or out != os.path.join("results", f"{name}.json") else (
            os.path.join("docs", "figures", f"{name}.png"))
    return out, png
