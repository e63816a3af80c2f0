"""One model on one mesh: what training, evaluation, generation and conversion all need of it.

A `ShardedModel` holds the config and mesh, the NNX graph and each parameter's declared layout, the pipeline
schedule, where batches go, and the sharded computations that every caller shares: the forward to final hidden
states (evaluation, scoring) and the evaluation loss (GPT's next-token loss and BERT's MLM + SOP alike, through the
model family's objective, mtx/objectives.py). It holds no optimizer: the training step (mtx/step.py) adds that.

Parameters cross the boundary as global arrays in their stored (canonical) layout: the layer stack in layer order,
split into contiguous blocks over "pipeline". Inside the training step, `local_slots` fills each device's equal chunk
slots from it when an uneven layout or virtual stages need them (moving only the layers stored elsewhere), and
autodiff brings the gradients back. Forward-only uses (evaluation, scoring, decoding) run GPipe's forward ticks with
one contiguous stage per device (`forward_pipeline`, laid out by `forward_params`), whatever schedule trains. A
parameter is part of the layer stack exactly when its declared spec has the "pipeline" axis.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.models.bert import BERT
from mtx.models.gpt import GPT
from mtx.objectives import micro_loss, objective_for
from mtx.parallel.mesh import BATCH, DATA, MODEL, PIPELINE
from mtx.parallel.pipeline import Schedule, SlotExchange, pipelined_final_hidden, pipelined_loss, to_slots
from mtx.parallel.sharded import (fit_spec, init_sharded, is_stacked, map_specs, named_shardings,
                                  partition_specs, replicated_groups, shard_over, split_abstract, with_axis)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def build_model(cfg: Config, *, seed: int | None = None):
    """A zero-argument constructor of the GPT or BERT this config describes (called abstractly or under jit)."""
    seed = cfg.training.seed if seed is None else seed
    t = cfg.training
    family = BERT if cfg.model.is_bert else GPT
    return lambda: family(cfg.model, dtype=DTYPES[t.compute_dtype], recompute=t.recompute_granularity,
                          recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
                          flash=t.use_flash_attn, scan_layers=t.scan_layers,
                          sequence_parallel=cfg.sequence_parallel, tp_comm_overlap=cfg.tp_comm_overlap,
                          rngs=nnx.Rngs(seed))


def num_microbatches(cfg: Config, mesh) -> int:
    """Microbatches per data rank and step: global batch / (micro batch x data-parallel size)."""
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * mesh.shape[DATA])


class ShardedModel:
    """The model of one (config, mesh) pair: graph, parameter layouts, batch placement and its sharded forwards."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.make_model = build_model(cfg)
        self.graphdef, self.abstract_params = split_abstract(self.make_model)
        tp = mesh.shape[MODEL]
        self.param_specs = partition_specs(self.abstract_params, tp)  # as declared; the shard_map's in/out specs
        self.param_shardings = named_shardings(self.abstract_params, mesh)  # as stored on this mesh
        self.replicated_groups = replicated_groups(self.abstract_params, tp)  # key/value groups when G < TP
        # The distributed optimizer (--use-distributed-optimizer) also splits each parameter over "data" in the
        # training state, fp32 master weights and Adam's moments alike, along one more dimension (`data_dim`).
        data = mesh.shape[DATA] if cfg.parallel.use_distributed_optimizer else 1
        self.master_specs = map_specs(  # the training state's layout, and the training step's shard_map specs
            lambda spec, x: with_axis(spec, shard_over(spec, x.shape, DATA, data), DATA, x.ndim),
            map_specs(lambda spec, x: fit_spec(spec, x.shape, mesh), self.param_specs, self.abstract_params),
            self.abstract_params)
        self.master_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.master_specs,
                                             is_leaf=lambda x: isinstance(x, P))
        self.num_microbatches = num_microbatches(cfg, mesh)
        self.pipeline = (Schedule(cfg.stage_layer_counts(), self.num_microbatches, cfg.virtual_stages, cfg.schedule)
                         if mesh.shape[PIPELINE] > 1 else None)
        self.forward_pipeline = None if self.pipeline is None else self.pipeline.forward_only()
        self.objective = objective_for(cfg)
        self.batch_sharding = NamedSharding(mesh, BATCH)
        self.eval_loss = jax.jit(self._eval_loss)
        self.eval_counts = jax.jit(self._eval_counts)

    def merge(self, params) -> nnx.Module:
        """The local model of these (local) parameters, inside shard_map."""
        return nnx.merge(self.graphdef, params)

    def init_params(self):
        """The initial parameters, built directly in their shardings (values independent of the mesh)."""
        return init_sharded(self.make_model, self.mesh)[1]

    @functools.cached_property
    def for_decoding(self) -> "ShardedModel":
        """The same model and mesh with sequence parallelism off (decoding runs whole rows); same parameters."""
        if not self.cfg.sequence_parallel:
            return self
        return ShardedModel(self.cfg.replace(sequence_parallel=False), self.mesh)

    # ---- layouts ----
    def forward_params(self, params):
        """`params` laid out for the forward-only schedule (evaluation, scoring, decoding): with uneven or virtual
        stages, the layer stack regathered into equal per-device slots of contiguous layers, split over "pipeline"."""
        schedule = self.forward_pipeline
        if schedule is None or not schedule.regathered:
            return params

        def regather(a, spec):  # whole stack on every stage -> slots -> each stage keeps its own
            if not is_stacked(spec):
                return a
            whole = jax.sharding.reshard(a, NamedSharding(self.mesh, P(None, *spec[1:])))
            return jax.sharding.reshard(to_slots(whole, schedule), NamedSharding(self.mesh, spec))

        return map_specs(regather, params, self.param_specs)

    def local_slots(self, params):
        """Inside the training step's shard_map: this device's stored parameters -> the same with the layer stack in
        its chunk slots for uneven or virtual stages (`SlotExchange`: only the layers stored on another device move,
        by `ppermute`); differentiable, so the slots' gradients pull back to the stored layout."""
        if self.pipeline is None or not self.pipeline.regathered:
            return params

        plans = {}  # one plan per stored layout (split in blocks, or whole), shared by the stacked parameters

        def slots(a, spec, stored):
            if not is_stacked(spec):
                return a
            rows = a.shape[0] if PIPELINE in stored else sum(self.pipeline.counts)
            if rows not in plans:
                plans[rows] = SlotExchange.plan(self.pipeline, rows)
            return plans[rows](a)

        return map_specs(slots, params, self.param_specs, self.master_specs)

    def host_rows(self, batch_size: int) -> HostRows:
        """The rows of a global batch of `batch_size` that this process's devices hold (all of them with one
        process): what a process needs to build (`dataset.batch(..., rows=...)`) and pass to `put_batch`."""
        return rows_held(self.batch_sharding, batch_size, lambda d: d.process_index == jax.process_index())

    def put_batch(self, batch_np, rows: HostRows | None = None):
        """A host batch (an array or a dict of arrays, leading axis G) -> global arrays split over "data" (the same
        global batch on every mesh). rows: the batch holds only these rows of the global batch (`host_rows`), as
        each process of a multi-process run builds only its own; None: the whole global batch.

        With several processes each one places only the rows its own devices hold.
        The objective checks the batch on the host first (`check_batch`: BERT's masked positions).
        """
        self.objective.check_batch(batch_np)
        if jax.process_count() == 1 and (rows is None or rows.whole):
            return jax.tree.map(lambda a: jax.device_put(a, self.batch_sharding), batch_np)
        def place(a):
            held = rows or HostRows(0, len(a), len(a))
            if len(a) != held.stop - held.start:
                raise ValueError(f"a batch part of {len(a)} rows for rows {held.start}..{held.stop} of {held.total}")
            return jax.make_array_from_callback((held.total, *a.shape[1:]), self.batch_sharding,
                                                lambda index: held.block(a, index))
        return jax.tree.map(place, batch_np)

    # ---- inside shard_map ----
    def local_final_hidden(self, params, tokens_BS):
        """Inside shard_map: (B, S) ids -> (B, S, D) final hidden states (pipelined when the mesh has stages);
        params laid out by `forward_params`."""
        model = self.merge(params)
        if self.pipeline is None:  # one stage: the layers vary over the size-1 "pipeline" axis only by type
            return jax.lax.pmean(model(tokens_BS), PIPELINE)
        return pipelined_final_hidden(model, tokens_BS, self.forward_pipeline)

    def _local_eval_loss(self, params, batch, counts):
        objective = self.objective.for_evaluation()
        model = self.merge(params)
        counts = objective.normalizers(batch) if counts is None else counts
        if self.pipeline is None:
            loss = micro_loss(objective, model, batch, counts)
        else:
            batch_M = jax.tree.map(lambda a: a[None], batch)
            loss = pipelined_loss(model, objective, batch_M, self.forward_pipeline, counts)
        return jax.lax.psum(loss, (DATA, PIPELINE))

    # ---- jitted ----
    def _eval_loss(self, params, batch, counts=None):
        """The loss of one batch (GPT: mean next-token loss; BERT: MLM + SOP), no dropout, no gradient. counts: the
        normalizers (`eval_counts`) of a larger batch this one is a part of, whose loss is then the sum of its parts'
        (evaluated a part at a time, as training runs microbatches); None: this batch's own."""
        return jax.shard_map(self._local_eval_loss, mesh=self.mesh, in_specs=(self.param_specs, BATCH, P()),
                             out_specs=P())(self.forward_params(params), batch, counts)

    def _eval_counts(self, batch):
        """The loss's normalizers of a batch (its predicted tokens; BERT's masked tokens and sequences), float32: the
        counts of a batch evaluated in parts are the sums of its parts' (each at least 1 where the objective keeps a
        loss without targets finite)."""
        counts = jax.shard_map(self.objective.for_evaluation().normalizers, mesh=self.mesh, in_specs=BATCH,
                               out_specs=P())(batch)
        return jax.tree.map(lambda c: jnp.asarray(c, jnp.float32), counts)  # (summed over parts: no int32 bound)


class HostRows(NamedTuple):
    """Rows [start, stop) of a global batch of `total` rows."""

    start: int
    stop: int
    total: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.total

    def block(self, rows_np, index: tuple[slice, ...]):
        """The global batch's block `index` (slices, as `jax.make_array_from_callback` asks) out of `rows_np`, which
        holds these rows of it."""
        first = index[0]
        stop = self.total if first.stop is None else first.stop
        return rows_np[(slice((first.start or 0) - self.start, stop - self.start), *index[1:])]


def rows_held(sharding, batch_size: int, mine) -> HostRows:
    """The smallest run of rows of a (batch_size, ...) array under `sharding` that covers every block held by the
    devices for which mine(device) is true (a process's devices: one run when the "data" ranks of a process are
    neighbours, as the meshes of mtx.parallel.mesh place them)."""
    blocks = [index[0] for device, index in sharding.devices_indices_map((batch_size,)).items() if mine(device)]
    if not blocks:
        raise ValueError("this process holds none of the mesh's devices; every process must own part of the mesh.")
    start = min(block.start or 0 for block in blocks)
    stop = max(batch_size if block.stop is None else block.stop for block in blocks)
    return HostRows(start, stop, batch_size)
