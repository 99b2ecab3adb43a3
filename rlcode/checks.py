"""Input checks: clear errors instead of silent NaNs, and config checking with field names.

Array checks run eagerly when the input is concrete and through `jax.debug.callback` when it is
traced (under `jit`/`vmap`), so a bad value raises an error naming the problem in both cases
(under `jit` the error surfaces as a `JaxRuntimeError` whose message contains the text below).

Config checks: `ConfigError` is the one error type for a config a job cannot run (a bad value,
an unknown or missing field, a resume that would change the run); its message is one line that
names the field, so an entry point can print it as is. `check_fields` checks a config against a
schema of `Spec`s (type, range, finiteness, allowed values) and refuses unknown fields, naming the
closest known ones.

Typed sections: a job converts each config section once, where it reads its config, into a
frozen dataclass (`rlcode.losses.ObjectiveConfig`, `rlcode.advantages.AdvantageConfig`, ...)
whose ``from_config`` takes a ConfigDict, a mapping or an instance; `section_fields` refuses
unknown fields and `check_values` checks every value against the section's Specs, so library
functions receive validated, hashable values and never read a ConfigDict themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
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


# ------------------------------------------------------------------------------ config checking


class ConfigError(ValueError):
    """A config the job cannot run; the message is one line naming the field."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@contextlib.contextmanager
