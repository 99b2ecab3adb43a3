"""Train steps on a device mesh vs on one device; run as a script with fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python step_check.py data=2,fsdp=2,tensor=2
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python step_check.py distributed PROCESS_ID NUM_PROCESSES PORT data=2,fsdp=2,tensor=2

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python step_check.py shared data=2,fsdp=2,tensor=2

Prints one JSON line: losses, the largest differences of metrics and updated params between
the sharded run and a run on one (local) device, and how many parameters were sharded. In the
distributed mode every process runs its part of one global mesh (jax.distributed over
localhost, CPU collectives over gloo) and compares with its own single-device run. The shared
mode does that for shared-prompt batches (each group's prompt once, `with_shared_prompts`):
one whose prompts divide over the data shards (placed with their rows) and one whose do not
(replicated).
"""

import json
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils


LOSS = dict(kind="ppo", agg="seq-mean-token-mean", clip_high=0.28, is_mode="tis", kl_coef=0.05, entropy_coef=0.01,
            value_coef=0.5)


def build(seed=0, value_head=True, **loss_overrides):
    """(model, objective, optim section): the `loss` section (LOSS with `loss_overrides`) read as
    a job reads it, into an `ObjectiveConfig`."""
    from rlcode import losses
    from rlcode.models.transformer import init_model, model_config
    from rlcode.train import step as step_lib

    cfg = model_config(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffw_dim=64, tie_embeddings=False, value_head=value_head, qk_norm=True)
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


def run_step(mesh=None, microbatches=2, steps=3, batch=None, value_head=True, **loss_overrides):
    """`steps` train steps on `batch` (default `make_batch()`, placed on the mesh's data axes here;
    a given batch is placed by the sharded step itself): (metrics per step, params, state)."""
    from rlcode.train import step as step_lib

    model, loss_cfg, optim = build(value_head=value_head, **loss_overrides)
    optimizer = step_lib.make_optimizer(optim)
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0, mesh=mesh)
    shardings = step_lib.state_shardings(state) if mesh is not None else None
    train_step = step_lib.make_train_step(graphdef, loss_cfg, optimizer, microbatches=microbatches,
                                          mesh=mesh, shardings=shardings, schedule=step_lib.lr_schedule(optim))
    if batch is None:
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


def differences(ref, run, value_head=True) -> dict:
    """Losses and the largest differences between a reference run and a run of `run_step`
    (each (history, params, ...)), and how far the parameters moved from their start."""
    (ref_hist, ref_params, *_), (hist, params, *_) = ref, run
    ref_leaves = jax.tree.leaves(ref_params)
    return {
        "loss": [h["loss"] for h in hist],
        "ref_loss": [h["loss"] for h in ref_hist],
        "max_param_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(ref_leaves, jax.tree.leaves(params))),
        "max_metric_rel_diff": max(abs(h[k] - r[k]) / max(1.0, abs(r[k])) for h, r in zip(hist, ref_hist) for k in r),
        "param_change": max(float(np.max(np.abs(a - b)))
                            for a, b in zip(ref_leaves, jax.tree.leaves(initial_params(value_head)))),
    }


def make_shared_batch(P, G, Lp=10, M=8, V=96, seed=0):
    """A GRPO batch of P prompts x G completions in the shared-prompt layout (prompts once per
    group), with old / behaviour / reference log-probs and advantages."""
    from rlcode.sampling import SampleOutput, to_training_batch
    from rlcode.train import step as step_lib

    rng = np.random.default_rng(seed)
    plen = rng.integers(1, Lp + 1, P).astype(np.int32)
    plen[0] = Lp
    prompts = np.where(np.arange(Lp)[None] < plen[:, None], rng.integers(1, V, (P, Lp)), 0).astype(np.int32)
    n = rng.integers(1, M + 1, P * G).astype(np.int32)
    tokens = np.where(np.arange(M)[None] < n[:, None], rng.integers(1, V, (P * G, M)), 0).astype(np.int32)
    logp = (-rng.gamma(2.0, 1.0, (P * G, M))).astype(np.float32)
    out = SampleOutput(tokens, logp, np.arange(M)[None] < n[:, None], n)
    tb = to_training_batch(prompts, plen, out, group_size=G)
    mask = np.asarray(tb.mask)
    batch = {"inputs": tb.inputs, "targets": tb.targets, "positions": tb.positions, "mask": tb.mask,
             "kv_lengths": tb.kv_lengths, "behavior_logp": tb.behavior_logp,
             "old_logp": np.where(mask, np.asarray(tb.behavior_logp) + 0.02, 0.0).astype(np.float32),
             "ref_logp": np.where(mask, np.asarray(tb.behavior_logp) - 0.05, 0.0).astype(np.float32),
             "advantages": rng.normal(size=P * G).astype(np.float32)}
    shared = step_lib.with_shared_prompts(batch, prompts, plen, tokens, multiple=4)
    return {k: np.asarray(v) for k, v in shared.items()}


def compare_shared(mesh_sizes):
    """Sharded vs one-device train steps on shared-prompt batches, prompts placed with their rows
    (P divisible by the data shards) and replicated (not divisible)."""
    from rlcode.sharding import make_mesh, mesh_config
    from rlcode.train import step as step_lib

    mesh = make_mesh(mesh_config(**mesh_sizes))
    shards = step_lib.batch_shards(mesh)
    out = {"devices": len(jax.devices()), "mesh": dict(mesh.shape), "data_shards": shards, "cases": []}
    for P, G, microbatches in ((shards, 4, 1), (shards // 2, 8, 2)):
        batch = make_shared_batch(P, G, seed=P)
        runs = [run_step(m, microbatches, batch=batch, value_head=False, value_coef=0.0) for m in (None, mesh)]
        out["cases"].append({"prompts": P, "group": G, "microbatches": microbatches, "prompts_divide": P % shards == 0,
                             **differences(*runs, value_head=False)})
    return out


def initial_params(value_head=True):
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(build(value_head=value_head)[0])))


def compare(mesh_sizes):
    from rlcode.sharding import make_mesh, mesh_config

    ref = run_step(mesh=None, microbatches=2)
    mesh = make_mesh(mesh_config(**mesh_sizes))
    run = run_step(mesh=mesh, microbatches=2)
    return {
        "devices": len(jax.devices()),
        "mesh": dict(mesh.shape),
        "sharded_params": sum(1 for x in jax.tree.leaves(run[2].params) if not x.sharding.is_fully_replicated),
        **differences(ref, run),
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
    if sys.argv[1] == "shared":
        sizes = dict(kv.split("=") for kv in sys.argv[2].split(","))
        print(json.dumps(compare_shared({k: int(v) for k, v in sizes.items()})))
    elif sys.argv[1] == "distributed":
        pid, nproc, port = (int(x) for x in sys.argv[2:5])
        sizes = dict(kv.split("=") for kv in sys.argv[5].split(","))
        print(json.dumps(distributed(pid, nproc, port, {k: int(v) for k, v in sizes.items()})))
    else:
        sizes = dict(kv.split("=") for kv in sys.argv[1].split(","))
        print(json.dumps(compare({k: int(v) for k, v in sizes.items()})))
