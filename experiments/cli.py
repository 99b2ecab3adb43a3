"""Command-line helpers shared by the experiment scripts (no flags are defined here)."""

from __future__ import annotations

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
