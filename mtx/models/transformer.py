"""The tensor-parallel transformer layer: self-attention and MLP, each one column- then one row-parallel linear.

Dimension alphabet (used in every name and einsum of mtx): B batch, S sequence (Q/K for query/key positions),
D model width, F MLP width, N heads, G key/value groups, H head dim, R rotary dims of a head, V vocab, L layers,
M microbatches, P pipeline stages; in inference, T new tokens of one step against a KV cache of S_max slots.
Inside shard_map shapes are local: a rank holds n_local = N / tp heads and F / tp MLP columns.

Communication of one layer, read top to bottom: the attention's QKV projection starts with `f` and its output
projection ends with `g`; the MLP's first linear starts with `f` and its second ends with `g`. That is one all-reduce
forward (g) and one backward (f) per block, two of each per layer (paper Fig. 3).

With sequence parallelism (`sequence_parallel`, mtx/parallel/layers.py) the layer's input and output are this rank's
rows (B / tp, S, D) of the residual stream: LayerNorm, dropout and the residual adds run on them only, `f` becomes an
all-gather and `g` a reduce-scatter (two of each per layer, forward and backward).

Llama's blocks (mtx/architecture.py) change what runs between the same collectives: rotary positions on q and k,
RMSNorm for LayerNorm, SwiGLU for GeLU (its gate and up columns split alike), grouped-query attention (query, key
and value kernels behind one `f`), linears without biases.

Inference (`decode`) runs the same weights on T new tokens with a KV cache of this rank's key/value heads (with
grouped-query attention its groups, not their copies per query head): the new keys and values are written into the
cache locally, so decoding adds no collective beyond the same two g's per layer.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.config import ModelConfig
from mtx.kernels import elementwise, gemm_epilogue
from mtx.kernels import flash_attention as flash_kernel
from mtx.models.rotary import apply_rotary
from mtx.parallel.layers import ColumnParallelLinear, RowParallelLinear, normalization
from mtx.parallel.ops import model_rank, model_size, sequence_parallel_rows
from mtx.parallel.random import (attention_dropout_hashes, attention_keep, drop, fold, model_parallel_keys,
                                 position_hashes)


def attention_core(q_BSNH, k_BSNH, v_BSNH, *, mask_BS=None, dropout_rate=0.0, hashes=None, causal=True):
    """Causal (or, with causal=False, bidirectional) softmax(Q K^T / sqrt(H)) V over this rank's heads; scores and
    softmax in float32.

    mask_BS: see `_segment_mask`. Attention dropout acts on this rank's own heads: `hashes` are the (rows, cols) of
    `_dropout_hashes`, drawn from each head's own (model-parallel) key; None is no dropout.
    """
    s, h = q_BSNH.shape[1], q_BSNH.shape[-1]
    scores_BNQK = jnp.einsum("bqnh,bknh->bnqk", q_BSNH, k_BSNH, preferred_element_type=jnp.float32)
    scores_BNQK = scores_BNQK / math.sqrt(h)
    allowed = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None] if causal else None
    if mask_BS is not None:
        keys_allowed = _segment_mask(mask_BS)
        allowed = keys_allowed if allowed is None else allowed & keys_allowed
    if allowed is not None:
        scores_BNQK = jnp.where(allowed, scores_BNQK, jnp.finfo(jnp.float32).min)
    probs_BNQK = jax.nn.softmax(scores_BNQK, axis=-1)
    if hashes is not None and dropout_rate > 0.0:
        rows_BNQ, cols_BNK = hashes
        keep_BNQK = attention_keep(rows_BNQ[..., :, None], cols_BNK[..., None, :], dropout_rate)
        probs_BNQK = jnp.where(keep_BNQK, probs_BNQK / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bnqk,bknh->bqnh", probs_BNQK.astype(v_BSNH.dtype), v_BSNH)


def _dropout_hashes(keys_B, heads: int, length: int):
    """The attention-dropout hashes ((B, n_local, S) rows and cols) of this rank's heads, from the sequences'
    keys folded with each head's global index: the same masks for a head whichever rank computes it."""
    return attention_dropout_hashes(model_parallel_keys(keys_B, heads), length)


