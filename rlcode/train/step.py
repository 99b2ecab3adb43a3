"""Train state, optimizer, and the jitted, sharded policy-gradient train step.

`train_step(state, batch) -> (state, metrics)` runs the model forward on a batch laid out by
`rlcode.sampling.to_training_batch` (plus advantages and the log-probs of the old / reference
policies), computes the objective of `rlcode.losses.objective_terms` from chunked log-probs,
accumulates gradients over micro-batches with the (numerator, denominator) contract, and applies
AdamW. It is jitted once with the state's shardings, the batch sharded over the data axes, and
the state donated.

Batch keys (all [B, T] unless noted): inputs, targets, positions, mask, kv_lengths [B],
advantages ([B] or [B, T]); optional old_logp (the policy the batch was scored with; absent: the
parameters being trained, i.e. this forward's own log-probs without their gradient, exact when
the batch gets one optimizer update and no other pass needs them: `make_prepare_fn` of the
synthesis job then skips that pass), behavior_logp (IS correction), ref_logp (KL), old_values and
returns (PPO value loss), segment_ids and is_global (packed documents under squid attention,
`rlcode.models.attention.AttentionMask`), score_index [B, K] (`with_score_index`: the log-probs,
and the unembedding with them, are computed at those positions only), prompts, prompt_lengths
and completions (`with_shared_prompts`: each group's prompt is computed once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlcode import losses
from rlcode.checks import expect_type
from rlcode.models.moe import rebalance_routers
from rlcode.models.attention import AttentionMask
from rlcode.models.logprobs import token_logprobs
from rlcode.models.transformer import logical_axes
from rlcode.sharding import DEFAULT_RULES, Rules, named_shardings, place, put

BATCH_KEYS = ("inputs", "targets", "positions", "mask", "kv_lengths", "advantages")
OPTIONAL_BATCH_KEYS = ("old_logp", "behavior_logp", "ref_logp", "old_values", "returns", "segment_ids", "is_global",
                       "score_index", "prompts", "prompt_lengths", "completions")
SCORE_MIN = 64  # score_index widths are powers of two from this (few shapes to compile)


class TrainState(NamedTuple):
    """step (int32 scalar), params (pure dict of arrays), opt_state (optax), rng (PRNG key)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def optim_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The `optim` config section: AdamW, linear warmup then cosine decay, global-norm clipping."""
    cfg = ml_collections.ConfigDict(
        {
            "lr": 1e-5,
            "warmup_steps": 10,
            "total_steps": 1000,
            "min_lr_ratio": 0.1,
            "b1": 0.9,
            "b2": 0.95,
            "eps": 1e-8,
            "weight_decay": 0.0,
            "grad_clip": 1.0,
        }
    )
    cfg.update(overrides)
    return cfg


def lr_schedule(cfg: Any) -> optax.Schedule:
    """Linear warmup then cosine decay.

    lr(s) = lr * (s + 1) / W for s < W (the first step already learns), then
    lr * (r + (1 - r) * (1 + cos(pi * p)) / 2) with p = (s - W) / (S - W) clipped to [0, 1],
    W = warmup_steps, S = total_steps, r = min_lr_ratio.
    """
    lr, warmup, total, ratio = cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = lr * (s + 1) / max(warmup, 1)
        progress = jnp.clip((s - warmup) / max(total - warmup, 1), 0.0, 1.0)
        cosine = lr * (ratio + (1 - ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def make_optimizer(cfg: Any, trainable: Any = None) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; weight decay only on matrices (not norms or biases).

    trainable: None (train every parameter) or a tree of bools matching the params (e.g.
    `rlcode.models.lora.adapter_mask`): only the True leaves are clipped, updated and get
    optimizer moments; the others get zero updates and no optimizer state.
    """
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity(),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    if trainable is None:
        return tx
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def _batch_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    return tuple(a for a in dict(rules).get("batch", ()) if mesh.shape[a] > 1)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Shard the leading (batch) axis over the mesh axes of the 'batch' rule."""
    axes = _batch_axes(mesh, rules)
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


def batch_shards(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many parts `batch_sharding` splits the leading axis into."""
    return int(np.prod([mesh.shape[a] for a in _batch_axes(mesh, rules)]))


