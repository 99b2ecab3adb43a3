"""The kernel tests launch Triton kernels as `kernels._triton.configure()` chooses by default: in
the interpreter unless jax's default backend is a CUDA GPU. The choice is made here, when pytest
loads this directory and before any of its test modules is collected (their skip marks ask
`_triton.available()`).

The XLA faces are tested in float32 against float64 oracles at float32 tolerances, so on a GPU
their matrix products run at full float32 precision: there XLA's default for float32 products is
TF32 (10 mantissa bits), which no such tolerance admits (on CPU the default is full precision
already, and the setting is left alone). The Triton kernels use full float32
products for float32 inputs themselves (their IEEE switch)."""

import jax

from kernels import _triton


def pytest_configure(config):
    _triton.configure()
    if _triton.on_gpu():
        jax.config.update("jax_default_matmul_precision", "highest")
