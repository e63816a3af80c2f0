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
# # 2. Why column-parallel first, then row-parallel (paper section 3)
#
# Megatron splits the MLP's first weight A by columns and the second, B, by rows: `Y = GeLU(X A)`, `Z = Y B`.
# GeLU is element-wise, so it commutes with a column split of A: each rank applies it to its own slice of `X A`
# and hands that slice straight to its rows of B. One all-reduce (`g`) at the end, forward; one (`f`) at the start,
# backward. The other order, rows of A first, leaves each rank with a *partial sum* of `X A`: GeLU of a sum is not
# the sum of GeLUs, so the full (b, s, F) pre-activation must be all-reduced before the GeLU, and the column-split B
# then leaves the output split, to be gathered.
#
# Here both orders run on 8 simulated devices (2 data x 4 model ranks), equal the unsharded MLP (values and
# gradients), and the collectives XLA compiles are counted from the optimized HLO with `mtx.audit.collectives`.
# The same is done for the attention block (heads split) and for the vocab-parallel loss against gathering logits.

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

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.audit import audit_config, audit_layer, audit_loss, collectives, summarize
from mtx.config import Config
from mtx.models.transformer import ParallelMLP, ParallelSelfAttention
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.mesh import DATA, MODEL, make_mesh
from mtx.parallel.ops import f, gather_from_model_parallel, scatter_to_model_parallel
from mtx.parallel.sharded import init_sharded, partition_specs
from mtx.plot import pyplot, show
from mtx.presets import load_preset

assert len(jax.devices()) == 8
plt = pyplot()  # matplotlib on its file backend: show() writes each figure, then displays it

# %% [markdown]
# ## Setup: a (2, 1, 4) mesh, the tiny model's widths, a helper that compiles and counts
#
# The helper compiles a function of local shards inside `jax.shard_map`, forward alone and forward + backward
# (gradients of `sum(y * dy)` w.r.t. the weights and the input), with XLA's all-reduce combiner off as
# `mtx/audit.py` does (the combiner would merge independent all-reduces into one launch and hide the per-op
# counts). Backward = (forward + backward) - forward. The same compiled programs are then run on real arrays.

# %%
DP, TP = 2, 4
mesh = make_mesh(DP, 1, TP)
SIZES = dict(mesh.shape)
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
cfg = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
    tensor_model_parallel_size=TP, data_parallel_size=DP, hidden_dropout=0.0, attention_dropout=0.0,
    vocab_size=257, seq_length=16)
m = cfg.model
B, S, D, F, N, H, V = 4, m.seq_length, m.hidden_size, m.ffn_size, m.num_attention_heads, m.head_dim, m.padded_vocab_size
b = B // DP  # the batch one device sees: collectives move b * s * ... elements each
print(f"global batch B={B} (b={b} per data rank), S={S}, D={D}, F={F}, N={N} heads, V={V}, tp={TP}")
is_spec = lambda x: isinstance(x, P)  # noqa: E731

rng = np.random.default_rng(0)
x_BSD = rng.standard_normal((B, S, D), np.float32)
dy_BSD = rng.standard_normal((B, S, D), np.float32)
batch = NamedSharding(mesh, P(DATA))
x, dy = jax.device_put(x_BSD, batch), jax.device_put(dy_BSD, batch)


def compile_and_run(local_fn, specs, params, x, dy):
    """local_fn(params, x) -> y inside shard_map: (collective report, y, weight grads, input grad)."""
    def forward(p, x_BSD, dy_BSD):
        return local_fn(p, x_BSD)

    def forward_backward(p, x_BSD, dy_BSD):
        p = jax.tree.map(lambda v: jax.lax.pcast(v, DATA, to="varying"), p)  # no data all-reduce inside the layer
        loss, (dp, dx) = jax.value_and_grad(lambda p, x: jnp.sum(local_fn(p, x) * dy_BSD), argnums=(0, 1))(p, x_BSD)
        return loss[None], jax.tree.map(lambda g: g[None], dp), dx  # one weight gradient per data rank

    per_rank = jax.tree.map(lambda s: P(DATA, *s), specs, is_leaf=is_spec)
    in_specs = (specs, P(DATA), P(DATA))
    fns = (jax.shard_map(forward, mesh=mesh, in_specs=in_specs, out_specs=P(DATA)),
           jax.shard_map(forward_backward, mesh=mesh, in_specs=in_specs, out_specs=(P(DATA), per_rank, P(DATA))))
    compiled = [jax.jit(fn).lower(params, x, dy).compile(compiler_options=NO_COMBINER) for fn in fns]
    report = summarize(*(collectives(c.as_text(), SIZES) for c in compiled))
    y = compiled[0](params, x, dy)
    _, dparams, dx = compiled[1](params, x, dy)
    return report, np.asarray(y), jax.tree.map(lambda g: np.asarray(g).sum(0), dparams), np.asarray(dx)


