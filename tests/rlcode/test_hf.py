"""Hugging Face checkpoints: the three families against an independent float64 forward, exact
round trips, sharded placement, and clear errors for what cannot be loaded faithfully."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rlcode.models import hf
from rlcode.models.safetensors_file import SafetensorsError, SafetensorsFile, write_file
from rlcode.models.transformer import ModelConfig, init_model, model_config
from support import hf_families, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = [3, 17, 5, 96, 0, 41, 41, 8, 63, 2, 11, 77, 30, 29, 1, 90, 45, 12, 7, 64, 33, 50, 21, 9, 88, 4, 39, 72]


def logits_of(model, tokens):
    out = model(jnp.asarray([tokens], jnp.int32))
    return np.asarray(model.logits(out.hidden)[0], np.float64)


def assert_close_to_oracle(got, want, rtol=1e-5):
    # Relative to the logits' scale: an error of 1e-5 of the largest logit anywhere fails.
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= rtol, f"max |ours - oracle| / max |oracle| = {err:.2e}"


@pytest.mark.parametrize("family", hf_families.FAMILIES)
@pytest.mark.parametrize("shards", [1, 3])
def test_loaded_model_matches_the_float64_forward_of_its_family(tmp_path, family, shards):
    cfg, tensors = hf_families.write_checkpoint(tmp_path, family, seed=1, shards=shards)
    model = hf.load_checkpoint(tmp_path, dtype="float32")
    assert model.cfg.vocab_size == cfg["vocab_size"] and model.cfg.num_layers == cfg["num_hidden_layers"]
    want = hf_families.numpy_forward(cfg, tensors, TOKENS)
    assert_close_to_oracle(logits_of(model, TOKENS), want)


def test_the_oracle_tells_the_families_apart(tmp_path):
    """Each family's own piece changes the logits: forgetting it would fail the test above."""
    for family, change in (("qwen2", {"model_type": "llama"}), ("qwen3", {"model_type": "llama"}),
                           ("llama", {"rope_scaling": None})):
        cfg, tensors = hf_families.write_checkpoint(tmp_path / family, family, seed=1)
        base = hf_families.numpy_forward(cfg, tensors, TOKENS)
        other = hf_families.numpy_forward({**cfg, **change}, tensors, TOKENS)
        assert np.max(np.abs(base - other)) > 1e-3 * np.max(np.abs(base)), family


def test_bfloat16_checkpoint_loads_exactly_and_computes_in_bfloat16(tmp_path):
    cfg, tensors = hf_families.write_checkpoint(tmp_path, "qwen2", dtype="bfloat16")
    exact = hf.load_checkpoint(tmp_path, dtype="float32")
    embed = np.asarray(exact.embed[...], np.float64)
    np.testing.assert_array_equal(embed, tensors["model.embed_tokens.weight"])  # bf16 values held exactly
    wq = np.asarray(exact.block_0.attn.proj.wq[...], np.float64)  # [D, N, H] from [N*H, D]
    np.testing.assert_array_equal(wq.reshape(wq.shape[0], -1).T, tensors["model.layers.0.self_attn.q_proj.weight"])
    model = hf.load_checkpoint(tmp_path)  # the default: bfloat16 parameters and compute
    assert model.embed[...].dtype == jnp.bfloat16 and model.cfg.dtype == jnp.bfloat16
    want = hf_families.numpy_forward(cfg, tensors, TOKENS)
    err = np.max(np.abs(logits_of(model, TOKENS) - want)) / np.max(np.abs(want))
    assert err < 0.05, err  # bfloat16 compute: close, not exact


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_save_then_load_is_bit_identical_and_readable_by_the_oracle(tmp_path, family):
    hf_families.write_checkpoint(tmp_path / "src", family, seed=2)
    model = hf.load_checkpoint(tmp_path / "src", dtype="float32")
    hf.save_checkpoint(model, tmp_path / "out", max_shard_bytes=20_000)  # several shards and an index
    assert os.path.exists(tmp_path / "out" / hf.INDEX)
    again = hf.load_checkpoint(tmp_path / "out", dtype="float32")
    a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(again))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    # The export is a checkpoint of the family in its own right: the oracle reads it by name.
    with open(tmp_path / "out" / hf.CONFIG) as f:
        config = json.load(f)
    assert config["architectures"] == hf_families.tiny_config(family)["architectures"]
    index = json.load(open(tmp_path / "out" / hf.INDEX))["weight_map"]
    stored = {n: np.asarray(SafetensorsFile(tmp_path / "out" / file).array(n), np.float64) for n, file in index.items()}
    assert_close_to_oracle(logits_of(model, TOKENS), hf_families.numpy_forward(config, stored, TOKENS))


