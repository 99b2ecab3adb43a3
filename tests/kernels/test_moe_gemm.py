"""kernels.moe_gemm: both faces against a per-expert numpy loop, values and gradients; MXFP8 face
against the same loop over operands quantised per expert with kernels.mxfp8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _triton, mxfp8
from kernels import moe_gemm as mg

TRITON_SKIP = pytest.mark.skipif(
    _triton.available() is not None, reason=f"Triton kernels cannot run here: {_triton.available()}"
)
IMPLS = ["xla", pytest.param("triton", marks=TRITON_SKIP)]

# (M, D, F, group sizes): uneven groups, empty groups (first, middle, last), rows past the last
# group, M not a multiple of the row tile (16 in the interpreted tests), a single group.
CASES = [
    (45, 24, 40, [10, 0, 17, 3, 0]),
    (37, 32, 20, [0, 37, 0]),
    (20, 16, 33, [3, 5, 0, 4, 1, 7]),
    (16, 40, 16, [16]),
]


def grouped_call(impl, x, w, gs, precision="bf16"):
    if impl == "triton":
        # Small tiles so the interpreted kernels cross several tiles at small shapes.
        return mg.grouped_matmul_triton(x, w, gs, precision=precision, block_m=16, block_n=16, block_k=16)
    return mg.grouped_matmul(x, w, gs, precision=precision, impl="xla")


def groups_of(gs):
    start = 0
    for e, g in enumerate(gs):
        yield e, slice(start, start + g)
        start += g


def oracle(x, w, gs, dy):
    """y = x_e @ w_e per group (float64 loop), and the gradients of sum(y * dy)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    for e, rows in groups_of(gs):
        y[rows] = x[rows] @ w[e]
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
    return y, dx, dw


def random_case(M, D, F, gs, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, D)).astype(np.float32)
    w = rng.standard_normal((len(gs), D, F)).astype(np.float32)
    dy = rng.standard_normal((M, F)).astype(np.float32)
    return x, w, np.asarray(gs, np.int32), dy


def value_and_grads(fn, x, w, dy):
    y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
    return (y,) + vjp(jnp.asarray(dy))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,D,F,gs", CASES)
@pytest.mark.slow
def test_float32_values_and_grads_match_the_loop(impl, M, D, F, gs):
    x, w, gs, dy = random_case(M, D, F, gs)
    got = value_and_grads(lambda a, b: grouped_call(impl, a, b, jnp.asarray(gs)), x, w, dy)
    for g, want, name in zip(got, oracle(x, w, gs, dy), ("y", "dx", "dw")):
        # Rows past sum(group_sizes) give 0 (and get 0 gradient), empty groups get dw = 0.
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-4, err_msg=name)


def test_bf16_computes_in_input_dtype_with_float32_accumulation():
    M, D, F, gs = CASES[0]
    x, w, gs, dy = random_case(M, D, F, gs)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = mg.grouped_matmul(xb, wb, jnp.asarray(gs), impl="xla")
    assert y.dtype == jnp.bfloat16
    want, _, _ = oracle(np.asarray(xb, np.float32), np.asarray(wb, np.float32), gs, dy)
    # Exact products of bf16 operands summed in float32: only the final rounding to bf16 remains.
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2**-8, atol=1e-2)


