"""The NSA attention layer (attention.kind="nsa"): cached decoding equals the full forward (direct
decode loop and through the sampler), a tiny model trains, and the layer's config and params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlcode import sampling
from rlcode.models.attention import AttentionMask, NSACache
from rlcode.models.logprobs import token_logprobs
from rlcode.models.transformer import init_model, logical_axes, model_config

V = 61
# Small NSA sizes so that ~30 tokens hold several compression blocks (l = 4, d = 2), more selection
# blocks (l' = 4) than are selected (n = 3), and a window (6) shorter than the sequence.
NSA = dict(kind="nsa", block_len=4, stride=2, select_size=4, num_select=3, window=6, impl="xla")


def nsa_config(shared_kv=True, **kw):
    base = dict(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48,
                attention=dict(NSA, shared_kv=shared_kv))
    base.update(kw)
    return model_config(**base)


@pytest.mark.parametrize("shared_kv,qk_norm", [(True, False), (False, True)])
@pytest.mark.slow
def test_decode_loop_matches_full_forward_logits(shared_kv, qk_norm):
    """Prompts of lengths 11 and 5 shared by G = 2 rows each; 14 generated tokens per row, so
    compression blocks straddle the prompt/generation boundary and complete during decoding."""
    model = init_model(nsa_config(shared_kv, qk_norm=qk_norm), seed=3)
    rng = np.random.default_rng(2)
    Pg, G, Lp, M = 2, 2, 12, 14
    prompt_lengths = jnp.array([11, 5])
    prompts = jnp.asarray(rng.integers(1, V, (Pg, Lp)))
    gen = jnp.asarray(rng.integers(1, V, (Pg * G, M)))
    out = jax.jit(lambda p, n: model(p, mask=AttentionMask(kv_lengths=n), return_kv=True))(prompts, prompt_lengths)
    assert isinstance(out.kv[0], NSACache)
    suffix = model.init_suffix_cache(Pg * G, M)
    positions0 = jnp.repeat(prompt_lengths, G)
    decode = jax.jit(lambda tok, pos, suffix, step: model.decode(tok, pos, out.kv, prompt_lengths, suffix, step))
    decoded = []
    for s in range(M):
        h, suffix = decode(gen[:, s], positions0 + s, suffix, jnp.int32(s))
        decoded.append(np.asarray(model.logits(h)))
    decoded = np.stack(decoded, 1)
    full_logits = jax.jit(lambda seq: model.logits(model(seq).hidden))
    for b in range(Pg * G):
        p = int(prompt_lengths[b // G])
        seq = jnp.concatenate([prompts[b // G, :p], gen[b]])[None]
        want = np.asarray(full_logits(seq)[0, p:])
        np.testing.assert_allclose(decoded[b], want, atol=1e-4, rtol=1e-4, err_msg=f"row {b}")


@pytest.mark.parametrize("shared_kv", [True, False])
@pytest.mark.slow
def test_sampler_behaviour_logprobs_equal_training_forward(shared_kv):
    model = init_model(nsa_config(shared_kv, tie_embeddings=False), seed=7)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params["unembed"] = params["unembed"] * 6.0  # a peaked policy: a wrong cache changes log-probs a lot
    prompts = jnp.array([[5, 6, 7, 8, 9, 10, 11, 0], [11, 12, 13, 0, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.array([7, 3], jnp.int32)
    cfg = sampling.SamplingConfig(max_new_tokens=16, temperature=1.0)
    out = sampling.sample(graphdef, params, prompts, lengths, jax.random.key(0), group_size=3, cfg=cfg)
    batch = sampling.to_training_batch(prompts, lengths, out, group_size=3)
    assert int(batch.mask.sum()) == 6 * 16

    @jax.jit
    def training_logprobs(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model(batch.inputs, batch.positions, AttentionMask(kv_lengths=batch.kv_lengths)).hidden
        w, layout = model.unembedding()
        return token_logprobs(hidden, w, batch.targets, unembed_layout=layout)

    logp = training_logprobs(params, batch)
    diff = np.abs(np.where(batch.mask, np.asarray(logp) - np.asarray(batch.behavior_logp), 0))
    assert diff.max() < 1e-4, diff.max()


@pytest.mark.slow
def test_tiny_nsa_model_trains():
    model = init_model(nsa_config(shared_kv=False), seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 25)))
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens[:, :-1]).hidden
        w, layout = model.unembedding()
        return -jnp.mean(token_logprobs(hidden, w, tokens[:, 1:], unembed_layout=layout))

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    losses = []
    for i in range(15):
        params, opt_state, loss, grads = step(params, opt_state)
        losses.append(float(loss))
        if i == 0:
            # Every branch's parameters learn: the compression MLP and the gate get gradients.
            flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(grads)}
            for name in ("k_compress/w1", "v_compress/pos", "w_gate", "wk_cmp", "wv_win", "proj/wq"):
                hits = [v for k, v in flat.items() if name in k]
                assert hits and all(float(jnp.abs(h[...]).max()) > 0 for h in hits), name
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses


def test_layer_params_config_and_masks():
    model = init_model(nsa_config(shared_kv=False, qk_norm=True))
    state = nnx.state(model, nnx.Param)
    axes = jax.tree.leaves(logical_axes(model), is_leaf=lambda a: isinstance(a, tuple))
    params = jax.tree.leaves(nnx.to_pure_dict(state))
    assert len(axes) == len(params) and all(len(a) == p.ndim for a, p in zip(axes, params))
    names = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(state)}
    assert {"block_0/attn/wk_cmp", "block_0/attn/wv_win", "block_0/attn/k_compress/pos", "block_0/attn/w_gate"} <= names
    shared = nnx.to_flat_state(nnx.state(init_model(nsa_config(shared_kv=True)), nnx.Param))
    assert not any("wk_cmp" in "/".join(map(str, k)) for k, _ in shared)

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 9)))
    with pytest.raises(ValueError, match="packed sequences"):
        model(tokens, mask=AttentionMask(segment_ids=jnp.ones((2, 9), jnp.int32)))
    # Right padding needs no mask: the valid positions equal the unpadded forward.
    forward = jax.jit(lambda tokens, mask: model(tokens, mask=mask).hidden)
    padded = forward(tokens, AttentionMask(kv_lengths=jnp.array([9, 5])))
    np.testing.assert_allclose(np.asarray(padded[1, :5]), np.asarray(forward(tokens[1:, :5], AttentionMask())[0]),
                               atol=1e-5)
    with pytest.raises(ValueError, match="must divide block_len"):
        init_model(nsa_config(attention=dict(NSA, stride=3)))
    with pytest.raises(ValueError, match="num_select"):
        init_model(nsa_config(attention=dict(NSA, num_select=2)))
