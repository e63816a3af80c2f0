"""Model-parallel dropout randomness (paper appendix B.2), made independent of the mesh.

Activations outside model-parallel regions (the residual stream, replicated on every model rank) must draw the SAME
dropout mask on every model rank, or the replicas drift apart. Activations inside model-parallel regions (each rank's
own heads) must draw a DIFFERENT mask per rank, or every shard would drop the same pattern.

mtx goes one step further than Megatron's per-rank RNG tracker: every mask is keyed by what it masks, not by who
computes it. Each sequence of the global batch has its own key (from the seed, the step and its index in the global
batch); a replicated activation draws its mask from that key alone, and a head's activation folds in the head's
global index. Ranks holding different heads therefore draw different masks, replicas draw the same, and the masks
are the same on every mesh: dropout does not break mesh invariance, and a run resumes on any mesh exactly. With
sequence parallelism the residual stream is not replicated but split by rows: each rank holds whole sequences and
draws their masks from the same per-sequence keys, so nothing changes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtx.parallel.ops import model_rank


def fold(keys, data):
    """fold_in(key, data) for each key of an array of keys (data a scalar, or an array of the keys' shape)."""
    return jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(data, keys.shape).astype(jnp.uint32))


def sample_keys(key, first: int | jax.Array, count: int):
    """Keys of the `count` sequences at global batch positions first, first + 1, ... (one key per sequence)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(first + jnp.arange(count, dtype=jnp.uint32))


def model_parallel_keys(keys_B, n_local: int):
    """(B,) sequence keys -> (B, n_local) keys of this rank's heads, folded with each head's global index."""
    heads = model_rank() * n_local + jnp.arange(n_local, dtype=jnp.uint32)
    return jax.vmap(lambda k: jax.vmap(lambda h: jax.random.fold_in(k, h))(heads))(keys_B)


def dropout(x, rate: float, keys):
    """Inverted dropout; `keys` of shape x.shape[:k] each draw the mask of their slice. keys=None or rate=0 is the
    identity."""
    if keys is None or rate == 0.0:
        return x
    draw = functools.partial(_keep_mask, p=1.0 - rate, shape=x.shape[keys.ndim:])
    for _ in range(keys.ndim):
        draw = jax.vmap(draw)
    return jnp.where(draw(keys), x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def _keep_mask(key, *, p, shape):
    return jax.random.bernoulli(key, p, shape)
