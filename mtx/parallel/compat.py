"""What differs between the jax versions mtx supports (0.10.2 through 0.12), in one place.

Each function has one meaning on every version; ops.py and the layers call these, never a version check.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

_GATHER_HAS_TO = "to" in inspect.signature(jax.lax.all_gather).parameters


def varying_axes(x) -> set[str]:
    """The mesh axes `x` varies over inside shard_map (empty outside). jax 0.11 keeps them in `aval.mat.varying`,
    other versions in `aval.vma`."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def shape_varying_like(shape, dtype, *arrays) -> jax.ShapeDtypeStruct:
    """The output type of a kernel (pallas_call) computed from `arrays`: (shape, dtype), varying over every mesh axis
    any of them varies over (shard_map with check_vma needs it spelled out; outside shard_map it is empty). jax 0.11
    names it `manual_axis_type`, other versions `vma`."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
    if hasattr(jax.sharding, "ManualAxisType"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


def all_gather_invariant(x, axis_name: str, axis: int):
    """Concatenates the ranks' slices of `x` along `axis`, typed invariant over `axis_name` (its transpose is a local
    slice). Versions whose all_gather has no `to=` get the same values from a psum of zero-padded slices (twice the
    traffic)."""
    if _GATHER_HAS_TO:
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")
    tp, rank = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    shape = list(x.shape)
    shape[axis] *= tp
    buf = jnp.zeros(shape, x.dtype)
    return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(buf, x, rank * x.shape[axis], axis), axis_name)


def uninitialized(shape, dtype):
    """An array whose values will all be written before any is read: `jax.lax.empty` (on GPUs an allocation and no
    kernel; elsewhere zeros). Versions without it get zeros."""
    empty = getattr(jax.lax, "empty", None)
    return empty(shape, dtype) if empty is not None else jnp.zeros(shape, dtype)
