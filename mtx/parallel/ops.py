"""Megatron's communication operators (paper Code 1), in the local view inside `jax.shard_map`.

shard_map runs with `check_vma=True`, so every value carries the set of mesh axes it varies over. That type system
is what makes Megatron's conjugate pairs fall out of autodiff:

- `f`: identity forward; all-reduce over "model" backward. A value that is the same on every model rank (invariant)
  is cast to one that may differ per rank. The transpose of that cast is a psum, so the backward all-reduce happens
  exactly here, once.
- `g`: all-reduce over "model" forward; identity backward. psum turns per-rank partial sums into one invariant value;
  its transpose under check_vma is the cast back to varying, which moves no data.

Sequence parallelism (Korthikanti et al. 2022, Megatron's `--sequence-parallel`) splits the residual stream, and with
it LayerNorm, dropout and the residual adds, over "model": `f` becomes an all-gather of the pieces (reduce-scatter
backward) and `g` a reduce-scatter (all-gather backward), the same bytes as the two all-reduces (an all-reduce is a
reduce-scatter then an all-gather) with no element-wise work repeated on every rank. Megatron cuts the sequence; mtx
cuts the microbatch's rows (whole sequences, B / tp per rank): every op between the gather and the scatter is
row-wise (attention looks within a row), so nothing else changes, and a rank's rows are contiguous in memory, so the
collectives need no transposes (cutting S cost ~12 ms of transposes per step on the 1.2B model at TP 2, measured).

With `check_vma=False` nothing tracks invariance: psum transposes to another psum and the cast to a no-op, so the
backward all-reduce moves from `f` to `g` and the input gradients come out wrong (tp times too large where the
replicated cotangent is summed). mtx always runs shard_map with check_vma=True; tests/test_layers.py compares every
gradient with a single-device reference and catches such a mistake.
"""

from __future__ import annotations

import jax

from mtx.parallel.compat import all_gather_invariant, varying_axes
from mtx.parallel.mesh import MODEL


def f(x):
    """Megatron's f (copy to the model-parallel region): identity forward, all-reduce over "model" backward."""
    return jax.lax.pcast(x, MODEL, to="varying")


def g(x):
    """Megatron's g (reduce from the model-parallel region): all-reduce over "model" forward, identity backward."""
    return jax.lax.psum(x, MODEL)


def vary(x, axes):
    """Casts `x` to vary over `axes` (those it does not vary over already); no data moves."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def cotangent_like(cotangent, primal):
    """A custom_vjp backward's cotangent typed as its primal input inside shard_map: summed over the mesh axes it
    varies over and the primal does not (autodiff's transpose of the implicit cast of an invariant input, e.g. a
    replicated scale applied to sequence-parallel rows), cast to vary over those the primal varies over and it does
    not."""
    extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
    return vary(jax.lax.psum(cotangent, extra) if extra else cotangent, varying_axes(primal))


def vary_like(x, ref, *, exclude=(MODEL,)):
    """Casts `x` to vary over every mesh axis (but `exclude`) that some leaf of `ref` varies over: a scan carry must
    keep one type, and a layer's output varies wherever its parameters do (except over "model", where g makes the
    residual stream replicated again)."""
    axes = set().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(ref)))
    return vary(x, axes - set(exclude))


def model_rank():
    """This device's index on the "model" axis (0 outside a model-parallel region of size 1)."""
    return jax.lax.axis_index(MODEL)


def model_size() -> int:
    """Number of model-parallel ranks (static)."""
    return jax.lax.axis_size(MODEL)


def gather_from_model_parallel(x, axis: int = -1):
    """Concatenates the per-rank slices of `x` along `axis`; backward keeps this rank's slice (no communication).

    The result is the same on every model rank, so it is typed invariant; its transpose is a local slice.
    """
    return all_gather_invariant(x, MODEL, axis % x.ndim)


def scatter_to_model_parallel(x, axis: int = -1):
    """Keeps this rank's slice of an invariant `x` along `axis`; backward all-reduces the zero-padded slices.

    The slice index depends on the rank, so the cast to varying (and its psum transpose) is explicit here.
    """
    axis = axis % x.ndim
    tp = model_size()
    if x.shape[axis] % tp:
        raise ValueError(f"dimension {axis} of size {x.shape[axis]} does not split over {tp} model ranks.")
    local = x.shape[axis] // tp
    return jax.lax.dynamic_slice_in_dim(f(x), model_rank() * local, local, axis)


# ---- sequence parallelism: the residual stream's rows (axis 0) are split over "model" ----


def gather_from_sequence_parallel(x_BSD):
    """SP's `f`: this rank's rows (B / tp, S, D) -> all rows (B, S, D) on every rank, for a column-parallel matmul;
    backward reduce-scatters the per-rank partial input gradients back into rows.

    Typed varying (unlike `gather_from_model_parallel`): the consumer multiplies it by this rank's weight columns, and
    the transpose of a varying all-gather is the psum_scatter that sums their partial gradients.
    """
    return jax.lax.all_gather(x_BSD, MODEL, axis=0, tiled=True)


def reduce_scatter_to_sequence_parallel(x_BSD):
    """SP's `g`: per-rank partial sums (B, S, D) -> this rank's rows of their sum (B / tp, S, D); backward all-gathers
    the rows' gradients."""
    return jax.lax.psum_scatter(x_BSD, MODEL, scatter_dimension=0, tiled=True)


def sequence_parallel_rows(x):
    """This rank's rows (axis 0) of a value every rank holds whole (token types, dropout keys); a gradient is summed
    over ranks by the cast to varying (as `scatter_to_model_parallel`)."""
    return scatter_to_model_parallel(x, 0)
