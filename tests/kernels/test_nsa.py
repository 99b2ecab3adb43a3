"""kernels.nsa: both faces against a naive float64 oracle of REFERENCE section 7, forward and
gradients, the two black-box identities (selection / window branch = dense causal attention when
they cover the whole past), decoding against the full forward, and argument checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _triton
from kernels.nsa import (
    TokenStore,
    check_sizes,
    nsa_attention,
    nsa_attention_reference,
    nsa_decode,
    num_compressed_blocks,
)
from rlcode.models.attention import SharedPrefix

TRITON_SKIP = pytest.mark.skipif(
    _triton.available() is not None, reason=f"Triton kernels cannot run here: {_triton.available()}"
)
IMPLS = ["xla", pytest.param("triton", marks=TRITON_SKIP)]
# Small NSA sizes so that a few dozen tokens hold several compression and selection blocks.
SIZES = dict(block_len=8, stride=4, select_size=16, num_select=3, window=24)


# ---------------------------------------------------------------------------------------------
# Oracle: REFERENCE section 7 written out per query with python loops, in float64.
# ---------------------------------------------------------------------------------------------


def np_softmax_attend(q, keys, values, scale):
    """q [H], keys/values [P, H] -> softmax(q . keys * scale) @ values and the probabilities."""
    s = keys @ q * scale
    p = np.exp(s - s.max())
    p /= p.sum()
    return p @ values, p


def np_nsa(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, sizes, scale=None):
    """Returns (out [B, T, N, H], selected [B, T, K, Ns] bool, margin).

    margin: the smallest score gap between a selected and an unselected candidate block that is not
    an exact tie; a tie is decided by the lower block index, a gap below float32 resolution could
    make a float32 implementation choose differently, so tests require it to be comfortable."""
    q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates = (
        np.asarray(x, np.float64) for x in (q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates)
    )
    l, d, ls, n, w = sizes["block_len"], sizes["stride"], sizes["select_size"], sizes["num_select"], sizes["window"]
    B, T, N, H = q.shape
    K = k_slc.shape[2]
    R = N // K
    Tc = k_cmp.shape[1]
    Ns = math.ceil(T / ls)
    scale = H**-0.5 if scale is None else scale
    out = np.zeros((B, T, N, H))
    selected = np.zeros((B, T, K, Ns), bool)
    margin = np.inf
    for b in range(B):
        for t in range(T):
            visible = [i for i in range(Tc) if i * d + l - 1 <= t]
            p_cmp = np.zeros((N, Tc))
            o_cmp = np.zeros((N, H))
            for h in range(N):
                if visible:
                    o_cmp[h], p_cmp[h, visible] = np_softmax_attend(
                        q[b, t, h], k_cmp[b, visible, h // R], v_cmp[b, visible, h // R], scale
                    )
            for kh in range(K):
                group = p_cmp[kh * R : (kh + 1) * R].sum(0)
                score = np.zeros(Ns)
                for j in range(Ns):
                    for i in range(Tc):
                        if i * d < (j + 1) * ls and j * ls < i * d + l:  # block i overlaps block j
                            score[j] += group[i]
                candidates = [j for j in range(Ns) if j * ls <= t]
                forced = sorted({0, t // ls, t // ls - 1} & set(candidates))
                rest = sorted(set(candidates) - set(forced), key=lambda j: (-score[j], j))
                chosen = forced + rest[: n - len(forced)]
                for a in rest[: n - len(forced)]:
                    for c in rest[n - len(forced) :]:
                        if score[a] != score[c]:
                            margin = min(margin, score[a] - score[c])
                selected[b, t, kh, chosen] = True
                keys = [u for j in chosen for u in range(j * ls, (j + 1) * ls) if u <= t]
                win = list(range(max(0, t - w + 1), t + 1))
                for h in range(kh * R, (kh + 1) * R):
                    o_slc, _ = np_softmax_attend(q[b, t, h], k_slc[b, keys, kh], v_slc[b, keys, kh], scale)
                    o_win, _ = np_softmax_attend(q[b, t, h], k_win[b, win, kh], v_win[b, win, kh], scale)
                    g = gates[b, t, h]
                    out[b, t, h] = g[0] * o_cmp[h] + g[1] * o_slc + g[2] * o_win
    return out, selected, margin


def dense_nsa_jax(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, selected, sizes, scale=None):
    """The same op as dense masked attention in jax (run under x64 for float64 gradients), with the
    selected blocks [B, T, K, Ns] held fixed."""
    l, d, ls, w = sizes["block_len"], sizes["stride"], sizes["select_size"], sizes["window"]
    B, T, N, H = q.shape
    K = k_slc.shape[2]
    R = N // K
    Tc = k_cmp.shape[1]
    scale = H**-0.5 if scale is None else scale
    t = np.arange(T)

    def attend(keys, values, mask_btnS):
        s = jnp.einsum("btnh,bsnh->btns", q, jnp.repeat(keys, R, axis=2)) * scale
        s = jnp.where(mask_btnS, s, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(mask_btnS, jnp.exp(s - m), 0.0)
        den = e.sum(-1, keepdims=True)
        p = e / jnp.where(den > 0, den, 1.0)
        return jnp.einsum("btns,bsnh->btnh", p, jnp.repeat(values, R, axis=2))

    cmp_mask = (np.arange(Tc)[None, :] * d + l - 1 <= t[:, None])[None, :, None, :]
    token_sel = np.repeat(selected, ls, axis=-1)[..., :T] & (t[None, :] <= t[:, None])[None, :, None, :]
    slc_mask = np.repeat(token_sel, R, axis=2)
    win_mask = ((t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - w))[None, :, None, :]
    o = (
        gates[..., 0:1] * attend(k_cmp, v_cmp, cmp_mask)
        + gates[..., 1:2] * attend(k_slc, v_slc, slc_mask)
        + gates[..., 2:3] * attend(k_win, v_win, win_mask)
    )
    return o


def np_dense_causal(q, k, v, scale=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    R = N // k.shape[2]
    scale = H**-0.5 if scale is None else scale
    s = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, R, 2)) * scale
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, np.repeat(v, R, 2))


@pytest.fixture
def x64():
    """A context manager that turns on float64 in jax for the oracle only."""
    return lambda: jax.enable_x64(True)


def make_inputs(seed, B, T, N, K, H, sizes, separate=False, gates=None):
    rng = np.random.default_rng(seed)
    Tc = num_compressed_blocks(T, sizes["block_len"], sizes["stride"])
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    # Larger queries make p_cmp peaked, so the top-n choice is decided by clear score gaps.
    x = dict(q=2.0 * f(B, T, N, H), k_slc=f(B, T, K, H), v_slc=f(B, T, K, H), k_cmp=f(B, Tc, K, H), v_cmp=f(B, Tc, K, H))
    if separate:
        x.update(k_win=f(B, T, K, H), v_win=f(B, T, K, H))
    else:
        x.update(k_win=x["k_slc"], v_win=x["v_slc"])
    if gates is None:
        x["gates"] = rng.uniform(size=(B, T, N, 3)).astype(np.float32)
    else:
        x["gates"] = np.broadcast_to(np.asarray(gates, np.float32), (B, T, N, 3)).copy()
    return x


def call(x, impl, separate, sizes):
    k = {"slc": x["k_slc"], "win": x["k_win"]} if separate else x["k_slc"]
    v = {"slc": x["v_slc"], "win": x["v_win"]} if separate else x["v_slc"]
    return nsa_attention(x["q"], k, v, x["k_cmp"], x["v_cmp"], x["gates"], impl=impl, **sizes)


ORACLE_ORDER = ("q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates")

# (B, T, N, K, num_select, separate k/v per branch, seed): T = 40 fits 3 selection blocks (n = 3
# selects every visible block); T = 70 and 96 make the top-n choice real; 40 and 70 are no block
# multiple. Seeds are ones whose top-n choices are far from ties (checked by the test).
SHAPES = [
    (2, 40, 4, 2, 3, False, 0),
    (1, 70, 4, 1, 3, True, 1),
    (1, 96, 4, 2, 4, False, 100),
]


# ---------------------------------------------------------------------------------------------
# Forward and gradients against the oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,T,N,K,n,separate,seed", SHAPES)
def test_forward_and_gradients_match_oracle(impl, B, T, N, K, n, separate, seed, x64):
    sizes = dict(SIZES, num_select=n)
    x = make_inputs(seed, B, T, N, K, 16, sizes, separate)
    want, selected, margin = np_nsa(*(x[name] for name in ORACLE_ORDER), sizes)
    assert margin > 1e-4, f"inputs too close to a top-n tie to test a float32 implementation: {margin}"
    # The selection is not trivial: some query leaves out a visible block.
    visible = np.arange(selected.shape[-1])[None, :] * sizes["select_size"] <= np.arange(T)[:, None]
    assert (T == 40) == bool(np.all(selected == visible[None, :, None, :]))

    names = ("q", "k_slc", "v_slc", "k_cmp", "v_cmp", "gates") + (("k_win", "v_win") if separate else ())
    cot = np.random.default_rng(1).standard_normal(want.shape).astype(np.float32)

    def loss(diff, x):
        out = call({**x, **diff}, impl, separate, sizes)
        return jnp.sum(out * cot), out

    # One forward and backward (the interpreted kernels are slow).
    (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))({k: x[k] for k in names}, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    with x64():
        x64_in = {k: jnp.asarray(v, jnp.float64) for k, v in x.items()}

        def oracle_loss(diff):
            y = {**x64_in, **diff}
            if not separate:
                y.update(k_win=y["k_slc"], v_win=y["v_slc"])
            out = dense_nsa_jax(*(y[k] for k in ORACLE_ORDER), selected, sizes)
            return jnp.sum(out * cot), out

        (_, want_out), want_grads = jax.jit(jax.value_and_grad(oracle_loss, has_aux=True))(
            {k: x64_in[k] for k in names}
        )
        want_grads = {k: np.asarray(v) for k, v in want_grads.items()}
    # The dense-mask oracle with the oracle's selection is the same function as the loop oracle.
    np.testing.assert_allclose(np.asarray(want_out), want, atol=1e-12)
    for name in names:
        np.testing.assert_allclose(np.asarray(grads[name]), want_grads[name], atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "T,sizes",
    [
        (6, SIZES),  # shorter than a compression block: the compression branch gives 0 everywhere
        (9, SIZES),  # a single compressed block
        (100, dict(block_len=16, stride=8, select_size=32, num_select=3, window=20)),
        (50, dict(block_len=4, stride=4, select_size=4, num_select=5, window=7)),  # l = l' = d: p_slc = p_cmp
    ],
    ids=["T6", "T9", "l16-d8-ls32", "l=ls=d=4"],
)
def test_forward_matches_oracle_at_other_sizes(impl, T, sizes):
    x = make_inputs(T, 1, T, 4, 2, 16, sizes)
    want, _, margin = np_nsa(*(x[name] for name in ORACLE_ORDER), sizes)
    assert margin > 1e-4, margin
    got = jax.jit(lambda x: call(x, impl, False, sizes))(x)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Black-box identities: a branch that covers the whole past is dense causal attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("branch", ["selection", "window"])
def test_branch_covering_the_past_is_dense_causal_attention(impl, branch):
    B, T, N, K, H = 1, 40, 4, 2, 16
    if branch == "selection":  # n * l' = 48 >= T: every block is selected
        sizes, gates = dict(SIZES, num_select=3), (0.0, 1.0, 0.0)
    else:  # w >= T: the window is the whole past
        sizes, gates = dict(SIZES, window=T), (0.0, 0.0, 1.0)
    x = make_inputs(3, B, T, N, K, H, sizes, gates=gates)
    got = jax.jit(lambda x: call(x, impl, False, sizes))(x)
    np.testing.assert_allclose(np.asarray(got), np_dense_causal(x["q"], x["k_slc"], x["v_slc"]), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Decoding one token at a time equals the full forward
# ---------------------------------------------------------------------------------------------


def test_decode_equals_full_forward_with_rows_at_different_positions():
    """Plain [B, S, K, H] caches; each row at its own position; unwritten entries are NaN."""
    B, T, N, K, H = 2, 70, 4, 2, 16
    sizes = SIZES
    x = make_inputs(1, B, T, N, K, H, sizes, separate=True)
    full = np.asarray(jax.jit(lambda x: call(x, "xla", True, sizes))(x))
    Tc = x["k_cmp"].shape[1]

    @jax.jit
    def step(x, t_b):
        def written(a, n_b):  # entries at index >= n_b are not written yet
            return jnp.where((jnp.arange(a.shape[1]) < n_b[:, None])[:, :, None, None], a, jnp.nan)

        kv = {name: written(x[name], t_b + 1) for name in ("k_slc", "v_slc", "k_win", "v_win")}
        n_cmp = num_compressed_blocks(t_b + 1, sizes["block_len"], sizes["stride"])
        q = x["q"][jnp.arange(B), t_b]
        return nsa_decode(
            q, {"slc": kv["k_slc"], "win": kv["k_win"]}, {"slc": kv["v_slc"], "win": kv["v_win"]},
            written(x["k_cmp"], n_cmp), written(x["v_cmp"], n_cmp), x["gates"][jnp.arange(B), t_b], t_b, **sizes,
        )

    assert Tc == num_compressed_blocks(T, sizes["block_len"], sizes["stride"]) == 16
    for t in range(T):
        t_b = np.array([t, T - 1 - t])
        got = np.asarray(step(x, jnp.asarray(t_b)))
        np.testing.assert_allclose(got, full[np.arange(B), t_b], atol=2e-5, rtol=2e-5, err_msg=f"t={t}")


@pytest.mark.slow
def test_decode_equals_full_forward_with_shared_prefix_cache():
    """The sampler's layout: prompts shared by G rows (lengths 21 and 9, so compression blocks
    straddle the prompt/generation boundary), each row's generated tail in its own suffix."""
    sizes = SIZES
    l, d = sizes["block_len"], sizes["stride"]
    Pg, G, N, K, H, Lp, M = 2, 2, 4, 2, 16, 24, 40
    B = Pg * G
    p = np.array([21, 9])
    rows = []
    for b in range(B):  # row b's full sequence: its group's prompt, then its own tokens
        g = b // G
        x = make_inputs(10 + b, 1, int(p[g]) + M, N, K, H, sizes)
        rows.append(x)
    # Make the prompt part identical within a group (tokens and the compressed prompt blocks).
    for b in range(B):
        first = rows[(b // G) * G]
        n_prompt_blocks = num_compressed_blocks(int(p[b // G]), l, d)
        for name in ("q", "k_slc", "v_slc", "gates"):
            rows[b][name][:, : p[b // G]] = first[name][:, : p[b // G]]
        for name in ("k_cmp", "v_cmp"):
            rows[b][name][:, :n_prompt_blocks] = first[name][:, :n_prompt_blocks]
        rows[b]["k_win"], rows[b]["v_win"] = rows[b]["k_slc"], rows[b]["v_slc"]
    full = [np.asarray(call(x, "xla", False, sizes))[0] for x in rows]

    nan = np.float32(np.nan)
    prefix, prefix_cmp = {}, {}
    for name in ("k_slc", "v_slc"):
        prefix[name] = np.full((Pg, Lp, K, H), nan, np.float32)
        for g in range(Pg):
            prefix[name][g, : p[g]] = rows[g * G][name][0, : p[g]]
    Scp = num_compressed_blocks(Lp, l, d)
    n_prompt_blocks = num_compressed_blocks(p, l, d)
    for name in ("k_cmp", "v_cmp"):
        prefix_cmp[name] = np.full((Pg, Scp, K, H), nan, np.float32)
        for g in range(Pg):
            prefix_cmp[name][g, : n_prompt_blocks[g]] = rows[g * G][name][0, : n_prompt_blocks[g]]
    Ssc = M // d + l // d

    @jax.jit
    def step(s, q, gates, suffix, suffix_cmp):
        pos = jnp.repeat(jnp.asarray(p), G) + s
        k = SharedPrefix(prefix["k_slc"], jnp.asarray(p), suffix["k_slc"])
        v = SharedPrefix(prefix["v_slc"], jnp.asarray(p), suffix["v_slc"])
        kc = SharedPrefix(prefix_cmp["k_cmp"], jnp.asarray(n_prompt_blocks), suffix_cmp["k_cmp"])
        vc = SharedPrefix(prefix_cmp["v_cmp"], jnp.asarray(n_prompt_blocks), suffix_cmp["v_cmp"])
        return nsa_decode(q, k, v, kc, vc, gates, pos, **sizes)

    # The decode reads the model layer's layout through its TokenStore interface; arrays directly.
    assert isinstance(SharedPrefix(prefix["k_slc"], p, prefix["k_slc"]), TokenStore)
    assert not isinstance(jnp.asarray(prefix["k_slc"]), TokenStore)
    suffix = {name: np.full((B, M, K, H), nan, np.float32) for name in ("k_slc", "v_slc")}
    suffix_cmp = {name: np.full((B, Ssc, K, H), nan, np.float32) for name in ("k_cmp", "v_cmp")}
    for s in range(M):
        q, gates, want = [], [], []
        for b in range(B):
            t = p[b // G] + s
            for name in suffix:
                suffix[name][b, s] = rows[b][name][0, t]
            n_done = num_compressed_blocks(t + 1, l, d)
            first = n_prompt_blocks[b // G]
            for name in suffix_cmp:
                suffix_cmp[name][b, : n_done - first] = rows[b][name][0, first:n_done]
            q.append(rows[b]["q"][0, t])
            gates.append(rows[b]["gates"][0, t])
            want.append(full[b][t])
        got = step(jnp.int32(s), np.stack(q), np.stack(gates), suffix, suffix_cmp)
        np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=2e-5, rtol=2e-5, err_msg=f"step {s}")


# ---------------------------------------------------------------------------------------------
# Sparsity of the reference, sizes and argument checks
# ---------------------------------------------------------------------------------------------


def test_reference_never_builds_a_time_by_time_tensor():
    import re

    B, T, N, K, H = 1, 512, 4, 2, 16
    sizes = dict(SIZES, window=32)
    x = make_inputs(0, B, T, N, K, H, sizes)
    args = [x[name] for name in ("q", "k_slc", "v_slc", "k_cmp", "v_cmp", "gates")]
    text = str(jax.make_jaxpr(lambda *a: nsa_attention_reference(*a, **sizes))(*args))
    dims = [[int(n) for n in shape.split(",") if n] for shape in re.findall(r"\[([0-9,]*)\]", text)]
    assert dims and not [d for d in dims if sum(n >= T for n in d) >= 2]
    # The chunk's selected keys are there: [B, K, C * n * l', H] with C = 64.
    assert [B, K, 64 * 3 * 16, H] in dims


def test_num_compressed_blocks():
    assert [num_compressed_blocks(T, 8, 4) for T in (0, 7, 8, 11, 12, 40)] == [0, 0, 1, 1, 2, 9]
    np.testing.assert_array_equal(num_compressed_blocks(jnp.array([0, 7, 8, 12, 40]), 8, 4), [0, 0, 1, 2, 9])
    assert num_compressed_blocks(64, 32, 16) == 3


def test_argument_checks():
    good = dict(SIZES)
    x = make_inputs(0, 1, 40, 4, 2, 16, good)
    args = [x[name] for name in ("q", "k_slc", "v_slc", "k_cmp", "v_cmp", "gates")]
    for bad, msg in [
        (dict(stride=3), "must divide block_len"),
        (dict(select_size=18, stride=4), "must divide select_size"),
        (dict(num_select=2), "num_select"),
        (dict(window=0), "window must be a positive"),
    ]:
        with pytest.raises(ValueError, match=msg):
            nsa_attention(*args, **{**good, **bad})
    with pytest.raises(ValueError, match="gates must be"):
        nsa_attention(*args[:5], args[5][..., :2], **good)
    with pytest.raises(ValueError, match="k_cmp must be"):
        nsa_attention(*args[:3], args[3][:, :-1], *args[4:], **good)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        nsa_attention(args[0][:, :, :3], *args[1:3], args[3], args[4], args[5][:, :, :3], **good)
    with pytest.raises(ValueError, match="'slc' and 'win'"):
        nsa_attention(args[0], {"slc": args[1]}, {"slc": args[2]}, *args[3:], **good)
    with pytest.raises(ValueError, match="both be arrays or both be dicts"):
        nsa_attention(args[0], {"slc": args[1], "win": args[1]}, args[2], *args[3:], **good)
    with pytest.raises(ValueError, match="impl must be"):
        nsa_attention(*args, impl="cuda", **good)
    assert check_sizes(32, 16, 64, 16, 512) == (32, 16, 64, 16, 512)
