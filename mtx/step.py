"""The training step: one shard_map over the whole mesh for loss and gradients, optax and loss scaling outside.

Inside the shard_map every collective is explicit: the model's f/g over "model", and exactly one gradient all-reduce
over "data" per step, after all microbatches are accumulated (with the distributed optimizer, a reduce-scatter of
the gradients and, before the forward, an all-gather of the parameters' shards; with --overlap-grad-reduce the layer
stack's share of them runs inside each layer's backward and forward instead: mtx/parallel/overlap.py). Each data
rank differentiates its own copy of the parameters (cast to "varying" over "data" before the loss), so autodiff
inserts no hidden reduction per microbatch.

A batch is a pytree of arrays with the global batch as leading axis (GPT: one (G, S + 1) token array; BERT: a dict
of fields); the model family's objective (mtx/objectives.py) says how a microbatch becomes its share of the loss.
The model, its layouts and batch placement are the ShardedModel's (mtx/sharded_model.py); the state's (mtx/state.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from mtx.layer_calls import LayerCalls
from mtx.objectives import micro_loss
from mtx.optim import learning_rate_schedule
from mtx.parallel.mesh import BATCH, DATA, MODEL, PIPELINE
from mtx.parallel.one_f_one_b import one_f_one_b
from mtx.parallel.overlap import LayerReduction, accumulator, gather_shard, layer_hook, reduction_kind
from mtx.parallel.pipeline import pipelined_loss
from mtx.parallel.random import rank_sample_keys, step_key
from mtx.parallel.ops import vary
from mtx.parallel.sharded import data_dim, is_stacked, map_specs
from mtx.sharded_model import DTYPES, ShardedModel
from mtx.state import TrainState, abstract_state, init_state, optimizer_for


def gradient_axes(param_specs, stored_specs, sequence_parallel: bool, replicated_groups):
    """Per parameter, the mesh axes its gradient is summed over once per step (and its copy cast to vary over inside
    the step, so autodiff inserts no earlier reduction): "data" always; "pipeline" for the parameters every stage
    holds (those not in the layer stack, and a stack that P does not divide, stored whole on every stage); "model"
    for the layer stack's replicated LayerNorms and biases under sequence parallelism, which each rank applies to its
    own rows only (Megatron's all-reduce of the sequence-parallel LayerNorm gradients), and for the parameters
    flagged in `replicated_groups` (a tree like the specs: grouped-query attention's key/value groups replicated
    because G < TP, of which each rank uses its own). Not the heads' replicated parameters: they act on the
    gathered, identical rows."""
    def axes(spec, stored, local):
        per_rank = local or (sequence_parallel and is_stacked(spec) and MODEL not in spec)
        return (DATA, *(() if is_stacked(stored) else (PIPELINE,)), *((MODEL,) if per_rank else ()))

    return jax.tree.map(axes, param_specs, stored_specs, replicated_groups, is_leaf=lambda x: isinstance(x, P))


def _reduce(g, axes, dim):
    """One parameter's gradient summed over `axes`; over "data" a reduce-scatter along `dim` when it is not None
    (the distributed optimizer's shard), else part of one all-reduce."""
    if dim is None:
        return jax.lax.psum(g, axes)
    g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
    return _reduce_rest(g, axes)


def _reduce_rest(g, axes):
    """One parameter's gradient summed over `axes` but "data" (reduced already)."""
    rest = tuple(axis for axis in axes if axis != DATA)
    return jax.lax.psum(g, rest) if rest else g


def _zeros(g) -> jax.Array:
    """The entries of g that are exactly 0, counted in int32 (a sharded tensor's count is one scalar summed over its
    shards), as float32 for the sum over tensors: exact up to 2^24 zeros, float32's nearest value beyond."""
    return jnp.sum(g == 0, dtype=jnp.int32).astype(jnp.float32)


def compiler_options(cfg) -> dict | None:
    """XLA options of the training step's compilation: --scheduler-memory-percent as XLA's slop factor (on CPU it
    is ignored)."""
    percent = cfg.training.scheduler_memory_percent
    return None if percent is None else {"xla_gpu_memory_limit_slop_factor": percent}


class TrainStep:
    """The compiled training step of one ShardedModel: `state, metrics = step(state, batch)` (the state is donated)."""

    def __init__(self, model: ShardedModel):
        self.model, self.cfg, self.mesh = model, model.cfg, model.mesh
        self.optimizer = optimizer_for(model)
        self.lr_schedule = learning_rate_schedule(self.cfg.optimizer, self.cfg.training.train_iters)
        self.compiler_options = compiler_options(self.cfg)
        self._step = jax.jit(self._train_step, donate_argnums=0, compiler_options=self.compiler_options)
        # Per parameter, the mesh axes its gradient is summed over (`gradient_axes`)
        self.reduce_axes = gradient_axes(model.param_specs, model.master_specs, self.cfg.sequence_parallel,
                                         model.replicated_groups)
        self._calls = LayerCalls(self) if self.cfg.training.layer_calls else None  # --layer-calls

    @classmethod
    def build(cls, cfg, mesh) -> "TrainStep":
        """The training step of a new ShardedModel of (cfg, mesh)."""
        return cls(ShardedModel(cfg, mesh))

    def __call__(self, state: TrainState, batch):
        return self._step(state, batch) if self._calls is None else self._calls.step(state, batch)

    def init_state(self) -> TrainState:
        return init_state(self.model)

    def abstract_state(self) -> TrainState:
        return abstract_state(self.model)

    # ---- inside shard_map ----
    def _local_loss_and_grads(self, params, batch, key, scale):
        """This data rank's share of the batch -> (global mean loss, global mean grads), both reduced over "data"
        (and, for parameters every pipeline stage holds, over "pipeline")."""
        model, cfg = self.model, self.cfg
        m, b = model.num_microbatches, cfg.training.micro_batch_size
        rows = jax.tree.leaves(batch)[0].shape[0]
        batch_M = jax.tree.map(lambda a: a.reshape(m, b, *a.shape[1:]), batch)
        counts = model.objective.normalizers(batch)  # the step's global counts the loss is averaged over
        # Dropout keys follow the sequence (its global batch position), not the rank.
        keys_MB = (jax.vmap(lambda i: rank_sample_keys(key, rows, i * b, b))(jnp.arange(m)) if cfg.model.has_dropout
                   else None)
        # Each rank differentiates its own copy: gradients stay local until the explicit reductions below.
        reduce_axes = self.reduce_axes
        kinds = self._reduction_kinds()
        # With --overlap-grad-reduce the layer stack stays invariant over "data" (replicated optimizer) or takes its
        # shards (distributed): each layer's reduction then happens in the backward (mtx/parallel/overlap.py).
        vary_axes = jax.tree.map(lambda axes, kind: tuple(a for a in axes if kind != "all_reduce" or a != DATA),
                                 reduce_axes, kinds, is_leaf=lambda x: isinstance(x, tuple))
        shards = jax.tree.map(vary, params, vary_axes, is_leaf=lambda x: isinstance(x, tuple))
        gathered = map_specs(lambda p, spec, master, kind: p if kind == "gather" else self._gather_master(
            p, spec, master), shards, model.param_specs, model.master_specs, kinds)
        params = map_specs(lambda p, spec, shard, kind: shard if kind in ("gather", "reduce_scatter") else p,
                           gathered, model.param_specs, shards, kinds)
        if model.pipeline is not None and model.pipeline.regathered:  # uneven or virtual stages: the chunk slots
            # The exchange is linear: the slots' gradients (fp32, accumulated so; the slots themselves may be the
            # compute-dtype copies of `_gather_master`) go back through its transpose, taken at fp32.
            to_stored = jax.linear_transpose(model.local_slots, jax.tree.map(accumulator, params))
            params = model.local_slots(params)
        else:
            to_stored = lambda grads: (grads,)
        merge = self._merge_with(kinds, gathered, model.master_specs)

        if model.pipeline is not None and model.pipeline.kind != "gpipe":  # 1F1B: the backward written out
            loss, grads = one_f_one_b(model.graphdef, params, model.objective, batch_M, model.pipeline, counts,
                                      keys_MB=keys_MB, scale=scale, seq_length=cfg.model.seq_length)
        elif model.pipeline is not None:  # GPipe: autodiff through one forward over all M microbatches
            def loss_fn(p):
                return pipelined_loss(merge(p), model.objective, batch_M, model.pipeline, counts,
                                      keys_MB=keys_MB) * scale

            loss, grads = jax.value_and_grad(loss_fn)(params)
        else:  # gradient accumulation: one microbatch's activations alive at a time
            def micro_grads(p, merge, inputs):
                batch_B, keys_B = inputs
                loss_fn = lambda p: micro_loss(model.objective, merge(p), batch_B, counts, keys_B=keys_B) * scale
                return jax.value_and_grad(loss_fn)(p)

            inputs_M = (batch_M, keys_MB)
            if m == 1:  # no accumulator: zeroing and adding it are two more passes over every gradient
                loss, grads = micro_grads(params, merge, jax.tree.map(lambda a: a[0], inputs_M))
            elif not cfg.parallel.overlap_grad_reduce:
                def micro(carry, inputs):
                    return jax.tree.map(jnp.add, carry, micro_grads(params, merge, inputs)), None

                zeros = (jax.lax.pcast(jnp.zeros((), jnp.float32), (DATA, PIPELINE), to="varying"),
                         jax.tree.map(accumulator, params))
                (loss, grads), _ = jax.lax.scan(micro, zeros, inputs_M)
            else:
                loss, grads = self._accumulate_then_reduce(params, gathered, kinds, inputs_M, micro_grads)
        grads, = to_stored(grads)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, shards)  # from the compute-dtype copies: fp32
        # The data-parallel gradient all-reduce, once per step after accumulation; parameters that every stage
        # holds (embeddings, final LN) also sum their per-stage parts over "pipeline", and with sequence parallelism
        # the layers' replicated LayerNorms and biases their per-rank (per-rows) parts over "model", as do
        # replicated key/value groups (each rank's from the heads it holds).
        # With the distributed optimizer the "data" part is a reduce-scatter: each rank keeps the sum of its shard.
        grads = map_specs(lambda g, master, axes, kind: _reduce(g, axes, data_dim(master)) if kind == "after" else
                          _reduce_rest(g, axes), grads, model.master_specs, reduce_axes, kinds)
        return jax.lax.psum(loss, (DATA, PIPELINE)) / scale, grads

    def differentiated(self, params):
        """Inside shard_map, the copy of the (stored) parameters each rank differentiates: cast to vary over the axes
        its gradient is summed over, so autodiff inserts no reduction (--layer-calls' pieces, mtx/layer_calls.py)."""
        return jax.tree.map(vary, params, self.reduce_axes, is_leaf=lambda x: isinstance(x, tuple))

    def reduce_local(self, loss, grads):
        """Inside shard_map, this rank's loss share and local fp32 gradients (of `differentiated` parameters) ->
        the step's loss and gradients: the same sums as the fused step's, after the backward."""
        grads = map_specs(lambda g, master, axes: _reduce(g, axes, data_dim(master)), grads, self.model.master_specs,
                          self.reduce_axes)
        return jax.lax.psum(loss, (DATA, PIPELINE)), grads

    def _reduction_kinds(self):
        """Per parameter, where its "data" reduction happens: "after" the backward, or inside it, layer by layer
        (`reduction_kind`, with --overlap-grad-reduce)."""
        model, p = self.model, self.cfg.parallel
        if not p.overlap_grad_reduce:
            return jax.tree.map(lambda spec: "after", model.param_specs, is_leaf=lambda x: isinstance(x, P))
        return map_specs(lambda spec, master: reduction_kind(spec, master, distributed=p.use_distributed_optimizer,
                                                             param_gather=p.overlap_param_gather) or "after",
                         model.param_specs, model.master_specs)

    def _accumulate_then_reduce(self, params, gathered, kinds, inputs_M, micro_grads):
        """Gradient accumulation under --overlap-grad-reduce: only the last microbatch's backward reduces (as
        Megatron-LM's buckets do), each layer's gradient summed with what the earlier microbatches accumulated for it
        (`LayerReduction.pending`) just before that layer's reduction; the earlier ones accumulate the local gradients
        of the whole parameters. One scan, the last microbatch a branch of a `cond`, so that both kinds of microbatch
        share one set of activation buffers (on the CPU, XLA gave a loop body and the code after it separate ones)."""
        model = self.model
        m = model.num_microbatches
        gathered = self._whole(gathered, kinds)
        whole = model.local_slots(gathered)
        placeholder = jnp.zeros((), jnp.float32)
        # Where each parameter's step gradient ends up: "after" (and the distributed optimizer's shards, written into
        # the front of their own accumulator, which the last backward has read by then) in the accumulator;
        # all-reduced ones, invariant over "data" where the accumulator varies, in a second one.
        dims = map_specs(lambda spec, master: data_dim(master), model.param_specs, model.master_specs)
        own = lambda kind: kind == "all_reduce"

        def accumulate(acc, reduced, inputs):
            loss, grads = micro_grads(whole, model.merge, inputs)
            return loss, jax.tree.map(jnp.add, acc, grads), jax.tree.map(jnp.zeros_like, reduced)

        def reduce_last(acc, reduced, inputs):
            merge = self._merge_with(kinds, gathered, model.master_specs, pending=acc["layers"])
            loss, grads = micro_grads(params, merge, inputs)

            def place(a, g, kind, dim):
                if kind == "after":
                    return a + g
                if own(kind):
                    return jnp.zeros_like(a)
                return jax.lax.dynamic_update_slice_in_dim(a, g, 0, dim)

            acc = jax.tree.map(place, acc, grads, kinds, dims)
            return loss, acc, jax.tree.map(lambda g, kind: g if own(kind) else placeholder, grads, kinds)

        def micro(carry, inputs):
            loss, acc, reduced = carry
            i, inputs = inputs
            step_loss, acc, reduced = jax.lax.cond(i == m - 1, reduce_last, accumulate, acc, reduced, inputs)
            return (loss + step_loss, acc, reduced), None

        zeros = (jax.lax.pcast(jnp.zeros((), jnp.float32), (DATA, PIPELINE), to="varying"),
                 jax.tree.map(accumulator, whole),
                 jax.tree.map(lambda p, kind: jnp.zeros_like(p) if own(kind) else placeholder, params, kinds))
        (loss, acc, reduced), _ = jax.lax.scan(micro, zeros, (jnp.arange(m), inputs_M))

        def result(a, r, p, kind, dim):
            if kind == "after":
                return a
            return r if own(kind) else jax.lax.slice_in_dim(a, 0, p.shape[dim], axis=dim)

        return loss, jax.tree.map(result, acc, reduced, params, kinds, dims)

    def _whole(self, gathered, kinds):
        """The whole parameters (each leaf of `gathered`, the parameters gathered before the forward, with those that
        --overlap-param-gather gathers inside the layers gathered too), varying over "data": what the microbatches
        before the last differentiate under --overlap-grad-reduce (their gradients stay local)."""
        model = self.model
        return map_specs(lambda p, spec, master, kind: vary(self._gather_master(p, spec, master) if kind == "gather"
                                                            else p, (DATA,)),
                         gathered, model.param_specs, model.master_specs, kinds)

    def _merge_with(self, kinds, gathered, master_specs, pending=None):
        """`model.merge`, with the layer stack's overlapped reductions when there are any; with `pending` (the layer
        stack's gradients accumulated over the earlier microbatches) each layer reduces its sum with them, the
        parameters all gathered before the forward (`gathered`: whole)."""
        model = self.model
        if not self.cfg.parallel.overlap_grad_reduce:
            return model.merge
        compute = DTYPES[self.cfg.training.compute_dtype]
        if pending is not None:
            kinds = jax.tree.map(lambda kind: "reduce_scatter" if kind == "gather" else kind, kinds)

        def reduction(kind, spec, master, whole, acc):
            dim = data_dim(master)
            return LayerReduction(kind, None if dim is None else dim - 1, self._wire_dtype(whole, spec, compute),
                                  whole if kind == "reduce_scatter" else None, None if pending is None else acc)

        plan = map_specs(reduction, kinds["layers"], model.param_specs["layers"], master_specs["layers"],
                         gathered["layers"], kinds["layers"] if pending is None else pending)
        hook = layer_hook(jax.tree.leaves(plan, is_leaf=lambda x: isinstance(x, LayerReduction)))

        def merge(params):
            local = model.merge(params)
            local.stack = dataclasses.replace(local.stack, per_layer=hook)
            return local

        return merge

    @staticmethod
    def _wire_dtype(p, spec, compute):
        """The dtype a parameter's all-gather sends: the compute dtype for matrices, which is what the forward casts
        them to anyway (half the bytes in bf16), else its own."""
        return compute if p.ndim - is_stacked(spec) >= 2 else p.dtype

    def _gather_master(self, p, spec, master):
        """Inside shard_map, the distributed optimizer's all-gather over "data" of one parameter's master shard (laid
        out by `master`, its spec in the training state; a parameter not split over "data" is returned as is).
        Matrices go in the compute dtype, which is what the forward casts them to anyway (half the bytes in bf16).
        The layer stack's stay in it: the copy the step's microbatches share is then half the size, and each
        microbatch's gradient of it is the same compute-dtype cotangent that the cast back would have passed on,
        accumulated in fp32 (`accumulator`, mtx/parallel/overlap.py). Other parameters (the
        embeddings, whose gradients sum over positions) and GPipe's (autodiff through its ticks sums each
        parameter's gradient in the parameter's dtype) are cast back."""
        dim = data_dim(master)
        if dim is None:
            return p
        pipeline = self.model.pipeline
        keep = is_stacked(spec) and (pipeline is None or pipeline.kind != "gpipe")
        return gather_shard(p, dim, self._wire_dtype(p, spec, DTYPES[self.cfg.training.compute_dtype]), keep)

    # ---- jitted ----
    def loss_and_grads(self, params, batch, step, scale=1.0):
        """Global mean loss and gradients (of loss x scale) of one step's batch (GPT: (G, S + 1) tokens; BERT: a dict
        of (G, ...) fields); params and gradients in their stored (canonical) layout."""
        model = self.model
        key = step_key(self.cfg.training.seed, step)
        loss, grads = jax.shard_map(
            self._local_loss_and_grads, mesh=self.mesh,
            in_specs=(model.master_specs, BATCH, P(), P()), out_specs=(P(), model.master_specs),
        )(params, batch, key, jnp.asarray(scale, jnp.float32))
        return loss, grads

    def _train_step(self, state: TrainState, batch):
        loss, grads = self.loss_and_grads(state.params, batch, state.step, state.loss_scale.scale)
        return self.update(state, loss, grads)

    def update(self, state: TrainState, loss, grads):
        """The step's optimizer update from its loss and the gradients of loss x the loss scale -> (state, metrics)."""
        t = self.cfg.training
        if t.fp16:  # undo the loss scale (bf16/fp32 train at scale 1: no extra pass over the gradients)
            grads = jax.tree.map(lambda g: g / state.loss_scale.scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params,
                                                   count=state.step - state.loss_scale.skipped)
        params = optax.apply_updates(state.params, updates)
        if t.fp16:  # overflow: keep the old weights and optimizer state, halve the scale
            keep_new = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep_new(params, state.params), keep_new(opt_state, state.opt_state)
        loss_scale = state.loss_scale.update(finite, t)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.lr_schedule(state.step - state.loss_scale.skipped),
            "loss_scale": state.loss_scale.scale,
            "skipped": ~finite,
        }
        if self.cfg.logging.log_params_norm:  # Megatron's params norm: the weights the step leaves
            metrics["params_norm"] = optax.tree.norm(params)
        if self.cfg.logging.log_num_zeros_in_grad:
            zeros = sum(_zeros(g) for g in jax.tree.leaves(grads))
            metrics["num_zeros"] = jnp.where(finite, zeros, jnp.nan)  # a skipped step's: none (Megatron's None)
        return TrainState(state.step + 1, params, opt_state, loss_scale), metrics

