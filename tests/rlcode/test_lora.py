"""LoRA adapters: unchanged forward at init, the low-rank update against a float64 oracle, merge,
adapters alone on disk, training only the adapters (bfloat16 base included), config errors."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode.checks import ConfigError
from rlcode.models import hf
from rlcode.models import lora as lora_lib
from rlcode.models.transformer import init_model, model_config
from rlcode.train import step as step_lib

from support import job_config, step_check
from support.hf_families import FAMILIES, write_checkpoint

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)


def logits(model, tokens=TOKENS):
    return np.asarray(model.logits(model(tokens).hidden))


def randomise_b(model, seed=1, std=0.2):
    """Nonzero B (a fresh adapter's B is zero, which would hide a wrong update)."""
    for i, (_, _, _, adapter) in enumerate(lora_lib.adapters(model)):
        b = adapter.b
        b.set_value((std * jax.random.normal(jax.random.key(seed * 1000 + i), b.shape)).astype(b.dtype))
    return model


@pytest.mark.slow
def test_fresh_adapters_leave_the_forward_unchanged():
    model = init_model(model_config(vocab_size=64, qkv_bias=True, qk_norm=True), seed=0)
    before = logits(model)
    lora_lib.add_lora(model, lora_lib.LoraConfig(rank=4), seed=0)
    assert len(lora_lib.adapters(model)) == 2 * 7
    np.testing.assert_array_equal(logits(model), before)
    # rank 0 adds nothing
    plain = init_model(model_config(vocab_size=64), seed=0)
    assert not lora_lib.adapters(lora_lib.add_lora(plain, lora_lib.LoraConfig(rank=0), seed=0))


def _f64(x):
    return np.asarray(jax.device_get(x), np.float64)


@pytest.mark.slow
def test_update_matches_a_float64_oracle_and_merging_changes_nothing():
    model = init_model(model_config(vocab_size=64, num_layers=1), seed=0)
    cfg = lora_lib.LoraConfig(rank=3, alpha=6.0)
    randomise_b(lora_lib.add_lora(model, cfg, seed=0))
    block = model.block_0
    proj, mlp = block.attn.proj, block.mlp

    def effective(module, target):
        weight, _ = lora_lib.TARGETS[target]
        adapter = getattr(module, f"lora_{target}")
        a, b = _f64(adapter.a[...]), _f64(adapter.b[...])
        return _f64(getattr(module, weight)[...]) + cfg.alpha / cfg.rank * np.tensordot(a, b, axes=1)

    x = np.random.default_rng(1).normal(size=(2, 5, 64)).astype(np.float32)
    x64 = x.astype(np.float64)
    # Positions 0: RoPE is the identity there, and the model has no QK-norm or biases.
    q, k, v = proj.qkv(jnp.asarray(x), jnp.zeros((2, 5), jnp.int32))
    np.testing.assert_allclose(q, np.einsum("btd,dnh->btnh", x64, effective(proj, "q")), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, np.einsum("btd,dkh->btkh", x64, effective(proj, "k")), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, np.einsum("btd,dkh->btkh", x64, effective(proj, "v")), rtol=1e-5, atol=1e-5)
    o = np.random.default_rng(2).normal(size=(2, 5, 4, 16)).astype(np.float32)
    np.testing.assert_allclose(proj.out(jnp.asarray(o)), np.einsum("btnh,nhd->btd", o.astype(np.float64),
                                                                     effective(proj, "o")), rtol=1e-5, atol=1e-5)
    gate, up = x64 @ effective(mlp, "gate"), x64 @ effective(mlp, "up")
    want = (gate / (1 + np.exp(-gate)) * up) @ effective(mlp, "down")
    np.testing.assert_allclose(mlp(jnp.asarray(x))[0], want, rtol=1e-5, atol=1e-5)

    before = logits(model)
    merged = lora_lib.merge_lora(model)
    assert not lora_lib.adapters(merged) and not nnx.state(merged, nnx.LoRAParam)
    assert lora_lib.adapters(model)  # the input keeps its adapters
    np.testing.assert_allclose(logits(merged), before, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits(model), before)


def test_adapters_carry_logical_axes():
    model = lora_lib.add_lora(init_model(model_config(vocab_size=64), seed=0), lora_lib.LoraConfig(rank=2), seed=0)
    proj, mlp = model.block_0.attn.proj, model.block_0.mlp
    assert proj.lora_q.a.get_metadata()["logical_axes"] == ("embed", None)
    assert proj.lora_q.b.get_metadata()["logical_axes"] == (None, "heads", "head_dim")
    assert proj.lora_o.a.get_metadata()["logical_axes"] == ("heads", "head_dim", None)
    assert mlp.lora_down.b.get_metadata()["logical_axes"] == (None, "embed")
    assert proj.lora_o.a.shape == (4, 16, 2) and proj.lora_o.b.shape == (2, 64)
    # A is a fan-in normal: std 1 / sqrt(in)
    a = np.asarray(mlp.lora_gate.a[...])
    assert abs(a.std() * np.sqrt(64) - 1) < 0.25


def _train_one_step(model, trainable, V, **loss_overrides):
    loss_cfg = step_check.build(**loss_overrides)[1]
    optim = step_lib.optim_config(lr=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.1)
    optimizer = step_lib.make_optimizer(optim, trainable)
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
    train_step = step_lib.make_train_step(graphdef, loss_cfg, optimizer, microbatches=2, trainable=trainable)
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch(V=V).items()}
    before = jax.tree.map(np.asarray, state.params)
    opt_state = state.opt_state
    state, metrics = train_step(state, batch)
    return before, jax.tree.map(np.asarray, state.params), opt_state, metrics


