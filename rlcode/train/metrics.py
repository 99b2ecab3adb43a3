"""Evaluation metrics (pass@k, best-of-n) and TensorBoard logging without TensorFlow.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", eq. 1): with n samples per prompt of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form (their Figure 3) avoiding the huge binomials.

`EventWriter` writes TensorBoard event files (scalars, text, and the run's hyperparameters for
the HParams tab) plus a `metrics.jsonl` copy of the scalars; `read_scalars` / `read_jsonl` read
them back for plot scripts and tests (any JSON lines file: `read_json_lines`,
`repair_json_lines`)::

    with EventWriter(workdir / "tb") as writer:
        writer.hparams(config, metrics=["eval/pass@1", "loss"])
        writer.scalars(step, {"loss": loss, "eval/pass@1": 0.25})
        writer.text(step, "samples/completion", completion)

Event files are written with tensorboard's record framing and protos only, and read back with
its TensorFlow-free record reader (`_read_records`). tensorboard's own writers
(`EventFileWriter`, `tensorboard.summary.Writer`) and event file loaders do their file IO
through `tensorboard.compat.tf`, which imports the real TensorFlow whenever it is installed; the
files here are plain Python files, so TensorFlow is never imported, installed or not.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import operator
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.compat.tensorflow_stub import errors as tb_errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.plugins.hparams import api_pb2 as hparams_api_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2 as hparams_plugin_data_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.record_writer import RecordWriter

__all__ = ["pass_at_k", "eval_summary", "EventWriter", "flatten_hparams", "read_scalars", "read_jsonl", "numbered_json_lines",
           "read_json_lines", "repair_json_lines", "JSONL_NAME"]

JSONL_NAME = "metrics.jsonl"
# TensorBoard lists a file as an event file when its name contains "tfevents".
EVENT_FILE_PATTERN = "events.out.tfevents.*"
_RESERVED_KEYS = ("step", "wall_time")
_writer_ids = itertools.count()


# --------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------


def pass_at_k(n: Any, c: Any, k: int) -> float | np.ndarray:
    """Unbiased pass@k for n samples of which c are correct (Chen et al. 2021, eq. 1).

    Args:
      n: number of samples, a python int or an integer array.
      c: number of correct samples, a python int or an integer array broadcastable with n.
      k: the k of pass@k, 1 <= k <= n.

    Returns:
      A python float when n and c are both scalars, else a float64 array of their broadcast shape.
    """
    k = operator.index(k)
    n_arr, c_arr = np.asarray(n), np.asarray(c)
    for name, a in (("n", n_arr), ("c", c_arr)):
        if a.dtype.kind not in "iu":
            raise TypeError(f"pass_at_k: {name} must be integers, got dtype {a.dtype}")
    n_arr, c_arr = np.broadcast_arrays(n_arr.astype(np.int64), c_arr.astype(np.int64))
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got k={k}")
    if np.any(k > n_arr):
        raise ValueError(f"pass_at_k: k must be <= n, got k={k} and n={n_arr.min()}")
    if np.any(c_arr < 0):
        raise ValueError(f"pass_at_k: c must be >= 0, got c={c_arr.min()}")
    if np.any(c_arr > n_arr):
        bad = np.argmax(c_arr > n_arr)
        raise ValueError(f"pass_at_k: c must be <= n, got c={c_arr.flat[bad]} > n={n_arr.flat[bad]}")
    # Factor j of each product is (1 - k / i) with i = n - c + 1 + j >= 1; factors j >= c are 1.
    # Fewer than k incorrect samples (n - c < k) means every k-subset holds a correct one.
    width = int(c_arr.max()) if c_arr.size else 0
    j = np.arange(width, dtype=np.int64)
    i = (n_arr - c_arr + 1)[..., None] + j
    factors = np.where(j < c_arr[..., None], 1.0 - k / i, 1.0)
    result = np.where(n_arr - c_arr < k, 1.0, 1.0 - np.prod(factors, axis=-1))
    if np.ndim(n) == 0 and np.ndim(c) == 0:
        return float(result)
    return result.astype(np.float64)


def eval_summary(correct: np.ndarray, ks: Sequence[int] = (1, 4, 16)) -> dict[str, float]:
    """pass@k and best-of-n of a [P, n] boolean matrix of per-sample correctness.

    Returns {"pass@k": mean over the P prompts of `pass_at_k(n, c_p, k)` for each k in ks with
    k <= n, "best_of_{n}": fraction of prompts with at least one correct sample (= pass@n)}.
    """
    correct = np.asarray(correct)
    if correct.ndim != 2:
        raise ValueError(f"eval_summary: correct must be [P, n], got shape {correct.shape}")
    P, n = correct.shape
    if P == 0 or n == 0:
        raise ValueError(f"eval_summary: correct must have at least one prompt and one sample, got {correct.shape}")
    c = correct.astype(bool).sum(axis=1)
    summary = {f"pass@{k}": float(np.mean(pass_at_k(n, c, k))) for k in ks if k <= n}
    summary[f"best_of_{n}"] = float(np.mean(c > 0))
    return summary


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class EventWriter:
    """Writes scalars and text to a new TensorBoard event file in `logdir`, plus `metrics.jsonl`.

    Each `scalars` call is one event (all its tags at one step and wall time) and one JSON line
    `{"step": s, "wall_time": t, tag: value, ...}` appended to `<logdir>/metrics.jsonl`; both
    files are flushed after every call so a crashed run loses nothing and a reader sees every
    step logged so far. A resumed run opens a new event file and appends to the same jsonl, after
    removing a torn last line (a writer killed mid-line, `repair_json_lines`) so that the next
    record starts on a line of its own; readers keep the last value written for a (tag, step).
    Not thread-safe.
    """

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        # The name TensorBoard's own writers use: time, host and pid keep concurrent and resumed
        # writers apart; the counter keeps two writers of one process apart.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_writer_ids)}"
        self.path = os.path.join(self.logdir, name)
        self._events = RecordWriter(open(self.path, "wb"))
        jsonl = os.path.join(self.logdir, JSONL_NAME)
        repair_json_lines(jsonl)
        self._jsonl = open(jsonl, "a", encoding="utf-8")
        self._closed = False
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: event_pb2.Event) -> None:
        if self._closed:
            raise RuntimeError(f"EventWriter for {self.logdir} is closed")
        self._events.write(event.SerializeToString())
        self._events.flush()

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Log `values` (tag -> number; None is skipped) at `step`. Non-finite values are kept."""
        step = int(step)
        values = {tag: float(v) for tag, v in values.items() if v is not None}
        reserved = [tag for tag in values if tag in _RESERVED_KEYS]
        if reserved:
            raise ValueError(f"EventWriter.scalars: tags {reserved} clash with the jsonl record's own keys")
        wall_time = time.time()
        event = event_pb2.Event(wall_time=wall_time, step=step)
        for tag, v in values.items():
            event.summary.value.add(tag=tag, simple_value=v)
        self._write(event)
        record = {"step": step, "wall_time": wall_time}
        record.update({tag: v if math.isfinite(v) else None for tag, v in values.items()})
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        """Log `text` (rendered as markdown) under `tag` at `step`, for TensorBoard's Text tab."""
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
            string_val=[str(text).encode("utf-8")],
        )
        event = event_pb2.Event(wall_time=time.time(), step=int(step))
        event.summary.value.add(tag=tag, tensor=tensor, metadata=text_metadata.create_summary_metadata("", ""))
        self._write(event)

    def hparams(self, hparams: Any, metrics: Sequence[str] = ()) -> dict[str, bool | int | float | str]:
        """Log the run's hyperparameters for TensorBoard's HParams tab, which tables and plots
        the runs of a log directory against each other by them and by `metrics`.

        hparams: the run's config, nested (an `ml_collections.ConfigDict` or a mapping), flattened
          by `flatten_hparams`. metrics: the scalar tags this run logs that sum it up (e.g.
          "eval/pass@1", "train/loss"): the tab's metric columns, each the tag's last value.
        Writes the hparams plugin's two summaries in one event at step 0: the session start (the
        values; `summary_v2.hparams_pb`) and the experiment (each hyperparameter's name and type,
        with no domain beyond a bool's two values, so that no other run's values fall outside it;
        and the metrics). TensorBoard takes the experiment summary of one run of the log directory
        for all of them, so runs meant to be compared share their config's fields and metrics.
        Returns the flat values.
        """
        values = flatten_hparams(hparams)
        now = time.time()
        start = hparams_summary.hparams_pb(values, start_time_secs=now)
        api = hparams_api_pb2
        types = {bool: api.DATA_TYPE_BOOL, str: api.DATA_TYPE_STRING}  # ints and floats: FLOAT64
        experiment = api.Experiment(metric_infos=[api.MetricInfo(name=api.MetricName(tag=tag)) for tag in metrics],
                                    time_created_secs=now)
        for name, value in sorted(values.items()):
            info = experiment.hparam_infos.add(name=name, type=types.get(type(value), api.DATA_TYPE_FLOAT64))
            if isinstance(value, bool):
                info.domain_discrete.extend([False, True])  # the whole domain: the tab's two check boxes
        plugin_data = hparams_plugin_data_pb2.HParamsPluginData(experiment=experiment)
        event = event_pb2.Event(wall_time=now, step=0)
        event.summary.value.add(tag=hparams_metadata.EXPERIMENT_TAG, tensor=hparams_metadata.NULL_TENSOR,
                                metadata=hparams_metadata.create_summary_metadata(plugin_data))
        event.summary.value.extend(start.value)
        self._write(event)
        return values

    def flush(self) -> None:
        if not self._closed:
            self._events.flush()
            self._jsonl.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._events.close()
            self._jsonl.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def flatten_hparams(config: Any) -> dict[str, bool | int | float | str]:
    """Dotted path -> value of every leaf of a nested config (`ml_collections.ConfigDict`,
    through its `to_dict()`, or a mapping), as the HParams tab takes them: bools, ints, floats and
    strings (numpy scalars as their Python equal) are kept, anything else (a list, None, a
    non-finite float) becomes its `str`. An empty section has no leaves and is left out."""
    from rlcode.checks import flatten  # noqa: PLC0415 (imports jax; only writers of hparams need it)

    if hasattr(config, "to_dict"):
        config = config.to_dict()
    out: dict[str, bool | int | float | str] = {}
    for name, value in flatten(config).items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # the tab's JSON has no NaN or infinity
        out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


