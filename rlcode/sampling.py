"""Sampling: jit-compiled prefill + decode with a KV cache and shared-prefix groups.

RL samples G completions per prompt, and in agent RL the prompt is most of the tokens. The
sampler therefore prefills each of the Pg prompts once and decodes its G rows against that one
prefix cache (attention reads the prompt's keys once per group), while each row keeps its own
cache of generated tokens. Rows are ordered group by group: row b belongs to prompt b // G, the
layout `rlcode.advantages.group_advantages` expects.

The distribution sampled from is `rlcode.models.logprobs.process_logits` (temperature, top-k,
top-p), and the behaviour log-probs returned are log-probs of exactly that distribution, so the
trainer can recompute them with `token_logprobs(..., same options)`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlcode.models.attention import AttentionMask
from rlcode.models.logprobs import process_logits


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature > 0; top_k None/0 = off; top_p None/1.0 = off; stop_ids end a row (the stop
    token is part of the completion and of its mask); pad_id fills tokens after the end."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class SampleOutput(NamedTuple):
    """tokens [B, M] (pad after the end), logprobs [B, M] behaviour log-probs (0 off the mask),
    mask [B, M] generated tokens (including a stop token), lengths [B]; M = max_new_tokens."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array


def sample_token(key_b: jax.Array, logits_bv: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row from process_logits(logits) with its own key; returns
    (tokens [B] int32, log-probs [B] of the drawn tokens under that distribution)."""
    processed = process_logits(logits_bv, cfg.temperature, cfg.top_k, cfg.top_p)
    token = jax.vmap(lambda k, l: jax.random.categorical(k, l))(key_b, processed)
    logp = jnp.take_along_axis(jax.nn.log_softmax(processed, -1), token[:, None], -1)[:, 0]
    return token.astype(jnp.int32), logp


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "cfg"))
def sample(
    graphdef: nnx.GraphDef,
    params: Any,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    *,
    group_size: int,
    cfg: SamplingConfig,
) -> SampleOutput:
    """Sample `group_size` completions for each prompt.

    Args:
      graphdef, params: the model as split by `nnx.split(model)` (params: its state).
      prompts: [Pg, Lp] right-padded token ids; prompt_lengths: [Pg] (each >= 1).
      key: PRNG key; row b uses fold_in(key, b) and step t fold_in(row_key, t), so a row's
        sample does not depend on the other rows of the batch.
      group_size: G samples per prompt; B = Pg * G rows ordered group by group.
      cfg: a SamplingConfig (static).
    """
    model = nnx.merge(graphdef, params)
    Pg, Lp = prompts.shape
    G, M = group_size, cfg.max_new_tokens
    B = Pg * G
    lengths_p = prompt_lengths.astype(jnp.int32)

    out = model(prompts, mask=AttentionMask(kv_lengths=lengths_p), return_kv=True)
    last = jnp.take_along_axis(out.hidden, (lengths_p - 1)[:, None, None], axis=1)[:, 0]  # [Pg, D]
    logits = jnp.repeat(model.logits(last), G, axis=0)  # [B, V]
    row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    positions0 = jnp.repeat(lengths_p, G)
    stop_ids = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)

    def cond(state):
        step, done = state[0], state[3]
        return (step < M) & ~jnp.all(done)

    def body(state):
        step, tokens, logps, done, logits, suffix = state
        keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
        token, logp = sample_token(keys, logits, cfg)
        live = ~done
        tokens = tokens.at[:, step].set(jnp.where(live, token, cfg.pad_id))
        logps = logps.at[:, step].set(jnp.where(live, logp, 0.0))
        done = done | jnp.isin(token, stop_ids)
        hidden, suffix = model.decode(token, positions0 + step, out.kv, lengths_p, suffix, step)
        return step + 1, tokens, logps, done, model.logits(hidden), suffix

    init = (
        jnp.zeros((), jnp.int32),
        jnp.full((B, M), cfg.pad_id, jnp.int32),
        jnp.zeros((B, M), jnp.float32),
        jnp.zeros((B,), bool),
        logits,
        model.init_suffix_cache(B, M),
    )
    _, tokens, logps, _, _, _ = jax.lax.while_loop(cond, body, init)
    # Everything after a row's stop token is padding. A loop that ends early ends only when every
    # row has stopped, so the positions it never wrote are all after a stop.
    is_stop = jnp.isin(tokens, stop_ids)
    mask = jnp.cumsum(is_stop, axis=1) - is_stop == 0
    return SampleOutput(tokens, logps, mask, mask.sum(-1).astype(jnp.int32))


class TrainingBatch(NamedTuple):
    """Sequences laid out for the training forward: inputs/targets [B, L-1] with L = Lp + M;
    positions [B, L-1]; mask [B, L-1] is 1 where the target is a generated token;
    behavior_logp [B, L-1] the sampler's log-probs at those targets; kv_lengths [B]."""

    inputs: jax.Array
    targets: jax.Array
    positions: jax.Array
    mask: jax.Array
    behavior_logp: jax.Array
    kv_lengths: jax.Array


@functools.partial(jax.jit, static_argnames=("group_size", "pad_id"))
def to_training_batch(
    prompts: jax.Array, prompt_lengths: jax.Array, sample_out: SampleOutput, *, group_size: int, pad_id: int = 0
) -> TrainingBatch:
    """Concatenate each row's prompt and completion contiguously (positions as when sampled)."""
    Pg, Lp = prompts.shape
    B, M = sample_out.tokens.shape
    L = Lp + M
    p = jnp.repeat(prompt_lengths.astype(jnp.int32), group_size)  # [B]
    n = sample_out.lengths
    j = jnp.arange(L)[None, :]
    prompt_rows = jnp.repeat(prompts, group_size, axis=0)
    from_prompt = jnp.take_along_axis(prompt_rows, jnp.clip(j, 0, Lp - 1).repeat(B, 0), axis=1)
    gen_idx = jnp.clip(j - p[:, None], 0, M - 1)
    from_gen = jnp.take_along_axis(sample_out.tokens, gen_idx, axis=1)
    seq = jnp.where(j < p[:, None], from_prompt, jnp.where(j < (p + n)[:, None], from_gen, pad_id))
    beh = jnp.take_along_axis(sample_out.logprobs, gen_idx, axis=1)
    target_is_gen = (j >= p[:, None]) & (j < (p + n)[:, None])
    return TrainingBatch(
        inputs=seq[:, :-1],
        targets=seq[:, 1:],
        positions=jnp.broadcast_to(jnp.arange(L - 1), (B, L - 1)),
        mask=target_is_gen[:, 1:],
        behavior_logp=jnp.where(target_is_gen, beh, 0.0)[:, 1:],
        kv_lengths=p + n,
    )
