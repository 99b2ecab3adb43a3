"""The MoE layer against a per-token loop over experts: both dispatch modes (values and gradients),
capacity drops, the auxiliary losses, aux-loss-free balancing, expert parallelism on 8 fake CPU
devices, MXFP8 experts, and training inside the Transformer.

Run as a script (`python test_moe.py ep`, with 8 fake devices) it prints the expert-parallel check
as one JSON line; `test_expert_parallel_equals_unsharded` starts it in a subprocess.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode.models import moe as moe_lib
from rlcode.models.transformer import ModelConfig, init_model, model_config
from support import xla_flags

D, E, F, K = 16, 4, 24, 2


def make_layer(seed=0, d_model=D, **opts):
    base = dict(num_experts=E, top_k=K, expert_ffw_dim=F, impl="xla")
    base.update(opts)
    cfg = ModelConfig.from_config(model_config(d_model=d_model, mlp=moe_lib.moe_config(**base)))
    return moe_lib.MoE(cfg, rngs=nnx.Rngs(params=seed))


def functional(layer):
    """(fn(params, x_btd) -> (y, aux), trainable params, constants) of an MoE layer."""
    graphdef, state = nnx.split(layer)
    full = nnx.to_pure_dict(state)
    params = {k: v for k, v in full.items() if k != "router_bias"}
    consts = {k: v for k, v in full.items() if k == "router_bias"}
    return (lambda p, x: nnx.merge(graphdef, {**p, **consts})(x)), params, consts


def with_params(layer, params):
    nnx.update(layer, nnx.State(params))
    return layer


def np_f(a):
    return np.asarray(a, np.float64)


# --------------------------------------------------------------------------------------------
# Oracle: selection in float64 numpy, then every token through its chosen experts one at a time
# --------------------------------------------------------------------------------------------


def oracle_selection(params, x_nd, opts, bias=None, cap=None):
    """Chosen experts [N, k] (checked to be free of near-ties) and kept [N, k]: capacity slots are
    handed out in token order, each token's choices in order."""
    z = np_f(x_nd) @ np_f(params["router_w"])
    score = 1 / (1 + np.exp(-z)) + (0 if bias is None else np_f(bias)) if opts["router"] == "sigmoid" else z
    sel = np.argsort(-score, axis=1, kind="stable")[:, : opts["top_k"]]
    ranked = -np.sort(-score, axis=1)
    assert np.min(ranked[:, opts["top_k"] - 1] - ranked[:, opts["top_k"]]) > 1e-4, "near-tie in the test router"
    kept = np.ones(sel.shape, bool)
    if cap is not None:
        count = np.zeros(opts["num_experts"], int)
        for n in range(sel.shape[0]):
            for j, e in enumerate(sel[n]):
                kept[n, j] = count[e] < cap
                count[e] += 1
    return sel, kept


def oracle(params, x_nd, opts, sel, kept):
    """y [N, D] and the two aux losses, a python loop over tokens and their experts (jnp, so the
    gradients come from the same loop)."""
    silu = jax.nn.silu
    ys, probs, lses = [], [], []
    for n in range(x_nd.shape[0]):
        x = x_nd[n]
        z = x @ params["router_w"]
        lses.append(jax.nn.logsumexp(z))
        if opts["router"] == "softmax":
            p = jax.nn.softmax(z)
            g = p[sel[n]]
            g = g / jnp.sum(g) if opts["renormalize"] else g
            probs.append(p)
        else:
            s = jax.nn.sigmoid(z)
            g = s[sel[n]] / jnp.sum(s[sel[n]])
            probs.append(s / jnp.sum(s))
        y = jnp.zeros_like(x)
        for j, e in enumerate(sel[n]):
            if kept[n, j]:
                h = silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
                y = y + g[j] * (h @ params["w_down"][e])
        if opts["num_shared_experts"]:
            h = silu(x @ params["shared_w_gate"]) * (x @ params["shared_w_up"])
            y = y + h @ params["shared_w_down"]
        ys.append(y)
    N, k, En = x_nd.shape[0], opts["top_k"], opts["num_experts"]
    f = np.bincount(sel.reshape(-1), minlength=En) / (N * k)
    P = jnp.mean(jnp.stack(probs), axis=0)
    aux_loss = opts["aux_loss_coef"] * En * jnp.sum(f * P)
    z_loss = opts["z_loss_coef"] * jnp.mean(jnp.stack(lses) ** 2)
    return jnp.stack(ys), aux_loss, z_loss


