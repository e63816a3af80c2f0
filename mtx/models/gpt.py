"""GPT: vocab-parallel embedding + learned positions, a scanned stack of pre-LN layers, final LN, tied output.

All methods run in the local view inside shard_map (see mtx/step.py). The logits stay split over "model"
(B, S, V / tp); the loss reduces B*S scalars through `vocab_parallel_cross_entropy`, never B*S*V logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.models.transformer import TransformerLayer
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.layers import REPLICATED, LayerNorm, VocabParallelEmbedding, param
from mtx.parallel.random import dropout, fold


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, recompute: str | None = None, rngs: nnx.Rngs):
        d, std = cfg.hidden_size, cfg.init_method_std
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, d, std=std, dtype=dtype, rngs=rngs)
        self.position_embeddings = param(rngs, (cfg.max_positions, d), (REPLICATED, REPLICATED), std=std)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make_layers(rngs):  # stacked: every layer parameter gets a leading L axis (replicated here)
            return TransformerLayer(cfg, dtype=dtype, rngs=rngs, selective_recompute=recompute == "selective")

        self.layers = make_layers(rngs)
        self.final_layernorm = LayerNorm(d, epsilon=cfg.layernorm_epsilon, dtype=dtype)
        self.num_layers = cfg.num_layers
        self.hidden_dropout = cfg.hidden_dropout
        self.recompute_full = recompute == "full"
        self.dtype = dtype

    def __call__(self, tokens_BS, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, D) final hidden states, replicated over "model".

        keys_B: one dropout key per sequence (mtx/parallel/random.py); None turns dropout off.
        """
        s = tokens_BS.shape[1]
        x_BSD = self.embedding(tokens_BS) + self.position_embeddings[:s].astype(self.dtype)
        x_BSD = dropout(x_BSD, self.hidden_dropout, None if keys_B is None else fold(keys_B, 0))

        graphdef, stacked = nnx.split(self.layers)

        def body(x_BSD, inputs):  # one compiled layer, run L times
            layer_state, i = inputs
            layer_keys = None if keys_B is None else fold(keys_B, i + 1)
            return nnx.merge(graphdef, layer_state)(x_BSD, mask_BS=mask_BS, keys_B=layer_keys), None

        if self.recompute_full:  # keep each layer's input only; recompute its activations in the backward
            body = jax.checkpoint(body)
        x_BSD, _ = jax.lax.scan(body, x_BSD, (stacked, jnp.arange(self.num_layers)))
        return self.final_layernorm(x_BSD)

    def logits(self, tokens_BS, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, V / tp): this rank's slice of the logits of the tied output layer."""
        return self.embedding.attend(self(tokens_BS, mask_BS=mask_BS, keys_B=keys_B))

    def loss(self, tokens_BS, targets_BS, *, mask_BS=None, keys_B=None, label_smoothing: float = 0.0):
        """Per-token cross-entropy (B, S), float32, replicated over "model"."""
        logits_BSV = self.logits(tokens_BS, mask_BS=mask_BS, keys_B=keys_B)
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, label_smoothing=label_smoothing)
