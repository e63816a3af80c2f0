"""The layer stack (Megatron's ParallelTransformer): L tensor-parallel layers stored stacked, run scanned or unrolled,
with a recomputation policy, for training and for cached decoding. GPT and BERT compose it.

The parameters of all L layers are one stacked (L, ...) array per kind, whose leading axis is declared "pipeline": a
pipeline stage holds its consecutive slice, checkpoints store the whole stack whatever the mesh. The model that
composes the stack keeps them as its `layers` attribute (so their paths are `layers.attention.qkv.kernel`, ...);
`ParallelTransformer` itself holds only how they run, so it is static (hashable) and adds no parameters.

Dimension letters as in mtx/models/transformer.py. Everything runs in the local view inside shard_map.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mtx.config import ModelConfig
from mtx.kernels.collective_matmul import KERNEL_OUTPUT
from mtx.kernels.elementwise import STATISTICS
from mtx.kernels.gemm_epilogue import ACTIVATIONS
from mtx.models.transformer import KVCache, TransformerLayer, dropout_draws, local_kv_heads
from mtx.parallel.mesh import DATA, MODEL, PIPELINE
from mtx.parallel.pipeline import RealLayers
from mtx.parallel.ops import vary, vary_like
from mtx.parallel.random import fold

# The stacked KV cache (L, B, S_max, G, H), G key/value heads (N without grouping): layers split like the layer stack,
# rows like the batch, key/value heads like the columns that produce them. With replicated groups (G < TP) each rank
# holds its own heads' group, so that axis of the global array has TP entries (TP / G copies of each group).
KV_CACHE_SPEC = KVCache(P(PIPELINE, DATA, None, MODEL, None), P(PIPELINE, DATA, None, MODEL, None))

LAYER_INPUT = "layer_input"  # checkpoint name of each layer's input (what `full` recomputation keeps)


_SAVED_PRIMITIVES = ("dot_product_attention_fwd", "pallas_call", "psum", "all_gather", "reduce_scatter", "ppermute")


def save_matmul_outputs(prim, *args, **params) -> bool:
    """Remat policy of `--recompute-granularity matmuls`: save the outputs of the weight matmuls, of fused attention
    (cuDNN's or mtx's kernel: output and softmax statistics, which its backward needs), of the `g` all-reduces and
    the norms' row statistics (`elementwise.STATISTICS`, 4 or 8 bytes a row); recompute the element-wise rest
    (LayerNorm's output, GeLU, bias adds, residual adds, dropout).

    The element-wise ops are cheap to recompute (memory-bound, fused into their neighbours), while each saved
    activation costs a write now and a read in the backward; the matmuls and attention are the FLOPs, and an
    all-reduce recomputed would be communication repeated (a row-parallel output is saved after its psum, so the
    backward adds none: tests/test_audit.py); so are sequence parallelism's all-gathers and reduce-scatters (the
    gathered whole-batch inputs of the column-parallel matmuls stay alive for the backward: speed over SP's
    activation-memory saving, which `full` recomputation keeps), and the peer-memory kernels' outputs
    (`collective_matmul.KERNEL_OUTPUT`: those collectives and matmuls in one), and the epilogue matmuls' outputs
    (`gemm_epilogue.ACTIVATIONS`: recomputed, they would cost the matmul again; the GeLU MLP keeps only h here).
    Without cuDNN the attention core's einsums have batch dimensions and are recomputed (as `selective` does).
    """
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or prim.name.startswith(_SAVED_PRIMITIVES)
            or params.get("name") in (STATISTICS, KERNEL_OUTPUT, ACTIVATIONS))


@jax.custom_vjp
def _unstack(a_L):
    """(L, ...) -> L arrays (...), whose gradients are stacked back in one pass.

    (Plain indexing would transpose to L zero-padded (L, ...) gradients summed together.)"""
    return tuple(a_L[i] for i in range(a_L.shape[0]))


_unstack.defvjp(lambda a_L: (_unstack(a_L), None), lambda _, grads: (jnp.stack(grads),))


def _kept_apart(fn):
    """fn(x, inputs) -> x, whose backward keeps what fn's own checkpoint saves (its pullback's residuals) whatever
    checkpoint encloses it. JAX applies the outermost checkpoint's policy to the values of the checkpoints nested in
    it, so inside 1F1B's chunk (whose policy keeps every activation of the layers --recompute-method leaves whole) a
    recomputed layer's checkpoint alone would keep everything too; behind a custom VJP its values are not the
    enclosing checkpoint's to keep, only the residuals its forward returns."""

    @jax.custom_vjp
    def apart(x_BSD, inputs):
        return fn(x_BSD, inputs)

    apart.defvjp(lambda x_BSD, inputs: jax.vjp(fn, x_BSD, inputs), lambda pullback, dy_BSD: pullback(dy_BSD))
    return apart