# The stub record reader raises DataLossError both for a record cut short by the end of the file
# and for a checksum mismatch; only its message tells them apart.
_TRUNCATED = "has truncated record"


def _read_records(path: str) -> Iterator[bytes]:
    """The records of one event file, read by tensorboard's own record reader.

    From tensorboard: `PyRecordReader_New` of `tensorboard.compat.tensorflow_stub` (the reader
    TensorBoard itself uses when TensorFlow is absent) parses the TFRecord framing (u64 length,
    its masked CRC-32C, payload, the payload's masked CRC-32C) and checks both checksums,
    raising `DataLossError` when one fails or when the file ends inside a record. It is used
    directly rather than through `event_file_loader.RawEventFileLoader`, which resolves its
    reader through `tensorboard.compat.tf` (the real TensorFlow whenever it is installed) and
    ends the file silently on any `DataLossError`, corrupted or torn.

    Added here: the two kinds of `DataLossError` are told apart. A record cut short by the end
    of the file (a writer still writing, or killed mid-record, whose resumed run then writes a
    new file) ends that file's records; any other failure is a ValueError naming the file, the
    record's index and its byte offset, never a silent loss of the records after it.
    """
    reader = PyRecordReader_New(path, 0, None, None)
    index, offset = 0, 0
    try:
        while True:
            try:
                reader.GetNext()
            except tb_errors.OutOfRangeError:  # the end of the file, between records
                return
            except tb_errors.DataLossError as e:
                if _TRUNCATED in e.message:
                    return
                detail = e.message.removeprefix(f"{path} ")
                raise ValueError(f"{path}: corrupted record {index} at byte {offset} ({detail})") from None
            data = reader.record()
            yield data
            index, offset = index + 1, offset + 8 + 4 + len(data) + 4
    finally:
        reader.file_handle.close()


