"""Grouped GEMM for mixture-of-experts layers: rows sorted by expert times that expert's weights.

    y[r] = x[r] @ w[e(r)],   x [M, D], w [E, D, F], group_sizes [E] int32 -> y [M, F] (x.dtype)

The rows of x are sorted by expert: group e is the next group_sizes[e] rows after groups 0..e-1
(a group may be empty). Rows past sum(group_sizes) give 0, as in `jax.lax.ragged_dot`. This is the
dropless MoE GEMM (MegaBlocks, Gale et al. 2022; REFERENCE section 10).

Precisions (`precision=`):

* "bf16": the operands in the input dtype (bfloat16 in training, whatever x.dtype is), products
  accumulated in float32 (`preferred_element_type`), the result cast to x.dtype.
* "mxfp8": the OCP MX emulation of REFERENCE section 9 (`kernels.mxfp8`): every GEMM quantises both
  operands to E4M3 with one E8M0 scale per 32 elements along *its own* contracting axis,
  dequantises and multiplies in float32 (what MX hardware computes: exact products, float32
  accumulation). Under `jax.custom_vjp` the backward re-quantises from the saved high-precision
  operands along the new contracting axes, never transposing quantised data:
    forward  y    = Q(x along D) @ Q(w_e along D)
    dx            = Q(dy along F) @ Q(w_e along F)^T
    dw_e          = Q(x_e along tokens)^T @ Q(dy_e along tokens)
  Tokens of a group are blocked in 32s for dw, so each group is padded with zero rows to a
  multiple of 32 before quantising along the token axis (a block never straddles two experts;
  zero rows change neither a block's amax nor a sum).

Faces (ARCHITECTURE "Kernels: one op, three faces"):

* `grouped_matmul_reference` - `jax.lax.ragged_dot` (the XLA path; dw of the MX face by
  `ragged_dot_general` with the token axis ragged and contracted). XLA:CPU lowers ragged_dot to a
  dense dot over all E groups, so on CPU the same GEMM runs as a loop (`lax.map`) over row tiles
  of `row_tiles` (each tile inside one group, matmul with that group's weights), with a
  hand-written backward of the same form (dx: the loop on w^T; dw: tile products added into
  their expert).
* `grouped_matmul_triton` - a Triton grouped GEMM: one program per (row tile, column tile), each
  row tile inside a single expert's group. The tile -> (expert, rows) table is computed in JAX by
  padding every group to a multiple of the row tile, so the grid is static (cdiv(M, BM) + E row
  tiles bound the padded count) while the groups are data. dx is the same kernel on w read
  transposed through its strides (no copy); dw is a per-expert transposed GEMM kernel (one
  program per (expert, D tile, F tile) looping over the group's rows). Forward and backward under
  `jax.custom_vjp`.
* `grouped_matmul(..., impl="auto"|"xla"|"triton")` - the dispatcher (`auto` = Triton on a CUDA
  device, XLA elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import _triton
from kernels._triton import cdiv, tl, triton

PRECISIONS = ("bf16", "mxfp8")
MX_BLOCK = 32  # elements sharing one E8M0 scale (OCP MX v1.0)


def _check_args(x, w, group_sizes, precision):
    if jnp.ndim(x) != 2:
        raise ValueError(f"x must be [M, D], got shape {jnp.shape(x)}")
    if jnp.ndim(w) != 3:
        raise ValueError(f"w must be [E, D, F], got shape {jnp.shape(w)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"x [M, D={x.shape[1]}] and w [E, D={w.shape[1]}, F] disagree on D")
    if jnp.shape(group_sizes) != (w.shape[0],):
        raise ValueError(f"group_sizes must be [E={w.shape[0]}], got shape {jnp.shape(group_sizes)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


# ---------------------------------------------------------------------------------------------
# Group bookkeeping (shared by the faces)
# ---------------------------------------------------------------------------------------------


def _row_groups(group_sizes, M):
    """[M] int32 group of each row (E for rows past the last group) and [E] group starts."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(M, dtype=ends.dtype), side="right").astype(jnp.int32)
    return group, ends - group_sizes


