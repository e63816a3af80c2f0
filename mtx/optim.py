"""The paper's optimizer recipe: AdamW (no decay on biases and LayerNorm), global-norm clipping, warmup + decay,
and dynamic loss scaling for fp16.

Everything here runs outside shard_map on global arrays, so optax sees each parameter once however it is sharded:
the global gradient norm is exact, with no double counting of replicated parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from mtx.config import OptimizerConfig, TrainingConfig

MAX_LOSS_SCALE = 2.0**32  # the largest --initial-loss-scale (Megatron's default); growing never goes beyond it
NO_DECAY = ("bias", "scale")  # the names of biases (any ..._bias too: BERT's lm_bias) and norms' scales


def decay_end(opt: OptimizerConfig, train_iters: int) -> int:
    """The step the lr decay ends at (min_lr after it): --lr-decay-iters, else --train-iters (Megatron's rule)."""
    return opt.lr_decay_iters or train_iters


def learning_rate_schedule(opt: OptimizerConfig, train_iters: int) -> optax.Schedule:
    """Megatron's schedule: linear warmup from --lr-warmup-init (0) to lr, then constant/linear/cosine decay to
    min_lr."""
    warmup = opt.lr_warmup_iters
    decay_steps = max(decay_end(opt, train_iters) - warmup, 1)
    if opt.lr_decay_style == "constant":
        decay = optax.constant_schedule(opt.lr)
    elif opt.lr_decay_style == "linear":
        decay = optax.linear_schedule(opt.lr, opt.min_lr, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.min_lr / opt.lr if opt.lr else 0.0)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(opt.lr_warmup_init, opt.lr, warmup), decay], [warmup])


def weight_decay_steps(opt: OptimizerConfig, train_iters: int) -> int:
    """The steps a rising weight decay takes: --weight-decay-incr-iters, else --train-iters (Megatron's rule)."""
    return opt.weight_decay_incr_iters or train_iters


def weight_decay_schedule(opt: OptimizerConfig, train_iters: int) -> optax.Schedule:
    """Megatron's weight-decay schedule: --weight-decay throughout (constant), or from --start-weight-decay to
    --end-weight-decay over `weight_decay_steps`, linearly or along a half cosine, then the end value."""
    if opt.weight_decay_incr_style == "constant":
        return optax.constant_schedule(opt.weight_decay)
    start, end, steps = opt.start_weight_decay, opt.end_weight_decay, max(weight_decay_steps(opt, train_iters), 1)

    def schedule(count):
        ratio = jnp.minimum(count / steps, 1.0)
        rise = ratio if opt.weight_decay_incr_style == "linear" else 0.5 * (jnp.cos(jnp.pi * (1.0 - ratio)) + 1.0)
        return start + rise * (end - start)

    return schedule


def weight_decay_mask(params):
    """True where weight decay applies: the weight matrices and embeddings, not the biases or the norms' scales and
    biases (Megatron's rule)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not _leaf_name(path).endswith(NO_DECAY), params)


def _leaf_name(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if isinstance(n, str) and n != "value"]
    return names[-1] if names else ""


def make_optimizer(opt: OptimizerConfig, train_iters: int) -> optax.GradientTransformationExtraArgs:
    """Clipping, then optax.adamw's chain (its state, so checkpoints load whatever the schedules) with the weight
    decay of the step passed as `count` to `update` (the lr schedule's count: steps applied, fp16's skipped ones not
    counted)."""
    chain = [optax.clip_by_global_norm(opt.clip_grad)] if opt.clip_grad > 0 else []
    chain.append(optax.chain(optax.scale_by_adam(b1=opt.adam_beta1, b2=opt.adam_beta2, eps=opt.adam_eps),
                             optax.masked(_decayed_weights(weight_decay_schedule(opt, train_iters)), weight_decay_mask),
                             optax.scale_by_learning_rate(learning_rate_schedule(opt, train_iters))))
    return optax.chain(*chain)


def _decayed_weights(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """optax.add_decayed_weights (its empty state) with the decay schedule(count) of the step being taken."""
    def update(updates, state, params, *, count, **_):
        decay = schedule(count)
        return jax.tree.map(lambda g, p: g + decay * p, updates, params), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


class LossScale(NamedTuple):
    """Dynamic loss scale (fp16): halve and skip the step on overflow, double after `window` good steps."""

    scale: jax.Array  # float32 scalar; 1.0 and never changed when loss scaling is off
    good_steps: jax.Array  # int32 scalar: finite steps since the last change
    skipped: jax.Array  # int32 scalar: steps skipped for overflow so far (they do not advance the lr schedule)

    @staticmethod
    def create(train: TrainingConfig) -> "LossScale":
        scale = train.initial_loss_scale if train.fp16 else 1.0
        return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def update(self, finite: jax.Array, train: TrainingConfig) -> "LossScale":
        if not train.fp16:
            return self
        grow = finite & (self.good_steps + 1 >= train.loss_scale_window)
        scale = jnp.where(finite, jnp.where(grow, jnp.minimum(self.scale * 2.0, MAX_LOSS_SCALE), self.scale),
                          jnp.maximum(self.scale / 2.0, train.min_loss_scale))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        skipped = self.skipped + jnp.where(finite, 0, 1)
        return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32), skipped.astype(jnp.int32))
