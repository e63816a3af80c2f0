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
# # 4. Pipeline schedules and their bubbles: GPipe, 1F1B, interleaved
#
# mtx pipelines the layer stack as one `lax.scan` over M + P - 1 ticks (`mtx/parallel/pipeline.py`): at tick t,
# stage s runs microbatch t - s, then `ppermute` hands its output to stage s + 1. Ticks where t - s falls outside
# 0 .. M - 1 are the bubble: the stage computes on a clamped input whose result is never used. Autodiff through the
# scan runs the same ticks in reverse for the backward. The idle fraction is (P - 1) / (M + P - 1), whatever the
# layer cost, so it shrinks only by raising the number of microbatches M.

# %%
import importlib.util
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

from mtx.config import Config
from mtx.parallel.pipeline import Schedule
from mtx.plot import pyplot, show
from mtx.presets import load_preset

# benchmarks/bench.py is a script beside the package, not part of it: loaded from its file.
_spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks/bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
measure = bench.measure  # warm-up, then the median time of jitted train steps

assert len(jax.devices()) == 8
plt = pyplot()  # matplotlib on its file backend: show() writes each figure, then displays it


# %% [markdown]
# ## Which microbatch each stage runs at each tick
#
# `Schedule(counts, microbatches)` is the static shape of one pipelined step: layers per stage and M. The grid
# below follows the scan's rule (stage s, tick t: microbatch t - s, clamped in the bubble); -1 marks bubble cells.

# %%
P_, M_ = 4, 6
schedule = Schedule(counts=(2,) * P_, microbatches=M_)  # 8 layers on 4 stages, 6 microbatches
T = schedule.ticks
grid = np.array([[t - s if 0 <= t - s < M_ else -1 for t in range(T)] for s in range(P_)])
print(f"P={schedule.stages} stages, M={schedule.microbatches} microbatches, {T} ticks; ideal bubble "
      f"{schedule.bubble:.1%}")
print(grid)

assert schedule.stages == P_ and T == M_ + P_ - 1
for s in range(P_):
    assert sorted(grid[s][grid[s] >= 0]) == list(range(M_))  # every stage runs every microbatch exactly once
    assert list(np.flatnonzero(grid[s] >= 0)) == list(range(s, s + M_))  # in order, starting at tick s
# the last stage finishes microbatch t - (P - 1) at tick t: the scan keeps its outputs ys[P - 1:]
assert list(grid[P_ - 1, P_ - 1:]) == list(range(M_))
bubble_cells = int((grid < 0).sum())
assert bubble_cells == P_ * (P_ - 1)  # a triangle of P - 1 idle ticks per stage
assert bubble_cells / grid.size == schedule.bubble == (P_ - 1) / (M_ + P_ - 1)

# %% [markdown]
# Forward ticks, then the backward: autodiff runs the scan in reverse, so backward tick k undoes forward tick
# T - 1 - k and the same triangle of idle cells appears mirrored.

# %%
backward = grid[:, ::-1]
timeline = np.concatenate([grid, backward], axis=1)  # (P, 2T)
fig, ax = plt.subplots(figsize=(10, 2.6))
cmap = plt.get_cmap("tab10")
for s in range(P_):
    for t in range(2 * T):
        mb = timeline[s, t]
        forward = t < T
        color = "white" if mb < 0 else cmap(mb % 10)
        ax.add_patch(plt.Rectangle((t, s), 1, 1, facecolor=color, edgecolor="grey", alpha=1.0 if forward else 0.55,
                                   hatch=None if mb >= 0 else "///"))
        if mb >= 0:
            ax.text(t + 0.5, s + 0.5, ("F" if forward else "B") + str(mb), ha="center", va="center", fontsize=8)
ax.axvline(T, color="k", lw=2)
ax.set_xlim(0, 2 * T), ax.set_ylim(P_, 0)
ax.set_yticks(np.arange(P_) + 0.5, [f"stage {s}" for s in range(P_)])
ax.set_xlabel("tick (forward | backward); hatched = bubble")
ax.set_title(f"GPipe in one scan: P={P_}, M={M_}, bubble (P-1)/(M+P-1) = {schedule.bubble:.0%}", fontsize=10)
show(fig, "04_schedule")
assert (backward < 0).sum() == bubble_cells

