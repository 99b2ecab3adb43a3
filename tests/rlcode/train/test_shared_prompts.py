"""The shared-prompt train batch: each group's prompt computed once gives the per-row numbers.

The per-row forward (every row laid out prompt + completion) is the reference: log-probs,
losses, metrics and updated parameters must agree at several shapes, with micro-batches and
minibatches splitting whole groups, and with the old log-probs taken from the train step itself.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlcode import losses
from rlcode.models.transformer import init_model, model_config, supports_shared_prompts
from rlcode.sampling import SampleOutput, to_training_batch
from rlcode.train import engine
from rlcode.train import step as step_lib


def _model(attention="dense", **kw):
    cfg = model_config(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       ffw_dim=64, tie_embeddings=False, qk_norm=True, **kw)
    cfg.attention = {"kind": attention}
    return init_model(cfg, seed=1)


def _groups(P, G, Lp, M, seed, pad=0):
    """A rollout of P prompts x G samples laid out as the synthesis job lays it out (per row)."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, Lp + 1, P).astype(np.int32)
    plen[0] = Lp  # one prompt fills its width
    prompts = np.where(np.arange(Lp)[None] < plen[:, None], rng.integers(1, 64, (P, Lp)), pad).astype(np.int32)
    n = rng.integers(1, M + 1, P * G).astype(np.int32)
    n[0] = 1  # a one-token completion
    tokens = np.where(np.arange(M)[None] < n[:, None], rng.integers(1, 64, (P * G, M)), pad).astype(np.int32)
    out = SampleOutput(jnp.asarray(tokens), jnp.asarray(-rng.gamma(2.0, 1.0, (P * G, M)).astype(np.float32)),
                       jnp.asarray(np.arange(M)[None] < n[:, None]), jnp.asarray(n))
    tb = to_training_batch(jnp.asarray(prompts), jnp.asarray(plen), out, group_size=G, pad_id=pad)
    batch = {"inputs": tb.inputs, "targets": tb.targets, "positions": tb.positions, "mask": tb.mask,
             "kv_lengths": tb.kv_lengths, "behavior_logp": tb.behavior_logp,
             "advantages": jnp.asarray(rng.normal(size=P * G).astype(np.float32))}
    return batch, prompts, plen, tokens


def _both(P, G, Lp, M, seed):
    batch, prompts, plen, tokens = _groups(P, G, Lp, M, seed)
    per_row = step_lib.with_score_index(batch, minimum=4, max_fraction=1.0)
    shared = step_lib.with_shared_prompts(batch, prompts, plen, tokens, multiple=4)
    return per_row, shared


@pytest.mark.parametrize("attention,P,G,Lp,M", [("dense", 3, 4, 11, 7), ("dense", 1, 2, 5, 3), ("dense", 2, 8, 24, 16),
                                                 ("squid", 3, 4, 11, 7)])
def test_shared_prompts_give_the_per_row_log_probs(attention, P, G, Lp, M):
    model = _model(attention)
    graphdef, params = step_lib.split_on_mesh(model, None)
    logprob = step_lib.make_logprob_fn(graphdef, temperature=0.7)
    per_row, shared = _both(P, G, Lp, M, seed=P * 100 + M)
    assert shared["prompts"].shape[0] == P and shared["completions"].shape[0] == P * G
    assert shared["completions"].shape[1] <= M + 3  # cut to what the loss reads, rounded up to 4
    a, _ = logprob(params, per_row)
    b, _ = logprob(params, shared)
    m = np.asarray(per_row["mask"])
    assert m.any(1).all()
    np.testing.assert_allclose(np.asarray(b)[m], np.asarray(a)[m], rtol=1e-5, atol=1e-5)
    assert not np.asarray(b)[~m].any()


