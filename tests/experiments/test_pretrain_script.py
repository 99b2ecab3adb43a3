"""experiments/pretrain.py: a tiny run end to end (export, --publish), a partial run that --publish
refuses, and config errors as one line with exit status 2 (also through experiments.train)."""

import json
import os
import subprocess
import sys

import pytest
from support.cli import assert_one_line_error
from support.tiny_corpus import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny(tmp_path, *flags):
    return ["--config=configs/pretrain_code.py:tokenizer=byte", f"--config.workdir={tmp_path / 'run'}",
            f"--config.data.corpus_dir={tmp_path / 'corpus'}", "--config.data.seq_len=64",
            "--config.data.rows_per_step=4", "--config.data.eval_batch=4", "--config.model.d_model=32",
            "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
            "--config.model.head_dim=16", "--config.model.ffw_dim=64", "--config.optim.warmup_steps=1", *flags]


def run(module, *flags):
    return subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_finished_run_is_exported_and_published_a_partial_one_is_not(tmp_path):
    write_corpus(tmp_path / "corpus")
    pub = tmp_path / "published"
    out = run("experiments.pretrain", *tiny(tmp_path, "--config.train.steps=2", "--publish",
                                            f"--publish_dir={pub}"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):out.stdout.rindex("}") + 1])
    assert result["completed"] and result["steps"] == 2 and result["heldout_bpb"] > 0
    assert sorted(os.listdir(pub)) == sorted(os.listdir(tmp_path / "run" / "base"))
    assert {"config.json", "model.safetensors", "pretrain.json", "tokenizer.json"} <= set(os.listdir(pub))
    assert json.load(open(pub / "pretrain.json"))["step"] == 2
    # A run stopped by its time budget after one step: exported, but not published.
    out = run("experiments.pretrain", *tiny(tmp_path, "--config.train.steps=50", "--config.train.max_minutes=1e-6",
                                            f"--config.workdir={tmp_path / 'partial'}", "--publish",
                                            f"--publish_dir={pub}"))
    assert out.returncode == 1 and "not finished (1 of 50 steps)" in out.stderr, out.stderr[-3000:]
    assert json.load(open(tmp_path / "partial" / "base" / "pretrain.json"))["step"] == 1
    assert json.load(open(pub / "pretrain.json"))["step"] == 2


def test_config_errors_are_one_line(tmp_path):
    write_corpus(tmp_path / "corpus")
    assert_one_line_error(run("experiments.pretrain", *tiny(tmp_path, "--config.data.seqlen=8")),
                          "data.seqlen", "data.seq_len")
    assert_one_line_error(run("experiments.train", *tiny(tmp_path, "--config.data.rows_per_step=0")),
                          "data.rows_per_step=0")
    assert not (tmp_path / "run").exists()
