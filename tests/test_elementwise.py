"""LayerNorm and RMSNorm with their backward written out (mtx/kernels/elementwise.py): the values and gradients of
autodiff through the plain formulas, and `matmuls` recomputation keeps their row statistics instead of recomputing
them in the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtx.kernels.elementwise import layer_norm, rms_norm
from mtx.models.stack import save_matmul_outputs


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
