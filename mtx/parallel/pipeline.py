"""Pipeline parallelism (GPipe) as one microbatched scan over the "pipeline" mesh axis, inside the step's shard_map.

Stage s holds the layers of its slice of the layer stack (the stack's leading axis is declared "pipeline"). The
global batch of a data rank is cut into M microbatches. Every schedule runs on `lockstep`, one `lax.scan` of ticks:
the work of a tick is the schedule's, the shifts along the ring after it (`ppermute` over "pipeline") are the
primitive's. GPipe's `pipeline_ticks` runs M + P - 1 ticks; at tick t every stage s runs microbatch t - s (ticks
outside 0..M-1 are the bubble: computed, never used) and shifts its output to the next stage. The first stage feeds
embeddings in, the last stage's outputs are the final hidden states. Training (`pipelined_loss`), evaluation
(`pipelined_final_hidden`) and cached decoding (`pipelined_decode`, M = 1, the KV cache carried through the ticks)
all run on it; 1F1B and interleaved 1F1B (mtx/parallel/one_f_one_b.py) run their forward and backward slots on
`lockstep` too, shifting activations forward and input gradients back. Autodiff through GPipe's scan is its backward;
per-layer recomputation (`--recompute-granularity full`) keeps one (b, S, D) input per layer and tick.

The loss is not computed on the last stage alone: its M outputs are reduce-scattered over "pipeline", so every stage
computes the logits and vocab-parallel loss of M / P microbatches (the logits are the costliest single matmul of a
GPT; this spreads them instead of leaving P - 1 stages idle). The tied embedding's gradient then has contributions
from every stage and the first; they meet in the psum over "pipeline" that every pipeline-replicated parameter gets
(Megatron's embedding-group all-reduce).

Uneven stages (a layout string, or first/last stage sizes) hold `max(layers per stage)` slots each; slots past a
stage's count are inactive (identity) layers, so every stage compiles to the same program.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtx.parallel.mesh import MODEL, PIPELINE
from mtx.parallel.ops import vary


class RealLayers(NamedTuple):
    """How many of a pipeline stage's held layers are real (a traced scalar; the rest are padding of an uneven
    layout), and the counts it can take (static, sorted)."""

    count: jax.Array
    choices: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """The static shape of one pipelined step: P stages (devices), each holding V layer chunks (virtual stages;
    virtual stage k = c P + s is chunk c of device s), M microbatches, and the schedule that runs them."""

    counts: tuple[int, ...]  # transformer layers of each virtual stage, P x V of them in pipeline order
    microbatches: int  # M, per data rank and step
    virtual: int = 1  # V, layer chunks per device
    kind: str = "gpipe"  # gpipe (autodiff through the tick scan) | 1f1b | interleaved (explicit backward)

    @property
    def stages(self) -> int:
        return len(self.counts) // self.virtual

    @property
    def slots(self) -> int:
        """Layer slots of every chunk (the largest virtual stage)."""
        return max(self.counts)

    @property
    def ticks(self) -> int:
        """GPipe: M + P - 1 forward ticks (and as many backward); 1F1B: one forward and one backward slot a tick
        until the last backward (V M + P V + P - 2 ticks when P divides M; mtx/parallel/one_f_one_b.py)."""
        p, v, m = self.stages, self.virtual, self.microbatches
        if self.kind == "gpipe":
            return m + p - 1
        u, g = (m - 1) % p, (m - 1) // p  # the last microbatch's backward on device 0, chunk 0, ends last
        return (p * v - 1) + (p - 1) + u + p * (v - 1) + p * v * g + 1

    @property
    def bubble(self) -> float:
        """The schedule's ideal idle fraction: (P - 1) / (V M + P - 1) when P divides M (GPipe and 1F1B: V = 1).
        For 1F1B in general, from the timetable: a tick lasts as long as its busiest device (a forward 1, a backward
        2 units), against 3 M units of work per device."""
        p, v, m = self.stages, self.virtual, self.microbatches
        if self.kind == "gpipe":
            return (p - 1) / (m + p - 1)
        table = self.timetable()
        ticks = (table["fwd_mb"] >= 0) * 1.0 + (table["bwd_mb"] >= 0) * 2.0  # (T, P), in chunk-forward units
        return 1.0 - 3.0 * v * m / ticks.max(axis=1).sum()

    @property
    def in_flight(self) -> int:
        """1F1B's ring size: the (microbatch, chunk) stage inputs a device keeps between forward and backward, the
        tick of each included (a tick runs its forward, then the head, then its backward); the sum over chunks of the
        most of each chunk alive at once. At most P V + P ceil(V / 2) - (V mod 2) <= 2 P V - 1 whatever M (equal once
        M >= 2 P V): on device s a pair of chunk c lives L = 2 P (V - c) - 1 - 2 s ticks and the chunk's forwards come P
        in a row every P V ticks, so at most P floor(L / P V) + min(P, L mod P V) are alive at once: P for each
        c >= V / 2, 2 P for each c < V / 2 but 2 P - 1 for c = (V - 1) / 2 when V is odd (tests/test_schedules.py)."""
        return len(self.ring()[0])

    @functools.cache  # (a Schedule is frozen: computed once, read-only arrays)
    def ring(self) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
        """1F1B's ring slots, grouped by chunk so that each slot holds one chunk's stage inputs only (its forward and
        backward branches then slice that chunk's layers at a static offset) -> (chunk of each slot, (T, P) slot
        each forward writes, (T, P) slot each backward reads; -1 where idle). Chunk c gets as many slots as the most
        of its (microbatch, chunk) pairs alive at once on any device; a device hands them out round-robin in the
        order of their forwards, which never reuses a slot before its backward (pairs of one chunk on one device all
        live the same number of ticks)."""
        p, v, m = self.stages, self.virtual, self.microbatches
        table = self.timetable()
        lives = {}  # (device, chunk) -> [(forward tick, backward tick)] in forward order
        for t_b, s in zip(*np.nonzero(table["bwd_mb"] >= 0)):
            t_f = int(table["bwd_saved_at"][t_b, s])
            lives.setdefault((int(s), int(table["fwd_chunk"][t_f, s])), []).append((t_f, int(t_b)))
        lives = {key: sorted(spans) for key, spans in lives.items()}
        width = [max((sum(f <= t <= b for f, b in lives.get((s, c), [])) for s in range(p) for t in range(self.ticks)),
                     default=0) for c in range(v)]
        offsets = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(int)
        fwd_slot, bwd_slot = np.full((self.ticks, p), -1, np.int32), np.full((self.ticks, p), -1, np.int32)
        for (s, c), spans in lives.items():
            freed = {}  # slot -> the tick of its last backward so far
            for n, (f, b) in enumerate(spans):
                slot = offsets[c] + n % width[c]
                assert freed.get(slot, -1) < f, "a ring slot reused before its backward"
                fwd_slot[f, s], bwd_slot[b, s], freed[slot] = slot, slot, b
        assert m == 0 or all(width), "every chunk runs"
        fwd_slot.flags.writeable = bwd_slot.flags.writeable = False
        return tuple(c for c in range(v) for _ in range(width[c])), fwd_slot, bwd_slot

    @functools.cache
    def timetable(self) -> dict[str, np.ndarray]:
        """1F1B: (T, P) tables of what each device does at each tick, fwd_mb, fwd_chunk, bwd_mb, bwd_chunk (-1 where
        idle), and bwd_saved_at, the tick of the forward whose input a backward needs; from the formulas in
        mtx/parallel/one_f_one_b.py."""
        p, v, m = self.stages, self.virtual, self.microbatches
        tables = {name: np.full((self.ticks, p), -1, np.int32) for name in ("fwd_mb", "fwd_chunk", "bwd_mb",
                                                                             "bwd_chunk", "bwd_saved_at")}
        for i in range(m):
            u, g = i % p, i // p
            for s in range(p):
                for c in range(v):
                    t_f = s + u + p * c + p * v * g
                    t_b = p * v - 1 + (p - 1 - s) + u + p * (v - 1 - c) + p * v * g
                    assert tables["fwd_mb"][t_f, s] == -1 and tables["bwd_mb"][t_b, s] == -1, "slot taken twice"
                    tables["fwd_mb"][t_f, s], tables["fwd_chunk"][t_f, s] = i, c
                    tables["bwd_mb"][t_b, s], tables["bwd_chunk"][t_b, s] = i, c
                    tables["bwd_saved_at"][t_b, s] = t_f
        for a in tables.values():
            a.flags.writeable = False
        return tables

    def forward_only(self) -> "Schedule":
        """One microbatch through GPipe's forward ticks on the same devices, for evaluation and decoding: with
        virtual stages, device s runs the contiguous layers of virtual stages s V .. s V + V - 1 instead."""
        v = self.virtual
        merged = tuple(sum(self.counts[s * v:(s + 1) * v]) for s in range(self.stages))
        return Schedule(merged, 1)

    @property
    def padded(self) -> bool:
        """True when virtual stages are uneven: padding slots are inactive (identity) layers."""
        return len(set(self.counts)) > 1

    @property
    def regathered(self) -> bool:
        """True when the stored layer stack is not already each device's contiguous slice: uneven or virtual
        stages, which `to_slots` lays out as (P x V x slots, ...) device-major."""
        return self.padded or self.virtual > 1

    def _device_major(self) -> list[int]:
        """Virtual stage indices in the order devices hold them: device 0's chunks, then device 1's, ..."""
        p, v = self.stages, self.virtual
        return [c * p + s for s in range(p) for c in range(v)]

    def slot_layers(self) -> np.ndarray:
        """(P V slots,) canonical layer index of every slot, device-major; padding slots repeat the chunk's first
        layer."""
        offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        return np.array([offsets[k] + min(i, max(self.counts[k] - 1, 0)) for k in self._device_major()
                         for i in range(self.slots)])

    def local_layers(self, chunk=0):
        """Inside shard_map: (global index of this device's chunk's first layer, how many of its slots are real
        layers, or None when the virtual stages are even), for ParallelTransformer's first_layer and real_layers."""
        k = chunk * self.stages + jax.lax.axis_index(PIPELINE)
        counts = jnp.asarray(self.counts)
        first_layer = jnp.concatenate([jnp.zeros((1,), counts.dtype), jnp.cumsum(counts)[:-1]])[k]
        return first_layer, (RealLayers(counts[k], tuple(sorted(set(self.counts)))) if self.padded else None)


