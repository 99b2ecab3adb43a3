"""rlcode.train.metrics: pass@k against exact binomial arithmetic, eval summaries of a hand-made
matrix, and event files / metrics.jsonl read back by our readers and by TensorBoard's own
(`plugin_event_accumulator`, what the TensorBoard UI reads) without TensorFlow being imported.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
import ml_collections
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.plugins.hparams import api_pb2 as hparams_api
from tensorboard.plugins.hparams import metadata as hparams_metadata

from rlcode.train.metrics import (EventWriter, eval_summary, flatten_hparams, pass_at_k, read_json_lines, read_jsonl,
                                  read_scalars, repair_json_lines)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


GRID = [(n, c, k) for n in range(1, 13) for c in range(n + 1) for k in range(1, n + 1)]
GRID += [(200, 0, 16), (200, 1, 1), (200, 3, 100), (200, 150, 16), (200, 190, 16), (200, 200, 200),
         (2000, 37, 1000), (2000, 1999, 1)]


def test_pass_at_k_matches_exact_binomials():
    for n, c, k in GRID:
        got = pass_at_k(n, c, k)
        assert type(got) is float
        assert got == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15), (n, c, k)
    # The cases with a closed form, exactly.
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k: every 3 samples hold a correct one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, rel=1e-15)


def test_pass_at_k_elementwise_on_arrays():
    n = np.array([[5, 8, 8], [16, 16, 3]])
    c = np.array([[0, 3, 8], [15, 1, 2]])
    got = pass_at_k(n, c, 3)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (2, 3)
    want = [[float(exact_pass_at_k(int(a), int(b), 3)) for a, b in zip(ra, rb)] for ra, rb in zip(n, c)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    # Broadcasting a scalar n over a vector of c (the per-prompt use).
    c16 = np.arange(17)
    np.testing.assert_allclose(pass_at_k(16, c16, 4), [float(exact_pass_at_k(16, int(x), 4)) for x in c16], rtol=1e-12)


@pytest.mark.parametrize(
    "n, c, k, message",
    [(4, 1, 5, "k must be <= n"), (4, 1, 0, "k must be >= 1"), (4, 5, 2, "c must be <= n"),
     (4, -1, 2, "c must be >= 0"), (np.array([4, 2]), np.array([1, 1]), 3, "k must be <= n"),
     (np.array([4, 2]), np.array([1, 3]), 1, "c must be <= n")],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_eval_summary_hand_made():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], bool)  # c = 1, 0, 3 of n = 4
    summary = eval_summary(correct, ks=(1, 2, 4, 16))
    assert set(summary) == {"pass@1", "pass@2", "pass@4", "best_of_4"}  # pass@16 needs n >= 16
    assert summary["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    # pass@2: 1 - C(3,2)/C(4,2) = 1/2 for c=1; 0 for c=0; 1 for c=3 (one incorrect sample < k).
    assert summary["pass@2"] == pytest.approx(0.5)
    assert summary["pass@4"] == summary["best_of_4"] == pytest.approx(2 / 3)
    assert all(type(v) is float for v in summary.values())

    correct16 = np.zeros((2, 16), bool)
    correct16[0, 5] = True
    summary = eval_summary(correct16)
    assert list(summary) == ["pass@1", "pass@4", "pass@16", "best_of_16"]
    assert summary["pass@1"] == pytest.approx(1 / 32)
    assert summary["pass@4"] == pytest.approx(4 / 16 / 2)  # one correct: pass@k = k / n
    assert summary["pass@16"] == summary["best_of_16"] == 0.5
    with pytest.raises(ValueError, match=r"\[P, n\]"):
        eval_summary(np.ones(4, bool))


def accumulator(logdir):
    acc = plugin_event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def test_scalars_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    values = {tag: rng.normal(size=5) * 10.0 ** rng.integers(-6, 6) for tag in ("loss", "eval/pass@1", "lr")}
    with EventWriter(tmp_path) as writer:
        for step in range(5):
            logged = {tag: v[step] for tag, v in values.items()}
            logged["lr"] = jnp.float32(logged["lr"])  # jax and numpy scalars both convert
            logged["skipped"] = None
            writer.scalars(10 * step, logged)
    got = read_scalars(tmp_path)
    assert set(got) == set(values)
    for tag, v in values.items():
        assert [s for s, _ in got[tag]] == [0, 10, 20, 30, 40]
        np.testing.assert_array_equal([x for _, x in got[tag]], v.astype(np.float32))
    # TensorBoard's own reader sees the same points under its scalars plugin.
    acc = accumulator(tmp_path)
    assert set(acc.PluginTagToContent("scalars")) == set(values)
    for tag, v in values.items():
        events = acc.Tensors(tag)
        assert [e.step for e in events] == [0, 10, 20, 30, 40]
        tb_values = [np.float32(e.tensor_proto.float_val[0]) for e in events]
        np.testing.assert_array_equal(tb_values, v.astype(np.float32))


def test_metrics_jsonl_and_non_finite(tmp_path):
    with EventWriter(tmp_path) as writer:
        writer.scalars(1, {"loss": 0.5, "reward": np.float64(2.0)})
        writer.scalars(2, {"loss": float("nan"), "reward": float("inf")})
        # Every call is on disk before close: a reader during training sees it.
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"step", "wall_time", "loss", "reward"}
    assert (first["step"], first["loss"], first["reward"]) == (1, 0.5, 2.0)
    assert first["wall_time"] == pytest.approx(time.time(), abs=60)
    assert (second["step"], second["loss"], second["reward"]) == (2, None, None)
    assert read_jsonl(tmp_path) == [first, second]
    got = read_scalars(tmp_path)  # the event file keeps the non-finite values themselves
    assert math.isnan(got["loss"][1][1]) and got["reward"][1][1] == math.inf
    with EventWriter(tmp_path) as writer, pytest.raises(ValueError, match="clash"):
        writer.scalars(3, {"step": 1.0})


def test_text_summary_for_the_text_tab(tmp_path):
    text = "def f(x):\n    return x + 1  # ünïcode"
    with EventWriter(tmp_path) as writer:
        writer.text(7, "samples/completion", text)
        writer.scalars(7, {"loss": 1.0})
    acc = accumulator(tmp_path)
    assert list(acc.PluginTagToContent("text")) == ["samples/completion"]
    assert acc.SummaryMetadata("samples/completion").plugin_data.plugin_name == "text"
    (event,) = acc.Tensors("samples/completion")
    assert event.step == 7
    assert event.tensor_proto.string_val[0].decode("utf-8") == text
    assert list(read_scalars(tmp_path)) == ["loss"]  # text is not a scalar


def test_hparams_for_the_hparams_tab(tmp_path):
    config = ml_collections.ConfigDict({
        "seed": 3, "resume": False, "scale": np.float32(0.5), "budget": float("inf"),
        "optim": {"lr": 1e-3, "betas": [0.9, 0.95], "schedule": {"name": "cosine", "warmup": 10}},
        "model": {"init_from": None, "dtype": "bfloat16"}, "eval": {"ks": (1, 4, 16)}, "lora": {},
    })
    want = {"seed": 3, "resume": False, "scale": 0.5, "budget": "inf", "optim.lr": 1e-3, "optim.betas": "[0.9, 0.95]",
            "optim.schedule.name": "cosine", "optim.schedule.warmup": 10, "model.init_from": "None",
            "model.dtype": "bfloat16", "eval.ks": "(1, 4, 16)"}
    with EventWriter(tmp_path) as writer:
        assert writer.hparams(config, metrics=["eval/pass@1", "train/loss"]) == want
        writer.scalars(1, {"eval/pass@1": 0.25, "train/loss": 2.0})
    assert flatten_hparams(config.to_dict()) == want  # a plain nested mapping flattens alike
    assert all(type(v) in (bool, int, float, str) for v in want.values())

    # TensorBoard's own reader finds the hparams plugin's two summaries and parses them.
    acc = accumulator(tmp_path)
    content = acc.PluginTagToContent("hparams")
    assert set(content) == {hparams_metadata.EXPERIMENT_TAG, hparams_metadata.SESSION_START_INFO_TAG}
    start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    got = {}
    for name, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        got[name] = {"bool_value": value.bool_value, "number_value": value.number_value,
                     "string_value": value.string_value}[kind]
        assert kind == {bool: "bool_value", str: "string_value"}.get(type(want[name]), "number_value"), name
    assert got == want
    assert start.start_time_secs == pytest.approx(time.time(), abs=60)
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == ["eval/pass@1", "train/loss"]
    infos = {info.name: info for info in experiment.hparam_infos}
    assert sorted(infos) == sorted(want)
    assert infos["resume"].type == hparams_api.DATA_TYPE_BOOL and list(infos["resume"].domain_discrete) == [False, True]
    assert infos["optim.lr"].type == infos["seed"].type == hparams_api.DATA_TYPE_FLOAT64
    assert infos["eval.ks"].type == hparams_api.DATA_TYPE_STRING
    assert not infos["optim.lr"].HasField("domain_interval") and not infos["eval.ks"].domain_discrete
    # The hparams event holds no scalar.
    assert list(read_scalars(tmp_path)) == ["eval/pass@1", "train/loss"]


def test_resumed_run_keeps_last_written(tmp_path):
    with EventWriter(tmp_path) as writer:
        for step in range(4):
            writer.scalars(step, {"loss": float(step)})
        writer.scalars(3, {"eval/pass@1": 0.25})  # an eval at a logged train step: merged, not lost
    with EventWriter(tmp_path) as writer:  # resumed from the checkpoint of step 1: re-logs 2, 3
        for step in range(2, 6):
            writer.scalars(step, {"loss": 100.0 + step})
    assert len([f for f in os.listdir(tmp_path) if "tfevents" in f]) == 2
    got = read_scalars(tmp_path)
    assert got["loss"] == [(0, 0.0), (1, 1.0), (2, 102.0), (3, 103.0), (4, 104.0), (5, 105.0)]
    assert got["eval/pass@1"] == [(3, 0.25)]
    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [0.0, 1.0, 102.0, 103.0, 104.0, 105.0]
    assert records[3]["eval/pass@1"] == 0.25


def test_truncated_tail_is_ignored_and_corruption_raises(tmp_path):
    with EventWriter(tmp_path) as writer:
        writer.scalars(0, {"loss": 1.0})
        writer.scalars(1, {"loss": 2.0})
        path = writer.path
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    with open(path, "ab") as f:
        f.write(b"\x20\x00\x00")  # ... and mid-record
    assert read_scalars(tmp_path) == {"loss": [(0, 1.0), (1, 2.0)]}
    with pytest.warns(RuntimeWarning, match="torn last line"):
        assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 1]
    data = bytearray(open(path, "rb").read())
    data[-12] ^= 0xFF  # a bit of the last complete record's payload
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="corrupted record"):
        read_scalars(tmp_path)


def write_losses(logdir, steps):
    """An event file with one `loss` event per step; returns its path and each record's offset."""
    with EventWriter(logdir) as writer:
        for step in steps:
            writer.scalars(step, {"loss": float(step)})
        path = writer.path
    data, offsets = open(path, "rb").read(), []
    while not offsets or offsets[-1] < len(data):  # u64 length, u32 crc, payload, u32 crc
        start = offsets[-1] if offsets else 0
        offsets.append(start + 16 + int.from_bytes(data[start:start + 8], "little"))
    return path, [0] + offsets[:-1]


