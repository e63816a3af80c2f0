"""Vocab-parallel cross-entropy (paper section 3): the loss from logits split over "model", never gathered.

Each rank holds logits for V / tp vocabulary entries. Instead of all-gathering B*S*V logits, the ranks reduce three
B*S scalars: the max (for stability), the sum of exponentials, and the target's logit (nonzero on one rank only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtx.parallel.mesh import MODEL, PIPELINE
from mtx.parallel.ops import model_rank


def vocab_parallel_cross_entropy(logits_BSV, targets_BS, *, label_smoothing: float = 0.0,
                                 vocab_size: int | None = None, pipeline_share: bool = False):
    """Per-token loss (B, S), replicated over "model", from this rank's logits slice (B, S, V / tp).

    loss = log sum_v exp(z_v - m) - (z_t - m), with m = max_v z_v taken over all ranks. The gradient is
    softmax - onehot on each rank's slice with no further communication: the transpose of each psum under
    check_vma is a cast, not a second all-reduce. With `vocab_size`, the padding columns (global ids >= vocab_size)
    are no tokens and take no probability (a converted GPT-2 has zero rows there, i.e. logits of 0 that would
    otherwise outweigh real tokens' negative logits).

    With `pipeline_share` the slice is this pipeline stage's 1 / P of the model rank's (`pipeline_vocab_share`, the
    1F1B head spread over the stages), and the three reductions run over "model" and "pipeline" together.
    """
    z = logits_BSV.astype(jnp.float32)
    v_local = z.shape[-1]
    axes = (MODEL, PIPELINE) if pipeline_share else MODEL
    if pipeline_share:  # slice (model rank, stage) of the vocabulary, model-rank-major
        first = (model_rank() * jax.lax.axis_size(PIPELINE) + jax.lax.axis_index(PIPELINE)) * v_local
    else:
        first = model_rank() * v_local
    if vocab_size is not None:
        real_V = first + jnp.arange(v_local) < vocab_size
        z = jnp.where(real_V, z, -jnp.inf)
    # The shift cancels in the loss, so it carries no gradient (pmax has none to give).
    m_BS = jax.lax.pmax(jax.lax.stop_gradient(z.max(-1)), axes)
    z = z - m_BS[..., None]
    sum_exp_BS = jax.lax.psum(jnp.exp(z).sum(-1), axes)
    local_t = targets_BS - first
    in_range = (local_t >= 0) & (local_t < v_local)
    z_t = jnp.take_along_axis(z, jnp.where(in_range, local_t, 0)[..., None], axis=-1)[..., 0]
    target_BS = jax.lax.psum(jnp.where(in_range, z_t, 0.0), axes)
    log_z_BS = jnp.log(sum_exp_BS)
    loss_BS = log_z_BS - target_BS
    if label_smoothing:
        # Smoothed target: (1 - eps) on the label, eps spread uniformly over the V real entries.
        shares = jax.lax.axis_size(MODEL) * (jax.lax.axis_size(PIPELINE) if pipeline_share else 1)
        vocab = vocab_size or v_local * shares
        z_real = z if vocab_size is None else jnp.where(real_V, z, 0.0)
        mean_z_BS = jax.lax.psum(z_real.sum(-1), axes) / vocab
        loss_BS = (1.0 - label_smoothing) * loss_BS + label_smoothing * (log_z_BS - mean_z_BS)
    return loss_BS
