# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Meshes and layouts
#
# mtx runs one SPMD program over a `("data", "pipeline", "model")` device mesh. Every parameter declares its
# layout (a `PartitionSpec`) once, where it is created; the global shape never depends on the mesh, only who holds
# which slice does. This notebook builds a 2 x 2 x 2 mesh on 8 simulated CPU devices, lists every parameter of the
# tiny GPT with its global shape, spec and per-device shard, and draws how a column-parallel and a row-parallel
# weight are split (paper section 3, Fig. 3).

# %%
import os
from pathlib import Path

import mtx
from mtx.devices import simulate_cpu_devices

simulate_cpu_devices(8)  # 8 simulated CPU devices; XLA reads the flag when JAX starts its backends
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The presets (configs/) and benchmarks/ sit beside the installed package (pip install -e .): paths start at ROOT,
# so the notebook runs from any working directory.
ROOT = Path(mtx.__file__).resolve().parents[1]

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.parallel.mesh import AXES, make_mesh
from mtx.plot import pyplot, show
from mtx.presets import load_preset
from mtx.sharded_model import ShardedModel

assert len(jax.devices()) == 8, jax.devices()
plt = pyplot()  # matplotlib on its file backend: show() writes each figure, then displays it

# %% [markdown]
# ## The mesh
#
# `make_mesh(data, pipeline, model)`; `"model"` is the innermost axis, so on a GPU host consecutive devices (one
# NVLink domain) form a tensor-parallel group.

# %%
DP, PP, TP = 2, 2, 2
mesh = make_mesh(DP, PP, TP)
ids = np.vectorize(lambda d: d.id)(mesh.devices)
print(dict(mesh.shape))
print(ids)
assert mesh.axis_names == AXES == ("data", "pipeline", "model")
assert dict(mesh.shape) == {"data": DP, "pipeline": PP, "model": TP}
# each tensor-parallel group (a row along "model") is a pair of neighbouring devices
for group in ids.reshape(-1, TP):
    assert list(group) == list(range(group[0], group[0] + TP)), group

# %% [markdown]
# ## Every parameter: global shape, PartitionSpec, per-device shard
#
# The tiny preset (`configs/tiny.toml`: 2 layers, width 64, 8 heads) on this mesh. The layer stack carries a leading
# `L` axis split over `"pipeline"`; column-parallel weights split their output axis over `"model"`, row-parallel
# weights their input axis, the vocab-parallel embedding its rows; LayerNorms and row-parallel biases are
# replicated.

# %%
cfg = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
    data_parallel_size=DP, pipeline_model_parallel_size=PP, tensor_model_parallel_size=TP).validate(8)
model = ShardedModel(cfg, mesh)
params = nnx.to_pure_dict(model.init_params())
is_spec = lambda x: isinstance(x, P)  # noqa: E731
names = [jax.tree_util.keystr(path, simple=True, separator=".")
         for path, _ in jax.tree_util.tree_leaves_with_path(params)]
declared = dict(zip(names, jax.tree.leaves(model.param_specs, is_leaf=is_spec)))  # as the modules declare them


