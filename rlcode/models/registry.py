"""Name -> implementation registries through which configs choose model components.

Both registries live here, and every built-in kind is listed here by where its class is defined
("module:Class"). A kind's module is imported when the kind is first looked up, so:

* no module imports another only to have it register a kind, and this module imports no model
  module at all: `rlcode.models.mlp` and `rlcode.models.moe` do not import each other (moe builds
  on the shared layers, not on mlp), and the attention kinds follow the same scheme;
* `MLP[cfg.mlp.kind]` finds every built-in kind whichever modules were imported first.

`register(kind)` adds a class at run time (a kind defined outside the package, a test's stand-in).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flax import nnx


class Registry(Mapping):
    """kind -> nnx.Module class for one component (its config field is `field`).

    `builtin` maps each built-in kind to "module:Class", imported on first lookup. `register(kind)`
    is a class decorator for further kinds; `build(cfg, rngs=...)` constructs the class named by
    `cfg.<field>["kind"]`. Unknown and duplicate kinds are errors that name the registered ones.
    """

    def __init__(self, field: str, builtin: Mapping[str, str]):
        self.field = field
        self._entries: dict[str, type | str] = dict(builtin)

    def __getitem__(self, kind: str) -> type:
        entry = self._entries[kind]
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = self._entries[kind] = getattr(importlib.import_module(module), name)
        return entry

    def __contains__(self, kind: object) -> bool:  # without importing the kind's module
        return kind in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __delitem__(self, kind: str) -> None:
        del self._entries[kind]

    def register(self, kind: str) -> Callable[[type], type]:
        def add(cls: type) -> type:
            if kind in self._entries:
                raise ValueError(f"{self.field} kind {kind!r} is already registered ({self[kind].__name__})")
            self._entries[kind] = cls
            return cls

        return add

    def build(self, cfg: Any, *, rngs: nnx.Rngs) -> nnx.Module:
        kind = getattr(cfg, self.field)["kind"]
        if kind not in self._entries:
            raise ValueError(f"unknown {self.field}.kind={kind!r}; registered: {sorted(self)}")
        return self[kind](cfg, rngs=rngs)


ATTENTION = Registry(
    "attention",
    {
        "dense": "rlcode.models.attention:DenseAttention",
        "squid": "rlcode.models.attention:SquidAttention",
        "nsa": "rlcode.models.attention:NSAAttention",
    },
)
MLP = Registry(
    "mlp",
    {
        "dense": "rlcode.models.mlp:SwiGLU",
        "moe": "rlcode.models.moe:MoE",
    },
)
