"""The train step: exact loss, micro-batching, schedule, donation; sharded and multi-process runs."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode import losses
from rlcode.models.attention import AttentionMask
from rlcode.train import step as step_lib

from support import step_check, xla_flags  # also the script the multi-device tests run in subprocesses


def fresh(microbatches=1, loss_overrides=None):
    model, loss_cfg, optim = step_check.build(**(loss_overrides or {}))
    optimizer = step_lib.make_optimizer(optim)
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
    train_step = step_lib.make_train_step(graphdef, loss_cfg, optimizer, microbatches=microbatches,
                                          schedule=step_lib.lr_schedule(optim))
    return graphdef, state, train_step, loss_cfg


@pytest.mark.slow
def test_loss_equals_objective_from_full_logits():
    graphdef, state, train_step, loss_cfg = fresh()
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch().items()}
    params0 = jax.tree.map(jnp.copy, state.params)
    _, metrics = train_step(state, batch)

    # Independent path: materialised logits and the losses module's own log-prob helpers.
    model = nnx.merge(graphdef, params0)
    out = model(batch["inputs"], batch["positions"], AttentionMask(kv_lengths=batch["kv_lengths"]))
    logits = model.logits(out.hidden)
    logp = losses.logprobs_from_logits(logits, batch["targets"])
    num, den, _ = losses.objective_terms(
        loss_cfg, logp, batch["old_logp"], batch["advantages"], batch["mask"], behavior_logp=batch["behavior_logp"],
        ref_logp=batch["ref_logp"], entropy=losses.entropy_from_logits(logits), values=out.values,
        old_values=batch["old_values"], returns=batch["returns"])
    np.testing.assert_allclose(float(metrics["loss"]), float(num / den), rtol=1e-5)
    assert float(metrics["grad_norm"]) > 0 and float(metrics["lr"]) > 0


def _sparse_batch(B, T, most, seed):
    """make_batch's rows with a mask of at most `most` scattered positions per row (one row empty)."""
    rng = np.random.default_rng(seed)
    batch = step_check.make_batch(B=B, T=T, seed=seed)
    mask = np.zeros((B, T), bool)
    for b in range(1, B):
        n = int(rng.integers(1, most + 1))
        mask[b, rng.choice(int(batch["kv_lengths"][b]), min(n, int(batch["kv_lengths"][b])), replace=False)] = True
    batch["mask"] = mask
    return batch


def test_the_score_index_lists_each_rows_loss_positions_in_order():
    batch = _sparse_batch(6, 40, 9, seed=3)
    out = step_lib.with_score_index(batch, minimum=4)
    index = np.asarray(out["score_index"])
    K = 1 << (int(batch["mask"].sum(1).max()) - 1).bit_length()  # a power of two, for few shapes
    assert index.shape == (6, K) and K >= batch["mask"].sum(1).max()
    for b in range(6):  # the naive loop
        want = [t for t in range(40) if batch["mask"][b, t]]
        assert list(index[b]) == want + [-1] * (K - len(want)), b
    dense = step_check.make_batch()  # most positions are scored: nothing to gain, left as it is
    assert "score_index" not in step_lib.with_score_index(dense)
    assert step_lib.with_score_index(out) is out


@pytest.mark.slow
@pytest.mark.parametrize("B,T,most,microbatches", [(8, 48, 6, 1), (16, 96, 20, 2), (4, 200, 33, 4)])
def test_scoring_only_the_loss_positions_changes_no_number(B, T, most, microbatches):
    """Log-probs at the mask's positions, the loss, every metric and the updated parameters are
    those of scoring every position (PPO with KL, entropy, IS and value terms); elsewhere 0."""
    batch = _sparse_batch(B, T, most, seed=B + T)
    scored = step_lib.with_score_index(batch, minimum=8)
    assert "score_index" in scored
    graphdef, state, train_step, _ = fresh(microbatches=microbatches)
    logprob = step_lib.make_logprob_fn(graphdef)
    full, _ = logprob(state.params, {k: jnp.asarray(v) for k, v in batch.items()})
    part, _ = logprob(state.params, {k: jnp.asarray(v) for k, v in scored.items()})
    m = batch["mask"]
    np.testing.assert_allclose(np.asarray(part)[m], np.asarray(full)[m], rtol=1e-5, atol=1e-5)
    assert not np.asarray(part)[~m].any()
    results = []
    for b in (batch, scored):
        _, state, train_step, _ = fresh(microbatches=microbatches)
        state, metrics = train_step(state, {k: jnp.asarray(v) for k, v in b.items()})
        results.append((jax.tree.map(float, metrics), jax.tree.map(np.asarray, state.params)))
    (m0, p0), (m1, p1) = results
    assert m0.keys() == m1.keys()
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_microbatches_give_the_full_batch_update():
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch().items()}
    results = []
    for m in (1, 2, 4):
        _, state, train_step, _ = fresh(microbatches=m)
        state, metrics = train_step(state, batch)
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state.params)))
    for loss, params in results[1:]:
        np.testing.assert_allclose(loss, results[0][0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(results[0][1])):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="microbatches"):
        fresh(microbatches=3)[2](fresh()[1], batch)