@dataclass(frozen=True)
class ParallelTransformer:
    """How a stack of TransformerLayers is built and run (static: the parameters live in the module that composes it).

    causal: GPT's masked attention (False: BERT's bidirectional); post_layernorm: the original BERT block;
    recompute: None | "full" | "selective" | "matmuls" (--recompute-granularity), over the layers that
    recompute_method and recompute_num_layers pick (`recomputed_runs`); scan_layers: one lax.scan over the
    stack (False unrolls it, see docs/design.md); sequence_parallel: the residual stream split by rows over "model";
    tp_comm_overlap: with it, the linears' all-gathers and reduce-scatters inside their matmuls (--tp-comm-overlap);
    per_layer: set by the training step for its overlapped data-parallel reductions (mtx/parallel/overlap.py), applied
    to each layer's parameters as it runs, outside its recomputation (so a gather there is never repeated);
    prevent_cse: the layers' recomputation behind an optimization barrier (jax.checkpoint's), so XLA cannot merge it
    with the forward it repeats. 1F1B turns it off: a chunk's backward is a program of its own, and the barrier made
    XLA copy every layer's fp32 weight slices ahead of it in every backward (16 ms a step, docs/benchmarks.md 4k).
    """

    cfg: ModelConfig
    dtype: type = jnp.float32
    recompute: str | None = None
    flash: bool = False
    scan_layers: bool = True
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    causal: bool = True
    post_layernorm: bool = False
    per_layer: Callable | None = None  # training step: (layer's parameters, index) -> what it computes with
    prevent_cse: bool = True  # False where a layer's forward and its backward never share a program
    recompute_method: str | None = None  # None (each layer) | "uniform" | "block": see `recomputed_runs`
    recompute_num_layers: int | None = None

    def build(self, rngs: nnx.Rngs) -> TransformerLayer:
        """The L layers as one TransformerLayer whose every parameter has a leading (L,) axis declared "pipeline"."""

        @nnx.split_rngs(splits=self.cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: PIPELINE})
        def make_layers(rngs):
            return TransformerLayer(self.cfg, dtype=self.dtype, rngs=rngs,
                                    selective_recompute=self.recompute == "selective", flash=self.flash,
                                    causal=self.causal, post_layernorm=self.post_layernorm,
                                    sequence_parallel=self.sequence_parallel, tp_comm_overlap=self.tp_comm_overlap,
                                    recompute_elementwise=self.recompute == "matmuls")

        return make_layers(rngs)

    def __call__(self, layers: TransformerLayer, x_BSD, *, mask_BS=None, keys_B=None, first_layer=0,
                 real_layers: RealLayers | None = None):
        """Runs the held layers (all L, or one pipeline stage's) on (B, S, D) (this rank's rows with sequence
        parallelism).

        keys_B: one dropout key per sequence (None: no dropout); first_layer: global index of the first held layer
        (dropout keys follow the global layer index); real_layers: with uneven pipeline stages, how many of the held
        layers are real (the rest, padding, pass x through): one `lax.switch` over the counts it can take, each
        branch running exactly its layers (a `cond` per layer would cost a branch decision per layer).
        """
        graphdef, stacked = nnx.split(layers)

        def layer(x_BSD, inputs):  # one compiled layer, run once per held layer
            layer_state, _, draws = inputs
            return nnx.merge(graphdef, layer_state)(x_BSD, mask_BS=mask_BS, draws=draws)

        def group_of(x_BSD, inputs):  # a recomputed group: consecutive layers, one input tuple each
            for layer_inputs in inputs:
                x_BSD = layer(x_BSD, layer_inputs)
            return x_BSD

        def prepared(inputs):  # the training step's per-layer hook, outside the recomputation
            return inputs if self.per_layer is None else (self.per_layer(*inputs[:2]), *inputs[1:])

        def run(unit: int, split=tuple):
            """(x, inputs) -> x of one unit of a run (`recomputed_runs`): a layer (unit 0: kept, 1: recomputed) or
            a group of `unit` layers recomputed from the group's input. A group's inputs -> one tuple a layer by
            `split`, inside the recomputation where no hook runs: so what the group keeps is its inputs as given
            (scanned: the scan's own (unit, ...) slab of the stack), not a copy of each layer's slice."""
            if unit <= 1:
                one = self._recomputed(layer) if unit else layer
                return lambda x_BSD, inputs: one(x_BSD, prepared(inputs))
            if self.per_layer is None:
                return self._recomputed(lambda x_BSD, inputs: group_of(x_BSD, split(inputs)))
            group = self._recomputed(group_of)
            return lambda x_BSD, inputs: group(x_BSD, tuple(prepared(one) for one in split(inputs)))

        def run_first(n, x_BSD):  # the first n held layers
            unstacked = None if self.scan_layers else jax.tree.map(_unstack, stacked)  # own buffers per layer
            for start, size, unit in self.recomputed_runs(n):
                x_BSD = (scan_run(x_BSD, start, size, unit) if self.scan_layers else
                         unrolled_run(x_BSD, unstacked, start, size, unit))
            return x_BSD

        def scan_run(x_BSD, start, size, unit):
            held = jax.tree.map(lambda a: a[start:start + size], (stacked, draws))
            inputs = (held[0], jnp.arange(start, start + size), held[1])
            if unit <= 1:
                body = run(unit)
                return jax.lax.scan(lambda x, xs: (body(x, xs), None), x_BSD, inputs)[0]
            group = run(unit, split=lambda xs: tuple(jax.tree.map(lambda a: a[i], xs) for i in range(unit)))
            inputs = jax.tree.map(lambda a: a.reshape(size // unit, unit, *a.shape[1:]), inputs)
            return jax.lax.scan(lambda x, xs: (group(x, xs), None), x_BSD, inputs)[0]

        def unrolled_run(x_BSD, unstacked, start, size, unit):
            # One jitted layer (or group), called for each: traced, differentiated and lowered once (a function the
            # calls share), where a Python loop over its body would trace a copy each; XLA inlines the calls, so the
            # compiled program is the same unrolled one.
            inputs_of = lambda i: (jax.tree.map(lambda parts: parts[i], unstacked,
                                                is_leaf=lambda x: isinstance(x, tuple)),
                                   jnp.int32(i), jax.tree.map(lambda a: a[i], draws))
            call = jax.jit(run(unit))
            for first in range(start, start + size, max(unit, 1)):
                x_BSD = call(x_BSD, inputs_of(first) if unit <= 1 else
                             tuple(inputs_of(i) for i in range(first, first + unit)))
            return x_BSD

        held = jax.tree.leaves(stacked)[0].shape[0]
        draws = None if keys_B is None else self.draws(keys_B, held, first_layer, x_BSD.shape[1])
        x_BSD = vary_like(x_BSD, stacked)  # the carry's type must not change inside the scan
        if real_layers is None:
            return run_first(held, x_BSD)
        count, choices = real_layers
        index = jnp.searchsorted(jnp.asarray(choices), count)
        return jax.lax.switch(index, [functools.partial(run_first, n) for n in choices], x_BSD)

    def one_layer(self, layer: TransformerLayer, x_BSD, index, *, mask_BS=None, keys_B=None):
        """Global layer `index` alone, its parameters unstacked in `layer`, as `__call__` runs each layer (its
        recomputation at the granularity, its dropout draws): --layer-calls' layer (mtx/layer_calls.py). Nothing
        slices or reshapes the parameters or the input on the way, so they are what a recomputation saves, never
        copies of them."""
        assert self.recompute_method is None and self.per_layer is None, "--layer-calls runs each layer alike"
        graphdef, state = nnx.split(layer)
        draws = None if keys_B is None else jax.tree.map(lambda a: a[0], self.draws(keys_B, 1, index, x_BSD.shape[1]))

        def run(x_BSD, inputs):
            state, _, draws = inputs
            return nnx.merge(graphdef, state)(x_BSD, mask_BS=mask_BS, draws=draws)

        if self.recompute in ("full", "matmuls"):
            run = self._recomputed(run, alone=True)
        return run(x_BSD, (state, index, draws))

    def recomputed_runs(self, n: int) -> list[tuple[int, int, int]]:
        """The first n held layers as runs (start, size, unit) of what the backward recomputes: unit 0 keeps the
        layers' activations, 1 recomputes each layer from its input (at the granularity: `full` or `matmuls`), U > 1
        each group of U layers from the group's input. --recompute-method block N: the first N layers of each stage
        (or virtual stage) recomputed, the rest kept; uniform N: groups of N (the last one shorter), as Megatron."""
        if self.recompute not in ("full", "matmuls"):
            runs = [(0, n, 0)]
        elif self.recompute_method == "block":
            u = self.recompute_num_layers or 1
            runs = [(0, min(u, n), 1), (u, n, 0)]
        else:
            u = self.recompute_num_layers or 1
            whole = n - n % u
            runs = [(0, whole, u), (whole, n, n - whole)]
        return [(start, end - start, unit) for start, end, unit in runs if end > start]

    def _recomputed(self, fn, alone: bool = False):
        """fn (x, inputs) -> x under the granularity's recomputation: `full` keeps its input x only (named
        LAYER_INPUT), `matmuls` the matmul outputs too (`save_matmul_outputs`). With --recompute-method, kept so even
        inside 1F1B's chunk checkpoint (`_kept_apart`), which then keeps the other layers' activations. alone: no
        checkpoint encloses this one and its forward and backward are programs of their own (`one_layer`): the input
        is not named (a name is a new array, which the layer's pullback would keep beside the caller's) and there is
        no barrier."""
        policy = None if self.recompute == "full" else save_matmul_outputs
        recomputed = jax.checkpoint(fn, policy=policy, prevent_cse=self.prevent_cse and not alone)
        if self.recompute == "full" and not alone:
            inner = recomputed
            recomputed = lambda x_BSD, inputs: inner(checkpoint_name(x_BSD, LAYER_INPUT), inputs)
        return recomputed if self.recompute_method is None else _kept_apart(recomputed)

    def draws(self, keys_B, count: int, first_layer, length: int):
        """The dropout Draws of `count` layers from global layer `first_layer` on, stacked (count, ...): each layer's
        from the sequences' keys folded with its global index (so a pipeline stage's layers draw what they draw
        unpipelined). All at once, vmapped over the layers, and computed into buffers (an optimization barrier): each
        layer drawing its own, XLA fused the hashing into every use and the step's program doubled (89k against 34k
        instructions for 24 layers on the CPU; docs/benchmarks.md 8f)."""
        keys_LB = jnp.broadcast_to(keys_B[None], (count, *keys_B.shape))
        keys_LB = fold(keys_LB, (first_layer + 1 + jnp.arange(count, dtype=jnp.uint32))[:, None])
        draw = functools.partial(dropout_draws, self.cfg, length=length, sequence_parallel=self.sequence_parallel)
        return jax.lax.optimization_barrier(jax.vmap(draw)(keys_LB))

    def empty_cache(self, layers: TransformerLayer, batch: int, window: int) -> KVCache:
        """A zero KV cache for the held layers: (held L, B, S_max, g, H) each, g this rank's key/value heads
        (`local_kv_heads`), typed like its spec (`KV_CACHE_SPEC`: it differs on every rank)."""
        held = layers.attention.proj.kernel.shape[0]  # local (held L, n_local * H, D)
        shape = (held, batch, window, local_kv_heads(self.cfg), self.cfg.head_dim)
        zeros = vary(jnp.zeros(shape, self.dtype), (DATA, PIPELINE, MODEL))
        return KVCache(zeros, zeros)

    def decode(self, layers: TransformerLayer, x_BTD, cache: KVCache, start_B, *, real_layers=None, write=None):
        """Inference through the held layers with their KV caches: (B, T, D) new tokens at positions start_B + t,
        cache (held L, B, S_max, g, H) each -> ((B, T, D), updated cache).

        The cache is stacked per layer and scanned alongside the layer parameters (one compiled layer). real_layers
        as in `__call__`, but here a padding layer runs and its output is dropped (one compiled layer, as before);
        write: optional bool, False leaves the cache as it was (a pipeline stage off its tick).
        """
        assert not self.sequence_parallel, "decoding runs whole rows: build its model with sequence parallelism off"
        graphdef, stacked = nnx.split(layers)
        num_held = jax.tree.leaves(stacked)[0].shape[0]
        masked = real_layers is not None

        def body(x_BTD, inputs):
            layer_state, layer_cache, active = inputs
            y_BTD, layer_cache = nnx.merge(graphdef, layer_state).decode(x_BTD, layer_cache, start_B, write=write)
            return (jnp.where(active, y_BTD, x_BTD) if masked else y_BTD), layer_cache

        active_L = jnp.arange(num_held) < real_layers.count if masked else jnp.ones((num_held,), jnp.bool_)
        x_BTD = vary_like(x_BTD, stacked)
        x_BTD, cache = jax.lax.scan(body, x_BTD, (stacked, cache, active_L))
        return x_BTD, cache
