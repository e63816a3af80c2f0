"""LayerNorm, RMSNorm and bias + GeLU with their backward written out (mtx/kernels/elementwise.py): the values and
gradients of autodiff through the plain formulas, `matmuls` recomputation keeps the norms' row statistics instead of
recomputing them in the backward, and the MLP activations' backward keeps nothing but their inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtx.config import Config
from mtx.kernels.elementwise import bias_gelu, layer_norm, rms_norm, swiglu
from mtx.models.stack import save_matmul_outputs
from mtx.presets import load_preset

from helpers import LLAMA_BLOCKS, loss_and_grads


def plain_layer_norm(x, scale, bias, epsilon, dtype):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias).astype(dtype)


def plain_rms_norm(x, scale, epsilon, dtype):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + epsilon) * scale).astype(dtype)


NORMS = {"LayerNorm": (layer_norm, plain_layer_norm, 2), "RMSNorm": (rms_norm, plain_rms_norm, 1)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_norm_equals_autodiff_of_its_formula(norm, dtype):
    fn, plain, n_params = NORMS[norm]
    k = jax.random.split(jax.random.key(0), 5)
    x = (3 * jax.random.normal(k[0], (3, 5, 48)) + 1).astype(dtype)  # an offset mean, so LayerNorm's centring counts
    params = [1 + 0.2 * jax.random.normal(k[1], (48,)), 0.1 * jax.random.normal(k[2], (48,))][:n_params]
    weights = jax.random.normal(k[3], x.shape)  # a loss whose gradient differs per element

    def loss(f):
        return lambda x, *p: (f(x, *p, 1e-5, dtype).astype(jnp.float32) * weights).sum()

    argnums = tuple(range(1 + n_params))
    value, grads = jax.value_and_grad(loss(fn), argnums)(x, *params)
    value_ref, grads_ref = jax.value_and_grad(loss(plain), argnums)(x, *params)
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    assert fn(x, *params, 1e-5, dtype).dtype == dtype
    for g, ref in zip(grads, grads_ref):  # x's gradient in x's dtype, the parameters' in float32
        assert g.dtype == ref.dtype
        scale = float(jnp.abs(ref.astype(jnp.float32)).max())
        ulp = 1e-6 if dtype == jnp.float32 else 2 ** -7  # bf16: one unit in the last place of the largest entry
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(ref, np.float32), rtol=0, atol=ulp * scale)


def _rsqrts(policy, norm):
    """rsqrt ops in the gradient of a checkpointed norm -> matmul under `policy`: 1 if the backward takes the
    forward's statistics, 2 if it recomputes them."""
    fn, _, n_params = NORMS[norm]
    body = jax.checkpoint(lambda x, w, *p: fn(x, *p, 1e-5, jnp.bfloat16) @ w, policy=policy)
    loss = lambda *args: body(*args).astype(jnp.float32).sum()
    args = (jnp.ones((2, 4, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16), jnp.ones(16), jnp.zeros(16))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(*args[:2 + n_params])
    return str(jaxpr).count("rsqrt")


@pytest.mark.parametrize("norm", list(NORMS))
def test_matmul_recomputation_keeps_the_norms_statistics(norm):
    assert _rsqrts(save_matmul_outputs, norm) == 1
    # the same policy without the statistics recomputes them (what the test would see if the name were dropped)
    assert _rsqrts(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, norm) == 2


@pytest.mark.parametrize("norm", list(NORMS))
def test_backward_reads_the_statistics_through_a_barrier(norm):
    """The backward takes the forward's float32 row statistics as stored values (XLA on GPUs would otherwise fuse
    their reductions into the backward again and write x^ * dy in float32 for the scale's gradient)."""
    fn, _, n_params = NORMS[norm]
    loss = lambda x, *p: fn(x, *p, 1e-5, jnp.bfloat16).astype(jnp.float32).sum()
    args = (jnp.ones((2, 4, 16), jnp.bfloat16), jnp.ones(16), jnp.zeros(16))[:1 + n_params]
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).as_text()
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    assert len(barriers) == 1
    assert barriers[0].count("tensor<2x4x1xf32>") == (2 if norm == "LayerNorm" else 1)  # mean and rstd, or rstd