@pytest.mark.slow
def test_a_train_step_changes_only_the_adapters_and_keeps_moments_only_for_them():
    model = step_check.build()[0]
    lora_lib.add_lora(model, lora_lib.LoraConfig(rank=4, targets=("q", "v", "o", "down")), seed=0)
    trainable = lora_lib.adapter_mask(model)
    before, after, opt_state, metrics = _train_one_step(model, trainable, V=96)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    flat_before = jax.tree_util.tree_leaves_with_path(before)
    flat_after, flags = jax.tree.leaves(after), jax.tree.leaves(trainable)
    changed_b = 0
    for (path, old), new, flag in zip(flat_before, flat_after, flags):
        name = jax.tree_util.keystr(path)
        if not flag:
            np.testing.assert_array_equal(new, old, err_msg=name)  # the base is untouched
        elif name.endswith("['b']"):
            assert not np.array_equal(new, old), name  # B starts at 0 and gets the gradient
            changed_b += 1
    assert changed_b == 2 * 4
    adapter_sizes = [x.size for x, f in zip(jax.tree.leaves(before), flags) if f]
    moments = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    assert sorted(x.size for x in moments) == sorted(adapter_sizes * 2)  # AdamW's mu and nu, adapters only
    assert sum(x.nbytes for x in moments) == 2 * 4 * sum(adapter_sizes)


@pytest.mark.slow
def test_default_optimizer_and_step_are_unchanged_by_the_trainable_argument():
    """trainable=None keeps every parameter trained and moments for all of them."""
    model = step_check.build()[0]
    before, after, opt_state, _ = _train_one_step(model, None, V=96)
    moments = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    assert len(moments) == 2 * len([x for x in jax.tree.leaves(before) if x.ndim > 0])
    assert sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))) > 10


@pytest.mark.slow
def test_bfloat16_base_with_float32_adapters_trains():
    model = init_model(model_config(vocab_size=96, param_dtype="bfloat16", dtype="bfloat16"), seed=0)
    lora_lib.add_lora(model, lora_lib.LoraConfig(rank=4, dtype="float32"), seed=0)
    trainable = lora_lib.adapter_mask(model)
    state = nnx.state(model)
    adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert adapters and all(x.dtype == jnp.float32 for x in adapters)
    params = jax.tree.leaves(nnx.to_pure_dict(state))
    flags = jax.tree.leaves(trainable)
    assert all(p.dtype == jnp.bfloat16 for p, f in zip(params, flags) if not f)
    before, after, _, metrics = _train_one_step(model, trainable, V=96, value_coef=0.0)
    assert np.isfinite(float(metrics["loss"]))
    for old, new, flag in zip(jax.tree.leaves(before), jax.tree.leaves(after), flags):
        assert new.dtype == old.dtype
        if not flag:
            np.testing.assert_array_equal(new, old)
    assert any(not np.array_equal(a, b) for a, b, f in zip(jax.tree.leaves(before), jax.tree.leaves(after), flags) if f)


