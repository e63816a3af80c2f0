"""1F1B (PipeDream-flush, Megatron's default) and interleaved 1F1B, as one lockstep scan inside the step's shard_map.

GPipe differentiates through its tick scan, so autodiff keeps what every tick saved: activations grow with M. Here the
backward of a stage is written out instead. Every tick each device runs a forward slot, the head (at the ticks where
the last virtual stage ran a forward) and a backward slot, the slots under `lax.switch` (a slot with no work costs
nothing); the tick loop is `lockstep` (mtx/parallel/pipeline.py), which then shifts activations to the next device
and input gradients to the previous one. Device s holds V chunks of layers (virtual stage k = c P + s is its chunk
c); with V = 1 it is plain 1F1B.

The timetable (Schedule.timetable; u = i mod P, g = i div P for microbatch i; T = V M + P V + P - 2 ticks when P
divides M):

  forward  of (i, chunk c) on device s at tick  s + u + P c + P V g
  backward of (i, chunk c) on device s at tick  P V - 1 + (P - 1 - s) + u + P (V - 1 - c) + P V g

Each device runs at most one forward and one backward a tick; a forward follows its predecessor virtual stage by one
tick (the wrap from device P - 1 to device 0 included), a backward its successor's; the last virtual stage runs the
backward of a microbatch in the tick of its forward, after the head. Ticks with no backward anywhere (the first P V -
1) cost a forward, ticks with no forward (the last P V - 1) a backward, the rest both, so the ideal bubble is (P - 1)
/ (V M + P - 1), as Megatron's. Unlike Megatron's interleaving, M need not be a multiple of P (a last partial group
of microbatches only leaves more slots idle).

The head is spread over the stages (GPT): the last virtual stage's output is sent to every device (P - 1 sends of
one pair, `last_stage_to_each`), each computes the logits of its 1 / P of the vocabulary (of its model rank's slice)
and the loss's max, sum of exponentials and target logit are reduced over "pipeline" and "model" together; the
gradients wrt that output come back along the sends, summed on the last stage. So no stage carries the logits alone
(left there, they made the last stage's tick the longest: docs/benchmarks.md 4d). BERT's heads run on the last
stage, and so does GPT's when P does not divide a model rank's vocabulary slice (a multiple of 128 rows, so only for
P not a power of two).

Memory: a (microbatch, chunk) is in flight on device s from the tick of its forward to the tick of its backward, 2
(P V - 1 - s - P c) ticks later (both end ticks count: a tick runs its forward before its backward), so at most 2 P V
- 1 are alive per device, whatever M. The forward slot runs the chunk under `jax.vjp` and keeps, in a slot of a ring,
its input and what `--recompute-granularity` keeps of it (everything without recomputation, the matmul outputs with
`matmuls`, each layer's input with `full`; with --recompute-method, all that its recomputed layers leave:
`_keep_policy`); the backward slot pulls back through those residuals,
recomputing only what the policy dropped, as the unpipelined step does. Values computed from the parameters alone
(the layers' slices of the stack, their bf16 casts) are recomputed rather than kept per microbatch. The layers'
own recomputation runs without jax.checkpoint's barrier against CSE (the forward it repeats is in another branch):
behind the barrier XLA copied every layer's fp32 weight slices in every backward, 16 ms a step on the 2.5B model
with V 3 (docs/benchmarks.md 4k).

The ring is separate sets of buffers, each slot with its own branch in the forward and backward `switch`es, so no
slot is indexed dynamically: a dynamic index into one stacked ring copied every kept value in and out (a cuBLAS or
cuDNN operand cannot be a dynamic slice), ~58 ms a step for the 1.2B model on 2 GPUs with V 2 (docs/benchmarks.md
4d). Its slots are grouped by chunk (Schedule.ring: chunk c gets as many as the most of its pairs alive at once), so
each branch runs one chunk and takes that chunk's layers from the stack at a static offset, where one ring for all
chunks sliced them at a dynamic one; a backward slot adds the chunk's gradients to its rows in place (`_add_grads`).
Grouped, the ring holds fewer slots (V 3 on P 2: 9 instead of 11; fewer than 2 P - 1 when M is smaller): on the 2.5B
model with V 3, 10.8 GiB less memory and 21 s less compilation, the same step time (docs/benchmarks.md 4j). The
embedding runs in virtual stage 0's forward, per microbatch as it enters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.parallel.mesh import DATA, PIPELINE
from mtx.parallel.compat import uninitialized, varying_axes
from mtx.parallel.ops import vary
from mtx.parallel.overlap import accumulator
from mtx.parallel.pipeline import NEXT, PREVIOUS, Schedule, last_stage_to_each, lockstep


def one_f_one_b(graphdef, params, objective, batch_M, schedule: Schedule, counts, *, keys_MB=None, scale=1.0,
                seq_length=None):
    """This device's share of the loss (x scale; summed over "pipeline" it is the data rank's) and the gradients of
    its local parameters (not yet reduced over any axis), for the M microbatches of `batch_M` ((M, B, ...) arrays).

    `params` are this device's local parameters (layer stack in device-major chunk slots, see Schedule.slot_layers),
    already cast to vary over the axes their gradients are summed over (mtx/step.py)."""
    p, v, slots = schedule.stages, schedule.virtual, schedule.slots
    stage = jax.lax.axis_index(PIPELINE)
    last_stage = p * v - 1
    table = {name: jnp.asarray(a) for name, a in schedule.timetable().items()}
    chunk_of_slot, fwd_slot, bwd_slot = schedule.ring()
    slots_of_ring = range(len(chunk_of_slot))
    table["fwd_slot"], table["bwd_slot"] = jnp.asarray(fwd_slot), jnp.asarray(bwd_slot)
    dropout = keys_MB is not None
    residuals = [_Residuals() for _ in range(v)]  # each chunk's pullback structure (its layers' offset is static)
    keep_policy = _keep_policy(nnx.merge(graphdef, params).stack, seq_length)
    spread = _head_spreads(objective, graphdef, params, p)

    def microbatch(mb):
        return jax.tree.map(lambda a: a[mb], batch_M), (keys_MB[mb] if dropout else None)

    def chunk_forward(params, x_BSD, mb, chunk: int):
        """The forward of virtual stage chunk P + stage on microbatch mb: embedding first if it is stage 0."""
        model = nnx.merge(graphdef, params)
        batch_B, keys_B = microbatch(mb)
        first_layer, real_layers = schedule.local_layers(chunk)
        layers_def, layers_state = nnx.split(model.layers)
        # A static slice: its transpose adds the chunk's gradients in place, no dynamic index into the stack.
        layers_state = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, chunk * slots, (chunk + 1) * slots),
                                    layers_state)
        # Only virtual stage 0 embeds (a cond, so the other stages run no lookup and no all-reduce over "model"). A
        # chunk past the first never does: without the cond its pullback has no embedding gradient, where the cond's
        # zeros (the whole fp32 table) were filled and added to the accumulator in every one of its backward slots.
        if chunk == 0:
            x_BSD = jax.lax.cond(stage == 0, lambda: vary(objective.embed(model, batch_B, keys_B), varying_axes(x_BSD)),
                                 lambda: x_BSD)
        # The chunk's backward (its own slot, another branch) never shares a program with this forward, so the
        # layers' recomputation needs no barrier against CSE: behind one, XLA copied each layer's weight slices.
        stack = dataclasses.replace(model.stack, prevent_cse=False)
        y_BSD = stack(nnx.merge(layers_def, layers_state), x_BSD, mask_BS=objective.attention_mask(batch_B),
                      keys_B=keys_B, first_layer=first_layer, real_layers=real_layers)
        return model, batch_B, y_BSD

    # Each chunk's forward and its pullback are one jitted function that its ring slots' forward and backward
    # branches call: traced and lowered once a chunk instead of once a branch (one trace for all chunks, with the
    # chunk a dynamic index, took V 4 uneven from 65.5k to 26.8k HLO instructions before XLA inlines the calls into
    # each branch, where they become the same program as a trace a branch).
    @functools.partial(jax.jit, static_argnames="chunk")
    def chunk_vjp(params, x_BSD, mb, chunk):
        forward = jax.checkpoint(lambda p, x: chunk_forward(p, x, mb, chunk)[2], policy=keep_policy(x_BSD))
        y_BSD, pullback = jax.vjp(forward, params, x_BSD)
        return y_BSD, residuals[chunk].split(pullback, params, x_BSD)

    @functools.partial(jax.jit, static_argnames="chunk")
    def chunk_pullback(kept, params, x_BSD, dy_BSD, chunk):
        return residuals[chunk].join(kept, params, x_BSD)(dy_BSD)

    def forward_slot(x_BSD, mb, chunk: int):
        """The chunk's forward under `jax.vjp` -> (output, the residuals to keep for its backward): what the keep
        policy saves, less the parameters and the stage input (at hand in the backward anyway; `_Residuals`)."""
        return chunk_vjp(params, x_BSD, mb, chunk=chunk)

    def stored_backward(slot):
        """Pulls dy back through the chunk whose forward kept its input and residuals in ring slot `slot` (a static
        index: one branch per slot, so the slot's buffers feed their consumers in place)."""
        def run(grads, ring, dy_BSD, first_row):
            x_BSD, *kept = ring[slot]
            chunk = chunk_of_slot[slot]
            d_params, dx_BSD = chunk_pullback(kept, params, x_BSD, dy_BSD, chunk=chunk)
            return _add_grads(grads, d_params, rows=(chunk * slots, slots, first_row)), dx_BSD.astype(dy_BSD.dtype)

        return run

    def idle_backward(grads, ring, dy_BSD, first_row):
        return grads, jnp.zeros_like(dy_BSD)

    def forward_into(slot):
        """The forward slot of the chunk whose inputs ring slot `slot` holds, its input and residuals becoming that
        slot (static: one branch per slot, so the new residuals are written where they are computed, not copied
        into a dynamically indexed ring)."""
        def run(x_BSD, ring, mb):
            y_BSD, new_kept = forward_slot(x_BSD, mb, chunk_of_slot[slot])
            return y_BSD, ring[:slot] + ((x_BSD, *new_kept),) + ring[slot + 1:]

        return run

    def idle_forward(x_BSD, ring, mb):
        return jnp.zeros_like(x_BSD), ring

    def head(grads, y_BSD, mb):
        """The head and loss of microbatch mb on the last virtual stage's output y (valid on device P - 1), run by
        every device: -> (grads + the head's, the loss x scale on device P - 1, dy for device P - 1). Spread over
        the stages, each computes the logits of its 1 / P of the vocabulary and the loss's three sums run over
        "pipeline" too; otherwise device P - 1 computes the whole head."""
        batch_B, _ = microbatch(mb)

        def loss_of(params, y_BSD):
            model = nnx.merge(graphdef, params)
            if not spread:
                return objective.head_loss(model, y_BSD, batch_B, counts)
            # y sent to every stage, inside the vjp: the gradients wrt it come back along the sends, summed on the
            # last stage (the sends' transpose), in y's dtype.
            return objective.head_loss(model, last_stage_to_each(y_BSD), batch_B, counts, pipeline_share=True)

        def run(grads, y_BSD):
            loss, pullback = jax.vjp(loss_of, params, y_BSD)
            d_params, dy_BSD = pullback(jnp.full_like(loss, scale))
            return _add_grads(grads, d_params, rows=None), _typed(loss * scale), vary(dy_BSD, varying_axes(y_BSD))

        if spread:
            grads, loss, dy_BSD = run(grads, y_BSD)
        else:
            grads, loss, dy_BSD = jax.lax.cond(stage == p - 1, run, lambda g, y: (g, _typed(jnp.zeros(())),
                                                                                   jnp.zeros_like(y)), grads, y_BSD)
        return grads, jnp.where(stage == p - 1, loss, 0.0), vary(dy_BSD.astype(y_BSD.dtype), varying_axes(y_BSD))

    def no_head(grads, y_BSD, mb):
        return grads, _typed(jnp.zeros((), jnp.float32)), jnp.zeros_like(y_BSD)

    def tick(t, received, carry):
        # Both shifts land before the tick's work begins (one barrier): the tick waits once for the slower neighbour,
        # and neither shift is left to start behind the other's consumer. Without it XLA starts each shift right
        # before the branch that reads it, so the input gradients' shift started after this tick's forward and head
        # (docs/benchmarks.md 4l; the barrier and the head's sends: 16 ms a step, 4m).
        (recv_fwd, recv_bwd), (ring, grads, loss_sum) = jax.lax.optimization_barrier(received), carry
        f_mb, b_chunk = table["fwd_mb"][t, stage], table["bwd_chunk"][t, stage]
        # Forward slot: keep the input and the residuals in the ring slot Schedule.ring gives (one of the chunk's,
        # whose last (microbatch, chunk) finished its backward).
        y_BSD, ring = jax.lax.switch(table["fwd_slot"][t, stage] + 1, (idle_forward, *map(forward_into, slots_of_ring)),
                                     recv_fwd, ring, jnp.maximum(f_mb, 0))
        # The head, at the ticks where the last virtual stage ran a forward (the same ticks on every device).
        head_mb = table["fwd_mb"][t, p - 1]
        grads, loss, dy_head = jax.lax.cond((head_mb >= 0) & (table["fwd_chunk"][t, p - 1] == v - 1), head, no_head,
                                            grads, y_BSD, jnp.maximum(head_mb, 0))
        # Backward slot: the input and residuals this (microbatch, chunk) kept at its forward (this tick's for the
        # last virtual stage, whose dy is the head's).
        dy_BSD = jnp.where(b_chunk * p + stage == last_stage, dy_head, recv_bwd)
        # The chunk's first row in the stack, as a traced value (the same as the branch's static one): see _add_grads.
        first_row = jnp.maximum(b_chunk, 0) * slots
        grads, dx_BSD = jax.lax.switch(table["bwd_slot"][t, stage] + 1,
                                       (idle_backward, *map(stored_backward, slots_of_ring)), grads, ring, dy_BSD,
                                       first_row)
        return (y_BSD, dx_BSD), (ring, grads, loss_sum + loss), None  # activations on (P - 1 -> 0: next chunk)

    # The carried activations and the kept residuals are typed like a chunk's (they vary wherever the layers do):
    # one forward traced on the first embedding types the carry, one a chunk on the carry types its ring slots, as
    # in the scan (XLA drops them; their values are never used).
    f_mb0 = jnp.maximum(table["fwd_mb"][0, stage], 0)
    zeros_BSD = jnp.zeros_like(forward_slot(_first_embedding(graphdef, params, objective, microbatch), f_mb0, 0)[0])
    for chunk in range(v):
        forward_slot(zeros_BSD, f_mb0, chunk)  # records the chunk's residuals' shapes and types
    # The ring's buffers are never read before a forward slot writes them: allocated, not filled. Filled from one
    # zeros value, XLA copied it into every slot's buffers at every step (28.5 GiB for the 2.5B model with V 3).
    ring = tuple(residuals[chunk].empty(zeros_BSD) for chunk in chunk_of_slot)
    grads = jax.tree.map(accumulator, params)  # fp32: the distributed optimizer's stack comes in the compute dtype
    (_, grads, loss), _ = lockstep(tick, (zeros_BSD, zeros_BSD), (ring, grads, _typed(jnp.zeros((), jnp.float32))),
                                   schedule.ticks, (NEXT, PREVIOUS))
    return loss, grads


class _Residuals:
    """What a chunk's pullback holds, split into what the forward slot must keep and what the backward slot has at
    hand anyway (the parameters and the stage input), so the ring holds only the activations.

    `split` records the pullback's structure (each trace of the forward slot records the same one)."""

    def __init__(self):
        self.treedef, self.sources, self.avals = None, None, None

    def split(self, pullback, params, x_BSD) -> list:
        leaves, treedef = jax.tree.flatten(pullback)
        assert self.treedef is None or self.treedef.num_leaves == treedef.num_leaves, "a trace kept other residuals"
        self.treedef = treedef
        at_hand = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
        at_hand[id(x_BSD)] = "input"
        self.sources = [at_hand.get(id(leaf), "kept") for leaf in leaves]
        # Typed as varying over "data" and "pipeline" (as the carried activations and gradients are), so that the
        # ring's type does not depend on which values a trace happens to see as the same on every rank.
        kept = [vary(leaf, (DATA, PIPELINE)) for leaf, src in zip(leaves, self.sources) if src == "kept"]
        self.avals = [(leaf.shape, leaf.dtype, varying_axes(leaf)) for leaf in kept]
        return kept

    def join(self, kept, params, x_BSD):
        param_leaves, kept = jax.tree.leaves(params), iter(kept)
        leaves = [x_BSD if src == "input" else next(kept) if src == "kept" else param_leaves[src]
                  for src in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)

    def empty(self, x_BSD) -> tuple:
        """A ring slot: buffers like the stage input and the kept residuals, their values unset."""
        avals = [(x_BSD.shape, x_BSD.dtype, varying_axes(x_BSD)), *self.avals]
        return tuple(vary(uninitialized(shape, dtype), axes) for shape, dtype, axes in avals)


def _add_grads(grads, d_params, rows: tuple[int, int, jax.Array] | None):
    """grads + the gradients of one tick's head or one chunk's backward, adding only the layer stack's `rows` (first,
    count, and first again as a traced value): a chunk's layer gradients are zero outside its rows (the transpose of
    the chunk's static slice pads them), the head's are zero throughout (rows None). Those rows are added in place,
    instead of reading and writing the device's whole stack each time.

    The accumulator's rows are read and written at the traced first row: XLA's GPU backend updates a buffer in
    place only when the read and the write share one dynamic index; at the static one (a slice and an update at
    constants) it rewrote the whole stack: 0.82 against 0.32 ms for 9 of 27 rows of a 1920 x 7680 fp32 leaf on an
    H200 (docs/benchmarks.md 4j)."""
    def add(path, g, d):
        if getattr(path[0], "key", None) != "layers":
            return g + d
        if rows is None:
            return g
        start, size, at = rows
        new = jax.lax.dynamic_slice_in_dim(g, at, size) + jax.lax.slice_in_dim(d, start, start + size)
        return jax.lax.dynamic_update_slice_in_dim(g, new.astype(g.dtype), at, axis=0)

    return jax.tree_util.tree_map_with_path(add, grads, d_params)


def _keep_policy(stack, seq_length):
    """What the forward slot keeps of a chunk for its backward -> (stage input -> remat policy): what
    `--recompute-granularity` keeps (everything without recomputation; the matmul outputs with `matmuls`; each layer's
    input with `full`; all but the S x S attention core with `selective`), restricted to activations (values with the
    micro batch and sequence dimensions). Values computed from the parameters alone (the layers' slices of the stack,
    their bf16 casts) are recomputed in the backward, not kept once per microbatch in flight. With
    --recompute-method the stack's own recomputation picks the layers (`ParallelTransformer.recomputed_runs`): the
    chunk keeps what it leaves."""
    from mtx.models.stack import LAYER_INPUT, save_matmul_outputs

    everything = jax.checkpoint_policies.everything_saveable
    base = {"matmuls": save_matmul_outputs, "full": jax.checkpoint_policies.save_only_these_names(LAYER_INPUT),
            "selective": lambda prim, *avals, **params: not any(_square_4d(a) for a in avals)}
    base = everything if stack.recompute_method else base.get(stack.recompute, everything)

    def for_input(x_BSD):
        b, s = x_BSD.shape[:2]

        def policy(prim, *avals, **params):
            activation = any(len(getattr(a, "shape", ())) >= 2 and a.shape[0] == b
                             and (s in a.shape[1:3] or seq_length in a.shape[1:3]) for a in avals)
            return activation and base(prim, *avals, **params)

        return policy

    return for_input


def _square_4d(aval):
    shape = getattr(aval, "shape", ())
    return len(shape) == 4 and shape[-1] == shape[-2]


def _typed(x):
    """A loss scalar typed as varying over "data" and "pipeline" (the branches and the carry must agree)."""
    return vary(x, (DATA, PIPELINE))


def _head_spreads(objective, graphdef, params, p) -> bool:
    """Whether the head's logits are spread over the P stages by vocabulary: an objective that allows it (GPT's
    next-token loss; BERT's heads run on the last stage) and a vocab-parallel slice that divides by P."""
    rows = nnx.merge(graphdef, params).embedding.embedding.shape[0]
    return objective.head_spreads_over_stages and rows % p == 0


def _first_embedding(graphdef, params, objective, microbatch):
    batch_B, keys_B = microbatch(0)
    return objective.embed(nnx.merge(graphdef, params), batch_B, keys_B)
