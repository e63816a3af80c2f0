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
# # 5. Communication vs computation under tensor parallelism
#
# Each transformer layer all-reduces its (b, s, h) activations four times over the tensor-parallel group, two
# forward (the `g`s) and two backward (the `f`s), while its matmuls shrink as 1 / tp. This notebook reads the
# all-reduces off the compiled program with `mtx.audit.audit_layer` (at the paper's micro batch 8 and sequence
# 1,024), then estimates per layer how long an H100 computes and how long the all-reduces take, as tp and the hidden
# size vary.

# %%
import os

from mtx.devices import simulate_cpu_devices

simulate_cpu_devices(8)  # 8 simulated CPU devices; XLA reads the flag when JAX starts its backends
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from mtx.audit import audit_config, audit_layer
from mtx.config import ModelConfig
from mtx.plot import pyplot, show

assert len(jax.devices()) == 8
plt = pyplot()  # matplotlib on its file backend: show() writes each figure, then displays it


# %% [markdown]
# ## What the compiled layer moves
#
# `audit_layer` compiles one `TransformerLayer` inside `shard_map` (fp32, forward alone and forward + backward) and
# lists every collective of the optimized HLO. A compile does not run the layer, so the paper's shapes cost
# nothing: b = 8, s = 1024, several hidden sizes and TP degrees (a handful, each audit is two compiles).

# %%
b, s = 8, 1024
AUDITS = [(1024, 16, 1), (1024, 16, 2), (1024, 16, 8), (2048, 16, 4), (3072, 32, 8)]  # (hidden, heads, tp)
audited = {}
for h, heads, tp in AUDITS:
    cfg = audit_config(hidden_size=h, num_attention_heads=heads, seq_length=s, micro_batch_size=b,
                       tensor_model_parallel_size=tp)
    r = audit_layer(cfg)
    audited[h, tp] = r
    print(f"h={h:<5} tp={tp}  forward {r['by_axis']['forward']}  backward {r['by_axis']['backward']}")
    if tp == 1:
        assert r["ops"] == {"forward": [], "backward": []}  # one device: nothing to communicate
    else:
        for phase in ("forward", "backward"):  # the paper's Fig. 4: 2 + 2 all-reduces of b*s*h over "model"
            assert r["ops"][phase] == [{"kind": "all-reduce", "axes": "model", "elements": b * s * h}] * 2

# %% [markdown]
# The message size, b * s * h elements, does not depend on tp: every rank all-reduces the full activation. Adding
# ranks shrinks each rank's matmuls but not its all-reduce volume (a ring moves 2 (tp - 1) / tp of it per rank).
#
# ## Time per layer on H100
#
# - Compute: FLOPs of one layer, forward + backward, per token: 6 x (12 h^2 + 13 h) for the weights + 12 h s for
#   attention scores and context (the per-layer terms of `ModelConfig.flops_per_token`), divided over tp ranks, at
#   989 TFLOP/s (H100 dense bf16 peak; mtx's measured training steps reach ~40-50% of it, docs/benchmarks.md).
# - Communication: 4 all-reduces of b s h bf16 values (2 bytes each); a ring all-reduce takes
#   2 (tp - 1) / tp x bytes / bus bandwidth. The bus bandwidth of a `psum` between 2 GPUs over NVLink, measured on
#   the benchmark machines: 66 GB/s at 16 MiB, 181 GB/s at 256 MiB, 246 GB/s at 1 GiB. The table uses
#   246 GB/s (best case) and, alongside, the bandwidth interpolated (log-linear) at the actual message size. These
#   are 2-GPU numbers; 4 and 8 GPUs on NVSwitch are assumed no faster.

# %%
PEAK_FLOPS = 989e12
BUS_BW = 246e9
MEASURED_BW = [(16 * 2**20, 66e9), (256 * 2**20, 181e9), (2**30, 246e9)]  # (bytes, bus bandwidth), 2-GPU psum


def bus_bandwidth(nbytes):
    sizes, bws = zip(*MEASURED_BW)
    return float(np.interp(np.log(nbytes), np.log(sizes), bws))  # clamped to the measured range