def pad_groups(a, group_sizes, multiple):
    """Copy each group of rows of a [M, ...] to start at a multiple of `multiple`, zero-padded.

    Returns (a_padded [Mp, ...], padded_sizes [E]) with padded_sizes[e] = the group size rounded up
    to `multiple` and Mp = round_up(M + E * (multiple - 1), multiple), a static bound on their sum.
    Rows past sum(group_sizes) are dropped.
    """
    M, E = a.shape[0], group_sizes.shape[0]
    Mp = cdiv(M + E * (multiple - 1), multiple) * multiple
    padded = cdiv(group_sizes, multiple) * multiple
    group, start = _row_groups(group_sizes, M)
    pstart = jnp.cumsum(padded) - padded
    g = jnp.minimum(group, E - 1)
    dest = jnp.where(group < E, pstart[g] + jnp.arange(M) - start[g], Mp)
    out = jnp.zeros((Mp,) + a.shape[1:], a.dtype).at[dest].set(a, mode="drop")
    return out, padded.astype(group_sizes.dtype)


# ---------------------------------------------------------------------------------------------
# XLA engines (float32 results)
# ---------------------------------------------------------------------------------------------


def ragged_dot_is_dense() -> bool:
    """True where XLA lowers `ragged_dot` to a dense dot over every group (XLA:CPU: E times the
    work and memory of the grouped GEMM; measured 8x slower than one-hot dispatch at E=64)."""
    return jax.default_backend() == "cpu"


def _tile_rows(group_sizes, M, block_m):
    """Row tiles of `row_tiles`: (expert [nt], row index [nt, block_m] with M for padding, valid)."""
    e, start, end = row_tiles(group_sizes, M, block_m)
    rows = start[:, None] + jnp.arange(block_m, dtype=jnp.int32)
    valid = rows < end[:, None]
    return e, jnp.where(valid, rows, M), valid


def _gather_tiles(a, rows):
    """a [M, ...] -> [nt, block_m, ...]; row index M reads a zero row."""
    a_pad = jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])
    return a_pad[rows]


def _tiled_forward(x, w, group_sizes, block_m):
    """float32 [M, N] = x_r @ w[e(r)] as a loop over row tiles, each inside one expert's group."""
    M = x.shape[0]
    e, rows, _ = _tile_rows(group_sizes, M, block_m)
    x_t = _gather_tiles(x, rows)
    y_t = jax.lax.map(lambda a: jnp.dot(a[0], w[a[1]], preferred_element_type=jnp.float32), (x_t, e))
    y = jnp.zeros((M + 1, w.shape[2]), jnp.float32).at[rows].set(y_t)  # rows are unique but the pad row
    return y[:M]


def _tiled_weight_grad(x, dy, group_sizes, num_groups, block_m):
    """float32 [E, D, F], dw[e] = x_e^T dy_e, accumulated tile by tile into its expert."""
    e, rows, _ = _tile_rows(group_sizes, x.shape[0], block_m)
    x_t, dy_t = _gather_tiles(x, rows), _gather_tiles(dy, rows)

    def body(dw, args):
        xi, dyi, ei = args
        return dw.at[ei].add(jnp.dot(xi.T, dyi, preferred_element_type=jnp.float32)), None

    dw0 = jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32)
    return jax.lax.scan(body, dw0, (x_t, dy_t, e))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_matmul(x, w, group_sizes, block_m):
    return _tiled_forward(x, w, group_sizes, block_m)


def _tiled_matmul_fwd(x, w, group_sizes, block_m):
    return _tiled_forward(x, w, group_sizes, block_m), (x, w, group_sizes)


def _tiled_matmul_bwd(block_m, res, dy):
    x, w, group_sizes = res
    dx = _tiled_forward(dy, jnp.swapaxes(w, 1, 2), group_sizes, block_m)
    dw = _tiled_weight_grad(x, dy, group_sizes, w.shape[0], block_m)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)