def ops(report, phase):
    return sorted((op["kind"], op["elements"]) for op in report["ops"][phase])


def close(a, b, what):
    scale = float(np.abs(b).max())
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


# %% [markdown]
# ## The MLP, column then row (mtx's `ParallelMLP`)

# %%
graphdef, mlp_params = init_sharded(lambda: ParallelMLP(m, dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh)
mlp_specs = partition_specs(mlp_params, TP)
W = jax.tree.map(np.asarray, nnx.to_pure_dict(mlp_params))  # the global weights, for the references
print("declared layouts:", nnx.to_pure_dict(mlp_specs))

col_row, y_cr, grads_cr, dx_cr = compile_and_run(lambda p, x: nnx.merge(graphdef, p)(x), mlp_specs, mlp_params, x, dy)
grads_cr = nnx.to_pure_dict(grads_cr)


def mlp_reference(w1, b1, w2, b2, x):
    return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2 + b2


ref_args = (W["fc1"]["kernel"], W["fc1"]["bias"], W["fc2"]["kernel"], W["fc2"]["bias"], x_BSD)
y_ref = np.asarray(mlp_reference(*ref_args))
g_ref = [np.asarray(g) for g in jax.grad(lambda *a: jnp.sum(mlp_reference(*a) * dy_BSD), argnums=range(5))(*ref_args)]

close(y_cr, y_ref, "column-then-row output")
for got, want, name in zip([grads_cr["fc1"]["kernel"], grads_cr["fc1"]["bias"], grads_cr["fc2"]["kernel"],
                            grads_cr["fc2"]["bias"], dx_cr], g_ref, ["dW1", "db1", "dW2", "db2", "dx"]):
    close(got, want, f"column-then-row {name}")
print("column then row:", col_row["by_axis"])

# %% [markdown]
# ## The MLP, row then column (written here)
#
# A split by rows: rank r holds rows `D r / tp ... D (r+1) / tp` of A, so it needs only those input features (a
# local slice of the replicated x, whose backward all-reduces the input gradient), and produces a partial sum of
# the whole (b, s, F) pre-activation. That sum must be all-reduced *before* the GeLU. B is then split by columns,
# giving each rank D / tp output features, which are all-gathered so the residual stream is replicated again.

# %%
def row_then_column(p, x_BSD):
    x_BSd = scatter_to_model_parallel(x_BSD)  # this rank's D / tp input features (backward: all-reduce of b*s*D)
    h_BSF = jax.lax.psum(x_BSd @ p["w1"], MODEL) + p["b1"]  # all-reduce of b*s*F: GeLU(sum) != sum(GeLU)
    h_BSF = jax.nn.gelu(h_BSF, approximate=True)
    y_BSd = f(h_BSF) @ p["w2"] + p["b2"]  # columns of B: D / tp outputs (f: backward all-reduce of b*s*F)
    return gather_from_model_parallel(y_BSd)  # all-gather of b*s*D to a replicated output


rc_specs = {"w1": P(MODEL, None), "b1": P(None), "w2": P(None, MODEL), "b2": P(MODEL)}
rc_params = {k: jax.device_put(v, NamedSharding(mesh, rc_specs[k])) for k, v in zip(rc_specs, ref_args[:4])}
row_col, y_rc, grads_rc, dx_rc = compile_and_run(row_then_column, rc_specs, rc_params, x, dy)

close(y_rc, y_ref, "row-then-column output")
for got, want, name in zip([grads_rc[k] for k in rc_specs] + [dx_rc], g_ref, ["dW1", "db1", "dW2", "db2", "dx"]):
    close(got, want, f"row-then-column {name}")
print("row then column:", row_col["by_axis"])

# %% [markdown]
# Both give the unsharded MLP's output and gradients. What they move per device, each op of b*s*... elements:

# %%
print(f"{'':18}{'forward':<52}{'backward'}")
for name, r in [("column then row", col_row), ("row then column", row_col)]:
    print(f"{name:18}{str(ops(r, 'forward')):<52}{ops(r, 'backward')}")

# column then row: one all-reduce of b*s*D forward (g), one backward (f); nothing else
assert ops(col_row, "forward") == ops(col_row, "backward") == [("all-reduce", b * S * D)]
# row then column: an all-reduce of the b*s*F pre-activation plus an all-gather of the output, forward; backward
# all-reduces both the F-wide and the D-wide input gradients
assert ops(row_col, "forward") == sorted([("all-reduce", b * S * F), ("all-gather", b * S * D)])
assert ops(row_col, "backward") == sorted([("all-reduce", b * S * F), ("all-reduce", b * S * D)])
count = lambda r: sum(len(r["ops"][p]) for p in ("forward", "backward"))  # noqa: E731
moved = lambda r: sum(op["elements"] for p in ("forward", "backward") for op in r["ops"][p])  # noqa: E731
assert count(col_row) == 2 < count(row_col) == 4
assert moved(col_row) == 2 * b * S * D and moved(row_col) == (2 * F + 2 * D) * b * S  # 5x with F = 4 D
print(f"collectives per MLP (fwd + bwd): {count(col_row)} vs {count(row_col)}; "
      f"elements: {moved(col_row):,} vs {moved(row_col):,} ({moved(row_col) / moved(col_row):.0f}x)")

# %% [markdown]
# ## Attention: heads split over "model"
#
# The fused QKV projection is column-parallel with columns ordered (N, 3, H), so each rank owns the q, k and v of
# N / tp whole heads and runs softmax attention on them with no communication; the output projection is
# row-parallel and ends with `g`. Compared here with attention written out on the global weights.

# %%
agraph, attn_params = init_sharded(lambda: ParallelSelfAttention(m, dtype=jnp.float32, rngs=nnx.Rngs(1)), mesh)
A = jax.tree.map(np.asarray, nnx.to_pure_dict(attn_params))


def attention_reference(a, x):
    bb, s, _ = x.shape
    qkv = (x @ a["qkv"]["kernel"] + a["qkv"]["bias"]).reshape(bb, s, N, 3, H)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(H)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    ctx = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, -1), v).reshape(bb, s, D)
    return ctx @ a["proj"]["kernel"] + a["proj"]["bias"]


