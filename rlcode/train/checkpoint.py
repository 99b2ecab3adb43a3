"""Checkpoints of the train state: atomic, verified, resumable, on orbax's `CheckpointManager`.

A checkpoint of step `s` holds the train state (any pytree of arrays: params, optax states,
the int32 step, the PRNG key), the caller's JSON metadata `extra` (the experiment config, the
data position, ...) and the metrics used for retention, committed together:

    <directory>/<s>/state/     the arrays (orbax OCDBT / TensorStore)
    <directory>/<s>/meta/      one JSON file: format, extra, and one record per array
                               (path, shape, dtype, checksum)
    <directory>/<s>/metrics/   orbax's metrics item (when `save` was given metrics)

Usage (resume if a checkpoint is present)::

    with Checkpointer(workdir / "ckpt", keep=3, best_metric="eval/pass@1") as ckpt:
        state, position = init_state(), {"epoch": 0, "index": 0}
        if ckpt.latest_step() is not None:  # the fresh state gives shapes, dtypes and shardings
            state, extra = ckpt.restore(target=state)
            position = extra["data"]
        while ...:
            state, metrics = train_step(state, batch)  # may donate the state's buffers
            if int(state.step) % save_every == 0:
                ckpt.save(int(state.step), state, metrics=eval_metrics,
                          extra={"config": cfg.to_dict(), "data": position})

For inference, `save_params` / `restore_params` write and read the parameters alone (no
optimizer state) as one verified directory.

What orbax-checkpoint (0.12) provides and this module configures: the atomic commit, async
saves, the metrics stored with each step, retention (its `LatestN` and `BestN` preservation
policies), removal of temporaries left by interrupted saves, typed PRNG keys (stored as key data
with their implementation, restored as typed keys), resharding on restore. What this module adds:
a checksum per array checked on every restore, one error type whose messages name the directory,
the step and the problem, refusal to overwrite a step silently, and a retention rule under which a
NaN metric never counts as best.

Guarantees (the local-filesystem behaviour is exercised by tests/rlcode/train/test_checkpoint.py):

* Atomic commit. Orbax writes a step into `<s>.orbax-checkpoint-tmp` and renames it to `<s>`
  after every file is written (on GCS, where renames are not atomic, it writes a
  `commit_success.txt` marker instead). A save killed at any point leaves only the temporary
  directory, which is never listed as a step: `latest_step()` and `restore()` keep seeing the
  last committed checkpoint. A (non read-only) `Checkpointer` has orbax remove temporaries when
  it opens the directory (finished before its first save), and the temporary of a step is
  replaced when that step is saved again. Old checkpoints are pruned only after the new one has
  committed, and not at all if its save fails.
* Verified restore. Each array's checksum (a position-weighted sum of its bits, mod 2^32,
  computed on device at save time; typed keys are summed over their key data) is stored with the
  checkpoint and checked after restore, so a truncated, deleted or silently altered array file, a
  garbled metadata file or a missing step raises `CheckpointError` naming the directory, the
  step and the problem (the underlying orbax error is chained as `__cause__`); garbage is never
  returned. (A bit flip inside an array file is not detected by orbax itself: the compressed
  chunk decodes to wrong values.)
* Async saves are safe to overlap with training. `save` returns after orbax has moved every
  array to host memory (`transfer_arrays_to_host` runs in the blocking part of the save when no
  device-to-host byte limit is configured, as here). On GPU/TPU that is a copy; on CPU it is a
  zero-copy view that TensorStore holds until those bytes are written, and while it is held XLA
  declines to donate the buffer and copies instead. Either way the caller may donate or
  overwrite the state right after `save` returns. `extra` and `metrics` are snapshotted (JSON
  round trip) when `save` is called. `wait()` blocks until the save is durable.

Retention (orbax's `AnyPreservationPolicy` of `LatestN(keep)` and, with `best_metric`,
`BestN(n=1)`): the `keep` most recent checkpoints are kept, plus the best step by
`metrics[best_metric]` even when it is older. Only finite numbers compete for best: a NaN or
infinite metric, a missing metric and a checkpoint without metrics are never best. Ties go to
the most recent step. Recency is the order of the steps (a fresh `Checkpointer` lists them by
number; within one, a step saved after a higher one counts as the newer, with a warning).

Restore targets: `target` (a pytree of `jax.ShapeDtypeStruct` with shardings, or of concrete
arrays) gives the structure, dtypes and shardings of the result, so a checkpoint written on one
mesh restores onto any other (resharding, replication, a single device). Arrays are read in the
dtype they were saved in, verified, then cast to the target's dtype. Without a target the saved
structure comes back as nested dicts / lists (namedtuples become dicts) on the saved shardings,
which needs the same devices as the saving job.

Checkpoints of the previous format (`rlcode.checkpoint/1`: metrics inside the metadata, typed
keys stored as raw key data) restore unchanged; their metrics are read from the metadata, and
orbax's retention, which does not see them, treats those steps as saved without metrics.

Not thread-safe; one writer per directory (another process may read with `read_only=True`).
Multi-host use follows orbax's contract (every process calls `save`/`restore`) but is untested.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "CheckpointError", "save_params", "restore_params", "params_extra"]

_log = logging.getLogger(__name__)


class _SavesWithoutMetrics(logging.Filter):
    """Orbax stores metrics only when a `best_fn` is set, and then warns on every save given none;
    saving without metrics is a normal use here (a warm-start cache, a run without evaluation)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_SavesWithoutMetrics())