def test_jit_with_traced_group_sizes():
    M, D, F, gs = CASES[2]
    x, w, gs, dy = random_case(M, D, F, gs)
    y = jax.jit(lambda a, b, g: mg.grouped_matmul(a, b, g, impl="xla"))(x, w, jnp.asarray(gs))
    np.testing.assert_allclose(np.asarray(y), oracle(x, w, gs, dy)[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,block,gs", [(45, 16, [10, 0, 17, 3, 0]), (7, 16, [0, 0, 7]), (64, 32, [32, 32])])
def test_row_tiles_cover_each_row_once_inside_one_group(M, block, gs):
    expert, start, end = (np.asarray(a) for a in mg.row_tiles(jnp.asarray(gs, jnp.int32), M, block))
    assert len(expert) == -(-M // block) + len(gs)
    owner = np.full(M, -1)
    for e, s, t in zip(expert, start, end):
        assert 0 <= t - s <= block
        owner[s:t] = np.where(owner[s:t] == -1, e, -2)  # -2 marks a row covered twice
    want = np.full(M, -1)
    for e, rows in groups_of(gs):
        want[rows] = e
    np.testing.assert_array_equal(owner, want)


def test_pad_groups_aligns_each_group_and_keeps_sums():
    gs = np.array([5, 0, 33, 1], np.int32)
    a = np.arange(45, dtype=np.float32)[:, None] + 1
    padded, sizes = (np.asarray(v) for v in mg.pad_groups(jnp.asarray(a), jnp.asarray(gs), 32))
    np.testing.assert_array_equal(sizes, [32, 0, 64, 32])
    assert padded.shape[0] % 32 == 0 and padded.shape[0] >= sizes.sum()
    start = 0
    for e, rows in groups_of(gs):
        np.testing.assert_array_equal(padded[start:start + gs[e], 0], a[rows, 0])
        assert not padded[start + gs[e]:start + sizes[e]].any()
        start += sizes[e]
    assert not padded[start:].any()  # rows 39..44 lie past the last group and are dropped


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------

def qdq(a, axis):
    """Quantise-dequantise along axis with zero padding to a multiple of 32 (float64 result)."""
    a = np.asarray(a, np.float32)
    n = a.shape[axis]
    pad = [(0, -n % 32) if i == axis % a.ndim else (0, 0) for i in range(a.ndim)]
    v, s = mxfp8.quantize(jnp.asarray(np.pad(a, pad)), axis=axis)
    out = np.asarray(mxfp8.dequantize(v, s, axis=axis), np.float64)
    return np.take(out, np.arange(n), axis=axis)


def mx_oracle(x, w, gs, dy):
    """The MX products per expert, each operand quantised along the GEMM's contracting axis; a
    group's tokens are blocked in 32s from the group's first row."""
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
    for e, rows in groups_of(gs):
        y[rows] = qdq(x[rows], 1) @ qdq(w[e], 0)
        dx[rows] = qdq(dy[rows], 1) @ qdq(w[e], 1).T
        if rows.stop > rows.start:
            dw[e] = qdq(x[rows], 0).T @ qdq(dy[rows], 0)
    return y, dx, dw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,D,F,gs", [CASES[0], (70, 64, 48, [33, 0, 31, 6])])
@pytest.mark.slow
def test_mxfp8_matches_per_expert_quantised_loop(impl, M, D, F, gs):
    x, w, gs, dy = random_case(M, D, F, gs, seed=1)
    got = value_and_grads(lambda a, b: grouped_call(impl, a, b, jnp.asarray(gs), "mxfp8"), x, w, dy)
    for g, want, name in zip(got, mx_oracle(x, w, gs, dy), ("y", "dx", "dw")):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-4, err_msg=name)


@pytest.mark.slow
def test_mxfp8_error_against_exact_is_within_e4m3_rounding():
    M, D, F, gs = 96, 64, 64, [40, 24, 0, 32]
    x, w, gs, dy = random_case(M, D, F, gs, seed=2)
    got = value_and_grads(lambda a, b: grouped_call("xla", a, b, jnp.asarray(gs), "mxfp8"), x, w, dy)
    # E4M3 with RNE has relative rounding error <= 2^-4 per element (3 stored mantissa bits), so a
    # product of two quantised operands is off by <= ~2 * 2^-4 per term; over a sum of random-sign
    # terms the errors partly cancel, giving ~2^-4 relative Frobenius error. Bound at 0.1.
    for g, want in zip(got, oracle(x, w, gs, dy)):
        rel = np.linalg.norm(np.asarray(g) - want) / np.linalg.norm(want)
        assert 0 < rel < 0.1, rel


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.slow
def test_cpu_tiled_engine_equals_ragged_dot(block_m):
    """The CPU engine (a loop over row tiles) equals jax.lax.ragged_dot, values and gradients,
    with groups spanning several tiles, empty groups and rows past the last group."""
    rng = np.random.default_rng(block_m)
    sizes = np.array([9, 0, 1, 14, 0, 5], np.int32)  # 29 of 33 rows grouped
    x = jnp.asarray(rng.standard_normal((33, 12)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 12, 7)), jnp.float32)
    gs = jnp.asarray(sizes)
    dy = jnp.asarray(rng.standard_normal((33, 7)), jnp.float32)
    ours, vjp_ours = jax.vjp(lambda a, b: mg._tiled_matmul(a, b, gs, block_m), x, w)
    want, vjp_want = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, preferred_element_type=jnp.float32), x, w)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(ours)[29:] == 0)
    for g, h in zip(vjp_ours(dy), vjp_want(dy)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5)
    dw = mg._tiled_weight_grad(x, dy, gs, 6, block_m)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(vjp_want(dy)[1]), rtol=1e-5, atol=1e-5)
