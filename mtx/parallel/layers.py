"""Megatron's tensor-parallel layers (paper section 3, Fig. 3), each written in the local view inside shard_map.

Every parameter states its layout once, here, where it is declared: the global array has the full (mesh-independent)
shape and `out_sharding` says how the mesh splits it. Inside `jax.shard_map` a layer sees only its local slice, so
`kernel` of a ColumnParallelLinear is (D, F / tp) there.

`sequence_parallel` (Megatron's `--sequence-parallel`, `Config.sequence_parallel`), fixed when a layer is built:
  False  the paper's layers: replicated (B, S, D) in and out; `f` before the column-parallel matmul, `g` after the
         row-parallel one.
  True   this rank's rows (B / tp, S, D) in and out; an all-gather before the column-parallel matmul, a
         reduce-scatter after the row-parallel one (mtx/parallel/ops.py). Decoding builds its model with it off.
`comm_overlap` (--tp-comm-overlap, with sequence parallelism only): those all-gathers and reduce-scatters inside the
matmuls, `column_parallel_matmul` / `row_parallel_matmul` of mtx/kernels/collective_matmul.py (peer-memory kernels on
Hopper GPUs; elsewhere the same collectives and matmuls, so the values are those without it).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.kernels import collective_matmul, elementwise, gemm_epilogue  # modules: they import mtx.parallel too
from mtx.parallel.mesh import MODEL, PIPELINE
from mtx.parallel.ops import (f, g, gather_from_model_parallel, gather_from_sequence_parallel, model_rank,
                              reduce_scatter_to_sequence_parallel, scatter_to_model_parallel)

REPLICATED = None


def param(rngs: nnx.Rngs | None, shape, spec: tuple, *, std: float | None = None, value: float = 0.0,
          groups: int | None = None) -> nnx.Param:
    """A float32 parameter of global `shape` with layout `spec`: N(0, std) when `std` is given, else `value`.

    groups: the "model"-split last axis is this many groups that cannot be cut (grouped-query attention's key/value
    heads): split when the model size divides them, else replicated, each rank using only its own group
    (`replicated_groups`, mtx/parallel/sharded.py).
    """
    assert len(spec) == len(shape), (shape, spec)
    if std is None:
        init = jnp.full(shape, value, jnp.float32)
    else:
        init = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    # eager_sharding=False: the layout is metadata; arrays are placed by the caller's jit out_shardings.
    return nnx.Param(init, out_sharding=spec, eager_sharding=False, **({} if groups is None else {"groups": groups}))


class ColumnParallelLinear(nnx.Module):
    """Y = X A + b with A split by columns: A = [A_1 ... A_tp]; rank r computes X A_r, its own slice of Y.

    The input is replicated, so `f` comes first: identity forward, and in the backward the partial input gradients
    of all ranks are summed (the one all-reduce of this layer). No communication forward unless gather_output (or,
    with sequence parallelism, the all-gather of the ranks' rows that replaces `f`).
    """

    def __init__(self, in_features: int, out_features: int, *, std: float, use_bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, parts: int = 1,
                 groups: int | None = None, comm_overlap: bool = False, epilogues: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        """parts > 1: `parts` matrices (in, parts, out) whose columns split over ranks alike, so each rank holds the
        matching columns of each (SwiGLU's gate and up; `parts_call`). groups: the columns are this many groups,
        replicated on every rank when the model size does not divide them (grouped-query attention's key/value
        heads, see `param`); `local_call` then uses the group it is given. epilogues: the bias added inside each
        matmul (`gemm_epilogue.bias_matmul`, --gemm-epilogues)."""
        shape, spec = ((in_features, out_features), (REPLICATED, MODEL)) if parts == 1 else (
            (in_features, parts, out_features), (REPLICATED, REPLICATED, MODEL))
        self.kernel = param(rngs, shape, spec, std=std, groups=groups)
        self.bias = param(None, shape[1:], spec[1:], groups=groups) if use_bias else None
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel and not gather_output
        self.epilogues = epilogues
        self.dtype = dtype

    def __call__(self, x_BSD, *, skip_bias_add: bool = False):
        """(B, S, D) replicated (or this rank's rows (B / tp, S, D) with sequence parallelism) -> (B, S, F / tp) on
        this rank, or (B, S, F) replicated with gather_output. skip_bias_add: (X A, b) instead, the bias left to the
        caller to add with what follows (Megatron's option: the MLP's bias + GeLU in one function,
        `elementwise.bias_gelu`)."""
        bias = None if self.bias is None else self.bias[...].astype(self.dtype)
        assert not (skip_bias_add and self.gather_output), "skip_bias_add returns this rank's bias columns"
        y = self._matmuls(x_BSD, [self.kernel[...].astype(self.dtype)],
                          None if bias is None or skip_bias_add else [bias])[0]
        return (y, bias) if skip_bias_add else y

    def split_call(self, x_BSD, parts: int, part_dim: int):
        """The same Y = X A + b as `parts` matmuls, one per interleaved group of output columns.

        This rank's columns are read as (n, parts, part_dim); output j is (B, S, n, part_dim) =
        f(X) A[:, :, j] + b[:, j].
        For the fused QKV projection (columns ordered (N, 3, H)) the matmuls write q, k and v into buffers of their
        own: no strided split of a (..., 3D / tp) activation forward, no re-interleaving of dq, dk, dv backward. One `f`
        (or one all-gather) serves all parts, so the backward still has one all-reduce (or one reduce-scatter).
        """
        kernel = self.kernel[...].astype(self.dtype)
        kernel = kernel.reshape(kernel.shape[0], -1, parts, part_dim)
        bias = None if self.bias is None else self.bias[...].astype(self.dtype).reshape(-1, parts, part_dim)
        return tuple(self._matmuls(x_BSD, [kernel[:, :, j] for j in range(parts)],
                                   None if bias is None else [bias[:, j] for j in range(parts)]))

    def parts_call(self, x_BSD):
        """The `parts` matmuls of a (D, parts, F) kernel with one `f` (or all-gather): (B, S, F / tp) each."""
        kernel = self.kernel[...].astype(self.dtype)
        bias = None if self.bias is None else self.bias[...].astype(self.dtype)
        parts = range(kernel.shape[1])
        return tuple(self._matmuls(x_BSD, [kernel[:, j] for j in parts],
                                   None if bias is None else [bias[j] for j in parts]))

    def enter(self, x_BSD):
        """The input of this rank's matmuls: f (replicated input) or, with sequence parallelism, the all-gather of the
        ranks' rows. Layers that share one input (q, k and v) enter it once and call `local_call` on it."""
        x_BSD = x_BSD.astype(self.dtype)
        return gather_from_sequence_parallel(x_BSD) if self.sequence_parallel else f(x_BSD)

    def local_call(self, x_BSD, start=None, size=None):
        """X A + b on an entered input: this rank's columns, or of replicated groups the columns start .. start +
        size (a traced start, this rank's)."""
        kernel = self.kernel[...].astype(self.dtype)
        bias = None if self.bias is None else self.bias[...].astype(self.dtype)
        if start is not None:
            kernel = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=1)
            bias = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
        y = x_BSD @ kernel
        return y if bias is None else y + bias

    def _matmuls(self, x, kernels, biases):
        biases = biases or [None] * len(kernels)
        if self.comm_overlap:
            ys = [y if b is None else y + b for y, b in zip(self._gathered_matmuls(x, kernels), biases)]
        else:
            x = self.enter(x)
            ys = [self._biased_matmul(x, kernel, bias) for kernel, bias in zip(kernels, biases)]
        return [gather_from_model_parallel(y) if self.gather_output else y for y in ys]

    def _biased_matmul(self, x, kernel, bias):
        """x (..., D) times kernel (D, ...) plus bias (...), the bias inside the matmul with `epilogues`."""
        if self.epilogues and bias is not None:
            y = gemm_epilogue.bias_matmul(x, kernel.reshape(kernel.shape[0], -1), bias.reshape(-1))
            return y.reshape(*x.shape[:-1], *kernel.shape[1:])
        y = jnp.einsum("...d,df->...f" if kernel.ndim == 2 else "...d,dnh->...nh", x, kernel)
        return y if bias is None else y + bias

    def _gathered_matmuls(self, x_BSD, kernels):
        """--tp-comm-overlap: this rank's rows times each kernel's columns for every row, the rows gathered inside
        one matmul of the kernels side by side (one exchange of the rows for all of them, as one all-gather served
        them before)."""
        x = x_BSD.astype(self.dtype)
        b, s, d = x.shape
        widths = [math.prod(k.shape[1:]) for k in kernels]
        w = jnp.concatenate([k.reshape(d, -1) for k in kernels], axis=1)
        y = collective_matmul.column_parallel_matmul(x.reshape(b * s, d), w)
        parts = jnp.split(y, list(itertools.accumulate(widths))[:-1], axis=1)
        return [part.reshape(-1, s, *k.shape[1:]) for part, k in zip(parts, kernels)]


class RowParallelLinear(nnx.Module):
    """Y = X A + b with A split by rows: A = [A_1; ...; A_tp] and X = [X_1 ... X_tp]; Y = g(sum_r X_r A_r) + b.

    The input arrives already split (the output of a ColumnParallelLinear), so no communication is needed before the
    matmul; `g` all-reduces the partial products. The bias is replicated and added once, after the reduce.
    """

    def __init__(self, in_features: int, out_features: int, *, std: float, use_bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, comm_overlap: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.kernel = param(rngs, (in_features, out_features), (MODEL, REPLICATED), std=std)
        self.bias = param(None, (out_features,), (REPLICATED,)) if use_bias else None
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel
        self.dtype = dtype

    def __call__(self, x_BSF):
        """(B, S, F / tp) on this rank (or (B, S, F) replicated without input_is_parallel) -> (B, S, D) replicated,
        or with sequence parallelism this rank's rows (B / tp, S, D) of it."""
        if not self.input_is_parallel:
            x_BSF = scatter_to_model_parallel(x_BSF)
        x_BSF, kernel = x_BSF.astype(self.dtype), self.kernel[...].astype(self.dtype)
        if self.comm_overlap:  # the rows' sums scattered inside the matmul
            b, s, f_local = x_BSF.shape
            y = collective_matmul.row_parallel_matmul(x_BSF.reshape(b * s, f_local), kernel)
            return self._biased(y.reshape(-1, s, kernel.shape[1]))
        return self.reduce(x_BSF @ kernel)

    def reduce(self, y_BSD):
        """This rank's partial product (B, S, D) -> the sum over ranks plus the bias: `g`, or with sequence
        parallelism the reduce-scatter into this rank's rows."""
        return self._biased(reduce_scatter_to_sequence_parallel(y_BSD) if self.sequence_parallel else g(y_BSD))

    def _biased(self, y):
        if self.bias is not None:  # replicated, added once after the reduction (to this rank's rows with SP)
            y = y + self.bias[...].astype(self.dtype)
        return y


class VocabParallelEmbedding(nnx.Module):
    """Embedding table split by vocabulary rows: rank r holds ids [r V/tp, (r+1) V/tp).

    Each rank looks up the ids in its range, writes zeros for the others, and `g` sums the partial lookups, so every
    rank ends with the full embedding. `attend` reuses the table as the (tied) output layer, giving this rank's slice
    of the logits, which are never gathered; an untied output layer (--untie-embeddings-and-output-weights) is a
    second table of the same layout used only through `attend`.
    """

    def __init__(self, num_embeddings: int, features: int, *, std: float, sequence_parallel: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = param(rngs, (num_embeddings, features), (MODEL, REPLICATED), std=std)
        self.sequence_parallel = sequence_parallel
        self.dtype = dtype

    def __call__(self, ids_BS):
        """(B, S) int ids, replicated -> (B, S, D) replicated, or with sequence parallelism this rank's rows
        (B / tp, S, D)."""
        table_VD = self.embedding[...]  # local (V / tp, D)
        v_local = table_VD.shape[0]
        local_ids = ids_BS - model_rank() * v_local
        in_range = (local_ids >= 0) & (local_ids < v_local)
        x_BSD = jnp.take(table_VD, jnp.where(in_range, local_ids, 0), axis=0)
        x_BSD = jnp.where(in_range[..., None], x_BSD, 0.0)
        # The partial lookups are summed over ranks: all-reduced, or reduce-scattered into the ranks' rows (SP).
        x_BSD = reduce_scatter_to_sequence_parallel(x_BSD) if self.sequence_parallel else g(x_BSD)
        return x_BSD.astype(self.dtype)

    def attend(self, x_BSD, *, pipeline_share: bool = False):
        """(B, S, D) replicated -> (B, S, V / tp) logits of this rank's vocabulary slice (f before the matmul); with
        `pipeline_share`, of this pipeline stage's 1 / P of it (B, S, V / (tp P))."""
        table_VD = self.embedding[...]
        if pipeline_share:
            rows, left = divmod(table_VD.shape[0], jax.lax.axis_size(PIPELINE))
            assert not left, "the pipeline stages must split the vocabulary slice evenly"
            table_VD = jax.lax.dynamic_slice_in_dim(table_VD, jax.lax.axis_index(PIPELINE) * rows, rows)
        return f(x_BSD.astype(self.dtype)) @ table_VD.astype(self.dtype).T


class LayerNorm(nnx.Module):
    """LayerNorm with replicated scale and bias, computed in float32 whatever the compute dtype (its backward written
    out, mtx/kernels/elementwise.py)."""

    def __init__(self, features: int, *, epsilon: float = 1e-5, dtype=jnp.float32):
        self.scale = param(None, (features,), (REPLICATED,), value=1.0)
        self.bias = param(None, (features,), (REPLICATED,))
        self.epsilon = epsilon
        self.dtype = dtype

    def __call__(self, x):
        return elementwise.layer_norm(x, self.scale[...], self.bias[...], self.epsilon, self.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm (--normalization RMSNorm): x / sqrt(mean(x^2) + eps) times a replicated scale, no mean subtraction and
    no bias; float32 whatever the compute dtype. Replicated like LayerNorm's parameters, so sequence parallelism
    treats it the same way (its gradient summed over "model" once per step)."""

    def __init__(self, features: int, *, epsilon: float = 1e-5, dtype=jnp.float32):
        self.scale = param(None, (features,), (REPLICATED,), value=1.0)
        self.epsilon = epsilon
        self.dtype = dtype

    def __call__(self, x):
        return elementwise.rms_norm(x, self.scale[...], self.epsilon, self.dtype)


def normalization(cfg, features: int, *, dtype):
    """The block's normalization layer of `features` (--normalization, --norm-epsilon)."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(features, epsilon=cfg.epsilon, dtype=dtype)
