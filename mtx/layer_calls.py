"""The training step as compiled calls, one layer at a time (--layer-calls): a program per piece of the model, called
from Python once per layer and microbatch, so that one compiled layer runs L times without a scan.

A scanned stack compiles one layer, but its loop keeps each layer's saved activations in stacked (L, ...) buffers:
zeroed before the loop, written by `dynamic-update-slice` in the forward, and copied out slice by slice for cuBLAS
and cuDNN in the backward, which take no offset into a stack (docs/benchmarks.md 19b: 22% of the 1.2B step). The
unrolled stack has none of it but compiles every layer. Here each layer's forward is one program that returns its
output and its pullback (`jax.vjp`'s residuals, each its own buffer), and each layer's backward one program that takes
them: compiled once, called L times, nothing stacked. The pieces, each one `jit(shard_map)` over the whole mesh:

  zeros          the step's local sums (its loss share and the gradients outside the layer stack, fp32) and
                 its global counts (the tokens the loss is averaged over, summed over "data" once a step)
  embed          a microbatch's embeddings, and their pullback
  layer          layer i's output and pullback (its parameters sliced from the stack inside the call)
  head           the head's loss share and gradients (of the loss x the loss scale, as the fused step)
  layer_back     a layer's pullback applied: its input's cotangent and its own gradients (a buffer a layer,
                 made by its first backward: none is alive at the forward's end, the step's peak)
  embed_back     the embeddings' gradients added
  finish         the gradients stacked and summed over the mesh as the fused step sums them (one all-reduce over
                 "data"), and the optimizer update, in one program

Values that stay in the local view from one call to the next (activations, pullbacks, accumulators) travel as
`Local`: each array gains a leading axis over the mesh axes it varies over, one entry per rank, so they leave and
enter a shard_map without moving and with the same type. The gradients are the fused step's (mtx/step.py) up to the
order of floating-point sums; the optimizer update is its code. What is not built: the pipeline (its schedules
are programs of their own), the distributed optimizer and the overlapped reductions (both live inside the fused
step's backward), and --recompute-method (which picks layers of a stack).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtx.hlo import collectives
from mtx.parallel.compat import varying_axes
from mtx.parallel.mesh import BATCH, DATA, PIPELINE
from mtx.parallel.ops import vary
from mtx.parallel.overlap import accumulator
from mtx.parallel.random import rank_sample_keys, step_key
from mtx.pullback import Pruned

LAYERS = "layers"  # the stacked layers' key in the parameters (GPT's and BERT's `layers` attribute)
# XLA's options for the layer's programs on GPUs: no dot merger, which joins the key's and value's weight-gradient
# matmuls (they share an operand) into one whose other operand is a concatenation of their cotangents, a 100 MB copy
# a layer at 1.2B (the unrolled step's matmuls are not joined)
LAYER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


@dataclasses.dataclass(frozen=True)
class Local:
    """Local values (a pytree of this rank's arrays inside shard_map) carried between programs: `arrays`, each leaf
    as a global array with a leading axis over the mesh axes it varies over (`specs`), and the tree's structure."""

    arrays: tuple
    treedef: jax.tree_util.PyTreeDef
    specs: tuple

    @property
    def signature(self):
        return self.treedef, self.specs


def _inside(signature, arrays):
    """Inside the shard_map that takes a `Local`'s arrays with its specs: its local tree again. Programs keep the
    signature (structure and specs) of what they were compiled for, never a `Local`, whose arrays they would keep
    alive."""
    return jax.tree.unflatten(signature[0], [a[0] for a in arrays])


class Program:
    """`fn(*global_args, *local_trees) -> local tree`, compiled as one jit(shard_map) over `mesh`; global arguments
    laid out by `specs`, local ones as their `Local` says. Called with the global arguments and `Local`s, it returns
    a `Local`. Compiled once per signature of its local arguments: the result's specs (the mesh axes each leaf varies
    over) come from tracing it once first. `donate`: the positions of the local arguments whose buffers the result
    may take (the accumulators, updated in place)."""

    def __init__(self, mesh, fn, specs: tuple, donate: tuple[int, ...] = (), compiler_options=None):
        self.mesh, self.fn, self.specs, self.donate = mesh, fn, specs, donate
        self.compiler_options = compiler_options
        self._compiled, self.abstract_args = {}, {}

    def __call__(self, global_args: tuple, *local_args: Local) -> Local:
        signature = signature_of(local_args)
        if signature not in self._compiled:
            self._compiled[signature] = self._compile(global_args, local_args)
        call, result = self._compiled[signature]
        arrays = call(global_args, *(local.arrays for local in local_args))
        return Local(tuple(_serial(self.mesh, arrays)), *result)

    def _compile(self, global_args, local_args):
        axes, signatures = self.mesh.axis_names, signature_of(local_args)
        result = [None, None]

        def body(global_args, *arrays):
            trees = [_inside(signature, a) for signature, a in zip(signatures, arrays)]
            leaves, result[0] = jax.tree.flatten(self.fn(*global_args, *trees))
            result[1] = tuple(P(tuple(a for a in axes if a in varying_axes(x)) or None) for x in leaves)
            return tuple(x[None] for x in leaves)

        body.__name__ = self.fn.__name__.strip("_").removesuffix("_fn")  # the module's name in profiles: jit_layer
        in_specs = (self.specs, *(local.specs for local in local_args))
        arrays = tuple(local.arrays for local in local_args)
        jax.eval_shape(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=P(axes)),
                       global_args, *arrays)  # traced once for the result's specs
        call = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=result[1]),
                       donate_argnums=tuple(1 + k for k in self.donate if k < len(local_args)),
                       compiler_options=self.compiler_options)
        self.abstract_args[signatures] = jax.tree.map(_abstract, (global_args, *arrays))
        return call, result

    def hlo(self, compiler_options=None) -> list[str]:
        """The compiled HLO text of each signature this program was called with (`LayerCalls.collectives`)."""
        return [self._compiled[key][0].lower(*args).compile(compiler_options=compiler_options).as_text()
                for key, args in self.abstract_args.items()]


