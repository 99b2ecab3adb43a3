"""experiments/overoptimization.py: the two sweeps against a saved reward model, the per-run curves
(proxy, gold, KL from the start policy), the table's numbers from them, and the figure."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import overoptimization
from rlcode.feedback import reward_model as rm
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.ffw_dim=64", "task.levels=(1,)", "task.num_train=24", "task.num_eval=4", "task.num_fresh=0",
        "task.max_prompt_len=160", "sampling.max_new_tokens=48", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "sft.steps=2", "sft.batch_size=4", "eval.num_samples=4", "eval.ks=(1,4)",
        "eval.prompts_per_batch=4", "monitor.audit_size=4", "monitor.window=1", "monitor.span=1",
        "monitor.min_windows=2"]


def test_smooth_is_a_trailing_mean():
    np.testing.assert_allclose(overoptimization.smooth([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(overoptimization.smooth([5.0], 10), [5.0])


def test_the_two_sweeps_are_ablate_grids_against_the_reward_model(tmp_path):
    (tmp_path / "rm" / "params").mkdir(parents=True)
    args = overoptimization.parse_args([f"--reward_model={tmp_path / 'rm'}", "--kl_coefs=0,0.2",
                                        "--actions=raise_kl,stop", "--monitor_kl=0.05", "--set=train.steps=7"])
    (kl_name, kl), (mon_name, mon) = overoptimization.sweeps(args)
    assert (kl_name, mon_name) == ("kl", "monitor")
    for argv in (kl, mon):
        assert "--set=reward.source=reward_model" in argv and "--set=monitor.enabled=True" in argv
        assert f"--set=reward.reward_model={tmp_path / 'rm'}" in argv and argv[-1].startswith("--sweep=")
        assert argv.index("--set=train.steps=50") < argv.index("--set=train.steps=7")  # --set comes last, wins
    assert "--sweep=loss.kl_coef:0.0,0.2" in kl and "--set=monitor.action=log" in kl
    assert "--sweep=monitor.action:raise_kl,stop" in mon and "--set=loss.kl_coef=0.05" in mon


def test_bad_arguments_are_refused(tmp_path, capsys):
    for argv, message in ((["--actions=panic"], "--actions"), (["--kl_coefs=a"], "--kl_coefs"),
                          ([f"--reward_model={tmp_path}"], "no reward model there"),
                          (["--kl_coefs=", "--actions="], "nothing to run")):
        with pytest.raises(SystemExit):
            overoptimization.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_sweeps_run_against_the_reward_model_and_report_proxy_gold_and_kl(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config path is relative to the repository
    model = init_model(model_config(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=16, ffw_dim=64, value_head=True), 5)
    gd, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params["value_w"] = jax.random.normal(jax.random.key(1), params["value_w"].shape) * 0.5
    rm.RewardModel(gd, params, ByteTokenizer(), max_len=256).save(str(tmp_path / "rm"))
    out = tmp_path / "out"
    argv = [f"--reward_model={tmp_path / 'rm'}", "--kl_coefs=0.1", "--actions=", "--steps=3", "--smooth=2",
            f"--out={out}", f"--set=sft.cache_dir={tmp_path / 'sft'}", *[f"--set={s}" for s in TINY]]
    assert overoptimization.main(argv) == 0
    data = json.load(open(out / "overoptimization.json"))
    # One run of the first sweep (the monitor's actions in a run: tests/rlcode/train/test_learned_reward.py).
    assert [(r["label"], r["status"]) for r in data["runs"]] == [("loss.kl_coef=0.1", "completed")]
    for r in data["runs"]:
        c = r["curves"]
        assert c["step"] == [1, 2, 3] and c["kl"][0] == 0.0  # step 1 samples with the start policy
        assert all(0 <= g <= 1 for g in c["gold"]) and all(np.isfinite(c["proxy"]))
        assert r["gold_peak"] == pytest.approx(max(overoptimization.smooth(c["gold"], 2)[1:]))  # full averages
        assert r["kl_final"] == pytest.approx(overoptimization.smooth(c["kl"], 2)[-1])
        cfg = json.load(open(os.path.join(r["workdir"], "config.json")))
        assert cfg["reward"]["source"] == "reward_model" and cfg["monitor"]["enabled"]
    assert data["runs"][0]["kl_coef_final"] == 0.1
    assert (out / "overoptimization.png").stat().st_size > 0
    # Again: nothing runs (the runs are complete), the same numbers come out.
    assert overoptimization.main(argv + ["--table_only"]) == 0
    again = json.load(open(out / "overoptimization.json"))
    assert [r["curves"] for r in again["runs"]] == [r["curves"] for r in data["runs"]]