def to_slots(layer_params, schedule: Schedule):
    """Canonical (L, ...) layer stack -> (P V slots, ...) per-device chunk slots (for uneven or virtual stages)."""
    index = jnp.asarray(schedule.slot_layers())
    return jax.tree.map(lambda a: a[index], layer_params)


@dataclass(frozen=True)
class SlotExchange:
    """How each device's chunk slots are filled from the stored layer stack inside shard_map, moving over "pipeline"
    only the layers stored on another device: the stack is stored split into contiguous (L / P, ...) blocks (or, when
    P does not divide L, whole on every device: then nothing moves).

    sends[o - 1]: (P, n_o) rows each device sends to the device o after it (padded with row 0 to the longest list;
    n_o = 0: no send);
    gather: (P, V slots) row of each slot in [own block, received from o = 1, ..., received from o = P - 1]."""

    sends: tuple[np.ndarray, ...]
    gather: np.ndarray

    @classmethod
    def plan(cls, schedule: Schedule, stored_rows: int) -> "SlotExchange":
        p, per_device = schedule.stages, schedule.virtual * schedule.slots  # suffix _PJ: stage, slot J of its own
        layers_PJ = schedule.slot_layers().reshape(p, per_device)
        if stored_rows != sum(schedule.counts):  # contiguous blocks of L / P layers
            source_PJ, row_PJ = np.divmod(layers_PJ, stored_rows)
        else:  # the whole stack on every device
            source_PJ, row_PJ = np.arange(p)[:, None] + 0 * layers_PJ, layers_PJ
        offset_PJ = (np.arange(p)[:, None] - source_PJ) % p
        wanted = [[row_PJ[(d + o) % p][offset_PJ[(d + o) % p] == o] for d in range(p)] for o in range(p)]
        width = [max(len(rows) for rows in wanted[o]) for o in range(p)]
        sends = tuple(np.array([np.pad(rows, (0, width[o] - len(rows))) for rows in wanted[o]], np.int32)
                      .reshape(p, width[o]) for o in range(1, p))
        starts = np.cumsum([0, stored_rows, *width[1:]])
        gather = np.zeros((p, per_device), np.int32)
        for d in range(p):
            for o in range(p):
                at = np.flatnonzero(offset_PJ[d] == o)
                gather[d, at] = row_PJ[d, at] if o == 0 else starts[o] + np.arange(len(at))
        return cls(sends, gather)

    def __call__(self, stored):
        """Inside shard_map: this device's stored (rows, ...) block -> its (V slots, ...) chunk slots. Differentiable:
        the gradients of the slots pull back to the stored block (the sends reversed)."""
        p = len(self.sends) + 1
        stage = jax.lax.axis_index(PIPELINE)
        received = [jax.lax.ppermute(jnp.take(stored, jnp.asarray(rows)[stage], axis=0), PIPELINE,
                                     [(s, (s + o) % p) for s in range(p)])
                    for o, rows in enumerate(self.sends, start=1) if rows.size]
        return jnp.take(jnp.concatenate([stored, *received]), jnp.asarray(self.gather)[stage], axis=0)


