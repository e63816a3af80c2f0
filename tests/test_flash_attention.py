"""mtx's flash-attention kernel (mtx/kernels/flash_attention.py), interpreted on the host: the same function as XLA's
attention with the same dropout masks, forward and backward, and training through it identical on every mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtx.config import Config
from mtx.kernels import flash_attention as flash
from mtx.models.transformer import attention_core
from mtx.parallel.random import attention_dropout_hashes, attention_keep
from mtx.presets import load_preset
from mtx.run import train

B, S, N, H = 2, 64, 2, 24  # H pads to 32 inside the kernel
BLOCKS = flash.Blocks(q=32, k=16, big=32, small=16)


@pytest.mark.parametrize("causal,padded,rate", [(True, False, 0.0), (True, False, 0.3), (False, True, 0.0),
                                                (False, True, 0.3), (False, False, 0.3)])
def test_kernel_is_xla_attention_forward_and_backward(causal, padded, rate):
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, dy = (jax.random.normal(key, (B, S, N, H)) for key in keys[:4])
    hashes = attention_dropout_hashes(jax.random.split(keys[4], B * N).reshape(B, N), S)
    mask_BS = (jnp.arange(S)[None, :] < jnp.array([[37], [S]])).astype(jnp.int32) if padded else None

    def kernel(q, k, v):
        return flash.flash_attention(q, k, v, causal=causal, dropout_rate=rate, hashes=hashes, blocks=BLOCKS,
                                     key_valid_BS=None if mask_BS is None else mask_BS > 0, interpret=True)

    def xla(q, k, v):
        return attention_core(q, k, v, mask_BS=mask_BS, causal=causal, dropout_rate=rate,
                              hashes=hashes if rate else None)

    (out, grads), (ref, ref_grads) = ((f(q, k, v), jax.vjp(f, q, k, v)[1](dy)) for f in (kernel, xla))
    np.testing.assert_allclose(out, ref, atol=2e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-6)
    if rate:  # dropout is really on: the output differs from attention without it
        assert float(jnp.max(jnp.abs(out - xla_no_dropout(q, k, v, mask_BS, causal)))) > 0.1


def xla_no_dropout(q, k, v, mask_BS, causal):
    return attention_core(q, k, v, mask_BS=mask_BS, causal=causal)


def test_dropout_masks_keep_the_rate_and_differ_by_head_and_position():
    rows, cols = attention_dropout_hashes(jax.random.split(jax.random.key(1), 8).reshape(2, 4), 512)
    keep = np.asarray(attention_keep(rows[..., :, None], cols[..., None, :], 0.1))  # (2, 4, 512, 512)
    assert abs(keep.mean() - 0.9) < 0.002
    per_row = keep.mean(axis=-1)
    assert per_row.min() > 0.82 and per_row.max() < 0.97  # no row (or head) is special
    drop = ~keep
    neighbours = (drop[..., :, 1:] & drop[..., :, :-1]).mean(), (drop[..., 1:, :] & drop[..., :-1, :]).mean()
    np.testing.assert_allclose(neighbours, 0.01, atol=0.0015)  # independent along rows and columns: 0.1 x 0.1
    assert (drop[0, 0] != drop[0, 1]).mean() > 0.15 and (drop[0, 0] != drop[1, 0]).mean() > 0.15
    # The mix of rows[q] + cols[k] hides the sum's structure: 2 x 2 squares drop as independent elements do.
    square = drop[..., :-1, :-1], drop[..., 1:, :-1], drop[..., :-1, 1:], drop[..., 1:, 1:]
    np.testing.assert_allclose((square[0] & square[1] & square[2] & square[3]).mean(), 1e-4, atol=4e-5)
    odd = (square[0] ^ square[1] ^ square[2] ^ square[3]).mean()
    np.testing.assert_allclose(odd, (1 - 0.8**4) / 2, atol=0.002)
    assert np.asarray(attention_keep(rows[..., :, None], cols[..., None, :], 0.0)).all()


def test_kernel_is_used_only_where_it_runs():
    q = jnp.zeros((2, 64, 2, 32), jnp.bfloat16)
    assert not flash.usable(q, q, None, causal=True)  # the host: XLA's attention, with the same masks
    assert flash.supported(jnp.zeros((2, 32, 2, 8)), jnp.zeros((2, 32, 2, 8)))  # tiles of 32; heads padded to 16
    assert not flash.supported(jnp.zeros((2, 8, 2, 32)), jnp.zeros((2, 8, 2, 32)))  # tiles under 16
    assert not flash.supported(jnp.zeros((2, 48, 2, 32)), jnp.zeros((2, 48, 2, 32)))  # 48: no power-of-2 tile
    assert not flash.supported(jnp.zeros((2, 96, 2, 32)), jnp.zeros((2, 96, 2, 32)))  # 64 does not divide 96


def test_fused_attention_with_dropout_trains_like_xla_attention_on_every_mesh(tmp_path):
    """On the host --use-flash-attn with attention dropout takes XLA's attention with the kernel's masks (the kernel
    cannot run interpreted inside shard_map: jax's interpreter breaks its varying-axes checks); the kernel is that
    function (the tests above), and benchmarks/gpu_checks.py checks it inside the model on a GPU."""
    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
        train_iters=3, hidden_dropout=0.1, attention_dropout=0.2)
    runs = [train(cfg.replace(run_dir=str(tmp_path / f"{dp}x{tp}{flash_on}"), data_parallel_size=dp,
                              tensor_model_parallel_size=tp, use_flash_attn=flash_on), progress=False)
            for dp, tp, flash_on in [(1, 1, False), (1, 1, True), (2, 4, True)]]
    for run in runs[1:]:
        np.testing.assert_allclose([run.losses[s] for s in range(1, 4)], [runs[0].losses[s] for s in range(1, 4)],
                                   rtol=1e-5)


@pytest.mark.parametrize("dp,pp,tp,sp", [(2, 1, 4, False), (1, 2, 2, True)])
def test_the_kernel_is_typed_for_the_sharded_step_on_every_axis(monkeypatch, dp, pp, tp, sp):
    """The training step through the kernel traces on meshes with data, pipeline and model axes (and sequence
    parallelism): the kernel's outputs and gradients carry the varying axes that shard_map checks. A trace, not a
    run: jax's interpreter cannot lower the kernel inside shard_map (above)."""
    from mtx.parallel import make_mesh
    from mtx.sharded_model import ShardedModel
    from mtx.step import TrainStep

    monkeypatch.setattr(flash, "INTERPRET", True)
    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
        hidden_dropout=0.1, attention_dropout=0.1, use_flash_attn=True, data_parallel_size=dp,
        pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, sequence_parallel=sp).validate(8)
    model = ShardedModel(cfg, make_mesh(dp, pp, tp))
    step = TrainStep(model)
    tokens = model.put_batch(np.zeros((cfg.training.global_batch_size, cfg.model.seq_length + 1), np.int32))
    program = str(step._step.trace(step.abstract_state(), tokens).jaxpr)
    assert "mtx_flash_forward" in program and "mtx_flash_backward" in program