# Rows per tile of the CPU engine: big enough for efficient matmuls, small enough that padding
# every group to a multiple of it (at most E * (TILE_M - 1) extra rows) stays cheap.
TILE_M = 128


def _xla_matmul(x, w, group_sizes):
    if ragged_dot_is_dense():
        return _tiled_matmul(x, w, group_sizes, TILE_M)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def _xla_weight_grad(x, dy, group_sizes):
    """[E, D, F] with dw[e] = x_e^T @ dy_e over the rows of group e."""
    if ragged_dot_is_dense():
        return _tiled_weight_grad(x, dy, group_sizes, group_sizes.shape[0], TILE_M)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return jax.lax.ragged_dot_general(x, dy, group_sizes, dims, preferred_element_type=jnp.float32)


def grouped_matmul_reference(x, w, group_sizes, *, precision="bf16"):
    """The XLA face: `jax.lax.ragged_dot` (shapes and precisions in the module docstring)."""
    _check_args(x, w, group_sizes, precision)
    group_sizes = group_sizes.astype(jnp.int32)
    if precision == "mxfp8":
        return _mx_grouped("xla", (), x, w, group_sizes)
    return _xla_matmul(x, w.astype(x.dtype), group_sizes).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# MXFP8 emulation (custom_vjp over either engine)
# ---------------------------------------------------------------------------------------------


def _qdq(a, axis):
    """Quantise to MXFP8 along `axis` (32-element blocks, RCEIL scales) and dequantise to float32.

    The axis is zero-padded to a multiple of 32 first: zeros change no block's amax, so the real
    elements quantise exactly as in a block-aligned tensor."""
    from kernels import mxfp8

    axis = axis % a.ndim
    n = a.shape[axis]
    pad = -n % MX_BLOCK
    if pad:
        a = jnp.pad(a, [(0, pad) if i == axis else (0, 0) for i in range(a.ndim)])
    values, scales = mxfp8.quantize(a, axis=axis)
    out = mxfp8.dequantize(values, scales, axis=axis, dtype=jnp.float32)
    return jax.lax.slice_in_dim(out, 0, n, axis=axis)


def _engine_matmul(impl, cfg, x, w, group_sizes, transpose_w=False):
    """float32 [M, N] = x @ w_e (or w_e^T when transpose_w) per group, by `impl`."""
    if impl == "triton":
        return _triton_matmul_launch(dict(cfg), x, w, group_sizes, transpose_w, jnp.float32)
    return _xla_matmul(x, jnp.swapaxes(w, 1, 2) if transpose_w else w, group_sizes)


