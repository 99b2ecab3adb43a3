"""The transformer against an independent float64 numpy forward, plus masks, registries, decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlcode.models import attention as attn_lib
from rlcode.models import mlp as mlp_lib
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import ModelConfig, init_model, logical_axes, model_config
from support.forward import forward


def small_config(**kw):
    base = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48)
    base.update(kw)
    return model_config(**base)


# --------------------------------------------------------------------------------------------
# Oracle: a float64 numpy forward written from the definitions, loops over heads and positions
# --------------------------------------------------------------------------------------------


def np_rmsnorm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_rope(x_tnh, positions, theta):
    T, N, H = x_tnh.shape
    out = np.empty_like(x_tnh)
    half = H // 2
    for i in range(half):
        angle = positions * theta ** (-2.0 * i / H)
        c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
        a, b = x_tnh[:, :, i], x_tnh[:, :, i + half]
        out[:, :, i] = a * c - b * s
        out[:, :, i + half] = b * c + a * s
    return out


def np_forward(params, cfg, tokens, visible):
    """tokens [T]; visible[t, s] whether query t may see key s. Returns final hidden [T, D]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T = len(tokens)
    N, K, H = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    x = p["embed"][tokens]
    positions = np.arange(T)
    for i in range(cfg["num_layers"]):
        blk = p[f"block_{i}"]
        h = np_rmsnorm(x, blk["attn_norm"]["scale"], cfg["norm_eps"])
        pr = blk["attn"]["proj"]
        q = np.einsum("td,dnh->tnh", h, pr["wq"])
        k = np.einsum("td,dkh->tkh", h, pr["wk"])
        v = np.einsum("td,dkh->tkh", h, pr["wv"])
        if cfg["qk_norm"]:
            q = np_rmsnorm(q, pr["q_norm"]["scale"], cfg["norm_eps"])
            k = np_rmsnorm(k, pr["k_norm"]["scale"], cfg["norm_eps"])
        q, k = np_rope(q, positions, cfg["rope_theta"]), np_rope(k, positions, cfg["rope_theta"])
        o = np.zeros((T, N, H))
        for n in range(N):
            kv = n // (N // K)
            for t in range(T):
                s = np.where(visible[t], k[:, kv] @ q[t, n] / np.sqrt(H), -np.inf)
                w = np.exp(s - s.max())
                w /= w.sum()
                o[t, n] = w @ v[:, kv]
        x = x + np.einsum("tnh,nhd->td", o, pr["wo"])
        h = np_rmsnorm(x, blk["mlp_norm"]["scale"], cfg["norm_eps"])
        m = blk["mlp"]
        gate = h @ m["w_gate"]
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ m["w_up"])) @ m["w_down"]
    return np_rmsnorm(x, p["final_norm"]["scale"], cfg["norm_eps"])


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_forward_matches_numpy_oracle(qk_norm, heads):
    cfg = small_config(qk_norm=qk_norm, num_heads=heads[0], num_kv_heads=heads[1], rope_theta=500.0)
    model = init_model(cfg, seed=1)
    # Non-trivial norm scales so the oracle checks they are applied.
    params = jax.tree.map(lambda a: a * 1.1 if a.ndim == 1 else a, params_of(model))
    model = nnx.merge(nnx.split(model)[0], params)
    tokens = np.random.default_rng(0).integers(0, 61, (2, 9))
    hidden = np.asarray(model(jnp.asarray(tokens)).hidden)
    causal = np.tril(np.ones((9, 9), bool))
    for b in range(2):
        np.testing.assert_allclose(hidden[b], np_forward(params, cfg, tokens[b], causal), rtol=2e-4, atol=2e-4)


def jitted_decode(model):
    """`model.decode` as one compiled program (support.forward does the same for the forward)."""
    graphdef, state = nnx.split(model)
    decode = jax.jit(lambda state, *args: nnx.merge(graphdef, state).decode(*args))
    return lambda *args: decode(state, *args)