def _scalar_value(value: summary_pb2.Summary.Value) -> float | None:
    """The number held by a summary value: a v1 simple_value or a scalars-plugin 0-d tensor."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        t = value.tensor
        for field in ("float_val", "double_val", "int_val", "int64_val"):
            if getattr(t, field):
                return float(getattr(t, field)[0])
        if t.tensor_content:
            dtype = {types_pb2.DT_FLOAT: np.float32, types_pb2.DT_DOUBLE: np.float64}.get(t.dtype)
            if dtype is not None:
                return float(np.frombuffer(t.tensor_content, dtype)[0])
    return None


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in `logdir`: tag -> [(step, value)] sorted by step.

    When a tag has several values at one step (a resumed run re-logs steps), the last written
    (latest wall time; ties by file then position) is kept. A record cut short by the end of its
    file (a writer killed mid-record) ends that file; a corrupted record anywhere is a ValueError
    naming the file, record and byte offset (`_read_records`).
    """
    points = []  # (wall_time, file index, position, tag, step, value)
    for file_index, path in enumerate(sorted(glob.glob(os.path.join(os.fspath(logdir), EVENT_FILE_PATTERN)))):
        for position, record in enumerate(_read_records(path)):
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                number = _scalar_value(value)
                if number is not None:
                    points.append((event.wall_time, file_index, position, value.tag, event.step, number))
    points.sort(key=lambda p: p[:3])
    latest: dict[str, dict[int, float]] = {}
    for *_, tag, step, number in points:
        latest.setdefault(tag, {})[step] = number
    return {tag: sorted(by_step.items()) for tag, by_step in sorted(latest.items())}