@pytest.mark.parametrize("where, part", [(2, "payload"), (2, "length"), (1, "payload crc")])
def test_a_garbled_record_in_the_middle_raises_naming_file_record_and_offset(tmp_path, where, part):
    path, offsets = write_losses(tmp_path, range(5))  # records: the file version, then steps 0..4
    data = bytearray(open(path, "rb").read())
    start, end = offsets[where], offsets[where + 1]
    index = {"length": start, "payload": start + 12, "payload crc": end - 1}[part]
    data[index] ^= 0x01
    open(path, "wb").write(bytes(data))
    message = re.escape(f"{path}: corrupted record {where} at byte {start}")
    with pytest.raises(ValueError, match=message):
        read_scalars(tmp_path)


def test_a_torn_tail_in_an_earlier_file_is_tolerated(tmp_path):
    # A writer killed mid-record, then the resumed run's writer in a new file.
    first, offsets = write_losses(tmp_path, range(3))
    with open(first, "r+b") as f:
        f.truncate(offsets[-1] + 20)  # the last record (step 2) cut inside its payload
    write_losses(tmp_path, range(2, 4))
    assert read_scalars(tmp_path) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]}
    # A torn header (fewer than the 12 bytes of length and checksum) is a torn tail too.
    with open(first, "r+b") as f:
        f.truncate(offsets[-1] + 5)
    assert read_scalars(tmp_path)["loss"][:2] == [(0, 0.0), (1, 1.0)]


