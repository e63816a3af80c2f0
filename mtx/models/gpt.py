"""GPT: vocab-parallel embedding + learned positions, a stack of pre-LN layers, final LN, tied output.

All methods run in the local view inside shard_map (see mtx/step.py). The logits stay split over "model"
(B, S, V / tp); the loss reduces B*S scalars through `vocab_parallel_cross_entropy`, never B*S*V logits.
With sequence parallelism the residual stream between `embed` and the head is split by rows over "model": `embed`
returns this rank's rows (B / tp, S, D), `transform` keeps them split, and the final LayerNorm runs on them before
the hidden states are gathered for the output layer.
Inference (mtx/generate.py) runs the same layers through `transform_cached`, with a per-layer KV cache scanned
alongside the layer parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.models.transformer import KVCache, TransformerLayer
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.mesh import PIPELINE
from mtx.parallel.layers import REPLICATED, LayerNorm, VocabParallelEmbedding, param
from mtx.parallel.ops import gather_from_model_parallel, sequence_parallel_rows, vary_like
from mtx.parallel.random import dropout, fold


_SAVED_PRIMITIVES = ("dot_product_attention_fwd", "psum", "all_gather", "reduce_scatter", "ppermute")


def save_matmul_outputs(prim, *args, **params) -> bool:
    """Remat policy of `--recompute-granularity matmuls`: save the outputs of the weight matmuls, of cuDNN's fused
    attention (its output and softmax statistics, which its backward needs) and of the `g` all-reduces; recompute the
    element-wise rest (LayerNorm, GeLU, bias adds, residual adds, dropout).

    The element-wise ops are cheap to recompute (memory-bound, fused into their neighbours), while each saved
    activation costs a write now and a read in the backward; the matmuls and attention are the FLOPs, and an
    all-reduce recomputed would be communication repeated (a row-parallel output is saved after its psum, so the
    backward adds none: tests/test_audit.py); so are sequence parallelism's all-gathers, reduce-scatters and ring
    steps (the gathered whole-batch inputs of the column-parallel matmuls stay alive for the backward: speed over
    SP's activation-memory saving, which `full` recomputation keeps). Without cuDNN the attention core's einsums have
    batch dimensions and are recomputed (as `selective` does).
    """
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or prim.name.startswith(_SAVED_PRIMITIVES))


@jax.custom_vjp
def _unstack(a_L):
    """(L, ...) -> L arrays (...), whose gradients are stacked back in one pass.

    (Plain indexing would transpose to L zero-padded (L, ...) gradients summed together.)"""
    return tuple(a_L[i] for i in range(a_L.shape[0]))


_unstack.defvjp(lambda a_L: (_unstack(a_L), None), lambda _, grads: (jnp.stack(grads),))


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, recompute: str | None = None, flash: bool = False,
                 scan_layers: bool = True, sp: str | None = None, rngs: nnx.Rngs):
        d, std = cfg.hidden_size, cfg.init_method_std
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, d, std=std, dtype=dtype, rngs=rngs)
        self.position_embeddings = param(rngs, (cfg.max_positions, d), (REPLICATED, REPLICATED), std=std)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: PIPELINE})
        def make_layers(rngs):  # stacked: every layer parameter gets a leading L axis, split into pipeline stages
            return TransformerLayer(cfg, dtype=dtype, rngs=rngs, selective_recompute=recompute == "selective",
                                    flash=flash, sp=sp)

        self.layers = make_layers(rngs)
        self.final_layernorm = LayerNorm(d, epsilon=cfg.layernorm_epsilon, dtype=dtype)
        self.hidden_dropout = cfg.hidden_dropout
        self.recompute = recompute
        self.scan_layers = scan_layers
        self.sp = sp  # sequence parallelism: None, "gather" or "overlap" (mtx/parallel/layers.py)
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size  # real ids; the padded ones take no probability in the loss

    def __call__(self, tokens_BS, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, D) final hidden states, replicated over "model".

        keys_B: one dropout key per sequence (mtx/parallel/random.py); None turns dropout off.
        """
        x_BSD = self.transform(self.embed(tokens_BS, keys_B=keys_B), mask_BS=mask_BS, keys_B=keys_B)
        return self.final_hidden(x_BSD)

    def embed(self, tokens_BS, *, keys_B=None, positions_BS=None):
        """(B, S) ids -> (B, S, D): token + position embeddings, then hidden dropout; with sequence parallelism this
        rank's rows (B / tp, S, D).

        positions_BS: each token's position (inference continues a sequence mid-way, never split); None means
        0 .. S - 1.
        """
        s = tokens_BS.shape[1]
        sp = self.sp if positions_BS is None else None
        if positions_BS is None:
            pos_SD = self.position_embeddings[:s]
        else:
            pos_SD = jnp.take(self.position_embeddings[...], positions_BS, axis=0)
        x_BSD = self.embedding(tokens_BS, sp=sp) + pos_SD.astype(self.dtype)
        if keys_B is not None and sp:
            keys_B = sequence_parallel_rows(keys_B)  # the keys of this rank's rows
        return dropout(x_BSD, self.hidden_dropout, None if keys_B is None else fold(keys_B, 0))

    def final_hidden(self, x_BSD):
        """Output of the layer stack -> final hidden states (B, S, D), replicated over "model": the final LayerNorm
        (on this rank's rows with sequence parallelism, which are then gathered)."""
        h_BSD = self.final_layernorm(x_BSD)
        return gather_from_model_parallel(h_BSD, axis=0) if self.sp else h_BSD

    def transform(self, x_BSD, *, mask_BS=None, keys_B=None, first_layer=0, active_L=None):
        """Runs the layers held in self.layers (all L, or one pipeline stage's) on (B, S, D).

        first_layer: global index of the first held layer (dropout keys follow the global layer index).
        active_L: optional bool per held layer; an inactive layer (stage padding) passes x through unchanged.
        """
        graphdef, stacked = nnx.split(self.layers)
        num_held = jax.tree.leaves(stacked)[0].shape[0]
        masked = active_L is not None

        def body(x_BSD, inputs):  # one compiled layer, run once per held layer
            layer_state, i, active = inputs
            layer_keys = None if keys_B is None else fold(keys_B, first_layer + i + 1)
            y_BSD = nnx.merge(graphdef, layer_state)(x_BSD, mask_BS=mask_BS, keys_B=layer_keys)
            return (jnp.where(active, y_BSD, x_BSD) if masked else y_BSD), None

        if self.recompute == "full":  # keep each layer's input only; recompute its activations in the backward
            body = jax.checkpoint(body)
        elif self.recompute == "matmuls":  # keep the matmuls' outputs; recompute LN, GeLU, bias adds, dropout
            body = jax.checkpoint(body, policy=save_matmul_outputs)
        active_L = active_L if masked else jnp.ones((num_held,), jnp.bool_)
        x_BSD = vary_like(x_BSD, stacked)  # the carry's type must not change inside the scan
        if self.scan_layers:
            x_BSD, _ = jax.lax.scan(body, x_BSD, (stacked, jnp.arange(num_held), active_L))
        else:  # unrolled: each layer's saved activations are buffers of their own, not slices of a stacked one
            per_layer = jax.tree.map(_unstack, stacked)
            for i in range(num_held):
                x_BSD, _ = body(x_BSD, (jax.tree.map(lambda parts: parts[i], per_layer,
                                                     is_leaf=lambda x: isinstance(x, tuple)), i, active_L[i]))
        return x_BSD

    def transform_cached(self, x_BTD, cache: KVCache, start_B, *, active_L=None, write=None):
        """Inference through the held layers with their KV caches: (B, T, D) new tokens at positions start_B + t,
        cache (held L, B, S_max, n_local, H) each -> ((B, T, D), updated cache).

        The cache is stacked per layer and scanned alongside the layer parameters (one compiled layer, as in
        `transform`). active_L as in `transform`; write: optional bool, False leaves the cache as it was (a pipeline
        stage off its tick).
        """
        graphdef, stacked = nnx.split(self.layers)
        num_held = jax.tree.leaves(stacked)[0].shape[0]
        masked = active_L is not None

        def body(x_BTD, inputs):
            layer_state, layer_cache, active = inputs
            y_BTD, layer_cache = nnx.merge(graphdef, layer_state).decode(x_BTD, layer_cache, start_B, write=write)
            return (jnp.where(active, y_BTD, x_BTD) if masked else y_BTD), layer_cache

        active_L = active_L if masked else jnp.ones((num_held,), jnp.bool_)
        x_BTD = vary_like(x_BTD, stacked)
        x_BTD, cache = jax.lax.scan(body, x_BTD, (stacked, cache, active_L))
        return x_BTD, cache

    def head_loss(self, x_BSD, targets_BS, *, label_smoothing: float = 0.0):
        """Final LN, tied output layer and vocab-parallel cross-entropy: (B, S, D) (this rank's B / tp rows with
        sequence parallelism) -> per-token loss (B, S) of all rows."""
        logits_BSV = self.embedding.attend(self.final_hidden(x_BSD))
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, label_smoothing=label_smoothing,
                                            vocab_size=self.vocab_size)

    def logits(self, tokens_BS, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, V / tp): this rank's slice of the logits of the tied output layer."""
        return self.embedding.attend(self(tokens_BS, mask_BS=mask_BS, keys_B=keys_B))

    def loss(self, tokens_BS, targets_BS, *, mask_BS=None, keys_B=None, label_smoothing: float = 0.0):
        """Per-token cross-entropy (B, S), float32, replicated over "model"."""
        logits_BSV = self.logits(tokens_BS, mask_BS=mask_BS, keys_B=keys_B)
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, label_smoothing=label_smoothing,
                                            vocab_size=self.vocab_size)
