"""1F1B (PipeDream-flush, Megatron's default) and interleaved 1F1B, as one lockstep scan inside the step's shard_map.

GPipe differentiates through its tick scan, so autodiff keeps what every tick saved: activations grow with M. Here the
backward of a stage is written out instead. Every tick each device has one forward slot and one backward slot, both
under `lax.cond` (a slot with no work costs nothing), then two `ppermute`s: activations to the next device, input
gradients to the previous one. Device s holds V chunks of layers (virtual stage k = c P + s is its chunk c); with
V = 1 it is plain 1F1B.

The timetable (Schedule.timetable; u = i mod P, g = i div P for microbatch i; T = V M + P V + P - 2 ticks when P
divides M):

  forward  of (i, chunk c) on device s at tick  s + u + P c + P V g
  backward of (i, chunk c) on device s at tick  P V - 1 + (P - 1 - s) + u + P (V - 1 - c) + P V g

Each device runs at most one forward and one backward a tick; a forward follows its predecessor virtual stage by one
tick (the wrap from device P - 1 to device 0 included), a backward its successor's; the last virtual stage runs the
backward of a microbatch in the tick of its forward (that is where the loss is). Ticks with no backward anywhere (the
first P V - 1) cost a forward, ticks with no forward (the last P V - 1) a backward, the rest both, so the ideal
bubble is (P - 1) / (V M + P - 1), as Megatron's. Unlike Megatron's interleaving, M need not be a multiple of P (a
last partial group of microbatches only leaves more slots idle).

Memory: a (microbatch, chunk) is in flight on device s for 2 (P V - 1 - s - P c) ticks, so at most K = 2 P V - 1 stage
inputs are alive per device, whatever M. A forward keeps only its input (one (B, S, D) slot of a ring of K); the
backward recomputes the chunk's forward from it under `jax.vjp` (Megatron's full recomputation of a stage), so no
layer activation outlives its tick. The embedding runs in virtual stage 0's forward, per microbatch as it enters;
the head and loss in the last virtual stage's backward, whose forward is skipped (the backward recomputes it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtx.parallel.mesh import DATA, PIPELINE
from mtx.parallel.compat import varying_axes
from mtx.parallel.ops import vary
from mtx.parallel.pipeline import Schedule


def one_f_one_b(graphdef, params, objective, batch_M, schedule: Schedule, counts, *, keys_MB=None, scale=1.0):
    """This device's share of the loss (x scale; summed over "pipeline" it is the data rank's) and the gradients of
    its local parameters (not yet reduced over any axis), for the M microbatches of `batch_M` ((M, B, ...) arrays).

    `params` are this device's local parameters (layer stack in device-major chunk slots, see Schedule.slot_layers),
    already cast to vary over the axes their gradients are summed over (mtx/step.py)."""
    p, v, slots = schedule.stages, schedule.virtual, schedule.slots
    stage = jax.lax.axis_index(PIPELINE)
    last_stage = p * v - 1
    table = {name: jnp.asarray(a) for name, a in schedule.timetable().items()}
    k_slots = schedule.in_flight
    dropout = keys_MB is not None

    def microbatch(mb):
        return jax.tree.map(lambda a: a[mb], batch_M), (keys_MB[mb] if dropout else None)

    def chunk_forward(params, x_BSD, mb, chunk):
        """The forward of virtual stage chunk P + stage on microbatch mb: embedding first if it is stage 0."""
        model = nnx.merge(graphdef, params)
        batch_B, keys_B = microbatch(mb)
        first_layer, active_L = schedule.local_layers(chunk)
        layers_def, layers_state = nnx.split(model.layers)
        layers_state = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * slots, slots), layers_state)
        # Only virtual stage 0 embeds (a cond, so the other stages run no lookup and no all-reduce over "model").
        x_BSD = jax.lax.cond(chunk * p + stage == 0,
                             lambda: vary(objective.embed(model, batch_B, keys_B), varying_axes(x_BSD)),
                             lambda: x_BSD)
        y_BSD = model.stack(nnx.merge(layers_def, layers_state), x_BSD, mask_BS=objective.attention_mask(batch_B),
                            keys_B=keys_B, first_layer=first_layer, active_L=active_L)
        return model, batch_B, y_BSD

    def forward_slot(x_BSD, mb, chunk):
        return chunk_forward(params, x_BSD, mb, chunk)[2]

    def backward_slot(grads, x_BSD, dy_BSD, mb, chunk):
        """Recomputes the chunk's forward from its saved input and pulls back dy (or, on the last virtual stage, the
        loss): -> (grads + this chunk's, loss, dx)."""
        is_last = chunk * p + stage == last_stage

        def forward_and_loss(params, x_BSD):
            model, batch_B, y_BSD = chunk_forward(params, x_BSD, mb, chunk)
            loss = jax.lax.cond(is_last, lambda: _typed(objective.head_loss(model, y_BSD, batch_B, counts)),
                                lambda: _typed(jnp.zeros((), jnp.float32)))
            return y_BSD, loss

        (y_BSD, loss), pullback = jax.vjp(forward_and_loss, params, x_BSD)
        dy_BSD = jnp.where(is_last, jnp.zeros((), dy_BSD.dtype), dy_BSD)
        d_params, dx_BSD = pullback((dy_BSD.astype(y_BSD.dtype), _typed(jnp.where(is_last, scale, 0.0))))
        return jax.tree.map(jnp.add, grads, d_params), loss * scale, dx_BSD

    def tick(carry, t):
        recv_fwd, recv_bwd, saved, grads, loss_sum = carry
        f_mb, f_chunk = table["fwd_mb"][t, stage], table["fwd_chunk"][t, stage]
        b_mb, b_chunk = table["bwd_mb"][t, stage], table["bwd_chunk"][t, stage]
        # Forward slot: keep the input (ring slot t mod K; the entry it overwrites finished its backward), run the
        # chunk unless it is the last virtual stage (its backward, this same tick, recomputes it with the loss).
        saved = jax.lax.dynamic_update_index_in_dim(saved, recv_fwd, t % k_slots, 0)
        run_forward = (f_mb >= 0) & (f_chunk * p + stage != last_stage)
        y_BSD = jax.lax.cond(run_forward, forward_slot, lambda x, *_: jnp.zeros_like(x),
                             recv_fwd, jnp.maximum(f_mb, 0), jnp.maximum(f_chunk, 0))
        # Backward slot: the input this (microbatch, chunk) had at its forward (the timetable says which tick).
        x_saved = jax.lax.dynamic_index_in_dim(saved, table["bwd_saved_at"][t, stage] % k_slots, 0, keepdims=False)
        grads, loss, dx_BSD = jax.lax.cond(
            b_mb >= 0, backward_slot,
            lambda g, x, *_: (g, _typed(jnp.zeros((), jnp.float32)), jnp.zeros_like(x)),
            grads, x_saved, recv_bwd, jnp.maximum(b_mb, 0), jnp.maximum(b_chunk, 0))
        to_next = [(i, (i + 1) % p) for i in range(p)]  # activations: device s -> s + 1 (P - 1 -> 0: next chunk)
        to_prev = [(i, (i - 1) % p) for i in range(p)]  # input gradients: s -> s - 1
        return (jax.lax.ppermute(y_BSD, PIPELINE, to_next), jax.lax.ppermute(dx_BSD, PIPELINE, to_prev), saved,
                grads, loss_sum + loss), None

    # The carried activations are typed like a chunk's output (they vary wherever the layers do).
    zeros_BSD = _zeros_like_typed(graphdef, params, objective, microbatch, forward_slot)
    saved = jnp.broadcast_to(zeros_BSD, (k_slots, *zeros_BSD.shape))
    grads = jax.tree.map(jnp.zeros_like, params)
    init = (zeros_BSD, zeros_BSD, saved, grads, _typed(jnp.zeros((), jnp.float32)))
    (_, _, _, grads, loss), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
    return loss, grads


def _typed(x):
    """A loss scalar typed as varying over "data" and "pipeline" (the cond branches and the carry must agree)."""
    return vary(x, (DATA, PIPELINE))


def _first_embedding(graphdef, params, objective, microbatch):
    batch_B, keys_B = microbatch(0)
    return objective.embed(nnx.merge(graphdef, params), batch_B, keys_B)


def _zeros_like_typed(graphdef, params, objective, microbatch, forward_slot):
    """Zeros shaped and typed like a chunk's output (the values are never used, so XLA drops the computation)."""
    y_BSD = forward_slot(_first_embedding(graphdef, params, objective, microbatch), 0, 0)
    return jnp.zeros_like(y_BSD)
