"""rlcode: reinforcement learning for coding agents in JAX.

Definitions follow docs/reference.md; module docstrings cite the section they implement.
"""

__version__ = "0.1.0"


def _check_kernels_package() -> None:
    """This project ships a top-level package `kernels` beside `rlcode`; so does a third-party
    distribution of that name. Where the import system would find the other one, every kernel
    import would fail later with an unrelated message: say so now, naming both."""
    import importlib.util
    import os

    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "kernels")
    if not os.path.isfile(os.path.join(ours, "__init__.py")):
        return  # installed without its kernels, or inside a sandbox view that hides them
    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return
    found = [os.path.realpath(p) for p in (spec.submodule_search_locations or ())] if spec else []
    if spec is not None and found and ours not in found:
        raise ImportError(
            f"the package 'kernels' found first is {found[0]}, not this project's {ours}: another "
            "distribution of that name (e.g. `pip uninstall kernels`) shadows it; remove it or run "
            "from the checkout's root")


_check_kernels_package()