@pytest.mark.slow
def test_a_model_trained_here_exports_as_the_family_its_config_matches(tmp_path):
    for overrides, arch in (({}, "LlamaForCausalLM"), ({"qk_norm": True}, "Qwen3ForCausalLM"),
                            ({"qkv_bias": True, "tie_embeddings": True}, "Qwen2ForCausalLM")):
        model = init_model(model_config(vocab_size=64, **overrides), seed=3)
        out = tmp_path / arch
        hf.save_checkpoint(model, out)
        assert hf.read_config(out)["architectures"] == [arch]
        again = hf.load_checkpoint(out, dtype="float32")
        np.testing.assert_array_equal(logits_of(model, TOKENS[:9]), logits_of(again, TOKENS[:9]))
    for section, match in (({"attention": {"kind": "nsa"}}, "attention.kind='nsa'"), ({"mlp": {"kind": "moe"}}, "mlp.kind='moe'")):
        with pytest.raises(hf.CheckpointFormatError, match=match):
            hf.family_of(ModelConfig.from_config(model_config(vocab_size=64, **section)))


def test_save_in_bfloat16_rounds_like_jax(tmp_path):
    model = init_model(model_config(vocab_size=64), seed=4)
    hf.save_checkpoint(model, tmp_path, dtype="bfloat16")
    st = SafetensorsFile(tmp_path / hf.SINGLE)
    assert st.dtype("model.embed_tokens.weight") == np.dtype(ml_dtypes.bfloat16)
    want = np.asarray(model.embed[...].astype(jnp.bfloat16))
    np.testing.assert_array_equal(st.array("model.embed_tokens.weight"), want)
    assert hf.read_config(tmp_path)["torch_dtype"] == "bfloat16"


def test_overrides_keep_the_parameters_and_a_new_value_head_starts_at_zero(tmp_path):
    cfg, tensors = hf_families.write_checkpoint(tmp_path, "qwen3", seed=5)
    squid = hf.load_checkpoint(tmp_path, dtype="float32", overrides={"attention": {"kind": "squid"}, "value_head": True})
    dense = hf.load_checkpoint(tmp_path, dtype="float32")
    assert squid.cfg.attention["kind"] == "squid"
    out = squid(jnp.asarray([TOKENS], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.values), 0.0)
    np.testing.assert_allclose(np.asarray(squid.logits(out.hidden)[0]), logits_of(dense, TOKENS), rtol=1e-5, atol=1e-5)
    with pytest.raises(hf.CheckpointFormatError, match="no field 'attn_kind'"):
        hf.load_checkpoint(tmp_path, overrides={"attn_kind": "squid"})


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures=\\['MistralForCausalLM'\\]"),
    ({"use_sliding_window": True}, "use_sliding_window=True switches on a sliding attention window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mystery_feature": 3}, "\\['mystery_feature'\\] are not known"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
])
def test_unsupported_config_fields_are_errors_naming_them(tmp_path, change, match):
    family = "qwen3"
    hf_families.write_checkpoint(tmp_path, family, **change)
    with pytest.raises(hf.CheckpointFormatError, match=match):
        hf.load_checkpoint(tmp_path)


def test_ignore_fields_accepts_a_field_named_harmless(tmp_path):
    hf_families.write_checkpoint(tmp_path, "llama", mystery_feature=3)
    hf.load_checkpoint(tmp_path, ignore_fields=("mystery_feature",))


def test_missing_unexpected_and_misshapen_tensors_are_errors_naming_them(tmp_path):
    cfg, tensors = hf_families.write_checkpoint(tmp_path / "extra", "qwen2",
                                                extra_tensors={"model.layers.0.mlp.gate_proj.bias": np.zeros(48, np.float32)})
    with pytest.raises(hf.CheckpointFormatError, match="model.layers.0.mlp.gate_proj.bias"):
        hf.load_checkpoint(tmp_path / "extra")
    # A missing tensor: drop one from a sharded index (the file still holds it, the index does not list it).
    hf_families.write_checkpoint(tmp_path / "missing", "qwen2", shards=2)
    index_file = tmp_path / "missing" / hf.INDEX
    index = json.load(open(index_file))
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    json.dump(index, open(index_file, "w"))
    with pytest.raises(hf.CheckpointFormatError, match="missing tensor.*model.layers.1.self_attn.k_proj.bias"):
        hf.load_checkpoint(tmp_path / "missing")
    # A shape that contradicts config.json.
    hf_families.write_checkpoint(tmp_path / "shape", "llama")
    config = json.load(open(tmp_path / "shape" / "config.json"))
    config["intermediate_size"] = 64
    json.dump(config, open(tmp_path / "shape" / "config.json", "w"))
    with pytest.raises(hf.CheckpointFormatError, match="'model.layers.0.mlp.gate_proj.weight' has shape \\[48, 32\\]"):
        hf.load_checkpoint(tmp_path / "shape")
    # Tied embeddings with a different stored head.
    hf_families.write_checkpoint(tmp_path / "tied", "qwen2",
                                 extra_tensors={"lm_head.weight": np.ones((97, 32), np.float32)})
    with pytest.raises(hf.CheckpointFormatError, match="lm_head.weight differs"):
        hf.load_checkpoint(tmp_path / "tied")
    with pytest.raises(hf.CheckpointFormatError, match="has no config.json"):
        hf.load_checkpoint(tmp_path / "nowhere")


