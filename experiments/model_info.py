"""Describe a model config without allocating it: parameter count, shapes, sharding, memory.

    python -m experiments.model_info --config=configs/model.py:qwen0.5b --config.mesh.fsdp=8

Builds the model abstractly (`nnx.eval_shape`), maps every parameter's logical axes to the mesh
of `config.mesh` (fake devices are fine: the mesh is only used for its shape), and prints a table
of parameters with their partition specs and the bytes each device holds for parameters and
AdamW moments.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from absl import app
from flax import nnx
from jax.sharding import AbstractMesh
from ml_collections import config_flags

from rlcode.models.transformer import init_model, logical_axes
from rlcode.sharding import MESH_AXES, logical_to_spec, rules_from_config

_CONFIG = config_flags.DEFINE_config_file("config", "configs/model.py", "Model config.")


def describe(cfg) -> dict:
    model = nnx.eval_shape(lambda: init_model(cfg.model))
    shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    axes = logical_axes(model)
    sizes = [int(cfg.mesh[a]) for a in MESH_AXES]
    if any(s < 1 for s in sizes):
        raise ValueError(f"model_info needs explicit mesh sizes (no -1), got {dict(zip(MESH_AXES, sizes))}")
    mesh = AbstractMesh(tuple(sizes), MESH_AXES)
    rules = rules_from_config(cfg.mesh)
    rows, total, per_device = [], 0, 0
    flat_axes = jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))
    flat_shapes = jax.tree.leaves(shapes)
    for (path, ax), x in zip(flat_axes, flat_shapes):
        spec = logical_to_spec(ax, rules, x.shape, mesh)
        shards = math.prod(math.prod(mesh.shape[a] for a in ((s,) if isinstance(s, str) else s)) for s in spec if s)
        n = math.prod(x.shape)
        total += n
        per_device += n // shards * np.dtype(x.dtype).itemsize
        rows.append((jax.tree_util.keystr(path), x.shape, str(spec)))
    return {"rows": rows, "params": total, "param_bytes_per_device": per_device, "mesh": dict(mesh.shape)}


def main(argv):
    del argv
    info = describe(_CONFIG.value)
    for name, shape, spec in info["rows"]:
        print(f"{name:<48} {str(shape):<20} {spec}")
    gib = 2**30
    print(f"parameters: {info['params'] / 1e6:.1f}M on mesh {info['mesh']}")
    print(f"per device: params {info['param_bytes_per_device'] / gib:.3f} GiB, "
          f"+ AdamW moments {2 * info['param_bytes_per_device'] / gib:.3f} GiB")


if __name__ == "__main__":
    app.run(main)
