"""Rotary position embeddings (RoPE, Su et al. 2021; `--position-embedding-type rope`), as Megatron-Core applies them
by default and Hugging Face's Llama does: the first R = int(H x --rotary-percent) dimensions of every query and key
head rotate in pairs (i, i + R / 2) ("rotate half", not interleaved) by the angle position x base^(-2i / R); the
other H - R dimensions pass through. The scores q . k then depend on the two positions only through their
difference.

Llama 3.1 and 3.2 scale the frequencies for long contexts (`--use-rope-scaling`, HF's rope_type "llama3", the same
formula as Megatron-Core's `_apply_scaling`): of the original context C (`--rope-scaling-original-max-position-
embeddings`), wavelengths 2 pi / f longer than C / low_freq_factor are stretched by `--rope-scaling-factor`, those
shorter than C / high_freq_factor kept, and those between interpolated smoothly, so local order stays sharp while
distant positions fold into the range the model was first trained on.

Applied inside each layer to this rank's heads after the QKV projection: the angles depend on the position alone,
never on the head, so tensor parallelism needs nothing more. Positions are those of whole sequences, which every
rank holds (sequence parallelism splits a microbatch by rows, pipeline stages pass whole sequences).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def inverse_frequencies(rotary_dim: int, base: float, scaling: tuple[float, float, float, int] | None = None):
    """(R / 2,) float32 frequencies base^(-2i / R), with `scaling` = (factor, low_freq_factor, high_freq_factor,
    original max positions) Llama 3's scaled ones (computed in float32, as HF and Megatron-Core do)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)  # 0 at C / low (all scaled) to 1 at C / high (unchanged)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelength < original / high, inv_freq, jnp.where(wavelength > original / low,
                                                                       inv_freq / factor, scaled))


def rotary_angles(positions, rotary_dim: int, base: float, scaling=None):
    """Integer positions (..., S) -> angles (..., S, R / 2) in float32: position x frequency."""
    return positions.astype(jnp.float32)[..., None] * inverse_frequencies(rotary_dim, base, scaling)


def apply_rotary(x_BSNH, positions, *, rotary_dim: int, base: float, scaling=None):
    """(B, S, n, H) heads at positions (S,) or (B, S) -> the same with their first `rotary_dim` dimensions rotated,
    in float32 and cast back; `scaling` as in `inverse_frequencies`."""
    angles = rotary_angles(positions, rotary_dim, base, scaling)
    angles_BS1R = (angles if angles.ndim == 3 else angles[None])[:, :, None, :]
    cos, sin = jnp.cos(angles_BS1R), jnp.sin(angles_BS1R)
    x32 = x_BSNH.astype(jnp.float32)
    half = rotary_dim // 2
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x_BSNH.dtype)
