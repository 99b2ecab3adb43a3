"""One way to launch a `@triton.jit` kernel from JAX, on a GPU or in the Triton interpreter.

`triton_call(*args, kernel=..., out_shape=..., grid=..., **constexprs)` follows the calling
convention of `jax_triton.triton_call`: the kernel's parameters are the array and scalar `args`
in order, then one pointer per output (outputs are zero-filled before the launch), then the
`constexprs` by keyword. `grid` is a tuple or a function of the constexprs.

* Compiled: the call goes to `jax_triton.triton_call` (imported lazily: it needs a GPU build of
  jax), compiled into the XLA program. Needs a CUDA device.
* Interpreted: the same kernel source runs in the Triton interpreter, one program instance at a
  time, inside `jax.pure_callback`. The interpreter expects torch-like tensors (`data_ptr`,
  `untyped_storage`, `stride`, ...); `_HostTensor` gives it those over a numpy array, so torch is
  not needed. This is how the kernels are tested on CPU; it is slow, so keep shapes small.

Which of the two is an explicit choice of the program, like Pallas's `interpret=`:
`configure(interpret)`, called once by an entry point (the experiment scripts, the kernel tests'
conftest) before the first launch. `interpret=None`, the default, means: interpret unless jax's
default backend is a CUDA GPU; a process that never calls `configure` gets that default too.
Importing this module or the kernel modules changes nothing in the process (no environment
variable is set) and the order of imports does not matter: triton is imported in its own default
(compiled) mode, so `@triton.jit` makes compiled-mode functions, and an interpreted launch runs
the kernel's Python source in the interpreter, with every `@triton.jit` function it calls (the
kernel's helpers, and the reductions of `triton.language`, which triton decorates when it is
imported) interpreted too for the duration of the launch (`_interpreted_device_calls`). Known
interpreter limit: `tl.dot` on bfloat16 operands is wrong, so interpreted tests use
float32/float16.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    import triton
    import triton.language as tl  # noqa: F401  (re-exported for kernel modules)

    HAVE_TRITON = True
except ImportError:  # no Linux wheel for this platform
    triton = None
    tl = None
    HAVE_TRITON = False

# The choice made by `configure`; None until it is called (then `interpreting` applies the default).
_INTERPRET: bool | None = None


def on_gpu() -> bool:
    """True when jax's default backend is a CUDA GPU."""
    return jax.default_backend() == "gpu"


def configure(interpret: bool | None = None) -> bool:
    """Choose how `triton_call` launches kernels in this process and return whether it interprets.

    True: in the Triton interpreter, on the host (any backend; slow). False: compiled through
    jax-triton (needs a CUDA device). None (the default): interpret unless jax's default backend
    is a CUDA GPU. The choice applies to launches traced afterwards (a function already jitted
    keeps the launch it was traced with).
    """
    global _INTERPRET
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None, got {interpret!r}")
    _INTERPRET = (not on_gpu()) if interpret is None else interpret
    return _INTERPRET


def interpreting() -> bool:
    """True when `triton_call` runs kernels in the interpreter: the `configure` choice, or its
    default (interpret unless jax's default backend is a CUDA GPU) when it was not called."""
    if not HAVE_TRITON:
        return False
    return (not on_gpu()) if _INTERPRET is None else _INTERPRET


def _imported_for_interpreter() -> bool:
    """True when triton was imported with TRITON_INTERPRET set, so its `@triton.jit` functions are
    interpreter functions, which cannot be compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def available() -> str | None:
    """None when `triton_call` can run here as configured, else the reason it cannot."""
    if not HAVE_TRITON:
        return "triton is not installed (pip install -e '.[triton]' on Linux, where it has wheels)"
    if interpreting():
        return None
    if not on_gpu():
        return ("the kernels are configured to run compiled (configure(interpret=False)) but jax's default "
                "backend is not a CUDA GPU; configure(interpret=True) runs them in the interpreter")
    if _imported_for_interpreter():
        return "triton was imported with TRITON_INTERPRET set, so its functions cannot be compiled; unset it"
    if importlib.util.find_spec("jax_triton") is None:
        return "jax-triton is not installed (pip install -e '.[gpu]')"
    return None


def require() -> None:
    """Raise a RuntimeError naming the reason when Triton kernels cannot run here."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"Triton kernels are unavailable: {reason}")


def use_triton(impl: str) -> bool:
    """The dispatch rule of every op: `auto` = Triton compiled on a CUDA device, XLA elsewhere
    (auto never picks the interpreter)."""
    if impl not in ("auto", "xla", "triton"):
        raise ValueError(f"impl must be 'auto', 'xla' or 'triton', got {impl!r}")
    if impl == "auto":
        return on_gpu() and not interpreting() and available() is None
    return impl == "triton"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _HostStorage:
    """The `untyped_storage()` of a `_HostTensor`: already on the host, so copies are no-ops."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def cpu(self) -> "_HostStorage":
        return self

    def copy_(self, other: "_HostStorage") -> None:
        if other.data_ptr() != self.data_ptr():
            raise RuntimeError("host tensors are expected to be shared with the interpreter, not copied")


class _DType:
    """A dtype whose str() is the name Triton canonicalises (float32, bfloat16, float8_e4m3fn, ...).

    Equal and hashed by name: Triton caches argument types under hash(dtype) without keeping the
    object alive, so an identity hash could be reused by a later object of another dtype."""

    def __init__(self, dtype: np.dtype):
        self.name = np.dtype(dtype).name

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, _DType) and other.name == self.name


class _HostTensor:
    """A contiguous numpy array in the shape of the torch tensor the interpreter expects."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("interpreted kernels take C-contiguous arrays")
        self.array = array
        self.dtype = _DType(array.dtype)

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self.array)

    def new_empty(self, *args, **kwargs) -> "_HostTensor":
        return self

    def set_(self, storage, offset, size, stride) -> "_HostTensor":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


