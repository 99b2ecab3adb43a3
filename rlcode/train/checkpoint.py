"""Checkpoints of the train state: atomic, verified, resumable, on orbax's `CheckpointManager`.

A checkpoint of step `s` holds the train state (any pytree of arrays: params, optax states,
the int32 step, the PRNG key), the caller's JSON metadata `extra` (the experiment config, the
data position, ...) and the metrics used for retention, committed together:

    <directory>/<s>/state/   the arrays (orbax OCDBT / TensorStore)
    <directory>/<s>/meta/    one JSON file: format, metrics, extra, and one record per array
                             (path, shape, dtype, PRNG-key implementation, checksum)

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

Guarantees (orbax-checkpoint 0.12; the local-filesystem behaviour is exercised by
tests/rlcode/train/test_checkpoint.py):

* Atomic commit. Orbax writes a step into `<s>.orbax-checkpoint-tmp` and renames it to `<s>`
  after every file is written (on GCS, where renames are not atomic, it writes a
  `commit_success.txt` marker instead). A save killed at any point leaves only the temporary
  directory, which is never listed as a step: `latest_step()` and `restore()` keep seeing the
  last committed checkpoint. Temporaries are removed when a (non read-only) `Checkpointer` opens
  the directory, and the temporary of a step is replaced when that step is saved again. Old
  checkpoints are pruned only after the new one has committed, and not at all if its save fails.
* Verified restore. Each array's checksum (a position-weighted sum of its bits, mod 2^32,
  computed on device at save time) is stored with the checkpoint and checked after restore, so a
  truncated, deleted or silently altered array file, a garbled metadata file or a missing step
  raises `CheckpointError` naming the directory, the step and the problem (the underlying orbax
  error is chained as `__cause__`); garbage is never returned. (A bit flip inside an array file
  is not detected by orbax itself: the compressed chunk decodes to wrong values.)
* Async saves are safe to overlap with training. `save` returns after orbax has moved every
  array to host memory (`transfer_arrays_to_host` runs in the blocking part of the save when no
  device-to-host byte limit is configured, as here). On GPU/TPU that is a copy; on CPU it is a
  zero-copy view that TensorStore holds until those bytes are written, and while it is held XLA
  declines to donate the buffer and copies instead. Either way the caller may donate or
  overwrite the state right after `save` returns. `extra` and `metrics` are snapshotted (JSON
  round trip) when `save` is called. `wait()` blocks until the save is durable.

Retention: the `keep` highest steps are kept, plus (with `best_metric`) the best step by
`metrics[best_metric]` even when it is older. Only finite numbers compete for best: a NaN or
infinite metric, a missing metric and a checkpoint without metrics are never best. Ties go to
the highest step (the newer of two equally good checkpoints is kept, the older one may be pruned).
Steps are ordered by their number, not by the time they were saved.

PRNG keys: typed keys (`jax.random.key`) are stored as their key data (`jax.random.key_data`)
and rewrapped (`jax.random.wrap_key_data`) on restore; raw uint32 keys are ordinary arrays.

Restore targets: `target` (a pytree of `jax.ShapeDtypeStruct` with shardings, or of concrete
arrays) gives the structure, dtypes and shardings of the result, so a checkpoint written on one
mesh restores onto any other (resharding, replication, a single device). Arrays are read in the
dtype they were saved in, verified, then cast to the target's dtype. Without a target the saved
structure comes back as nested dicts / lists (namedtuples become dicts) on the saved shardings,
which needs the same devices as the saving job.

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

__all__ = ["Checkpointer", "CheckpointError"]

_log = logging.getLogger(__name__)

FORMAT = "rlcode.checkpoint/1"
STATE_ITEM = "state"
META_ITEM = "meta"
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


_KNOWN_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _impl_for_key_dtype(dtype: Any, hint: str | None) -> str:
    """The PRNG implementation name of a typed-key dtype (e.g. key<fry> -> 'threefry2x32')."""
    for name in ((hint,) if hint else ()) + _KNOWN_IMPLS:
        try:
            if jax.eval_shape(lambda: jax.random.key(0, impl=name)).dtype == dtype:
                return name
        except Exception:  # an unknown name: try the next one
            continue
    raise CheckpointError(f"cannot determine the PRNG implementation of key dtype {dtype}")


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


class _KeepLatestAndBest:
    """Orbax preservation policy: the `keep` highest steps, plus the best step if any."""

    def __init__(self, keep: int | None, best_step_of):
        self._keep = keep
        self._best_step_of = best_step_of

    def should_preserve(self, checkpoints, *, context):
        del context
        steps = [info.step for info in checkpoints]
        newest = set(sorted(steps)[-self._keep :]) if self._keep is not None else set(steps)
        best = self._best_step_of(steps)
        return [s in newest or s == best for s in steps]


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
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=_KeepLatestAndBest(keep, self._best_of),
            create=not read_only,
            read_only=read_only,
        )
        try:
            self._manager = ocp.CheckpointManager(path, options=options)
        except Exception as e:
            raise CheckpointError(f"cannot open checkpoint directory {path}: {e}") from e
        self.directory = self._manager.directory  # an etils.epath.Path (local or gs://)
        if not read_only:
            self._remove_uncommitted()
        # step -> its metrics (None if saved without metrics or if the metadata is unreadable).
        self._metrics: dict[int, dict | None] = {}
        if best_metric is not None:
            for step in self._manager.all_steps():
                self._metrics[step] = self._read_metrics(step)

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
        return self._best_of(self.all_steps())

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with `step` (None if it was saved without metrics)."""
        if step not in self._metrics:
            self._metrics[step] = self._read_metrics(step)
        return self._metrics[step]

    def _best_of(self, steps: Sequence[int]) -> int | None:
        if self.best_metric is None:
            return None
        best_step, best_value = None, None
        for step in sorted(steps):  # ascending, so `>=` / `<=` hands ties to the higher step
            metrics = self._metrics.get(step)
            value = _finite_number(metrics.get(self.best_metric)) if metrics else None
            if value is None:
                continue
            if (best_value is None
                    or (value >= best_value if self.best_mode == "max" else value <= best_value)):
                best_step, best_value = step, value
        return best_step

    def _read_metrics(self, step: int) -> dict | None:
        try:
            metrics = self._read_meta(step).get("metrics")
        except CheckpointError as e:
            _log.warning("ignoring the metrics of step %d: %s", step, e)
            return None
        return metrics if isinstance(metrics, dict) else None

    def _remove_uncommitted(self) -> None:
        """Delete temporaries left by interrupted saves (synchronously: orbax's own cleanup
        runs in a thread that can outlive a short-lived process)."""
        if jax.process_index() != 0:
            return
        try:
            for tmp in ocp.utils.tmp_checkpoints(self.directory):
                _log.info("removing the uncommitted checkpoint %s", tmp.get())
                tmp.get().rmtree()
        except Exception as e:  # a leftover temporary is harmless: it is never listed
            _log.warning("could not remove uncommitted checkpoints in %s: %s", self.directory, e)

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
                "saving step %d below the latest step %d in %s: checkpoints are ordered by step, "
                "so it counts as older", step, latest, self.directory)

        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
        records, stored_leaves = [], []
        for path, leaf in leaves_with_path:
            impl = None
            if _is_typed_key(leaf):
                impl = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            stored_leaves.append(leaf)
            records.append(
                {"path": _path_str(path), "shape": list(np.shape(leaf)),
                 "dtype": _leaf_dtype(leaf).name, "prng_impl": impl}
            )
        paths = [r["path"] for r in records]
        if len(set(paths)) != len(paths):
            raise ValueError(f"state has leaves whose paths collide after naming: {paths}")
        for record, checksum in zip(records, _checksums(stored_leaves)):
            record["checksum"] = checksum
        meta = {"format": FORMAT, "step": step, "metrics": metrics, "extra": extra,
                "leaves": records}
        stored_state = jax.tree_util.tree_unflatten(treedef, stored_leaves)

        self._metrics[step] = metrics
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{STATE_ITEM: ocp.args.StandardSave(stored_state),
                       META_ITEM: ocp.args.JsonSave(meta)}
                ),
                force=True,  # bypass orbax's save-interval policy; existence is checked above
            )
        except Exception as e:
            self._metrics.pop(step, None)
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
            if step is not None:
                self._metrics.pop(step, None)
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
        fields = ("path", "shape", "dtype", "prng_impl", "checksum")
        if (not isinstance(meta, dict) or meta.get("format") != FORMAT
                or not isinstance(meta.get("leaves"), list)
                or not all(isinstance(r, dict) and all(f in r for f in fields)
                           for r in meta["leaves"])):
            raise CheckpointError(f"{self._where(step)}: the metadata is not an {FORMAT} record")
        return meta

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

        meta = self._read_meta(step)
        saved = {r["path"]: r for r in meta["leaves"]}
        if target is None:
            template, typed = None, {}
        else:
            template, typed = self._template(step, target, saved)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(template)}),
            )[STATE_ITEM]
        except Exception as e:
            hint = "" if target is not None else (
                " (without a target the saved shardings are used: pass target= to restore "
                "onto this process's devices)")
            raise CheckpointError(
                f"{self._where(step)}: cannot read the arrays, files are missing or corrupted"
                f"{hint} ({type(e).__name__}: {_first_line(e)})") from e

        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(restored)
        paths = [_path_str(p) for p, _ in leaves_with_path]
        leaves = [leaf for _, leaf in leaves_with_path]
        if sorted(paths) != sorted(saved):
            raise CheckpointError(
                f"{self._where(step)}: restored leaves {sorted(set(paths) ^ set(saved))} do not "
                f"match the metadata (corrupted tree metadata)")

        bad = []
        for path, leaf, checksum in zip(paths, leaves, _checksums(leaves)):
            record = saved[path]
            as_saved = (list(np.shape(leaf)) == record["shape"]
                        and _leaf_dtype(leaf).name == record["dtype"])
            if not as_saved:
                # Jax arrays are read in the saved dtype; numpy / python leaves of a target are
                # read in the target's dtype and cannot be compared with the saved checksum.
                if target is None or isinstance(leaf, jax.Array):
                    bad.append(path)
            elif record["checksum"] is not None and checksum != record["checksum"]:
                bad.append(path)
        if bad:
            raise CheckpointError(
                f"{self._where(step)}: arrays {bad} do not match the shapes, dtypes or checksums "
                f"recorded at save time (corrupted array files)")

        out = []
        for path, leaf in zip(paths, leaves):
            if target is None:
                impl = saved[path]["prng_impl"]
            else:
                impl, dtype, sharding = typed[path]
                if impl is None and isinstance(leaf, jax.Array) and leaf.dtype != dtype:
                    leaf = leaf.astype(dtype)
                    if sharding is not None and leaf.sharding != sharding:
                        leaf = jax.device_put(leaf, sharding)
            if impl is not None:
                try:
                    leaf = jax.random.wrap_key_data(leaf, impl=impl)
                except Exception as e:
                    raise CheckpointError(
                        f"{self._where(step)}: {path} is not valid {impl} key data: {e}") from e
            out.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, out), meta["extra"]

    def _template(self, step: int, target: Any, saved: dict) -> tuple[Any, dict]:
        """Orbax restore template in the saved dtypes, and per path (key impl, dtype, sharding)."""
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(target)
        paths = [_path_str(p) for p, _ in leaves_with_path]
        missing = sorted(set(paths) - set(saved))
        unexpected = sorted(set(saved) - set(paths))
        if missing or unexpected:
            raise CheckpointError(
                f"{self._where(step)} does not match the target: in the target but not the "
                f"checkpoint: {missing}; in the checkpoint but not the target: {unexpected}")
        template, typed, mismatched = [], {}, []
        for path, leaf in zip(paths, (leaf for _, leaf in leaves_with_path)):
            record = saved[path]
            sharding = getattr(leaf, "sharding", None)
            if _is_typed_key(leaf):
                abstract = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                data = jax.eval_shape(jax.random.key_data, abstract)
                if isinstance(leaf, jax.Array):
                    impl = str(jax.random.key_impl(leaf))
                else:
                    impl = _impl_for_key_dtype(leaf.dtype, record["prng_impl"])
                shape, dtype = tuple(data.shape), data.dtype
            else:
                impl, shape, dtype = None, tuple(np.shape(leaf)), _leaf_dtype(leaf)
            if list(shape) != record["shape"]:
                mismatched.append(f"{path}: checkpoint {tuple(record['shape'])}, target {shape}")
            typed[path] = (impl, dtype, sharding)
            if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
                template.append(
                    jax.ShapeDtypeStruct(shape, np.dtype(jnp.dtype(record["dtype"])),
                                         sharding=sharding))
            else:
                template.append(leaf)
        if mismatched:
            raise CheckpointError(
                f"{self._where(step)} does not match the target's shapes: {mismatched}")
        return jax.tree_util.tree_unflatten(treedef, template), typed


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