def expected_shard(shape, spec):
    """Global shape / the sizes of the mesh axes each dimension is split over."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(n // (mesh.shape[a] if a else 1) for n, a in zip(shape, spec))


rows = []
for path, arr in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    spec = arr.sharding.spec
    shard = arr.addressable_shards[0].data.shape
    rows.append((name, arr.shape, spec, shard))
    # the stored layout is the declared one, and every device holds a shard of the same, expected shape
    assert spec == declared[name], (name, spec, declared[name])
    assert all(s.data.shape == expected_shard(arr.shape, spec) for s in arr.addressable_shards), name
    assert len(arr.addressable_shards) == 8

print(f"{'parameter':<34}{'global shape':<18}{'PartitionSpec':<34}{'shard per device'}")
for name, shape, spec, shard in rows:
    print(f"{name:<34}{str(shape):<18}{str(spec):<34}{shard}")

total = sum(a.size for a in jax.tree.leaves(params))
per_device = sum(int(np.prod(s)) for *_, s in rows)
print(f"\n{total:,} parameters; {per_device:,} on each device ({per_device / total:.1%})")
assert total == cfg.model.num_params()  # the config owns the arithmetic
embedding = params["embedding"]["embedding"].size
print(f"the {cfg.model.padded_vocab_size:,}-row embedding is {embedding / total:.0%} of this tiny model; split over "
      f"'model' only, it is why a device holds about 1 / tp of the parameters, not 1 / (tp x pp)")

# %% [markdown]
# The declared layouts of the Megatron layers, checked one by one:

# %%
LAYOUTS = {
    "embedding.embedding": P("model", None),  # vocab-parallel: rows (vocabulary) split
    "layers.attention.qkv.kernel": P("pipeline", None, "model"),  # column-parallel: each rank owns whole heads
    "layers.attention.qkv.bias": P("pipeline", "model"),
    "layers.attention.proj.kernel": P("pipeline", "model", None),  # row-parallel
    "layers.attention.proj.bias": P("pipeline", None),  # added once, after the all-reduce
    "layers.mlp.fc1.kernel": P("pipeline", None, "model"),  # column-parallel
    "layers.mlp.fc2.kernel": P("pipeline", "model", None),  # row-parallel
    "layers.ln1.scale": P("pipeline", None),
    "final_layernorm.scale": P(None),
    "position_embeddings": P(None, None),
}
by_name = {name: spec for name, _, spec, _ in rows}
for name, spec in LAYOUTS.items():
    assert by_name[name] == spec, (name, by_name[name], spec)

# %% [markdown]
# ## Parameters are mesh-independent
#
# The same seed gives bit-identical global weights on one device and on the 2 x 2 x 2 mesh (docs/design.md, decision 2):
# sharding only decides who holds which slice.

# %%
one = ShardedModel(cfg.replace(data_parallel_size=1, pipeline_model_parallel_size=1, tensor_model_parallel_size=1),
                   make_mesh(1, 1, 1, devices=jax.devices()[:1]))
single = nnx.to_pure_dict(one.init_params())
for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(single)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
print("identical global weights on a 1-device mesh and on", dict(mesh.shape))

# %% [markdown]
# ## A column-parallel and a row-parallel weight
#
# Layer 0 of the MLP: `fc1` (D x F) is split by columns, so rank r computes X A_r, its own F / tp slice of the
# hidden activations, with no communication; GeLU is element-wise and runs on that slice. `fc2` (F x D) is split by
# rows, consuming exactly that slice and producing a partial sum that `g` all-reduces. First
# `jax.debug.visualize_array_sharding` on 2-D slices (layer 0, resharded to the 2-D layout), then a picture of
# which devices hold each block of the stored 3-D arrays.

# %%
fc1 = params["layers"]["mlp"]["fc1"]["kernel"]  # (L, D, F)
fc2 = params["layers"]["mlp"]["fc2"]["kernel"]  # (L, F, D)
fc1_layer0 = fc1.at[0].get(out_sharding=NamedSharding(mesh, P(None, "model")))
fc2_layer0 = fc2.at[0].get(out_sharding=NamedSharding(mesh, P("model", None)))
print("fc1, layer 0 (D x F), column-parallel:")
jax.debug.visualize_array_sharding(fc1_layer0, scale=0.5)  # wide (64 x 256): scaled to fit its labels
print("fc2, layer 0 (F x D), row-parallel:")
jax.debug.visualize_array_sharding(fc2_layer0)
np.testing.assert_array_equal(np.asarray(fc1_layer0), np.asarray(fc1)[0])


# %%
def blocks_of_layer0(arr):
    """{(row slice, col slice) of layer 0: device ids holding it} from the stored array's sharding."""
    held = {}
    for device, index in arr.sharding.devices_indices_map(arr.shape).items():
        layers, rows_, cols = (range(*s.indices(n)) for s, n in zip(index, arr.shape))
        if 0 in layers:
            held.setdefault((rows_.start, rows_.stop, cols.start, cols.stop), []).append(device.id)
    return held


coords = {int(ids.flat[i]): np.unravel_index(i, ids.shape) for i in range(ids.size)}  # device id -> (data, pipe, model)
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, arr, title, split_axis in [(axes[0], fc1, "fc1 kernel, layer 0: column-parallel P(pipeline, None, model)", 1),
                                   (axes[1], fc2, "fc2 kernel, layer 0: row-parallel P(pipeline, model, None)", 0)]:
    held = blocks_of_layer0(arr)
    n_rows, n_cols = arr.shape[1:]
    assert len(held) == TP  # layer 0 is cut into tp blocks ...
    for (r0, r1, c0, c1), devs in held.items():
        model_rank = {coords[d][2] for d in devs}
        assert len(model_rank) == 1 and {coords[d][1] for d in devs} == {0}  # ... held by one model rank of stage 0
        # ... and the block index along the split axis is that model rank
        start, size = ((r0, n_rows) if split_axis == 0 else (c0, n_cols))
        assert start == model_rank.pop() * size // TP
        assert len(devs) == DP  # replicated over "data"
        ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=f"C{coords[devs[0]][2]}", alpha=0.5,
                                   edgecolor="k"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, f"model rank {coords[devs[0]][2]}\ndevices {devs}", ha="center",
                va="center")
    ax.set_xlim(0, n_cols), ax.set_ylim(n_rows, 0)
    ax.set_xlabel(f"columns ({n_cols})"), ax.set_ylabel(f"rows ({n_rows})"), ax.set_title(title, fontsize=9)
show(fig, "01_column_and_row_parallel")

# %% [markdown]
# Layer 1 lives on pipeline stage 1 (devices with pipeline index 1), and each block is replicated over the two data
# ranks. Inside the step's `shard_map` a device sees only its shard: fc1 as (1, 64, 128) and fc2 as (1, 128, 64).