attn_specs = partition_specs(attn_params, TP)
attn, y_attn, grads_attn, dx_attn = compile_and_run(lambda p, x: nnx.merge(agraph, p)(x), attn_specs, attn_params, x,
                                                    dy)
grads_attn = nnx.to_pure_dict(grads_attn)
close(y_attn, np.asarray(attention_reference(A, x_BSD)), "attention output")
ga_ref, gx_ref = jax.grad(lambda a, x: jnp.sum(attention_reference(a, x) * dy_BSD), argnums=(0, 1))(A, x_BSD)
for path, got in jax.tree_util.tree_leaves_with_path(grads_attn):
    want = ga_ref
    for k in path:
        want = want[k.key]
    close(got, np.asarray(want), f"attention grad {jax.tree_util.keystr(path)}")
close(dx_attn, np.asarray(gx_ref), "attention dx")
print("attention:", attn["by_axis"])
assert ops(attn, "forward") == ops(attn, "backward") == [("all-reduce", b * S * D)]

# %% [markdown]
# A whole pre-LN layer is attention + MLP: `mtx.audit.audit_layer` compiles `TransformerLayer` and finds exactly
# the paper's Fig. 4, two all-reduces of b*s*D forward and two backward, the sum of the two blocks above.

# %%
acfg = audit_config(hidden_size=D, num_attention_heads=N, seq_length=S, micro_batch_size=b,
                    tensor_model_parallel_size=TP, data_parallel_size=DP, vocab_size=257)
layer = audit_layer(acfg)
print("TransformerLayer:", layer["by_axis"])
assert layer["by_axis"] == {"forward": {"all-reduce model": 2}, "backward": {"all-reduce model": 2}}
for phase in ("forward", "backward"):
    assert ops(layer, phase) == sorted(ops(attn, phase) + ops(col_row, phase))

