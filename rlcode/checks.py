"""Input checks shared by the objectives: clear errors instead of silent NaNs.

Checks run eagerly when the input is concrete and through `jax.debug.callback` when it is traced
(under `jit`/`vmap`), so a bad value raises an error naming the problem in both cases (under `jit`
the error surfaces as a `JaxRuntimeError` whose message contains the text below).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _raise_if_nonfinite(x: np.ndarray, name: str) -> None:
    x = np.asarray(x)
    bad = ~np.isfinite(x)
    if bad.any():
        where = np.argwhere(bad)[:8].tolist()
        raise ValueError(
            f"{name} contains {int(bad.sum())} non-finite value(s) (NaN/Inf), first at index "
            f"{where}. Mask infrastructure failures out with `valid=` instead of passing NaN."
        )


def check_finite(x: jax.Array, name: str, where: jax.Array | None = None) -> None:
    """Raise ValueError if `x` has a NaN/Inf at a position where `where` is true (default: all)."""
    if where is not None:
        x = jnp.where(where, x, jnp.zeros_like(x))
    if isinstance(x, jax.core.Tracer):
        jax.debug.callback(_raise_if_nonfinite, x, name)
    else:
        _raise_if_nonfinite(np.asarray(jax.device_get(x), dtype=np.float64), name)


def one_of(value: str, allowed: tuple[str, ...], field: str) -> str:
    """Return `value` if it is one of `allowed`, else raise a ValueError naming the field."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {allowed}")
    return value


def config_get(config: Any, name: str, default: Any) -> Any:
    """Field `name` of a ConfigDict, dataclass or mapping, or `default` when it has none."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def apply_overrides(cfg: Any, overrides: Mapping[str, Any], section: str) -> None:
    """Set known fields of a ConfigDict; an unknown field is a ValueError naming the section."""
    for key, value in overrides.items():
        if key not in cfg:
            raise ValueError(f"unknown {section} config field {key!r}; known: {sorted(cfg.keys())}")
        setattr(cfg, key, value)


def parse_config_arg(arg: str | None, defaults: Mapping[str, str]) -> dict[str, str]:
    """The choices of a config file's argument (``--config=configs/x.py:a=1,b=2``): `defaults`
    updated by the comma-separated ``name=value`` items of `arg`; an unknown name or an item
    without ``=`` raises a ValueError listing the names."""
    choices = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in choices:
            raise ValueError(f"config argument {item!r}: expected one of {sorted(choices)} as name=value")
        choices[name] = value
    return choices
