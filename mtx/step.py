"""The training and evaluation steps: one shard_map over the whole mesh for loss and gradients, optax outside.

Inside the shard_map every collective is explicit: the model's f/g over "model", and exactly one gradient all-reduce
over "data" per step, after all microbatches are accumulated. Each data rank differentiates its own copy of the
parameters (cast to "varying" over "data" before the loss), so autodiff inserts no hidden reduction per microbatch.

A batch is a pytree of arrays with the global batch as leading axis (GPT: one (G, S + 1) token array; BERT: a dict
of fields); the model family's objective (mtx/objectives.py) says how a microbatch becomes its share of the loss.
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
from mtx.models.bert import BERT
from mtx.models.gpt import GPT
from mtx.objectives import micro_loss, objective_for
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.optim import LossScale, learning_rate_schedule, make_optimizer
from mtx.parallel.mesh import DATA, MODEL, PIPELINE
from mtx.parallel.pipeline import Schedule, from_slots, pipelined_final_hidden, pipelined_loss, to_slots
from mtx.parallel.random import sample_keys
from mtx.parallel.sharded import named_shardings, partition_specs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _map_layers(fn, tree, specs):
    """Applies fn(leaf, spec) to the leaves of the layer stack ("layers"), leaving the others alone."""
    def one(path, leaf, spec):
        return fn(leaf, spec) if jax.tree_util.keystr(path).startswith("['layers']") else leaf
    return jax.tree_util.tree_map_with_path(one, tree, specs, is_leaf=lambda x: isinstance(x, P))


class TrainState(NamedTuple):
    step: jax.Array  # int32: optimizer steps taken (skipped fp16 steps included), also the data position
    params: nnx.State  # fp32 master weights, global arrays laid out by their declared PartitionSpecs
    opt_state: optax.OptState
    loss_scale: LossScale


def build_model(cfg: Config, *, seed: int | None = None):
    """A zero-argument constructor of the GPT or BERT this config describes (called abstractly or under jit)."""
    seed = cfg.training.seed if seed is None else seed
    dtype = DTYPES[cfg.training.compute_dtype]
    t = cfg.training
    family = BERT if cfg.model.is_bert else GPT
    return lambda: family(cfg.model, dtype=dtype, recompute=t.recompute_granularity, flash=t.use_flash_attn,
                          scan_layers=t.scan_layers, sp=sequence_parallel_mode(cfg), rngs=nnx.Rngs(seed))


def sequence_parallel_mode(cfg: Config) -> str | None:
    """The layers' `sp` (mtx/parallel/layers.py): None, "gather" or "overlap". With TP 1 there is nothing to split, and
    sequence parallelism is off (as in Megatron)."""
    p = cfg.parallel
    if not p.sequence_parallel or p.tensor_model_parallel_size == 1:
        return None
    return "overlap" if p.tp_comm_overlap else "gather"


def num_microbatches(cfg: Config, mesh) -> int:
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * mesh.shape[DATA])


class Trainer:
    """Owns the compiled steps of one (config, mesh) pair."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.make_model = build_model(cfg)
        self.objective = objective_for(cfg)
        self.optimizer = make_optimizer(cfg.optimizer, cfg.training.train_iters)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.training.train_iters)
        self.graphdef, self.abstract_params = nnx.split(nnx.eval_shape(self.make_model))
        self.param_specs = partition_specs(self.abstract_params)  # as declared; the shard_map's in/out specs
        self.pipeline = Schedule(cfg.stage_layer_counts(), self.num_microbatches) if mesh.shape[PIPELINE] > 1 else None
        self.batch_sharding = NamedSharding(mesh, P(DATA))
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_objective_loss if cfg.model.is_bert else self._eval_loss)

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
    def _local_loss_and_grads(self, params, batch, key, scale):
        """This data rank's share of the batch -> (global mean loss, global mean grads), both reduced over "data"
        (and, for parameters every pipeline stage holds, over "pipeline")."""
        cfg, t = self.cfg, self.cfg.training
        m, b = self.num_microbatches, t.micro_batch_size
        rows = jax.tree.leaves(batch)[0].shape[0]
        batch_M = jax.tree.map(lambda a: a.reshape(m, b, *a.shape[1:]), batch)
        counts = self.objective.normalizers(batch)  # the step's global counts the loss is averaged over
        dropout_on = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0
        # Global batch position of this rank's first sequence: dropout keys follow the sequence, not the rank.
        first = jax.lax.axis_index(DATA) * rows
        keys_MB = jax.vmap(lambda i: sample_keys(key, first + i * b, b))(jnp.arange(m)) if dropout_on else None
        # Each rank differentiates its own copy: gradients stay local until the explicit psums below.
        reduce_axes = self._gradient_axes()
        params = jax.tree.map(lambda p, axes: jax.lax.pcast(p, axes, to="varying"), params, reduce_axes,
                              is_leaf=lambda x: isinstance(x, tuple))

        if self.pipeline is not None:  # GPipe: one forward and backward through all M microbatches
            def loss_fn(p):
                model = nnx.merge(self.graphdef, p)
                return pipelined_loss(model, self.objective, batch_M, self.pipeline, counts, keys_MB=keys_MB) * scale

            loss, grads = jax.value_and_grad(loss_fn)(params)
        else:  # gradient accumulation: one microbatch's activations alive at a time
            def micro_grads(batch_B, keys_B):
                loss_fn = lambda p: micro_loss(self.objective, nnx.merge(self.graphdef, p), batch_B, counts,
                                               keys_B=keys_B) * scale
                return jax.value_and_grad(loss_fn)(params)

            if m == 1:  # no accumulator: zeroing and adding it are two more passes over every gradient
                loss, grads = micro_grads(jax.tree.map(lambda a: a[0], batch_M),
                                          None if keys_MB is None else keys_MB[0])
            else:
                def micro(carry, inputs):
                    return jax.tree.map(jnp.add, carry, micro_grads(*inputs)), None

                zeros = (jax.lax.pcast(jnp.zeros((), jnp.float32), (DATA, PIPELINE), to="varying"),
                         jax.tree.map(jnp.zeros_like, params))
                (loss, grads), _ = jax.lax.scan(micro, zeros, (batch_M, keys_MB))
        # The data-parallel gradient all-reduce, once per step after accumulation; parameters that every stage
        # holds (embeddings, final LN) also sum their per-stage parts over "pipeline", and with sequence parallelism
        # the layers' replicated LayerNorms and biases their per-rank (per-rows) parts over "model".
        grads = jax.tree.map(lambda g, axes: jax.lax.psum(g, axes), grads, reduce_axes,
                             is_leaf=lambda x: isinstance(x, tuple))
        return jax.lax.psum(loss, (DATA, PIPELINE)) / scale, grads

    def _gradient_axes(self):
        """Per parameter, the mesh axes its gradient is summed over once per step (and its copy cast to vary over
        inside the step, so autodiff inserts no earlier reduction): "data" always; "pipeline" for the parameters
        every stage holds; "model" for the layers' replicated LayerNorms and biases under sequence parallelism, which
        each rank applies to its own rows only (Megatron's all-reduce of the sequence-parallel LayerNorm gradients).
        Not the heads' replicated parameters: they act on the gathered, identical rows."""
        sp = sequence_parallel_mode(self.cfg) is not None

        def axes(path, spec):
            layer_replicated = sp and jax.tree_util.keystr(path).startswith("['layers']") and MODEL not in spec
            return (DATA, *(() if PIPELINE in spec else (PIPELINE,)), *((MODEL,) if layer_replicated else ()))

        return jax.tree_util.tree_map_with_path(axes, self.param_specs, is_leaf=lambda x: isinstance(x, P))

    # ---- jitted ----
    @property
    def num_microbatches(self) -> int:
        return num_microbatches(self.cfg, self.mesh)

    def loss_and_grads(self, params, batch, step, scale=1.0):
        """Global mean loss and gradients (of loss x scale) of one step's batch (GPT: (G, S + 1) tokens; BERT: a dict
        of (G, ...) fields); params and gradients in their stored (canonical) layout."""
        key = jax.random.fold_in(jax.random.key(self.cfg.training.seed), step)
        loss, grads = jax.shard_map(
            self._local_loss_and_grads, mesh=self.mesh,
            in_specs=(self.param_specs, P(DATA), P(), P()), out_specs=(P(), self.param_specs),
        )(self.stage_params(params), batch, key, jnp.asarray(scale, jnp.float32))
        return loss, self._canonical_grads(grads)

    def _train_step(self, state: TrainState, batch):
        t = self.cfg.training
        loss, grads = self.loss_and_grads(state.params, batch, state.step, state.loss_scale.scale)
        if t.fp16:  # undo the loss scale (bf16/fp32 train at scale 1: no extra pass over the gradients)
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

    def stage_params(self, params):
        """Uneven pipeline stages: the layer stack regathered into equal per-stage slots, split over "pipeline"."""
        if self.pipeline is None or not self.pipeline.padded:
            return params
        def regather(a, spec):  # whole stack on every stage -> slots -> each stage keeps its own
            whole = jax.sharding.reshard(a, NamedSharding(self.mesh, P(None, *spec[1:])))
            return jax.sharding.reshard(to_slots(whole, self.pipeline), NamedSharding(self.mesh, spec))

        return _map_layers(regather, params, self.param_specs)

    def _canonical_grads(self, grads):
        if self.pipeline is None or not self.pipeline.padded:
            return grads
        storage = named_shardings(self.abstract_params, self.mesh)

        def scatter_back(path, g, spec, sharding):  # slots -> whole stack -> stored like the parameter
            if not jax.tree_util.keystr(path).startswith("['layers']"):
                return g
            whole = jax.sharding.reshard(g, NamedSharding(self.mesh, P(None, *spec[1:])))
            return jax.sharding.reshard(from_slots(whole, self.pipeline), sharding)

        return jax.tree_util.tree_map_with_path(scatter_back, grads, self.param_specs, storage,
                                                is_leaf=lambda x: isinstance(x, P))

    def local_final_hidden(self, params, tokens_BS):
        """Inside shard_map: (B, S) ids -> (B, S, D) final hidden states (pipelined when the mesh has stages)."""
        model = nnx.merge(self.graphdef, params)
        if self.pipeline is None:  # one stage: the layers vary over the size-1 "pipeline" axis only by type
            return jax.lax.pmean(model(tokens_BS), PIPELINE)
        return pipelined_final_hidden(model, tokens_BS, Schedule(self.pipeline.counts, 1))

    def _eval_loss(self, params, tokens):
        """Mean next-token loss of a (B, S + 1) batch, no dropout."""

        def local(params, tokens):
            hidden = self.local_final_hidden(params, tokens[:, :-1])
            model = nnx.merge(self.graphdef, params)
            per_token = vocab_parallel_cross_entropy(model.embedding.attend(hidden), tokens[:, 1:],
                                                     vocab_size=self.cfg.model.vocab_size)
            return jax.lax.pmean(per_token.mean(), DATA)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.param_specs, P(DATA)), out_specs=P())(
            self.stage_params(params), tokens)

    def _eval_objective_loss(self, params, batch):
        """The training loss (BERT: MLM + SOP) of a batch of micro x DP sequences, no dropout, no gradient."""
        def local(params, batch):
            model = nnx.merge(self.graphdef, params)
            counts = self.objective.normalizers(batch)
            if self.pipeline is None:
                loss = micro_loss(self.objective, model, batch, counts)
            else:
                batch_M = jax.tree.map(lambda a: a[None], batch)
                loss = pipelined_loss(model, self.objective, batch_M, Schedule(self.pipeline.counts, 1), counts)
            return jax.lax.psum(loss, (DATA, PIPELINE))

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.param_specs, P(DATA)), out_specs=P())(
            self.stage_params(params), batch)

    def put_batch(self, batch_np):
        """A host batch (an array or a dict of arrays, leading axis G) -> global arrays split over "data" (the same
        global batch on every mesh).

        With several processes each one passes the same global batch and places only the rows its own devices hold.
        """
        if jax.process_count() == 1:
            return jax.tree.map(lambda a: jax.device_put(a, self.batch_sharding), batch_np)
        return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, self.batch_sharding, lambda i: a[i]),
                            batch_np)
