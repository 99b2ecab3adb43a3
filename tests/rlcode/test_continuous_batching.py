"""Continuous batching in the sampler (`sampling.slots`): the same rows as the static batch,
behaviour log-probs equal to the training forward, slots refilled as rows end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode import sampling
from rlcode.models.transformer import init_model, model_config
from support import training_logprobs

V = 61
NSA = dict(kind="nsa", block_len=4, stride=2, select_size=4, num_select=3, window=6, impl="xla")


def parts(attention=None, seed=7):
    kw = {} if attention is None else {"attention": attention}
    cfg = model_config(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffw_dim=48, tie_embeddings=False, qk_norm=True, **kw)
    graphdef, state = nnx.split(init_model(cfg, seed=seed))
    params = nnx.to_pure_dict(state)
    params["unembed"] = params["unembed"] * 6.0  # far from uniform, so that top-k / top-p bite
    return graphdef, params


@pytest.fixture(scope="module")
def dense():
    return parts()


def prompts_for(P: int, Lp: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, Lp + 1, P)
    lengths[0] = 1  # a one-token prompt
    lengths[-1] = Lp  # a full-width one
    prompts = np.where(np.arange(Lp)[None] < lengths[:, None], rng.integers(1, V, (P, Lp)), 0)
    return jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)


# Many stop tokens: rows end at very different steps (some at the first token, some never).
STOPS = tuple(range(40, 52))


@pytest.mark.parametrize("P,G,Lp,M,slots,per_prompt_keys,extra", [
    (3, 4, 6, 12, 1, False, {}),  # one slot: every row alone, one after the other
    (3, 4, 6, 12, 3, True, {}),  # fewer slots than a group
    (2, 5, 5, 9, 4, False, dict(temperature=0.7, top_p=0.9)),  # slots do not divide the rows
    (4, 2, 7, 10, 8, True, dict(top_k=5, top_p=0.8)),  # as many slots as rows: no refill
    (2, 3, 4, 6, 50, False, {}),  # more slots than rows
    (1, 8, 3, 1, 3, False, {}),  # one new token per row
])
def test_continuous_batching_draws_the_static_batchs_rows(dense, P, G, Lp, M, slots, per_prompt_keys, extra):
    graphdef, params = dense
    prompts, lengths = prompts_for(P, Lp, seed=P * 10 + G)
    cfg = sampling.SamplingConfig(max_new_tokens=M, stop_ids=STOPS, temperature=extra.pop("temperature", 1.3),
                                  pad_id=0, **extra)
    key = jax.random.split(jax.random.key(3), P) if per_prompt_keys else jax.random.key(3)
    static = sampling.sample(graphdef, params, prompts, lengths, key, group_size=G, cfg=cfg)
    cont = sampling.sample(graphdef, params, prompts, lengths, key, group_size=G,
                           cfg=dataclasses.replace(cfg, slots=slots))
    np.testing.assert_array_equal(np.asarray(cont.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(cont.mask), np.asarray(static.mask))
    np.testing.assert_array_equal(np.asarray(cont.lengths), np.asarray(static.lengths))
    np.testing.assert_allclose(np.asarray(cont.logprobs), np.asarray(static.logprobs), atol=2e-5)
    n = np.asarray(static.lengths)
    if M > 1:
        assert n.min() < M <= n.max() or n.min() < n.max(), n  # rows of different lengths were refilled


def test_continuous_behaviour_logprobs_equal_training_forward(dense):
    graphdef, params = dense
    prompts, lengths = prompts_for(3, 6)
    cfg = sampling.SamplingConfig(max_new_tokens=12, temperature=0.8, top_p=0.95, stop_ids=STOPS, slots=2)
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(0), group_size=4, cfg=cfg)
    batch = sampling.to_training_batch(prompts, lengths, out, group_size=4)
    mask = np.asarray(batch.mask)
    assert mask.sum() == int(out.lengths.sum()) > 0
    diff = np.abs(np.asarray(training_logprobs(graphdef, params, batch, cfg)) - np.asarray(batch.behavior_logp))[mask]
    assert diff.max() < 1e-4, diff.max()


def test_rows_end_at_their_stop_and_every_row_is_served(dense):
    graphdef, params = dense
    prompts, lengths = prompts_for(4, 5, seed=2)
    M = 10
    cfg = sampling.SamplingConfig(max_new_tokens=M, stop_ids=STOPS, temperature=2.0, pad_id=0, slots=3)
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(5), group_size=6, cfg=cfg)
    tokens, mask, n, logp = (np.asarray(a) for a in (out.tokens, out.mask, out.lengths, out.logprobs))
    assert tokens.shape == (24, M)
    for b in range(24):
        stop_at = [t for t in range(M) if tokens[b, t] in STOPS]
        expect = stop_at[0] + 1 if stop_at else M
        assert n[b] == expect >= 1 and mask[b].sum() == expect
        assert np.all(tokens[b, expect:] == 0) and np.all(logp[b, expect:] == 0)
        assert np.all(logp[b, :expect] < 0)  # every generated token has its log-prob
    assert n.min() < M and len(set(n.tolist())) > 2


def test_squid_attention_model():
    graphdef, params = parts({"kind": "squid", "impl": "xla"}, seed=3)
    prompts, lengths = prompts_for(2, 6, seed=4)
    cfg = sampling.SamplingConfig(max_new_tokens=8, stop_ids=STOPS, temperature=1.5)
    static = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(2), group_size=3, cfg=cfg)
    cont = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(2), group_size=3,
                           cfg=dataclasses.replace(cfg, slots=2))
    np.testing.assert_array_equal(np.asarray(cont.tokens), np.asarray(static.tokens))
    np.testing.assert_allclose(np.asarray(cont.logprobs), np.asarray(static.logprobs), atol=2e-5)


@pytest.mark.parametrize("kind", ["nsa", "moe"])
def test_continuous_batching_refuses_models_whose_rows_depend_on_the_batch(kind):
    if kind == "nsa":
        graphdef, params = parts(dict(NSA, shared_kv=True))
    else:
        cfg = model_config(vocab_size=V, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48,
                           mlp={"kind": "moe", "num_experts": 4, "top_k": 2, "expert_ffw_dim": 16})
        graphdef, params = nnx.split(init_model(cfg, seed=0))
    model = nnx.merge(graphdef, params)
    assert not sampling.supports_continuous_batching(model.cfg)
    prompts, lengths = prompts_for(2, 6)
    cfg = sampling.SamplingConfig(max_new_tokens=4, slots=2)
    with pytest.raises(ValueError, match="sampling.slots"):
        sampling.sample(graphdef, params, prompts, lengths, jax.random.key(0), group_size=2, cfg=cfg)
    sampling.sample(graphdef, params, prompts, lengths, jax.random.key(0), group_size=2,
                    cfg=dataclasses.replace(cfg, slots=0))  # the static batch serves it


def test_slots_must_not_be_negative():
    with pytest.raises(ValueError, match="slots"):
        sampling.SamplingConfig(slots=-1)
