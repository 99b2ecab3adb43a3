"""Reward models learned from pairwise choices (Bradley-Terry).

A reward model is the policy architecture (`rlcode.models.transformer`, from scratch or from any
checkpoint `rlcode.models.hf.initial_model` loads) with its scalar value head; the reward of a
completion is the head's value at the last token of prompt + completion + EOS. It is trained so
that, for a pair in which people chose `y_c` over `y_r` for prompt `x`,

    P(y_c > y_r) = sigmoid(r(x, y_c) - r(x, y_r)),    loss = -log sigmoid(delta - m)

(delta = r(x, y_c) - r(x, y_r), m the pair's margin, 0 by default); a pair labelled a tie
contributes -1/2 [log sigmoid(delta) + log sigmoid(-delta)], which is smallest at delta = 0. The
batch loss is the weight-weighted mean over pairs (docs/reference.md §14).

Reported on held-out pairs: pairwise accuracy (ties excluded; delta = 0 counts one half), the loss,
and the calibration of sigmoid(delta): the expected calibration error over bins of the confidence
sigmoid(|delta|) (each pair folded so its predicted winner is the first), i.e.
ECE = sum_b (n_b / n) |accuracy_b - mean confidence_b|.

`RewardModel.score(prompts, completions)` is the pointwise API a job uses as a reward: batched,
jitted (rows padded to a few bucket lengths, so it compiles a bounded number of shapes), on the
policy's mesh when one is given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from rlcode.feedback.preferences import PreferencePair
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import ModelConfig, init_model
from rlcode.sharding import DEFAULT_RULES, Rules
from rlcode.tokenizer import Tokenizer, load_tokenizer
from rlcode.train import checkpoint
from rlcode.train.step import batch_sharding, init_train_state, make_optimizer, optim_config, split_on_mesh

__all__ = ["pair_losses", "bradley_terry_loss", "pairwise_metrics", "PairBatch", "encode_pairs", "encode_texts",
           "make_score_fn", "RewardModel", "train_config", "train_reward_model", "load_reward_model",
           "reward_model_extra", "FORMAT"]

FORMAT = "rlcode.reward_model/1"


# --------------------------------------------------------------------------------------------
# The loss and its metrics
# --------------------------------------------------------------------------------------------


def pair_losses(delta: jax.Array, tie: jax.Array, margin: jax.Array) -> jax.Array:
    """Per pair: -log sigmoid(delta - margin), or for a tie -1/2 [log sigmoid(delta) + log sigmoid(-delta)]."""
    win = jax.nn.softplus(margin - delta)
    draw = 0.5 * (jax.nn.softplus(-delta) + jax.nn.softplus(delta))
    return jnp.where(tie, draw, win)


def bradley_terry_loss(r_chosen: jax.Array, r_rejected: jax.Array, tie: jax.Array | None = None,
                       weight: jax.Array | None = None, margin: jax.Array | None = None) -> jax.Array:
    """The weighted mean of `pair_losses` over pairs (rewards [N] of the chosen and the rejected)."""
    delta = (r_chosen - r_rejected).astype(jnp.float32)
    tie = jnp.zeros(delta.shape, bool) if tie is None else tie
    weight = jnp.ones(delta.shape, jnp.float32) if weight is None else weight
    margin = jnp.zeros(delta.shape, jnp.float32) if margin is None else margin
    return jnp.sum(weight * pair_losses(delta, tie, margin)) / jnp.sum(weight)


def pairwise_metrics(delta: Any, tie: Any = None, bins: int = 10) -> dict[str, float]:
    """Accuracy, loss and calibration of reward differences `delta` = r(chosen) - r(rejected).

    accuracy: over non-tie pairs, delta > 0 counts 1 and delta = 0 one half. ece: expected
    calibration error of the confidence sigmoid(|delta|) in `bins` equal bins over [0.5, 1].
    loss: the unweighted mean pair loss (margins 0). Also the number of pairs and of ties."""
    delta = np.asarray(delta, np.float64)
    tie = np.zeros(delta.shape, bool) if tie is None else np.asarray(tie, bool)
    d = delta[~tie]
    loss = np.where(tie, 0.5 * (np.logaddexp(0, -delta) + np.logaddexp(0, delta)), np.logaddexp(0, -delta))
    out = {"pairs": float(delta.size), "ties": float(tie.sum()), "loss": float(loss.mean()) if delta.size else math.nan}
    if d.size == 0:
        return dict(out, accuracy=math.nan, ece=math.nan, mean_delta=math.nan)
    correct = np.where(d > 0, 1.0, np.where(d == 0, 0.5, 0.0))
    confidence = 1.0 / (1.0 + np.exp(-np.abs(d)))
    index = np.minimum(((confidence - 0.5) * 2 * bins).astype(int), bins - 1)
    ece = sum(abs(correct[index == b].mean() - confidence[index == b].mean()) * (index == b).sum()
              for b in range(bins) if (index == b).any()) / d.size
    return dict(out, accuracy=float(correct.mean()), ece=float(ece), mean_delta=float(d.mean()))


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _sequence(tokenizer: Tokenizer, prompt: str, completion: str) -> list[int]:
    ids = tokenizer.encode(prompt) + tokenizer.encode(completion)
    eos = getattr(tokenizer, "eos_id", None)
    return ids + ([eos] if eos is not None else [])


def _bucket(n: int, minimum: int = 32) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def encode_texts(tokenizer: Tokenizer, prompts: Sequence[str], completions: Sequence[str], max_len: int,
                 length: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens [B, T] right-padded with 0, lengths [B], number truncated) of prompt + completion +
    EOS. A sequence over `max_len` keeps its last `max_len` tokens (the prompt's start is cut,
    the completion and the position the reward is read at are kept). T = `length`, or the longest
    row rounded up to a power of two (at most `max_len`)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows = [_sequence(tokenizer, p, c) for p, c in zip(prompts, completions)]
    truncated = sum(len(r) > max_len for r in rows)
    rows = [r[-max_len:] for r in rows]
    T = length if length is not None else min(_bucket(max((len(r) for r in rows), default=1)), max_len)
    tokens = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return tokens, np.array([len(r) for r in rows], np.int32), truncated


@dataclasses.dataclass
class PairBatch:
    """Encoded pairs: tokens [N, 2, T] (chosen, rejected), lengths [N, 2], tie / weight / margin [N]."""

    tokens: np.ndarray
    lengths: np.ndarray
    tie: np.ndarray
    weight: np.ndarray
    margin: np.ndarray
    truncated: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, index: Any) -> PairBatch:
        return PairBatch(self.tokens[index], self.lengths[index], self.tie[index], self.weight[index],
                         self.margin[index], self.truncated)


def encode_pairs(tokenizer: Tokenizer, pairs: Sequence[PreferencePair], max_len: int,
                 length: int | None = None) -> PairBatch:
    """Both completions of every pair after its prompt, as `encode_texts` encodes them."""
    if not pairs:
        raise ValueError("no preference pairs to encode")
    prompts = [p.prompt for p in pairs for _ in range(2)]
    completions = [c for p in pairs for c in (p.chosen, p.rejected)]
    tokens, lengths, truncated = encode_texts(tokenizer, prompts, completions, max_len, length)
    n = len(pairs)
    return PairBatch(tokens.reshape(n, 2, -1), lengths.reshape(n, 2), np.array([p.tie for p in pairs], bool),
                     np.array([p.weight for p in pairs], np.float32), np.array([p.margin for p in pairs], np.float32),
                     truncated)


# --------------------------------------------------------------------------------------------
# Scoring and training
# --------------------------------------------------------------------------------------------


def _rewards(graphdef: Any, params: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, params)
    out = model(tokens, None, AttentionMask(kv_lengths=lengths))
    if out.values is None:
        raise ValueError("a reward model needs the value head (model.value_head=True)")
    last = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(out.values, last[:, None], axis=1)[:, 0].astype(jnp.float32)


def make_score_fn(graphdef: Any) -> Callable:
    """jit fn(params, tokens [B, T], lengths [B]) -> rewards [B]: the value head at each row's last token."""
    return jax.jit(lambda params, tokens, lengths: _rewards(graphdef, params, tokens, lengths))