def layer_flops(h):
    """Forward + backward FLOPs of one layer per token; the same terms as ModelConfig.flops_per_token."""
    return 6 * (12 * h * h + 13 * h) + 12 * h * s


def allreduce_seconds(nbytes, tp, bw):
    return 2 * (tp - 1) / tp * nbytes / bw


# the per-layer FLOPs agree with the config's whole-model formula
for h in (1024, 3072):
    m2, m1 = (ModelConfig(num_layers=n, hidden_size=h, num_attention_heads=16, seq_length=s) for n in (2, 1))
    assert m2.flops_per_token() - m1.flops_per_token() == layer_flops(h)

HIDDEN = [1024, 1536, 2048, 2304, 3072]
TPS = [2, 4, 8]
rows = []
for h in HIDDEN:
    for tp in TPS:
        elements = b * s * h
        if (h, tp) in audited:  # where the audit compiled this shape, the message size is the compiler's
            assert {op["elements"] for op in audited[h, tp]["ops"]["forward"]} == {elements}
        nbytes = 2 * elements  # bf16 on the GPU
        compute = b * s * layer_flops(h) / tp / PEAK_FLOPS
        comm_peak = 4 * allreduce_seconds(nbytes, tp, BUS_BW)
        comm_sized = 4 * allreduce_seconds(nbytes, tp, bus_bandwidth(nbytes))
        rows.append(dict(h=h, tp=tp, mb=nbytes / 1e6, compute_ms=compute * 1e3, comm_ms=comm_peak * 1e3,
                         ratio=compute / comm_peak, bw=bus_bandwidth(nbytes) / 1e9, comm_sized_ms=comm_sized * 1e3,
                         ratio_sized=compute / comm_sized))

print(f"b={b}, s={s}, bf16; per layer, forward + backward, one device")
print(f"{'h':>5}{'tp':>4}{'MB/all-reduce':>15}{'compute ms':>12}{'comm ms':>9}{'ratio':>7}"
      f"{'bw@size GB/s':>14}{'comm ms':>9}{'ratio':>7}")
for r in rows:
    print(f"{r['h']:>5}{r['tp']:>4}{r['mb']:>15.1f}{r['compute_ms']:>12.3f}{r['comm_ms']:>9.3f}{r['ratio']:>7.2f}"
          f"{r['bw']:>14.0f}{r['comm_sized_ms']:>9.3f}{r['ratio_sized']:>7.2f}")

# %% [markdown]
# Compute ~ h^2 / tp while communication ~ h (tp - 1) / tp, so the ratio grows with h and falls with tp, asserted:

# %%
by = {(r["h"], r["tp"]): r for r in rows}
for key in ("ratio", "ratio_sized"):
    for tp in TPS:
        assert all(by[h1, tp][key] < by[h2, tp][key] for h1, h2 in zip(HIDDEN, HIDDEN[1:])), (key, tp)
    for h in HIDDEN:
        assert all(by[h, t1][key] > by[h, t2][key] for t1, t2 in zip(TPS, TPS[1:])), (key, h)
    # smaller messages get less bandwidth, so the size-aware ratio is never better than the best case
    assert all(r["ratio_sized"] <= r["ratio"] + 1e-12 for r in rows)
r = by[3072, 8]
print(f"8.3B's layer (h=3072) at tp=8: {r['compute_ms']:.2f} ms of peak-rate compute vs {r['comm_ms']:.2f} ms of "
      f"all-reduce at 246 GB/s: an H100 computes {PEAK_FLOPS / 125e12:.0f}x faster than the paper's V100 "
      f"(125 TFLOP/s) but NVLink did not grow as much, so TP = 8 leaves the all-reduces exposed unless overlapped.")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for i, tp in enumerate(TPS):
    hs = HIDDEN
    axes[0].plot(hs, [by[h, tp]["ratio"] for h in hs], "o-", color=f"C{i}", label=f"tp={tp}, 246 GB/s")
    axes[0].plot(hs, [by[h, tp]["ratio_sized"] for h in hs], "o--", color=f"C{i}", alpha=0.6,
                 label=f"tp={tp}, bw at message size")
    axes[1].plot(hs, [by[h, tp]["compute_ms"] for h in hs], "o-", color=f"C{i}", label=f"compute, tp={tp}")
    axes[1].plot(hs, [by[h, tp]["comm_ms"] for h in hs], "s--", color=f"C{i}", label=f"all-reduce, tp={tp}")
