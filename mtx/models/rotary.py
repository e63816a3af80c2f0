"""Rotary position embeddings (RoPE, Su et al. 2021; `--position-embedding-type rope`), as Megatron-Core applies them
by default and Hugging Face's Llama does: the first R = int(H x --rotary-percent) dimensions of every query and key
head rotate in pairs (i, i + R / 2) ("rotate half", not interleaved) by the angle position x base^(-2i / R); the
other H - R dimensions pass through. The scores q . k then depend on the two positions only through their
difference.

Applied inside each layer to this rank's heads after the QKV projection: the angles depend on the position alone,
never on the head, so tensor parallelism needs nothing more. Positions are those of whole sequences, which every
rank holds (sequence parallelism splits a microbatch by rows, pipeline stages pass whole sequences).
"""

from __future__ import annotations

import jax.numpy as jnp


def rotary_angles(positions, rotary_dim: int, base: float):
    """Integer positions (..., S) -> angles (..., S, R / 2) in float32: position x base^(-2i / R)."""
    inv_freq_R = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    return positions.astype(jnp.float32)[..., None] * inv_freq_R


def apply_rotary(x_BSNH, positions, *, rotary_dim: int, base: float):
    """(B, S, n, H) heads at positions (S,) or (B, S) -> the same with their first `rotary_dim` dimensions rotated,
    in float32 and cast back."""
    angles = rotary_angles(positions, rotary_dim, base)
    angles_BS1R = (angles if angles.ndim == 3 else angles[None])[:, :, None, :]
    cos, sin = jnp.cos(angles_BS1R), jnp.sin(angles_BS1R)
    x32 = x_BSNH.astype(jnp.float32)
    half = rotary_dim // 2
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x_BSNH.dtype)