NEXT, PREVIOUS = 1, -1  # directions along the pipeline ring


def lockstep(work, received, carry, ticks: int, directions):
    """The pipeline's tick loop, shared by every schedule (GPipe, 1F1B, interleaved), evaluation and decoding: a
    `lax.scan` over `ticks` ticks; at tick t every device runs work(t, received, carry) -> (sent, carry, out), then
    each of `sent` moves one device along the ring in its direction (NEXT: stage s -> s + 1, the last stage to the
    first; PREVIOUS: s -> s - 1) by a `ppermute` and arrives as the next tick's `received`.

    `received` (what arrives before tick 0) types the shifted values; returns (final carry, the ticks' outs)."""
    p = jax.lax.axis_size(PIPELINE)
    pairs = {d: [(i, (i + d) % p) for i in range(p)] for d in set(directions)}

    def tick(state, t):
        sent, carry, out = work(t, *state)
        return (tuple(jax.lax.ppermute(x, PIPELINE, pairs[d]) for x, d in zip(sent, directions)), carry), out

    (_, carry), outs = jax.lax.scan(tick, (tuple(received), carry), jnp.arange(ticks))
    return carry, outs


def pipeline_ticks(stage_fn, inputs_M, schedule: Schedule, state=None):
    """The GPipe tick loop: M + P - 1 ticks; at tick t stage s runs microbatch t - s and sends its output on.

    stage_fn(x, mb, on_tick, state) -> (y, state): this stage's work on input x (stage 0: inputs_M[mb]; the others:
    what the previous stage sent at the tick before); mb is the microbatch index clamped to 0..M-1 and on_tick False
    in the bubble, where the result is never used. `state` (e.g. a stage's KV cache) is carried through the ticks.
    Returns ((M, ...) outputs of the last stage, meaningful on the last stage only; the final state).
    """
    stage = jax.lax.axis_index(PIPELINE)
    p, m = schedule.stages, schedule.microbatches

    def work(t, received, state):
        mb = t - stage
        x = jnp.where(stage == 0, inputs_M[jnp.clip(t, 0, m - 1)], received[0])  # what stage 0 receives is unused
        y, state = stage_fn(x, jnp.clip(mb, 0, m - 1), (mb >= 0) & (mb < m), state)
        return (y,), state, y

    init = vary(jnp.zeros_like(inputs_M[0]), [PIPELINE])  # what stage 0 "receives" before tick 0
    state, ys_T = lockstep(work, (init,), state, schedule.ticks, (NEXT,))
    return ys_T[p - 1:], state  # the last stage finishes microbatch t - (P - 1) at tick t


