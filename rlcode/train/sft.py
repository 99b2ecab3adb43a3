"""Supervised warm start: maximum likelihood on demonstrations, cached on disk by content.

The SFT loss is the mean negative log-likelihood of the demonstration tokens,
-sum_{b,t} m log pi(y_bt | y_<t) / sum_{b,t} m, with m the completion tokens (the prompt is not
trained on). It is the ``reinforce`` policy loss with advantage 1, ``token-mean`` aggregation,
so it runs through the same jitted, sharded `rlcode.train.step.make_train_step` as RL
(chunked log-probs, micro-batching, the mesh) instead of a second training step.

Caching. The result is keyed by the SHA-256 of everything that determines it (the model
section without the value head, the sft section, the demonstrations' token arrays, the seed);
`load_or_train` restores a cached result when the key matches and trains and saves otherwise,
so the second run of an experiment skips SFT. A corrupted cache entry is reported and retrained.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from rlcode import losses
from rlcode.checks import apply_overrides
from rlcode.models import hf
from rlcode.models.layers import INIT_SCHEME
from rlcode.models.transformer import init_model
from rlcode.sampling import SampleOutput, to_training_batch
from rlcode.train.checkpoint import CheckpointError, Checkpointer
from rlcode.train.rollout import EncodedTasks, trim_batch
from rlcode.train.step import init_train_state, make_optimizer, make_train_step, optim_config, with_score_index
from rlcode.train.workdir import ADDED_FIELDS


# The SFT loss as an objective: reinforce with advantage 1, token-mean (see the module docstring).
SFT_OBJECTIVE = losses.ObjectiveConfig(policy=losses.PolicyLossConfig(kind="reinforce", agg="token-mean"))


def sft_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The `sft` config section. steps = 0 disables the warm start."""
    cfg = ml_collections.ConfigDict(
        {
            "steps": 300,
            "batch_size": 32,
            "microbatches": 1,
            "lr": 3e-3,
            "warmup_steps": 20,
            "min_lr_ratio": 0.1,
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            "cache_dir": "runs/sft_cache",
            "log_every": 50,
            # The warm start's seed; -1: the run's. RL seeds compared from one warm start set it.
            "seed": -1,
        }
    )
    apply_overrides(cfg, overrides, "sft")
    return cfg


def demo_batch(demos: EncodedTasks, ids: np.ndarray, trim_multiple: int = 32) -> dict[str, jax.Array]:
    """A train-step batch of demonstrations `ids`: prompt + reference continuation, the loss on
    the continuation (advantage 1, old log-probs 0: ``reinforce`` ignores them); the time axis
    is trimmed as in `rlcode.train.rollout.trim_batch`."""
    ids = np.asarray(ids)
    targets = demos.targets[ids]
    lengths = demos.target_lengths[ids]
    mask = np.arange(targets.shape[1])[None, :] < lengths[:, None]
    out = SampleOutput(jnp.asarray(targets), jnp.zeros(targets.shape, jnp.float32), jnp.asarray(mask),
                       jnp.asarray(lengths))
    tb = to_training_batch(jnp.asarray(demos.prompts[ids]), jnp.asarray(demos.prompt_lengths[ids]), out, group_size=1)
    batch = {
        "inputs": tb.inputs, "targets": tb.targets, "positions": tb.positions, "mask": tb.mask,
        "kv_lengths": tb.kv_lengths, "advantages": jnp.ones(tb.mask.shape[0], jnp.float32),
        "old_logp": jnp.zeros(tb.mask.shape, jnp.float32),
    }
    needed = int(np.max(demos.prompt_lengths[ids] + lengths)) - 1
    return with_score_index(trim_batch(batch, needed, trim_multiple))


def _demo_arrays(demos: Any) -> tuple[np.ndarray, ...]:
    if isinstance(demos, EncodedTasks):
        return demos.prompts, demos.prompt_lengths, demos.targets, demos.target_lengths
    return demos.arrays()


def _demo_batch(demos: Any, ids: np.ndarray) -> dict[str, jax.Array]:
    return demo_batch(demos, ids) if isinstance(demos, EncodedTasks) else demos.batch(ids)


def warm_start_seed(cfg: Any) -> int:
    """The seed of a job's SFT warm start: ``sft.seed``, or the run's ``seed`` where it is -1."""
    seed = cfg.sft.get("seed", -1)
    return cfg.seed if seed < 0 else seed


