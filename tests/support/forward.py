"""The model's forward as a compiled program, for tests that compare against it.

Running a model eagerly compiles every operation it executes (hundreds of small XLA programs per
new shape); jitting the whole forward compiles one. `forward` caches the program per graph
definition, so a test calling it on many sequences pays one compile per shape.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from rlcode.models.attention import AttentionMask


def forward(model, tokens, positions=None, mask=AttentionMask(), return_kv=False):
    """`model(tokens, positions, mask, return_kv)` (a `ModelOutput`), jitted."""
    graphdef, state = nnx.split(model)
    return _forward(graphdef, return_kv, state, tokens, positions, mask)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, return_kv, state, tokens, positions, mask):
    return nnx.merge(graphdef, state)(tokens, positions, mask, return_kv=return_kv)
