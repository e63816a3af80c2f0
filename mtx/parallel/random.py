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

Masks come from a counter-based hash, not from the key's random stream: a key gives four words; `position_hashes`
hashes the row and the column indices of the masked slice under two of them each, and element (r, c) is kept when
the hash of rows[r] + cols[c] clears the rate (`attention_keep`). So a GPU kernel can draw attention dropout element
by element without storing the (S, S) mask (mtx/kernels/flash_attention.py), XLA's attention draws the same masks,
and hidden dropout is integer arithmetic fused into its multiply.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mtx.parallel.mesh import DATA
from mtx.parallel.ops import model_rank


def fold(keys, data):
    """Keys folded with uint32 data (a scalar, or an array that broadcasts against the keys): a new key for each,
    by hashing the key's words with the data (`_hash_words`; no threefry program, which each fold_in would add)."""
    words = jax.random.key_data(keys)
    data = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), keys.shape)
    return jax.random.wrap_key_data(_hash_words(words, data, words.shape[-1]), impl=jax.random.key_impl(keys))


def sample_keys(key, first: int | jax.Array, count: int):
    """Keys of the `count` sequences at global batch positions first, first + 1, ... (one key per sequence)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(first + jnp.arange(count, dtype=jnp.uint32))


def step_key(seed: int, step):
    """The training step's key, from which every sequence's is folded (`rank_sample_keys`)."""
    return jax.random.fold_in(jax.random.key(seed), step)


def rank_sample_keys(key, rows: int, first: int | jax.Array, count: int):
    """Inside shard_map: the keys of `count` of this data rank's `rows` sequences from its row `first` on, keyed by
    their global batch position (the rank's first row is row `rank x rows`), not by the rank."""
    return sample_keys(key, jax.lax.axis_index(DATA) * rows + first, count)


def model_parallel_keys(keys_B, n_local: int):
    """(B,) sequence keys -> (B, n_local) keys of this rank's heads, folded with each head's global index."""
    heads = model_rank() * n_local + jnp.arange(n_local, dtype=jnp.uint32)
    return fold(jnp.broadcast_to(keys_B[:, None], (keys_B.shape[0], n_local)), heads[None, :])


def dropout(x, rate: float, keys):
    """Inverted dropout; `keys` of shape x.shape[:k] each draw the mask of their slice. keys=None or rate=0 is the
    identity.

    The mask is the counter-based hash of `attention_keep` (as attention dropout's), over each slice seen as a
    matrix (all but its last dim, by its last dim): a few integer operations an element, which XLA fuses into the
    multiply."""
    if keys is None or rate == 0.0:
        return x
    rest = x.shape[keys.ndim:]
    return drop(x, rate, position_hashes(keys, math.prod(rest[:-1]), rest[-1] if rest else 1))


def drop(x, rate: float, hashes):
    """`dropout` with its (rows, cols) position hashes drawn already (K + (rows,) and K + (cols,), as
    `position_hashes` gives them; None or rate 0 is the identity): what is left to do per element."""
    if hashes is None or rate == 0.0:
        return x
    rows, cols = hashes
    keep = attention_keep(rows[..., :, None], cols[..., None, :], rate).reshape(x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def _mix(x):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def position_hashes(keys, rows: int, cols: int):
    """keys (any shape K) -> (rows, cols) hashes, K + (rows,) and K + (cols,) uint32: row and column indices hashed
    under two words of each key each."""
    words = _hash_words(jax.random.key_data(keys), jnp.zeros(keys.shape, jnp.uint32), 4)[..., None, :]
    row, col = jnp.arange(rows, dtype=jnp.uint32), jnp.arange(cols, dtype=jnp.uint32)
    return _mix(_mix(row ^ words[..., 0]) + words[..., 1]), _mix(_mix(col ^ words[..., 2]) + words[..., 3])


def _hash_words(words, data, count: int):
    """(K..., w) uint32 key words and (K...) uint32 data -> (K..., count) words, each chaining the data and a
    word-specific constant through every key word."""
    out = []
    for i in range(count):
        h = _mix(data ^ np.uint32((0x9E3779B9 * (i + 1)) % 2**32))
        for j in range(words.shape[-1]):
            h = _mix(h ^ words[..., j])
        out.append(h)
    return jnp.stack(out, axis=-1)


def attention_dropout_hashes(keys_BN, length: int):
    """(B, N) keys of (sequence, global head) -> (rows, cols), each (B, N, length) uint32: the query and the key
    positions hashed under the head's key."""
    return position_hashes(keys_BN, length, length)


def attention_keep(rows, cols, rate: float):
    """Which elements survive dropout at `rate`, for row and column hashes that broadcast against each other ((Q, 1)
    and (1, K)): the pair's mix against the rate as an unsigned 32-bit threshold (keep probability 1 - rate to
    2^-32). The mix is an xor-shift then a multiply: the hashes are already mixed, so it only has to make the sum's
    bits depend on each other nonlinearly, and the multiply carries every bit into the top ones that the threshold
    reads (this runs for every element, inside the attention kernel too; tests/test_flash_attention.py checks rows,
    neighbours and 2 x 2 squares drop as independent elements do)."""
    x = rows + cols
    x = x ^ (x >> 15)
    x = x * np.uint32(0x2C1B3C6D)
    return x >= np.uint32(min(round(rate * 2**32), 2**32 - 1))
