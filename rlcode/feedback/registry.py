"""The model registry between a trainer and the servers: which checkpoint is live.

    <root>/v000005/          the parameters of version 5 (`rlcode.train.checkpoint.save_params`)
    <root>/CURRENT.json      {"version": 5, "path": ..., plus what the publisher recorded}
    <root>/history.jsonl     one line per publication, oldest first

`publish` writes the parameters first (committed atomically), then replaces CURRENT.json
atomically (a temporary file and a rename), so a server reading the registry at any moment sees
either the previous version or the new one, complete. Versions only increase.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlcode.train.checkpoint import restore_params, save_params

__all__ = ["publish", "current", "load", "history"]

CURRENT = "CURRENT.json"
HISTORY = "history.jsonl"


def _version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"v{version:06d}")


def current(root: str | os.PathLike) -> dict | None:
    """The live version's record, or None when nothing is published yet."""
    path = os.path.join(os.fspath(root), CURRENT)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def history(root: str | os.PathLike) -> list[dict]:
    """Every publication, oldest first."""
    path = os.path.join(os.fspath(root), HISTORY)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def publish(root: str | os.PathLike, version: int, params: Any, info: dict[str, Any] | None = None) -> dict:
    """Make `params` the live version `version` (greater than the live one); returns its record."""
    root = os.fspath(root)
    live = current(root)
    if live is not None and version <= live["version"]:
        raise ValueError(f"version {version} is not newer than the live version {live['version']}")
    os.makedirs(root, exist_ok=True)
    path = _version_dir(root, version)
    record = {"version": int(version), "path": os.path.abspath(path), **(info or {})}
    save_params(path, params, extra=record, force=True)
    tmp = os.path.join(root, f".{CURRENT}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, CURRENT))
    with open(os.path.join(root, HISTORY), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return record


def load(root: str | os.PathLike, version: int, target: Any = None) -> Any:
    """The parameters of a published version (`target`: a pytree of the expected structure)."""
    params, _ = restore_params(_version_dir(os.fspath(root), version), target=target)
    return params
