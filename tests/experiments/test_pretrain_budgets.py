"""experiments/pretrain_budgets.py: the budgets' bases (a fresh export, a pretraining run, the
committed base reused only for the config and steps it was trained with), the RL runs from each,
and the JSON and figure."""

import json
import os

import numpy as np
import pytest
from support.tiny_corpus import write_corpus

from experiments import pretrain_budgets
from rlcode.train import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRETRAIN = ["data.seq_len=64", "data.rows_per_step=4", "data.eval_batch=4", "model.d_model=32", "model.num_layers=1",
            "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.ffw_dim=64",
            "optim.warmup_steps=1"]
SYNTH = ["task.levels=(1,)", "task.num_train=24", "task.num_eval=4", "task.num_fresh=4", "task.max_prompt_len=160",
         "sampling.max_new_tokens=48", "rollout.prompts_per_step=2", "rollout.group_size=4", "sft.steps=2",
         "sft.batch_size=4", "train.steps=1", "eval.every=0", "eval.num_samples=4", "eval.ks=(1,4)",
         "eval.prompts_per_batch=4"]


@pytest.mark.slow
def test_budgets_pretrain_measure_and_run_rl_from_each(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the script's config paths are relative to the repository
    write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    argv = ["--budgets=0,2", "--seeds=1", f"--out={out}", "--pretrain_config=configs/pretrain_code.py:tokenizer=byte",
            f"--committed={tmp_path / 'none'}", f"--pretrain_set=data.corpus_dir={tmp_path / 'corpus'}",
            *[f"--pretrain_set={s}" for s in PRETRAIN], f"--set=sft.cache_dir={tmp_path / 'sft'}",
            *[f"--set={s}" for s in SYNTH]]
    assert pretrain_budgets.main(argv) == 0
    data = json.load(open(out / "pretrain_budgets.json"))
    assert [b["steps"] for b in data["budgets"]] == [0, 2]
    fresh, trained = data["budgets"]
    assert json.load(open(os.path.join(fresh["base"], pretrain.REPORT)))["step"] == 0
    assert json.load(open(os.path.join(trained["base"], pretrain.REPORT)))["step"] == 2
    # Measured here, the same way: the pretraining run's own last held-out evaluation agrees.
    run_eval = json.load(open(os.path.join(trained["base"], pretrain.REPORT)))["heldout"]["bpb"]
    assert trained["heldout_bpb"] == pytest.approx(run_eval, rel=1e-5) and trained["heldout_bpb"] < fresh["heldout_bpb"]
    for b in data["budgets"]:
        (run,) = b["runs"]
        assert run["completed"] and 0 <= run["final"]["eval/pass@1"] <= 1
        assert set(run["start"]) == {"eval/pass@1", "eval/best_of_4", "eval_fresh/pass@1", "eval_fresh/best_of_4"}
        assert json.load(open(os.path.join(run["workdir"], "config.json")))["model"]["init_from"] == b["base"]
    assert (out / "pretrain_budgets.png").stat().st_size > 0
    rows = (out / "pretrain_budgets.md").read_text().splitlines()
    assert len(rows) == 2 + len(data["budgets"]) and "eval_fresh/best_of_4 start -> end" in rows[0]
    for b, row in zip(data["budgets"], rows[2:]):
        (run,) = b["runs"]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [str(b["steps"]), f"{b['heldout_bpb']:.3f}", "1"]
        assert cells[3] == f"{run['start']['eval/pass@1']:.3f} -> {run['final']['eval/pass@1']:.3f}"
    # Run again: nothing is trained again (the runs are complete), the same table comes out.
    assert pretrain_budgets.main(argv) == 0
    assert json.load(open(out / "pretrain_budgets.json"))["budgets"][1]["heldout_bpb"] == trained["heldout_bpb"]


def test_the_committed_base_is_reused_only_for_its_own_config_and_steps(tmp_path):
    cfg = pretrain_budgets.pretrain_config("configs/pretrain_code.py", ["data.seq_len=512"])
    report = {"step": 1200, "config": dict(cfg.to_dict(), workdir="/elsewhere", resume=True)}
    report["config"]["train"] = dict(report["config"]["train"], steps=1200, max_minutes=60.0)
    assert pretrain_budgets._same_run(report, cfg, 1200)
    assert not pretrain_budgets._same_run(report, cfg, 300)
    other = pretrain_budgets.pretrain_config("configs/pretrain_code.py", ["data.seq_len=1024"])
    assert not pretrain_budgets._same_run(report, other, 1200)
    other = pretrain_budgets.pretrain_config("configs/pretrain_code.py", ["data.seq_len=512", "optim.lr=0.01"])
    assert not pretrain_budgets._same_run(report, other, 1200)
    # A base trained before the config had data.repeat_fraction / repeat_span / repeat_tokens is the same run
    # while they hold their neutral values, not once they change what is trained.
    older = json.loads(json.dumps(report))
    for field in ("repeat_fraction", "repeat_span", "repeat_tokens"):
        older["config"]["data"].pop(field)
    assert pretrain_budgets._same_run(older, cfg, 1200)
    other = pretrain_budgets.pretrain_config("configs/pretrain_code.py", ["data.seq_len=512", "data.repeat_fraction=0.25"])
    assert not pretrain_budgets._same_run(older, other, 1200)


def test_the_committed_base_is_refused_when_the_prepared_corpus_or_tokenizer_differs(tmp_path):
    """The config's paths are the same whatever was prepared there: a corpus prepared without the
    mined projects has other splits and another tokenizer than the committed base's. The budgets
    would then be trained and measured on different tokens, so the base is refused, not reused."""
    cfg = pretrain_budgets.pretrain_config("configs/pretrain_code.py", [f"data.corpus_dir={tmp_path / 'corpus'}",
                                                                        f"tokenizer={tmp_path / 'corpus' / 'tokenizer'}"])
    splits = {"train": {"files": 724, "bytes": 11846142}, "heldout": {"files": 33, "bytes": 456842}}
    tok = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}, "added_tokens": []}
    committed = tmp_path / "base"
    (tmp_path / "corpus" / "tokenizer").mkdir(parents=True)
    committed.mkdir()
    report = {"corpus": {"splits": splits}}
    (committed / pretrain.REPORT).write_text(json.dumps(report))
    (committed / "tokenizer.json").write_text(json.dumps(tok))
    (tmp_path / "corpus" / "report.json").write_text(json.dumps({"splits": splits}, indent=2))
    (tmp_path / "corpus" / "tokenizer" / "tokenizer.json").write_text(json.dumps(tok, indent=2))
    assert pretrain_budgets._data_differs(report, str(committed), cfg) is None  # formatting aside, the same
    stdlib_only = {"train": {"files": 699, "bytes": 11698277}, "heldout": {"files": 31, "bytes": 420229}}
    (tmp_path / "corpus" / "report.json").write_text(json.dumps({"splits": stdlib_only}))
    assert "has splits" in pretrain_budgets._data_differs(report, str(committed), cfg)
    (tmp_path / "corpus" / "report.json").write_text(json.dumps({"splits": splits}))
    (tmp_path / "corpus" / "tokenizer" / "tokenizer.json").write_text(
        json.dumps(dict(tok, model=dict(tok["model"], vocab={"a": 0, "c": 1}))))
    assert "tokenizer" in pretrain_budgets._data_differs(report, str(committed), cfg)
    os.remove(tmp_path / "corpus" / "report.json")
    assert "unreadable" in pretrain_budgets._data_differs(report, str(committed), cfg)
    # Wired into make_base: a committed base of the same config and steps is refused for it.
    (tmp_path / "corpus" / "report.json").write_text(json.dumps({"splits": stdlib_only}))
    config = dict(cfg.to_dict())
    config["train"] = dict(config["train"], steps=1200)
    (committed / pretrain.REPORT).write_text(json.dumps({"step": 1200, "config": config, "corpus": {"splits": splits}}))
    args = pretrain_budgets.parse_args([f"--committed={committed}", f"--out={tmp_path / 'out'}"])
    with pytest.raises(SystemExit, match="prepare_mined"):
        pretrain_budgets.make_base(1200, args, cfg, say=lambda _: None)