# %% [markdown]
# ## 1F1B and interleaved 1F1B: the backward written out, memory bounded by P
#
# GPipe keeps what every forward tick saved until the backward scan runs, so activation memory grows with M. The
# default schedule, 1F1B (`mtx/parallel/one_f_one_b.py`), gives every tick one forward and one backward slot: after a
# warm-up of forwards each device alternates, so a microbatch's stage input is freed after at most 2 P - 1 ticks.
# Interleaving gives each device V chunks of layers (virtual stage c P + s is chunk c of device s): a microbatch
# travels the devices V times, each visit 1/V of the work, and the bubble shrinks to (P - 1) / (V M + P - 1).
# `Schedule.timetable()` is the plan the scan follows; its cells below are "F" + microbatch (chunk as a subscript
# letter) in the forward slot over "B" + microbatch in the backward slot.

# %%
def draw(ax, sched, title):
    table = sched.timetable()
    p = sched.stages
    for s in range(p):
        for t in range(sched.ticks):
            for row, kind in ((0, "fwd"), (1, "bwd")):
                mb, chunk = table[f"{kind}_mb"][t, s], table[f"{kind}_chunk"][t, s]
                color = "white" if mb < 0 else cmap(mb % 10)
                ax.add_patch(plt.Rectangle((t, s + row / 2), 1, 0.5, facecolor=color, edgecolor="grey",
                                           alpha=1.0 if kind == "fwd" else 0.55, hatch=None if mb >= 0 else "///"))
                if mb >= 0:
                    label = ("F" if kind == "fwd" else "B") + str(mb) + ("abc"[chunk] if sched.virtual > 1 else "")
                    ax.text(t + 0.5, s + row / 2 + 0.25, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, sched.ticks), ax.set_ylim(p, 0)
    ax.set_yticks(np.arange(p) + 0.5, [f"device {s}" for s in range(p)])
    ax.set_title(f"{title}: {sched.ticks} ticks, ideal bubble {sched.bubble:.0%}", fontsize=9)


one_f_one_b = Schedule((2,) * P_, M_ + 2, 1, "1f1b")  # M = 8 on P = 4
interleaved = Schedule((1,) * (2 * P_), M_ + 2, 2, "interleaved")  # the same 8 layers as 2 chunks per device
fig, axes = plt.subplots(2, 1, figsize=(12, 5.5))
draw(axes[0], one_f_one_b, f"1F1B, P={P_}, M={M_ + 2}")
draw(axes[1], interleaved, f"interleaved 1F1B, P={P_}, V=2, M={M_ + 2}")
axes[1].set_xlabel("tick (top half: forward slot, bottom half: backward slot; hatched = idle)")
show(fig, "04_one_f_one_b")

for sched in (one_f_one_b, interleaved):
    m, v = sched.microbatches, sched.virtual
    assert np.isclose(sched.bubble, (P_ - 1) / (v * m + P_ - 1))
    table = sched.timetable()
    # every device runs every (microbatch, chunk) forward and backward once
    for s in range(P_):
        assert sorted(zip(table["fwd_mb"][:, s], table["fwd_chunk"][:, s]))[-m * v:] == sorted(
            (i, c) for i in range(m) for c in range(v))
    # at most 2 P V - 1 stage inputs in flight on any device, whatever M (the ring: each chunk's most at once)
    assert sched.in_flight <= 2 * P_ * v - 1
assert interleaved.bubble < one_f_one_b.bubble  # V = 2 halves the idle ticks' share
print(f"bubble: GPipe/1F1B {one_f_one_b.bubble:.1%}, interleaved V=2 {interleaved.bubble:.1%} at M = {M_ + 2}")

# %% [markdown]
# ## The ideal bubble as M grows

