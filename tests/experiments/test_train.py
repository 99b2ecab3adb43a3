"""The README's main-job command, shrunk by flags to a few steps of a tiny model; config errors
are one line on stderr and exit status 2."""

import json
import os
import subprocess
import sys

import pytest
from support.cli import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = [
    "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1", "--config.model.head_dim=16", "--config.model.ffw_dim=64",
    "--config.task.levels=(1,)", "--config.task.num_train=24", "--config.task.num_eval=4",
    "--config.task.max_prompt_len=160", "--config.sampling.max_new_tokens=48",
    "--config.rollout.prompts_per_step=2", "--config.rollout.group_size=4", "--config.sft.steps=2",
    "--config.sft.batch_size=4", "--config.train.steps=2", "--config.eval.every=0", "--config.eval.num_samples=4",
    "--config.eval.ks=(1,4)", "--config.eval.prompts_per_batch=4",
]


@pytest.mark.slow
def test_main_job_command_runs(tmp_path):
    cmd = [sys.executable, "-m", "experiments.train", "--config=configs/grpo_synth.py:loss=dapo,base=bytes",
           f"--config.workdir={tmp_path / 'run'}", f"--config.sft.cache_dir={tmp_path / 'sft'}", *TINY,
           "--config.rollout.async=True"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["completed"] and result["steps"] == 2
    start, end = result["start -> end"]["eval/pass@1"]
    assert 0 <= start <= 1 and 0 <= end <= 1
    assert "eval @ step 2" in out.stderr  # the final eval
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
    assert (tmp_path / "run" / "summary.json").is_file()
    assert json.load(open(tmp_path / "run" / "config.json"))["rollout"]["async_mode"] is True
    assert "dapo async 2/2" in out.stderr


def test_async_flag_alias():
    from experiments.cli import translate_aliases

    assert translate_aliases(["x", "--config.rollout.async=True", "--config.seed=1"]) == [
        "x", "--config.rollout.async_mode=True", "--config.seed=1"]
    assert translate_aliases(["--config.rollout.async"]) == ["--config.rollout.async_mode"]
    assert translate_aliases(["--config.rollout.asyncx=1"]) == ["--config.rollout.asyncx=1"]


def run_train(*flags):
    cmd = [sys.executable, "-m", "experiments.train", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "flag, texts",
    [
        ("--config.rollout.grup_size=4", ["unknown config field 'rollout.grup_size'", "rollout.group_size"]),
        ("--config.optim.lr=nan", ["optim.lr=nan"]),
        ("--config.task.num_train=0", ["task.num_train=0"]),
        ("--config.seed=-1", ["seed=-1"]),
        ("--config.rollout.group_size=1000000", ["estimated peak memory", "reduce rollout.group_size"]),
        ("--config.rollout.group_size=1.5", ["rollout.group_size=1.5"]),
    ],
)
def test_config_errors_are_one_line_and_exit_2(tmp_path, flag, texts):
    run = tmp_path / "run"
    out = run_train("--config=configs/grpo_synth.py:base=bytes", f"--config.workdir={run}",
                    f"--config.sft.cache_dir={tmp_path / 'sft'}", *TINY, "--config.train.steps=1", flag)
    assert_one_line_error(out, *texts)
    assert not run.exists() and not (tmp_path / "sft").exists()  # refused before the warm start


@pytest.mark.slow
def test_agent_config_errors_and_a_changed_resume_are_refused(tmp_path):
    out = run_train("--config=configs/agent_repo.py", "--config.agent.max_turn=3", f"--config.workdir={tmp_path}")
    assert_one_line_error(out, "agent.max_turn", "agent.max_turns")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"seed": 0, "job": "synth"}))
    out = run_train("--config=configs/grpo_synth.py:base=bytes", f"--config.workdir={run}", *TINY, "--config.seed=5",
                    "--config.resume=True")
    line = assert_one_line_error(out, "resume: the config differs", "seed 0 -> 5", "resume_override")
    assert "job \"synth\" -> (absent)" in line
    assert json.loads((run / "config.json").read_text()) == {"seed": 0, "job": "synth"}


def test_help_lists_each_job_configs_arguments():
    out = run_train("--help")
    assert out.returncode == 1 and not out.stderr, out.stderr[-2000:]  # absl's --help exits with 1
    text = " ".join(out.stdout.split())  # absl wraps the help text
    for expected in ("configs/grpo_synth.py: loss=grpo|dr_grpo|dapo|gspo|cispo|ppo, attention=nsa|squid, mlp=moe",
                     "configs/agent_repo.py:", "configs/pretrain_code.py: tokenizer=bpe|byte", "--print_config"):
        assert expected in text, expected
    assert "bytes,levels" not in text  # an entry combining choices is split into them


def test_print_config_shows_the_resolved_fields_and_runs_nothing(tmp_path):
    run_dir = tmp_path / "run"
    out = run_train("--config=configs/grpo_synth.py:loss=dapo", "--print_config", "--config.rollout.group_size=4",
                    f"--config.workdir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "# --config=configs/grpo_synth.py:loss=dapo (job: synth)"
    assert "rollout.group_size = 4  # valid: an integer >= 1" in lines
    assert f"workdir = '{run_dir}'  # valid: a string" in lines
    # The default warm start is the pretrained base, with its own tokenizer.
    assert any(line.startswith("tokenizer = 'init_from'  # valid: a string; or a tokenizer.json") for line in lines)
    assert any(line.startswith("model.init_from = 'checkpoints/code_base'") for line in lines)
    # The architecture printed is the checkpoint's, as the job will load it (not the byte policy's).
    base = json.load(open(os.path.join(ROOT, "checkpoints", "code_base", "config.json")))
    assert f"model.d_model = {base['hidden_size']}  # valid: an integer >= 1" in lines
    assert f"model.vocab_size = {base['vocab_size']}  # valid: an integer >= 1" in lines
    assert "loss.clip_high = 0.28  # valid: a finite number >= 0" in lines  # the dapo recipe's clip-higher
    assert len(lines) > 100 and not run_dir.exists()
    # An unknown field is still the one-line error, with or without --print_config.
    assert_one_line_error(run_train("--print_config", "--config.rollout.grup_size=4"), "rollout.group_size")
