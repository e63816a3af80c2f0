"""From NNX modules to global sharded arrays and back: layouts are read from each parameter's declaration."""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def split_abstract(make: Callable[[], nnx.Module]):
    """(graphdef, abstract state) of the module `make()` builds, without allocating it."""
    return nnx.split(nnx.eval_shape(make))


def partition_specs(state):
    """The PartitionSpec of every parameter, as declared where the parameter was created (a tree like `state`)."""
    return jax.tree.map(lambda v: v, nnx.get_partition_spec(state))


def named_shardings(state, mesh: jax.sharding.Mesh):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(state),
                        is_leaf=lambda x: isinstance(x, P))


def init_sharded(make: Callable[[], nnx.Module], mesh: jax.sharding.Mesh):
    """Builds the module's parameters directly as global arrays laid out on `mesh`.

    Values depend only on `make` (config and seed): random draws are the same however the output is sharded
    (jax's partitionable threefry), so one seed gives bit-identical global weights on every mesh.
    """
    graphdef, abstract = split_abstract(make)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=named_shardings(abstract, mesh))()
    return graphdef, state
