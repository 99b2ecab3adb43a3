"""Every field of a job's config is checked: a helper shared by the synthesis and agent job tests."""

import math

import ml_collections
import pytest

from rlcode.checks import ConfigError


def set_field(cfg, dotted, value):
    *path, last = dotted.split(".")
    node = cfg
    for name in path:
        node = node[name]
    node[last] = value


def leaves(cfg, prefix=""):
    for name, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from leaves(value, prefix + name + ".")
        else:
            yield prefix + name, value


def wrong_type(value):
    return {bool: "yes", int: "1", float: "1.0", str: 3, tuple: 5, type(None): "x"}[type(value)]


def check_every_field(cfg, validate):
    """Each leaf set to a value of the wrong type, then each number set out of range (NaN for a
    float, -10**9 for an integer), is refused naming that field."""
    base = ml_collections.ConfigDict(cfg.to_dict(), type_safe=False)
    validate(base)
    paths = list(leaves(base))
    for path, value in paths:
        for bad in [wrong_type(value)] + ([math.nan] if isinstance(value, float) else []) + (
                [-10**9] if isinstance(value, int) and not isinstance(value, bool) else []):
            copy = ml_collections.ConfigDict(base.to_dict(), type_safe=False)
            set_field(copy, path, bad)
            with pytest.raises(ConfigError) as e:
                validate(copy)
            assert path in str(e.value), (path, bad, str(e.value))
    return [p for p, _ in paths]