def _pair_loss(graphdef: Any, params: Any, batch: dict) -> tuple[jax.Array, dict]:
    n, _, T = batch["tokens"].shape
    r = _rewards(graphdef, params, batch["tokens"].reshape(2 * n, T), batch["lengths"].reshape(2 * n)).reshape(n, 2)
    delta = r[:, 0] - r[:, 1]
    loss = bradley_terry_loss(r[:, 0], r[:, 1], batch["tie"], batch["weight"], batch["margin"])
    decided = ~batch["tie"]
    accuracy = jnp.sum(jnp.where(decided, (delta > 0) + 0.5 * (delta == 0), 0.0)) / jnp.maximum(jnp.sum(decided), 1)
    return loss, {"loss": loss, "accuracy": accuracy, "mean_abs_delta": jnp.mean(jnp.abs(delta))}


def _as_arrays(batch: PairBatch) -> dict:
    return {"tokens": batch.tokens, "lengths": batch.lengths, "tie": batch.tie, "weight": batch.weight,
            "margin": batch.margin}


class RewardModel:
    """A reward model ready to score: graph definition, parameters, tokenizer and length limit.

    score(prompts, completions) -> float32 [B] rewards; rows are scored `batch_size` at a time,
    each chunk padded to a power-of-two length, so the jitted function sees few shapes."""

    def __init__(self, graphdef: Any, params: Any, tokenizer: Tokenizer, max_len: int, batch_size: int = 32,
                 mesh: Any = None, rules: Rules = DEFAULT_RULES):
        self.graphdef, self.params, self.tokenizer = graphdef, params, tokenizer
        self.max_len, self.batch_size = int(max_len), int(batch_size)
        self.mesh, self.rules = mesh, rules
        self._score = make_score_fn(graphdef)

    def _put(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, batch_sharding(self.mesh, self.rules))

    def score_tokens(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(tokens), self.batch_size):
            t, n = tokens[i:i + self.batch_size], lengths[i:i + self.batch_size]
            rows = len(t)
            if rows < self.batch_size:  # pad the last chunk: one batch shape per length bucket
                t = np.concatenate([t, np.zeros((self.batch_size - rows, t.shape[1]), t.dtype)])
                n = np.concatenate([n, np.ones(self.batch_size - rows, n.dtype)])
            out.append(np.asarray(self._score(self.params, self._put(t), self._put(n)))[:rows])
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """The reward of each completion after its prompt."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        rows = [_sequence(self.tokenizer, p, c)[-self.max_len:] for p, c in zip(prompts, completions)]
        order = np.argsort([len(r) for r in rows], kind="stable")  # similar lengths share a chunk
        rewards = np.zeros(len(rows), np.float32)
        for i in range(0, len(rows), self.batch_size):
            chunk = order[i:i + self.batch_size]
            T = min(_bucket(max(len(rows[j]) for j in chunk)), _bucket(self.max_len))
            tokens = np.zeros((len(chunk), T), np.int32)
            for k, j in enumerate(chunk):
                tokens[k, :len(rows[j])] = rows[j]
            rewards[chunk] = self.score_tokens(tokens, np.array([len(rows[j]) for j in chunk], np.int32))
        return rewards

    def deltas(self, batch: PairBatch) -> np.ndarray:
        """r(chosen) - r(rejected) of each encoded pair."""
        n, _, T = batch.tokens.shape
        r = self.score_tokens(batch.tokens.reshape(2 * n, T), batch.lengths.reshape(2 * n)).reshape(n, 2)
        return r[:, 0] - r[:, 1]

    def evaluate(self, batch: PairBatch) -> dict[str, float]:
        return pairwise_metrics(self.deltas(batch), batch.tie)

    def save(self, path: str, extra: dict | None = None, force: bool = False) -> None:
        """A self-describing directory that `load_reward_model(path)` rebuilds alone:
        ``<path>/tokenizer/`` (Hugging Face tokenizer files) and ``<path>/params/`` (the parameters,
        `rlcode.train.checkpoint.save_params`, written last and atomically) whose extra holds the
        model's config section, the length limit and `extra`."""
        params_dir, tokenizer_dir = _layout(path)
        if os.path.exists(params_dir) and not force:
            raise checkpoint.CheckpointError(f"a reward model in {path} already exists; pass force=True to overwrite it")
        self.tokenizer.save(tokenizer_dir)
        model_cfg = nnx.merge(self.graphdef, self.params).cfg
        checkpoint.save_params(params_dir, self.params, force=force, extra={
            "format": FORMAT, "max_len": self.max_len, "model": model_cfg.to_section(), **(extra or {})})