def _torn_tail(path: str, size: int, block: int = 1 << 16) -> tuple[int, bytes]:
    """(offset, bytes) of the part of a file after its last newline."""
    with open(path, "rb") as f:
        end = size
        tail = b""
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            tail = f.read(end - start) + tail
            cut = tail.rfind(b"\n")
            if cut >= 0:
                return size - len(tail) + cut + 1, tail[cut + 1:]
            end = start
        return 0, tail


def repair_json_lines(path: str | os.PathLike) -> int:
    """Make a JSON lines file that a killed writer left without a final newline appendable again:
    a last line that is a whole JSON object gets its newline, a torn one is cut off (with a
    RuntimeWarning naming the file). Returns the number of bytes removed; a missing file is left
    alone."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if size == 0:
        return 0
    offset, tail = _torn_tail(path, size)
    if not tail:
        return 0
    try:
        whole = isinstance(json.loads(tail.decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        whole = False
    if whole:
        with open(path, "ab") as f:
            f.write(b"\n")
        return 0
    with open(path, "r+b") as f:
        f.truncate(offset)
    warnings.warn(f"{path}: removed a torn last line ({len(tail)} bytes, a writer killed mid-line) before "
                  "appending", RuntimeWarning, stacklevel=2)
    return len(tail)


def numbered_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each record of a JSON lines file, as `read_json_lines` reads them."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if number == len(lines):  # no newline after it: the last line of a writer killed mid-write
                warnings.warn(f"{path}:{number}: skipped a torn last line ({len(raw)} bytes, a writer killed "
                              "mid-line)", RuntimeWarning, stacklevel=2)
                continue
            raise ValueError(f"{path}:{number}: not a JSON record: {raw[:80]!r}") from None
        yield number, record


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a JSON lines file, in order.

    A last line without its newline that is not a whole JSON object (a writer killed mid-line) is
    skipped with a RuntimeWarning naming the file; any other line that is not a JSON object raises
    a ValueError naming the file and the line.
    """
    return [record for _, record in numbered_json_lines(os.fspath(path))]


def read_jsonl(logdir: str | os.PathLike) -> list[dict]:
    """The records of `<logdir>/metrics.jsonl`, one per step, sorted by step.

    Records of one step are merged in file order, later values replacing earlier ones (a
    resumed run re-logs steps; a training step and an eval at the same step are two records).
    Non-finite values read back as None. A torn last line is skipped with a warning; a malformed
    line elsewhere, or a record without a step, is a ValueError naming the file and line
    (`read_json_lines`).
    """
    path = os.path.join(os.fspath(logdir), JSONL_NAME)
    merged: dict[int, dict] = {}
    for number, record in numbered_json_lines(path):
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            raise ValueError(f"{path}:{number}: a record without a step: {json.dumps(record)[:80]}")
        merged.setdefault(int(step), {}).update(record)
    return [merged[step] for step in sorted(merged)]
