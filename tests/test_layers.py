"""Each tensor-parallel layer equals its plain single-device version: values and gradients, fp32, rtol 1e-5.

The sharded layer runs inside shard_map (check_vma=True) on a (data, 1, model) mesh; the reference is written here
in plain jax.numpy on the global parameters. Gradients are taken through the whole shard_map, so a missing or
doubled all-reduce in f/g shows up as a wrong input or parameter gradient.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import ModelConfig
from mtx.models.transformer import (ParallelMLP, ParallelSelfAttention, TransformerLayer, attention_core,
                                    fused_attention)
from mtx.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, make_mesh
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.sharded import init_sharded, partition_specs

MESHES = [(dp, tp) for tp in (1, 2, 4, 8) for dp in (1, 2) if dp * tp <= 8]
B, S, D, F, N = 4, 8, 32, 64, 8
RTOL = 1e-5
CFG = ModelConfig(num_layers=2, hidden_size=D, num_attention_heads=N, ffn_hidden_size=F, seq_length=S,
                  vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)


def mesh_of(dp, tp):
    return make_mesh(dp, 1, tp, devices=jax.devices()[: dp * tp])


def run_sharded(make, mesh, x, x_spec, out_spec, call=lambda m, x: m(x)):
    """(y, dL/dparams, dL/dx) of the layer on `mesh`, with L = sum(y * r) for a fixed r; all global arrays."""
    graphdef, params = init_sharded(make, mesh)
    specs = partition_specs(params, mesh.shape["model"])
    fn = jax.shard_map(lambda p, x: call(nnx.merge(graphdef, p), x), mesh=mesh, in_specs=(specs, x_spec),
                       out_specs=out_spec)
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    y = jax.jit(fn)(params, x)
    r = jax.random.normal(jax.random.key(7), y.shape, jnp.float32)
    r = jax.device_put(r, y.sharding)
    float_input = jnp.issubdtype(x.dtype, jnp.floating)  # integer ids have no gradient
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x) * r), argnums=(0, 1) if float_input else 0))(params, x)
    grad_p, grad_x = grads if float_input else (grads, None)
    to_np = lambda tree: jax.tree.map(np.asarray, nnx.to_pure_dict(tree))
    return np.asarray(y), to_np(grad_p), None if grad_x is None else np.asarray(grad_x), np.asarray(r), to_np(params)


def reference(ref_fn, params, x, r):
    y, vjp = jax.vjp(lambda p: ref_fn(p, jnp.asarray(x)), params)
    if not np.issubdtype(np.asarray(x).dtype, np.floating):
        return np.asarray(y), jax.tree.map(np.asarray, vjp(jnp.asarray(r))[0]), None
    y, vjp = jax.vjp(ref_fn, params, jnp.asarray(x))
    gp, gx = vjp(jnp.asarray(r))
    return np.asarray(y), jax.tree.map(np.asarray, gp), np.asarray(gx)


def assert_close(actual, expected):
    """rtol 1e-5 per element, plus an absolute floor of 1e-5 x the array's largest magnitude: entries that are sums
    of cancelling terms (a gradient entry of 0.002 from terms of size 5) carry fp32 rounding of the terms' size."""
    def one(a, e):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * float(np.abs(e).max()))
    jax.tree.map(one, actual, expected)


def check(make, ref_fn, dp, tp, x, x_spec, out_spec, call=lambda m, x: m(x)):
    y, gp, gx, r, params = run_sharded(make, mesh_of(dp, tp), x, x_spec, out_spec, call)
    y_ref, gp_ref, gx_ref = reference(ref_fn, params, x, r)
    assert_close(y, y_ref)
    assert_close(gp, gp_ref)
    if gx is not None:
        assert_close(gx, gx_ref)


def x_BSD(features=D):
    return np.asarray(jax.random.normal(jax.random.key(1), (B, S, features), jnp.float32))


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(dp, tp, gather):
    make = lambda: ColumnParallelLinear(D, F, std=0.02, gather_output=gather, rngs=nnx.Rngs(0))
    out = P("data") if gather else P("data", None, "model")
    check(make, lambda p, x: x @ p["kernel"] + p["bias"], dp, tp, x_BSD(), P("data"), out)


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(dp, tp, input_is_parallel):
    make = lambda: RowParallelLinear(F, D, std=0.02, input_is_parallel=input_is_parallel, rngs=nnx.Rngs(0))
    x_spec = P("data", None, "model") if input_is_parallel else P("data")
    check(make, lambda p, x: x @ p["kernel"] + p["bias"], dp, tp, x_BSD(F), x_spec, P("data"))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_vocab_parallel_embedding(dp, tp):
    ids = np.asarray(jax.random.randint(jax.random.key(2), (B, S), 0, 1024))
    make = lambda: VocabParallelEmbedding(1024, D, std=0.02, rngs=nnx.Rngs(0))
    # gradient w.r.t. the table only (ids are integers)
    check(make, lambda p, ids: p["embedding"][ids], dp, tp, ids, P("data"), P("data"))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_tied_output_logits(dp, tp):
    make = lambda: VocabParallelEmbedding(1024, D, std=0.02, rngs=nnx.Rngs(0))
    check(make, lambda p, x: x @ p["embedding"].T, dp, tp, x_BSD(), P("data"), P("data", None, "model"),
          call=lambda m, x: m.attend(x))


