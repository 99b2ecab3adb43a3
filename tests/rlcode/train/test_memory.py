"""The memory estimate: parameter bytes equal the built model's, the train step's estimate is
close to XLA's own memory analysis of the compiled step, and a config that cannot fit is refused
with the estimate and the field to reduce."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from support import tiny_job

from rlcode.checks import ConfigError
from rlcode.losses import ObjectiveConfig
from rlcode.models.attention import attention_config
from rlcode.models.moe import moe_config
from rlcode.models.transformer import init_model
from rlcode.train import loop, memory
from rlcode.train.step import init_train_state, make_optimizer, make_train_step


@pytest.mark.parametrize(
    "attention, mlp, extra",
    [("dense", None, {}), ("squid", None, {"value_head": True}),
     ("nsa", None, {"tie_embeddings": False}), ("dense", "moe", {"qk_norm": True})],
)
def test_param_bytes_equal_the_built_model(tmp_path, attention, mlp, extra):
    cfg = tiny_job.tiny_config(tmp_path)
    nsa = dict(block_len=8, stride=4, select_size=16, num_select=4, window=32, shared_kv=False)
    cfg.model.attention = attention_config(attention, **(nsa if attention == "nsa" else {}))
    if mlp:
        cfg.model.mlp = moe_config(num_experts=4, top_k=2, expert_ffw_dim=24, num_shared_experts=1)
    cfg.model.update(extra)
    model = init_model(cfg.model, 0)
    actual = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    assert memory.param_bytes(cfg.model) == actual


@pytest.mark.parametrize("kind", ["dense", "squid"])
@pytest.mark.slow
def test_train_step_estimate_is_close_to_xla_memory_analysis(tmp_path, kind):
    cfg = tiny_job.tiny_config(tmp_path)
    cfg.model.update(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=192)
    cfg.model.attention = attention_config(kind, **({"impl": "xla"} if kind == "squid" else {}))
    rows, T = 8, 256
    optimizer = make_optimizer(cfg.optim)
    graphdef, state = init_train_state(init_model(cfg.model, 0), optimizer, 0)
    step = make_train_step(graphdef, ObjectiveConfig.from_config(cfg.loss), optimizer)
    zeros = jnp.zeros((rows, T), jnp.float32)
    batch = {"inputs": jnp.zeros((rows, T), jnp.int32), "targets": jnp.zeros((rows, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T), (rows, T)), "mask": jnp.ones((rows, T), bool),
             "kv_lengths": jnp.full((rows,), T, jnp.int32), "advantages": jnp.ones((rows,), jnp.float32),
             "old_logp": zeros, "behavior_logp": zeros, "ref_logp": zeros}
    measured = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    estimate = memory.train_step_bytes(cfg.model, rows, T)
    assert 0.75 < estimate / measured < 1.33, (estimate, measured)


def test_kv_cache_estimate_is_the_sampler_cache(tmp_path):
    cfg = tiny_job.tiny_config(tmp_path)
    model = init_model(cfg.model, 0)
    cache = model.blocks()[0].attn.init_suffix_cache(12, 48)
    per_layer = sum(x.size * x.dtype.itemsize for x in cache)
    assert memory.kv_cache_bytes(cfg.model, 12, 48) == per_layer * cfg.model.num_layers


def test_default_configs_fit_and_an_absurd_batch_is_refused(tmp_path):
    cfg = tiny_job.load_config()
    estimate = memory.estimate_synth(cfg)
    assert 256 * 2**20 < estimate.peak < 8 * 2**30  # a 0.8M-parameter policy: about 2 GiB at peak
    assert estimate.largest() == "train"
    memory.check(estimate, [("a 16 GiB machine", 16 * 2**30)])
    cfg.rollout.group_size = 4096
    with pytest.raises(ConfigError) as e:
        loop.validate_config(cfg, 1, budget=[("a 16 GiB machine", 16 * 2**30)])
    message = str(e.value)
    assert message.startswith("estimated peak memory") and "exceeds a 16 GiB machine (16.0 GiB)" in message
    assert "reduce rollout.group_size" in message and "32768 rows x 272 tokens" in message
    big_model = memory.Estimate({"state": 20 * 2**30, "train": 2**30}, 21 * 2**30, {"state": memory.MODEL_FIELDS}, {})
    with pytest.raises(ConfigError, match="exceeds x .* reduce model.d_model"):
        memory.check(big_model, [("x", 16 * 2**30)])


def test_limits_report_the_host():
    (what, available), *_ = memory.limits(jax.devices())
    assert what == "the host's physical memory" and available > 2**28
    assert memory.device_memory(jax.devices("cpu")) is None  # CPU devices share the host's memory
    assert math.isclose(memory.host_memory(), available)


class FakeAccelerator:
    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_limits_use_the_devices_memory_on_accelerators():
    devices = [FakeAccelerator(80 * 2**30), FakeAccelerator(80 * 2**30)]
    assert memory.limits(devices) == [("the memory of the 2 gpu device(s)", 160 * 2**30)]
    assert memory.device_memory([FakeAccelerator(2**30), *jax.devices("cpu")]) is None
    estimate = memory.Estimate({"state": 2**30, "train": 200 * 2**30}, 201 * 2**30, {"train": ("reduce x",)}, {})
    with pytest.raises(ConfigError, match=r"exceeds the memory of the 2 gpu device\(s\) \(160.0 GiB\): reduce x"):
        memory.check(estimate, memory.limits(devices))
