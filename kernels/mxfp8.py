"""MXFP8: block-scaled FP8 quantisation and the GEMM built on it (REFERENCE section 9).

Definition (OCP Microscaling Formats (MX) v1.0 specification, 2023; Rouhani et al. 2023,
"Microscaling Data Formats for Deep Learning", arXiv 2310.10537): a tensor is cut into blocks of
32 consecutive elements along one axis (the reduction axis of the GEMM that consumes it). Each
block stores one shared scale X = 2^e as E8M0 (`float8_e8m0fnu`: the biased exponent e + 127, no
sign, no zero, code 0xFF = NaN) and 32 elements P_i in FP8, so that the block represents X * P_i.

* Elements: E4M3 (`float8_e4m3fn`, max 448, emax 8, no inf) or E5M2 (`float8_e5m2`, max 57344,
  emax 15). P_i = x_i / X rounded to nearest, ties to even, saturated to +-max.
* Scale rules, with amax = max_i |x_i| of the block:
  - "rceil" (cuBLAS / TransformerEngine / JAX; the default): e = ceil(log2(amax / max)), so
    amax / X lies in (max / 2, max] and nothing saturates;
  - "floor" (the OCP spec): e = floor(log2(amax)) - emax; values in (max, 2^(emax+1)) * X saturate.
  Both are evaluated exactly on the float32 bits (a floating log2 is off by one near powers of
  two); e is clamped to the E8M0 range [-127, 127].
* An all-zero block gets the smallest scale 2^-127 (code 0). A block holding a NaN or an Inf gets
  the NaN scale (code 0xFF) and every element of it is the FP8 NaN code 0x7F, so the block
  dequantises to NaN whichever part a consumer reads.

All bit manipulation is integer arithmetic on the float32 bit pattern: XLA on CPU flushes float32
subnormals to zero in floating arithmetic, and integer arithmetic is exact on every backend, which
is what makes the XLA and Triton quantisers bit-identical.

Shapes: `quantize(x [..., L, ...], axis)` -> values (x's shape, FP8) and scales (x's shape with
L replaced by L / 32, E8M0). L must be a multiple of 32 unless `pad=True`, which quantises as if x
were zero-padded to a multiple of 32 (zeros do not change a block's amax) and returns values of
the original length with ceil(L / 32) scales; `dequantize` accepts that pair.

`mx_dot(a [..., M, K], b [K, N])` -> [..., M, N] is the MXFP8 GEMM with a `jax.custom_vjp`: every
product quantises both operands along its own contracting axis, from the high-precision tensors
(the backward pass re-quantises the saved a and b; it never transposes quantised data):

    y  = Q(a along K) @ Q(b along K)
    dA = Q(dy along N) @ Q(b along N)^T
    dB = Q(a along M)^T @ Q(dy along M)            (M = the flattened leading axes of a)

A contracting axis that is not a multiple of 32 (K, N or M, in the product that contracts it) is
zero-padded to one first; zero rows and columns add nothing to a product and do not change any
other block's scale. Accumulation is float32.

Faces (ARCHITECTURE "Kernels: one op, three faces"):
* `quantize` / `dequantize` / `mx_dot(impl="xla")` - jax.numpy; the GEMM is dequantise -> `jnp.dot`
  with float32 accumulation, the XLA emulation of what MX hardware computes;
* `quantize_triton` (one fused pass: block amax, scale, conversion) and `mx_matmul_triton`
  (`tl.dot_scaled` on Blackwell; on Ada/Hopper, which have no MX hardware (REFERENCE section 9), an
  FP8 `tl.dot` per 32-wide K block with the two scales applied to the float32 partial product - a
  correctness path; in the interpreter and on older GPUs the same with the tiles upcast to float32);
* `mx_dot(impl="auto")` - on a CUDA device `jax.nn.scaled_matmul` (cuDNN MXFP8) where the device
  is Blackwell or newer, else the Triton kernels; the XLA emulation elsewhere.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _triton
from kernels._triton import cdiv, tl, triton

BLOCK = 32
"""Elements per shared scale (fixed by the MX spec for MXFP8)."""

SCALE_RULES = ("rceil", "floor")


class _Elem(NamedTuple):
    dtype: type
    mbits: int  # stored mantissa bits
    bias: int  # exponent bias
    emax: int  # exponent of the largest normal
    max_code: int  # code of +max (448 / 57344): saturation target
    max_value: float


# Codes are the 7 magnitude bits; the sign is bit 7. E4M3FN has no inf (0x7F = NaN, 0x7E = 448);
# E5M2 is IEEE-like (0x7C = inf, 0x7B = 57344).
ELEMS = {
    "e4m3": _Elem(jnp.float8_e4m3fn, 3, 7, 8, 0x7E, 448.0),
    "e5m2": _Elem(jnp.float8_e5m2, 2, 15, 15, 0x7B, 57344.0),
}
_NAN_CODE = 0x7F  # a NaN in both element formats
_SCALE_NAN = 0xFF
_RCEIL_MANT = 0x600000  # the 23-bit mantissa of 1.75: 448 = 1.75 * 2^8 and 57344 = 1.75 * 2^15
_INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_options(scale_rule: str, elem: str) -> _Elem:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if elem not in ELEMS:
        raise ValueError(f"elem must be one of {tuple(ELEMS)}, got {elem!r}")
    return ELEMS[elem]


# ---------------------------------------------------------------------------------------------
# XLA face: integer arithmetic on int32 bit patterns
# ---------------------------------------------------------------------------------------------


def _floor_log2(mag):
    """floor(log2 v) and the 23-bit normalised mantissa of v > 0 finite, from its bits `mag`.

    A float32 subnormal has bits m = v * 2^149 < 2^23; converting the integer m to float32 is exact
    and its exponent field is floor(log2 m), its mantissa field m's normalised mantissa."""
    e_field = mag >> 23
    sub = lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.int32)
    fl = jnp.where(e_field > 0, e_field - 127, (sub >> 23) - 127 - 149)
    mant = jnp.where(e_field > 0, mag, sub) & 0x7FFFFF
    return fl, mant