def signature_of(local_args) -> tuple:
    return tuple(local.signature for local in local_args)


def _serial(mesh, results):
    """`results`, awaited first on CPUs: there, calls with collectives in flight together deadlocked XLA's runtime
    (seen once in three 2-device runs), so each call finishes before the next starts."""
    return jax.block_until_ready(results) if _platform(mesh) == "cpu" else results


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _split(params):
    """The parameters (an nnx.State) -> (a State of those outside the layer stack, the stack's raw subtree): both laid
    out as in `params`, whose subtrees are plain dicts (as the specs' and gradients' are)."""
    raw = params.raw_mapping
    return nnx.State({k: v for k, v in raw.items() if k != LAYERS}), raw[LAYERS]


def _joined(outer, layers):
    """`_split`'s parts -> one State laid out as the parameters."""
    return nnx.State({**outer.raw_mapping, LAYERS: layers})


class LayerCalls:
    """--layer-calls: `calls.step(state, batch)` is the fused step's (mtx/step.py) as calls of compiled pieces (see
    the module's docstring), `calls.loss_and_grads(params, batch, step, scale)` its loss and gradients. `train_step`
    is the TrainStep it serves: its model, its gradient reduction (`reduce_local`) and its optimizer update."""

    def __init__(self, train_step):
        self.train_step, self.model, self.cfg = train_step, train_step.model, train_step.cfg
        mesh, specs = train_step.mesh, self.model.master_specs
        self.num_layers = self.cfg.model.num_layers
        options = train_step.compiler_options
        index, program = P(), functools.partial(Program, mesh, compiler_options=options)
        self._zeros = program(self._zeros_fn, (specs, BATCH))
        self._embed = program(self._embed_fn, (specs, BATCH, index, index))
        layer_options = dict(options or {}, **LAYER_OPTIONS) if _platform(mesh) == "gpu" else options
        self._layer = Program(mesh, self._layer_fn, (specs, BATCH, index, index, index), compiler_options=layer_options)
        self._head = program(self._head_fn, (specs, BATCH, index, index, index), donate=(0, 1))  # x, acc
        # the earlier microbatches' gradients (not the layer's input or output cotangent: the dx that took either's
        # buffer is copied into it, since the fusion that makes dx reads them)
        self._layer_back = Program(mesh, self._layer_back_fn, (specs, index), donate=(3,),
                                   compiler_options=layer_options)
        self._embed_back = program(self._embed_back_fn, (), donate=(2,))  # acc
        self._finishers, self._finish_args, self._indices = {}, {}, {}

    def step(self, state, batch):
        """The training step: `state, metrics = calls.step(state, batch)` (the state is donated)."""
        accumulated = self._accumulated(state.params, batch, state.step, state.loss_scale.scale)
        return self._finish("step", accumulated, state)

    def loss_and_grads(self, params, batch, step, scale=1.0):
        """Global mean loss and gradients (of loss x scale), as TrainStep.loss_and_grads; params and gradients in
        their stored layout."""
        scale = jnp.asarray(scale, jnp.float32)
        return self._finish("grads", self._accumulated(params, batch, step, scale), scale)

    def _accumulated(self, params, batch, step, scale) -> list[Local]:
        """The step's local sums over its microbatches: [the loss and the gradients outside the layer stack, layer 0's
        gradients, ..., layer L - 1's]. Each layer's gradients are buffers of their own, made by its first backward,
        so none is alive before the backward reaches its layer (a stacked accumulator would be, at the peak)."""
        step, scale = jnp.asarray(step, jnp.int32), jnp.asarray(scale, jnp.float32)
        acc, grads = self._zeros((params, batch)), [()] * self.num_layers
        for j in range(self.model.num_microbatches):
            micro = (batch, step, self._index(j))
            out, inputs, pullbacks = self._embed((params, *micro)), [], []
            x, embed_pullback = _part(out, 0), _part(out, 1)
            for i in range(self.num_layers):
                out = self._layer((params, *micro, self._index(i)), x)
                inputs.append(x)  # its backward takes it again (`Pruned`)
                x = _part(out, 0)
                pullbacks.append(_part(out, 1))
            out = self._head((params, *micro, scale), x, acc)
            dx, acc = _part(out, 0), _part(out, 1)
            for i in reversed(range(self.num_layers)):
                out = self._layer_back((params, self._index(i)), pullbacks.pop(), inputs.pop(), dx, *grads[i])
                dx, grads[i] = _part(out, 0), (_part(out, 1),)
            acc = self._embed_back((), embed_pullback, dx, acc)
        return [acc, *(g for g, in grads)]

    def _index(self, i: int) -> jax.Array:
        """i as a device scalar, made once (a Python int would be a host transfer per call)."""
        if i not in self._indices:
            self._indices[i] = jax.device_put(jnp.int32(i), NamedSharding(self.train_step.mesh, P()))
        return self._indices[i]

    def _finish(self, kind: str, accumulated: list[Local], arg):
        """The local sums -> the step's loss and gradients, summed over the mesh as the fused step sums them
        (TrainStep.reduce_local), the layers' stacked on the way; `kind` "grads": (loss, grads) for the loss scale
        `arg`; "step": the optimizer update of the state `arg` from them, in the same program (XLA can fuse the
        stacking into the update's passes)."""
        signatures = signature_of(accumulated)
        key = (kind, signatures)
        if key not in self._finishers:
            def reduce(scale, *arrays):
                acc, *layers = [_inside(signature, a) for signature, a in zip(signatures, arrays)]
                stacked = jax.tree.map(lambda *grads: jnp.stack(grads), *layers)
                loss, grads = self.train_step.reduce_local(acc["loss"], _joined(acc["outer"], stacked))
                return loss / scale, grads

            reduced = jax.shard_map(reduce, mesh=self.train_step.mesh,
                                    in_specs=(P(), *(local.specs for local in accumulated)),
                                    out_specs=(P(), self.model.master_specs))
            options = self.train_step.compiler_options
            if kind == "grads":
                finish = jax.jit(reduced, compiler_options=options)
            else:
                def finish(state, *arrays):
                    return self.train_step.update(state, *reduced(state.loss_scale.scale, *arrays))
                # the sums' buffers fit no result: not donated
                finish = jax.jit(finish, donate_argnums=0, compiler_options=options)
            self._finishers[key] = finish
            self._finish_args[key] = jax.tree.map(_abstract, (arg, *(local.arrays for local in accumulated)))
        return _serial(self.train_step.mesh, self._finishers[key](arg, *(local.arrays for local in accumulated)))

    def collectives(self, compiler_options=None) -> dict[str, list]:
        """Program name -> the collectives (`mtx.hlo.collectives`: (kind, axes, elements)) of each of its compiled
        variants, of the programs compiled so far (the audit: tests/test_layer_calls.py)."""
        sizes = dict(self.train_step.mesh.shape)
        texts = {name: program.hlo(compiler_options) for name, program in self._programs().items()}
        texts["finish"] = [self._finishers[key].lower(*args).compile(compiler_options=compiler_options).as_text()
                           for key, args in self._finish_args.items()]
        return {name: [collectives(text, sizes) for text in variants] for name, variants in texts.items()}

    def _programs(self) -> dict[str, Program]:
        return {"zeros": self._zeros, "embed": self._embed, "layer": self._layer, "head": self._head,
                "layer_back": self._layer_back, "embed_back": self._embed_back}

    # ---- the pieces, inside shard_map ----
    def _varying(self, params):
        """The step's copy of the parameters (TrainStep.differentiated): gradients stay local until `_finish`."""
        return self.train_step.differentiated(params)

    def _micro(self, batch, step, j):
        """Microbatch j of this rank's rows, and its dropout keys (None without dropout): the fused step's."""
        b = self.cfg.training.micro_batch_size
        batch_B = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, j * b, b), batch)
        if not self.cfg.model.has_dropout:
            return batch_B, None
        rows = jax.tree.leaves(batch)[0].shape[0]
        return batch_B, rank_sample_keys(step_key(self.cfg.training.seed, step), rows, j * b, b)

    def _zeros_fn(self, params, batch):
        """The step's sums, zero, and its global counts the loss is averaged over (summed over "data" once here)."""
        outer, _ = _split(self._varying(params))
        loss = jax.lax.pcast(jnp.zeros((), jnp.float32), (DATA, PIPELINE), to="varying")
        counts = jax.tree.map(jnp.asarray, self.model.objective.normalizers(batch))
        return {"loss": loss, "outer": jax.tree.map(accumulator, outer), "counts": counts}

    def _embed_fn(self, params, batch, step, j):
        outer, layers = _split(self._varying(params))
        batch_B, keys_B = self._micro(batch, step, j)
        embed = lambda outer: self.model.objective.embed(self.model.merge(_joined(outer, layers)), batch_B, keys_B)
        return jax.vjp(embed, outer)

    def _layer_fn(self, params, batch, step, j, i, x_BSD):
        outer, _ = _split(params)
        one = self._layer_params(params, i)
        batch_B, keys_B = self._micro(batch, step, j)
        mask_BS = self.model.objective.attention_mask(batch_B)

        def layer(one, x_BSD):
            module = self.model.merge(_joined(outer, one))  # the layer's parameters in the stack's place, unstacked
            return module.stack.one_layer(module.layers, x_BSD, i, mask_BS=mask_BS, keys_B=keys_B)

        return Pruned.vjp(layer, one, x_BSD)

    def _layer_params(self, params, i):
        """Layer i's parameters, indexed in the stack and cast to vary as `differentiated` casts them."""
        one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), _split(params)[1])
        axes = self.train_step.reduce_axes.raw_mapping[LAYERS]
        return jax.tree.map(vary, one, axes, is_leaf=lambda x: isinstance(x, tuple))

    def _head_fn(self, params, batch, step, j, scale, x_BSD, acc):
        outer, layers = _split(self._varying(params))
        batch_B, _ = self._micro(batch, step, j)
        objective, counts = self.model.objective, acc["counts"]
        loss_fn = lambda outer, x_BSD: objective.head_loss(self.model.merge(_joined(outer, layers)), x_BSD, batch_B,
                                                           counts) * scale
        loss, (d_outer, dx_BSD) = jax.value_and_grad(loss_fn, argnums=(0, 1))(outer, x_BSD)
        return dx_BSD, dict(acc, loss=acc["loss"] + loss, outer=jax.tree.map(jnp.add, acc["outer"], d_outer))

    def _layer_back_fn(self, params, i, pruned, x_BSD, dy_BSD, *earlier):
        """Layer i's backward -> (the input's cotangent, its parameters' gradients, added to `earlier`'s: the
        earlier microbatches' sum, when there are some). Its pullback completed with the layer's parameters and
        input, sliced and cast again here as the forward did."""
        d_one, dx_BSD = pruned.complete((self._layer_params(params, i), x_BSD))(dy_BSD)
        return dx_BSD, jax.tree.map(jnp.add, earlier[0], d_one) if earlier else d_one

    def _embed_back_fn(self, pullback, dx_BSD, acc):
        d_outer, = pullback(dx_BSD)
        return dict(acc, outer=jax.tree.map(jnp.add, acc["outer"], d_outer))


def _part(local: Local, k: int) -> Local:
    """Element k of a Local holding a tuple (a program's several results), as a Local of its own."""
    children = local.treedef.children()
    start = sum(child.num_leaves for child in children[:k])
    stop = start + children[k].num_leaves
    return Local(local.arrays[start:stop], children[k], local.specs[start:stop])