@pytest.mark.parametrize("dp,tp", MESHES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy(dp, tp, label_smoothing):
    mesh = mesh_of(dp, tp)
    v = 1024
    logits = 3.0 * jax.random.normal(jax.random.key(3), (B, S, v), jnp.float32)
    targets = jax.random.randint(jax.random.key(4), (B, S), 0, v)
    fn = jax.shard_map(lambda z, t: vocab_parallel_cross_entropy(z, t, label_smoothing=label_smoothing), mesh=mesh,
                       in_specs=(P("data", None, "model"), P("data")), out_specs=P("data"))
    z = jax.device_put(logits, NamedSharding(mesh, P("data", None, "model")))
    t = jax.device_put(targets, NamedSharding(mesh, P("data")))
    r = jax.random.normal(jax.random.key(5), (B, S))

    def ref(z):
        onehot = optax.smooth_labels(jax.nn.one_hot(targets, v), label_smoothing)
        return optax.softmax_cross_entropy(z, onehot)

    loss = np.asarray(jax.jit(fn)(z, t))
    grad = np.asarray(jax.jit(jax.grad(lambda z: jnp.sum(fn(z, t) * jax.device_put(r, loss_sharding(mesh)))))(z))
    ref_loss, vjp = jax.vjp(ref, logits)
    assert_close(loss, np.asarray(ref_loss))
    assert_close(grad, np.asarray(vjp(r)[0]))


def test_cross_entropy_ignores_padding_columns_even_a_whole_slice_of_them():
    """With vocab_size the padding columns take no probability; at TP 4 with 40 real of 64 columns the last rank's
    slice is padding alone (its local max is -inf, which must not turn the global sum into NaN)."""
    mesh = mesh_of(1, 4)
    v, real = 64, 40
    logits = 3.0 * jax.random.normal(jax.random.key(3), (B, S, v), jnp.float32)
    targets = jax.random.randint(jax.random.key(4), (B, S), 0, real)
    fn = jax.shard_map(lambda z, t: vocab_parallel_cross_entropy(z, t, vocab_size=real), mesh=mesh,
                       in_specs=(P(None, None, "model"), P()), out_specs=P())
    z = jax.device_put(logits, NamedSharding(mesh, P(None, None, "model")))
    loss, grad = jax.jit(jax.value_and_grad(lambda z: fn(z, targets).sum()))(z)
    ref_loss, ref_grad = jax.value_and_grad(
        lambda z: optax.softmax_cross_entropy_with_integer_labels(z[..., :real], targets).sum())(logits)
    assert_close(np.asarray(loss), np.asarray(ref_loss))
    assert_close(np.asarray(grad), np.asarray(ref_grad))  # the reference's padding columns: exactly 0
    assert not np.asarray(grad)[..., real:].any()


def test_cross_entropy_keeps_the_logits_as_they_came_for_its_backward():
    """The backward is written out: it keeps the bf16 logits and the per-token log-sum-exps, no float32 array of the
    logits' size (autodiff kept exp(z) in float32, then built the gradient in float32; issue 24's profile)."""
    mesh = mesh_of(1, 2)
    v = 1024
    fn = jax.shard_map(lambda z, t: vocab_parallel_cross_entropy(z, t, vocab_size=1000), mesh=mesh,
                       in_specs=(P(None, None, "model"), P()), out_specs=P())
    logits = jax.device_put(jax.random.normal(jax.random.key(3), (B, S, v), jnp.bfloat16),
                            NamedSharding(mesh, P(None, None, "model")))
    targets = jax.device_put(jax.random.randint(jax.random.key(4), (B, S), 0, 1000), NamedSharding(mesh, P()))
    _, pullback = jax.vjp(lambda z: fn(z, targets).sum(), logits)
    saved = [(r.shape, r.dtype) for r in jax.tree.leaves(pullback)]  # the residuals the backward reads
    big = [(shape, dtype) for shape, dtype in saved if np.prod(shape) >= B * S * v // 2]
    assert big and all(dtype == jnp.bfloat16 for _, dtype in big), saved


def loss_sharding(mesh):
    return NamedSharding(mesh, P("data"))


def test_cross_entropy_is_stable_for_huge_logits():
    mesh = mesh_of(1, 8)
    logits = jnp.zeros((1, 1, 1024)).at[0, 0, 5].set(1e4)
    fn = jax.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "model"), P()),
                       out_specs=P())
    loss = np.asarray(jax.jit(fn)(jax.device_put(logits, NamedSharding(mesh, P(None, None, "model"))),
                                  jnp.array([[5]])))
    assert np.isfinite(loss).all() and abs(loss[0, 0]) < 1e-6