def test_a_run_killed_mid_line_is_readable_and_resumable(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    with EventWriter(tmp_path) as writer:
        writer.scalars(0, {"loss": 1.0})
        writer.scalars(1, {"loss": 2.0})
    with open(jsonl, "a") as f:
        f.write('{"step": 2, "lo')  # SIGKILL mid-write
    # Every reader skips the torn last line, with a warning naming the file.
    with pytest.warns(RuntimeWarning, match=re.escape(str(jsonl)) + ":3: skipped a torn last line"):
        assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 1]
    # The resumed run's writer cuts it off, so its records start on lines of their own.
    with pytest.warns(RuntimeWarning, match="removed a torn last line"):
        writer = EventWriter(tmp_path)
    with writer:
        writer.scalars(2, {"loss": 3.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path)] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert jsonl.read_text().endswith('"loss": 3.0}\n')
    # A whole record that lost only its newline is kept.
    with open(jsonl, "a") as f:
        f.write('{"step": 3, "loss": 4.0}')
    with EventWriter(tmp_path) as writer:
        writer.scalars(4, {"loss": 5.0})
    assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 1, 2, 3, 4]
    assert repair_json_lines(jsonl) == 0 and repair_json_lines(tmp_path / "missing.jsonl") == 0


def test_a_malformed_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path):
    with EventWriter(tmp_path) as writer:
        for step in range(3):
            writer.scalars(step, {"loss": float(step)})
    jsonl = tmp_path / "metrics.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    jsonl.write_text(lines[0] + '{"step": 1, "lo\n' + lines[2])
    with pytest.raises(ValueError, match=re.escape(f"{jsonl}:2: not a JSON record")):
        read_jsonl(tmp_path)
    jsonl.write_text(lines[0] + '{"loss": 1.0}\n' + lines[2])
    with pytest.raises(ValueError, match=re.escape(f"{jsonl}:2: a record without a step")):
        read_jsonl(tmp_path)
    other = tmp_path / "episodes.jsonl"  # any JSON lines file, e.g. the agent's recorded turns
    other.write_text('{"step": 0, "turns": []}\n{"step": 10, "tu')
    with pytest.warns(RuntimeWarning, match=re.escape(str(other))):
        assert read_json_lines(other) == [{"step": 0, "turns": []}]
    other.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"{other}:2")):
        read_json_lines(other)


def test_tensorflow_is_never_imported(tmp_path):
    # A stand-in `tensorflow` is importable in the child, so any code path that tries TensorFlow
    # (as tensorboard's own writers and readers do whenever it is installed) imports it.
    fake = tmp_path / "site" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = textwrap.dedent(f"""
        import importlib.util, sys
        assert importlib.util.find_spec("tensorflow") is not None
        import numpy as np
        from rlcode.train.metrics import EventWriter, eval_summary, read_jsonl, read_scalars
        with EventWriter({str(tmp_path / "logs")!r}) as w:
            w.scalars(1, {{"loss": 0.5, **eval_summary(np.ones((2, 16), bool))}})
            w.text(1, "note", "hello")
            w.hparams({{"optim": {{"lr": 0.1}}, "ks": [1, 4]}}, metrics=["loss"])
        assert read_scalars({str(tmp_path / "logs")!r})["pass@1"] == [(1, 1.0)]
        assert read_jsonl({str(tmp_path / "logs")!r})[0]["loss"] == 0.5
        print("tensorflow" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"