@pytest.mark.slow
def test_save_and_load_adapters_round_trip_and_refuse_a_mismatch(tmp_path):
    cfg = lora_lib.LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "up"))
    source = randomise_b(lora_lib.add_lora(init_model(model_config(vocab_size=64), seed=0), cfg, seed=0))
    lora_lib.save_adapters(source, tmp_path / "ad")
    target = lora_lib.add_lora(init_model(model_config(vocab_size=64), seed=0), cfg, seed=5)
    lora_lib.load_adapters(target, tmp_path / "ad")
    want = nnx.to_pure_dict(nnx.state(source, nnx.LoRAParam))
    got = nnx.to_pure_dict(nnx.state(target, nnx.LoRAParam))
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(logits(target), logits(source))

    def fresh(**kw):
        return lora_lib.add_lora(init_model(model_config(vocab_size=64), seed=0),
                                 lora_lib.LoraConfig(**{**dataclass_fields(cfg), **kw}), seed=0)

    with pytest.raises(ValueError, match="lora.rank"):
        lora_lib.load_adapters(fresh(rank=2), tmp_path / "ad")
    with pytest.raises(ValueError, match="lora.targets"):
        lora_lib.load_adapters(fresh(targets=("q", "v", "up")), tmp_path / "ad")
    with pytest.raises(ValueError, match="lora.alpha"):
        lora_lib.load_adapters(fresh(alpha=16.0), tmp_path / "ad")
    wider = lora_lib.add_lora(init_model(model_config(vocab_size=64, d_model=32), seed=0), cfg, seed=0)
    with pytest.raises(ValueError, match="shape"):
        lora_lib.load_adapters(wider, tmp_path / "ad")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora_lib.load_adapters(init_model(model_config(vocab_size=64), seed=0), tmp_path / "ad")


def dataclass_fields(cfg):
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": cfg.targets, "dtype": cfg.dtype}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_lora_on_a_bfloat16_checkpoint_base_trains_only_the_adapters(tmp_path, family):
    """QLoRA-style: a checkpoint of each family loaded as a bfloat16 base under float32 adapters."""
    write_checkpoint(tmp_path / "src", family)
    model = hf.load_checkpoint(tmp_path / "src", dtype="float32", param_dtype="bfloat16")
    lora_lib.add_lora(model, lora_lib.LoraConfig(rank=4), seed=0)
    trainable = lora_lib.adapter_mask(model)
    before, after, _, metrics = _train_one_step(model, trainable, V=model.cfg.vocab_size, value_coef=0.0)
    assert np.isfinite(float(metrics["loss"]))
    for old, new, flag in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(trainable)):
        assert (old.dtype == np.float32) if flag else (old.dtype == jnp.bfloat16)
        assert flag or np.array_equal(old, new)
    assert any(not np.array_equal(o, n) for o, n, f in zip(jax.tree.leaves(before), jax.tree.leaves(after),
                                                           jax.tree.leaves(trainable)) if f)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_lora_on_a_hugging_face_checkpoint_merges_and_exports(tmp_path, family):
    write_checkpoint(tmp_path / "src", family)
    model = hf.load_checkpoint(tmp_path / "src", dtype="float32", param_dtype="float32")
    V = model.cfg.vocab_size
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, V, (2, 6)), jnp.int32)
    base = logits(model, tokens)
    randomise_b(lora_lib.add_lora(model, lora_lib.LoraConfig(rank=2), seed=0))
    tuned = logits(model, tokens)
    assert np.abs(tuned - base).max() > 1e-3  # the adapters matter
    hf.save_checkpoint(lora_lib.merge_lora(model), tmp_path / "out")
    reloaded = hf.load_checkpoint(tmp_path / "out", dtype="float32", param_dtype="float32")
    # equal up to float32 rounding (the merged weight W + scale A B is rounded once)
    np.testing.assert_allclose(logits(reloaded, tokens), tuned, rtol=1e-5, atol=5e-5)