def _last_stage_to_all(x):
    """The last stage's value of x on every stage (a psum of x masked to the last stage)."""
    last = jax.lax.axis_index(PIPELINE) == jax.lax.axis_size(PIPELINE) - 1
    return jax.lax.psum(jnp.where(last, x, jnp.zeros((), x.dtype)), PIPELINE)


def last_stage_to_each(x):
    """The last stage's value of x on every stage, sent to each of the others by a ppermute of one pair (varying over
    "pipeline", where _last_stage_to_all's psum makes it invariant). Under autodiff the gradients come back the same
    way, summed on the last stage in x's dtype. For the spread head (mtx/parallel/one_f_one_b.py) the psum was an
    all-reduce of the (B, S, D) output (30 ms a step on one of 2 H200s, its waits included) and its transpose, met
    only where the fp32 LayerNorm read the invariant value, an fp32 all-reduce (docs/benchmarks.md 4l, 4m)."""
    p, stage = jax.lax.axis_size(PIPELINE), jax.lax.axis_index(PIPELINE)
    out = x
    for k in range(p - 1):
        out = jnp.where(stage == k, jax.lax.ppermute(x, PIPELINE, [(p - 1, k)]), out)
    return out


def _pipelined_hidden(model, x0_MBSD, schedule: Schedule, *, keys_MB=None, mask_MBS=None):
    """Runs this stage's layers over the M microbatches, GPipe style; returns (M, B, S, D) final-layer outputs (B / tp
    rows each with sequence parallelism), meaningful on the last stage only. `model` is the local (this stage's)
    model; x0 the embeddings; mask_MBS the padding masks (BERT), which every stage reads for the microbatch it is
    running."""
    first_layer, real_layers = schedule.local_layers()

    def stage_fn(x_BSD, mb, on_tick, state):
        keys_B = None if keys_MB is None else keys_MB[mb]
        mask_BS = None if mask_MBS is None else mask_MBS[mb]
        return model.transform(x_BSD, mask_BS=mask_BS, keys_B=keys_B, first_layer=first_layer,
                               real_layers=real_layers), state

    return pipeline_ticks(stage_fn, x0_MBSD, schedule)[0]


