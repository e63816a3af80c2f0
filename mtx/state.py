"""The training state: step, fp32 master weights, optimizer state and loss scale, as global sharded arrays.

Kept apart from the training step so that checkpoints (restore targets), conversion (a fresh state around converted
weights) and loading need only the model, never the step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.optim import LossScale, make_optimizer
from mtx.sharded_model import ShardedModel


class TrainState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken (skipped fp16 steps included), also the data position
    params: nnx.State  # fp32 master weights, global arrays laid out by their declared PartitionSpecs
    opt_state: optax.OptState
    loss_scale: LossScale


def optimizer_for(model: ShardedModel) -> optax.GradientTransformation:
    """AdamW with clipping and the learning-rate schedule of the model's config (mtx/optim.py)."""
    return make_optimizer(model.cfg.optimizer, model.cfg.training.train_iters)


def state_shardings(model: ShardedModel) -> TrainState:
    """Where each piece of the state lives: parameters and Adam's moments as the parameters declare (also split over
    "data" with the distributed optimizer: `ShardedModel.master_shardings`), the rest replicated."""
    replicated = NamedSharding(model.mesh, P())
    optimizer = optimizer_for(model)
    opt_state = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, model.abstract_params),
        model.master_shardings, transform_non_params=lambda _: replicated)
    return TrainState(replicated, model.master_shardings, opt_state, LossScale(replicated, replicated, replicated))


def _fresh_state(model: ShardedModel, params=None) -> TrainState:
    params = nnx.state(model.make_model()) if params is None else params
    return TrainState(jnp.asarray(0, jnp.int32), params, optimizer_for(model).init(params),
                      LossScale.create(model.cfg.training))


def init_state(model: ShardedModel) -> TrainState:
    """The initial state, built directly in its shardings (values independent of the mesh)."""
    return jax.jit(lambda: _fresh_state(model), out_shardings=state_shardings(model))()


def state_with_params(model: ShardedModel, params) -> TrainState:
    """A step-0 state around given (placed) parameters: fresh optimizer state and loss scale (converted weights)."""
    return jax.jit(lambda p: _fresh_state(model, p), out_shardings=state_shardings(model), donate_argnums=0)(params)


def abstract_state(model: ShardedModel) -> TrainState:
    """Shapes, dtypes and shardings of the state on the model's mesh (the restore target of a checkpoint)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(lambda: _fresh_state(model)), state_shardings(model))
