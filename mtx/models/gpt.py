"""GPT: vocab-parallel embedding + learned positions, a stack of pre-LN layers, final LN, tied output (GPT-2's
blocks; with Megatron-Core's flags Llama's: rotary positions inside the layers instead of the learned table, RMSNorm,
SwiGLU, grouped-query attention, no biases, an untied vocab-parallel output layer; mtx/architecture.py).

All methods run in the local view inside shard_map (see mtx/step.py). The logits stay split over "model"
(B, S, V / tp); the loss reduces B*S scalars through `vocab_parallel_cross_entropy`, never B*S*V logits.
With sequence parallelism the residual stream between `embed` and the head is split by rows over "model": `embed`
returns this rank's rows (B / tp, S, D), `transform` keeps them split, and the final LayerNorm runs on them before
the hidden states are gathered for the output layer.
The layer stack is a ParallelTransformer (mtx/models/stack.py), shared with BERT; inference (mtx/generate.py) runs
the same layers through `transform_cached`, with a per-layer KV cache scanned alongside the layer parameters.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.models.stack import ParallelTransformer
from mtx.models.transformer import KVCache
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.layers import REPLICATED, VocabParallelEmbedding, normalization, param
from mtx.parallel.ops import gather_from_model_parallel, sequence_parallel_rows
from mtx.parallel.random import dropout, fold


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, recompute: str | None = None,
                 recompute_method: str | None = None, recompute_num_layers: int | None = None, flash: bool = False,
                 scan_layers: bool = True, sequence_parallel: bool = False, tp_comm_overlap: bool = False,
                 rngs: nnx.Rngs):
        d, std = cfg.hidden_size, cfg.init_method_std
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, d, std=std,
                                                sequence_parallel=sequence_parallel, dtype=dtype, rngs=rngs)
        self.position_embeddings = (None if cfg.rope else  # rotary positions act inside attention instead
                                    param(rngs, (cfg.max_positions, d), (REPLICATED, REPLICATED), std=std))
        self.stack = ParallelTransformer(cfg, dtype=dtype, recompute=recompute, recompute_method=recompute_method,
                                         recompute_num_layers=recompute_num_layers, flash=flash,
                                         scan_layers=scan_layers, sequence_parallel=sequence_parallel,
                                         tp_comm_overlap=tp_comm_overlap)
        self.layers = self.stack.build(rngs)  # (L, ...) each, split into pipeline stages
        self.final_layernorm = normalization(cfg, d, dtype=dtype)
        # untied: a second vocab-parallel table, used only as the output layer (`attend`)
        self.output_layer = None if cfg.tied else VocabParallelEmbedding(cfg.padded_vocab_size, d, std=std,
                                                                         dtype=dtype, rngs=rngs)
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
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

        positions_BS: each token's position (inference continues a sequence mid-way; --reset-position-ids restarts
        them at each document); None means 0 .. S - 1. With sequence parallelism, this rank's rows of them are used.
        Learned positions only: rotary ones act inside each layer's attention (mtx/models/rotary.py).
        """
        x_BSD = self.embedding(tokens_BS)
        if self.position_embeddings is not None:
            x_BSD = x_BSD + self._positions(tokens_BS.shape[1], positions_BS).astype(self.dtype)
        if keys_B is not None and self.sequence_parallel:
            keys_B = sequence_parallel_rows(keys_B)  # the keys of this rank's rows
        return dropout(x_BSD, self.hidden_dropout, None if keys_B is None else fold(keys_B, 0))

    def _positions(self, s, positions_BS):
        """The learned position embeddings of 0 .. s - 1 (S, D), or of `positions_BS` (B, S, D) (this rank's rows of
        them with sequence parallelism)."""
        if positions_BS is None:
            return self.position_embeddings[:s]
        if self.sequence_parallel:  # the embedding returns this rank's rows
            positions_BS = sequence_parallel_rows(positions_BS)
        return jnp.take(self.position_embeddings[...], positions_BS, axis=0)

    def attend(self, h_BSD, *, pipeline_share: bool = False):
        """Final hidden states (B, S, D) -> this rank's vocabulary slice of the logits (B, S, V / tp), through the
        tied embedding or the untied output layer (see VocabParallelEmbedding.attend for `pipeline_share`)."""
        table = self.embedding if self.output_layer is None else self.output_layer
        return table.attend(h_BSD, pipeline_share=pipeline_share)

    def final_hidden(self, x_BSD):
        """Output of the layer stack -> final hidden states (B, S, D), replicated over "model": the final LayerNorm
        (on this rank's rows with sequence parallelism, which are then gathered)."""
        h_BSD = self.final_layernorm(x_BSD)
        return gather_from_model_parallel(h_BSD, axis=0) if self.sequence_parallel else h_BSD

    def transform(self, x_BSD, *, mask_BS=None, keys_B=None, first_layer=0, real_layers=None):
        """Runs the layers held in self.layers (all L, or one pipeline stage's) on (B, S, D): see
        ParallelTransformer.__call__."""
        return self.stack(self.layers, x_BSD, mask_BS=mask_BS, keys_B=keys_B, first_layer=first_layer,
                          real_layers=real_layers)

    def transform_cached(self, x_BTD, cache: KVCache, start_B, *, real_layers=None, write=None):
        """Inference through the held layers with their KV caches: see ParallelTransformer.decode."""
        return self.stack.decode(self.layers, x_BTD, cache, start_B, real_layers=real_layers, write=write)

    def head_loss(self, x_BSD, targets_BS, *, label_smoothing: float = 0.0, pipeline_share: bool = False):
        """Final LN, output layer and vocab-parallel cross-entropy: (B, S, D) (this rank's B / tp rows with
        sequence parallelism) -> per-token loss (B, S) of all rows. With `pipeline_share` each pipeline stage computes
        the logits of its 1 / P of the vocabulary (1F1B's head, mtx/parallel/one_f_one_b.py)."""
        logits_BSV = self.attend(self.final_hidden(x_BSD), pipeline_share=pipeline_share)
        return vocab_parallel_cross_entropy(logits_BSV, targets_BS, label_smoothing=label_smoothing,
                                            vocab_size=self.vocab_size, pipeline_share=pipeline_share)

    def logits(self, tokens_BS, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, V / tp): this rank's slice of the logits of the output layer."""
        return self.attend(self(tokens_BS, mask_BS=mask_BS, keys_B=keys_B))