FORMAT = "rlcode.checkpoint/2"
LEGACY_FORMAT = "rlcode.checkpoint/1"  # metrics in the metadata; typed keys stored as key data
PARAMS_FORMAT = "rlcode.params/1"
STATE_ITEM = "state"
META_ITEM = "meta"
PARAMS_ITEM = "params"
# Orbax's suffix for a step that is being written (orbax/checkpoint/_src/path/atomicity_types.py).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
BEST_MODES = ("max", "min")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, incompatible with the target, or failed to save."""


# --------------------------------------------------------------------------------------------
# Pytree paths and PRNG keys
# --------------------------------------------------------------------------------------------


def _path_str(path: Sequence[Any]) -> str:
    """'opt_state/1/0/mu/w' for a key path; namedtuple fields and dict keys read the same."""
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            parts.append(str(entry.key))
        else:
            parts.append(str(entry))
    return "/".join(parts)


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype_name(x: Any) -> str:
    """'float32', 'uint32', ... and, for typed PRNG keys, the key dtype ('key<fry>')."""
    return str(x.dtype) if _is_typed_key(x) else _leaf_dtype(x).name


def _summed(x: Any) -> Any:
    """What a leaf's checksum is computed over: the key data of a typed key, else the leaf."""
    return jax.random.key_data(x) if _is_typed_key(x) else x


def _leaf_dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


# --------------------------------------------------------------------------------------------
# Checksums: position-weighted sum of 32-bit words, mod 2^32; identical in jax and numpy
# --------------------------------------------------------------------------------------------


def _bits(dtype: np.dtype) -> int:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return jnp.finfo(dtype).bits


def _checksum_supported(dtype: np.dtype) -> bool:
    return dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)


