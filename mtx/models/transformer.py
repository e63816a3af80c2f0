"""The tensor-parallel transformer layer: self-attention and MLP, each one column- then one row-parallel linear.

Dimension alphabet (used in every name and einsum of mtx): B batch, S sequence (Q/K for query/key positions),
D model width, F MLP width, N heads, H head dim, V vocab, L layers, M microbatches, P pipeline stages.
Inside shard_map shapes are local: a rank holds n_local = N / tp heads and F / tp MLP columns.

Communication of one layer, read top to bottom: the attention's QKV projection starts with `f` and its output
projection ends with `g`; the MLP's first linear starts with `f` and its second ends with `g`. That is one all-reduce
forward (g) and one backward (f) per block, two of each per layer (paper Fig. 3).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.parallel.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from mtx.parallel.random import dropout, fold, model_parallel_keys


def attention_core(q_BSNH, k_BSNH, v_BSNH, *, mask_BS=None, dropout_rate=0.0, keys_B=None):
    """Causal softmax(Q K^T / sqrt(H)) V over this rank's heads; scores and softmax in float32.

    mask_BS marks real tokens (1) and padding (0); padded keys get no attention. Attention dropout acts on this
    rank's own heads, so each head draws from its own (model-parallel) key.
    """
    s, h = q_BSNH.shape[1], q_BSNH.shape[-1]
    scores_BNQK = jnp.einsum("bqnh,bknh->bnqk", q_BSNH, k_BSNH, preferred_element_type=jnp.float32)
    scores_BNQK = scores_BNQK / math.sqrt(h)
    allowed_QK = jnp.tril(jnp.ones((s, s), jnp.bool_))
    allowed = allowed_QK[None, None] if mask_BS is None else allowed_QK & (mask_BS[:, None, None, :] > 0)
    scores_BNQK = jnp.where(allowed, scores_BNQK, jnp.finfo(jnp.float32).min)
    probs_BNQK = jax.nn.softmax(scores_BNQK, axis=-1)
    if keys_B is not None:
        probs_BNQK = dropout(probs_BNQK, dropout_rate, model_parallel_keys(keys_B, probs_BNQK.shape[1]))
    return jnp.einsum("bnqk,bknh->bqnh", probs_BNQK.astype(v_BSNH.dtype), v_BSNH)


class ParallelSelfAttention(nnx.Module):
    """Fused QKV (column-parallel, so each rank owns whole heads), attention core, row-parallel output."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, selective_recompute: bool = False):
        d, std = cfg.hidden_size, cfg.init_method_std
        # Columns are ordered (N, 3, H): a contiguous split over ranks gives each rank the q, k and v of its heads.
        self.qkv = ColumnParallelLinear(d, 3 * d, std=std, dtype=dtype, rngs=rngs)
        self.proj = RowParallelLinear(d, d, std=std / math.sqrt(2 * cfg.num_layers), dtype=dtype, rngs=rngs)
        self.head_dim = cfg.head_dim
        self.dropout_rate = cfg.attention_dropout
        self.selective_recompute = selective_recompute

    def __call__(self, x_BSD, *, mask_BS=None, keys_B=None):
        b, s, _ = x_BSD.shape
        qkv = self.qkv(x_BSD).reshape(b, s, -1, 3, self.head_dim)  # (B, S, n_local, 3, H)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        core = functools.partial(attention_core, dropout_rate=self.dropout_rate)
        if self.selective_recompute:  # keep only the projections' activations; recompute the S x S part
            core = jax.checkpoint(core)
        ctx_BSNH = core(q, k, v, mask_BS=mask_BS, keys_B=keys_B)
        return self.proj(ctx_BSNH.reshape(b, s, -1))


class ParallelMLP(nnx.Module):
    """Column-parallel D -> F, GeLU, row-parallel F -> D.

    Column split first: GeLU is element-wise, so it commutes with the split and needs no all-reduce in between.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_method_std
        self.fc1 = ColumnParallelLinear(d, f, std=std, dtype=dtype, rngs=rngs)
        self.fc2 = RowParallelLinear(f, d, std=std / math.sqrt(2 * cfg.num_layers), dtype=dtype, rngs=rngs)

    def __call__(self, x_BSD):
        return self.fc2(jax.nn.gelu(self.fc1(x_BSD), approximate=True))


class TransformerLayer(nnx.Module):
    """Pre-LN block: x + drop(attn(LN(x))), then x + drop(mlp(LN(x))); the residual stream is replicated."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, selective_recompute: bool = False):
        self.ln1 = LayerNorm(cfg.hidden_size, epsilon=cfg.layernorm_epsilon, dtype=dtype)
        self.attention = ParallelSelfAttention(cfg, dtype=dtype, rngs=rngs, selective_recompute=selective_recompute)
        self.ln2 = LayerNorm(cfg.hidden_size, epsilon=cfg.layernorm_epsilon, dtype=dtype)
        self.mlp = ParallelMLP(cfg, dtype=dtype, rngs=rngs)
        self.dropout_rate = cfg.hidden_dropout

    def __call__(self, x_BSD, *, mask_BS=None, keys_B=None):
        """keys_B: one dropout key per sequence (None: no dropout)."""
        k_attn, k_res1, k_res2 = (None,) * 3 if keys_B is None else (fold(keys_B, i) for i in range(3))
        h = self.attention(self.ln1(x_BSD), mask_BS=mask_BS, keys_B=k_attn)
        # Residual-branch dropout acts on replicated values: the same mask on every model rank.
        x_BSD = x_BSD + dropout(h, self.dropout_rate, k_res1)
        h = self.mlp(self.ln2(x_BSD))
        return x_BSD + dropout(h, self.dropout_rate, k_res2)
