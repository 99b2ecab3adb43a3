"""Compute kernels: each op is an XLA reference, a Triton GPU kernel and a dispatcher."""