def _words_jax(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    elif _bits(x.dtype) < 8:  # int4, float4, ...: widen (value-preserving) to a byte multiple
        x = x.astype(jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32)
    bits = x.dtype.itemsize * 8
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 64-bit: [..., 2]


def _checksum_jax(x: jax.Array) -> jax.Array:
    w = _words_jax(x)
    # Linear index from per-axis iotas (no reshape, which would reshard a sharded array).
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= w.shape[axis]
    return jnp.sum(w * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_checksums_jit = jax.jit(lambda xs: [_checksum_jax(x) for x in xs])


def _checksum_np(a: Any) -> int:
    a = np.asarray(a)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    elif jnp.issubdtype(a.dtype, jnp.complexfloating):
        a = np.stack([a.real, a.imag], axis=-1)
    elif _bits(a.dtype) < 8:
        a = a.astype(np.int32 if jnp.issubdtype(a.dtype, jnp.integer) else np.float32)
    a = np.ascontiguousarray(a)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[a.dtype.itemsize]
    w = a.view(unsigned).astype(np.uint32).ravel()
    index = (np.arange(w.size, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    return int(np.sum(w * (index * np.uint32(2) + np.uint32(1)), dtype=np.uint32))


def _checksums(leaves: Sequence[Any]) -> list[int | None]:
    """One checksum per leaf (None for dtypes without one); jax arrays are summed on device."""
    out: list[int | None] = [None] * len(leaves)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not _checksum_supported(_leaf_dtype(leaf)):
            continue
        if isinstance(leaf, jax.Array):
            # One jit per device set: a jitted call cannot mix arrays committed to different devices.
            devices = tuple(sorted(d.id for d in leaf.sharding.device_set))
            groups.setdefault((devices, leaf.sharding.memory_kind), []).append(i)
        else:
            out[i] = _checksum_np(leaf)
    for idx in groups.values():
        sums = jax.device_get(_checksums_jit([leaves[i] for i in idx]))
        for i, s in zip(idx, sums):
            out[i] = int(s)
    return out


# --------------------------------------------------------------------------------------------
# JSON snapshots
# --------------------------------------------------------------------------------------------


def _json_default(o: Any) -> Any:
    if hasattr(o, "item") and np.ndim(o) == 0:  # numpy / jax scalars
        return o.item()
    raise TypeError(f"object of type {type(o).__name__} is not JSON serialisable")


def _json_snapshot(value: Any, what: str) -> Any:
    """A deep, JSON-normalised copy (tuples become lists), taken now, so later mutation is harmless."""
    try:
        return json.loads(json.dumps(value, default=_json_default))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serialisable (dicts with str keys, lists, str, numbers, bool, "
            f"None; pass a ConfigDict as cfg.to_dict()): {e}"
        ) from e


def _finite_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------------------------
# Records and verification, shared by train-state checkpoints and parameter exports
# --------------------------------------------------------------------------------------------


def _records(state: Any) -> list[dict]:
    """One record per leaf of `state`: path, shape, dtype and checksum (summed on device)."""
    leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(state)
    records = [{"path": _path_str(path), "shape": list(np.shape(leaf)), "dtype": _dtype_name(leaf)}
               for path, leaf in leaves_with_path]
    paths = [r["path"] for r in records]
    if len(set(paths)) != len(paths):
        raise ValueError(f"state has leaves whose paths collide after naming: {paths}")
    for record, checksum in zip(records, _checksums([_summed(leaf) for _, leaf in leaves_with_path])):
        record["checksum"] = checksum
    return records


def _check_meta(meta: Any, formats: Sequence[str], where: str) -> dict:
    fields = ("path", "shape", "dtype", "checksum")
    if (not isinstance(meta, dict) or meta.get("format") not in formats
            or not isinstance(meta.get("leaves"), list)
            or not all(isinstance(r, dict) and all(f in r for f in fields) for r in meta["leaves"])):
        raise CheckpointError(f"{where}: the metadata is not an {' or '.join(formats)} record")
    return meta


def _legacy_impl(record: dict) -> str | None:
    """The PRNG implementation of a leaf that the previous format stored as raw key data."""
    return record.get("prng_impl")


def _template(target: Any, saved: dict, where: str) -> tuple[Any, dict]:
    """Orbax restore template in the saved dtypes, and per path the target's (dtype, sharding)."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [_path_str(p) for p, _ in leaves_with_path]
    missing = sorted(set(paths) - set(saved))
    unexpected = sorted(set(saved) - set(paths))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the target: in the target but not the checkpoint: {missing}; "
            f"in the checkpoint but not the target: {unexpected}")
    template, wanted, mismatched = [], {}, []
    for path, leaf in zip(paths, (leaf for _, leaf in leaves_with_path)):
        record = saved[path]
        sharding = getattr(leaf, "sharding", None)
        shape = tuple(np.shape(leaf))
        dtype = leaf.dtype if _is_typed_key(leaf) else _leaf_dtype(leaf)
        saved_key = record["dtype"].startswith("key<")
        stored_shape, stored_dtype = shape, dtype
        if _is_typed_key(leaf) and _legacy_impl(record):  # key data: read it, wrap it afterwards
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            stored_shape, stored_dtype = tuple(data.shape), data.dtype
        elif _is_typed_key(leaf) != saved_key:
            mismatched.append(f"{path}: checkpoint {record['dtype']}, target {dtype}")
        elif not saved_key:
            stored_dtype = np.dtype(jnp.dtype(record["dtype"]))  # read as saved, cast afterwards
        if list(stored_shape) != record["shape"]:
            mismatched.append(f"{path}: checkpoint {tuple(record['shape'])}, target {stored_shape}")
        wanted[path] = (dtype, sharding)
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            template.append(jax.ShapeDtypeStruct(stored_shape, stored_dtype, sharding=sharding))
        else:
            template.append(leaf)
    if mismatched:
        raise CheckpointError(f"{where} does not match the target's shapes or dtypes: {mismatched}")
    return jax.tree_util.tree_unflatten(treedef, template), wanted


def _verified(restored: Any, saved: dict, wanted: dict | None, where: str) -> Any:
    """`restored` checked against the saved records (paths, shapes, dtypes, checksums), then cast
    to the target's dtypes and shardings (`wanted`; None: no target)."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(restored)
    paths = [_path_str(p) for p, _ in leaves_with_path]
    leaves = [leaf for _, leaf in leaves_with_path]
    if sorted(paths) != sorted(saved):
        raise CheckpointError(
            f"{where}: restored leaves {sorted(set(paths) ^ set(saved))} do not match the metadata "
            f"(corrupted tree metadata)")
    bad = []
    for path, leaf, checksum in zip(paths, leaves, _checksums([_summed(x) for x in leaves])):
        record = saved[path]
        if list(np.shape(leaf)) != record["shape"] or _dtype_name(leaf) != record["dtype"]:
            # Jax arrays are read in the saved dtype; numpy / python leaves of a target are read
            # in the target's dtype and cannot be compared with the saved checksum.
            if wanted is None or isinstance(leaf, jax.Array):
                bad.append(path)
        elif record["checksum"] is not None and checksum != record["checksum"]:
            bad.append(path)
    if bad:
        raise CheckpointError(
            f"{where}: arrays {bad} do not match the shapes, dtypes or checksums recorded at save "
            f"time (corrupted array files)")
    out = []
    for path, leaf in zip(paths, leaves):
        impl = _legacy_impl(saved[path])
        if impl is not None:
            try:
                leaf = jax.random.wrap_key_data(leaf, impl=impl)
            except Exception as e:
                raise CheckpointError(f"{where}: {path} is not valid {impl} key data: {e}") from e
        elif wanted is not None and isinstance(leaf, jax.Array):
            dtype, sharding = wanted[path]
            if leaf.dtype != dtype:
                leaf = leaf.astype(dtype)
                if sharding is not None and leaf.sharding != sharding:
                    leaf = jax.device_put(leaf, sharding)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _restore_hint(target: Any) -> str:
    return "" if target is not None else (
        " (without a target the saved shardings are used: pass target= to restore onto this "
        "process's devices)")


# --------------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores train-state checkpoints in `directory` (see the module docstring).

    Args:
      directory: the run's checkpoint directory (created if missing; local path or gs://...).
      keep: number of most recent checkpoints to keep (>= 1), None to keep all.
      best_metric: name of a key of the `metrics` passed to `save`; its best checkpoint is kept
        in addition to the `keep` most recent ones.
      best_mode: "max" or "min": which metric value is best.
      async_save: write in a background thread (`save` returns once the arrays are on the host).
      read_only: open for reading only (an evaluator next to a running job): `save` raises and
        temporaries of in-progress saves are left alone.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        best_metric: str | None = None,
        best_mode: str = "max",
        async_save: bool = True,
        read_only: bool = False,
    ):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        if best_mode not in BEST_MODES:
            raise ValueError(f"best_mode={best_mode!r} is not one of {BEST_MODES}")
        if best_metric is not None and not isinstance(best_metric, str):
            raise ValueError(f"best_metric must be a str or None, got {best_metric!r}")
        path = os.fspath(directory)
        if "://" not in path:
            path = os.path.abspath(path)
        self.keep = keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self.read_only = read_only
        self._pending_step: int | None = None
        self._closed = False
        policies = [ocp.checkpoint_managers.LatestN(n=keep)]
        if best_metric is not None:
            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=self._rank, reverse=best_mode == "min", n=1,
                keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            # A best_fn makes orbax store the metrics of every save (retention is the policy's).
            best_fn=self._rank,
            best_mode=best_mode,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        try:
            self._manager = ocp.CheckpointManager(path, options=options)
        except Exception as e:
            raise CheckpointError(f"cannot open checkpoint directory {path}: {e}") from e
        self.directory = self._manager.directory  # an etils.epath.Path (local or gs://)

    # ---------------------------------------------------------------------------- queries

    def all_steps(self) -> list[int]:
        """Committed steps, ascending, plus one this object is still writing (durable at `wait`)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The highest step, or None when the directory holds no committed checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best finite `metrics[best_metric]`; None without best_metric or one."""
        if self.best_metric is None:
            return None
        step = self._manager.best_step()
        return step if step is not None and self._value(self.metrics(step)) is not None else None

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with `step` (None if it was saved without metrics or they are
        unreadable, which is logged)."""
        try:
            metrics = self._manager.metrics(step)
            if metrics is None and (self._step_dir(step) / META_ITEM).exists():
                meta = self._read_meta(step)
                metrics = meta.get("metrics") if meta["format"] == LEGACY_FORMAT else None
        except Exception as e:  # noqa: BLE001 - unreadable metrics only cost retention by best
            _log.warning("ignoring the metrics of %s: %s", self._where(step), _first_line(e))
            return None
        return dict(metrics) if isinstance(metrics, Mapping) else None

    def _value(self, metrics: Any) -> float | None:
        if not isinstance(metrics, Mapping) or self.best_metric is None:
            return None
        return _finite_number(metrics.get(self.best_metric))

    def _rank(self, metrics: Any) -> float:
        """Orbax's sort key: the metric, or the worst value when it is missing or not finite."""
        value = self._value(metrics)
        if value is None:
            return -math.inf if self.best_mode == "max" else math.inf
        return value

    def _step_dir(self, step: int) -> Any:
        return self.directory / str(step)

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {self.directory}"

    # ---------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        extra: Any = None,
        force: bool = False,
    ) -> bool:
        """Save `state` (pytree of arrays), `metrics` and JSON `extra` as checkpoint `step`.

        With async_save, returns once the arrays are copied to host memory (the caller may then
        donate or overwrite them); the write commits in the background (see `wait`). A step that
        already exists raises CheckpointError unless `force=True`, which deletes it first (until
        the new save commits, that step is absent; the other checkpoints are untouched).

        Returns:
          True: a save was performed (started, with async_save).
        """
        self._check_open()
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read_only; cannot save step {step}")
        step = _as_step(step)
        metrics = _json_snapshot(dict(metrics), "metrics") if metrics is not None else None
        extra = _json_snapshot(extra, "extra")

        if step in self._manager.all_steps() or self._step_dir(step).exists():
            if not force:
                raise CheckpointError(
                    f"{self._where(step)} already exists; pass force=True to overwrite it"
                )
            self.wait()
            if step in self._manager.all_steps():
                self._manager.delete(step)
            elif self._step_dir(step).exists():  # written by another process after we opened
                self._step_dir(step).rmtree()
        latest = self.latest_step()
        if latest is not None and step < latest:
            _log.warning(
                "saving step %d below the latest step %d in %s: retention counts it as the newest "
                "until the directory is reopened, then by its number", step, latest, self.directory)

        meta = {"format": FORMAT, "step": step, "extra": extra, "leaves": _records(state)}
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
                ),
                metrics=metrics,
                force=True,  # bypass orbax's save-interval policy; existence is checked above
            )
        except Exception as e:
            failed = self._pending_step
            self._pending_step = None
            if failed is not None and failed != step:
                raise CheckpointError(
                    f"saving {self._where(failed)} failed in the background: {e}") from e
            raise CheckpointError(f"saving {self._where(step)} failed: {e}") from e
        self._pending_step = step if self.async_save else None
        return True

    def wait(self) -> None:
        """Block until the pending async save (if any) is committed; raise if it failed."""
        if self._closed:
            return
        step, self._pending_step = self._pending_step, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"saving {self._where(step) if step is not None else 'to ' + str(self.directory)}"
                f" failed in the background: {e}") from e

    def close(self) -> None:
        """Wait for the pending save and release orbax's resources (idempotent)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            try:
                self._manager.close()
            except Exception as e:  # a failed save was already raised by wait()
                _log.warning("closing the checkpoint manager of %s: %s", self.directory, e)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer of {self.directory} is closed")

    # ---------------------------------------------------------------------------- restoring

    def _read_meta(self, step: int) -> dict:
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )
            meta = restored[META_ITEM]
        except Exception as e:
            raise CheckpointError(
                f"{self._where(step)}: the metadata file is missing or corrupted "
                f"({type(e).__name__}: {_first_line(e)})") from e
        return _check_meta(meta, (FORMAT, LEGACY_FORMAT), self._where(step))

    def restore_or_none(self, *, target: Any = None) -> tuple[Any, Any] | None:
        """`restore()` of the latest step, or None when the directory has no checkpoint."""
        if self.latest_step() is None:
            return None
        return self.restore(target=target)

    def restore(self, step: int | None = None, *, target: Any = None) -> tuple[Any, Any]:
        """Restore checkpoint `step` (default: the latest) and return `(state, extra)`.

        Args:
          step: the step to restore; None for the latest.
          target: optional pytree giving the structure, dtypes and shardings of the result:
            `jax.ShapeDtypeStruct`s (with `sharding=`) or concrete arrays; typed PRNG keys in the
            target come back as typed keys.

        Raises:
          CheckpointError: no checkpoint / no such step; missing or corrupted files or metadata;
            checksum mismatch; the target's paths or shapes differ from the checkpoint's.
        """
        self._check_open()
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no checkpoint in {self.directory} (use restore_or_none() or check "
                    f"latest_step() is None to start from scratch)")
        step = _as_step(step)
        if step not in self._manager.all_steps() and not self._step_dir(step).is_dir():
            hint = ""
            if (self.directory / f"{step}{TMP_SUFFIX}").exists():
                hint = " (only an uncommitted temporary exists: that save was interrupted)"
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}{hint}; "
                f"available steps: {self.all_steps()}")

        where = self._where(step)
        meta = self._read_meta(step)
        saved = {r["path"]: r for r in meta["leaves"]}
        template, wanted = _template(target, saved, where) if target is not None else (None, None)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(template)}),
            )[STATE_ITEM]
        except Exception as e:
            raise CheckpointError(
                f"{where}: cannot read the arrays, files are missing or corrupted"
                f"{_restore_hint(target)} ({type(e).__name__}: {_first_line(e)})") from e
        return _verified(restored, saved, wanted, where), meta["extra"]


# --------------------------------------------------------------------------------------------
# Parameters alone, for inference
# --------------------------------------------------------------------------------------------


def save_params(path: str | os.PathLike, params: Any, *, extra: Any = None, force: bool = False) -> None:
    """Write `params` (a pytree of arrays: the model's weights, no optimizer state) and JSON
    `extra` (e.g. the model config and the step they come from) as one directory `path`,
    committed atomically (orbax writes a temporary and renames it) and verified on restore like a
    checkpoint. An existing `path` raises CheckpointError unless `force=True`."""
    path = os.path.abspath(os.fspath(path))
    extra = _json_snapshot(extra, "extra")
    meta = {"format": PARAMS_FORMAT, "extra": extra, "leaves": _records(params)}
    if os.path.exists(path) and not force:
        raise CheckpointError(f"parameters in {path} already exist; pass force=True to overwrite them")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as writer:
            writer.save(path, args=ocp.args.Composite(
                **{PARAMS_ITEM: ocp.args.StandardSave(params), META_ITEM: ocp.args.JsonSave(meta)}),
                force=force)
    except Exception as e:
        raise CheckpointError(f"saving parameters to {path} failed: {e}") from e


def params_extra(path: str | os.PathLike) -> Any:
    """The `extra` of the parameters written by `save_params` to `path`, without reading the arrays."""
    return _params_meta(os.path.abspath(os.fspath(path)))["extra"]


def _params_meta(path: str) -> dict:
    where = f"parameters in {path}"
    if not os.path.isdir(path):
        parent, name = os.path.split(path)
        interrupted = os.path.isdir(parent) and any(n.startswith(name + TMP_SUFFIX) for n in os.listdir(parent))
        hint = " (only an uncommitted temporary exists: that save was interrupted)" if interrupted else ""
        raise CheckpointError(f"no parameters in {path}: not a directory{hint}")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            meta = reader.restore(path, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as e:
        raise CheckpointError(
            f"{where}: the metadata file is missing or corrupted ({type(e).__name__}: {_first_line(e)})") from e
    return _check_meta(meta, (PARAMS_FORMAT,), where)


def restore_params(path: str | os.PathLike, *, target: Any = None) -> tuple[Any, Any]:
    """`(params, extra)` written by `save_params` to `path`; `target` as for `Checkpointer.restore`.
    CheckpointError naming `path` when it is missing, not a parameter export, or corrupted."""
    path = os.path.abspath(os.fspath(path))
    where = f"parameters in {path}"
    meta = _params_meta(path)
    saved = {r["path"]: r for r in meta["leaves"]}
    template, wanted = _template(target, saved, where) if target is not None else (None, None)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            restored = reader.restore(
                path, args=ocp.args.Composite(**{PARAMS_ITEM: ocp.args.StandardRestore(template)}))[PARAMS_ITEM]
    except Exception as e:
        raise CheckpointError(
            f"{where}: cannot read the arrays, files are missing or corrupted{_restore_hint(target)} "
            f"({type(e).__name__}: {_first_line(e)})") from e
    return _verified(restored, saved, wanted, where), meta["extra"]


def _as_step(step: Any) -> int:
    """A non-negative int from an int, numpy integer or integer scalar array."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative integer, got {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return value


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else repr(e)