def _engine_weight_grad(impl, cfg, x, dy, group_sizes, num_groups):
    if impl == "triton":
        return _triton_weight_grad_launch(dict(cfg), x, dy, group_sizes, num_groups, jnp.float32)
    return _xla_weight_grad(x, dy, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mx_grouped(impl, cfg, x, w, group_sizes):
    y = _engine_matmul(impl, cfg, _qdq(x, 1), _qdq(w, 1), group_sizes)
    return y.astype(x.dtype)


def _mx_grouped_fwd(impl, cfg, x, w, group_sizes):
    return _mx_grouped(impl, cfg, x, w, group_sizes), (x, w, group_sizes)


def _mx_grouped_bwd(impl, cfg, res, dy):
    x, w, group_sizes = res
    # dx contracts over F: quantise dy rowwise and w along its F axis, from the sources.
    dx = _engine_matmul(impl, cfg, _qdq(dy, 1), _qdq(w, 2), group_sizes, transpose_w=True)
    # dw contracts over the tokens of each group: pad groups to 32-row blocks, quantise columnwise.
    x_p, padded = pad_groups(x, group_sizes, MX_BLOCK)
    dy_p, _ = pad_groups(dy, group_sizes, MX_BLOCK)
    dw = _engine_weight_grad(impl, cfg, _qdq(x_p, 0), _qdq(dy_p, 0), padded, w.shape[0])
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_mx_grouped.defvjp(_mx_grouped_fwd, _mx_grouped_bwd)


# ---------------------------------------------------------------------------------------------
# Triton face
# ---------------------------------------------------------------------------------------------

if _triton.HAVE_TRITON:

    @triton.jit
    def _grouped_matmul_kernel(
        x_ptr, w_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
        y_ptr,
        K: tl.constexpr, N: tl.constexpr, SW_E: tl.constexpr, SW_K: tl.constexpr, SW_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        """y[rows of tile] = x[rows] @ w[e]: x [M, K] row-major, w[e][k, n] at e*SW_E + k*SW_K + n*SW_N."""
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + t)
        start = tl.load(tile_start_ptr + t)
        end = tl.load(tile_end_ptr + t)
        # Row tiles past the padded groups' total are empty (start == end): nothing to do.
        if start < end:
            offs_m = start + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = offs_m < end
            col_ok = offs_n < N
            w_base = w_ptr + e.to(tl.int64) * SW_E
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_base + offs_k[:, None] * SW_K + offs_n[None, :] * SW_N,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(a, b, input_precision="ieee")
                else:
                    acc += tl.dot(a, b)
            tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _grouped_weight_grad_kernel(
        x_ptr, dy_ptr, group_start_ptr, group_end_ptr,
        dw_ptr,
        D: tl.constexpr, F: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):
        """dw[e] = x[rows of e]^T @ dy[rows of e]: x [M, D], dy [M, F], dw [E, D, F]."""
        e = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
        d_ok = offs_d < D
        f_ok = offs_f < F
        start = tl.load(group_start_ptr + e)
        end = tl.load(group_end_ptr + e)
        acc = tl.zeros((BLOCK_D, BLOCK_F), tl.float32)
        for r0 in range(start, end, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < end
            xt = tl.load(x_ptr + offs_r[None, :].to(tl.int64) * D + offs_d[:, None],
                         mask=d_ok[:, None] & r_ok[None, :], other=0.0)
            g = tl.load(dy_ptr + offs_r[:, None].to(tl.int64) * F + offs_f[None, :],
                        mask=r_ok[:, None] & f_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, g, input_precision="ieee")
            else:
                acc += tl.dot(xt, g)
        tl.store(dw_ptr + e.to(tl.int64) * (D * F) + offs_d[:, None] * F + offs_f[None, :],
                 acc.to(dw_ptr.dtype.element_ty), mask=d_ok[:, None] & f_ok[None, :])


def row_tiles(group_sizes, M, block_m):
    """The static tile table of the Triton forward: groups padded to multiples of block_m.

    Returns (tile_expert, tile_start, tile_end), each [cdiv(M, block_m) + E] int32: row tile t
    covers rows [tile_start[t], tile_end[t]) of x, all in group tile_expert[t]; unused trailing
    tiles have start == end. sum_e cdiv(g_e, block_m) <= cdiv(M, block_m) + E bounds the count.
    """
    E = group_sizes.shape[0]
    n_tiles = cdiv(M, block_m) + E
    tiles_per = cdiv(group_sizes, block_m)
    tile_ends = jnp.cumsum(tiles_per)
    t = jnp.arange(n_tiles, dtype=tile_ends.dtype)
    expert = jnp.searchsorted(tile_ends, t, side="right")
    used = expert < E
    e = jnp.minimum(expert, E - 1)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    start = group_start[e] + (t - (tile_ends[e] - tiles_per[e])) * block_m
    end = jnp.minimum(start + block_m, group_start[e] + group_sizes[e])
    start = jnp.where(used, start, 0)
    end = jnp.where(used, end, 0)
    return e.astype(jnp.int32), start.astype(jnp.int32), end.astype(jnp.int32)


def _launch_config(dtype, block_m, block_n, block_k):
    # float32 inputs get exact float32 products (Triton's default for them on GPU is TF32).
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=bool(dtype == jnp.float32))


def _triton_matmul_launch(cfg, x, w, group_sizes, transpose_w, out_dtype):
    """[M, N] = x @ w_e per group; w [E, K, N], or [E, N, K] read transposed when transpose_w."""
    M, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    w = w.astype(x.dtype)
    strides = (w.shape[1] * w.shape[2], 1, w.shape[2]) if transpose_w else (w.shape[1] * w.shape[2], w.shape[2], 1)
    tile_expert, tile_start, tile_end = row_tiles(group_sizes, M, cfg["BLOCK_M"])
    return _triton.triton_call(
        x, w, tile_expert, tile_start, tile_end,
        kernel=_grouped_matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        grid=(tile_expert.shape[0], cdiv(N, cfg["BLOCK_N"])),
        K=K, N=N, SW_E=strides[0], SW_K=strides[1], SW_N=strides[2],
        **cfg,
    )


def _triton_weight_grad_launch(cfg, x, dy, group_sizes, num_groups, out_dtype):
    M, D = x.shape
    F = dy.shape[1]
    dy = dy.astype(x.dtype)
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = (ends - group_sizes).astype(jnp.int32)
    block_d, block_f = cfg["BLOCK_N"], cfg["BLOCK_N"]
    return _triton.triton_call(
        x, dy, starts, ends,
        kernel=_grouped_weight_grad_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, D, F), out_dtype),
        grid=(num_groups, cdiv(D, block_d), cdiv(F, block_f)),
        D=D, F=F, BLOCK_D=block_d, BLOCK_F=block_f, BLOCK_R=cfg["BLOCK_K"], IEEE=cfg["IEEE"],
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _triton_grouped(cfg_items, x, w, group_sizes):
    return _triton_matmul_launch(dict(cfg_items), x, w, group_sizes, False, x.dtype)


