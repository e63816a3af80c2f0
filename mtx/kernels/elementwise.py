"""LayerNorm and RMSNorm with their backward written out, so XLA fuses each pass into few reads of bf16 activations.

Both normalize over the last axis in float32 whatever the activations' dtype, and return `dtype`. Differentiated by
autodiff, a LayerNorm's backward is a chain XLA compiles into several passes on a GPU: the normalized input is
written in float32 (4 bytes an element) for the scale's gradient, and the statistics are computed again in each
pass that needs them. Here the backward is the textbook one, from the bf16 input, the output gradient and the
two float32 statistics of each row:

    x^ = (x - mean) * rstd,  g = dy * scale
    dx = rstd * (g - mean(g) - x^ * mean(g * x^))        (RMSNorm: x^ = x * rstd, no mean(g) term)
    dscale = sum over rows of dy * x^,  dbias = sum over rows of dy

The statistics (two float32 numbers a row, named `STATISTICS` for the recomputation policies) are what the backward
takes from the forward: with them the scale's and bias's gradients are plain column sums of bf16 inputs, which XLA
fuses into one pass; recomputed, their row reductions end in a separate float32 pass. The backward reads them through
an optimization barrier (`_kept`): without it XLA on GPUs fuses the forward's row reductions into the backward's
fusions again (their input is read there anyway), and the scale's gradient then writes x^ * dy in float32 before its
column sum, as autodiff's did. Values and gradients are those of autodiff up to float32 rounding
(tests/test_elementwise.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtx.parallel.ops import cotangent_like

STATISTICS = "norm_statistics"  # checkpoint name of each row's mean and 1 / std (what `matmuls` recomputation keeps)


def _rows(x):
    return tuple(range(x.ndim - 1))


def _kept(*statistics):
    """The forward's statistics as stored values: XLA may not recompute them from x inside the backward's fusions."""
    return jax.lax.optimization_barrier(statistics)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x, scale, bias, epsilon: float, dtype):
    """(..., D) -> (..., D) in `dtype`: (x - mean) / sqrt(var + epsilon) * scale + bias over the last axis."""
    return _layer_norm_fwd(x, scale, bias, epsilon, dtype)[0]


def _layer_norm_fwd(x, scale, bias, epsilon, dtype):
    x32 = x.astype(jnp.float32)
    mean = checkpoint_name(x32.mean(-1, keepdims=True), STATISTICS)
    rstd = checkpoint_name(jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + epsilon), STATISTICS)
    # scale and bias are kept for their types (`cotangent_like`): D numbers each
    return ((x32 - mean) * rstd * scale + bias).astype(dtype), (x, mean, rstd, scale, bias)


def _layer_norm_bwd(epsilon, dtype, residuals, dy):
    x, mean, rstd, scale, bias = residuals
    mean, rstd = _kept(mean, rstd)
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    dy32 = dy.astype(jnp.float32)
    g = dy32 * scale
    dx = rstd * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    grads = dx.astype(x.dtype), (dy32 * x_hat).sum(_rows(x)), dy32.sum(_rows(x))
    return tuple(cotangent_like(grad, primal) for grad, primal in zip(grads, (x, scale, bias)))


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, epsilon: float, dtype):
    """(..., D) -> (..., D) in `dtype`: x / sqrt(mean(x^2) + epsilon) * scale over the last axis."""
    return _rms_norm_fwd(x, scale, epsilon, dtype)[0]


def _rms_norm_fwd(x, scale, epsilon, dtype):
    x32 = x.astype(jnp.float32)
    rstd = checkpoint_name(jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + epsilon), STATISTICS)
    return (x32 * rstd * scale).astype(dtype), (x, rstd, scale)


def _rms_norm_bwd(epsilon, dtype, residuals, dy):
    x, rstd, scale = residuals
    (rstd,) = _kept(rstd)
    x_hat = x.astype(jnp.float32) * rstd
    dy32 = dy.astype(jnp.float32)
    g = dy32 * scale
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdims=True))
    grads = dx.astype(x.dtype), (dy32 * x_hat).sum(_rows(x))
    return tuple(cotangent_like(grad, primal) for grad, primal in zip(grads, (x, scale)))


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)

