"""Device mesh from config, logical axis rules, and sharding helpers.

Parameters and activations are annotated with *logical* axis names ("batch", "embed", "heads",
...). A config owns the mesh shape (axes data, fsdp, tensor, expert; size 1 allowed, -1 = all
remaining devices) and the rules mapping each logical name to mesh axes. The same model code then
runs replicated on one CPU or sharded over a pod.

A logical dimension whose size is not divisible by the mesh axes its rule names is left
replicated (e.g. 2 kv heads on a tensor axis of 4), never padded silently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

Rules = tuple[tuple[str, tuple[str, ...]], ...]

# Data parallel over data x fsdp; parameters sharded over fsdp (ZeRO-3 style) along the model
# dimension and over tensor along heads / ffw / vocab (Megatron style); experts over expert.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("expert", ("expert",)),
    ("seq", ()),
    ("head_dim", ()),
)


def mesh_config(**sizes: int) -> ml_collections.ConfigDict:
    """The `mesh` config section: one size per axis (default data=-1: all devices data-parallel)."""
    cfg = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "expert": 1})
    cfg.update(sizes)
    cfg.rules = tuple((name, tuple(axes)) for name, axes in DEFAULT_RULES)
    return cfg


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a Mesh with axes MESH_AXES from a `mesh` config section (sizes; one may be -1)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(config[a]) if a in config else 1 for a in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} does not fit {len(devices)} devices")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def rules_from_config(config: Any) -> Rules:
    rules = config["rules"] if "rules" in config else DEFAULT_RULES
    return tuple((name, tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)) for name, axes in rules)


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """PartitionSpec for logical axis names; with shape and mesh, indivisible dims stay replicated.

    A mesh axis is used at most once per array (the first logical dim that claims it wins).
    """
    table = dict(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for i, name in enumerate(axes):
        mesh_axes = [a for a in table.get(name, ()) if a not in used] if name is not None else []
        if mesh is not None:
            mesh_axes = [a for a in mesh_axes if mesh.shape[a] > 1]
            if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = []
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model's activations live: a mesh and the rules that map logical axes onto it.

    A model gets one with `place` (done by `rlcode.train.step.init_train_state`); it is a static
    attribute of the modules that pin activations, so it is part of the model's graph definition
    and every function built from that graphdef (the train step, the log-prob function, the
    sampler) traces the same shardings and the same expert-parallel collectives.
    """

    mesh: Mesh
    rules: Rules


def place(model: Any, mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Any:
    """Give every module of `model` that pins activations (`placement` attribute) this mesh and
    these rules (None: no mesh, no constraints); returns the model."""
    placement = None if mesh is None else Placement(mesh, tuple(rules))
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "placement"):
            module.placement = placement
    return model


def constrain(x: jax.Array, axes: Sequence[str | None], placement: Placement | None) -> jax.Array:
    """`with_sharding_constraint` by logical names on `placement`'s mesh; the identity without one."""
    if placement is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} do not match an array of rank {x.ndim}")
    spec = logical_to_spec(axes, placement.rules, x.shape, placement.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(placement.mesh, spec))


def named_shardings(logical_axes: Any, shapes: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedSharding tree for a tree of logical-axes tuples and a matching tree of shaped leaves."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, rules, x.shape, mesh)),
        logical_axes,
        shapes,
        is_leaf=lambda a: isinstance(a, tuple) and all(isinstance(n, (str, type(None))) for n in a),
    )


def put(tree: Any, shardings: Any) -> Any:
    """Place host or single-device values onto (possibly multi-process) shardings.

    Works in a multi-process run, where a sharding spans devices of other processes: every
    process passes the same full values and contributes only its addressable shards. Typed PRNG
    keys are moved through their key data.
    """

    def one(x, sharding):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=impl)
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)
