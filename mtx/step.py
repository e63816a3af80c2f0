"""The training and evaluation steps: one shard_map over the whole mesh for loss and gradients, optax outside.

Inside the shard_map every collective is explicit: the model's f/g over "model", and exactly one gradient all-reduce
over "data" per step, after all microbatches are accumulated. Each data rank differentiates its own copy of the
parameters (cast to "varying" over "data" before the loss), so autodiff inserts no hidden reduction per microbatch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.models.gpt import GPT
from mtx.optim import LossScale, learning_rate_schedule, make_optimizer
from mtx.parallel.mesh import DATA
from mtx.parallel.random import sample_keys
from mtx.parallel.sharded import named_shardings, partition_specs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class TrainState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken (skipped fp16 steps included), also the data position
    params: nnx.State  # fp32 master weights, global arrays laid out by their declared PartitionSpecs
    opt_state: optax.OptState
    loss_scale: LossScale


def build_model(cfg: Config, *, seed: int | None = None):
    """A zero-argument constructor of the GPT this config describes (called abstractly or under jit)."""
    seed = cfg.training.seed if seed is None else seed
    dtype = DTYPES[cfg.training.compute_dtype]
    return lambda: GPT(cfg.model, dtype=dtype, recompute=cfg.training.recompute_granularity, rngs=nnx.Rngs(seed))


def num_microbatches(cfg: Config, mesh) -> int:
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * mesh.shape[DATA])


class Trainer:
    """Owns the compiled steps of one (config, mesh) pair."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.make_model = build_model(cfg)
        self.optimizer = make_optimizer(cfg.optimizer, cfg.training.train_iters)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.training.train_iters)
        self.graphdef, self.abstract_params = nnx.split(nnx.eval_shape(self.make_model))
        self.param_specs = partition_specs(self.abstract_params)
        self.batch_sharding = NamedSharding(mesh, P(DATA))
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_loss)

    # ---- state ----
    def _fresh_state(self) -> TrainState:
        params = nnx.state(self.make_model())
        return TrainState(jnp.asarray(0, jnp.int32), params, self.optimizer.init(params),
                          LossScale.create(self.cfg.training))

    def state_shardings(self) -> TrainState:
        """Where each piece of the state lives: parameters and Adam's moments as the parameters declare, the rest
        replicated."""
        replicated = NamedSharding(self.mesh, P())
        params = named_shardings(self.abstract_params, self.mesh)
        opt_state = optax.tree_map_params(
            self.optimizer, lambda _, sharding: sharding, jax.eval_shape(self.optimizer.init, self.abstract_params),
            params, transform_non_params=lambda _: replicated)
        return TrainState(replicated, params, opt_state, LossScale(replicated, replicated, replicated))

    def init_state(self) -> TrainState:
        """The initial state, built directly in its shardings (values independent of the mesh)."""
        return jax.jit(self._fresh_state, out_shardings=self.state_shardings())()

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state on this mesh (the restore target of a checkpoint)."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(self._fresh_state), self.state_shardings())

    # ---- inside shard_map ----
    def _local_loss_and_grads(self, params, tokens, key, scale):
        """This data rank's share of the batch -> (global mean loss, global mean grads), both reduced over "data"."""
        cfg, t = self.cfg, self.cfg.training
        m = self.num_microbatches
        tokens_MBS = tokens.reshape(m, t.micro_batch_size, -1)
        n_tokens = t.global_batch_size * (tokens.shape[-1] - 1)  # loss is the mean over every token of the step
        dropout_on = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0
        # Global batch position of this rank's first sequence: dropout keys follow the sequence, not the rank.
        first = jax.lax.axis_index(DATA) * tokens.shape[0]
        # Each data rank differentiates its own copy: the gradient stays local until the one psum below.
        params = jax.tree.map(lambda p: jax.lax.pcast(p, DATA, to="varying"), params)

        def loss_fn(p, tokens_BS, keys_B):
            per_token = nnx.merge(self.graphdef, p).loss(
                tokens_BS[:, :-1], tokens_BS[:, 1:], keys_B=keys_B, label_smoothing=cfg.model.label_smoothing)
            return per_token.sum() / n_tokens

        def micro(carry, inputs):
            loss_acc, grad_acc = carry
            tokens_BS, i = inputs
            b = t.micro_batch_size
            keys_B = sample_keys(key, first + i * b, b) if dropout_on else None
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, tokens_BS, keys_B) * scale)(params)
            return (loss_acc + loss, jax.tree.map(jnp.add, grad_acc, grads)), None

        zeros = (jax.lax.pcast(jnp.zeros((), jnp.float32), DATA, to="varying"), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(micro, zeros, (tokens_MBS, jnp.arange(m)))
        # The data-parallel gradient all-reduce: once per step, after accumulation.
        return jax.lax.psum(loss, DATA) / scale, jax.lax.psum(grads, DATA)

    # ---- jitted ----
    @property
    def num_microbatches(self) -> int:
        return num_microbatches(self.cfg, self.mesh)

    def _train_step(self, state: TrainState, tokens):
        t = self.cfg.training
        key = jax.random.fold_in(jax.random.key(t.seed), state.step)
        loss, grads = jax.shard_map(
            self._local_loss_and_grads, mesh=self.mesh,
            in_specs=(self.param_specs, P(DATA), P(), P()), out_specs=(P(), self.param_specs),
        )(state.params, tokens, key, state.loss_scale.scale)
        grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if t.fp16:  # overflow: keep the old weights and optimizer state, halve the scale
            keep_new = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep_new(params, state.params), keep_new(opt_state, state.opt_state)
        loss_scale = state.loss_scale.update(finite, t)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.schedule(state.step - state.loss_scale.skipped),
            "loss_scale": state.loss_scale.scale,
            "skipped": ~finite,
        }
        return TrainState(state.step + 1, params, opt_state, loss_scale), metrics

    def _eval_loss(self, params, tokens):
        """Mean next-token loss of a (B, S + 1) batch, no dropout."""

        def local(params, tokens):
            per_token = nnx.merge(self.graphdef, params).loss(tokens[:, :-1], tokens[:, 1:])
            return jax.lax.pmean(per_token.mean(), DATA)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.param_specs, P(DATA)), out_specs=P())(
            params, tokens)

    def put_batch(self, tokens_np):
        """Host (G, S + 1) tokens -> a global array split over "data" (the same global batch on every mesh)."""
        return jax.device_put(tokens_np, self.batch_sharding)
