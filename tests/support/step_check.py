"""Train steps on a device mesh vs on one device; run as a script with fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python step_check.py data=2,fsdp=2,tensor=2
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python step_check.py distributed PROCESS_ID NUM_PROCESSES PORT data=2,fsdp=2,tensor=2

Prints one JSON line: losses, the largest differences of metrics and updated params between
the sharded run and a run on one (local) device, and how many parameters were sharded. In the
distributed mode every process runs its part of one global mesh (jax.distributed over
localhost, CPU collectives over gloo) and compares with its own single-device run.
"""

import json
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils


LOSS = dict(kind="ppo", agg="seq-mean-token-mean", clip_high=0.28, is_mode="tis", kl_coef=0.05, entropy_coef=0.01,
            value_coef=0.5)


def build(seed=0, **loss_overrides):
    """(model, objective, optim section): the `loss` section (LOSS with `loss_overrides`) read as
    a job reads it, into an `ObjectiveConfig`."""
    from rlcode import losses
    from rlcode.models.transformer import init_model, model_config
    from rlcode.train import step as step_lib

    cfg = model_config(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffw_dim=64, tie_embeddings=False, value_head=True, qk_norm=True)
    loss_cfg = losses.ObjectiveConfig.from_config(losses.loss_config(**{**LOSS, **loss_overrides}))
    optim = step_lib.optim_config(lr=1e-3, warmup_steps=2, total_steps=10, weight_decay=0.1)
    return init_model(cfg, seed=seed), loss_cfg, optim


def make_batch(B=16, T=12, V=96, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, T + 1, B)
    prompt = rng.integers(1, 4, B)
    pos = np.arange(T)[None]
    mask = (pos >= prompt[:, None] - 1) & (pos < lengths[:, None] - 1)
    return {
        "inputs": rng.integers(0, V, (B, T)).astype(np.int32),
        "targets": rng.integers(0, V, (B, T)).astype(np.int32),
        "positions": np.broadcast_to(pos, (B, T)).astype(np.int32),
        "mask": mask,
        "kv_lengths": lengths.astype(np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
        "old_logp": (-np.abs(rng.normal(4.6, 0.3, (B, T)))).astype(np.float32),
        "behavior_logp": (-np.abs(rng.normal(4.6, 0.3, (B, T)))).astype(np.float32),
        "ref_logp": (-np.abs(rng.normal(4.6, 0.3, (B, T)))).astype(np.float32),
        "old_values": rng.normal(size=(B, T)).astype(np.float32),
        "returns": rng.normal(size=(B, T)).astype(np.float32),
    }


def run_step(mesh=None, microbatches=2, steps=3):
    from rlcode.train import step as step_lib

    model, loss_cfg, optim = build()
    optimizer = step_lib.make_optimizer(optim)
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0, mesh=mesh)
    shardings = step_lib.state_shardings(state) if mesh is not None else None
    train_step = step_lib.make_train_step(graphdef, loss_cfg, optimizer, microbatches=microbatches,
                                          mesh=mesh, shardings=shardings, schedule=step_lib.lr_schedule(optim))
    batch = make_batch()
    if mesh is not None:
        sharding = step_lib.batch_sharding(mesh)
        batch = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}
    history = []
    for _ in range(steps):
        state, metrics = train_step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)) if x.is_fully_addressable else
                          np.asarray(multihost_utils.process_allgather(x, tiled=True)), state.params)
    return history, params, state


def initial_params():
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(build()[0])))


def compare(mesh_sizes):
    from rlcode.sharding import make_mesh, mesh_config

    ref_hist, ref_params, _ = run_step(mesh=None, microbatches=2)
    mesh = make_mesh(mesh_config(**mesh_sizes))
    hist, params, state = run_step(mesh=mesh, microbatches=2)
    param_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)))
    metric_diff = max(abs(h[k] - r[k]) / max(1.0, abs(r[k])) for h, r in zip(hist, ref_hist) for k in r)
    sharded = sum(1 for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated)
    return {
        "devices": len(jax.devices()),
        "mesh": dict(mesh.shape),
        "loss": [h["loss"] for h in hist],
        "ref_loss": [h["loss"] for h in ref_hist],
        "max_param_diff": param_diff,
        "max_metric_rel_diff": metric_diff,
        "sharded_params": sharded,
        "param_change": max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(initial_params()))),
    }


def distributed(process_id, num_processes, port, mesh_sizes):
    """This process's part of a multi-process run on localhost (CPU collectives over gloo)."""
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    result = compare(mesh_sizes)
    result.update(process_id=jax.process_index(), process_count=jax.process_count(),
                  local_devices=len(jax.local_devices()))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "distributed":
        pid, nproc, port = (int(x) for x in sys.argv[2:5])
        sizes = dict(kv.split("=") for kv in sys.argv[5].split(","))
        print(json.dumps(distributed(pid, nproc, port, {k: int(v) for k, v in sizes.items()})))
    else:
        sizes = dict(kv.split("=") for kv in sys.argv[1].split(","))
        print(json.dumps(compare({k: int(v) for k, v in sizes.items()})))
