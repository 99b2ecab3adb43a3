"""rlcode: reinforcement learning for coding agents in JAX.

Definitions follow docs/reference.md; module docstrings cite the section they implement.
"""

__version__ = "0.1.0"
