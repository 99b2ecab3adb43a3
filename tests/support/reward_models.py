"""A tiny byte-level reward model for tests of the jobs' learned rewards."""

import jax
from flax import nnx

from rlcode.feedback import reward_model as rm
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer


def save_tiny_reward_model(path, max_len=256):
    """Save a 1-layer byte-level reward model with a random (nonzero) value head to `path`; returns it."""
    model = init_model(model_config(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=16, ffw_dim=64, value_head=True), 5)
    gd, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params["value_w"] = jax.random.normal(jax.random.key(1), params["value_w"].shape) * 0.5
    rm.RewardModel(gd, params, ByteTokenizer(), max_len=max_len).save(str(path))
    return str(path)
