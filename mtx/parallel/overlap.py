"""Data-parallel communication overlapped with compute, layer by layer (Megatron's `--overlap-grad-reduce` and
`--overlap-param-gather`), inside the training step's shard_map.

Without them the step reduces every gradient over "data" once, after the whole backward (all-reduce; with the
distributed optimizer a reduce-scatter), and the distributed optimizer gathers every parameter before the forward.
In a stacked layer stack nothing of that can start early: the stack's gradient is one (L, ...) array, complete
only when the backward of layer 0 is. Here the step hands the layer stack a function applied to each layer's
parameters as that layer runs (`ParallelTransformer.per_layer`); its transpose is that layer's reduction, so the
backward reduces layer l while it computes layer l - 1, and XLA's asynchronous collectives overlap the two:

- replicated optimizer: the layer's parameters enter invariant over "data" and are cast to vary (no data moves);
  the cast's transpose is the all-reduce of that layer's gradient (Megatron's `f`, over "data" instead of "model").
- distributed optimizer, `--overlap-grad-reduce`: the parameters are gathered once before the forward, as without
  the flag; the layer takes its gathered copy in the forward and its backward reduce-scatters the layer's gradient
  onto this rank's shard (`_scattered_in_backward`).
- distributed optimizer, `--overlap-param-gather` too: the layer all-gathers its own shards as it runs (in the
  compute dtype, like the up-front gather), so the gather of layer l + 1 overlaps layer l; the transpose is the same
  reduce-scatter (in fp32, as every gradient reduction: `gather_shard`, the up-front gather too).

With gradient accumulation (M microbatches a data rank) only the last microbatch's backward reduces, as in
Megatron-LM (its buckets are reduced in the last microbatch's backward): the first M - 1 accumulate their local
gradients of the whole parameters (the distributed optimizer's gathered once before the forward, so
--overlap-param-gather gathers up front then), and the last adds the accumulated gradient of each layer to that
layer's cotangent just before its reduction (`_plus_in_backward`). So the step moves the bytes of one reduction
whatever M, the last of it behind the last backward. Parameters outside the stack (embeddings, final LayerNorm)
and the sums over "model" (sequence parallelism's replicated LayerNorms, replicated key/value groups) are reduced
after the backward as before. The pipelined schedules keep their one reduction after the last tick.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtx.parallel.mesh import DATA
from mtx.parallel.ops import vary
from mtx.parallel.sharded import data_dim, is_stacked


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scattered_in_backward(shard, dim, gathered):
    """The gathered parameter (computed before the forward) in the forward; in the backward its gradient
    reduce-scattered over "data" onto `shard` along `dim`."""
    return gathered


def _scattered_fwd(shard, dim, gathered):
    return gathered, None


def _scattered_bwd(dim, _, ct):
    return jax.lax.psum_scatter(ct, DATA, scatter_dimension=dim, tiled=True), None


_scattered_in_backward.defvjp(_scattered_fwd, _scattered_bwd)


def accumulator(p):
    """Zeros to accumulate the gradients of `p` in over microbatches: fp32 at least, so that the distributed
    optimizer's compute-dtype copies of the layer stack (`gather_shard(..., keep_wire=True)`) sum in fp32."""
    return jnp.zeros_like(p, dtype=jnp.promote_types(p.dtype, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_shard(shard, dim, wire, keep_wire=False):
    """`shard` all-gathered over "data" along `dim`, sent in dtype `wire` (the compute dtype for matrices: the forward
    casts them to it anyway) and cast back, or with `keep_wire` kept in it (the copy that the step's microbatches
    share: half the bytes in bf16); in the backward the gradient reduce-scattered in fp32 or wider, as every gradient
    reduction. The distributed optimizer's one gather, before the forward (mtx/step.py) or inside each layer (here)."""
    whole = jax.lax.all_gather(shard.astype(wire), DATA, axis=dim, tiled=True)
    return whole if keep_wire else whole.astype(shard.dtype)


def _gather_fwd(shard, dim, wire, keep_wire):
    return gather_shard(shard, dim, wire, keep_wire), None


def _gather_bwd(dim, wire, keep_wire, _, ct):
    return (jax.lax.psum_scatter(ct.astype(jnp.promote_types(ct.dtype, jnp.float32)), DATA, scatter_dimension=dim,
                                 tiled=True),)


gather_shard.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def _plus_in_backward(x, pending, i):
    """`x` in the forward; in the backward its cotangent plus `pending[i]` (layer i's gradient accumulated over the
    step's earlier microbatches), so that the reduction that transposes the layer's hook reduces the step's sum."""
    return x


def _plus_fwd(x, pending, i):
    return x, (pending, i)


def _plus_bwd(residuals, ct):
    pending, i = residuals
    return ct + pending[i], None, None


_plus_in_backward.defvjp(_plus_fwd, _plus_bwd)


class LayerReduction(NamedTuple):
    """How one stacked parameter is reduced inside the backward, layer by layer (see the module docstring)."""

    kind: str  # "all_reduce" | "reduce_scatter" | "gather"
    dim: int | None = None  # the dimension of one layer's parameter that "data" splits (distributed optimizer)
    wire: jnp.dtype | None = None  # "gather": the dtype it sends
    gathered: jax.Array | None = None  # "reduce_scatter": the whole stack, gathered before the forward (maybe in the
    # compute dtype: each layer's slice is cast back to the shard's dtype, so the gradient reaches the reduction and
    # `pending` in it)
    pending: jax.Array | None = None  # the stack's gradient accumulated over the step's earlier microbatches

    def __call__(self, w, i):
        """One layer's parameter `w` (layer index `i`) -> what the layer computes with."""
        if self.kind == "all_reduce":
            w = vary(w, (DATA,))
        elif self.kind == "reduce_scatter":
            w = _scattered_in_backward(w, self.dim, self.gathered[i].astype(w.dtype))
        else:
            w = gather_shard(w, self.dim, self.wire)
        return w if self.pending is None else _plus_in_backward(w, self.pending, jnp.asarray(i))


def reduction_kind(spec: P, master: P, *, distributed: bool, param_gather: bool) -> str | None:
    """How a parameter (declared `spec`, stored `master`) is reduced inside the backward; None for the parameters
    outside the layer stack, reduced after the backward."""
    if not is_stacked(spec):
        return None
    if not distributed or data_dim(master) is None:  # replicated over "data": all-reduce
        return "all_reduce"
    return "gather" if param_gather else "reduce_scatter"


def layer_hook(reductions: list[LayerReduction]):
    """The stack's `per_layer` function: (one layer's parameters as handed over, layer index) -> the parameters the
    layer computes with; `reductions` lists each leaf's LayerReduction in the order of the layer's leaves."""
    def per_layer(layer_state, i):
        leaves, treedef = jax.tree.flatten(layer_state)
        assert len(leaves) == len(reductions), "the reductions are made from the same layer stack"
        return jax.tree.unflatten(treedef, [reduce(w, i) for w, reduce in zip(leaves, reductions)])

    return per_layer
