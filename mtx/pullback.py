"""A pullback (`jax.vjp`'s) that keeps only what its backward cannot get for free, for a backward run in another
compiled program than its forward (--layer-calls, mtx/layer_calls.py): there each saved value is a buffer of its own,
so a saved value that is one of the function's inputs would be a copy of it, and two that are reshapes of one value
two buffers, where a single program keeps one."""

from __future__ import annotations

import jax
from jax.extend.core import Literal


@jax.tree_util.register_pytree_node_class
class Pruned:
    """A layer's pullback without the saved values its backward has anyway or gets for free: the layer's own inputs (its
    parameters, which a policy that recomputes their casts saves as the fp32 slices, 113 MB a layer at 1.2B, and its
    input x, which the forward would return as a copy) and views (reshapes, squeezes) of them or of another saved value
    (cuDNN's attention saves its output, the output projection the same output reshaped: a copy each, 50 MB a layer).
    `where` says, for each of the pullback's leaves, None (kept) or (is_input, k, shape): the k-th leaf of the inputs
    (is_input) or of the pullback, reshaped to `shape`; the backward puts them back (`complete`)."""

    def __init__(self, kept: tuple, treedef, where: tuple):
        self.kept, self.treedef, self.where = kept, treedef, where

    @classmethod
    def vjp(cls, fn, *inputs) -> tuple:
        """jax.vjp(fn, *inputs) -> (fn's output, its pullback pruned). Where each saved value comes from is read off
        the pullback's jaxpr, traced a second time (the values are the first trace's)."""
        out, pullback = jax.vjp(fn, *inputs)
        leaves, treedef = jax.tree.flatten(pullback)
        jaxpr = jax.make_jaxpr(lambda *inputs: jax.tree.leaves(jax.vjp(fn, *inputs)[1]))(*inputs).jaxpr
        assert [(x.shape, x.dtype) for x in leaves] == [(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]
        where = _sources(jaxpr, jaxpr.outvars)
        return out, cls(tuple(leaf for leaf, w in zip(leaves, where, strict=True) if w is None), treedef, where)

    def complete(self, inputs):
        given, kept = jax.tree.leaves(inputs), iter(self.kept)
        leaves = [next(kept) if w is None else None for w in self.where]
        for k, w in enumerate(self.where):
            if w is not None:
                is_input, source, shape = w
                leaves[k] = (given if is_input else leaves)[source].reshape(shape)
        return jax.tree.unflatten(self.treedef, leaves)

    def tree_flatten(self):
        return self.kept, (self.treedef, self.where)

    @classmethod
    def tree_unflatten(cls, aux, kept):
        return cls(tuple(kept), *aux)


def _sources(jaxpr, outvars) -> tuple:
    """For each of `outvars` (of `jaxpr`: a pullback's saved values): None if it is computed here and kept, else
    (is_input, k, shape): a view of input k or of kept output k, reshaped (see `Pruned`). Each value reached through
    views (its root) is kept once: as itself where it is an output, else as its first view among the outputs."""
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    inputs = {v: k for k, v in enumerate(jaxpr.invars)}

    def root(v):
        while (eqn := producer.get(v)) is not None and _is_view(eqn):
            v = eqn.invars[0]
        return v

    roots = [None if _is_literal(v) else root(v) for v in outvars]
    kept = {v: k for k, v in reversed(list(enumerate(outvars))) if not _is_literal(v) and v not in inputs
            and root(v) is v}  # outputs that are their own root: each kept, its first place
    where = []
    for k, (v, r) in enumerate(zip(outvars, roots)):
        if r is None or (r not in inputs and kept.setdefault(r, k) == k):
            where.append(None)  # computed here (or a literal): kept
        else:
            where.append((r in inputs, inputs[r] if r in inputs else kept[r], tuple(v.aval.shape)))
    return tuple(where)


def _is_view(eqn) -> bool:
    """A reshape (no transpose first) or a squeeze: the same elements in the same order, which a reshape redoes."""
    name = eqn.primitive.name
    return ((name == "squeeze" or name == "reshape" and eqn.params.get("dimensions") is None)
            and not _is_literal(eqn.invars[0]))


def _is_literal(v) -> bool:
    return isinstance(v, Literal)