def test_causal_and_padding_and_segments():
    cfg = small_config()
    net = init_model(cfg, seed=2)
    model = lambda *a, **k: forward(net, *a, **k)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 61, (1, 10)))
    full = model(tokens).hidden
    changed = model(tokens.at[0, 7].set((tokens[0, 7] + 1) % 61)).hidden
    np.testing.assert_allclose(np.asarray(full[0, :7]), np.asarray(changed[0, :7]), atol=1e-6)
    assert not np.allclose(np.asarray(full[0, 7:]), np.asarray(changed[0, 7:]))

    # Right padding via kv_lengths: valid positions equal the unpadded forward.
    short = model(tokens[:, :6]).hidden
    padded = model(tokens, mask=AttentionMask(kv_lengths=jnp.array([6]))).hidden
    np.testing.assert_allclose(np.asarray(padded[0, :6]), np.asarray(short[0]), atol=1e-5)

    # Packed segments with positions restarting: each segment equals its own forward.
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]])
    packed = model(tokens, pos, AttentionMask(segment_ids=seg)).hidden
    np.testing.assert_allclose(np.asarray(packed[0, :4]), np.asarray(model(tokens[:, :4]).hidden[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[0, 4:9]), np.asarray(model(tokens[:, 4:9]).hidden[0]), atol=1e-5)
    assert np.all(np.isfinite(np.asarray(packed)))
    both = model(tokens, pos, AttentionMask(segment_ids=seg, kv_lengths=jnp.array([9]))).hidden
    np.testing.assert_allclose(np.asarray(both[0, :9]), np.asarray(packed[0, :9]), atol=1e-6)


def test_decode_matches_full_forward_with_shared_prefix_groups():
    cfg = small_config(qk_norm=True)
    model = init_model(cfg, seed=3)
    decode = jitted_decode(model)
    rng = np.random.default_rng(2)
    Pg, G, Lp, M = 2, 3, 7, 4
    prompt_lengths = jnp.array([7, 4])
    prompts = jnp.asarray(rng.integers(1, 61, (Pg, Lp)))
    gen = jnp.asarray(rng.integers(1, 61, (Pg * G, M)))
    out = forward(model, prompts, mask=AttentionMask(kv_lengths=prompt_lengths), return_kv=True)
    suffix = model.init_suffix_cache(Pg * G, M)
    positions0 = jnp.repeat(prompt_lengths, G)
    decoded = []
    for t in range(M):
        h, suffix = decode(gen[:, t], positions0 + t, out.kv, prompt_lengths, suffix, jnp.int32(t))
        decoded.append(np.asarray(h))
    decoded = np.stack(decoded, 1)
    for b in range(Pg * G):
        g = b // G
        p = int(prompt_lengths[g])
        seq = jnp.concatenate([prompts[g, :p], gen[b]])[None]
        ref = np.asarray(forward(model, seq).hidden[0, p:])
        np.testing.assert_allclose(decoded[b], ref, atol=2e-5, rtol=2e-5)


def test_tied_untied_and_value_head():
    tied = init_model(small_config(), seed=0)
    w, layout = tied.unembedding()
    assert layout == "vd" and w.shape == (61, 32)
    untied = init_model(small_config(tie_embeddings=False, value_head=True), seed=0)
    w, layout = untied.unembedding()
    assert layout == "dv" and w.shape == (32, 61)
    out = untied(jnp.zeros((2, 5), jnp.int32))
    assert out.values.shape == (2, 5) and out.values.dtype == jnp.float32
    assert untied.logits(out.hidden).shape == (2, 5, 61)
    assert tied(jnp.zeros((2, 5), jnp.int32)).values is None


def test_bfloat16_compute_close_to_float32():
    m32 = init_model(small_config(), seed=4)
    m16 = init_model(small_config(dtype="bfloat16"), seed=4)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 61, (2, 8)))
    h32, h16 = m32(tokens).hidden, m16(tokens).hidden
    assert h16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(h16, np.float32), np.asarray(h32), atol=0.1)


def test_logical_axes_cover_every_parameter():
    model = init_model(small_config(qk_norm=True, tie_embeddings=False, value_head=True))
    axes, params = logical_axes(model), params_of(model)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
    flat_params = jax.tree.leaves(params)
    assert len(flat_axes) == len(flat_params)
    for a, p in zip(flat_axes, flat_params):
        assert len(a) == p.ndim


