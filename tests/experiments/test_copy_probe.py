"""experiments/copy_probe.py: every variant trains from the same tiny checkpoint on the same kind of
rows and reports the copy metrics it documents."""

import json

import jax
import pytest
from flax import nnx
from support.tiny_corpus import write_corpus

from experiments import copy_probe
from rlcode.models import hf
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer

TINY_SHAPE = dict(vocab_size=ByteTokenizer().vocab_size, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, ffw_dim=64)


def save_tiny_base(path, seed=0):
    """A one-layer byte-level checkpoint of TINY_SHAPE (the probe's --init)."""
    hf.save_checkpoint(init_model(model_config(**TINY_SHAPE), seed=seed), path, tokenizer=ByteTokenizer())


@pytest.mark.slow
def test_every_variant_runs_and_reports_the_copy_metrics(tmp_path, capsys):
    write_corpus(tmp_path / "corpus")
    save_tiny_base(tmp_path / "base")
    copy_probe.main([f"--init={tmp_path / 'base'}", f"--corpus={tmp_path / 'corpus'}", "--steps=3", "--eval_every=2",
                     "--rows=4", "--seq_len=32", "--span=8", f"--out={tmp_path / 'out'}",
                     "--variants=" + ",".join(copy_probe.VARIANTS)])
    report = json.load(open(tmp_path / "out" / "copy_probe.json"))
    assert [r["variant"] for r in report["results"]] == list(copy_probe.VARIANTS)
    for r in report["results"]:
        assert [c["step"] for c in r["curve"]] == [0, 2, 3]
        assert r["curve"][0]["loss"] is None and all(c["loss"] > 0 for c in r["curve"][1:])
        for c in r["curve"]:
            for key in ("uniform_repeat_nll", "fixed_repeat_nll", "copy_first_nll", "copy_repeat_nll"):
                assert c[key] > 0, key
    # Same start for every variant: step 0 is the checkpoint itself.
    starts = {round(r["curve"][0]["uniform_repeat_nll"], 6) for r in report["results"]}
    assert len(starts) == 1
    # Variants that share a span rule see the same batches, so after 3 steps only the optimiser differs.
    ends = {r["variant"]: r["curve"][-1]["uniform_repeat_nll"] for r in report["results"]}
    assert ends["job"] != ends["adam"] and ends["job_fixed"] != ends["adam_fixed"]
    # Mixed: half the rows are code, so its loss differs from the pure-copy variant's on the same steps.
    assert ends["job_mixed"] != ends["job"]
    assert "| job_fixed | 3 |" in capsys.readouterr().out


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown variants"):
        copy_probe.main(["--variants=job,sgd", f"--out={tmp_path}"])


@pytest.mark.slow
def test_scratch_starts_from_a_fresh_model_of_the_checkpoints_changed_architecture(tmp_path):
    write_corpus(tmp_path / "corpus")
    shape = TINY_SHAPE
    save_tiny_base(tmp_path / "base", seed=3)
    common = [f"--init={tmp_path / 'base'}", f"--corpus={tmp_path / 'corpus'}", "--steps=1", "--eval_every=1",
              "--rows=4", "--seq_len=32", "--span=8", "--variants=job"]

    def run(*extra):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        copy_probe.main(common + [f"--out={out}", *extra])
        return json.load(open(out / "copy_probe.json"))["results"][0]

    base, fresh, wider = run(), run("--scratch"), run("--scratch", "--arch=num_layers=2,ffw_dim=96")
    sizes = {k: sum(x.size for x in jax.tree.leaves(nnx.state(init_model(model_config(**{**shape, **v}))))) for k, v in
             {"base": {}, "wider": {"num_layers": 2, "ffw_dim": 96}}.items()}
    assert base["parameters"] == fresh["parameters"] == sizes["base"]
    assert wider["parameters"] == sizes["wider"]
    # The fresh model is not the checkpoint: its step-0 metrics differ (seed 0, the checkpoint's seed 3).
    assert base["curve"][0]["uniform_repeat_nll"] != fresh["curve"][0]["uniform_repeat_nll"]
    assert fresh["curve"][0]["uniform_repeat_nll"] != wider["curve"][0]["uniform_repeat_nll"]


@pytest.mark.parametrize("extra, message", [
    (["--arch=num_layers=2"], "needs --scratch"),
    (["--scratch", "--arch=num_layerz=2"], "no field 'num_layerz'"),
    (["--scratch", "--arch=vocab_size=512"], "cannot change vocab_size"),
    (["--scratch", "--arch=num_layers"], "expected field=value"),
    (["--scratch", "--arch=num_layers=two"], "not a number"),
])
def test_a_bad_arch_is_refused_before_any_work(tmp_path, extra, message):
    save_tiny_base(tmp_path / "base")
    with pytest.raises(SystemExit, match=message):
        copy_probe.main([f"--init={tmp_path / 'base'}", f"--corpus={tmp_path / 'no_corpus'}", f"--out={tmp_path}",
                         *extra])


def test_an_impossible_arch_shape_is_refused_before_any_work(tmp_path):
    save_tiny_base(tmp_path / "base")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        copy_probe.main([f"--init={tmp_path / 'base'}", f"--corpus={tmp_path / 'no_corpus'}", f"--out={tmp_path}",
                         "--scratch", "--arch=num_kv_heads=4"])