def test_safetensors_files_are_checked_and_round_trip(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), ml_dtypes.bfloat16),
               "c": np.array(7, np.int64), "empty": np.zeros((0, 3), np.float32)}
    write_file(tmp_path / "x.safetensors", tensors, {"k": "v"})
    st = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(st.names) == sorted(tensors) and st.metadata == {"k": "v"}
    for name, value in tensors.items():
        assert st.dtype(name) == value.dtype and st.shape(name) == value.shape
        np.testing.assert_array_equal(st.array(name), value)
    raw = (tmp_path / "x.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0  # tensors start aligned
    (tmp_path / "short").write_bytes(raw[:-4])
    with pytest.raises(SafetensorsError, match="outside the data|after the last"):
        SafetensorsFile(tmp_path / "short")
    header = json.loads(raw[8:8 + n])
    header["a"]["data_offsets"] = [0, 20]
    bad = json.dumps(header).encode()
    (tmp_path / "bad").write_bytes(len(bad).to_bytes(8, "little") + bad + raw[8 + n:])
    with pytest.raises(SafetensorsError, match="tensor 'a' holds 20 bytes"):
        SafetensorsFile(tmp_path / "bad")
    with pytest.raises(SafetensorsError, match="has no tensor 'z'"):
        st.array("z")


def test_safetensors_agrees_with_the_reference_implementation(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
    tensors = {"w": np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32), "i": np.arange(4, dtype=np.int32)}
    write_file(tmp_path / "ours.safetensors", tensors)
    theirs = safetensors_numpy.load_file(str(tmp_path / "ours.safetensors"))
    for k in tensors:
        np.testing.assert_array_equal(theirs[k], tensors[k])
    safetensors_numpy.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    st = SafetensorsFile(tmp_path / "theirs.safetensors")
    for k in tensors:
        np.testing.assert_array_equal(st.array(k), tensors[k])


SHARDED_CHECK = """
import json, sys
import jax, numpy as np
from flax import nnx
from rlcode.models import hf
from rlcode.sharding import make_mesh, mesh_config
path = sys.argv[1]
mesh = make_mesh(mesh_config(data=1, fsdp=2, tensor=2))
sharded = hf.load_checkpoint(path, dtype="float32", mesh=mesh)
plain = hf.load_checkpoint(path, dtype="float32")
a, b = nnx.to_pure_dict(nnx.state(sharded)), nnx.to_pure_dict(nnx.state(plain))
same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
specs = {"wq": list(a["block_0"]["attn"]["proj"]["wq"].sharding.spec),
         "w_down": list(a["block_1"]["mlp"]["w_down"].sharding.spec),
         "devices": len(a["block_0"]["attn"]["proj"]["wq"].sharding.device_set)}
tokens = jax.numpy.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jax.numpy.int32)
out = jax.jit(lambda m, t: m.logits(m(t).hidden))(sharded, tokens)
ref = plain.logits(plain(tokens).hidden)
# One train step on the mesh equals the step on one device.
from rlcode import losses
from rlcode.train import step as step_lib
rng = np.random.default_rng(0)
batch = {"inputs": rng.integers(0, 97, (4, 12)).astype(np.int32), "targets": rng.integers(0, 97, (4, 12)).astype(np.int32),
         "positions": np.tile(np.arange(12, dtype=np.int32), (4, 1)), "mask": (rng.random((4, 12)) < 0.7).astype(np.float32),
         "kv_lengths": np.full((4,), 12, np.int32), "advantages": rng.normal(size=(4, 12)).astype(np.float32),
         "old_logp": np.full((4, 12), -4.0, np.float32)}
objective = losses.ObjectiveConfig.from_config(losses.loss_config())
losses_seen = []
for m, mesh_ in ((sharded, mesh), (plain, None)):
    opt = step_lib.make_optimizer(step_lib.optim_config(lr=1e-3, warmup_steps=0))
    gd, state = step_lib.init_train_state(m, opt, 0, mesh_)
    fn = step_lib.make_train_step(gd, objective, opt, mesh=mesh_, shardings=step_lib.state_shardings(state) if mesh_ else None)
    state, metrics = fn(state, {k: jax.numpy.asarray(v) for k, v in batch.items()})
    losses_seen.append(float(metrics["loss"]))
print(json.dumps({"same": bool(same), "specs": specs, "logits_err": float(np.max(np.abs(np.asarray(out) - np.asarray(ref)))),
                  "step_losses": losses_seen}))
"""


@pytest.mark.slow
def test_loading_onto_a_mesh_places_each_parameter_on_its_sharding(tmp_path):
    hf_families.write_checkpoint(tmp_path / "ckpt", "qwen2", shards=2)
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SHARDED_CHECK, str(tmp_path / "ckpt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"]
    assert result["specs"] == {"wq": ["fsdp", "tensor", None], "w_down": ["tensor", "fsdp"], "devices": 4}
    assert result["logits_err"] < 1e-5
    sharded_loss, plain_loss = result["step_losses"]
    assert abs(sharded_loss - plain_loss) <= 1e-5 * max(1.0, abs(plain_loss)), result["step_losses"]


@pytest.mark.parametrize("family", hf_families.FAMILIES)
@pytest.mark.slow
def test_a_loaded_model_samples_scores_trains_and_checkpoints_unchanged(tmp_path, family):
    """The sampler's behaviour log-probs equal the training forward's (chunked log-probs), a train
    step runs on the loaded parameters, and the train state checkpoints and restores exactly."""
    from rlcode import losses, sampling
    from rlcode.train import step as step_lib
    from rlcode.train.checkpoint import Checkpointer

    hf_families.write_checkpoint(tmp_path / "ckpt", family, seed=3)
    model = hf.load_checkpoint(tmp_path / "ckpt", dtype="float32")
    optimizer = step_lib.make_optimizer(step_lib.optim_config(lr=1e-3, warmup_steps=0))
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
    prompts = jnp.array([[5, 6, 7, 8, 9, 1], [11, 12, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([6, 2], jnp.int32)
    cfg = sampling.SamplingConfig(max_new_tokens=10, temperature=1.0, stop_ids=(2,))
    out = sampling.sample(graphdef, state.params, prompts, lengths, jax.random.key(0), group_size=3, cfg=cfg)
    batch = sampling.to_training_batch(prompts, lengths, out, group_size=3)
    logp, _ = step_lib.make_logprob_fn(graphdef)(state.params, {
        "inputs": batch.inputs, "targets": batch.targets, "positions": batch.positions, "kv_lengths": batch.kv_lengths})
    mask = np.asarray(batch.mask)
    assert mask.sum() > 0
    diff = np.abs(np.where(mask, np.asarray(logp) - np.asarray(batch.behavior_logp), 0.0))
    assert diff.max() < 1e-4, diff.max()
    train = {"inputs": batch.inputs, "targets": batch.targets, "positions": batch.positions, "mask": batch.mask,
             "kv_lengths": batch.kv_lengths, "old_logp": logp,
             "advantages": jnp.asarray(np.random.default_rng(0).normal(size=batch.mask.shape), jnp.float32)}
    objective = losses.ObjectiveConfig.from_config(losses.loss_config())
    step_fn = step_lib.make_train_step(graphdef, objective, optimizer)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step_fn(state, train)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
    assert all(jax.tree.leaves(changed))  # every parameter of the family is trained
    ckpt = Checkpointer(str(tmp_path / "train"), keep=1, async_save=False)
    try:
        ckpt.save(1, state, extra={}, force=True)
        restored, _ = ckpt.restore(target=state)
    finally:
        ckpt.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state.params, restored.params)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="loads a 0.5B-parameter checkpoint onto the GPU mesh")
def test_a_real_size_checkpoint_loads_onto_the_gpu_mesh(tmp_path):
    import time

    from experiments import bench_load
    from rlcode.sharding import make_mesh, mesh_config

    bench_load.write_random(str(tmp_path), "qwen2.5-0.5b", shard_mb=512)
    mesh = make_mesh(mesh_config(data=1, fsdp=-1))
    t0 = time.perf_counter()
    model = hf.load_checkpoint(tmp_path, mesh=mesh)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    print(f"loaded {count / 1e6:.1f}M parameters onto {len(jax.devices())} device(s) in {seconds:.2f} s")
    assert count == 494_032_768  # Qwen2.5-0.5B with tied embeddings
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    assert np.all(np.isfinite(np.asarray(model.logits(model(tokens).hidden), np.float32)))