def _rne_shift(m, sh):
    """round_half_even(m / 2^sh) for int32 0 <= m < 2^24; m * 2^-sh when sh < 0 (then exact)."""
    s = jnp.clip(sh, 0, 30)  # m < 2^24, so any shift >= 25 already gives 0 with rem < half
    n = m >> s
    rem = m & ((1 << s) - 1)
    half = (1 << s) >> 1
    up = (s > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1)))
    return jnp.where(sh < 0, m << jnp.clip(-sh, 0, 7), n + up.astype(jnp.int32))


def _scale_exponent(amax, scale_rule: str, el: _Elem):
    """E8M0 code (int32) of a block from the bits `amax` of its largest magnitude."""
    fl, mant = _floor_log2(amax)
    e = fl - el.emax
    if scale_rule == "rceil":
        # amax / max = (1.mant / 1.75) * 2^(fl - emax) with 1.mant / 1.75 in [4/7, 8/7): the ceil
        # of its log2 adds one exactly when 1.mant > 1.75.
        e = e + (mant > _RCEIL_MANT).astype(jnp.int32)
    code = jnp.clip(e, -127, 127) + 127
    code = jnp.where(amax == 0, 0, code)
    return jnp.where(amax >= 0x7F800000, _SCALE_NAN, code)


def _encode(bits, e, el: _Elem):
    """FP8 codes (int32) of x / 2^e, x given by its float32 bits, e broadcastable (finite x)."""
    mag = bits & 0x7FFFFFFF
    fl, _ = _floor_log2(mag)
    e_field = mag >> 23
    m = jnp.where(e_field > 0, (mag & 0x7FFFFF) | 0x800000, mag)  # x = m * 2^p
    p = jnp.maximum(e_field, 1) - 150
    # Exponent of y = x / 2^e, and of y's quantum: 2^(ey - mbits) for normals, the fixed subnormal
    # quantum 2^(1 - bias - mbits) below the smallest normal.
    ey = jnp.maximum(fl - e, 1 - el.bias)
    n = _rne_shift(m, ey - el.mbits + e - p)
    # Normal: code = (ey + bias) << mbits | (n - 2^mbits); rounding up to n = 2^(mbits+1) carries into
    # the exponent by itself, and a subnormal rounding up to 2^mbits becomes the smallest normal.
    code = ((ey + el.bias - 1) << el.mbits) + n
    code = jnp.where(mag == 0, 0, jnp.minimum(code, el.max_code))
    return code | jnp.where(bits < 0, 0x80, 0)