def config_errors(prefix: str = "") -> Iterator[None]:
    """Re-raise a ValueError of the block (a section's own validator) as a ConfigError, its
    message prefixed by `prefix` (e.g. the section's name) unless it names it already."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        text = str(e)
        raise ConfigError(text if not prefix or prefix in text else f"{prefix}: {text}") from e


def closest(name: str, known: Sequence[str], n: int = 3) -> list[str]:
    """The known dotted names closest to `name` (difflib): whole paths first, then paths whose
    last part is close to `name`'s last part or a prefix of it, or the other way round (a right
    field name in the wrong section, a shortened or lengthened name)."""
    near = difflib.get_close_matches(name, known, n=n, cutoff=0.8)
    last = name.rsplit(".", 1)[-1]

    def score(k: str) -> float:
        other = k.rsplit(".", 1)[-1]
        short, long = sorted((last, other), key=len)
        prefix = len(short) >= 3 and long.startswith(short)
        return max(difflib.SequenceMatcher(None, last, other).ratio(), 0.75 if prefix else 0.0)

    by_last = sorted((k for k in known if k not in near and score(k) >= 0.75), key=score, reverse=True)
    return (near + by_last)[:n]


def unknown_field_error(path: str, known: Sequence[str]) -> ConfigError:
    """ConfigError for an unknown config field, naming the closest known fields."""
    near = closest(path, sorted(known))
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return ConfigError(f"unknown config field {path!r}{hint}")


_np_bool = type(np.bool_(True))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclasses.dataclass(frozen=True)
class Spec:
    """The valid values of one config field.

    kind: "int", "float" (an int is accepted; NaN and Inf never are), "bool", "str" or "seq" (a
    tuple or list whose items satisfy `item`, at least `min_len` of them). low / high: inclusive
    bounds, exclusive with low_open / high_open. choices: the allowed values. none_ok: None is
    allowed. required: the field must be present.
    """

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple | None = None
    none_ok: bool = False
    item: Spec | None = None
    min_len: int = 0
    required: bool = True

    def problem(self, value: Any) -> str | None:
        """Why `value` is not valid (a phrase such as "must be an integer >= 1"), or None."""
        if value is None:
            return None if self.none_ok else f"must be {self.describe()}, not None"
        if self.kind == "seq":
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                return f"must be {self.describe()}"
            if len(value) < self.min_len:
                return f"must hold at least {self.min_len} item(s)"
            for i, item in enumerate(value):
                why = self.item.problem(item) if self.item is not None else None
                if why:
                    return f"item {i} ({item!r}) {why}"
            return None
        if self.kind == "bool":
            ok = isinstance(value, (bool, _np_bool))
        elif self.kind == "int":
            ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, _np_bool))
        elif self.kind == "float":
            ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, _np_bool)) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok or (self.choices is not None and value not in self.choices) or not self._in_range(value):
            return f"must be {self.describe()}"
        return None

    def _in_range(self, value: Any) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.kind == "seq":
            what = "a tuple" + (f" of {self.item.describe()}" if self.item is not None else "")
            return what + (f" (at least {self.min_len})" if self.min_len else "")
        if self.choices is not None:
            what = f"one of {tuple(self.choices)}"
        else:
            what = {"int": "an integer", "float": "a finite number", "bool": "True or False",
                    "str": "a string"}[self.kind]
            lo = None if self.low is None else f"{'>' if self.low_open else '>='} {_number(self.low)}"
            hi = None if self.high is None else f"{'<' if self.high_open else '<='} {_number(self.high)}"
            if lo and hi:
                what += f" {lo} and {hi}"
            elif lo or hi:
                what += f" {lo or hi}"
        return what + (" or None" if self.none_ok else "")


def integer(low: float | None = None, high: float | None = None, **kw: Any) -> Spec:
    return Spec("int", low, high, **kw)


def real(low: float | None = None, high: float | None = None, **kw: Any) -> Spec:
    return Spec("float", low, high, **kw)


def flag(**kw: Any) -> Spec:
    return Spec("bool", **kw)


def text(choices: Sequence[str] | None = None, **kw: Any) -> Spec:
    return Spec("str", choices=None if choices is None else tuple(choices), **kw)


def sequence(item: Spec | None = None, min_len: int = 0, **kw: Any) -> Spec:
    return Spec("seq", item=item, min_len=min_len, **kw)


Schema = Mapping[str, "Spec | Schema"]


def spec_of_default(value: Any) -> Spec:
    """The Spec a field gets from the type of its default value: True/False, an integer, a finite
    number, a string, a tuple; a None default (a placeholder) allows a finite number or None."""
    if isinstance(value, (bool, _np_bool)):
        return flag()
    if isinstance(value, numbers.Integral):
        return integer()
    if isinstance(value, numbers.Real):
        return real()
    if isinstance(value, str):
        return text()
    if isinstance(value, (tuple, list)):
        return sequence()
    return real(none_ok=True)


def schema_from_defaults(defaults: Any, specs: Mapping[str, Spec] | None = None) -> dict[str, Spec]:
    """The schema of a section whose fields are those of `defaults` (the section as its builder
    returns it, e.g. `optim_config()`): each field is checked by `specs[name]` when given (ranges,
    allowed values), else by the type of its default. A field the builder no longer has is not
    known, one it gained is checked by type."""
    specs = specs or {}
    return {name: specs.get(name) or spec_of_default(value) for name, value in defaults.items()}


def schema_paths(schema: Schema, prefix: str = "") -> list[str]:
    """Dotted paths of every field and section of a schema."""
    out = []
    for name, spec in schema.items():
        out.append(prefix + name)
        if not isinstance(spec, Spec):
            out += schema_paths(spec, prefix + name + ".")
    return out


def check_fields(cfg: Any, schema: Schema, prefix: str = "", known: Sequence[str] | None = None) -> None:
    """Raise ConfigError for the first field of `cfg` (a ConfigDict or mapping) that the schema
    does not know (naming the closest known fields), that is missing, or whose value does not
    satisfy its Spec. A nested mapping of the schema is a section."""
    known = schema_paths(schema) if known is None else known
    for name in cfg.keys():
        if name not in schema:
            raise unknown_field_error(prefix + name, known)
    for name, spec in schema.items():
        path = prefix + name
        if name not in cfg:
            if isinstance(spec, Spec) and not spec.required:
                continue
            raise ConfigError(f"config field {path!r} is missing")
        value = cfg[name]
        if isinstance(spec, Spec):
            why = spec.problem(value)
            if why:
                raise ConfigError(f"{path}={value!r}: {why}")
        elif not isinstance(value, Mapping) and not hasattr(value, "keys"):
            raise ConfigError(f"{path}={value!r}: must be a config section with fields {sorted(spec)}")
        else:
            check_fields(value, spec, path + ".", known)


# ------------------------------------------------------------------------------ typed sections


def section_fields(config: Any, known: Sequence[str], section: str) -> dict[str, Any]:
    """The fields of one config section (a ConfigDict, FrozenConfigDict or mapping) as a dict,
    for the `from_config` of the frozen dataclass that section becomes where it enters the
    library. A field outside `known` is a ConfigError naming the closest known ones (a mistyped
    ``loss.kl_cof`` is refused, not silently dropped); a list becomes a tuple (hashable, so the
    dataclass can be a static argument of `jax.jit`). Missing fields are left out: the dataclass
    supplies their defaults."""
    if not hasattr(config, "keys"):
        raise ConfigError(f"the {section} section must be a config section or a mapping, not "
                          f"{type(config).__name__}")
    paths = [f"{section}.{name}" for name in known]
    out: dict[str, Any] = {}
    for name in config.keys():
        if name not in known:
            raise unknown_field_error(f"{section}.{name}", paths)
        value = config[name]
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def check_values(obj: Any, specs: Mapping[str, Spec], section: str) -> None:
    """ConfigError ``section.field=value: why`` for the first attribute of `obj` (a typed section)
    whose value does not satisfy its Spec."""
    for name, spec in specs.items():
        value = getattr(obj, name)
        why = spec.problem(value)
        if why:
            raise ConfigError(f"{section}.{name}={value!r}: {why}")


class TypedSection:
    """Base of the frozen dataclass a config section becomes where it enters the library.

    A subclass is a ``@dataclasses.dataclass(frozen=True)`` that sets `SPECS` (field -> `Spec`,
    the valid values) and `SECTION` (the section's name in a job's config). Making one checks every
    field (`check_values`; a list becomes a tuple, so the instance can be a static argument of
    `jax.jit`), and `from_config` reads a section (a ConfigDict or mapping; an unknown field is a
    ConfigError naming the closest known ones, a missing one takes its default) or passes an
    instance through.
    """

    SPECS: Mapping[str, Spec] = {}
    SECTION = ""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        check_values(self, self.SPECS, self.SECTION)

    @classmethod
    def from_config(cls, config: Any) -> Any:
        if isinstance(config, cls):
            return config
        return cls(**section_fields(config, tuple(cls.SPECS), cls.SECTION))

    @classmethod
    def default_section(cls, **overrides: Any) -> Any:
        """The section as a job's config holds it (a ConfigDict): the defaults with `overrides`
        (an unknown field or an invalid value is an error naming it)."""
        import ml_collections  # noqa: PLC0415 (configs are ConfigDicts; the checks need not be)

        cfg = ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(cls)})
        apply_overrides(cfg, overrides, cls.SECTION)
        cls.from_config(cfg)
        return cfg


def expect_type(value: Any, cls: type, what: str) -> Any:
    """`value` if it is a `cls`, else a TypeError saying how to build one from a config section
    (library functions take typed sections, not ConfigDicts or dicts)."""
    if not isinstance(value, cls):
        raise TypeError(f"{what} must be a {cls.__name__} (build it with {cls.__name__}.from_config(section)), "
                        f"not {type(value).__name__}")
    return value


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every leaf of a nested mapping (a config loaded from JSON)."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix + name + "."))
        else:
            out[prefix + name] = value
    return out
