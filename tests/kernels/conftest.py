"""The kernel tests launch Triton kernels as `kernels._triton.configure()` chooses by default: in
the interpreter unless jax's default backend is a CUDA GPU. The choice is made here, when pytest
loads this directory and before any of its test modules is collected (their skip marks ask
`_triton.available()`)."""

from kernels import _triton


def pytest_configure(config):
    _triton.configure()
