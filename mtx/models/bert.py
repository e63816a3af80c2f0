"""BERT (paper section 4.2): the GPT machinery with bidirectional attention, token types, and two heads.

Embeddings: vocab-parallel token embedding (as GPT) + learned positions + token types (segment A = 0, B = 1).
Layers: the same layer stack as GPT (ParallelTransformer, mtx/models/stack.py), bidirectional, with padded keys
masked out. Two placements of LayerNorm (`--layernorm-placement`):
  pre  (the paper's): x + f(LN(x)) in every block, a final LayerNorm after the stack, no embedding LayerNorm;
  post (original BERT): LN(x + f(x)) in every block, a LayerNorm on the embeddings, no final LayerNorm.
Heads, both in the local view inside shard_map:
  MLM: dense D -> D, GeLU, LayerNorm, then logits tied to the vocab-parallel embedding plus an output bias split over
       "model" like the logits (B, S, V / tp); the loss is the vocab-parallel cross-entropy, never gathering logits.
  SOP (sentence-order prediction, following ALBERT): the [CLS] state through a pooler dense + tanh and a 2-way
       classifier; `--bert-no-binary-head` leaves it out.
The dense layers of the heads are small (D x D) and replicated, as in Megatron's BertLMHead and Pooler.
With sequence parallelism the embeddings and layers work on this rank's rows (B / tp, S, D) as GPT's do; the final
hidden states are gathered before the heads.
Dimension letters as in mtx/models/transformer.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.models.stack import ParallelTransformer
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.layers import REPLICATED, LayerNorm, VocabParallelEmbedding, param
from mtx.parallel.mesh import MODEL
from mtx.parallel.ops import gather_from_model_parallel, sequence_parallel_rows
from mtx.parallel.random import dropout, fold


class Dense(nnx.Module):
    """A replicated linear layer y = x W + b (every model rank holds all of W and computes the same y)."""

    def __init__(self, in_features: int, out_features: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (in_features, out_features), (REPLICATED, REPLICATED), std=std)
        self.bias = param(None, (out_features,), (REPLICATED,))
        self.dtype = dtype

    def __call__(self, x):
        return x.astype(self.dtype) @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


class BERT(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, recompute: str | None = None,
                 recompute_method: str | None = None, recompute_num_layers: int | None = None, flash: bool = False,
                 scan_layers: bool = True, sequence_parallel: bool = False, tp_comm_overlap: bool = False,
                 rngs: nnx.Rngs):
        d, std = cfg.hidden_size, cfg.init_method_std
        self.post_layernorm = cfg.layernorm_placement == "post"
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, d, std=std,
                                                sequence_parallel=sequence_parallel, dtype=dtype, rngs=rngs)
        self.position_embeddings = param(rngs, (cfg.max_positions, d), (REPLICATED, REPLICATED), std=std)
        self.tokentype_embeddings = (param(rngs, (cfg.tokentypes, d), (REPLICATED, REPLICATED), std=std)
                                     if cfg.tokentypes else None)
        self.embedding_layernorm = (LayerNorm(d, epsilon=cfg.epsilon, dtype=dtype)
                                    if self.post_layernorm else None)
        self.stack = ParallelTransformer(cfg, dtype=dtype, recompute=recompute, recompute_method=recompute_method,
                                         recompute_num_layers=recompute_num_layers, flash=flash,
                                         scan_layers=scan_layers, sequence_parallel=sequence_parallel,
                                         tp_comm_overlap=tp_comm_overlap,
                                         causal=False,
                                         post_layernorm=self.post_layernorm)
        self.layers = self.stack.build(rngs)  # stacked like GPT's: (L, ...) each, split into pipeline stages
        self.final_layernorm = (None if self.post_layernorm
                                else LayerNorm(d, epsilon=cfg.epsilon, dtype=dtype))
        # MLM head (Megatron's BertLMHead): dense + GeLU + LayerNorm, then the tied logits plus a vocab-split bias.
        self.lm_dense = Dense(d, d, std=std, dtype=dtype, rngs=rngs)
        self.lm_layernorm = LayerNorm(d, epsilon=cfg.epsilon, dtype=dtype)
        self.lm_bias = param(None, (cfg.padded_vocab_size,), (MODEL,))  # split over "model" like the logits
        if cfg.bert_binary_head:
            self.pooler = Dense(d, d, std=std, dtype=dtype, rngs=rngs)
            self.sop_head = Dense(d, 2, std=std, dtype=dtype, rngs=rngs)
        else:
            self.pooler = self.sop_head = None
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size

    def embed(self, tokens_BS, types_BS=None, *, keys_B=None):
        """(B, S) ids and token types -> (B, S, D): token + position + type embeddings, [LayerNorm,] dropout; with
        sequence parallelism this rank's rows (B / tp, S, D)."""
        s = tokens_BS.shape[1]
        types_BS = jnp.zeros_like(tokens_BS) if types_BS is None else types_BS
        if self.sequence_parallel:  # this rank's rows
            types_BS = sequence_parallel_rows(types_BS)
            keys_B = None if keys_B is None else sequence_parallel_rows(keys_B)
        x_BSD = self.embedding(tokens_BS) + self.position_embeddings[:s].astype(self.dtype)
        if self.tokentype_embeddings is not None:
            x_BSD = x_BSD + jnp.take(self.tokentype_embeddings[...], types_BS, axis=0).astype(self.dtype)
        if self.embedding_layernorm is not None:
            x_BSD = self.embedding_layernorm(x_BSD)
        return dropout(x_BSD, self.hidden_dropout, None if keys_B is None else fold(keys_B, 0))

    def transform(self, x_BSD, *, mask_BS=None, keys_B=None, first_layer=0, real_layers=None):
        """Runs the held layers on (B, S, D): see ParallelTransformer.__call__."""
        return self.stack(self.layers, x_BSD, mask_BS=mask_BS, keys_B=keys_B, first_layer=first_layer,
                          real_layers=real_layers)

    def final_hidden(self, x_BSD):
        """Output of the layer stack -> the final hidden states, replicated over "model" (the final LayerNorm of
        pre-LN, post-LN ends in one; sequence-parallel rows gathered)."""
        h_BSD = x_BSD if self.final_layernorm is None else self.final_layernorm(x_BSD)
        return gather_from_model_parallel(h_BSD, axis=0) if self.sequence_parallel else h_BSD

    def __call__(self, tokens_BS, types_BS=None, *, mask_BS=None, keys_B=None):
        """(B, S) ids -> (B, S, D) final hidden states, replicated over "model"."""
        x_BSD = self.transform(self.embed(tokens_BS, types_BS, keys_B=keys_B), mask_BS=mask_BS, keys_B=keys_B)
        return self.final_hidden(x_BSD)

    def lm_logits(self, h_BSD):
        """Final hidden states -> (B, S, V / tp): this rank's slice of the MLM logits (never gathered)."""
        y_BSD = self.lm_layernorm(jax.nn.gelu(self.lm_dense(h_BSD), approximate=False))
        return self.embedding.attend(y_BSD) + self.lm_bias[...].astype(self.dtype)

    def sop_logits(self, h_BSD):
        """Final hidden states -> (B, 2) sentence-order logits from the [CLS] position, float32."""
        return self.sop_head(jnp.tanh(self.pooler(h_BSD[:, 0]))).astype(jnp.float32)

    def head_losses(self, x_BSD, labels_BS, is_random_B, positions_BK=None):
        """Output of the layer stack -> per-token MLM loss (B, S) and per-sequence SOP loss (B,), float32.

        labels_BS: original ids at masked positions (anything elsewhere: the caller's loss mask drops it).
        is_random_B: 1 where segments A and B were swapped. Without the binary head the SOP loss is zeros.
        positions_BK: the MLM head runs only at these positions of each sequence (labels_BS is then (B, K), the
        labels there, and so is the MLM loss); None: at every position.
        """
        h_BSD = self.final_hidden(x_BSD)
        h_lm = h_BSD if positions_BK is None else jnp.take_along_axis(h_BSD, positions_BK[:, :, None], axis=1)
        mlm_BS = vocab_parallel_cross_entropy(self.lm_logits(h_lm), jnp.maximum(labels_BS, 0),
                                              vocab_size=self.vocab_size)
        if self.pooler is None:
            return mlm_BS, jnp.zeros(mlm_BS.shape[:1], jnp.float32)
        logits_B2 = self.sop_logits(h_BSD)
        target_B = jnp.take_along_axis(logits_B2, is_random_B.astype(jnp.int32)[:, None], axis=-1)[:, 0]
        return mlm_BS, jax.nn.logsumexp(logits_B2, axis=-1) - target_B
