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
# # 3. The memory wall (paper section 2)
#
# Why a model of billions of parameters does not fit on one GPU, before counting a single activation. With Adam,
# each parameter drags its gradient and two moment estimates along. What mtx keeps, per parameter:
#
# | what | dtype | bytes | lives |
# | --- | --- | --- | --- |
# | master weight | fp32 | 4 | train state (argument of the step) |
# | Adam first moment m | fp32 | 4 | train state |
# | Adam second moment v | fp32 | 4 | train state |
# | gradient | fp32 | 4 | inside the step (accumulated over microbatches, then consumed by the update) |
#
# 16 bytes per parameter. With `--bf16` the layers cast weights to bf16 on the fly for the matmuls
# (`x.astype(self.dtype)` in `mtx/parallel/layers.py`): transient copies, not stored. (The mixed-precision recipe of
# the ZeRO paper, fp16 weights and gradients + fp32 master, m and v, also totals 16 bytes.) Activations come on
# top and depend on batch, sequence and recomputation; they are not counted here.
#
# Below: the per-device bytes of the paper's 1.2B-8.3B models under tensor (TP) and pipeline (PP) parallelism,
# from each parameter's declared layout, checked against XLA's compiled memory analysis on small configs.

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
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.parallel.mesh import make_mesh
from mtx.parallel.sharded import partition_specs
from mtx.plot import pyplot, show
from mtx.presets import load_preset
from mtx.sharded_model import build_model
from mtx.step import TrainStep

assert len(jax.devices()) == 8
plt = pyplot()  # matplotlib on its file backend: show() writes each figure, then displays it
BYTES_PER_PARAM = 4 + 4 + 4 + 4  # fp32 weight + fp32 gradient + fp32 Adam m + fp32 Adam v
STATE_BYTES_PER_PARAM = 4 + 4 + 4  # what the train state holds between steps: weight, m, v
GB = 1e9


# %% [markdown]
# ## Parameters per device, from the declared layouts
#
# A parameter's shard on a (data, pipeline, model) mesh is its global shape divided, dimension by dimension, by the
# sizes of the mesh axes its `PartitionSpec` names (a mesh axis that does not divide its dimension is dropped, as
# `mtx.parallel.sharded.fit_spec` does). Data parallelism replicates: DP does not appear.

# %%
def abstract_params(cfg):
    return nnx.split(nnx.eval_shape(build_model(cfg)))[1]  # shapes only, nothing allocated


def params_per_device(abstract, pp, tp):
    sizes = {"data": 1, "pipeline": pp, "model": tp}
    total = 0
    for x, spec in zip(jax.tree.leaves(abstract), jax.tree.leaves(partition_specs(abstract, tp),
                                                                    is_leaf=lambda s: isinstance(s, P))):
        shard = [n // sizes[a] if a and n % sizes[a] == 0 else n for n, a in zip(x.shape, spec)]
        total += int(np.prod(shard))
    return total


def replicated_params(abstract):
    """Parameters every model and pipeline rank holds whole (LayerNorms, row-parallel biases, positions), as
    declared (GPT's blocks: the same on every tensor-parallel size)."""
    specs = jax.tree.leaves(partition_specs(abstract, 1), is_leaf=lambda s: isinstance(s, P))
    return sum(x.size for x, spec in zip(jax.tree.leaves(abstract), specs) if "model" not in spec)


# %% [markdown]
# ## Check against the compiler: the train step's argument bytes
#
# `jax.jit(train_step._train_step).lower(state, tokens).compile().memory_analysis().argument_size_in_bytes` is what one
# device must hold as the step's inputs: the train state (weights, m, v and a few scalars) and its share of the
# token batch. It must equal 12 bytes x the parameters per device counted above, plus the tokens. (The gradients,
# 4 more bytes per parameter, are temporaries of the step, inside `temp_size_in_bytes` with the activations.)

# %%
small = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
    vocab_size=257, num_layers=4, hidden_dropout=0.0, attention_dropout=0.0)
checked = []
for dp, pp, tp in [(1, 1, 1), (2, 2, 2)]:
    cfg = small.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp,
                        tensor_model_parallel_size=tp).validate(8)
    train_step = TrainStep.build(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[:dp * pp * tp]))
    state = train_step.abstract_state()
    t, m = cfg.training, cfg.model
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, m.seq_length + 1), np.int32,
                                  sharding=train_step.model.batch_sharding)
    memory = jax.jit(train_step._train_step).lower(state, tokens).compile().memory_analysis()
    n_dev = params_per_device(abstract_params(cfg), pp, tp)
    # the counting above agrees with the shards the training step actually lays out
    assert n_dev == sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(state.params))
    token_bytes = t.global_batch_size // dp * (m.seq_length + 1) * 4
    scalars = memory.argument_size_in_bytes - STATE_BYTES_PER_PARAM * n_dev - token_bytes
    checked.append((dp, pp, tp, n_dev, memory.argument_size_in_bytes, scalars, memory.temp_size_in_bytes))
    assert 0 <= scalars < 1024, scalars  # the step counter, Adam's counts, the loss scale: a few int32/fp32 scalars