# %%
ms = np.arange(1, 65)
ideal = {p: np.array([Schedule((1,) * p, int(m)).bubble for m in ms]) for p in (2, 4, 8)}
for p, curve in ideal.items():
    assert np.all(np.diff(curve) < 0)  # more microbatches, smaller bubble
    assert curve[0] == (p - 1) / p  # M = 1: only one stage ever works
    assert Schedule((1,) * p, 4 * p).bubble < 0.2  # the usual rule of thumb, M >= 4 P
assert np.all(ideal[2] < ideal[4]) and np.all(ideal[4] < ideal[8])  # more stages, bigger bubble at the same M

fig, ax = plt.subplots(figsize=(6, 3.4))
for p, curve in ideal.items():
    ax.plot(ms, curve, label=f"P = {p}")
ax.set_xscale("log", base=2), ax.set_xlabel("microbatches M"), ax.set_ylabel("ideal bubble (P-1)/(M+P-1)")
ax.legend(), ax.grid(alpha=0.3)
show(fig, "04_ideal_bubble")

# %% [markdown]
# ## Measured: pipelined vs unpipelined steps of the tiny model
#
# For each M, the same global batch is trained without pipelining on one device (T1) and over P = 2 stages (Tp),
# timed with `benchmarks/bench.py`'s `measure`. The measured bubble is 1 - T1 / (P Tp) (it also contains the shift
# communication). On simulated CPU devices all "devices" share the host's cores, so Tp cannot fall to T1 / P and
# these numbers are noise-prone: they are printed, not asserted. What is asserted: the pipelined run computes the
# same loss as the unpipelined one (fp32, no dropout), and reports the ideal bubble of its schedule. On GPUs,
# `python benchmarks/pipeline_bubble.py` measures the real thing.
#
# Measured on 2 x H200 (docs/benchmarks.md 4-4e; PP 2, M = 8; bubble = 1 - T1 / (2 Tp), ideal in brackets): on the
# 1.2B model (micro batch 8, `matmuls` recomputation) 1F1B 15.4% (11.1%), interleaved V = 2 12.2% (5.9%), 1.76x one
# GPU; GPipe 12.4% (11.1%) with `full` recomputation. The head's logits are spread over the stages by vocabulary, so
# both devices compute about the same (~615 ms a step with V = 2); what is left above the ideal is mostly the shifts
# waiting on each other (44-55 ms a step). 1F1B's peak memory is the same at M = 8 and 16 (31.4 GiB); GPipe's grows
# with M.

# %%
base = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
    vocab_size=257, hidden_dropout=0.0, attention_dropout=0.0, data_parallel_size=1, tensor_model_parallel_size=1)
PP = 2
mb = base.training.micro_batch_size
rows = []
for m in (2, 8):
    common = dict(global_batch_size=mb * m)
    flat = measure(base.replace(pipeline_model_parallel_size=1, **common), steps=3, warmup=1)
    piped = measure(base.replace(pipeline_model_parallel_size=PP, **common), steps=3, warmup=1)
    assert piped["microbatches"] == m and piped["pipeline"]["stages"] == PP
    assert np.isclose(piped["pipeline"]["ideal_bubble"], (PP - 1) / (m + PP - 1))
    # same batches, same weights: the pipeline changes where layers run, not the math
    np.testing.assert_allclose(piped["loss"], flat["loss"], rtol=1e-5)
    rows.append((m, flat["step_s"], piped["step_s"], piped["pipeline"]["ideal_bubble"],
                 1 - flat["step_s"] / (PP * piped["step_s"])))

print(f"{'M':>3}{'T1 ms':>9}{'Tp ms':>9}{'ideal bubble':>14}{'measured (CPU)':>16}")
for m, t1, tp, ideal_b, measured in rows:
    print(f"{m:>3}{t1 * 1e3:>9.1f}{tp * 1e3:>9.1f}{ideal_b:>14.1%}{measured:>16.1%}")
assert rows[0][3] > rows[1][3]  # the ideal bubble falls from M = 2 to M = 8