axes[0].axhline(1, color="k", lw=1)
axes[0].set_xlabel("hidden size h"), axes[0].set_ylabel("compute time / all-reduce time")
axes[0].legend(fontsize=7), axes[0].set_title("per layer, H100 bf16 peak, b=8, s=1024", fontsize=9)
axes[1].set_xlabel("hidden size h"), axes[1].set_ylabel("ms per layer (fwd + bwd)"), axes[1].set_yscale("log")
axes[1].legend(fontsize=7), axes[1].set_title("compute falls as 1/tp; all-reduce volume does not", fontsize=9)
show(fig, "05_comm_vs_compute")

# %% [markdown]
# ## Sequence parallelism: the same bytes, the element-wise work split
#
# With `--sequence-parallel` each rank keeps only its rows (b / tp whole sequences) of the residual stream, so
# LayerNorm, dropout and the residual adds run once per token instead of once per rank. Each all-reduce becomes an
# all-gather (before the column-parallel matmul) and a reduce-scatter (after the row-parallel one). A ring all-reduce
# is exactly a reduce-scatter followed by an all-gather, so the bytes on the wire do not change; the audit shows the
# swap and the message sizes:

# %%
h, heads, tp = 1024, 16, 2
sp = audit_layer(audit_config(hidden_size=h, num_attention_heads=heads, seq_length=s, micro_batch_size=b,
                              tensor_model_parallel_size=tp, sequence_parallel=True, recompute_granularity="matmuls"))
print("forward ", sp["by_axis"]["forward"], sp["elements"]["forward"])
print("backward", sp["by_axis"]["backward"], sp["elements"]["backward"])
assert sp["by_axis"]["forward"] == {"all-gather model": 2, "reduce-scatter model": 2}
# each gather delivers the b*s*h activation; each scatter leaves this rank's b/tp rows of it
assert sp["elements"]["forward"] == {"all-gather model": 2 * b * s * h, "reduce-scatter model": 2 * b * s * h // tp}
# elements a rank sends, from the audited counts: a gather delivers the whole bsh, of which (tp-1)/tp came from the
# others; a scatter leaves bsh/tp here and sent the other tp-1 shards of as many elements away. Against the same
# layer without sequence parallelism (audited above): the same volume as its ring all-reduces, 2 (tp-1)/tp each
gathered, scattered = (sp["elements"]["forward"][f"{kind} model"] for kind in ("all-gather", "reduce-scatter"))
ring_allreduce = sum(2 * (tp - 1) / tp * op["elements"] for op in audited[h, tp]["ops"]["forward"])
assert (tp - 1) / tp * gathered + (tp - 1) * scattered == ring_allreduce
# the backward mirrors the forward; the replicated LayerNorm and bias gradients, each rank's from its own rows, are
# summed over "model" once per step together with the data-parallel reduction, not inside the layer
assert sp["elements"]["backward"] == sp["elements"]["forward"]

# %% [markdown]
# What it buys on GPUs (docs/benchmarks.md, table 3, 1.2B on 2 H200s): the element-wise fusions per step fell from
# 65.4 to 46.9 ms, and weak scaling of the 2.5B model rose from 84% to 87%. What it does not buy: the collectives
# themselves, 27 ms per step with nothing to run beside them. Cutting each gather and scatter into tp - 1 ring steps
# beside the matmuls of the rows already present hid half of that time but cost more in half-size matmuls at TP 2, so
# that path was removed (docs/design.md); hiding the collectives needs peer-memory kernels inside the matmuls.