def _triton_grouped_fwd(cfg_items, x, w, group_sizes):
    return _triton_grouped(cfg_items, x, w, group_sizes), (x, w, group_sizes)


def _triton_grouped_bwd(cfg_items, res, dy):
    x, w, group_sizes = res
    cfg = dict(cfg_items)
    dy = dy.astype(x.dtype)
    dx = _triton_matmul_launch(cfg, dy, w, group_sizes, True, x.dtype)
    dw = _triton_weight_grad_launch(cfg, x, dy, group_sizes, w.shape[0], jnp.float32)
    return dx, dw.astype(w.dtype), None


_triton_grouped.defvjp(_triton_grouped_fwd, _triton_grouped_bwd)


def grouped_matmul_triton(x, w, group_sizes, *, precision="bf16", block_m=64, block_n=64, block_k=32):
    """The Triton face (kernels and tile table in the module docstring); differentiable.

    block_m / block_n / block_k: tile sizes (powers of two >= 16). With precision "mxfp8" the
    operands are quantised and dequantised in JAX and the float32 GEMMs run in these kernels.
    """
    _triton.require()
    _check_args(x, w, group_sizes, precision)
    for name, blk in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not isinstance(blk, int) or blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk!r}")
    group_sizes = group_sizes.astype(jnp.int32)
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[2]), x.dtype)
    if precision == "mxfp8":
        cfg = _launch_config(jnp.float32, block_m, block_n, block_k)
        return _mx_grouped("triton", tuple(sorted(cfg.items())), x, w, group_sizes)
    cfg = _launch_config(x.dtype, block_m, block_n, block_k)
    return _triton_grouped(tuple(sorted(cfg.items())), x, w.astype(x.dtype), group_sizes)


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def grouped_matmul(x, w, group_sizes, *, precision="bf16", impl="auto"):
    """y [M, F] = x[r] @ w[group of r] for rows sorted by group; see the module docstring.

    x [M, D]; w [E, D, F]; group_sizes [E] int (sum <= M; rows past the sum give 0).
    precision: "bf16" (input dtype, float32 accumulation) or "mxfp8" (MX emulation, REFERENCE
    section 9). impl: "auto" (Triton on a CUDA device, XLA elsewhere), "xla" or "triton".
    """
    if _triton.use_triton(impl):
        return grouped_matmul_triton(x, w, group_sizes, precision=precision)
    return grouped_matmul_reference(x, w, group_sizes, precision=precision)