class Draws(NamedTuple):
    """A layer's dropout masks as the position hashes they are drawn from ((rows, cols), or None where that site
    does not drop): the attention probabilities of this rank's heads ((B, n_local, S) each) and the two residual
    branches ((B, S) and (B, D), B this rank's rows with sequence parallelism)."""

    attention: tuple | None = None
    residual1: tuple | None = None
    residual2: tuple | None = None


def dropout_draws(cfg: ModelConfig, keys_B, length: int, *, sequence_parallel: bool = False) -> Draws:
    """A layer's Draws from its sequences' keys (the layer's fold of each sequence's key).

    Residual-branch dropout acts on the residual stream: the same mask on every rank that holds the sequence (all
    of them, or with sequence parallelism the one holding its row); attention dropout on whole rows, by head. The
    layer stack draws all its layers' at once (vmapped over the layers: one program for the L layers' hashes,
    where a layer's own draws made XLA's program more than twice as large, docs/benchmarks.md 8f)."""
    own_B = sequence_parallel_rows(keys_B) if sequence_parallel else keys_B
    heads = cfg.num_attention_heads // model_size()
    attention = _dropout_hashes(fold(keys_B, 0), heads, length) if cfg.attention_dropout > 0.0 else None
    residual = [position_hashes(fold(own_B, site), length, cfg.hidden_size) if cfg.hidden_dropout > 0.0 else None
                for site in (1, 2)]
    return Draws(attention, *residual)


def _segment_mask(mask_BS):
    """(B, S) segment ids -> (B, 1, Q, K) which keys each query may attend to: those of its own segment, never a 0
    (padding). BERT's 0/1 padding mask is the one-segment case; GPT's --reset-attention-mask numbers the packed
    documents 1, 2, ... (mtx/data/documents.py), which makes the causal mask block-diagonal. A padding query (0)
    sees every real key, as with a plain padding mask (its output is never used)."""
    q_BQ1, k_B1K = mask_BS[:, :, None], mask_BS[:, None, :]
    return ((k_B1K > 0) & ((k_B1K == q_BQ1) | (q_BQ1 == 0)))[:, None]


def fused_attention(q_BSNH, k_BSNH, v_BSNH, *, mask_BS=None, causal=True):
    """Causal (or bidirectional) attention through `jax.nn.dot_product_attention`: cuDNN's flash attention on GPU
    for bf16/fp16 (no S x S scores in memory), XLA's implementation elsewhere (the portable fallback). No dropout.

    BERT's padding mask (bidirectional, 0/1) goes in as each row's count of real keys: its real tokens are a prefix
    of the row (mtx/data/bert_dataset.py fills rows from the start), so "the first n keys" is exactly
    `_segment_mask`'s rule, padding queries included, and cuDNN takes it. Other masks (GPT's document ids) need the
    full (S, S) mask, which cuDNN's entry point does not take: XLA's implementation then."""
    half = q_BSNH.dtype in (jnp.bfloat16, jnp.float16)
    if mask_BS is not None and not causal:
        # At least one key: a row of padding alone (never read) must not divide by zero into NaN gradients.
        real_keys_B = jnp.maximum(jnp.sum(mask_BS > 0, axis=1, dtype=jnp.int32), 1)
        return jax.nn.dot_product_attention(q_BSNH, k_BSNH, v_BSNH, key_value_seq_lengths=real_keys_B,
                                            implementation="cudnn" if _gpu() and half else None)
    gpu = _gpu() and half and mask_BS is None
    mask = None if mask_BS is None else _segment_mask(mask_BS)
    return jax.nn.dot_product_attention(q_BSNH, k_BSNH, v_BSNH, mask=mask, is_causal=causal,
                                        implementation="cudnn" if gpu else None)