print(f"{'mesh (d,p,m)':<14}{'params/device':>14}{'argument bytes':>16}{'= 12 x params + tokens +':>26}"
      f"{'temp bytes':>12}")
for dp, pp, tp, n_dev, arg, scalars, temp in checked:
    print(f"{str((dp, pp, tp)):<14}{n_dev:>14,}{arg:>16,}{scalars:>20} scalar bytes{temp:>12,}")
print(f"full model: {small.model.num_params():,} parameters")

# %% [markdown]
# ## The paper's models (Table 1): bytes per device vs TP and PP
#
# `configs/gpt_*.toml`: 1.2B (40 layers, hidden 1536), 2.5B (54, 1920), 4.2B (64, 2304), 8.3B (72, 3072), vocab
# padded to 51,200. A combination the config refuses (heads not divisible by TP, layers by PP) is left out.

# %%
PRESETS = ["1.2b", "2.5b", "4.2b", "8.3b"]
SIZES = [1, 2, 4, 8]
H100_GB = 80
table = {}  # (name, tp, pp) -> bytes per device
models = {}
for name in PRESETS:
    cfg = Config().replace(**load_preset(ROOT / f"configs/gpt_{name}.toml"))
    abstract = abstract_params(cfg)
    n = sum(x.size for x in jax.tree.leaves(abstract))
    assert n == cfg.model.num_params(), (name, n, cfg.model.num_params())  # the config's formula = the model
    stack = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(abstract)["layers"]))
    models[name] = (cfg, n, replicated_params(abstract) + (n - stack))  # held whole by some split: see below
    for tp in SIZES:
        for pp in SIZES:
            try:
                cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp).validate()
            except ValueError:
                continue
            table[name, tp, pp] = BYTES_PER_PARAM * params_per_device(abstract, pp, tp)

print(f"{'model':<6}{'params':>15}  GB per device (16 B/param), rows TP, columns PP = {SIZES}")
for name in PRESETS:
    cfg, n, _ = models[name]
    for tp in SIZES:
        cells = [f"{table[name, tp, pp] / GB:8.1f}" if (name, tp, pp) in table else f"{'-':>8}" for pp in SIZES]
        head = f"{name:<6}{n:>15,}" if tp == 1 else " " * 21
        print(f"{head}  TP={tp:<2}" + "".join(cells))

# %% [markdown]
# TP divides every weight matrix, the embedding included; PP divides only the layer stack: every stage keeps its
# TP share of the 51,200 x D embedding (each stage embeds, and the tied embedding is also the output layer), so the
# PP columns fall a little slower than 1 / PP. What the numbers say, asserted:

# %%
for name in PRESETS:
    cfg, n, unsplit = models[name]
    for (nm, tp, pp), bytes_ in table.items():
        if nm != name:
            continue
        # each device holds its 1 / (tp pp) share, plus at most what some axis keeps whole: the small replicated
        # parameters, and the embeddings, which only the layer stack's pipeline split leaves out (every stage
        # embeds, and the tied embedding is the output layer too)
        assert BYTES_PER_PARAM * n / (tp * pp) <= bytes_ <= BYTES_PER_PARAM * (n / (tp * pp) + unsplit)
        # doubling TP or PP always lowers the per-device bytes
        for bigger in [(name, 2 * tp, pp), (name, tp, 2 * pp)]:
            if bigger in table:
                assert table[bigger] < bytes_, (bigger, (name, tp, pp))

# 8.3B on one device: 133 GB of weights and optimizer state, more than an 80 GB H100 holds with no activations at
# all; split 8 ways over tensor parallelism (the paper's choice) it takes ~17 GB.
assert table["8.3b", 1, 1] > H100_GB * GB
assert table["8.3b", 8, 1] < H100_GB * GB / 4
# the paper's weak scaling: 1.2B on 1 GPU, 2.5B on 2, 4.2B on 4, 8.3B on 8 keep ~1B parameters per GPU
per_gpu = {name: table[name, tp, 1] / BYTES_PER_PARAM for name, tp in zip(PRESETS, SIZES)}
print("parameters per GPU at the paper's TP:", {k: f"{v / 1e9:.2f}B" for k, v in per_gpu.items()})
assert max(per_gpu.values()) / min(per_gpu.values()) < 1.25