# %% [markdown]
# ## The loss: vocab-parallel cross-entropy vs gathering the logits
#
# The tied output layer leaves each rank with logits for V / tp vocabulary entries. Gathering them moves b*s*V
# elements per device. mtx's `vocab_parallel_cross_entropy` reduces three b*s scalars instead: the max, the sum of
# exponentials and the target's logit, V / 3 times less traffic (about 17,000x at GPT-2's padded 51,200).

# %%
def gathered_cross_entropy(z_BSv, y_BS):
    z_BSV = gather_from_model_parallel(z_BSv)  # all-gather of b*s*V logits
    logp_BSV = jax.nn.log_softmax(z_BSV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BSV, y_BS[..., None], axis=-1)[..., 0]


def compile_loss(ce, z, y):
    specs = (P(DATA, None, MODEL), P(DATA))

    def forward_backward(z, y):
        loss, dz = jax.value_and_grad(lambda z: jnp.sum(ce(z, y)))(z)
        return loss[None], dz

    fns = (jax.shard_map(ce, mesh=mesh, in_specs=specs, out_specs=P(DATA)),
           jax.shard_map(forward_backward, mesh=mesh, in_specs=specs, out_specs=(P(DATA), specs[0])))
    compiled = [jax.jit(fn).lower(z, y).compile(compiler_options=NO_COMBINER) for fn in fns]
    report = summarize(*(collectives(c.as_text(), SIZES) for c in compiled))
    return report, np.asarray(compiled[0](z, y)), np.asarray(compiled[1](z, y)[1])


z_BSV = 3 * rng.standard_normal((B, S, V), np.float32)
y_BS = rng.integers(0, V, (B, S)).astype(np.int32)
z = jax.device_put(z_BSV, NamedSharding(mesh, P(DATA, None, MODEL)))
y = jax.device_put(y_BS, batch)
vocab_parallel, loss_vp, dz_vp = compile_loss(lambda z, y: vocab_parallel_cross_entropy(z, y), z, y)
gathered, loss_g, dz_g = compile_loss(gathered_cross_entropy, z, y)

loss_ref = -np.take_along_axis(np.asarray(jax.nn.log_softmax(z_BSV, -1)), y_BS[..., None], -1)[..., 0]
dz_ref = np.asarray(jax.nn.softmax(z_BSV, -1)) - np.eye(V, dtype=np.float32)[y_BS]  # softmax - onehot
for got, want, name in [(loss_vp, loss_ref, "vocab-parallel loss"), (loss_g, loss_ref, "gathered loss"),
                        (dz_vp, dz_ref, "vocab-parallel dz"), (dz_g, dz_ref, "gathered dz")]:
    close(got, want, name)

audited = audit_loss(acfg)  # mtx's own audit of the same loss, on the same mesh and shapes
print("vocab-parallel (audit_loss):", audited["ops"])
print("gathered logits:            ", gathered["ops"])
assert audited["ops"] == vocab_parallel["ops"]
assert ops(audited, "forward") == [("all-reduce", b * S)] * 3 and ops(audited, "backward") == []
assert ops(gathered, "forward") == [("all-gather", b * S * V)] and ops(gathered, "backward") == []
print(f"elements moved per device: {moved(audited):,} (3 b s) vs {moved(gathered):,} (b s V): "
      f"{moved(gathered) / moved(audited):.0f}x")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
labels = ["MLP\ncolumn then row", "MLP\nrow then column", "loss\nvocab-parallel", "loss\ngather logits"]
values = [moved(r) for r in (col_row, row_col, audited, gathered)]
ax.bar(labels, values, color=["C2", "C3", "C2", "C3"])
for i, (v, r) in enumerate(zip(values, (col_row, row_col, audited, gathered))):
    ax.text(i, v, f"{count(r)} ops\n{v:,}", ha="center", va="bottom", fontsize=8)
ax.set_yscale("log"), ax.set_ylabel("elements moved per device (fwd + bwd)")
ax.set_title(f"b={b}, s={S}, D={D}, F={F}, V={V}, tp={TP}", fontsize=9)
show(fig, "02_collectives")