def _gpu() -> bool:
    return jax.default_backend() == "gpu"


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, (B, S_max, g, H) each for one layer (a leading layer axis when
    stacked), g = `local_kv_heads`: the key/value heads this rank computes, split over "model" exactly like the
    columns that produce them (grouped-query attention: its groups, N / G times fewer than its query heads)."""

    k: jax.Array
    v: jax.Array


def local_kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads of this rank (inside shard_map): its n_local = N / tp heads without grouping; with G groups,
    its G / tp groups when tp divides G, else (G < tp) the one group that all its heads use."""
    tp = model_size()
    if not cfg.group_query_attention:
        return cfg.num_attention_heads // tp
    return cfg.query_groups // tp if cfg.query_groups % tp == 0 else 1


def _repeat_groups(kv_BSGH, heads: int):
    """(B, S, g, H) keys or values of g groups -> (B, S, heads, H), each group repeated to its heads (query head j
    of this rank uses local group j // (heads / g))."""
    repeat = heads // kv_BSGH.shape[2]
    return jnp.repeat(kv_BSGH, repeat, axis=2) if repeat > 1 else kv_BSGH


def _cached_attention_core(q_BTNH, k_BSGH, v_BSGH, start_B):
    """Attention of T new queries at absolute positions start_B + t over a (B, S_max) cache of g key/value heads,
    in float32; the N query heads are viewed as (g, N / g), so each group's keys serve its heads without copies.

    Query t of row b may see cache slots 0 .. start_B[b] + t (its own position included); later slots hold stale
    keys or padding and are masked. With T = S_max and start_B = 0 this is `attention_core`'s causal mask.
    """
    (b, t, n, h), (s, g) = q_BTNH.shape, k_BSGH.shape[1:3]
    q_BTGNH = q_BTNH.reshape(b, t, g, n // g, h)  # N here: the heads of one group
    scores_BGNTS = jnp.einsum("btgnh,bsgh->bgnts", q_BTGNH, k_BSGH, preferred_element_type=jnp.float32)
    scores_BGNTS = scores_BGNTS / math.sqrt(h)
    allowed_BTS = jnp.arange(s)[None, None, :] <= (start_B[:, None] + jnp.arange(t)[None, :])[:, :, None]
    scores_BGNTS = jnp.where(allowed_BTS[:, None, None], scores_BGNTS, jnp.finfo(jnp.float32).min)
    probs_BGNTS = jax.nn.softmax(scores_BGNTS, axis=-1)
    ctx_BTGNH = jnp.einsum("bgnts,bsgh->btgnh", probs_BGNTS.astype(v_BSGH.dtype), v_BSGH)
    return ctx_BTGNH.reshape(b, t, n, h)


def _write_rows(cache_BSGH, new_BTGH, start_B, write=None):
    """Writes row b's T new entries at slots start_B[b] .. start_B[b] + T - 1 of the cache.

    write: optional bool (a pipeline stage that is not on its tick): False keeps the old entries (selecting among
    T slots per row, not the whole cache).
    """
    t = new_BTGH.shape[1]
    new_BTGH = new_BTGH.astype(cache_BSGH.dtype)
    if write is not None:
        old_BTGH = jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, t, axis=0))(cache_BSGH, start_B)
        new_BTGH = jnp.where(write, new_BTGH, old_BTGH)
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u, s, axis=0))(cache_BSGH, new_BTGH,
                                                                                            start_B)