def train_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The reward model's training section: pairs per step, steps, evaluation cadence, length
    limit, and an `optim` section as the policy's (`rlcode.train.step.optim_config`)."""
    cfg = ml_collections.ConfigDict({
        "steps": 300, "batch_pairs": 16, "eval_every": 50, "max_len": 512, "seed": 0,
        "optim": optim_config(lr=1e-3, warmup_steps=20, total_steps=300, weight_decay=0.01),
    })
    cfg.update(overrides)
    return cfg


def train_reward_model(model: nnx.Module, tokenizer: Tokenizer, train_pairs: Sequence[PreferencePair],
                       heldout_pairs: Sequence[PreferencePair], cfg: Any, *, mesh: Any = None,
                       rules: Rules = DEFAULT_RULES, log: Callable[[str], None] = print,
                       on_eval: Callable[[int, dict, RewardModel], None] | None = None) -> tuple[RewardModel, list[dict]]:
    """Train `model` (with its value head) on `train_pairs` with the Bradley-Terry loss; returns the
    reward model and one record per evaluation (step, train loss/accuracy over the last steps,
    held-out `pairwise_metrics` as heldout/<name>). Pairs are drawn uniformly without replacement
    within an epoch, `cfg.batch_pairs` per step (seeded by `cfg.seed`). `on_eval(step, record,
    reward_model)` is called after each evaluation (e.g. to measure more on the current model)."""
    if not getattr(model.cfg, "value_head", False):
        raise ValueError("a reward model needs the value head: build it with model.value_head=True")
    if len(train_pairs) < cfg.batch_pairs:
        raise ValueError(f"{len(train_pairs)} training pairs, fewer than batch_pairs={cfg.batch_pairs}")
    optimizer = make_optimizer(cfg.optim)
    graphdef, state = init_train_state(model, optimizer, cfg.seed, mesh, rules)
    length = min(_bucket(max(len(_sequence(tokenizer, p.prompt, c)) for p in train_pairs
                             for c in (p.chosen, p.rejected))), _bucket(cfg.max_len))
    data = encode_pairs(tokenizer, train_pairs, cfg.max_len, length)
    held = encode_pairs(tokenizer, heldout_pairs, cfg.max_len) if heldout_pairs else None
    if data.truncated:
        log(f"reward model: {data.truncated} of {2 * len(data)} training sequences cut to {cfg.max_len} tokens")

    @jax.jit
    def step_fn(state, batch):
        (_, metrics), grads = jax.value_and_grad(lambda p: _pair_loss(graphdef, p, batch), has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = jax.tree.map(jnp.add, state.params, updates)
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    scorer = RewardModel(graphdef, state.params, tokenizer, cfg.max_len, mesh=mesh, rules=rules)
    rng = np.random.default_rng(cfg.seed)
    order, cursor, recent, history = rng.permutation(len(data)), 0, [], []
    t0 = time.perf_counter()

    def evaluate(step: int) -> None:
        scorer.params = state.params
        record = {"step": step, "seconds": time.perf_counter() - t0}
        if recent:
            record.update({f"train/{k}": float(np.mean([m[k] for m in recent])) for k in recent[0]})
        if held is not None:
            record.update({f"heldout/{k}": v for k, v in scorer.evaluate(held).items()})
        history.append(record)
        log(f"reward model step {step}/{cfg.steps}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in record.items() if k.startswith(("train/", "heldout/accuracy", "heldout/ece"))))
        if on_eval is not None:
            on_eval(step, record, scorer)

    for step in range(1, cfg.steps + 1):
        if cursor + cfg.batch_pairs > len(order):
            order, cursor = rng.permutation(len(data)), 0
        index = order[cursor:cursor + cfg.batch_pairs]
        cursor += cfg.batch_pairs
        batch = _as_arrays(data.take(index))
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharding(mesh, rules))
        state, metrics = step_fn(state, batch)
        recent.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        if not math.isfinite(recent[-1]["loss"]):
            raise FloatingPointError(f"reward model loss is {recent[-1]['loss']} at step {step}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate(step)
            recent = []
    scorer.params = state.params
    return scorer, history


def _layout(path: str) -> tuple[str, str]:
    return os.path.join(path, "params"), os.path.join(path, "tokenizer")


def reward_model_extra(path: str) -> dict:
    """The `extra` a saved reward model was written with (its config, length limit, notes)."""
    return checkpoint.params_extra(_layout(path)[0])


def load_reward_model(path: str, model: nnx.Module | None = None, tokenizer: Tokenizer | None = None, *,
                      batch_size: int = 32, mesh: Any = None, rules: Rules = DEFAULT_RULES) -> RewardModel:
    """The reward model `RewardModel.save` wrote to `path`: its architecture from the saved config
    (or `model`'s, whose parameters are replaced; shapes must match), its tokenizer from the saved
    files (or `tokenizer`), placed on `mesh` when given."""
    params_dir, tokenizer_dir = _layout(path)
    extra = checkpoint.params_extra(params_dir)
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise checkpoint.CheckpointError(f"{path} is not a reward model saved by RewardModel.save "
                                         f"(no {FORMAT!r} format in its extra)")
    if model is None:
        model = init_model(ModelConfig.from_config(extra["model"]), 0)
    if not getattr(model.cfg, "value_head", False):
        raise ValueError(f"{path}: a reward model needs the value head (model.value_head=True)")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    graphdef, params = split_on_mesh(model, mesh, rules)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    restored, _ = checkpoint.restore_params(params_dir, target=target)
    return RewardModel(graphdef, restored, tokenizer, int(extra["max_len"]), batch_size, mesh, rules)