# ---- attention, MLP and the whole layer against a plain reference ----

def ref_attention(p, x):
    """Plain causal multi-head attention with the fused (N, 3, H) column order of the QKV weight."""
    h = D // N
    qkv = (x @ p["qkv"]["kernel"] + p["qkv"]["bias"]).reshape(B, S, N, 3, h)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(h)
    scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -jnp.inf)
    ctx = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, -1), v).reshape(B, S, D)
    return ctx @ p["proj"]["kernel"] + p["proj"]["bias"]


def ref_mlp(p, x):
    hidden = jax.nn.gelu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"], approximate=True)
    return hidden @ p["fc2"]["kernel"] + p["fc2"]["bias"]


def ref_layernorm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def ref_layer(p, x):
    x = x + ref_attention(p["attention"], ref_layernorm(p["ln1"], x))
    return x + ref_mlp(p["mlp"], ref_layernorm(p["ln2"], x))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_parallel_mlp(dp, tp):
    check(lambda: ParallelMLP(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)), ref_mlp, dp, tp, x_BSD(), P("data"),
          P("data"))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_parallel_self_attention(dp, tp):
    check(lambda: ParallelSelfAttention(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)), ref_attention, dp, tp, x_BSD(),
          P("data"), P("data"))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_transformer_layer(dp, tp):
    check(lambda: TransformerLayer(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)), ref_layer, dp, tp, x_BSD(),
          P("data"), P("data"))


def test_padding_mask_hides_padded_keys():
    mesh = mesh_of(1, 2)
    make = lambda: ParallelSelfAttention(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = init_sharded(make, mesh)
    mask = jnp.ones((B, S), jnp.int32).at[:, S // 2:].set(0)
    fn = jax.jit(jax.shard_map(lambda p, x, m: nnx.merge(graphdef, p)(x, mask_BS=m), mesh=mesh,
                               in_specs=(partition_specs(params, 2), P(), P()), out_specs=P()))
    x = jnp.asarray(x_BSD())
    x2 = x.at[:, S // 2:].set(123.0)  # change only padded positions
    y1, y2 = np.asarray(fn(params, x, mask)), np.asarray(fn(params, x2, mask))
    np.testing.assert_allclose(y1[:, : S // 2], y2[:, : S // 2], rtol=RTOL, atol=RTOL)
    assert not np.allclose(y1[:, S // 2:], y2[:, S // 2:])


def test_fused_attention_with_bert_padding_equals_the_masked_reference():
    """BERT's padding mask reaches the fused path as each row's count of real keys (cuDNN's form): every position's
    output, padding queries included, and every input gradient equal the explicit-mask reference."""
    b, s, n, h = 4, 16, 2, 8
    q, k, v, dy = (jax.random.normal(jax.random.key(i), (b, s, n, h)) for i in range(4))
    real = np.array([16, 11, 3, 0])  # a full row, two padded ones, and one of padding alone
    mask_BS = jnp.asarray(np.arange(s)[None, :] < real[:, None], jnp.int32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v, mask_BS=mask_BS, causal=False)[:3] * dy[:3])  # the padding row: never read

    for fused_out, ref_out in zip(jax.value_and_grad(functools.partial(loss, fused_attention), (0, 1, 2))(q, k, v),
                                  jax.value_and_grad(functools.partial(loss, attention_core), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(fused_out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    fused, ref = (np.asarray(f(q, k, v, mask_BS=mask_BS, causal=False)) for f in (fused_attention, attention_core))
    np.testing.assert_allclose(fused[:3], ref[:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 4)])
def test_fused_attention_path_equals_the_reference(dp, tp):
    """--use-flash-attn: jax.nn.dot_product_attention (cuDNN on GPU; XLA here) gives the same layer."""
    make = lambda: ParallelSelfAttention(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0), flash=True)
    check(make, ref_attention, dp, tp, x_BSD(), P("data"), P("data"))
