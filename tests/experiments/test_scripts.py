"""The benchmark and inspection scripts run end to end at small sizes and write what they promise."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*argv):
    out = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_bench_sampling_quick(tmp_path):
    path = tmp_path / "bench.json"
    stdout = run("experiments.bench_sampling", "--quick", "--repeats=1", f"--out={path}")
    assert "speedup" in stdout
    result = json.loads(path.read_text())
    assert [r["benchmark"] for r in result["rows"]] == ["decode", "groups"]
    for r in result["rows"]:
        assert r["same_tokens"], r  # the baselines draw the same tokens: equal work compared
        assert r["baseline_s"] > 0 and r["ours_s"] > 0


@pytest.mark.slow
def test_model_info_counts_qwen_shape():
    stdout = run("experiments.model_info", "--config=configs/model.py:qwen0.5b", "--config.mesh.data=1",
                 "--config.mesh.fsdp=4", "--config.mesh.tensor=2")
    assert "parameters: 494.0M" in stdout
    specs = {line.split()[0]: line.split(")", 1)[1].strip() for line in stdout.splitlines() if line.startswith("[")}
    assert specs["['block_0']['attn']['proj']['wq']"] == "P('fsdp', 'tensor', None)"
    assert specs["['block_0']['attn']['proj']['wo']"] == "P('tensor', None, 'fsdp')"
    assert specs["['block_0']['mlp']['w_down']"] == "P('tensor', 'fsdp')"
    assert specs["['embed']"] == "P('tensor', 'fsdp')"
    # 14 query heads do not split over a tensor axis of 4: that dimension stays replicated.
    stdout = run("experiments.model_info", "--config=configs/model.py:qwen0.5b", "--config.mesh.data=1",
                 "--config.mesh.tensor=4")
    specs = {line.split()[0]: line.split(")", 1)[1].strip() for line in stdout.splitlines() if line.startswith("[")}
    assert specs["['block_0']['attn']['proj']['wq']"] == "P(None, None, None)"
    assert specs["['block_0']['mlp']['w_gate']"] == "P(None, 'tensor')"


@pytest.mark.slow
def test_bench_logprobs_quick(tmp_path):
    path = tmp_path / "bench.json"
    stdout = run("experiments.bench_logprobs", "--quick", f"--out={path}")
    assert "summary" in stdout
    result = json.loads(path.read_text())
    variants = {r["variant"] for r in result["results"]}
    assert variants == {"naive", "chunked"}
    naive = next(r for r in result["results"] if r["variant"] == "naive")
    chunked = next(r for r in result["results"] if r["variant"] == "chunked")
    # Same numbers from both paths; the chunked one plans far less temporary memory.
    assert abs(naive["value"] - chunked["value"]) < 1e-4 * abs(naive["value"])
    assert chunked["xla_temp_bytes"] < naive["xla_temp_bytes"] / 4


@pytest.mark.slow
def test_bench_scoring_quick(tmp_path):
    """Scoring the loss positions only gives the same log-probs and loss as scoring all of them."""
    path = tmp_path / "bench.json"
    # The synthesis job's model cut to one layer: the equality checked here does not depend on size.
    stdout = run("experiments.bench_scoring", "--quick", "--config=configs/grpo_synth.py:base=bytes", "--config.model.num_layers=1",
                 f"--out={path}")
    assert "| train |" in stdout
    result = json.loads(path.read_text())
    assert result["max_logp_diff"] < 1e-5 and result["score_index_width"] < result["length"]
    assert abs(result["loss"]["full"] - result["loss"]["scored"]) <= 1e-5 * max(1.0, abs(result["loss"]["full"]))
    assert [r["stage"] for r in result["results"]] == ["score", "train"]
    assert all(r["full_s"] > 0 and r["scored_s"] > 0 for r in result["results"])


@pytest.mark.slow
def test_bench_rl_step_quick(tmp_path):
    """Every stage is timed; the three layouts of the score and train stages agree."""
    path = tmp_path / "bench.json"
    stdout = run("experiments.bench_rl_step", "--quick", "--config.model.num_layers=1", f"--out={path}")
    assert "| train | shared+on_policy |" in stdout
    result = json.loads(path.read_text())
    rows = result["results"]
    assert [r["stage"] for r in rows[:2]] == ["sample", "grade"]
    assert rows[1]["reference_pass_rate"] == 1.0  # reference solutions: every row's tests ran and passed
    steps = {r["variant"]: r for r in rows if r["stage"] == "step"}
    assert set(steps) == {"per_row", "shared_prompts", "shared+on_policy"}
    for r in steps.values():
        assert r["logp_diff"] < 1e-5 and abs(r["loss"] - steps["per_row"]["loss"]) < 1e-5
    staged = [r for r in rows if r["stage"] in ("score", "train")]
    assert len(staged) == 6 and all(r["median_s"] > 0 and r["xla_flops"] > 0 and r["speedup"] > 0 for r in staged)
    score = {r["variant"]: r for r in staged if r["stage"] == "score"}
    assert score["per_row"]["passes"] == score["shared_prompts"]["passes"] == 2  # old + reference
    assert score["shared+on_policy"]["passes"] == 1  # the old log-probs come from the train step
    assert score["shared_prompts"]["xla_flops"] < score["per_row"]["xla_flops"]  # G - 1 of G prompts not recomputed


@pytest.mark.slow
def test_bench_continuous_quick(tmp_path):
    """Static batch and slot counts on both length distributions, the same tokens (checked by the
    script on every batch), lengths summarised."""
    path = tmp_path / "bench.json"
    stdout = run("experiments.bench_continuous", "--quick", "--slots=2,4", "--config.model.num_layers=1", f"--out={path}")
    assert "gen tok/s" in stdout
    rows = json.loads(path.read_text())["rows"]
    assert {(r["case"], r["variant"]) for r in rows} == {
        (c, v) for c in ("main_job", "varied") for v in ("static", "slots=2", "slots=4")}
    for r in rows:
        assert r["seconds_per_batch"] > 0 and r["speedup"] > 0 and r["generated_tokens_per_s"] > 0
        L = r["lengths"]
        assert 1 <= L["min"] <= L["median"] <= L["max"] and L["static_waste"] >= 1.0
    varied = next(r for r in rows if r["case"] == "varied")["lengths"]
    assert varied["min"] < varied["max"]  # the stop tokens end rows at different steps


@pytest.mark.slow
def test_bench_load_writes_loads_and_reports_memory(tmp_path):
    path = tmp_path / "bench.json"
    stdout = run("experiments.bench_load", "--shape=tiny", f"--workdir={tmp_path}", "--repeats=1", "--shard_mb=1",
                 f"--out={path}")
    assert "load s" in stdout
    result = json.loads(path.read_text())
    # tiny: V=1024, D=64, F=192, 2 layers of GQA 4/2 with head_dim 16, q/k/v biases, tied embeddings:
    # V*D + D + 2 * (2*D + D*N*H + 2*D*K*H + N*H*D + 3*D*F + N*H + 2*K*H) = 164,416 bfloat16 parameters
    assert result["param_bytes"] == 2 * 164_416
    assert result["files"] >= 1 and result["file_bytes"] >= result["param_bytes"]
    assert result["seconds"] > 0 and result["peak_anon_above_start"] >= 0
    assert os.path.exists(tmp_path / "tiny" / "model.safetensors.index.json")