def test_registries_and_config_validation():
    with pytest.raises(ValueError, match="unknown attention.kind='nope'"):
        init_model(small_config(attention={"kind": "nope"}))
    with pytest.raises(ValueError, match="unknown mlp.kind"):
        init_model(small_config(mlp={"kind": "nope"}))
    with pytest.raises(ValueError, match="already registered"):
        attn_lib.register_attention("dense")(object)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_config(small_config(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_config(small_config(dtype="float8"))

    # A registered kind is picked up by config alone.
    @mlp_lib.register_mlp("test_zero_mlp")
    class ZeroMLP(nnx.Module):
        def __init__(self, cfg, *, rngs):
            pass

        def __call__(self, x):
            return jnp.zeros_like(x), {"test_aux": jnp.float32(0.5)}

    try:
        model = init_model(small_config(mlp={"kind": "test_zero_mlp"}))
        out = model(jnp.zeros((1, 3), jnp.int32))
        assert float(out.aux["test_aux"]) == 1.0  # summed over the 2 layers
    finally:
        del mlp_lib.MLP["test_zero_mlp"]


def test_attention_config_lists_every_option_and_rejects_unknown_ones():
    cfg = attn_lib.attention_config("nsa", window=64)
    assert cfg["kind"] == "nsa" and cfg["window"] == 64 and cfg["block_len"] == 32 and cfg["num_select"] == 16
    assert attn_lib.attention_config("squid") == {"kind": "squid", "impl": "auto"}
    with pytest.raises(ValueError, match="unknown attention kind"):
        attn_lib.attention_config("linear")
    with pytest.raises(ValueError, match="no option"):
        attn_lib.attention_config("dense", window=4)
    # A model built from a partial section takes the remaining options' defaults.
    model = init_model(small_config(attention={"kind": "nsa", "window": 8, "impl": "xla"}))
    assert model.block_0.attn.sizes.window == 8 and model.block_0.attn.sizes.select_size == 64


# Which dimensions each projection contracts (its fan-in), by parameter name; the expected std of
# a fresh parameter is 1 / sqrt(product of those dimensions).
FAN_IN = {
    "wq": lambda s: s[0], "wk": lambda s: s[0], "wv": lambda s: s[0],  # [D, heads, H]: x @ w over D
    "wo": lambda s: s[0] * s[1],  # [N, H, D]: over heads x head_dim
    "w_gate": lambda s: s[-2] if len(s) == 3 and s[-1] != 3 else s[0],  # MoE [E, D, F]; dense [D, F]; NSA gate [D, N, 3]
    "w_up": lambda s: s[-2] if len(s) == 3 else s[0],
    "w_down": lambda s: s[-2] if len(s) == 3 else s[0],  # MoE [E, F, D]; dense [F, D]
    "router_w": lambda s: s[0],  # [D, E]
    "w1": lambda s: s[0] * s[2],  # NSA compression [l, K, H, F]: over the block's l x H
    "w2": lambda s: s[1],  # [K, F, H]
    "embed": lambda s: s[1],  # [V, D], read as a row; its std is D^-1/2 as well
}


@pytest.mark.parametrize("extra", [{"attention": {"kind": "dense"}}, {"attention": {"kind": "nsa"}},
                                   {"mlp": {"kind": "moe"}}], ids=["dense", "nsa", "moe"])
def test_every_projection_starts_with_std_one_over_sqrt_fan_in(extra):
    model = init_model(model_config(vocab_size=2048, d_model=128, num_layers=1, num_heads=8, num_kv_heads=4,
                                    head_dim=32, ffw_dim=512, **extra), seed=0)
    checked = set()
    for path, w in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]:
        name = str(path[-1].key)
        if name not in FAN_IN:
            continue
        want = FAN_IN[name](w.shape) ** -0.5
        got = float(np.std(np.asarray(w, np.float64)))
        assert abs(got / want - 1) < 0.05, (jax.tree_util.keystr(path), w.shape, got, want)
        checked.add(name)
    assert {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed"} <= checked


def test_a_fresh_model_spreads_its_predictions():
    """Unit-variance projections give near-uniform next-token distributions: the mean log-prob of
    random tokens is close to -log V (a model whose projections start 16x too small mostly
    repeats its current token instead)."""
    V = 2048
    model = init_model(model_config(vocab_size=V, d_model=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32,
                                    ffw_dim=512), seed=0)
    tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, V)
    logits = model.logits(forward(model, tokens, jnp.arange(64)[None].repeat(4, 0)).hidden)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    mean = float(jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean())
    assert abs(mean + np.log(V)) < 1.0, mean