def test_state_is_donated_and_step_advances():
    _, state, train_step, _ = fresh()
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch().items()}
    leaf = jax.tree.leaves(state.params)[0]
    new_state, _ = train_step(state, batch)
    assert leaf.is_deleted()
    assert int(new_state.step) == 1
    assert not np.array_equal(jax.random.key_data(new_state.rng), jax.random.key_data(jax.random.key(0)))
    bad = dict(batch)
    del bad["advantages"]  # (old_logp may be absent: the step's own log-probs, test_shared_prompts)
    with pytest.raises(ValueError, match="advantages"):
        train_step(new_state, bad)


def test_lr_schedule_warmup_then_cosine():
    cfg = step_lib.optim_config(lr=1e-3, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    sched = step_lib.lr_schedule(cfg)
    expected = [1e-3 * (s + 1) / 4 for s in range(4)]
    expected += [1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min((s - 4) / 10, 1)))) for s in range(4, 20)]
    np.testing.assert_allclose([float(sched(s)) for s in range(20)], expected, rtol=1e-6)


@pytest.mark.slow
def test_weight_decay_only_on_matrices():
    graphdef, state, _, _ = fresh()
    optim = step_lib.optim_config(lr=0.0, weight_decay=0.5, warmup_steps=0)
    optimizer = step_lib.make_optimizer(optim)
    opt_state = optimizer.init(state.params)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, _ = optimizer.update(zeros, opt_state, state.params)
    # lr 0: nothing moves at all, decay included (AdamW scales decay by the learning rate).
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    optim = step_lib.optim_config(lr=1.0, weight_decay=0.5, warmup_steps=0, grad_clip=0.0)
    optimizer = step_lib.make_optimizer(optim)
    updates, _ = optimizer.update(zeros, optimizer.init(state.params), state.params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(state.params)):
        if p.ndim >= 2:
            np.testing.assert_allclose(np.asarray(u), -0.5 * np.asarray(p), rtol=1e-6)
        else:
            assert float(jnp.abs(u).max()) == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _check(result):
    assert result["devices"] == 8 and result["sharded_params"] > 0
    assert result["param_change"] > 1e-4  # the steps moved the parameters
    assert result["max_param_diff"] < 1e-5, result
    assert result["max_metric_rel_diff"] < 1e-5, result
    np.testing.assert_allclose(result["loss"], result["ref_loss"], rtol=1e-5)


@pytest.fixture(scope="module")
def eight_device_result():
    """Runs the mesh check in a process started with 8 fake CPU devices."""
    out = subprocess.run([sys.executable, step_check.__file__, "data=2,fsdp=2,tensor=2"],
                         env=_env(8), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_step_equals_single_device(eight_device_result):
    _check(eight_device_result)
    assert eight_device_result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}


@pytest.mark.slow
def test_sharded_shared_prompt_step_equals_single_device():
    """Shared-prompt batches (each group's prompt once) on 8 devices: prompts placed with their rows
    where they divide over the data shards, replicated where not; both equal one device."""
    out = subprocess.run([sys.executable, step_check.__file__, "shared", "data=2,fsdp=2,tensor=2"],
                         env=_env(8), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8 and result["data_shards"] == 4
    assert sorted(c["prompts_divide"] for c in result["cases"]) == [False, True]
    for case in result["cases"]:
        assert case["param_change"] > 1e-4, case  # the steps moved the parameters
        assert case["max_param_diff"] < 1e-5 and case["max_metric_rel_diff"] < 1e-5, case
        np.testing.assert_allclose(case["loss"], case["ref_loss"], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_on_localhost_equal_single_device():
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, step_check.__file__, "distributed", str(i), "2", str(port),
                          "data=2,fsdp=2,tensor=2"], env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(r["process_id"] for r in results) == [0, 1]
    for r in results:
        assert r["process_count"] == 2 and r["local_devices"] == 4
        _check(r)


@pytest.mark.slow
def test_train_state_checkpoint_resume_is_bit_identical(tmp_path):
    """The real TrainState (NamedTuple, typed key, optax state) round-trips through Checkpointer."""
    from rlcode.train.checkpoint import Checkpointer

    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch().items()}
    _, state, train_step, _ = fresh()
    for _ in range(4):
        state, _ = train_step(state, batch)
    straight = jax.tree.map(np.asarray, state.params)

    _, state, train_step, _ = fresh()
    for _ in range(2):
        state, _ = train_step(state, batch)
    with Checkpointer(str(tmp_path / "ckpt"), async_save=False) as ckpt:
        ckpt.save(2, state, extra={"data_position": 2})
    _, template, train_step, _ = fresh()
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        restored, extra = ckpt.restore(target=template)
    assert isinstance(restored, step_lib.TrainState) and extra["data_position"] == 2
    assert int(restored.step) == 2
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))
    for _ in range(2):
        restored, _ = train_step(restored, batch)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