class ParallelSelfAttention(nnx.Module):
    """QKV projection (column-parallel, so each rank owns whole heads), attention core, row-parallel output.

    Multi-head attention (GPT-2's) projects q, k and v with one fused kernel. Grouped-query attention
    (--group-query-attention) has G key/value heads, query head i using group i // (N / G), and three kernels that
    share one `f`: the query's split over "model" as always; the key's and value's split too when tp divides G (each
    rank holds the G / tp groups of its n_local heads), or, when G < tp, replicated with each rank computing only the
    one group its heads use (`replicated_groups`: their gradients are summed over "model" once per step, not per
    layer). Which of the two is decided by the mesh, inside shard_map: the parameters are the same on every mesh.
    Rotary positions (--position-embedding-type rope) rotate q and k of this rank's heads.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, selective_recompute: bool = False,
                 flash: bool = False, causal: bool = True, sequence_parallel: bool = False,
                 tp_comm_overlap: bool = False):
        d, h, std = cfg.hidden_size, cfg.head_dim, cfg.init_method_std
        linear = functools.partial(ColumnParallelLinear, std=std, use_bias=not cfg.disable_bias_linear,
                                   sequence_parallel=sequence_parallel, comm_overlap=tp_comm_overlap, dtype=dtype,
                                   rngs=rngs)
        self.grouped = cfg.group_query_attention
        if self.grouped:  # query columns (N, H); key and value columns (G, H)
            g = cfg.query_groups
            self.query, self.key, self.value = linear(d, d), linear(d, g * h, groups=g), linear(d, g * h, groups=g)
        else:  # columns ordered (N, 3, H): a contiguous split over ranks gives each rank the q, k, v of its heads
            self.qkv = linear(d, 3 * d, epilogues=cfg.gemm_epilogues)
        self.proj = RowParallelLinear(d, d, std=std / math.sqrt(2 * cfg.num_layers),
                                      use_bias=not cfg.disable_bias_linear, sequence_parallel=sequence_parallel,
                                      comm_overlap=tp_comm_overlap,
                                      dtype=dtype, rngs=rngs)
        self.head_dim = h
        self.groups, self.heads_per_group = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups
        self.rotary = (dict(rotary_dim=cfg.rotary_dim, base=cfg.rotary_base, scaling=cfg.rope_scaling)
                       if cfg.rope else None)
        self.dropout_rate = cfg.attention_dropout
        self.selective_recompute = selective_recompute
        self.flash = flash  # fused attention (--use-flash-attn): cuDNN, or mtx's kernel with attention dropout
        self.causal = causal  # False: every token attends to every (unpadded) token, as in BERT

    def __call__(self, x_BSD, *, mask_BS=None, hashes=None):
        """(B, S, D) -> (B, S, D), or this rank's rows (B / tp, S, D) with sequence parallelism; attention sees whole
        rows (at positions 0 .. S - 1). mask_BS and the dropout hashes (Draws.attention) cover the whole
        microbatch."""
        q, k, v = self._project(x_BSD, jnp.arange(x_BSD.shape[1]))
        k, v = (_repeat_groups(a, q.shape[2]) for a in (k, v))  # (B, S, n_local, H) each
        return self.proj(self._attend(q, k, v, mask_BS, hashes))

    def _project(self, x_BSD, positions):
        """x -> q (B, S, n_local, H) of this rank's heads, k and v (B, S, g, H) of its key/value heads (its groups
        with grouped-query attention, `local_kv_heads`) at `positions` ((S,) or (B, S)); q and k rotated with rope."""
        if self.grouped:
            q, k, v = self._grouped_qkv(x_BSD)
        else:
            q, k, v = self.qkv.split_call(x_BSD, 3, self.head_dim)
        if self.rotary is not None:
            q, k = (apply_rotary(a, positions, **self.rotary) for a in (q, k))
        return q, k, v

    def _grouped_qkv(self, x_BSD):
        """Grouped-query projections with one `f`: q (B, S, n_local, H); k and v (B, S, g, H), g = G / tp groups,
        or with replicated groups (G < tp) the one group of this rank's heads."""
        x = self.query.enter(x_BSD)
        b, s = x.shape[:2]
        q = self.query.local_call(x).reshape(b, s, -1, self.head_dim)
        if self.groups % model_size() == 0:  # split: this rank's G / tp groups
            return q, *(p.local_call(x).reshape(b, s, -1, self.head_dim) for p in (self.key, self.value))
        group = model_rank() * q.shape[2] // self.heads_per_group  # the group of this rank's first (and every) head
        start = group * self.head_dim
        return q, *(p.local_call(x, start, self.head_dim)[:, :, None] for p in (self.key, self.value))

    def _attend(self, q, k, v, mask_BS, hashes):
        """(B, S, n_local, H) q, k, v -> (B, S, n_local * H) context of this rank's heads."""
        b, s = q.shape[:2]
        rate = self.dropout_rate if hashes is not None else 0.0
        if self.flash and rate == 0.0:
            return fused_attention(q, k, v, mask_BS=mask_BS, causal=self.causal).reshape(b, s, -1)
        if self.flash and flash_kernel.usable(q, k, mask_BS, self.causal):  # dropout inside the kernel
            valid_BS = None if mask_BS is None else mask_BS > 0
            return flash_kernel.flash_attention(q, k, v, causal=self.causal, key_valid_BS=valid_BS, dropout_rate=rate,
                                                hashes=hashes).reshape(b, s, -1)
        core = functools.partial(attention_core, dropout_rate=rate, causal=self.causal)
        if self.selective_recompute:  # keep only the projections' activations; recompute the S x S part
            core = jax.checkpoint(core)
        return core(q, k, v, mask_BS=mask_BS, hashes=hashes).reshape(b, s, -1)

    def decode(self, x_BTD, cache: KVCache, start_B, *, write=None):
        """Inference with a KV cache: (B, T, D) new tokens at positions start_B + t -> ((B, T, D), updated cache).

        The new keys/values of this rank's key/value heads go into this rank's cache slice (no communication); the
        only collective is the output projection's g, as in training. No dropout. With grouped-query attention the
        cache holds the groups only, (B, S_max, g, H), and attention reads each group for its heads.
        """
        b, t, _ = x_BTD.shape
        q, k, v = self._project(x_BTD, start_B[:, None] + jnp.arange(t))  # q (B, T, n_local, H); k, v (B, T, g, H)
        cache = KVCache(_write_rows(cache.k, k, start_B, write), _write_rows(cache.v, v, start_B, write))
        ctx_BTNH = _cached_attention_core(q, cache.k, cache.v, start_B)
        return self.proj(ctx_BTNH.reshape(b, t, -1)), cache