def pipelined_loss(model, objective, batch_M, schedule: Schedule, counts, *, keys_MB=None):
    """This stage's share of the step's loss over this data rank's M microbatches (a pytree of (M, B, ...) arrays,
    see mtx/objectives.py), computed for its M / P share of the outputs (summed over "pipeline" it is the rank's
    total). The embeddings are made for all M up front; the padding mask travels with each microbatch."""
    p, m = schedule.stages, schedule.microbatches
    b = jax.tree.leaves(batch_M)[0].shape[1]
    # With sequence parallelism each model rank embeds its rows of every microbatch: order the rows rank-major.
    rows = _rank_major if model.sequence_parallel else (lambda a: a.reshape(-1, *a.shape[2:]))
    x0 = objective.embed(model, jax.tree.map(rows, batch_M), None if keys_MB is None else rows(keys_MB))  # (M B, S, D)
    s = x0.shape[1]
    x0_MBSD = x0.reshape(m, x0.shape[0] // m, s, -1)  # (M, B / tp, S, D) with sequence parallelism
    mask = objective.attention_mask(jax.tree.map(lambda a: a.reshape(m * b, *a.shape[2:]), batch_M))
    mask_MBS = None if mask is None else mask.reshape(m, b, s)  # whole microbatches: the layers gather all rows
    hidden_MBSD = _pipelined_hidden(model, x0_MBSD, schedule, keys_MB=keys_MB, mask_MBS=mask_MBS)
    # Spread the last stage's outputs over all stages: M padded up to a multiple of P, M' / P microbatches each.
    share = math.ceil(m / p)
    last = jax.lax.axis_index(PIPELINE) == p - 1
    hidden_MBSD = jnp.where(last, hidden_MBSD, jnp.zeros((), hidden_MBSD.dtype))
    pad = [(0, share * p - m)] + [(0, 0)] * 3
    mine_MBSD = jax.lax.psum_scatter(jnp.pad(hidden_MBSD, pad), PIPELINE, scatter_dimension=0, tiled=True)
    stage = jax.lax.axis_index(PIPELINE)
    mine_batch = jax.tree.map(
        lambda a: rows(jax.lax.dynamic_slice_in_dim(jnp.pad(a, [(0, share * p - m)] + [(0, 0)] * (a.ndim - 1)),
                                                    stage * share, share)), batch_M)
    real_B = rows(jnp.repeat(((stage * share + jnp.arange(share)) < m)[:, None], b, axis=1))  # padding counts nothing
    # The head gathers the model ranks' rows (rank-major with sequence parallelism): mine_batch is in that order.
    return objective.head_loss(model, mine_MBSD.reshape(-1, s, mine_MBSD.shape[-1]), mine_batch, counts,
                               weight_B=real_B)


def _rank_major(a_MB):
    """(M, B, ...) -> (M * B, ...) ordered by model rank, then microbatch: rank r's rows of every microbatch (B / tp
    each, as sequence parallelism splits them) are one contiguous block."""
    tp = jax.lax.axis_size(MODEL)
    m, b = a_MB.shape[:2]
    return jnp.swapaxes(a_MB.reshape(m, tp, b // tp, *a_MB.shape[2:]), 0, 1).reshape(m * b, *a_MB.shape[2:])


def pipelined_final_hidden(model, tokens_BS, schedule: Schedule):
    """(B, S) ids -> (B, S, D) final hidden states after the final LayerNorm on every stage (no dropout), replicated
    over "model"; for evaluation, as one microbatch (`schedule`: `Schedule.forward_only`)."""
    hidden_BSD = _pipelined_hidden(model, model.embed(tokens_BS)[None], schedule)[0]
    return model.final_hidden(_last_stage_to_all(hidden_BSD))


def pipelined_decode(model, x_BTD, cache, start_B, schedule: Schedule):
    """Cached decoding through the stages, one microbatch in P ticks: stage s runs its layers (and writes its KV
    cache) at tick s on what stage s - 1 sent; -> the last stage's output (B, T, D) on every stage, this stage's
    cache (`schedule`: `Schedule.forward_only`)."""
    _, real_layers = schedule.local_layers()

    def stage_fn(x_in_BTD, mb, on_tick, cache):
        return model.transform_cached(x_in_BTD, cache, start_B, real_layers=real_layers, write=on_tick)

    ys_BTD, cache = pipeline_ticks(stage_fn, vary(x_BTD, [PIPELINE])[None], schedule, cache)
    return _last_stage_to_all(ys_BTD[0]), cache
