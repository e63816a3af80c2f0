"""Text generation: sample continuations from a trained GPT on its training mesh.

Each new token runs the model on a fixed (1, S) window (one compiled program, no recompiles as the text grows). The
logits of the last position are gathered over "model" (V floats, not B*S*V) and sampled on device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.parallel.ops import gather_from_model_parallel


def make_next_token_fn(trainer, vocab_size: int, temperature: float = 1.0, top_k: int = 0):
    """Returns jitted (params, window_1S, position, key) -> next token id (sampled; greedy when temperature=0)."""

    def last_logits(params, window_1S, position):
        hidden_1SD = trainer.local_final_hidden(params, window_1S)
        hidden_D = jax.lax.dynamic_index_in_dim(hidden_1SD[0], position, keepdims=False)
        local_V = nnx.merge(trainer.graphdef, params).embedding.attend(hidden_D)  # this rank's vocab slice
        return gather_from_model_parallel(local_V.astype(jnp.float32))

    sharded = jax.shard_map(last_logits, mesh=trainer.mesh, in_specs=(trainer.param_specs, P(), P()),
                            out_specs=P())

    def next_token(params, window_1S, position, key):
        logits_V = sharded(trainer.stage_params(params), window_1S, position)
        logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < vocab_size, logits_V, -jnp.inf)  # no padding ids
        if temperature == 0.0:
            return jnp.argmax(logits_V)
        logits_V = logits_V / temperature
        if top_k:
            kth = jax.lax.top_k(logits_V, top_k)[0][-1]
            logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
        return jax.random.categorical(key, logits_V)

    return jax.jit(next_token)


def generate(trainer, params, prompt_ids: list[int], num_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> list[int]:
    """`prompt_ids` continued by `num_tokens` sampled ids (the window slides once the sequence length is full)."""
    cfg = trainer.cfg.model
    seq = cfg.seq_length
    next_token = make_next_token_fn(trainer, cfg.vocab_size, temperature, top_k)
    replicated = NamedSharding(trainer.mesh, P())
    ids = list(prompt_ids) or [0]
    key = jax.random.key(seed)
    for i in range(num_tokens):
        context = ids[-seq:]
        window = np.zeros((1, seq), np.int32)
        window[0, : len(context)] = context
        token = next_token(params, jax.device_put(window, replicated), len(context) - 1, jax.random.fold_in(key, i))
        ids.append(int(token))
    return ids
