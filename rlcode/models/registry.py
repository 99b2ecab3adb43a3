"""Name -> implementation registries through which configs choose model components."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx


class Registry(dict):
    """A dict of kind -> nnx.Module class for one component (its config field is `field`).

    `register(kind)` is a class decorator; `build(cfg, rngs=...)` constructs the class named by
    `cfg.<field>["kind"]`. Unknown and duplicate kinds are errors that name the registered ones.
    """

    def __init__(self, field: str):
        super().__init__()
        self.field = field

    def register(self, kind: str) -> Callable[[type], type]:
        def add(cls: type) -> type:
            if kind in self:
                raise ValueError(f"{self.field} kind {kind!r} is already registered ({self[kind].__name__})")
            self[kind] = cls
            return cls

        return add

    def build(self, cfg: Any, *, rngs: nnx.Rngs) -> nnx.Module:
        kind = getattr(cfg, self.field)["kind"]
        if kind not in self:
            raise ValueError(f"unknown {self.field}.kind={kind!r}; registered: {sorted(self)}")
        return self[kind](cfg, rngs=rngs)