def _as_accurate_as_autodiff(fn, plain, args):
    """fn's value and gradients (of a loss weighting every element) against float32 autodiff of `plain`: in float32
    equal to rounding, in bf16 within twice the error of autodiff of `plain` in bf16 itself (the path fn replaces),
    element by element at the scale of the largest gradient entry."""
    weights = jax.random.normal(jax.random.key(9), args[0].shape)
    loss = lambda f: lambda *a: (f(*a).astype(jnp.float32) * weights).sum()
    argnums = tuple(range(len(args)))
    got = jax.value_and_grad(loss(fn), argnums)(*args)
    same = jax.value_and_grad(loss(plain), argnums)(*args)  # autodiff in the arguments' dtype
    exact = jax.value_and_grad(loss(plain), argnums)(*(a.astype(jnp.float32) for a in args))
    for ours, theirs, ref in zip(jax.tree.leaves(got), jax.tree.leaves(same), jax.tree.leaves(exact)):
        assert ours.dtype == theirs.dtype
        scale = float(jnp.abs(ref).max())
        error = lambda x: float(jnp.abs(x.astype(jnp.float32) - ref).max())
        assert error(ours) <= max(2 * error(theirs), 1e-6 * scale), (error(ours), error(theirs), scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_bias_gelu_is_as_accurate_as_autodiff_of_jax_gelu(with_bias, dtype):
    k = jax.random.split(jax.random.key(1), 2)
    h = (2 * jax.random.normal(k[0], (3, 5, 64))).astype(dtype)
    bias = (0.5 * jax.random.normal(k[1], (64,))).astype(dtype)
    if with_bias:
        _as_accurate_as_autodiff(bias_gelu, lambda h, b: jax.nn.gelu(h + b, approximate=True), (h, bias))
    else:
        _as_accurate_as_autodiff(bias_gelu, lambda h: jax.nn.gelu(h, approximate=True), (h,))
    assert bias_gelu(h, bias).dtype == bias_gelu(h).dtype == dtype


def test_bias_gelu_keeps_only_its_inputs_for_the_backward():
    """Autodiff of jax.nn.gelu keeps the tanh of every element for the backward (one more activation written and
    read a layer); the written-out backward keeps h and the bias and recomputes it."""
    h, bias = jnp.ones((4, 8, 32), jnp.bfloat16), jnp.ones(32, jnp.bfloat16)

    def residual_shapes(f):
        _, residuals = jax.vjp(f, h, bias)
        return sorted(leaf.shape for leaf in jax.tree.leaves(residuals) if leaf.size > 1)

    assert residual_shapes(bias_gelu) == [(4, 8, 32), (32,)]
    assert residual_shapes(lambda h, b: jax.nn.gelu(h + b, approximate=True)).count((4, 8, 32)) >= 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_is_as_accurate_as_autodiff_of_jax_silu(dtype):
    gate, up = (2 * jax.random.normal(jax.random.key(2), (2, 2, 3, 40))).astype(dtype)
    _as_accurate_as_autodiff(swiglu, lambda g, u: jax.nn.silu(g) * u, (gate, up))
    _, residuals = jax.vjp(swiglu, gate, up)  # the two inputs, nothing computed from them (autodiff keeps 5)
    assert len(jax.tree.leaves(residuals)) == 2


@pytest.mark.parametrize("blocks,flag,mesh", [({}, "bias_gelu_fusion", (2, 1, 2)),
                                              (LLAMA_BLOCKS, "bias_swiglu_fusion", (1, 2, 2))], ids=["gelu", "swiglu"])
def test_the_fused_activations_train_as_autodiff_does_on_a_mesh(blocks, flag, mesh):
    """The whole model with the written-out activation (--bias-gelu-fusion, --bias-swiglu-fusion) and with autodiff's
    (the default) on a mesh with sequence parallelism: the same loss and every gradient (the bias's gradient summed
    over the rows of every rank)."""
    preset = {**load_preset("configs/tiny.toml"), "global_batch_size": 8, "micro_batch_size": 4}
    cfg = Config().replace(**preset, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=True, **blocks)
    loss, grads = loss_and_grads(cfg, *mesh, **{flag: True})
    ref_loss, ref = loss_and_grads(cfg, *mesh)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert grads.keys() == ref.keys()
    for path in ref:
        np.testing.assert_allclose(grads[path], ref[path], rtol=1e-4, atol=1e-6 * np.abs(ref[path]).max(),
                                   err_msg=path)


def test_a_checkpoint_resumes_with_either_setting():
    """The settings change how a backward is computed, no parameter: a run saved with either resumes with the other
    (`check_compatible`), and --use-checkpoint-args leaves this run's choice alone."""
    from mtx.checkpoint import check_compatible
    from mtx.config import ModelConfig
    from mtx.resume import ARCHITECTURE

    check_compatible(Config(), ModelConfig(bias_gelu_fusion=True, bias_swiglu_fusion=True), "ck")
    assert not {"bias_gelu_fusion", "bias_swiglu_fusion"} & set(ARCHITECTURE)