def test_the_table_gives_each_metric_as_mean_and_sample_std_over_the_completed_seeds():
    metrics = ["eval/pass@1", "eval_fresh/pass@1"]

    def run(seed, start, final, completed=True):
        return {"seed": seed, "completed": completed, "start": dict(zip(metrics, start)),
                "final": dict(zip(metrics, final))}

    data = {"metrics": metrics, "budgets": [
        {"steps": 0, "heldout_bpb": 3.67449, "runs": [run(0, (0.1, 0.2), (0.3, 0.5)), run(1, (0.3, 0.4), (0.1, 0.7)),
                                                     run(2, (0.9, 0.9), (0.9, 0.9), completed=False)]},
        {"steps": 300, "heldout_bpb": 1.85281, "runs": [run(0, (0.25, None), (0.5, None))]}]}
    rows = pretrain_budgets.table(data).splitlines()
    assert rows[0] == "| pretraining steps | held-out bpb | seeds | eval/pass@1 start -> end | eval_fresh/pass@1 start -> end |"
    assert rows[2] == (f"| 0 | 3.674 | 2 | 0.200 ± {np.std([0.1, 0.3], ddof=1):.3f} -> 0.200 ± "
                       f"{np.std([0.3, 0.1], ddof=1):.3f} | 0.300 ± 0.141 -> 0.600 ± 0.141 |")
    assert rows[3] == "| 300 | 1.853 | 1 | 0.250 -> 0.500 | — -> — |"