def split_on_mesh(model: nnx.Module, mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> tuple[nnx.GraphDef, Any]:
    """The model placed on `mesh` (`rlcode.sharding.place`), split into its graphdef and its
    pure-dict parameters, each sharded by its logical axes (mesh None: unplaced, as they are).

    The graphdef carries the mesh: every function built from it (train step, log-probs, sampler)
    pins activations and routes experts the same way."""
    graphdef, state = nnx.split(place(model, mesh, rules))
    params = nnx.to_pure_dict(state)
    if mesh is not None:
        params = put(params, named_shardings(logical_axes(model), params, mesh, rules))
    return graphdef, params


def init_train_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    seed: int,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> tuple[nnx.GraphDef, TrainState]:
    """Split the model and build the train state, its parameters sharded by their logical axes
    on `mesh` (`split_on_mesh`)."""
    graphdef, params = split_on_mesh(model, mesh, rules)
    # jit propagates each parameter's sharding to its optimizer moments; what depends on no
    # parameter (step counts) is replicated over the mesh.
    opt_state = jax.jit(optimizer.init)(params)
    step = jnp.zeros((), jnp.int32)
    rng = jax.random.key(seed)
    if mesh is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
        on_mesh = lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh else put(x, replicated)
        opt_state = jax.tree.map(on_mesh, opt_state)
        step, rng = put((step, rng), (replicated, replicated))
    return graphdef, TrainState(step, params, opt_state, rng)


def state_shardings(state: TrainState) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)


def with_score_index(batch: dict, minimum: int = SCORE_MIN, max_fraction: float = 0.75,
                     width: int | None = None) -> dict:
    """`batch` plus ``score_index`` [B, K]: in each row, the positions where ``mask`` is set, in
    order, then -1 (K = the largest count rounded up to a power of two, at least `minimum`, so
    a run compiles few shapes). Log-probs are then computed
    only there: the loss uses no other position, and the unembedding with its softmax over the
    vocabulary is the costliest part of scoring a token. Positions outside the mask get log-prob
    0 (as the losses mask them anyway). Returned unchanged where K would exceed `max_fraction`
    of the time axis (little to save), or where it is already there. `width`: K itself (at least
    the largest count)."""
    if "score_index" in batch:
        return batch
    mask = np.asarray(batch["mask"], bool)
    B, T = mask.shape
    most = int(mask.sum(1).max(initial=0))
    K = min(T, max(minimum, 1 << (max(most, 1) - 1).bit_length())) if width is None else int(width)
    if K < most:
        raise ValueError(f"score_index width {K} < {most} loss positions in a row")
    if K > max_fraction * T:
        return batch
    order = np.argsort(~mask, axis=1, kind="stable")[:, :K]  # masked positions first, in order
    index = np.where(np.take_along_axis(mask, order, axis=1), order, -1).astype(np.int32)
    if K > T:
        index = np.pad(index, ((0, 0), (0, K - T)), constant_values=-1)
    return dict(batch, score_index=jnp.asarray(index))