class ParallelMLP(nnx.Module):
    """Column-parallel D -> F, GeLU, row-parallel F -> D; with --swiglu, silu(x W_gate) * (x W_up), then W_down.

    Column split first: GeLU is element-wise, so it commutes with the split and needs no all-reduce in between. So
    is SwiGLU's product when each rank holds the same columns of the gate and the up matrix: fc1's kernel is
    (D, 2, F), gate then up, split over "model" along F, and one `f` serves both matmuls.

    recompute_elementwise (--recompute-granularity matmuls): the epilogue MLP keeps only the matmul's output for the
    backward, the GeLU recomputed from it, as that policy does with autodiff's MLP (keeping both costs one (tokens, F)
    activation more a layer); in every layer, those --recompute-method leaves whole too (they share this module).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, sequence_parallel: bool = False,
                 tp_comm_overlap: bool = False, recompute_elementwise: bool = False):
        d, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_method_std
        bias = not cfg.disable_bias_linear
        self.swiglu = cfg.swiglu
        self.bias_gelu_fusion, self.bias_swiglu_fusion = cfg.bias_gelu_fusion, cfg.bias_swiglu_fusion
        self.gemm_epilogues = cfg.gemm_epilogues
        self.keep_gelu = not (cfg.bias_gelu_fusion or recompute_elementwise)  # the epilogue MLP's GeLU(h) kept
        self.fc1 = ColumnParallelLinear(d, f, std=std, use_bias=bias, parts=2 if cfg.swiglu else 1,
                                        sequence_parallel=sequence_parallel, comm_overlap=tp_comm_overlap,
                                        dtype=dtype, rngs=rngs)
        self.fc2 = RowParallelLinear(f, d, std=std / math.sqrt(2 * cfg.num_layers), use_bias=bias,
                                     sequence_parallel=sequence_parallel, comm_overlap=tp_comm_overlap, dtype=dtype,
                                     rngs=rngs)

    def __call__(self, x_BSD):
        if self.swiglu:
            gate_BSF, up_BSF = self.fc1.parts_call(x_BSD)
            if self.bias_swiglu_fusion:
                return self.fc2(elementwise.swiglu(gate_BSF, up_BSF))
            return self.fc2(jax.nn.silu(gate_BSF) * up_BSF)
        if self.gemm_epilogues and not self.fc1.comm_overlap:  # (the peer-memory kernels run their own matmuls)
            return self._epilogue_mlp(x_BSD)
        if self.bias_gelu_fusion:  # the bias add and GeLU in one function whose backward recomputes them from X A
            return self.fc2(elementwise.bias_gelu(*self.fc1(x_BSD, skip_bias_add=True)))
        return self.fc2(jax.nn.gelu(self.fc1(x_BSD), approximate=True))

    def _epilogue_mlp(self, x_BSD):
        """The same MLP with its bias + GeLU and their backward inside the matmuls (`gemm_epilogue.gelu_mlp`)."""
        dtype = self.fc1.dtype
        w1, w2 = self.fc1.kernel[...].astype(dtype), self.fc2.kernel[...].astype(dtype)
        b1 = jnp.zeros(w1.shape[1:], dtype) if self.fc1.bias is None else self.fc1.bias[...].astype(dtype)
        y = gemm_epilogue.gelu_mlp(self.fc1.enter(x_BSD), w1, b1, w2, self.keep_gelu)
        return self.fc2.reduce(y)


class TransformerLayer(nnx.Module):
    """Pre-LN block: x + drop(attn(LN(x))), then x + drop(mlp(LN(x))); the residual stream is replicated, or split
    by rows with sequence parallelism (mtx/parallel/layers.py).

    post_layernorm=True gives the original BERT/Transformer block instead, LN(x + drop(attn(x))) then
    LN(x + drop(mlp(x))), with the same parameters (paper section 4.2 compares the two); causal=False makes the
    attention bidirectional. LN is LayerNorm or RMSNorm (--normalization).
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, selective_recompute: bool = False,
                 flash: bool = False, causal: bool = True, post_layernorm: bool = False,
                 sequence_parallel: bool = False, tp_comm_overlap: bool = False, recompute_elementwise: bool = False):
        self.ln1 = normalization(cfg, cfg.hidden_size, dtype=dtype)
        self.attention = ParallelSelfAttention(cfg, dtype=dtype, rngs=rngs, selective_recompute=selective_recompute,
                                               flash=flash, causal=causal, sequence_parallel=sequence_parallel,
                                               tp_comm_overlap=tp_comm_overlap)
        self.ln2 = normalization(cfg, cfg.hidden_size, dtype=dtype)
        self.mlp = ParallelMLP(cfg, dtype=dtype, rngs=rngs, sequence_parallel=sequence_parallel,
                               tp_comm_overlap=tp_comm_overlap, recompute_elementwise=recompute_elementwise)
        self.dropout_rate = cfg.hidden_dropout
        self.post_layernorm = post_layernorm

    def __call__(self, x_BSD, *, mask_BS=None, draws: Draws | None = None):
        """draws: the layer's dropout (`dropout_draws`; None: no dropout). With sequence parallelism x is this rank's
        rows (B / tp, S, D) of the microbatch."""
        draws = draws or Draws()
        attention = functools.partial(self.attention, mask_BS=mask_BS, hashes=draws.attention)
        if self.post_layernorm:
            x_BSD = self.ln1(x_BSD + drop(attention(x_BSD), self.dropout_rate, draws.residual1))
            return self.ln2(x_BSD + drop(self.mlp(x_BSD), self.dropout_rate, draws.residual2))
        x_BSD = x_BSD + drop(attention(self.ln1(x_BSD)), self.dropout_rate, draws.residual1)
        return x_BSD + drop(self.mlp(self.ln2(x_BSD)), self.dropout_rate, draws.residual2)

    def decode(self, x_BTD, cache: KVCache, start_B, *, write=None):
        """The same block for inference with this layer's KV cache (see ParallelSelfAttention.decode); no dropout."""
        if self.post_layernorm:
            h, cache = self.attention.decode(x_BTD, cache, start_B, write=write)
            x_BTD = self.ln1(x_BTD + h)
            return self.ln2(x_BTD + self.mlp(x_BTD)), cache
        h, cache = self.attention.decode(self.ln1(x_BTD), cache, start_B, write=write)
        x_BTD = x_BTD + h
        return x_BTD + self.mlp(self.ln2(x_BTD)), cache
