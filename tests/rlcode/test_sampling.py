"""Sampler: behaviour log-probs equal the training forward, stops, PRNG, groups, distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode import sampling
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import init_model, model_config
from support import training_logprobs

V = 61


@pytest.fixture(scope="module")
def model_parts():
    cfg = model_config(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffw_dim=48, tie_embeddings=False, qk_norm=True)
    model = init_model(cfg, seed=7)
    # Scale the output layer up so the policy is far from uniform and top-p/top-k bite.
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params["unembed"] = params["unembed"] * 6.0
    return graphdef, params


def prompts_and_lengths():
    prompts = jnp.array([[5, 6, 7, 8, 9, 0], [11, 12, 0, 0, 0, 0], [13, 14, 15, 0, 0, 0]], jnp.int32)
    return prompts, jnp.array([5, 2, 3], jnp.int32)


@pytest.mark.parametrize(
    "cfg",
    [
        sampling.SamplingConfig(max_new_tokens=12, temperature=1.0, stop_ids=(3, 4)),
        sampling.SamplingConfig(max_new_tokens=12, temperature=0.7, top_p=0.9, stop_ids=(3, 4)),
        sampling.SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=5, top_p=0.8, stop_ids=(3, 4)),
    ],
    ids=["t1", "t0.7-top_p", "top_k-top_p"],
)
def test_behaviour_logprobs_equal_training_forward(model_parts, cfg):
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(0), group_size=4, cfg=cfg)
    batch = sampling.to_training_batch(prompts, lengths, out, group_size=4)
    assert int(batch.mask.sum()) == int(out.lengths.sum()) > 0
    logp = training_logprobs(graphdef, params, batch, cfg)
    diff = np.abs(np.where(batch.mask, np.asarray(logp) - np.asarray(batch.behavior_logp), 0))
    assert diff.max() < 1e-4, diff.max()
    assert np.all(np.isfinite(np.asarray(logp))[np.asarray(batch.mask)])
    # The concatenated sequences hold the prompt, then the completion, at the sampled positions.
    for b in range(12):
        g, p, n = b // 4, int(lengths[b // 4]), int(out.lengths[b])
        seq = np.concatenate([np.asarray(batch.inputs[b]), np.asarray(batch.targets[b, -1:])])
        np.testing.assert_array_equal(seq[:p], np.asarray(prompts[g, :p]))
        np.testing.assert_array_equal(seq[p : p + n], np.asarray(out.tokens[b, :n]))


def test_stop_tokens_mask_and_lengths(model_parts):
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    # Make every token a stop token except a few, so rows stop at different steps.
    stops = tuple(range(6, V))
    cfg = sampling.SamplingConfig(max_new_tokens=8, stop_ids=stops, pad_id=0, temperature=3.0)
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(1), group_size=5, cfg=cfg)
    tokens, mask, n = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.lengths)
    saw_early_stop = False
    for b in range(tokens.shape[0]):
        stop_at = [t for t in range(8) if tokens[b, t] in stops]
        expected_len = stop_at[0] + 1 if stop_at else 8
        assert n[b] == expected_len and mask[b].sum() == expected_len
        assert np.all(mask[b, :expected_len]) and not np.any(mask[b, expected_len:])
        assert np.all(tokens[b, expected_len:] == 0)
        assert np.all(np.asarray(out.logprobs)[b, expected_len:] == 0)
        saw_early_stop |= expected_len < 8
    assert saw_early_stop


def test_prng_is_per_row_and_reproducible(model_parts):
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    cfg = sampling.SamplingConfig(max_new_tokens=6, temperature=1.5)
    a = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(3), group_size=4, cfg=cfg)
    b = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(3), group_size=4, cfg=cfg)
    c = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(4), group_size=4, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    # The G rows of a group differ from one another.
    group0 = {tuple(r) for r in np.asarray(a.tokens[:4])}
    assert len(group0) > 1


def test_per_prompt_keys_make_a_prompts_samples_independent_of_the_batch(model_parts):
    """With one key per prompt, a prompt's G rows are the same wherever it sits in the batch
    and whatever else is in it; fold_in(key[p], g) is row g of prompt p."""
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(9), i))(jnp.arange(3))
    cfg = sampling.SamplingConfig(max_new_tokens=6, temperature=1.5)
    full = sampling.sample(graphdef, params, prompts, lengths, keys, group_size=2, cfg=cfg)
    order = jnp.array([2, 0])
    part = sampling.sample(graphdef, params, prompts[order], lengths[order], keys[order], group_size=2, cfg=cfg)
    tokens = np.asarray(full.tokens).reshape(3, 2, -1)
    np.testing.assert_array_equal(np.asarray(part.tokens).reshape(2, 2, -1), tokens[np.asarray(order)])
    # A prompt alone with its key as the batch's one key: row g uses fold_in(key, g) either way.
    alone = sampling.sample(graphdef, params, prompts[1:2], lengths[1:2], keys[1], group_size=2, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(alone.tokens).reshape(2, -1), tokens[1])
    with pytest.raises(ValueError, match="one per prompt"):
        sampling.sample(graphdef, params, prompts, lengths, keys[:2], group_size=2, cfg=cfg)


@pytest.mark.slow
def test_shared_prefix_group_equals_replicated_prompts(model_parts):
    """G rows decoded against one prefix = the prompt prefilled G times (same row keys)."""
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    cfg = sampling.SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.95)
    shared = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(5), group_size=4, cfg=cfg)
    rep = sampling.sample(graphdef, params, jnp.repeat(prompts, 4, 0), jnp.repeat(lengths, 4), jax.random.key(5),
                          group_size=1, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(rep.tokens))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(rep.logprobs), atol=1e-5)


@pytest.mark.slow
def test_top_k_1_is_greedy_against_full_forward(model_parts):
    graphdef, params = model_parts
    prompts, lengths = prompts_and_lengths()
    cfg = sampling.SamplingConfig(max_new_tokens=6, top_k=1)
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(6), group_size=2, cfg=cfg)
    batch = sampling.to_training_batch(prompts, lengths, out, group_size=2)

    @jax.jit
    def full_logits(params, batch):
        model = nnx.merge(graphdef, params)
        return model.logits(model(batch.inputs, batch.positions, AttentionMask(kv_lengths=batch.kv_lengths)).hidden)

    greedy = np.asarray(jnp.argmax(full_logits(params, batch), -1))
    mask = np.asarray(batch.mask)
    assert mask.sum() == 36
    np.testing.assert_array_equal(greedy[mask], np.asarray(batch.targets)[mask])
    np.testing.assert_allclose(np.asarray(out.logprobs)[np.asarray(out.mask)], 0.0, atol=1e-6)  # one-token support


@pytest.mark.slow
def test_first_token_distribution(model_parts):
    """Empirical first-token frequencies match softmax of the processed logits."""
    graphdef, params = model_parts
    prompts = jnp.array([[5, 6, 7]], jnp.int32)
    lengths = jnp.array([3], jnp.int32)
    cfg = sampling.SamplingConfig(max_new_tokens=1, temperature=4.0, top_p=0.9)
    n = 4000
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(8), group_size=n, cfg=cfg)
    model = nnx.merge(graphdef, params)
    from rlcode.models.logprobs import process_logits

    probs = np.asarray(jax.nn.softmax(process_logits(model.logits(model(prompts).hidden[0, -1]), 4.0, None, 0.9)))
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=V)
    assert (probs == 0).sum() > 0 and counts[probs == 0].sum() == 0  # nothing outside the nucleus
    expected = probs * n
    big = expected > 20
    assert big.sum() >= 2
    z = (counts[big] - expected[big]) / np.sqrt(expected[big] * (1 - probs[big]))
    assert np.all(np.abs(z) < 5), z


def test_bad_sampling_config():
    with pytest.raises(ValueError, match="temperature"):
        sampling.SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling.SamplingConfig(max_new_tokens=0)