def with_shared_prompts(batch: dict, prompts, prompt_lengths, completions, multiple: int = 16) -> dict:
    """`batch` (rows laid out prompt + completion, `rlcode.sampling.to_training_batch`, G rows per
    prompt) plus the keys of the shared-prompt forward (`rlcode.models.transformer.Transformer.
    forward_shared`): ``prompts`` [P, Lp] and ``prompt_lengths`` [P] once per group, and each row's
    ``completions`` [B, Lc] (its sampled tokens: row position prompt_length + t holds token t),
    Lc cut to what the loss positions read, rounded up to `multiple`; the prompts keep their
    width (the task pool's), so a run compiles one shape per completion width: each compilation
    of the train step costs as much as many steps, and the prompts are computed only once per
    group. The log-probs then come from
    a forward over P prompts and B completions instead of B prompts + completions; they are equal.
    Also adds ``score_index`` (`with_score_index`), which this forward needs, Lc + 1 wide (a
    row's loss positions: its prompt's last token and at most Lc own ones), so the batch's shapes
    follow Lc alone when its time axis is not trimmed."""
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    prompts, completions = np.asarray(prompts), np.asarray(completions)
    B, P = completions.shape[0], prompts.shape[0]
    if B % P or B != batch["inputs"].shape[0]:
        raise ValueError(f"{B} completion rows for {P} prompts and a batch of {batch['inputs'].shape[0]} rows")
    rows_p = np.repeat(prompt_lengths, B // P)
    inputs = np.asarray(batch["inputs"])[:, :int(prompt_lengths.max(initial=1))]
    in_prompt = np.arange(inputs.shape[1])[None, :] < rows_p[:, None]
    if not np.array_equal(np.where(in_prompt, inputs, 0), np.where(in_prompt, np.repeat(prompts[:, :inputs.shape[1]], B // P, 0), 0)):
        raise ValueError(f"the batch's rows do not start with their group's prompt ({P} groups of {B // P} rows)")
    mask = np.asarray(batch["mask"], bool)
    own = np.arange(mask.shape[1])[None, :] - rows_p[:, None]
    if (mask & (own < -1)).any():
        raise ValueError("a loss position lies inside a row's prompt")
    last = int(np.where(mask, own, -1).max(initial=-1))  # the last own position the loss reads
    Lc = min(completions.shape[1], max(multiple, -(-(last + 1) // multiple) * multiple))
    batch = with_score_index(batch, max_fraction=float("inf"), width=Lc + 1)  # whatever its share of T
    return dict(batch, prompts=jnp.asarray(prompts), prompt_lengths=jnp.asarray(prompt_lengths),
                completions=jnp.asarray(completions[:, :Lc]))


def _shared_hidden(model, mb):
    """The hidden states at ``score_index`` from the shared-prompt forward: a row's first loss
    position reads its prompt's last token (the prompt's stream), later ones its own tokens."""
    prompts, lengths, own = mb["prompts"], mb["prompt_lengths"], mb["completions"]
    B, Lc = own.shape
    G = B // prompts.shape[0]
    p = jnp.repeat(lengths.astype(jnp.int32), G)[:, None]  # [B, 1]
    out_p, out_c = model.forward_shared(prompts, lengths, own, p + jnp.arange(Lc)[None, :])
    at = jnp.maximum(mb["score_index"], 0)
    in_prompt = at < p
    group = (jnp.arange(B) // G)[:, None]
    from_prompt = out_p.hidden[group, jnp.minimum(at, prompts.shape[1] - 1)]
    from_own = jnp.take_along_axis(out_c.hidden, jnp.clip(at - p, 0, Lc - 1)[..., None], axis=1)
    hidden = jnp.where(in_prompt[..., None], from_prompt, from_own)
    aux = {k: out_p.aux.get(k, 0.0) + out_c.aux.get(k, 0.0) for k in {*out_p.aux, *out_c.aux}}
    return hidden, aux


PROMPT_KEYS = ("prompts", "prompt_lengths")  # one row per group of a shared-prompt batch


def split_microbatches(batch: dict, num: int) -> dict:
    """Stack `num` strided micro-batches of `batch` on a new leading axis: rows i, i+num, ...; a
    shared-prompt batch (`with_shared_prompts`) is split by whole groups (groups i, i+num, ...),
    its prompts with them."""
    B = batch["inputs"].shape[0]
    if "prompts" not in batch:
        return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(B // num, num, *x.shape[1:]), 0, 1), batch)
    P = batch["prompts"].shape[0]
    if P % num:
        raise ValueError(f"{P} prompt groups are not divisible by microbatches={num}")
    G = B // P
    split = lambda x, rows: jnp.swapaxes(x.reshape(P // num, num, rows, *x.shape[1:]), 0, 1).reshape(
        num, (P // num) * rows, *x.shape[1:])
    return {k: split(v, 1 if k in PROMPT_KEYS else G) for k, v in batch.items()}


def _forward_logprobs(graphdef, params, mb, sampling_options, need_entropy):
    model = nnx.merge(graphdef, params)
    w, layout = model.unembedding()
    targets, index = mb["targets"], mb.get("score_index")
    if "prompts" in mb:  # prompts once per group (`with_shared_prompts`)
        hidden, aux = _shared_hidden(model, mb)
        values = None
        targets = jnp.take_along_axis(targets, jnp.maximum(index, 0), axis=1)
    else:
        mask = AttentionMask(kv_lengths=mb["kv_lengths"], segment_ids=mb.get("segment_ids"),
                             is_global=mb.get("is_global"))
        out = model(mb["inputs"], mb["positions"], mask)
        hidden, values, aux = out.hidden, out.values, out.aux
        if index is not None:  # only the scored positions reach the unembedding (`with_score_index`)
            at = jnp.maximum(index, 0)
            hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)
            targets = jnp.take_along_axis(targets, at, axis=1)
    res = token_logprobs(hidden, w, targets, **sampling_options, unembed_layout=layout,
                         return_entropy=need_entropy)
    logp, entropy = res if need_entropy else (res, None)
    if index is not None:
        scatter = lambda x: jnp.zeros(mb["targets"].shape, x.dtype).at[
            jnp.arange(x.shape[0])[:, None], jnp.maximum(index, 0)].add(jnp.where(index >= 0, x, 0))
        logp = scatter(logp)
        entropy = None if entropy is None else scatter(entropy)
    return logp, entropy, values, aux


def make_logprob_fn(
    graphdef: nnx.GraphDef, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Callable:
    """jit fn(params, batch) -> (logp [B, T], values [B, T] or None): old / reference log-probs.

    The distribution options are those of `rlcode.models.logprobs.token_logprobs`.
    """
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    @jax.jit
    def fn(params, batch):
        logp, _, values, _ = _forward_logprobs(graphdef, params, batch, options, False)
        return logp, values

    return fn


def make_train_step(
    graphdef: nnx.GraphDef,
    objective: losses.ObjectiveConfig,
    optimizer: optax.GradientTransformation,
    *,
    microbatches: int = 1,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    schedule: optax.Schedule | None = None,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    shardings: Any = None,
    log_entropy: bool = False,
    trainable: Any = None,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """Build `train_step(state, batch) -> (state, metrics)`, jitted, donating the state.

    Args:
      graphdef: from `init_train_state`.
      objective: the `rlcode.losses.ObjectiveConfig` of the `loss` section
        (`ObjectiveConfig.from_config(cfg.loss)`, converted once where the job reads its config).
      optimizer: from `make_optimizer`.
      microbatches: M; the batch is split into M strided micro-batches (rows i, i+M, ...) whose
        gradients are accumulated exactly.
      temperature, top_k, top_p: the policy's distribution for log-probs. The default trains
        pi = softmax(logits / temperature), the sampler's temperature; a sampler's top-k/top-p
        truncation then shows up as a behaviour/policy mismatch for the IS correction. Passing
        the sampler's top_k/top_p instead trains the truncated distribution itself.
      schedule: optional learning-rate schedule, reported as the `lr` metric.
      mesh, rules, shardings: with a mesh, the step is jitted with `shardings` (the state's,
        see `state_shardings`) and the batch sharded over the data axes.
      log_entropy: report the policy's mean entropy (`entropy` metric) even when
        loss.entropy_coef is 0 (costs one more pass over each log-prob chunk).
      trainable: None, or the tree of bools given to `make_optimizer`: gradients are taken
        with respect to the True leaves only (the others enter the loss as constants, so no
        weight gradient is computed for them; their gradients read as zero) and the other
        parameters are carried over unchanged.
    """
    expect_type(objective, losses.ObjectiveConfig, "objective")
    need_entropy = objective.entropy_coef > 0 or log_entropy
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    def terms_fn(params, mb):
        logp, entropy, values, aux = _forward_logprobs(graphdef, params, mb, options, need_entropy)
        old_logp = mb.get("old_logp")
        own = jax.lax.stop_gradient(jnp.where(mb["mask"], logp, 0.0))
        if old_logp is None:  # scored by the parameters being trained: their own log-probs
            old_logp = own
        num, den, metrics = losses.objective_terms(
            objective, logp, old_logp, mb["advantages"], mb["mask"],
            behavior_logp=mb.get("behavior_logp"), ref_logp=mb.get("ref_logp"), entropy=entropy,
            values=values if "returns" in mb else None, old_values=mb.get("old_values"), returns=mb.get("returns"),
        )
        if "old_logp" not in mb and "ref_logp" in mb:
            # The summed log-ratio to the reference per row, as a sum over the rows with loss
            # positions and their count (means over micro-batches divide exactly).
            rows = jnp.any(mb["mask"], axis=-1)
            metrics["kl_from_start_sum"] = jnp.sum(jnp.where(rows, jnp.sum(own - mb["ref_logp"], axis=-1), 0.0))
            metrics["kl_from_start_rows"] = jnp.sum(rows).astype(jnp.float32)
        for name, value in aux.items():
            # Auxiliary (MoE) losses are means over the micro-batch; weight them like the tokens.
            # Other aux entries (load fractions, drop rates) are metrics only.
            if name.endswith("_loss"):
                num = num + value * den
            metrics[f"aux_{name}"] = jax.lax.stop_gradient(value)
        return num, den, metrics

    def gradients(params, mbs):
        if trainable is None:
            return losses.accumulate_gradients(terms_fn, params, mbs)
        leaves, treedef = jax.tree.flatten(params)
        flags = treedef.flatten_up_to(trainable)

        def with_frozen(trained):
            it = iter(trained)
            return treedef.unflatten([next(it) if f else p for p, f in zip(leaves, flags)])

        trained = [p for p, f in zip(leaves, flags) if f]
        loss, grads, metrics = losses.accumulate_gradients(lambda t, mb: terms_fn(with_frozen(t), mb), trained, mbs)
        it = iter(grads)
        grads = treedef.unflatten([next(it) if f else jnp.zeros_like(p) for p, f in zip(leaves, flags)])
        return loss, grads, metrics

    def step_fn(state: TrainState, batch: dict[str, jax.Array]):
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"train batch is missing {missing}")
        B = batch["inputs"].shape[0]
        if B % microbatches:
            raise ValueError(f"batch size {B} is not divisible by microbatches={microbatches}")
        mbs = split_microbatches(batch, microbatches)
        loss, grads, metrics = gradients(state.params, mbs)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if trainable is not None:
            params = jax.tree.map(lambda t, new, old: new if t else old, trainable, params, state.params)
        params = rebalance_routers(graphdef, state.params, params, metrics)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), update_norm=optax.tree.norm(updates))
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        rng, _ = jax.random.split(state.rng)
        return TrainState(state.step + 1, params, opt_state, rng), metrics

    if mesh is None:
        return jax.jit(step_fn, donate_argnums=0)

    data = batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step_fn, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)
    shards = batch_shards(mesh, rules)

    def sharded_step(state, batch):
        # A batch computed on the mesh by another jitted function (old log-probs, advantages) is
        # committed to that function's output sharding; jit does not reshard committed inputs.
        # Rows are split over the data axes; a shared-prompt batch's prompts with their rows when
        # they divide evenly, else replicated.
        where = {k: (data if k not in PROMPT_KEYS or v.shape[0] % shards == 0 else replicated) for k, v in batch.items()}
        return jitted(state, jax.device_put(batch, where))

    return sharded_step