def _as_shape_dtypes(out_shape) -> tuple[list[jax.ShapeDtypeStruct], bool]:
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)
    return [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes], single


def _resolve_grid(grid, constexprs: dict[str, Any]) -> tuple[int, ...]:
    g = grid(constexprs) if callable(grid) else grid
    g = (g,) if isinstance(g, int) else tuple(int(x) for x in g)
    if not 1 <= len(g) <= 3 or any(x < 0 for x in g):
        raise ValueError(f"grid must be 1 to 3 non-negative sizes, got {g}")
    return g


@functools.lru_cache(maxsize=None)
def _interpreter_function(fn: Callable) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _interpreted(kernel) -> Any:
    """The interpreter function of a `@triton.jit` kernel (cached by its Python function: hashing
    a compiled-mode function walks its dependencies)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    return _interpreter_function(kernel.fn)


def _call_interpreted(jit_function, *args, **kwargs):
    return _interpreted(jit_function)(*args, **kwargs)


@contextlib.contextmanager
def _interpreted_device_calls():
    """While it is open, calling a compiled-mode `@triton.jit` function runs it in the interpreter.

    Inside a kernel running in the interpreter, a call to another `@triton.jit` function (a
    helper, or `tl.sum`, `tl.max`, ... which triton decorates when it is imported) is a plain
    Python call, and a compiled-mode function refuses it ("outside of the scope of a kernel"); an
    interpreter function runs the callee's source in the interpreter, which is what triton does
    everywhere when it is imported with TRITON_INTERPRET set. The class attribute is swapped back
    on exit; launches hold `_INTERPRETER_LOCK`, and a compiled launch never calls a function this
    way, so nothing else sees the swap.
    """
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original


# The interpreter patches `triton.language` globally while a launch runs, so launches (from jax's
# callback threads) must not overlap.
_INTERPRETER_LOCK = threading.Lock()


def _run_interpreted(kernel, grid, constexprs, arg_kinds, scalars, outs, *host_arrays):
    tensors, it_arrays, it_scalars = [], iter(host_arrays), iter(scalars)
    for kind in arg_kinds:
        if kind == "array":
            tensors.append(_HostTensor(np.ascontiguousarray(np.array(next(it_arrays), copy=True))))
        else:
            tensors.append(next(it_scalars))
    results = [np.zeros(s.shape, s.dtype) for s in outs]
    tensors += [_HostTensor(r) for r in results]
    with _INTERPRETER_LOCK, _interpreted_device_calls():
        _interpreted(kernel)[grid](*tensors, **constexprs)
    return tuple(results)


def _call_compiled(args, kernel, outs, grid, num_warps, num_stages, constexprs) -> tuple:
    """The launch through jax-triton, with the interpreter's conventions kept.

    * A Python float argument is passed as float32, as Triton's own launcher and its interpreter
      pass it (jax-triton passes it as float64, which makes float64 arithmetic of everything it
      touches and fails to compile where it meets a float32 loop variable).
    * Under `jax.vmap` the kernel is launched once per row (`jax.custom_batching.sequential_vmap`,
      as the interpreted launch's callback does); jax-triton alone refuses to be batched.
    """
    import jax_triton

    args = tuple(np.float32(a) if isinstance(a, float) else a for a in args)
    positions = [i for i, a in enumerate(args) if not isinstance(a, (bool, int, np.float32))]

    def launch(*arrays):
        full = list(args)
        for i, a in zip(positions, arrays):
            full[i] = a
        return tuple(jax_triton.triton_call(
            *full, kernel=kernel, out_shape=outs, grid=grid, num_warps=num_warps, num_stages=num_stages,
            zeroed_outputs=tuple(range(len(outs))), **constexprs,
        ))

    return jax.custom_batching.sequential_vmap(launch)(*(args[i] for i in positions))


def triton_call(
    *args: jax.Array | int | float | bool,
    kernel: Any,
    out_shape: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    grid: int | tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]],
    num_warps: int = 4,
    num_stages: int = 2,
    **constexprs: Any,
):
    """Launch `kernel` over `grid`; returns the output array(s) (zero-filled before the launch).

    Python scalars among `args` become scalar kernel parameters (static: they are part of the
    compiled program); arrays become pointers.
    """
    require()
    outs, single = _as_shape_dtypes(out_shape)
    grid_t = _resolve_grid(grid, constexprs)
    if not interpreting():
        result = _call_compiled(args, kernel, outs, grid_t, num_warps, num_stages, constexprs)
        return result[0] if single else result
    arrays = [a for a in args if not isinstance(a, (bool, int, float))]
    kinds = tuple("scalar" if isinstance(a, (bool, int, float)) else "array" for a in args)
    scalars = tuple(a for a in args if isinstance(a, (bool, int, float)))
    callback = functools.partial(_run_interpreted, kernel, grid_t, dict(constexprs), kinds, scalars, tuple(outs))
    result = jax.pure_callback(callback, tuple(outs), *[jnp.asarray(a) for a in arrays], vmap_method="sequential")
    return result[0] if single else tuple(result)