def test_mlp_targets_need_the_dense_mlp():
    from rlcode.models.moe import moe_config

    cfg = model_config(vocab_size=64)
    cfg.mlp = moe_config(num_experts=4, top_k=2, expert_ffw_dim=32)
    model = init_model(cfg, seed=0)
    with pytest.raises(ValueError, match="dense SwiGLU"):
        lora_lib.add_lora(model, lora_lib.LoraConfig(rank=2), seed=0)
    lora_lib.add_lora(model, lora_lib.LoraConfig(rank=2, targets=("q", "v")), seed=0)
    assert len(lora_lib.adapters(model)) == 2 * 2


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"lora\.rank=-1"):
        lora_lib.LoraConfig(rank=-1)
    with pytest.raises(ConfigError, match=r"lora\.alpha"):
        lora_lib.LoraConfig(rank=2, alpha=0.0)
    with pytest.raises(ConfigError, match=r"lora\.targets.*'gate', 'up', 'down'"):
        lora_lib.LoraConfig.from_config({"rank": 2, "targets": ["q", "qq"]})
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        lora_lib.LoraConfig(rank=2, targets=("q", "q"))
    with pytest.raises(ConfigError, match=r"lora\.dtype"):
        lora_lib.LoraConfig(dtype="float16")
    with pytest.raises(ConfigError, match=r"lora\.rnk.*lora\.rank"):
        lora_lib.LoraConfig.from_config({"rnk": 2})
    section = lora_lib.lora_config(rank=8)
    assert lora_lib.LoraConfig.from_config(section) == lora_lib.LoraConfig(rank=8)
    assert lora_lib.LoraConfig.from_config(lora_lib.lora_config()).rank == 0


def test_both_jobs_have_the_lora_section_and_check_it(tmp_path):
    from rlcode.train import loop
    from support import tiny_job

    cfg = tiny_job.tiny_config(tmp_path)
    assert lora_lib.LoraConfig.from_config(cfg.lora) == lora_lib.LoraConfig()  # off by default
    loop.validate_config(cfg, 1)
    for field, value, message in [("rank", -1, r"^lora\.rank=-1"), ("targets", ("q", "mlp"), r"^lora\.targets="),
                                  ("alpha", 0.0, r"^lora\.alpha=0")]:
        bad = tiny_job.tiny_config(tmp_path, **{f"lora__{field}": value})
        with pytest.raises(ConfigError, match=message):
            loop.validate_config(bad, 1)
    from rlcode.models.moe import moe_config

    moe = tiny_job.tiny_config(tmp_path, lora__rank=4)
    moe.model.mlp = moe_config(num_experts=4, top_k=2, expert_ffw_dim=32)
    with pytest.raises(ConfigError, match=r"lora\.targets=.*model\.mlp\.kind='moe'"):
        loop.validate_config(moe, 1)
    moe.lora.targets = ("q", "k", "v", "o")
    loop.validate_config(moe, 1)
    assert lora_lib.LoraConfig.from_config(job_config("agent_repo").lora) == lora_lib.LoraConfig()


def _count_dots(jaxpr):
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _count_dots(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _count_dots(sub)
    return count


def test_frozen_weights_get_no_weight_gradient_matmuls():
    """Differentiating only the adapters leaves out the frozen weights' gradient products."""
    counts = {}
    for name in ("adapters", "everything"):
        model = lora_lib.add_lora(step_check.build()[0], lora_lib.LoraConfig(rank=4), seed=0)
        trainable = lora_lib.adapter_mask(model) if name == "adapters" else None
        optimizer = step_lib.make_optimizer(step_check.build()[2], trainable)
        graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
        train_step = step_lib.make_train_step(graphdef, step_check.build()[1], optimizer, trainable=trainable)
        batch = {k: jnp.asarray(v) for k, v in step_check.make_batch().items()}
        counts[name] = _count_dots(jax.make_jaxpr(train_step)(state, batch).jaxpr)
    # 2 layers x 7 projections whose weight gradient is dropped
    assert counts["adapters"] <= counts["everything"] - 2 * 7, counts