# %% [markdown]
# ## The distributed optimizer: the state split over "data"
#
# Data parallelism above replicates all 16 bytes. `--use-distributed-optimizer` (ZeRO-1, Megatron's flag) splits the
# fp32 master weights and both Adam moments over the d data ranks, each rank updating its 1/d: the state between
# steps falls from 12 to 12 / d bytes per parameter. Each step all-gathers the parameters (in bf16 for the matrices
# with `--bf16`, the dtype the forward uses) and reduce-scatters the gradients, so the step's temporaries still hold
# the whole gradient (4 bytes) and the gathered copy: 4 + 2 + 12 / d bytes per parameter at the step's peak in bf16,
# before activations. The compiler's argument bytes check the 12 / d (a few vectors that d does not divide stay
# whole).

# %%
def argument_bytes(cfg, mesh):
    step = TrainStep.build(cfg.validate(8), make_mesh(*mesh, devices=jax.devices()[:int(np.prod(mesh))]))
    state = step.abstract_state()
    t, m = cfg.training, cfg.model
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, m.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
    memory = jax.jit(step._train_step).lower(state, tokens).compile().memory_analysis()
    local = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(state.params))
    return memory.argument_size_in_bytes - t.global_batch_size // mesh[0] * (m.seq_length + 1) * 4, local


print(f"{'mesh (d,p,m)':<14}{'replicated: state bytes':>24}{'distributed: state bytes':>26}{'ratio':>7}")
for mesh in [(2, 1, 1), (4, 1, 2), (8, 1, 1)]:
    dp, _, tp = mesh
    cfg = small.replace(data_parallel_size=dp, pipeline_model_parallel_size=1, tensor_model_parallel_size=tp)
    replicated, n_rep = argument_bytes(cfg, mesh)
    distributed, n_dist = argument_bytes(cfg.replace(use_distributed_optimizer=True), mesh)
    assert abs(replicated - STATE_BYTES_PER_PARAM * n_rep) < 1024  # 12 bytes x the local parameters (+ scalars)
    assert abs(distributed - STATE_BYTES_PER_PARAM * n_dist) < 1024  # ... of the local shards, now split over data
    assert n_dist < 1.05 * n_rep / dp  # ~1/d of them
    print(f"{str(mesh):<14}{replicated:>24,}{distributed:>26,}{replicated / distributed:>7.2f}")

# The paper's 8.3B on 2 GPUs without model parallelism: 133 GB replicated, 94% of an H200's 141 GB before any
# activation or the update's temporaries; distributed, 4 + 2 + 12 / 2 = 12 bytes per parameter, ~100 GB. (Measured
# on 2 x H200 in docs/benchmarks.md: distributed it trains, peak 109 GiB; replicated it runs out of memory.)
gpt_83b = Config().replace(**load_preset(ROOT / "configs/gpt_8.3b.toml"))
n83 = sum(x.size for x in jax.tree.leaves(abstract_params(gpt_83b)))
print(f"8.3B at DP 2: replicated {BYTES_PER_PARAM * n83 / GB:.0f} GB, distributed {(4 + 2 + 12 / 2) * n83 / GB:.0f} GB "
      "per device, before activations")
assert (4 + 2 + 12 / 2) * n83 < 0.75 * 141 * GB and BYTES_PER_PARAM * n83 > 0.9 * 141 * GB

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, vary, label in [(axes[0], "tp", "tensor-parallel size (PP = 1)"), (axes[1], "pp", "pipeline stages (TP = 1)")]:
    for i, name in enumerate(PRESETS):
        keys = [(name, s, 1) if vary == "tp" else (name, 1, s) for s in SIZES]
        xs = [s for s, k in zip(SIZES, keys) if k in table]
        ax.plot(xs, [table[k] / GB for k in keys if k in table], "o-", color=f"C{i}", label=f"GPT {name.upper()}")
    ax.axhline(H100_GB, color="k", ls="--", lw=1)
    ax.text(1, H100_GB * 1.08, "H100, 80 GB", fontsize=8)
    ax.set_xscale("log", base=2), ax.set_yscale("log"), ax.set_xticks(SIZES, [str(s) for s in SIZES])
    ax.set_xlabel(label)
axes[0].set_ylabel("GB per device: weights + grads + Adam m, v (fp32)")
axes[0].legend(fontsize=8)
fig.suptitle("16 bytes per parameter, before activations", fontsize=10)
show(fig, "03_memory_per_device")
