"""Config checking: each Spec accepts exactly its values, unknown fields name the closest known
ones, and every error is a one-line ConfigError (a ValueError) naming the field."""

import math

import ml_collections
import numpy as np
import pytest

from rlcode.checks import (ConfigError, check_fields, closest, config_errors, flag, integer, real,
                           schema_from_defaults, sequence, text, unknown_field_error)


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (integer(1), [1, 7, np.int64(3)], [0, -1, 1.5, True, "1", None, math.nan]),
        (integer(-1, 8), [-1, 0, 8], [-2, 9]),
        (real(0, low_open=True), [1e-9, 3, 2.5], [0.0, -1.0, math.nan, math.inf, -math.inf, True, "1"]),
        (real(0, 1, high_open=True), [0.0, 0.5], [1.0, 1.5, math.nan]),
        (real(1, low_open=True, none_ok=True), [None, 1.5], [1.0, math.nan]),
        (flag(), [True, False, np.bool_(True)], [0, 1, "True", None]),
        (text(("a", "b")), ["a", "b"], ["c", 1, None]),
        (text(), ["", "x"], [1, None]),
        (sequence(integer(choices=(1, 2)), min_len=1), [(1,), [1, 2]], [(), (3,), "12", 1, (1, "2")]),
    ],
)
def test_spec_accepts_exactly_its_values(spec, good, bad):
    for value in good:
        assert spec.problem(value) is None, (spec, value)
    for value in bad:
        assert spec.problem(value), (spec, value)


SCHEMA = {"seed": integer(0), "optim": {"lr": real(0, low_open=True), "b1": real(0, 1)},
          "rollout": {"group_size": integer(1), "prompts_per_step": integer(1)}, "extra": flag(required=False)}


def config(**sections):
    cfg = ml_collections.ConfigDict({"seed": 0, "optim": {"lr": 1e-3, "b1": 0.9},
                                     "rollout": {"group_size": 4, "prompts_per_step": 2}}, type_safe=False)
    for path, value in sections.items():
        node = cfg
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return cfg


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"seed": -1}, "seed=-1: must be an integer >= 0"),
        ({"optim__lr": math.nan}, "optim.lr=nan: must be a finite number > 0"),
        ({"optim__b1": 2.0}, "optim.b1=2.0: must be a finite number >= 0 and <= 1"),
        ({"rollout__grup_size": 4}, "unknown config field 'rollout.grup_size'; did you mean rollout.group_size?"),
        ({"optimm": 1}, "unknown config field 'optimm'; did you mean optim?"),
        ({"rollout": 3}, "rollout=3: must be a config section"),
    ],
)
def test_check_fields_names_the_field(changes, message):
    check_fields(config(), SCHEMA)  # the valid config passes, the optional field may be absent
    with pytest.raises(ConfigError) as e:
        check_fields(config(**changes), SCHEMA)
    assert str(e.value).startswith(message), str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_missing_field_and_one_line_errors():
    cfg = config()
    del cfg.optim["lr"]
    with pytest.raises(ConfigError, match="'optim.lr' is missing"):
        check_fields(cfg, SCHEMA)
    assert str(ConfigError("a\nb  c")) == "a b c"
    with pytest.raises(ConfigError, match="^loss: bad$"):
        with config_errors("loss"):
            raise ValueError("bad")
    with pytest.raises(ConfigError, match="^loss.kind bad$"):
        with config_errors("loss"):
            raise ValueError("loss.kind bad")


def test_closest_names():
    known = ["rollout.group_size", "rollout.prompts_per_step", "optim.lr", "sft.lr", "seed", "task.seed"]
    assert closest("rollout.grup_size", known) == ["rollout.group_size"]
    assert closest("sed", known)[0] == "seed"
    assert closest("lr", known) == ["optim.lr", "sft.lr"]  # a right name in the wrong section
    assert closest("zzz", known) == []
    assert str(unknown_field_error("zzz", known)) == "unknown config field 'zzz'"


def test_schema_from_defaults_follows_the_builder():
    defaults = {"lr": 1e-3, "steps": 10, "name": "x", "on": True, "ks": (1,), "cap": None}
    schema = schema_from_defaults(defaults, {"lr": real(0, low_open=True)})
    assert set(schema) == set(defaults)
    assert schema["lr"].problem(0.0) and not schema["lr"].problem(0.1)
    assert schema["steps"].problem(1.5) and schema["name"].problem(3) and schema["on"].problem(1)
    assert schema["ks"].problem(3) and not schema["cap"].problem(None) and schema["cap"].problem(math.inf)
