"""Sampling: jit-compiled prefill + decode with a KV cache and shared-prefix groups.

RL samples G completions per prompt, and in agent RL the prompt is most of the tokens. The
sampler therefore prefills each of the Pg prompts once and decodes its G rows against that one
prefix cache (attention reads the prompt's keys once per group), while each row keeps its own
cache of generated tokens. Rows are ordered group by group: row b belongs to prompt b // G, the
layout `rlcode.advantages.group_advantages` expects.

Documents (squid attention, docs/reference.md §8): `encode_documents` computes each document's keys
and values at every layer once (`DocKV`); `document_context` lays any subset of them side by side
for a batch of prompts, in `shared` or `sequential` positions (re-positioning a cached document
is a RoPE rotation of its keys); `sample_with_context` prefills only the global tokens against
that context and samples G rows per prompt from the one encoding.

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
import numpy as np
from flax import nnx

from rlcode.checks import TypedSection, integer, real, sequence
from rlcode.models.attention import AttentionMask, KVCache
from rlcode.models.layers import Rope, apply_rope
from rlcode.models.logprobs import process_logits
from rlcode.models.transformer import supports_shared_prompts


# The valid values of the sampler's options (the `sampling` section of a job's config holds some of them).
SAMPLING_SPECS = {
    "max_new_tokens": integer(1), "temperature": real(0, low_open=True), "top_k": integer(0, none_ok=True),
    "top_p": real(0, 1, low_open=True, none_ok=True), "stop_ids": sequence(integer()), "pad_id": integer(),
    "slots": integer(0),
}


@dataclasses.dataclass(frozen=True)
class SamplingConfig(TypedSection):
    """The sampler's options, validated and frozen (a static argument of the jitted sampler).

    temperature > 0 (no greedy special case: use top_k=1); top_k None/0 = off; top_p None/1.0 =
    off; stop_ids end a row (the stop token is part of the completion and of its mask); pad_id
    fills tokens after the end. slots > 0: `sample` decodes with continuous batching in that many
    slots (`_generate_continuous`); 0: every row in one static batch. A job's `sampling` section
    becomes one through `from_config`.
    """

    SPECS = SAMPLING_SPECS
    SECTION = "sampling"

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    slots: int = 0


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
      key: one PRNG key, row b using fold_in(key, b), or one key per prompt [Pg], row b using
        fold_in(key[b // G], b % G); step t uses fold_in(row_key, t). A row's sample does not
        depend on the other rows of the batch; with per-prompt keys it does not depend on where
        its prompt sits in the batch either.
      group_size: G samples per prompt; B = Pg * G rows ordered group by group.
      cfg: a SamplingConfig (static); with cfg.slots > 0 the rows decode with continuous batching
        (`_generate_continuous`): the same tokens and log-probs per row, fewer decoded rows when
        their lengths differ.
    """
    model = nnx.merge(graphdef, params)
    lengths_p = prompt_lengths.astype(jnp.int32)
    out = model(prompts, mask=AttentionMask(kv_lengths=lengths_p), return_kv=True)
    last = jnp.take_along_axis(out.hidden, (lengths_p - 1)[:, None, None], axis=1)[:, 0]  # [Pg, D]
    if cfg.slots:
        if not supports_continuous_batching(model.cfg):
            raise ValueError("sampling.slots > 0 (continuous batching) needs dense or squid attention and a dense MLP; "
                             "set sampling.slots=0 for this model")
        return _generate_continuous(model, out.kv, lengths_p, last, key, group_size, cfg)
    return _generate(model, out.kv, lengths_p, last, lengths_p, key, group_size, cfg)


def supports_continuous_batching(model_cfg: Any) -> bool:
    """Whether `sample` may decode this model's rows with continuous batching (``slots`` > 0). The
    condition is the shared-prompt forward's (`supports_shared_prompts`): dense or squid attention,
    whose decode takes one step per row, and a dense MLP (a mixture of experts routes and drops
    over the tokens of a batch, so a row's tokens would depend on its neighbours).
    `model_cfg`: a model's config (`Transformer.cfg`) or a job's model section."""
    return supports_shared_prompts(model_cfg)


