"""rlcode: reinforcement learning for coding agents in JAX.

Definitions follow REFERENCE.md of the project; module docstrings cite the section they implement.
"""

__version__ = "0.1.0"
