"""LayerNorm, RMSNorm and the MLP's activations (bias + GeLU, SwiGLU) with their backward written out, so XLA fuses
each pass into few reads of bf16 activations.

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

The MLP's activations (`bias_gelu`, `swiglu`; Megatron's bias-GeLU and bias-SwiGLU fusions, `--bias-gelu-fusion`,
`--bias-swiglu-fusion`, off by default): the backward keeps only the matmuls' outputs (and the bias), which it reads
anyway, and recomputes the rest from them. Autodiff's forward also writes the GeLU's tanh for the backward: one more
(tokens, F) activation written, kept and read a layer (7.5 GiB of the 1.2B model's step at micro batch 16). The
arithmetic is jax.nn.gelu's and jax.nn.silu's, in the activations' dtype (the tanh in float32). The backward reads its
inputs through the barrier too: without it XLA merges its recomputation with the forward's and stores the shared tanh
after all. Measured on an H200 (docs/benchmarks.md 13) the GeLU's recomputation costs more than the memory traffic it
saves (1.2B: 7.5 GiB less, ~1% slower): an option for runs short of memory. SwiGLU's changed neither the peak memory
nor the speed measurably (the Llama 1B preset).
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


_GELU_C = 0.7978845608028654  # sqrt(2 / pi), GPT-2's tanh approximation of GeLU
_GELU_A = 0.044715


def gelu_terms(u):
    """u -> (GeLU(u), its derivative), tanh-approximated as GPT-2 and Megatron's bias-GeLU compute it, in u's dtype
    (the tanh in float32, as XLA computes a bf16 tanh)."""
    t = jnp.tanh((_GELU_C * (u + _GELU_A * u * u * u)).astype(jnp.float32)).astype(u.dtype)
    return 0.5 * u * (1 + t), 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_A * u * u)


@jax.custom_vjp
def bias_gelu(h, bias=None):
    """GeLU(h + bias) (tanh approximation) in h's dtype; h (..., F) is a matmul's output, bias (F,) or None."""
    return _bias_gelu_fwd(h, bias)[0]


def _biased(h, bias):
    return h if bias is None else h + bias.astype(h.dtype)


def _bias_gelu_fwd(h, bias):
    return gelu_terms(_biased(h, bias))[0], (h, bias)


def _bias_gelu_bwd(residuals, dy):
    h, bias = _kept(*residuals)  # else XLA merges this tanh with the forward's and keeps it, in memory, after all
    dh = dy * gelu_terms(_biased(h, bias))[1]
    if bias is None:
        return dh, None
    return dh, cotangent_like(dh.astype(jnp.float32).sum(_rows(h)).astype(bias.dtype), bias)


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


@jax.custom_vjp
def swiglu(gate, up):
    """silu(gate) * up in gate's dtype (SwiGLU's product of two matmuls' outputs), as jax.nn.silu computes it."""
    return _swiglu_fwd(gate, up)[0]


def _swiglu_fwd(gate, up):
    return gate * jax.nn.sigmoid(gate) * up, (gate, up)


def _swiglu_bwd(residuals, dy):
    gate, up = _kept(*residuals)
    sig = jax.nn.sigmoid(gate)
    return dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