def test_the_completion_width_covers_exactly_the_positions_the_loss_reads():
    batch, prompts, plen, tokens = _groups(3, 2, 9, 12, seed=4)
    shared = step_lib.with_shared_prompts(batch, prompts, plen, tokens, multiple=1)
    n = np.asarray(batch["mask"]).sum(1)  # a row's loss positions: its prompt's last token + n - 1 own tokens
    assert shared["completions"].shape[1] == max(int(n.max()) - 1, 1)
    assert shared["prompts"].shape == prompts.shape  # the pool's width: one shape per completion width
    wide = step_lib.with_shared_prompts(batch, prompts, plen, tokens, multiple=8)
    assert wide["completions"].shape[1] == min(12, 8 * -(-(int(n.max()) - 1) // 8))
    short, p2, l2, t2 = _groups(2, 2, 2, 12, seed=5)  # completions most of the time axis: still indexed
    assert step_lib.with_shared_prompts(short, p2, l2, t2, multiple=1)["score_index"].shape[1] >= 0.75 * short["mask"].shape[1]
    with pytest.raises(ValueError, match="completion rows"):
        step_lib.with_shared_prompts(batch, prompts[:2], plen[:2], tokens[:4])
    with pytest.raises(ValueError, match="start with their group's prompt"):  # rows and prompts misaligned
        step_lib.with_shared_prompts(batch, prompts[::-1], plen[::-1], tokens)


def _train(batch, microbatches, objective, drop_old=False):
    model = _model()
    optim = step_lib.optim_config(lr=1e-3, warmup_steps=1, total_steps=4)
    optimizer = step_lib.make_optimizer(optim)
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
    step = step_lib.make_train_step(graphdef, objective, optimizer, microbatches=microbatches, log_entropy=True)
    batch = dict(batch)
    if drop_old:
        batch.pop("old_logp")
    state, metrics = step(state, batch)
    return jax.tree.map(float, metrics), jax.tree.map(np.asarray, state.params)


def _close(run_a, run_b, skip=()):
    (ma, pa), (mb, pb) = run_a, run_b
    for k in ma.keys() & mb.keys():
        if k not in skip:
            np.testing.assert_allclose(mb[k], ma[k], rtol=3e-5, atol=2e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(y, x, rtol=2e-4, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_train_step_on_shared_prompts_is_the_per_row_step(microbatches):
    """PPO clip + TIS + KL + entropy: loss, metrics and updated parameters agree; micro-batches
    hold whole groups."""
    objective = losses.ObjectiveConfig.from_config(losses.loss_config(
        kind="ppo", agg="seq-mean-token-mean", clip_high=0.28, is_mode="tis", kl_coef=0.1, entropy_coef=0.01))
    per_row, shared = _both(4, 4, 13, 9, seed=7)
    graphdef, params = step_lib.split_on_mesh(_model(), None)
    own, _ = step_lib.make_logprob_fn(graphdef)(params, per_row)
    m = per_row["mask"]
    extra = {"old_logp": jnp.where(m, own - 0.02, 0.0), "ref_logp": jnp.where(m, own + 0.05, 0.0)}
    a = _train({**per_row, **extra}, microbatches, objective)
    b = _train({**shared, **extra}, microbatches, objective)
    # Metrics are means over micro-batches, which hold other rows here (strided rows vs whole
    # groups); the loss and the update are exact either way.
    _close(a, b, skip=() if microbatches == 1 else set(a[0]) - {"loss", "grad_norm", "update_norm"})


@pytest.mark.slow
def test_old_log_probs_from_the_train_step_equal_a_separate_pass():
    """One update per batch: without ``old_logp`` the step uses its own log-probs (no gradient
    through them) and reports the summed log-ratio to the reference per row."""
    objective = losses.ObjectiveConfig.from_config(losses.loss_config(
        kind="ppo", agg="token-mean", clip_high=0.28, is_mode="tis", kl_coef=0.1))
    _, shared = _both(2, 4, 10, 8, seed=9)
    graphdef, params = step_lib.split_on_mesh(_model(), None)
    own, _ = step_lib.make_logprob_fn(graphdef)(params, shared)
    m = shared["mask"]
    ref = jnp.where(m, own + jnp.asarray(np.random.default_rng(0).normal(0, 0.1, m.shape), jnp.float32), 0.0)
    batch = {**shared, "old_logp": jnp.where(m, own, 0.0), "ref_logp": ref}
    for microbatches in (1, 2):
        separate = _train(batch, microbatches, objective)
        inside = _train(batch, microbatches, objective, drop_old=True)
        _close(separate, inside)
        rows = np.asarray(m).any(1)
        want = float(np.sum(np.where(np.asarray(m), np.asarray(own) - np.asarray(ref), 0)[rows]) / rows.sum())
        got = inside[0]["kl_from_start_sum"] / inside[0]["kl_from_start_rows"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert "kl_from_start_sum" not in separate[0]


def test_minibatches_and_microbatches_keep_each_prompt_with_its_rows():
    _, shared = _both(4, 3, 6, 5, seed=2)
    for mb in engine.split_groups(shared, 2, 3, np.random.default_rng(0)):
        assert mb["prompts"].shape[0] == 2 and mb["inputs"].shape[0] == 6
        first = np.asarray(mb["inputs"])[::3]  # each group's first row starts with its prompt
        for g in range(2):
            k = int(mb["prompt_lengths"][g])
            np.testing.assert_array_equal(first[g, :k], np.asarray(mb["prompts"])[g, :k])
    split = step_lib.split_microbatches(shared, 2)
    assert split["prompts"].shape[:2] == (2, 2) and split["inputs"].shape[:2] == (2, 6)
    for i in range(2):  # micro-batch i holds groups i, i + 2
        np.testing.assert_array_equal(split["prompts"][i], np.asarray(shared["prompts"])[i::2])
        rows = np.concatenate([np.arange(g * 3, g * 3 + 3) for g in (i, i + 2)])
        np.testing.assert_array_equal(split["inputs"][i], np.asarray(shared["inputs"])[rows])
    with pytest.raises(ValueError, match="prompt groups"):
        step_lib.split_microbatches(shared, 3)


def test_only_layouts_that_cannot_change_a_number_share_prompts():
    assert supports_shared_prompts(_model("dense").cfg) and supports_shared_prompts(_model("squid").cfg)
    nsa = _model("dense")
    for cfg in (dataclasses.replace(nsa.cfg, attention={"kind": "nsa"}), dataclasses.replace(nsa.cfg, mlp={"kind": "moe"})):
        assert not supports_shared_prompts(cfg)
    model = _model()
    model.cfg = dataclasses.replace(model.cfg, mlp={"kind": "moe"})
    with pytest.raises(ValueError, match="dense MLP"):
        model.forward_shared(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), jnp.zeros((2, 3), jnp.int32),
                             jnp.zeros((2, 3), jnp.int32))