def _to_f32_bits(x):
    """int32 float32 bit patterns of x (float32 / bfloat16 / float16), exactly, subnormals included."""
    if x.dtype == jnp.bfloat16:
        # bfloat16 is the top half of float32: shifting the bits cannot flush a subnormal.
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _normalise_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def quantize(x, axis: int = -1, *, scale_rule: str = "rceil", elem: str = "e4m3", pad: bool = False):
    """MX-quantise x in blocks of 32 consecutive elements along `axis` (module docstring).

    x: float32, bfloat16 or float16 (the arithmetic is exact, on the float32 bits).
    Returns (values, scales): values has x's shape in `float8_e4m3fn` (elem "e4m3") or
    `float8_e5m2` (elem "e5m2"); scales is `float8_e8m0fnu` with the `axis` dimension divided by 32
    (ceil-divided with `pad=True`). Raises ValueError when the axis length is not a multiple of 32
    and `pad` is False.
    """
    _check_options(scale_rule, elem)
    x = jnp.asarray(x)
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"quantize takes float32, bfloat16 or float16 input, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("quantize needs an array of rank >= 1")
    axis = _normalise_axis(axis, x.ndim)
    length = x.shape[axis]
    if length % BLOCK and not pad:
        raise ValueError(
            f"the quantised axis ({axis}) has length {length}, which is not a multiple of the MX block size "
            f"{BLOCK}; pass pad=True to zero-pad it"
        )
    return _quantize(x, axis, scale_rule, elem)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize(x, axis: int, scale_rule: str, elem: str):
    el = ELEMS[elem]
    length = x.shape[axis]
    nb = cdiv(length, BLOCK)
    bits = jnp.moveaxis(_to_f32_bits(x), axis, -1)
    bits = jnp.pad(bits, [(0, 0)] * (x.ndim - 1) + [(0, nb * BLOCK - length)])
    bits = bits.reshape(*bits.shape[:-1], nb, BLOCK)
    amax = jnp.max(bits & 0x7FFFFFFF, axis=-1)  # non-negative int32 order = magnitude order
    scale_code = _scale_exponent(amax, scale_rule, el)
    code = _encode(bits, scale_code[..., None] - 127, el)
    code = jnp.where((scale_code == _SCALE_NAN)[..., None], _NAN_CODE, code)
    code = code.reshape(*code.shape[:-2], nb * BLOCK)[..., :length]
    values = lax.bitcast_convert_type(code.astype(jnp.uint8), el.dtype)
    scales = lax.bitcast_convert_type(scale_code.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return jnp.moveaxis(values, -1, axis), jnp.moveaxis(scales, -1, axis)


def _elem_of(dtype) -> _Elem:
    for el in ELEMS.values():
        if jnp.dtype(dtype) == jnp.dtype(el.dtype):
            return el
    raise ValueError(f"values must be float8_e4m3fn or float8_e5m2, got {dtype}")


def _ldexp_exact(v, e):
    """v * 2^e for float32 v (normal or zero; inf/nan pass through) and int32 e, exact up to the
    float32 subnormal rounding (round-half-even), computed on the bits so no flush to zero occurs."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    mag = bits & 0x7FFFFFFF
    e_field = mag >> 23
    new_e = e_field + e
    normal = (mag & 0x7FFFFF) | (new_e << 23)
    m = (mag & 0x7FFFFF) | 0x800000
    sub = _rne_shift(m, jnp.clip(1 - new_e, 0, 30))  # a carry to 2^23 is the smallest normal's bits
    out = jnp.where(new_e >= 1, normal, sub)
    out = jnp.where(new_e >= 255, 0x7F800000, out)
    out = jnp.where((e_field == 0) | (e_field == 255), mag, out)  # zero (fp8 values are f32 normals), inf, nan
    out = out | (bits & jnp.int32(-(2**31)))
    return lax.bitcast_convert_type(out, jnp.float32)


def dequantize(values, scales, axis: int = -1, dtype=jnp.float32):
    """values * 2^scale per block of 32 along `axis` (NaN scale -> NaN), returned in `dtype`.

    values: FP8 (E4M3 or E5M2); scales: E8M0 with the `axis` dimension equal to ceil(L / 32) for
    an axis length L of values (L need not be a multiple of 32: the output of `quantize(pad=True)`).
    """
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    _elem_of(values.dtype)
    if scales.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"scales must be float8_e8m0fnu, got {scales.dtype}")
    if values.ndim != scales.ndim:
        raise ValueError(f"values and scales must have the same rank, got {values.shape} and {scales.shape}")
    axis = _normalise_axis(axis, values.ndim)
    length = values.shape[axis]
    nb = cdiv(length, BLOCK)
    want = values.shape[:axis] + (nb,) + values.shape[axis + 1:]
    if scales.shape != want:
        raise ValueError(
            f"scales for values {values.shape} along axis {axis} must have shape {want}, got {scales.shape}"
        )
    return _dequantize(values, scales, axis, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequantize(values, scales, axis: int, dtype):
    length = values.shape[axis]
    nb = cdiv(length, BLOCK)
    v = jnp.moveaxis(values.astype(jnp.float32), axis, -1)  # fp8 -> float32 is exact (all normals)
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, nb * BLOCK - length)]).reshape(*v.shape[:-1], nb, BLOCK)
    s = jnp.moveaxis(lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32), axis, -1)[..., None]
    out = _ldexp_exact(v, s - 127)
    out = jnp.where(s == _SCALE_NAN, jnp.nan, out)
    out = out.reshape(*out.shape[:-2], nb * BLOCK)[..., :length]
    return jnp.moveaxis(out, -1, axis).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Triton face
# ---------------------------------------------------------------------------------------------

if _triton.HAVE_TRITON:

    @triton.jit
    def _tl_floor_log2(mag):
        e_field = mag >> 23
        sub = mag.to(tl.float32).to(tl.int32, bitcast=True)
        fl = tl.where(e_field > 0, e_field - 127, (sub >> 23) - 276)
        mant = tl.where(e_field > 0, mag, sub) & 0x7FFFFF
        return fl, mant

    @triton.jit
    def _tl_rne_shift(m, sh):
        s = tl.minimum(tl.maximum(sh, 0), 30)
        n = m >> s
        rem = m & ((1 << s) - 1)
        half = (1 << s) >> 1
        up = (s > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1)))
        return tl.where(sh < 0, m << tl.minimum(tl.maximum(-sh, 0), 7), n + up.to(tl.int32))

    @triton.jit
    def _quantize_kernel(
        x_ptr, R, C, v_ptr, s_ptr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RCEIL: tl.constexpr,
        MBITS: tl.constexpr, BIAS: tl.constexpr, EMAX: tl.constexpr, MAX_CODE: tl.constexpr,
    ):
        """One [BLOCK_R, BLOCK_C] tile of x [R, C] -> FP8 codes [R, C] and E8M0 codes [R, C / 32]."""
        NB: tl.constexpr = BLOCK_C // 32
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]  # R * C may exceed int32
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bits = tl.reshape(x.to(tl.int32, bitcast=True), (BLOCK_R, NB, 32))
        mag = bits & 0x7FFFFFFF
        amax = tl.max(mag, axis=2)

        fl, mant = _tl_floor_log2(amax)
        e = fl - EMAX
        if RCEIL:
            e = e + (mant > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -127), 127)
        e = tl.where(amax == 0, -127, e)
        is_nan = amax >= 0x7F800000
        scale_code = tl.where(is_nan, 255, e + 127)

        e3 = e[:, :, None]
        fl_x, _unused = _tl_floor_log2(mag)
        e_field = mag >> 23
        m = tl.where(e_field > 0, (mag & 0x7FFFFF) | 0x800000, mag)
        p = tl.maximum(e_field, 1) - 150
        ey = tl.maximum(fl_x - e3, 1 - BIAS)
        n = _tl_rne_shift(m, ey - MBITS + e3 - p)
        code = ((ey + BIAS - 1) << MBITS) + n
        code = tl.where(mag == 0, 0, tl.minimum(code, MAX_CODE))
        code = code | tl.where(bits < 0, 0x80, 0)
        code = tl.where(is_nan[:, :, None], 0x7F, code)
        tl.store(v_ptr + offs, tl.reshape(code, (BLOCK_R, BLOCK_C)).to(tl.uint8), mask=mask)

        scols = tl.program_id(1) * NB + tl.arange(0, NB)
        smask = (rows[:, None] < R) & (scols[None, :] < C // 32)
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * (C // 32) + scols[None, :], scale_code.to(tl.uint8), mask=smask)

    @triton.jit
    def _e8m0_to_f32(code):
        """float32 2^(code - 127); code 0 is the subnormal 2^-127, 255 is NaN."""
        c = code.to(tl.int32)
        bits = tl.where(c == 0, 0x00400000, c << 23)
        bits = tl.where(c == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_matmul_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, M, N, K, c_ptr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
        A_E5M2: tl.constexpr, B_E5M2: tl.constexpr,
    ):
        """c [M, N] = (a [M, K] * 2^as) @ (b [N, K] * 2^bs)^T, float32 accumulation.

        MODE 0: `tl.dot_scaled` (BLOCK_K any multiple of 32); MODE 1: FP8 `tl.dot` per 32-wide K
        block, scales applied to the float32 partial product; MODE 2: as 1 with the tiles upcast to
        float32. Modes 1 and 2 take BLOCK_K = 32. K is a multiple of 32."""
        A_TY: tl.constexpr = tl.float8e5 if A_E5M2 else tl.float8e4nv
        B_TY: tl.constexpr = tl.float8e5 if B_E5M2 else tl.float8e4nv
        A_FMT: tl.constexpr = "e5m2" if A_E5M2 else "e4m3"
        B_FMT: tl.constexpr = "e5m2" if B_E5M2 else "e4m3"
        KB = K // 32
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rm64[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0).to(A_TY, bitcast=True)
            # b is loaded as its [BLOCK_K, BLOCK_N] transpose, the layout both dots take.
            b = tl.load(b_ptr + rn64[None, :] * K + rk[:, None], mask=n_ok[None, :], other=0).to(B_TY, bitcast=True)
            if MODE == 0:
                rs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                sa = tl.load(as_ptr + rm64[:, None] * KB + rs[None, :], mask=m_ok[:, None], other=127)
                sb = tl.load(bs_ptr + rn64[:, None] * KB + rs[None, :], mask=n_ok[:, None], other=127)
                acc = tl.dot_scaled(a, sa, A_FMT, b, sb, B_FMT, acc)
            else:
                sa = _e8m0_to_f32(tl.load(as_ptr + rm64 * KB + k0 // 32, mask=m_ok, other=127))
                sb = _e8m0_to_f32(tl.load(bs_ptr + rn64 * KB + k0 // 32, mask=n_ok, other=127))
                if MODE == 1:
                    part = tl.dot(a, b)
                else:
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                acc += part * sa[:, None] * sb[None, :]
        tl.store(c_ptr + rm64[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def quantize_triton(x2d, *, scale_rule: str = "rceil", elem: str = "e4m3", block_rows: int = 16, block_cols: int = 64):
    """The fused Triton quantiser along the last axis of x2d [R, C] (C a multiple of 32).

    Bit-identical to `quantize(x2d, axis=-1, ...)`; returns (values [R, C], scales [R, C / 32])."""
    el = _check_options(scale_rule, elem)
    x2d = jnp.asarray(x2d)
    if x2d.ndim != 2:
        raise ValueError(f"quantize_triton takes a 2-D array, got shape {x2d.shape}")
    if x2d.dtype not in _INPUT_DTYPES:
        raise ValueError(f"quantize_triton takes float32, bfloat16 or float16 input, got {x2d.dtype}")
    R, C = x2d.shape
    if C % BLOCK:
        raise ValueError(f"the quantised (last) axis has length {C}, which is not a multiple of {BLOCK}")
    if block_cols % BLOCK:
        raise ValueError(f"block_cols must be a multiple of {BLOCK}, got {block_cols}")
    v, s = _triton.triton_call(
        x2d, R, C,
        kernel=_quantize_kernel,
        out_shape=(jax.ShapeDtypeStruct((R, C), jnp.uint8), jax.ShapeDtypeStruct((R, C // BLOCK), jnp.uint8)),
        grid=(cdiv(R, block_rows), cdiv(C, block_cols)),
        BLOCK_R=block_rows, BLOCK_C=block_cols, RCEIL=scale_rule == "rceil",
        MBITS=el.mbits, BIAS=el.bias, EMAX=el.emax, MAX_CODE=el.max_code,
    )
    return lax.bitcast_convert_type(v, el.dtype), lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def _compute_capability() -> tuple[int, int] | None:
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def _default_mode() -> int:
    """dot_scaled on Blackwell (sm_100+), FP8 dot on Ada/Hopper (sm_89+), else the float32 upcast."""
    if _triton.interpreting():
        return 2
    cc = _compute_capability()
    if cc is not None and cc >= (10, 0):
        return 0
    if cc is not None and cc >= (8, 9):
        return 1
    return 2


def mx_matmul_triton(a_vals, a_scales, b_vals, b_scales, *, mode: int | None = None, block_m: int = 32,
                     block_n: int = 32, block_k: int | None = None):
    """Block-scaled FP8 GEMM: (a_vals * 2^a_scales) @ (b_vals * 2^b_scales)^T in float32.

    a_vals [M, K], a_scales [M, K / 32]: a quantised along K (rows); b_vals [N, K], b_scales
    [N, K / 32]: b quantised along K, stored K-major (the layout of cuBLAS/cuDNN MX GEMMs and of
    `tl.dot_scaled`'s scales), i.e. `quantize(b_kn.T)` for a [K, N] operand. Returns [M, N] float32.
    `mode` picks the kernel path (see `_mx_matmul_kernel`); None chooses by device.
    """
    a_vals, b_vals, a_scales, b_scales = (jnp.asarray(t) for t in (a_vals, b_vals, a_scales, b_scales))
    ea, eb = _elem_of(a_vals.dtype), _elem_of(b_vals.dtype)
    if a_vals.ndim != 2 or b_vals.ndim != 2 or a_vals.shape[1] != b_vals.shape[1]:
        raise ValueError(f"mx_matmul_triton takes a [M, K] and b [N, K], got {a_vals.shape} and {b_vals.shape}")
    M, K = a_vals.shape
    N = b_vals.shape[0]
    if K % BLOCK:
        raise ValueError(f"K = {K} must be a multiple of {BLOCK}")
    for name, s, rows in (("a_scales", a_scales, M), ("b_scales", b_scales, N)):
        if s.dtype != jnp.float8_e8m0fnu or s.shape != (rows, K // BLOCK):
            raise ValueError(f"{name} must be float8_e8m0fnu of shape {(rows, K // BLOCK)}, got {s.dtype} {s.shape}")
    mode = _default_mode() if mode is None else mode
    if mode not in (0, 1, 2):
        raise ValueError(f"mode must be 0, 1 or 2, got {mode}")
    if mode == 0:
        block_k = block_k or max(b for b in (128, 64, 32) if K % b == 0)
    else:
        block_k = BLOCK
    if block_k % BLOCK or K % block_k:
        raise ValueError(f"block_k ({block_k}) must be a multiple of {BLOCK} dividing K ({K})")
    u8 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint8)
    return _triton.triton_call(
        u8(a_vals), u8(a_scales), u8(b_vals), u8(b_scales), M, N, K,
        kernel=_mx_matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(cdiv(M, block_m), cdiv(N, block_n)),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode,
        A_E5M2=ea.mbits == 2, B_E5M2=eb.mbits == 2,
    )


# ---------------------------------------------------------------------------------------------
# The GEMM with its custom VJP, and the dispatcher
# ---------------------------------------------------------------------------------------------


def _pad_rows_to_block(x, axis: int):
    extra = -x.shape[axis] % BLOCK
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _mx_product(lhs_pc, rhs_cq, elem: str, scale_rule: str, backend: str):
    """Q(lhs along C) @ Q(rhs along C) -> [P, Q] float32; C is zero-padded to a multiple of 32."""
    lhs_pc = _pad_rows_to_block(lhs_pc, 1)
    rhs_cq = _pad_rows_to_block(rhs_cq, 0)
    if backend == "xla":
        lv, ls = quantize(lhs_pc, axis=1, scale_rule=scale_rule, elem=elem)
        rv, rs = quantize(rhs_cq, axis=0, scale_rule=scale_rule, elem=elem)
        return jnp.dot(dequantize(lv, ls, axis=1), dequantize(rv, rs, axis=0), preferred_element_type=jnp.float32)
    # The kernels take the right operand K-major: quantise its (high-precision) transpose rowwise.
    if backend == "triton":
        lv, ls = quantize_triton(lhs_pc, scale_rule=scale_rule, elem=elem)
        rv, rs = quantize_triton(rhs_cq.T, scale_rule=scale_rule, elem=elem)
        return mx_matmul_triton(lv, ls, rv, rs)
    lv, ls = quantize(lhs_pc, axis=1, scale_rule=scale_rule, elem=elem)
    rv, rs = quantize(rhs_cq.T, axis=1, scale_rule=scale_rule, elem=elem)
    return jax.nn.scaled_matmul(lv[None], rv[None], ls[None], rs[None], preferred_element_type=jnp.float32)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _mx_dot_2d(a_mk, b_kn, elem, scale_rule, backend, out_dtype):
    return _mx_product(a_mk, b_kn, elem, scale_rule, backend).astype(out_dtype)


def _mx_dot_2d_fwd(a_mk, b_kn, elem, scale_rule, backend, out_dtype):
    # Residuals are the high-precision operands: the backward products re-quantise them along M and N.
    return _mx_dot_2d(a_mk, b_kn, elem, scale_rule, backend, out_dtype), (a_mk, b_kn)


def _mx_dot_2d_bwd(elem, scale_rule, backend, out_dtype, res, dy_mn):
    a_mk, b_kn = res
    da = _mx_product(dy_mn, b_kn.T, elem, scale_rule, backend)  # contracts N
    db = _mx_product(a_mk.T, dy_mn, elem, scale_rule, backend)  # contracts M (the tokens)
    return da.astype(a_mk.dtype), db.astype(b_kn.dtype)


_mx_dot_2d.defvjp(_mx_dot_2d_fwd, _mx_dot_2d_bwd)


def _backend(impl: str) -> str:
    """"xla", "triton" or "scaled_matmul" for `impl` on this process's default device."""
    triton_here = _triton.use_triton(impl)  # also validates impl
    if impl == "auto" and _triton.on_gpu() and hasattr(jax.nn, "scaled_matmul"):
        cc = _compute_capability()
        if cc is not None and cc >= (10, 0):  # cuDNN's MXFP8 GEMM needs Blackwell
            return "scaled_matmul"
    if not triton_here:
        return "xla"
    _triton.require()
    return "triton"


def mx_dot(a, b, *, precision_elem: str = "e4m3", scale_rule: str = "rceil", impl: str = "auto", out_dtype=None):
    """MXFP8 matmul a [..., M, K] @ b [K, N] -> [..., M, N] with the MX backward (module docstring).

    Forward quantises a along K and b along K; the backward re-quantises dy and the saved a, b along
    N (for dA) and along the flattened token axis M (for dB). Contracting axes that are not multiples
    of 32 are zero-padded internally. Accumulation is float32; the output is cast to `out_dtype`
    (default a.dtype) and the gradients to the dtypes of a and b.
    impl: "xla" (dequantise -> jnp.dot), "triton" (fused quantiser + block-scaled GEMM), or "auto"
    (on a CUDA device `jax.nn.scaled_matmul` on Blackwell, else Triton; XLA elsewhere).
    """
    _check_options(scale_rule, precision_elem)
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"mx_dot takes a [..., M, K] and b [K, N], got {a.shape} and {b.shape}")
    for name, x in (("a", a), ("b", b)):
        if x.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    return _mx_dot(a, b, precision_elem, scale_rule, _backend(impl), out_dtype)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _mx_dot(a, b, elem, scale_rule, backend, out_dtype):
    y = _mx_dot_2d(a.reshape(-1, a.shape[-1]), b, elem, scale_rule, backend, out_dtype)
    return y.reshape(*a.shape[:-1], b.shape[1])
