"""The Triton launcher: the same @triton.jit source runs through the interpreter on CPU, as the
explicit `configure` choice says; importing the kernels sets nothing in the environment."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import _triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_SKIP = pytest.mark.skipif(_triton.available() is not None, reason=f"Triton unavailable: {_triton.available()}")

if _triton.HAVE_TRITON:
    tl = _triton.tl

    @_triton.triton.jit
    def _relu(x):
        return tl.maximum(x, 0.0)

    @_triton.triton.jit
    def _axpy_relu_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, _relu(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)

    @_triton.triton.jit
    def _axpy_kernel(x_ptr, y_ptr, n, alpha, out_ptr, sum_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        out = alpha * tl.load(x_ptr + offs, mask=m, other=0.0) + tl.load(y_ptr + offs, mask=m, other=0.0)
        tl.store(out_ptr + offs, out, mask=m)
        tl.atomic_add(sum_ptr, tl.sum(tl.where(m, out, 0.0), axis=0))

    @_triton.triton.jit
    def _matmul_kernel(a_ptr, b_ptr, M, N, K, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       IEEE: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:  # float32 products (a GPU's default for float32 inputs is TF32)
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _axpy(x, y, alpha, block=32):
    n = x.shape[0]
    return _triton.triton_call(
        x, y, n, alpha,
        kernel=_axpy_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.float32)),
        grid=lambda meta: (_triton.cdiv(n, meta["BLOCK"]),),
        BLOCK=block,
    )


@TRITON_SKIP
@pytest.mark.parametrize("n", [1, 31, 32, 100])
def test_add_matches_numpy_with_scalars_and_two_outputs(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    out, total = jax.jit(lambda a, b: _axpy(a, b, 2.5))(x, y)
    np.testing.assert_allclose(np.asarray(out), 2.5 * x + y, rtol=1e-6, atol=1e-6)
    # The sum output is zero-filled before the launch and accumulated over programs.
    np.testing.assert_allclose(float(total), float(np.sum(2.5 * x + y)), rtol=1e-5, atol=1e-5)


@TRITON_SKIP
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float16, 2e-2)])
@pytest.mark.parametrize("M,N,K", [(16, 16, 16), (70, 40, 50), (5, 33, 17)])
def test_matmul_matches_numpy(M, N, K, dtype, tol):
    rng = np.random.default_rng(M * N * K)
    a = rng.standard_normal((M, K)).astype(dtype)
    b = rng.standard_normal((K, N)).astype(dtype)
    c = _triton.triton_call(
        jnp.asarray(a), jnp.asarray(b), M, N, K,
        kernel=_matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(_triton.cdiv(M, 32), _triton.cdiv(N, 32)),
        BM=32, BN=32, BK=16, IEEE=dtype == np.float32,
    )
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(np.asarray(c), want, rtol=tol, atol=tol * np.sqrt(K))


@TRITON_SKIP
def test_vmap_runs_one_launch_per_row():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    out, total = jax.vmap(lambda a: _axpy(a, a, 1.0))(x)
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(x))
    np.testing.assert_allclose(np.asarray(total), 2 * np.asarray(x).sum(1))


@TRITON_SKIP
def test_dispatch_rule_and_bad_arguments():
    assert _triton.use_triton("xla") is False
    assert _triton.use_triton("triton") is True
    assert _triton.use_triton("auto") is (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="impl must be"):
        _triton.use_triton("cuda")
    with pytest.raises(ValueError, match="grid"):
        _triton.triton_call(jnp.ones(4), kernel=_axpy_kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(1, 1, 1, 1))


def test_importing_the_kernels_leaves_the_environment_alone():
    code = ("import os; before = dict(os.environ); "
            "import kernels, kernels._triton, kernels.flash, kernels.moe_gemm, kernels.mxfp8, kernels.nsa, kernels.squid; "
            "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)); "
            "assert not changed, changed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@TRITON_SKIP
def test_interpretation_is_the_configured_choice():
    before = _triton.interpreting()
    x = jnp.asarray([-2.0, -0.5, 0.0, 1.5, 3.0], jnp.float32)

    def relu(a):
        return _triton.triton_call(a, a.shape[0], kernel=_axpy_relu_kernel,
                                   out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), grid=(2,), BLOCK=4)

    try:
        # Interpreted on any backend when asked; the kernel's helper is interpreted with it.
        assert _triton.configure(interpret=True) is True and _triton.interpreting()
        assert _triton.available() is None and _triton.use_triton("auto") is False
        np.testing.assert_array_equal(np.asarray(relu(x)), np.maximum(np.asarray(x), 0))
        if not _triton.on_gpu():
            # Compiled needs a CUDA device: refused with the reason, never run interpreted instead.
            assert _triton.configure(interpret=False) is False and not _triton.interpreting()
            assert "CUDA" in _triton.available()
            with pytest.raises(RuntimeError, match="configure"):
                relu(x)
        assert _triton.configure() is (not _triton.on_gpu())
        with pytest.raises(TypeError):
            _triton.configure(interpret="yes")
    finally:
        _triton.configure(interpret=before)


def test_compiled_launch_passes_floats_as_float32_and_maps_vmap_to_one_launch_per_row(monkeypatch):
    """The jax-triton path (GPU only) checked on any machine with a stand-in for jax_triton that
    records what it is given: a Python float reaches it as float32 (jax-triton would make it a
    float64 kernel parameter), integers and bools unchanged, and under vmap it is called with one
    row at a time (jax-triton itself refuses vmap)."""
    import types

    seen = []

    def fake_triton_call(*args, kernel, out_shape, grid, num_warps, num_stages, zeroed_outputs, **constexprs):
        seen.append(dict(types=[type(a) for a in args], shapes=[getattr(a, "shape", None) for a in args],
                         zeroed=zeroed_outputs, constexprs=constexprs))
        alpha = float(args[2])
        # A callback without a batching rule, like jax-triton's primitive: vmap of it is an error.
        host = lambda x: (np.asarray(x) * np.float32(alpha), np.asarray(x).sum(keepdims=True).astype(np.float32))
        return list(jax.pure_callback(host, tuple(out_shape), args[0]))

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=fake_triton_call))
    outs = [jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)]

    def launch(x):
        return _triton._call_compiled((x, 4, 2.5, True), "kernel", outs, (1,), 4, 2, {"BLOCK": 4})

    x = jnp.arange(4, dtype=jnp.float32)
    y, total = launch(x)
    np.testing.assert_allclose(np.asarray(y), 2.5 * np.arange(4))
    assert seen[0]["types"][1:] == [int, np.float32, bool] and seen[0]["zeroed"] == (0, 1)
    assert seen[0]["constexprs"] == {"BLOCK": 4}
    seen.clear()
    xs = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    ys, totals = jax.jit(jax.vmap(launch))(xs)
    np.testing.assert_allclose(np.asarray(ys), 2.5 * np.asarray(xs))
    np.testing.assert_allclose(np.asarray(totals)[:, 0], np.asarray(xs).sum(1))
    assert seen and all(s["shapes"][0] == (4,) for s in seen)  # traced per row, never with the batch axis