def cache_key(model_cfg: Any, sft_cfg: Any, demos: Any, seed: int) -> str:
    model = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)
    model.pop("value_head", None)
    sft = sft_cfg.to_dict() if hasattr(sft_cfg, "to_dict") else dict(sft_cfg)
    for k in ("cache_dir", "log_every", "seed"):  # the seed used is the `seed` argument
        sft.pop(k, None)
    if model.get("init_from"):  # the starting weights are part of what the warm start depends on
        model["init_from"] = hf.checkpoint_fingerprint(model["init_from"])
    # Fields added since caches were written leave the key unchanged at their neutral values, so
    # those caches stay valid.
    for key, neutral in ADDED_FIELDS.items():
        if key.startswith("model.") and model.get(key[len("model."):]) == neutral:
            model.pop(key[len("model."):])
    h = hashlib.sha256()
    # INIT_SCHEME names how fresh parameters are drawn: a fix to the initialisation is a new scheme,
    # so warm starts cached under the old one are not reused.
    h.update(json.dumps({"model": model, "sft": sft, "seed": seed, "init": INIT_SCHEME}, sort_keys=True,
                        default=str).encode())
    for a in _demo_arrays(demos):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def train(model_cfg: Any, sft_cfg: Any, demos: Any, seed: int,
          on_step: Callable[[int, dict], None] | None = None) -> tuple[Any, list[dict]]:
    """Train the job's starting model (`hf.initial_model`: fresh, or the checkpoint of
    ``model.init_from``; no value head) on `demos`; returns (pure-dict params, history).

    demos: `EncodedTasks` (prompt + reference continuation) or any object with ``len()``,
    ``batch(ids) -> train-step batch`` and ``arrays() -> arrays that determine it`` (the cache
    key), such as multi-turn agent demonstrations (`rlcode.train.demonstrations.Demonstrations`).
    Batches are drawn without replacement, epoch by epoch, from a `seed`-ed permutation.
    on_step(step, metrics) is called after each step (progress display).
    """
    cfg = ml_collections.ConfigDict(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    cfg.value_head = False
    model = hf.initial_model(cfg, seed)
    optim = optim_config(lr=sft_cfg.lr, warmup_steps=sft_cfg.warmup_steps, total_steps=sft_cfg.steps,
                         min_lr_ratio=sft_cfg.min_lr_ratio, weight_decay=sft_cfg.weight_decay,
                         grad_clip=sft_cfg.grad_clip)
    optimizer = make_optimizer(optim)
    graphdef, state = init_train_state(model, optimizer, seed)
    step_fn = make_train_step(graphdef, SFT_OBJECTIVE, optimizer, microbatches=sft_cfg.microbatches)
    rng = np.random.default_rng(seed)
    bs = min(sft_cfg.batch_size, len(demos))
    order = rng.permutation(len(demos))
    cursor = 0
    history = []
    for step in range(sft_cfg.steps):
        if cursor + bs > len(order):
            order, cursor = rng.permutation(len(demos)), 0
        ids = order[cursor: cursor + bs]
        cursor += bs
        state, metrics = step_fn(state, _demo_batch(demos, ids))
        nll = float(metrics["policy_loss"])
        if not np.isfinite(nll):
            raise FloatingPointError(f"SFT loss is {nll} at step {step}; lower sft.lr (now {sft_cfg.lr})")
        record = {"step": step, "nll": nll, "grad_norm": float(metrics["grad_norm"])}
        history.append(record)
        if on_step is not None:
            on_step(step, record)
    return jax.device_get(state.params), history


def load_or_train(model_cfg: Any, sft_cfg: Any, demos: Any, seed: int,
                  on_step: Callable[[int, dict], None] | None = None,
                  log: Callable[[str], None] = print) -> tuple[Any, dict]:
    """SFT params for (model, sft config, demos, seed), from the cache or freshly trained.

    Returns (pure-dict params, info) with info = {"key", "path", "cached", "history", "seconds"}.
    """
    key = cache_key(model_cfg, sft_cfg, demos, seed)
    path = os.path.join(sft_cfg.cache_dir, key)
    t0 = time.perf_counter()
    if os.path.isdir(path):
        try:
            cached = restore_cached(path, model_cfg)
            if cached is not None:
                params, extra = cached
                log(f"SFT: reusing the cached warm start {path} (trained {extra['seconds']:.0f} s)")
                return params, {"key": key, "path": path, "cached": True, "history": extra["history"],
                                "seconds": time.perf_counter() - t0}
        except CheckpointError as e:
            log(f"SFT: cache entry {path} is unreadable ({e}); training again")
    params, history = train(model_cfg, sft_cfg, demos, seed, on_step)
    seconds = time.perf_counter() - t0
    ckpt = Checkpointer(path, keep=1, async_save=False)
    try:
        ckpt.save(sft_cfg.steps, params, extra={"history": history, "seconds": seconds}, force=True)
    finally:
        ckpt.close()
    return params, {"key": key, "path": path, "cached": False, "history": history, "seconds": seconds}


def restore_cached(path: str, model_cfg: Any) -> tuple[Any, dict] | None:
    """(pure-dict params, extra) of the warm start cached in directory `path` for a model of
    `model_cfg` (no value head); None when it holds no checkpoint; CheckpointError if unreadable."""
    ckpt = Checkpointer(path, keep=1, async_save=False)
    try:
        if ckpt.latest_step() is None:
            return None
        return ckpt.restore(target=_template(model_cfg, 0))
    finally:
        ckpt.close()


def _template(model_cfg: Any, seed: int) -> Any:
    cfg = ml_collections.ConfigDict(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    cfg.value_head = False
    abstract = nnx.eval_shape(lambda: init_model(cfg, seed))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        nnx.to_pure_dict(nnx.state(abstract)))


def merge_params(target: Any, source: Any) -> Any:
    """`target` (pure dict) with every leaf that `source` also has replaced by source's (same
    shape required): loads SFT weights into a model that adds a value head."""
    if isinstance(target, dict):
        return {k: merge_params(v, source[k]) if k in source else v for k, v in target.items()}
    if np.shape(target) != np.shape(source):
        raise ValueError(f"cannot load a {np.shape(source)} parameter into {np.shape(target)}")
    return jnp.asarray(source, dtype=target.dtype)