def _row_keys(key: jax.Array, Pg: int, G: int) -> jax.Array:
    """Row b's key: fold_in(key, b), or fold_in(key[b // G], b % G) with one key per prompt."""
    B = Pg * G
    if key.ndim == 0:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    if key.shape == (Pg,):  # one key per prompt
        return jax.vmap(lambda b: jax.random.fold_in(key[b // G], b % G))(jnp.arange(B))
    raise ValueError(f"key must be one key or one per prompt [{Pg}], got shape {key.shape}")


def _completion_mask(tokens: jax.Array, stop_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mask, lengths) of completions whose every position after a row's stop token is padding."""
    is_stop = jnp.isin(tokens, stop_ids)
    mask = jnp.cumsum(is_stop, axis=1) - is_stop == 0
    return mask, mask.sum(-1).astype(jnp.int32)


def _generate_continuous(model, prefix, prefix_lengths, last_hidden, key, G, cfg) -> SampleOutput:
    """Continuous batching: `cfg.slots` rows decode at a time; a slot whose row ends (stop token or
    max_new_tokens) takes the next waiting row at once, its suffix cache reused from slot 0 on.

    Rows are served in order (row b = sample b % G of prompt b // G). Each slot reads its prompt's
    keys/values from the prefix cache (every prompt prefilled once) and its own suffix; row b's
    token t is drawn with fold_in(row key, t) from its own history alone, as in `_generate`, so a
    row's tokens do not depend on which slot or which neighbours it had, and its log-probs are
    those of the distribution it was drawn from. The loop ends when every row has ended; no step
    decodes for a row that has ended except the one in which it ended (the slot's next row starts
    from its prompt's last hidden state, already computed)."""
    Pg = prefix_lengths.shape[0]
    M = cfg.max_new_tokens
    B = Pg * G
    S = min(cfg.slots, B)
    row_keys = _row_keys(key, Pg, G)
    first_logits = model.logits(last_hidden)  # [Pg, V]: each prompt's next-token logits
    stop_ids = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)

    def cond(state):
        return jnp.any(state[0] < B)

    def body(state):
        slot_row, slot_step, next_row, tokens, logps, logits, suffix = state
        live = slot_row < B
        row = jnp.minimum(slot_row, B - 1)
        keys = jax.vmap(jax.random.fold_in)(row_keys[row], slot_step)
        token, logp = sample_token(keys, logits, cfg)
        # An idle slot's row index is B: its writes fall outside the arrays and are dropped.
        tokens = tokens.at[slot_row, slot_step].set(token, mode="drop")
        logps = logps.at[slot_row, slot_step].set(logp, mode="drop")
        ended = live & (jnp.isin(token, stop_ids) | (slot_step + 1 >= M))
        prompt = row // G
        slot_prefix = jax.tree.map(lambda a: a[prompt], prefix)
        hidden, suffix = model.decode(token, prefix_lengths[prompt] + slot_step, slot_prefix,
                                      prefix_lengths[prompt], suffix, slot_step)
        # Ended slots take the next rows in slot order; past the last row they go idle.
        new_row = next_row + jnp.cumsum(ended) - 1
        new_row = jnp.where(new_row < B, new_row, B)
        slot_row = jnp.where(ended, new_row, slot_row)
        slot_step = jnp.where(ended, 0, slot_step + 1)
        logits = jnp.where(ended[:, None], first_logits[jnp.minimum(new_row, B - 1) // G], model.logits(hidden))
        return slot_row, slot_step, next_row + ended.sum(), tokens, logps, logits, suffix

    init = (
        jnp.arange(S, dtype=jnp.int32),
        jnp.zeros((S,), jnp.int32),
        jnp.asarray(S, jnp.int32),
        jnp.full((B, M), cfg.pad_id, jnp.int32),
        jnp.zeros((B, M), jnp.float32),
        first_logits[jnp.arange(S) // G],
        model.init_suffix_cache(S, M),
    )
    _, _, _, tokens, logps, _, _ = jax.lax.while_loop(cond, body, init)
    mask, lengths = _completion_mask(tokens, stop_ids)
    return SampleOutput(tokens, logps, mask, lengths)


def _generate(model, prefix, prefix_lengths, last_hidden, first_position, key, G, cfg) -> SampleOutput:
    """Decode G rows per prompt against the shared prefix cache (keys valid below prefix_lengths
    [Pg]); last_hidden [Pg, D] predicts each row's first token, which sits at first_position [Pg]."""
    Pg = prefix_lengths.shape[0]
    M = cfg.max_new_tokens
    B = Pg * G
    logits = jnp.repeat(model.logits(last_hidden), G, axis=0)  # [B, V]
    row_keys = _row_keys(key, Pg, G)
    positions0 = jnp.repeat(first_position.astype(jnp.int32), G)
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
        hidden, suffix = model.decode(token, positions0 + step, prefix, prefix_lengths, suffix, step)
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
    mask, lengths = _completion_mask(tokens, stop_ids)
    return SampleOutput(tokens, logps, mask, lengths)


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


# --------------------------------------------------------------------------------------------
# Document KV reuse (squid attention)
# --------------------------------------------------------------------------------------------


class DocKV(NamedTuple):
    """One document's keys and values at every layer, k/v [num_layers, L, K, H] (keys after RoPE),
    encoded with its first token at position `start`. Under squid attention they depend on the
    document alone, so they can be reused in any subset, order and position."""

    k: jax.Array
    v: jax.Array
    start: int

    @property
    def length(self) -> int:
        return int(self.k.shape[1])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _encode(graphdef, params, tokens, positions, lengths):
    model = nnx.merge(graphdef, params)
    out = model(tokens, positions, AttentionMask(kv_lengths=lengths), return_kv=True)
    return jnp.stack([kv.k for kv in out.kv]), jnp.stack([kv.v for kv in out.kv])


def encode_documents(model: nnx.Module, docs, *, start: int = 0, pad_to: int = 16) -> list[DocKV]:
    """Encode each document (a 1-D token sequence) alone, first token at position `start`.

    The documents are run as one right-padded batch (length rounded up to `pad_to` so repeated
    calls reuse compilations); each returned DocKV holds only its own tokens."""
    docs = [np.asarray(d, np.int32) for d in docs]
    for i, d in enumerate(docs):
        if d.ndim != 1 or d.size == 0:
            raise ValueError(f"document {i} must be a non-empty 1-D token sequence, got shape {d.shape}")
    if not docs:
        return []
    L = -(-max(d.size for d in docs) // pad_to) * pad_to
    tokens = np.zeros((len(docs), L), np.int32)
    for i, d in enumerate(docs):
        tokens[i, : d.size] = d
    positions = np.broadcast_to(start + np.arange(L, dtype=np.int32), tokens.shape)
    lengths = np.array([d.size for d in docs], np.int32)
    graphdef, params = nnx.split(model)
    k, v = _encode(graphdef, params, tokens, positions, lengths)  # [layers, m, L, K, H]
    return [DocKV(k[:, i, : d.size], v[:, i, : d.size], int(start)) for i, d in enumerate(docs)]


def rotate_keys(k: jax.Array, delta: int, rope: Rope) -> jax.Array:
    """Move cached keys [..., L, K, H] by `delta` positions (an int, or a traced scalar under
    jit/vmap): RoPE is a rotation, R(p + d) = R(d) R(p)."""
    if isinstance(delta, int) and delta == 0:
        return k
    flat = k.reshape((-1,) + k.shape[-3:])
    moved = apply_rope(flat, jnp.full(flat.shape[:2], delta, jnp.int32), rope)
    return moved.reshape(k.shape)


class DocumentContext(NamedTuple):
    """Cached documents for a batch of P prompts: per layer k/v [P, S, K, H] (each row's documents
    back to back from slot 0, then padding); valid [P, S]; length [P] document tokens per row;
    next_position [P] the position of each row's first global token."""

    k: list[jax.Array]
    v: list[jax.Array]
    valid: jax.Array
    length: jax.Array
    next_position: jax.Array


def document_positions(lengths, mode: str, start: int = 0) -> tuple[list[int], int]:
    """Start position of each document and of the global segment (docs/reference.md §8):
    `shared` – every document starts at `start`, the global segment after the longest one;
    `sequential` – documents take consecutive positions, the global segment follows them."""
    lengths = [int(n) for n in lengths]
    if mode == "shared":
        return [start] * len(lengths), start + max(lengths, default=0)
    if mode == "sequential":
        starts = [start + int(s) for s in np.cumsum([0] + lengths[:-1])] if lengths else []
        return starts, start + sum(lengths)
    raise ValueError(f"document position mode must be 'shared' or 'sequential', got {mode!r}")


def document_context(
    model: nnx.Module, doc_sets: list[list[DocKV]], *, mode: str = "shared", start: int = 0, pad_to: int = 64
) -> DocumentContext:
    """Lay out row p's documents `doc_sets[p]` (in that order) at the positions of `mode`.

    A document encoded at another position is moved by rotating its keys (values carry no
    position). S is the longest row's document tokens rounded up to `pad_to`. Only a squid model
    has documents that are independent of each other (docs/reference.md §8); any other raises."""
    kind = model.cfg.attention["kind"]
    if kind != "squid":
        raise ValueError(f"cached documents need attention.kind='squid' (a document's keys depend on the "
                         f"tokens before it under {kind!r} attention)")
    rows, lengths, next_pos = [], [], []
    for docs in doc_sets:
        starts, nxt = document_positions([d.length for d in docs], mode, start)
        ks = [rotate_keys(d.k, s - d.start, model.cfg.rope) for d, s in zip(docs, starts)]
        vs = [d.v for d in docs]
        rows.append((ks, vs))
        lengths.append(sum(d.length for d in docs))
        next_pos.append(nxt)
    L, K, H = model.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
    S = max(pad_to, -(-max(lengths, default=0) // pad_to) * pad_to)
    k_rows, v_rows = [], []
    for (ks, vs), n in zip(rows, lengths):
        pad = jnp.zeros((L, S - n, K, H), model.cfg.dtype)
        k_rows.append(jnp.concatenate([x.astype(model.cfg.dtype) for x in ks] + [pad], axis=1))
        v_rows.append(jnp.concatenate([x.astype(model.cfg.dtype) for x in vs] + [pad], axis=1))
    k_all, v_all = jnp.stack(k_rows, axis=1), jnp.stack(v_rows, axis=1)  # [layers, P, S, K, H]
    n = jnp.asarray(lengths, jnp.int32)
    return DocumentContext(
        k=list(k_all), v=list(v_all), valid=jnp.arange(S)[None, :] < n[:, None], length=n,
        next_position=jnp.asarray(next_pos, jnp.int32),
    )


def _prefill_context(model, context: DocumentContext, prompts):
    positions = context.next_position[:, None] + jnp.arange(prompts.shape[1])[None, :]
    layers = [KVCache(k, v) for k, v in zip(context.k, context.v)]
    return model.forward_with_context(prompts, positions, layers, context.valid, return_kv=True)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def prefill_with_context(graphdef, params, context: DocumentContext, prompts) -> jax.Array:
    """Hidden states [P, Lp, D] of the global tokens `prompts` [P, Lp] (right-padded) after the
    cached documents; the documents themselves are not recomputed."""
    return _prefill_context(nnx.merge(graphdef, params), context, prompts).hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "cfg"))
def sample_with_context(
    graphdef: nnx.GraphDef,
    params: Any,
    context: DocumentContext,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    *,
    group_size: int,
    cfg: SamplingConfig,
) -> SampleOutput:
    """`sample` for prompts that follow cached documents: the global tokens are prefilled once
    against the context, then G rows per prompt decode against [documents | prompt]."""
    model = nnx.merge(graphdef, params)
    lengths_p = prompt_lengths.astype(jnp.int32)
    out = _prefill_context(model, context, prompts)
    last = jnp.take_along_axis(out.hidden, (lengths_p - 1)[:, None, None], axis=1)[:, 0]
    # One contiguous prefix per prompt: its documents, then its prompt, then padding.
    S, Lp = context.valid.shape[1], prompts.shape[1]
    j = jnp.arange(S + Lp)[None, :]
    src = jnp.where(j < context.length[:, None], j, S + j - context.length[:, None])
    src = jnp.clip(src, 0, S + Lp - 1)[:, :, None, None]
    prefix = [
        KVCache(
            jnp.take_along_axis(jnp.concatenate([ck, kv.k.astype(ck.dtype)], axis=1), src, axis=1),
            jnp.take_along_axis(jnp.concatenate([cv, kv.v.astype(cv.dtype)], axis=1), src, axis=1),
        )
        for ck, cv, kv in zip(context.k, context.v, out.kv)
    ]
    return _generate(
        model, prefix, context.length + lengths_p, last, context.next_position + lengths_p, key, group_size, cfg
    )


# --------------------------------------------------------------------------------------------
# Multi-turn sessions: a persistent KV cache per row, extended turn by turn
# --------------------------------------------------------------------------------------------


class SessionCache(NamedTuple):
    """Keys/values of R rows' contexts, k/v [num_layers, R + 1, S, K, H] (row R is scratch for
    padding rows of a batch); slot p holds the token at position p. Which slots are filled is
    tracked by the caller (`rlcode.session_sampling.SessionSampler`)."""

    k: jax.Array
    v: jax.Array


def init_session_cache(model: nnx.Module, rows: int, max_len: int) -> SessionCache:
    cfg = model.cfg
    shape = (model.num_layers, rows + 1, max_len, cfg.num_kv_heads, cfg.head_dim)
    return SessionCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def _write_rows(cache_rows: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache_rows [L, Rb, S, K, H] with new [L, Rb, T, K, H] written at slot starts[b] of row b."""
    put = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=1)
    return jax.vmap(put, in_axes=(1, 1, 0), out_axes=1)(cache_rows, new, starts)


@functools.partial(jax.jit, static_argnames=("graphdef", "span"), donate_argnames=("cache",))
def extend_session(graphdef, params, cache: SessionCache, rows, tokens, lengths, num_new, span=None):
    """Append tokens [Rb, T] (right-padded, num_new [Rb] real ones) to the contexts of `rows` [Rb]
    that hold lengths [Rb] tokens: each new token attends to its row's cached slots below
    `lengths` and causally to the new tokens before it (positions lengths + t), which is the full
    forward at those positions for causal and squid-global tokens. Returns (cache with the new
    keys/values written at slots lengths.., hidden [Rb, D] of each row's last new token).
    The caller keeps lengths + T within the cache length. `span` (static, >= max(lengths)): only
    the first `span` slots are read (None: all), so attention costs what the contexts hold rather
    than the cache's capacity."""
    model = nnx.merge(graphdef, params)
    ck, cv = cache.k[:, rows], cache.v[:, rows]
    S, T = ck.shape[2] if span is None else min(span, ck.shape[2]), tokens.shape[1]
    valid = jnp.arange(S)[None, :] < lengths[:, None]
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    layers = [KVCache(ck[i, :, :S], cv[i, :, :S]) for i in range(ck.shape[0])]
    out = model.forward_with_context(tokens, positions, layers, valid, return_kv=True)
    ck = _write_rows(ck, jnp.stack([kv.k for kv in out.kv]), lengths)
    cv = _write_rows(cv, jnp.stack([kv.v for kv in out.kv]), lengths)
    last = out.hidden[jnp.arange(tokens.shape[0]), jnp.maximum(num_new - 1, 0)]
    return SessionCache(cache.k.at[:, rows].set(ck), cache.v.at[:, rows].set(cv)), last


@functools.partial(jax.jit, static_argnames=("rope",), donate_argnames=("cache",))
def write_documents(cache: SessionCache, rows, starts, doc_k, doc_v, doc_start, *, rope: Rope):
    """Place cached documents into distinct `rows` [Nd] at slots starts [Nd]: doc_k/v
    [L, Nd, Ld, K, H] (right-padded) were encoded with their first token at doc_start [Nd]; keys
    are rotated by starts - doc_start (RoPE is a rotation). Padding slots past a document's end
    are written too; they lie beyond the row's filled length."""
    rotate = lambda k, delta: rotate_keys(k, delta, rope)
    moved = jax.vmap(rotate, in_axes=(1, 0), out_axes=1)(doc_k, (starts - doc_start).astype(jnp.int32))
    ck = _write_rows(cache.k[:, rows], moved, starts)
    cv = _write_rows(cache.v[:, rows], doc_v, starts)
    return SessionCache(cache.k.at[:, rows].set(ck), cache.v.at[:, rows].set(cv))


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "span"))
def sample_session(graphdef, params, cache: SessionCache, rows, lengths, last_hidden, key, *,
                   cfg: SamplingConfig, span: int | None = None) -> SampleOutput:
    """Sample one continuation per row of `rows` [Rb] after its cached context of lengths [Rb]
    tokens; last_hidden [Rb, D] is the hidden state of each context's last token. `span` (static,
    >= max(lengths)): only the first `span` cache slots are read (None: all)."""
    model = nnx.merge(graphdef, params)
    S = cache.k.shape[2] if span is None else min(span, cache.k.shape[2])
    prefix = [KVCache(cache.k[i, rows, :S], cache.v[i, rows, :S]) for i in range(cache.k.shape[0])]
    return _generate(model, prefix, lengths, last_hidden, lengths, key, 1, cfg)
