"""Model-parallel dropout randomness (paper appendix B.2).

Activations outside model-parallel regions (the residual stream, replicated on every model rank) must draw the SAME
dropout mask on every model rank, or the replicas drift apart. Activations inside model-parallel regions (each rank's
own heads) must draw a DIFFERENT mask per rank, or every shard would drop the same pattern. Both come from one key:
the replicated stream uses it as is, the model-parallel stream folds in the model rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtx.parallel.ops import model_rank


def model_parallel_key(key):
    """A key that differs per model rank, for dropout inside a model-parallel region."""
    return jax.random.fold_in(key, model_rank())


def dropout(x, rate: float, key, *, model_parallel: bool):
    """Inverted dropout; `key=None` or `rate=0` is the identity. `model_parallel` picks the per-rank stream."""
    if key is None or rate == 0.0:
        return x
    if model_parallel:
        key = model_parallel_key(key)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)
