"""Squid attention in the model: cached documents equal the packed forward; reuse for sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from rlcode import sampling
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import init_model, model_config
from support.forward import forward

V = 53


@pytest.fixture(scope="module")
def model():
    cfg = model_config(
        vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48,
        attention={"kind": "squid", "impl": "xla"},
    )
    return init_model(cfg, seed=3)


def make_docs(rng, lengths):
    return [rng.integers(1, V, size=n).astype(np.int32) for n in lengths]


def packed(docs, prompt, mode, start=0):
    """The full packed sequence [docs..., prompt] with its segment ids, global flags and positions."""
    starts, gstart = sampling.document_positions([len(d) for d in docs], mode, start)
    tokens = np.concatenate(list(docs) + [prompt]).astype(np.int32)
    seg = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)] + [np.full(len(prompt), len(docs))])
    glob = np.concatenate([np.zeros(len(d), bool) for d in docs] + [np.ones(len(prompt), bool)])
    pos = np.concatenate([s + np.arange(len(d)) for s, d in zip(starts, docs)] + [gstart + np.arange(len(prompt))])
    return tokens[None], seg[None].astype(np.int32), glob[None], pos[None].astype(np.int32)


def packed_hidden(model, docs, prompt, mode, start=0):
    tokens, seg, glob, pos = packed(docs, prompt, mode, start)
    out = forward(model, jnp.asarray(tokens), jnp.asarray(pos), AttentionMask(segment_ids=seg, is_global=glob))
    return np.asarray(out.hidden[0, -len(prompt):])


def context_hidden(model, doc_sets, prompts, mode, start=0):
    context = sampling.document_context(model, doc_sets, mode=mode, start=start)
    Lp = max(len(p) for p in prompts)
    buf = np.zeros((len(prompts), Lp), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    graphdef, params = nnx.split(model)
    return np.asarray(sampling.prefill_with_context(graphdef, params, context, jnp.asarray(buf)))


@pytest.mark.parametrize("mode", ["shared", "sequential"])
@pytest.mark.slow
def test_cached_documents_equal_the_packed_forward(model, mode):
    rng = np.random.default_rng(0)
    docs = make_docs(rng, [9, 4, 13])
    prompts = [rng.integers(1, V, size=n).astype(np.int32) for n in (6, 3)]
    encoded = sampling.encode_documents(model, docs)  # once, at position 0
    # Row 0 uses all three documents, row 1 a subset in another order (sequential: other offsets).
    doc_sets = [encoded, [encoded[2], encoded[0]]]
    got = context_hidden(model, doc_sets, prompts, mode, start=2)
    want0 = packed_hidden(model, docs, prompts[0], mode, start=2)
    want1 = packed_hidden(model, [docs[2], docs[0]], prompts[1], mode, start=2)
    np.testing.assert_allclose(got[0], want0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1, :3], want1, rtol=1e-4, atol=1e-4)


def test_shared_mode_is_invariant_to_document_order(model):
    rng = np.random.default_rng(1)
    docs = sampling.encode_documents(model, make_docs(rng, [7, 12, 5]))
    prompt = [rng.integers(1, V, size=8).astype(np.int32)]
    a = context_hidden(model, [docs], prompt, "shared")
    b = context_hidden(model, [[docs[1], docs[2], docs[0]]], prompt, "shared")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Sequential positions depend on the order (a check that the test above can fail).
    c = context_hidden(model, [docs], prompt, "sequential")
    d = context_hidden(model, [[docs[1], docs[2], docs[0]]], prompt, "sequential")
    assert np.abs(c - d).max() > 1e-3


def test_sequential_rotation_equals_re_encoding_at_the_new_offset(model):
    rng = np.random.default_rng(2)
    doc = make_docs(rng, [11])
    at0 = sampling.encode_documents(model, doc, start=0)[0]
    at37 = sampling.encode_documents(model, doc, start=37)[0]
    moved = sampling.rotate_keys(at0.k, 37, model.cfg.rope)
    np.testing.assert_allclose(np.asarray(moved), np.asarray(at37.k), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(at0.v), np.asarray(at37.v), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(at0.k) - np.asarray(at37.k)).max() > 1e-2
    # A context built from the position-0 encoding equals one built from encodings at the offsets.
    docs = make_docs(rng, [6, 9])
    prompt = [rng.integers(1, V, size=5).astype(np.int32)]
    starts, _ = sampling.document_positions([6, 9], "sequential", 4)
    native = [sampling.encode_documents(model, [d], start=s)[0] for d, s in zip(docs, starts)]
    np.testing.assert_allclose(
        context_hidden(model, [sampling.encode_documents(model, docs)], prompt, "sequential", start=4),
        context_hidden(model, [native], prompt, "sequential", start=4),
        rtol=1e-4, atol=1e-4,
    )


def test_group_sampling_reuses_one_encoding_and_matches_the_packed_forward(model):
    rng = np.random.default_rng(3)
    docs = make_docs(rng, [10, 6])
    prompt = rng.integers(1, V, size=7).astype(np.int32)
    encoded = sampling.encode_documents(model, docs)
    context = sampling.document_context(model, [encoded], mode="sequential")
    G = 4
    cfg = sampling.SamplingConfig(max_new_tokens=6, temperature=1.0)
    graphdef, params = nnx.split(model)
    out = sampling.sample_with_context(
        graphdef, params, context, jnp.asarray(prompt[None]), jnp.array([7]), jax.random.key(0), group_size=G, cfg=cfg
    )
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (G, 6) and len({tuple(r) for r in tokens}) > 1
    # Each row's behaviour log-probs equal a full packed forward over [docs, prompt, completion]:
    # the generated tokens belong to the global segment.
    for g in range(G):
        seq_tokens, seg, glob, pos = packed(docs, np.concatenate([prompt, tokens[g]]), "sequential")
        hidden = forward(model, jnp.asarray(seq_tokens), jnp.asarray(pos),
                         AttentionMask(segment_ids=seg, is_global=glob)).hidden
        logits = model.logits(hidden[0])
        logp = jax.nn.log_softmax(logits, -1)
        first = seq_tokens.shape[1] - 6 - 1  # the position predicting the first generated token
        want = np.array([logp[first + t, tokens[g, t]] for t in range(6)])
        np.testing.assert_allclose(np.asarray(out.logprobs[g]), want, rtol=1e-4, atol=1e-4)


def test_squid_without_segments_is_causal_attention(model):
    dense = init_model(dataclasses.replace(model.cfg, attention=ml_collections.FrozenConfigDict({"kind": "dense"})), seed=3)
    tokens = jnp.asarray(np.random.default_rng(4).integers(1, V, size=(2, 19)))
    np.testing.assert_allclose(np.asarray(forward(model, tokens).hidden), np.asarray(forward(dense, tokens).hidden),
                               rtol=1e-5, atol=1e-5)


def test_dense_model_refuses_cached_documents():
    dense = init_model(model_config(vocab_size=V, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, ffw_dim=16))
    docs = sampling.encode_documents(dense, [np.arange(1, 5)])
    with pytest.raises(ValueError, match="squid"):
        context_hidden(dense, [docs], [np.arange(1, 4)], "shared")
    with pytest.raises(ValueError, match="mode"):
        sampling.document_positions([3], "interleaved")
    with pytest.raises(ValueError, match="non-empty"):
        sampling.encode_documents(dense, [np.zeros((0,), np.int32)])


def test_squid_model_trains_on_packed_documents(model):
    rng = np.random.default_rng(5)
    docs = make_docs(rng, [12, 9, 7])
    tokens, seg, glob, pos = packed(docs, rng.integers(1, V, size=10).astype(np.int32), "shared")
    mask = AttentionMask(segment_ids=jnp.asarray(seg), is_global=jnp.asarray(glob))
    graphdef, params = nnx.split(model)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    def loss_fn(p):
        m = nnx.merge(graphdef, p)
        logp = jax.nn.log_softmax(m.logits(m(jnp.asarray(tokens[:, :-1]), jnp.asarray(pos[:, :-1]), AttentionMask(
            segment_ids=mask.segment_ids[:, :-1], is_global=mask.is_global[:, :-1])).hidden), -1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), -1))

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return loss, optax.apply_updates(p, updates), s

    losses = []
    for _ in range(8):
        loss, params, opt_state = step(params, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1
