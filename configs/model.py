"""Model shapes: tiny (tests, CPU runs), small (CPU benchmarks), qwen0.5b (a ~0.5B GPU policy).

    python -m experiments.model_info --config=configs/model.py:qwen0.5b --config.mesh.fsdp=8

Experiment configs embed `get_config(name).model` as their `model` section. The mesh section
sizes the device mesh (data, fsdp, tensor, expert; -1 = all remaining devices).
"""

import ml_collections

from rlcode.models.transformer import model_config
from rlcode.sharding import mesh_config

SHAPES = {
    "tiny": dict(vocab_size=320, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=192),
    "small": dict(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, ffw_dim=768),
    # Qwen2.5-0.5B's shape (no attention biases here): 24 layers, GQA 14/2, tied embeddings.
    "qwen0.5b": dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                     ffw_dim=4864, rope_theta=1_000_000.0, dtype="bfloat16", param_dtype="float32"),
}
ARGS = tuple(SHAPES)


def get_config(arg=None):
    name = arg or "tiny"
    if name not in SHAPES:
        raise ValueError(f"model shape {name!r} is not one of {sorted(SHAPES)}")
    cfg = ml_collections.ConfigDict()
    cfg.name = name
    cfg.model = model_config(**SHAPES[name])
    cfg.mesh = mesh_config()
    return cfg
