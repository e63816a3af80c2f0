"""From NNX modules to global sharded arrays and back: layouts are read from each parameter's declaration."""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.parallel.mesh import DATA, MODEL, PIPELINE


def split_abstract(make: Callable[[], nnx.Module]):
    """(graphdef, abstract state) of the module `make()` builds, without allocating it."""
    return nnx.split(nnx.eval_shape(make))


def partition_specs(state, model_size: int):
    """The PartitionSpec of every parameter, as declared where the parameter was created (a tree like `state`), on
    a mesh of `model_size` model ranks: groups that this size does not divide are replicated (`replicated_groups`;
    1: every spec as declared)."""
    return map_specs(lambda spec, replicated: P(*(None if replicated and a == MODEL else a for a in spec)),
                     nnx.get_partition_spec(state), replicated_groups(state, model_size))


def replicated_groups(state, model_size: int):
    """Per parameter of `state` (a tree like its specs), whether it is declared in groups (`groups`,
    mtx/parallel/layers.py) that `model_size` ranks cannot split, G < TP: such a parameter is replicated over
    "model" and each rank uses its own group, so its gradient differs per rank (the training step sums it over
    "model" once per step, mtx/step.py)."""
    def replicated(v):
        groups = v.get_metadata().get("groups")
        return v.replace(groups is not None and groups % model_size != 0)

    return jax.tree.map(replicated, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(state, mesh: jax.sharding.Mesh):
    """Where each parameter is stored on `mesh`: its layout on the mesh (`partition_specs`), minus any mesh axis
    that does not divide the dimension (an uneven pipeline layout's layer stack, say, is then kept whole on every
    stage)."""
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, fit_spec(spec, x.shape, mesh)),
                        partition_specs(state, mesh.shape[MODEL]), state, is_leaf=lambda x: isinstance(x, P))


def is_stacked(spec: P) -> bool:
    """True for the layer stack's parameters: their leading axis is split into pipeline stages (whatever their path)."""
    return PIPELINE in spec


def map_specs(fn, tree, specs, *rest):
    """tree_map over parameters and their declared specs (and further trees shaped like them)."""
    return jax.tree.map(fn, tree, specs, *rest, is_leaf=lambda x: isinstance(x, P))


def fit_spec(spec: P, shape, mesh: jax.sharding.Mesh) -> P:
    """`spec` with the mesh axes removed that do not divide their dimension of `shape`."""
    def fits(axis, dim):
        return axis is None or dim % mesh.shape[axis] == 0
    return P(*(axis if fits(axis, dim) else None for axis, dim in zip(spec, shape)))


def shard_over(spec: P, shape, axis: str, size: int) -> int | None:
    """The dimension of a parameter to split over one more mesh axis (the distributed optimizer's "data"): the first
    one that its declared layout does not split (nor, then, its stored one, which only drops axes: `fit_spec`) and
    that `size` divides; None when there is none (the parameter then stays whole on every rank of `axis`)."""
    if size == 1:
        return None
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return next((dim for dim, (declared, n) in enumerate(zip(entries, shape)) if declared is None and n % size == 0),
                None)


def with_axis(spec: P, dim: int | None, axis: str, ndim: int) -> P:
    """`spec` with mesh axis `axis` on dimension `dim` (unchanged when dim is None)."""
    if dim is None:
        return spec
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[dim] = axis
    return P(*entries)


def data_dim(spec: P) -> int | None:
    """The dimension `spec` splits over "data" (the distributed optimizer's master shards), or None."""
    return list(spec).index(DATA) if DATA in spec else None


def init_sharded(make: Callable[[], nnx.Module], mesh: jax.sharding.Mesh):
    """Builds the module's parameters directly as global arrays laid out on `mesh`.

    Values depend only on `make` (config and seed): random draws are the same however the output is sharded
    (jax's partitionable threefry), so one seed gives bit-identical global weights on every mesh.
    """
    graphdef, abstract = split_abstract(make)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=named_shardings(abstract, mesh))()
    return graphdef, state