def random_inputs(seed, B=3, T=4, d=D):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((B, T, d)).astype(np.float32))


CASES = [
    dict(router="softmax", dispatch="dropless", renormalize=True),
    dict(router="softmax", dispatch="capacity", capacity_factor=0.75, renormalize=False, num_shared_experts=1),
    dict(router="sigmoid", dispatch="dropless"),
    dict(router="sigmoid", dispatch="capacity", capacity_factor=1.0, num_shared_experts=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['router']}-{c['dispatch']}")
@pytest.mark.slow
def test_matches_per_token_loop_values_and_grads(case):
    layer = make_layer(seed=1, aux_loss_coef=0.3, z_loss_coef=0.05, **case)
    opts = moe_lib.moe_config(num_experts=E, top_k=K, expert_ffw_dim=F, aux_loss_coef=0.3, z_loss_coef=0.05, **case)
    bias = None
    if case["router"] == "sigmoid":
        # A non-zero selection bias that changes the selection of some tokens.
        bias = jnp.asarray(np.random.default_rng(7).normal(0, 0.2, E).astype(np.float32))
        layer.router_bias[...] = bias
    fn, params, _ = functional(layer)
    x = random_inputs(2)
    B, T, _ = x.shape
    x_nd = x.reshape(B * T, D)
    cap = moe_lib.capacity(B * T, layer.opts) if case["dispatch"] == "capacity" else None
    sel, kept = oracle_selection(params, x_nd, opts, bias, cap)
    if case["dispatch"] == "capacity":
        assert 0 < (~kept).sum(), "the capacity case should drop something"
    cot = jnp.asarray(np.random.default_rng(3).standard_normal((B * T, D)).astype(np.float32))

    def loss(p, x):
        y, aux = fn(p, x)
        return jnp.sum(y.reshape(B * T, D) * cot) + aux["moe_aux_loss"] + aux["moe_z_loss"], (y, aux)

    def oracle_loss(p, x):
        y, aux_l, z_l = oracle(p, x.reshape(B * T, D), opts, sel, kept)
        return jnp.sum(y * cot) + aux_l + z_l, (y, aux_l, z_l)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    (_, (y_o, aux_o, z_o)), grads_o = jax.value_and_grad(oracle_loss, argnums=(0, 1), has_aux=True)(params, x)
    np.testing.assert_allclose(np.asarray(y).reshape(B * T, D), np.asarray(y_o), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux["moe_aux_loss"]), float(aux_o), rtol=1e-5)
    np.testing.assert_allclose(float(aux["moe_z_loss"]), float(z_o), rtol=1e-5)
    np.testing.assert_allclose(float(aux["moe_dropped_frac"]), (~kept).mean(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(aux["moe_load"]), np.bincount(sel.reshape(-1), minlength=E) / sel.size)
    for name in params:
        np.testing.assert_allclose(np.asarray(grads[0][name]), np.asarray(grads_o[0][name]), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(grads_o[1]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dropless_equals_capacity_without_drops():
    x = random_inputs(4, B=4, T=8)
    y_dl, aux_dl = make_layer(seed=2, dispatch="dropless")(x)
    # capacity_factor E / k makes C = N: no expert can overflow.
    y_cap, aux_cap = make_layer(seed=2, dispatch="capacity", capacity_factor=E / K)(x)
    np.testing.assert_allclose(np.asarray(y_cap), np.asarray(y_dl), rtol=1e-5, atol=1e-6)
    assert float(aux_cap["moe_dropped_frac"]) == 0.0
    for name in ("moe_aux_loss", "moe_z_loss", "moe_load"):
        np.testing.assert_allclose(np.asarray(aux_cap[name]), np.asarray(aux_dl[name]), rtol=1e-6)


def test_capacity_drops_exactly_the_assignments_past_capacity_in_token_order():
    # top-1 and a router that sends every token to expert 2: the first C tokens are kept.
    layer = make_layer(seed=3, top_k=1, dispatch="capacity", capacity_factor=1.5, renormalize=True)
    w = np.zeros((D, E), np.float32)
    w[0, 2] = 5.0
    layer.router_w[...] = jnp.asarray(w)
    x = random_inputs(5, B=2, T=8)
    x = x.at[..., 0].set(jnp.abs(x[..., 0]) + 1.0)  # feature 0 > 0: expert 2 always wins
    N = 16
    C = math.ceil(1 * N / E * 1.5)
    assert C == 6 and moe_lib.capacity(N, layer.opts) == C
    y, aux = layer(x)
    y = np.asarray(y).reshape(N, D)
    np.testing.assert_allclose(float(aux["moe_dropped_frac"]), (N - C) / N)
    np.testing.assert_allclose(np.asarray(aux["moe_load"]), [0, 0, 1, 0])
    # Dropped tokens contribute nothing (they pass through the residual); the kept ones get expert 2
    # with gate 1 (top-1, renormalised).
    assert np.all(y[C:] == 0)
    x_nd = np.asarray(x).reshape(N, D)
    h = jax.nn.silu(x_nd[:C] @ layer.w_gate[2]) * (x_nd[:C] @ layer.w_up[2])
    np.testing.assert_allclose(y[:C], np.asarray(h @ layer.w_down[2]), rtol=1e-5, atol=1e-6)


def test_aux_loss_is_alpha_when_uniform_and_larger_when_skewed():
    alpha = 0.01
    x = random_inputs(6, B=4, T=8)
    layer = make_layer(seed=4, aux_loss_coef=alpha)
    # A zero router gives P_i = 1/E exactly, so E * sum_i f_i P_i = sum_i f_i = 1 whatever f is.
    layer.router_w[...] = jnp.zeros((D, E))
    np.testing.assert_allclose(float(layer(x)[1]["moe_aux_loss"]), alpha, rtol=1e-6)
    w = np.zeros((D, E), np.float32)
    w[:, 0] = 3.0
    layer.router_w[...] = jnp.asarray(w)
    skewed = float(layer(jnp.abs(x))[1]["moe_aux_loss"])  # |x| . w > 0: expert 0 dominates every token
    assert skewed > 1.5 * alpha, skewed


def test_z_loss_formula():
    layer = make_layer(seed=5, z_loss_coef=1e-3)
    x = random_inputs(7)
    z = np_f(x).reshape(-1, D) @ np_f(layer.router_w[...])
    lse = np.log(np.sum(np.exp(z), axis=-1))
    np.testing.assert_allclose(float(layer(x)[1]["moe_z_loss"]), 1e-3 * np.mean(lse**2), rtol=1e-5)


def test_aux_free_bias_moves_the_load_toward_uniform():
    layer = make_layer(seed=0, router="sigmoid", bias_update_rate=0.02, expert_ffw_dim=8)
    rng = np.random.default_rng(0)
    u = rng.standard_normal(D).astype(np.float32)
    u /= np.linalg.norm(u)
    x = jnp.asarray(rng.standard_normal((4, 16, D)).astype(np.float32) + 2 * u)
    w = 0.5 * np.array(layer.router_w[...])  # a random part of std 1/8, small next to the planted skew
    w[:, 0] += 2 * u  # experts 0 and 1 win almost every token
    w[:, 1] += u
    layer.router_w[...] = jnp.asarray(w)
    graphdef, state = nnx.split(layer)
    load_fn = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x)[1]["moe_load"])
    params = nnx.to_pure_dict(state)
    loads = []
    for _ in range(50):
        loads.append(np.asarray(load_fn(params, x)))
        params = moe_lib.update_router_bias(params, loads[-1], rate=0.02)
    first, last = loads[0].max(), np.mean([l.max() for l in loads[-10:]])
    # The max load starts near 1/k (two experts take everything) and ends within reach of 1/E; the
    # sign rule leaves an oscillation of about one step of gamma.
    assert first > 0.45 and last < 0.5 * (first + 1 / E), (first, last)
    assert np.std(loads[-1]) < 0.5 * np.std(loads[0])

    # The nnx form updates the layer in place with its own rate.
    moe_lib.update_router_bias(layer, loads[0])
    np.testing.assert_allclose(np.asarray(layer.router_bias[...]), -0.02 * np.sign(loads[0] - loads[0].mean()))


@pytest.mark.slow
def test_mxfp8_experts_are_close_to_bf16():
    x = random_inputs(8, B=4, T=16, d=64)
    ref = make_layer(seed=6, d_model=64, expert_ffw_dim=64, num_shared_experts=1)
    mx = with_params(make_layer(seed=6, d_model=64, expert_ffw_dim=64, num_shared_experts=1, precision="mxfp8"),
                     nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
    fn_ref, params, _ = functional(ref)
    fn_mx, _, _ = functional(mx)
    (y_ref, aux_ref), (y_mx, aux_mx) = (jax.jit(fn)(params, x) for fn in (fn_ref, fn_mx))
    rel = float(jnp.linalg.norm(y_mx - y_ref) / jnp.linalg.norm(y_ref))
    print(f"MXFP8 vs bf16 MoE forward: relative Frobenius error {rel:.4f}")
    # Each E4M3 element carries <= 2^-4 relative rounding error (RNE, 3 mantissa bits), so a product
    # of two quantised operands is off by <= ~2 * 2^-4 per term; random-sign errors partly cancel in
    # the sums and the three chained GEMMs add up to a few percent. 0.1 leaves room for the worst
    # case of one GEMM without allowing a wrong scale (a factor-2 error alone would give >= 0.5).
    assert 0 < rel < 0.1, rel
    # The router is float32 either way: identical routing statistics.
    np.testing.assert_array_equal(np.asarray(aux_mx["moe_load"]), np.asarray(aux_ref["moe_load"]))

    g = [jax.jit(jax.grad(lambda p: jnp.sum(fn(p, x)[0] ** 2)))(params) for fn in (fn_ref, fn_mx)]
    for name in ("w_gate", "w_up", "w_down"):
        rel_g = float(jnp.linalg.norm(g[1][name] - g[0][name]) / jnp.linalg.norm(g[0][name]))
        assert rel_g < 0.15, (name, rel_g)


def test_config_validation():
    with pytest.raises(ValueError, match="no option"):
        moe_lib.moe_config(num_expert=4)
    with pytest.raises(ValueError, match="top_k"):
        make_layer(top_k=E + 1)
    with pytest.raises(ValueError, match="router"):
        make_layer(router="relu")


# --------------------------------------------------------------------------------------------
# Inside the Transformer and the train step
# --------------------------------------------------------------------------------------------


def tiny_moe_model(**opts):
    mlp = moe_lib.moe_config(num_experts=4, top_k=2, expert_ffw_dim=32, impl="xla", **opts)
    cfg = model_config(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp=mlp)
    return init_model(cfg, seed=0)


@pytest.mark.slow
def test_moe_transformer_trains_in_the_train_step():
    """The train step adds exactly the "_loss" aux entries to the objective, reports the others as
    metrics, and a sigmoid-routed MoE Transformer trains (loss decreases) with bias updates."""
    from rlcode import losses
    from rlcode.models.attention import AttentionMask
    from rlcode.train import step as step_lib

    from support import step_check

    model = tiny_moe_model(router="sigmoid", dispatch="capacity", capacity_factor=1.0, num_shared_experts=1,
                           aux_loss_coef=0.1, z_loss_coef=0.01)
    loss_cfg = losses.ObjectiveConfig.from_config(losses.loss_config(kind="ppo", agg="token-mean"))
    optimizer = step_lib.make_optimizer(step_lib.optim_config(lr=3e-3, warmup_steps=0))
    graphdef, state = step_lib.init_train_state(model, optimizer, seed=0)
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch(B=4, T=8, V=61).items()}
    params0 = jax.tree.map(jnp.copy, state.params)
    train_step = step_lib.make_train_step(graphdef, loss_cfg, optimizer)
    history = []
    for _ in range(6):
        before = jax.tree.map(jnp.copy, state.params)
        state, metrics = train_step(state, batch)
        history.append(float(metrics["loss"]))
        # The step moves each layer's bias by its own layer's load (not the sum over layers), and
        # nothing else touches it (AdamW's weight decay would shrink it).
        for i in range(2):
            load = metrics[f"aux_moe_load_layer{i}"]
            assert load.shape == (4,)
            want_bias = before[f"block_{i}"]["mlp"]["router_bias"] - 1e-3 * jnp.sign(load - jnp.mean(load))
            np.testing.assert_allclose(np.asarray(state.params[f"block_{i}"]["mlp"]["router_bias"]),
                                       np.asarray(want_bias), rtol=0, atol=1e-7)
        assert not np.allclose(np.asarray(metrics["aux_moe_load_layer0"]), np.asarray(metrics["aux_moe_load_layer1"]))

    @jax.jit
    def objective(params):
        model = nnx.merge(graphdef, params)
        out = model(batch["inputs"], batch["positions"], AttentionMask(kv_lengths=batch["kv_lengths"]))
        logp = losses.logprobs_from_logits(model.logits(out.hidden), batch["targets"])
        num, den, _ = losses.objective_terms(loss_cfg, logp, batch["old_logp"], batch["advantages"], batch["mask"])
        return num / den, out.aux

    policy_loss, aux = objective(params0)
    want = float(policy_loss) + float(aux["moe_aux_loss"]) + float(aux["moe_z_loss"])
    np.testing.assert_allclose(history[0], want, rtol=1e-5)
    assert np.all(np.isfinite(history)) and history[-1] < history[0] - 0.05, history
    # Metrics summed over the 2 layers: the loads sum to 2.
    assert metrics["aux_moe_load"].shape == (4,) and float(metrics["aux_moe_dropped_frac"]) >= 0
    np.testing.assert_allclose(float(jnp.sum(metrics["aux_moe_load"])), 2.0, rtol=1e-6)
    assert float(jnp.abs(state.params["block_0"]["mlp"]["router_bias"]).sum()) > 0


# --------------------------------------------------------------------------------------------
# Expert parallelism on 8 fake CPU devices
# --------------------------------------------------------------------------------------------


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (1e-6 + np.max(np.abs(np.asarray(y)))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def ep_check():
    """Expert-parallel layers (shard_map, all_to_all) vs the unsharded layer; relative max diffs."""
    from rlcode import losses
    from rlcode.sharding import make_mesh, mesh_config, place, rules_from_config
    from rlcode.train import step as step_lib

    from support import step_check

    assert jax.device_count() == 8
    results = {}
    x22 = random_inputs(11, B=2, T=11)  # N = 22: padded to 24 for 8 token shards
    cot = jnp.asarray(np.random.default_rng(12).standard_normal(x22.shape).astype(np.float32))
    for name, mesh_sizes, opts in [
        ("dropless_data2_expert4", dict(data=2, expert=4), dict(dispatch="dropless")),
        ("capacity_nodrop_expert8_sigmoid", dict(data=1, expert=8),
         dict(dispatch="capacity", capacity_factor=8.0, router="sigmoid", num_shared_experts=1)),
    ]:
        layer = make_layer(seed=9, num_experts=8, aux_loss_coef=0.1, z_loss_coef=0.01, **opts)
        if layer.router_bias is not None:
            layer.router_bias[...] = jnp.asarray(np.random.default_rng(1).normal(0, 0.2, 8).astype(np.float32))

        def grad_fn(fn):
            def loss(p, x):
                y, aux = fn(p, x)
                return jnp.sum(y * cot) + aux["moe_aux_loss"] + aux["moe_z_loss"], (y, aux)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

        fn, params, _ = functional(layer)
        (_, ref), ref_g = grad_fn(fn)(params, x22)
        cfg = mesh_config(**mesh_sizes)
        sharded = grad_fn(functional(place(layer, make_mesh(cfg), rules_from_config(cfg)))[0])
        assert "all_to_all" in str(jax.make_jaxpr(sharded)(params, x22))  # the shard_map path ran
        (_, got), got_g = sharded(params, x22)
        results[name] = {"values": _max_diff(got, ref), "grads": _max_diff(got_g, ref_g)}

    # Capacity with drops: per-(shard, expert) capacity = the unsharded layer on each shard's tokens.
    layer = make_layer(seed=10, num_experts=8, dispatch="capacity", capacity_factor=1.0)
    x = random_inputs(13, B=4, T=8)  # 32 tokens, 4 per shard
    cfg = mesh_config(data=2, expert=4)
    place(layer, make_mesh(cfg), rules_from_config(cfg))
    y, aux = jax.jit(lambda x: layer(x))(x)
    place(layer, None)
    one_shard = jax.jit(lambda c: layer(c))
    chunks = [one_shard(c[None]) for c in x.reshape(8, 1, 4, D)[:, 0]]
    y_chunks = jnp.concatenate([c[0] for c in chunks], axis=1).reshape(x.shape)
    results["capacity_drops_per_shard"] = {
        "values": _max_diff(y, y_chunks),
        "dropped": float(aux["moe_dropped_frac"]),
        "dropped_ref": float(np.mean([float(c[1]["moe_dropped_frac"]) for c in chunks])),
    }

    # A capacity-mode MoE policy trained with expert parallelism: the old log-probs (the
    # log-prob function built from the train state's graphdef, as the jobs build it) equal the
    # train step's own log-probs at the same parameters, so every ratio is exactly 1. The same
    # log-probs without the mesh route tokens per shard differently and do drop others.
    model = tiny_moe_model(dispatch="capacity", capacity_factor=1.0)
    optimizer = step_lib.make_optimizer(step_lib.optim_config(lr=1e-3, warmup_steps=0))
    mesh_cfg = mesh_config(data=2, expert=4)
    mesh, rules = make_mesh(mesh_cfg), rules_from_config(mesh_cfg)
    graphdef, state = step_lib.init_train_state(model, optimizer, 0, mesh, rules)
    batch = {k: jnp.asarray(v) for k, v in step_check.make_batch(B=8, T=8, V=61).items()}
    old_logp, _ = step_lib.make_logprob_fn(graphdef)(state.params, batch)
    unplaced, _ = step_lib.make_logprob_fn(nnx.split(place(nnx.merge(graphdef, state.params), None))[0])(
        jax.device_get(state.params), jax.device_get(batch))
    objective = losses.ObjectiveConfig.from_config(losses.loss_config(kind="ppo", agg="token-mean", clip_low=0.0,
                                                                      clip_high=0.0))
    step = step_lib.make_train_step(graphdef, objective, optimizer, mesh=mesh, rules=rules,
                                    shardings=step_lib.state_shardings(state))
    _, m = step(state, dict(batch, old_logp=jnp.where(batch["mask"], old_logp, 0.0)))
    mask = np.asarray(batch["mask"])
    results["old_logp_vs_train_step"] = {
        "ratio_min": float(m["ratio_min"]), "ratio_max": float(m["ratio_max"]),
        "unplaced_diff": float(np.max(np.abs(np.asarray(old_logp) - np.asarray(unplaced))[mask])),
    }
    return results


@pytest.fixture(scope="module")
def ep_results():
    # The checkout first (its tests/rlcode folder must not shadow the package), then tests/, where
    # the `support` package lives.
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = (os.path.dirname(tests), tests, os.environ.get("PYTHONPATH"))
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(filter(None, path)))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "ep"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_expert_parallel_equals_unsharded(ep_results):
    for name in ("dropless_data2_expert4", "capacity_nodrop_expert8_sigmoid"):
        assert ep_results[name]["values"] < 1e-5, (name, ep_results[name])
        assert ep_results[name]["grads"] < 1e-5, (name, ep_results[name])
    drops = ep_results["capacity_drops_per_shard"]
    assert drops["values"] < 1e-5 and drops["dropped"] > 0, drops
    np.testing.assert_allclose(drops["dropped"], drops["dropped_ref"], rtol=1e-6)


@pytest.mark.slow
def test_old_logprobs_equal_the_train_steps_under_expert_parallelism(ep_results):
    r = ep_results["old_logp_vs_train_step"]
    assert r["ratio_min"] == pytest.approx(1.0, abs=1e-5) and r["ratio_max"] == pytest.approx(1.0, abs=1e-5), r
    # Without the mesh, capacity is per layer instead of per (shard, expert): other tokens are
    # dropped and the log-probs move by far more than float reordering (~1e-6), so the check can fail.
    assert r["unplaced_diff"] > 1e-4, r


if __name__ == "__main__":
    if sys.argv[1:] == ["ep"]:
        print(json.dumps(ep_check()))
