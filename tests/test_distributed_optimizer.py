"""--use-distributed-optimizer (ZeRO-1): master weights and Adam's moments split over "data", gradients
reduce-scattered and parameters all-gathered, with the same losses, clipping and checkpoints as the replicated
optimizer."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.presets import load_preset
from mtx.run import train
from mtx.step import TrainStep

from helpers import loss_and_grads

# Tiny GPT, 4 layers, dropout on, clipping that binds (gradient norms ~1-3 here), 2 microbatches a data rank at DP 8.
BASE = Config().replace(**load_preset("configs/tiny.toml")).replace(
    num_layers=4, hidden_dropout=0.1, attention_dropout=0.1, clip_grad=0.5, micro_batch_size=1, global_batch_size=16)


def cfg_for(mesh, **flags):
    dp, pp, tp = mesh
    return BASE.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, **flags)


def test_losses_equal_the_replicated_optimizer_on_every_mesh(tmp_path, shared_initial_state):
    ref = train(cfg_for((8, 1, 1), train_iters=10, run_dir=str(tmp_path / "ref")), progress=False)
    ref_losses = [ref.losses[s] for s in range(1, 11)]
    for mesh, flags in [((8, 1, 1), {}), ((4, 1, 2), {}), ((2, 2, 2), {"virtual_pipeline_model_parallel_size": 2}),
                        ((2, 1, 4), {"sequence_parallel": True, "micro_batch_size": 4})]:
        r = train(cfg_for(mesh, train_iters=10, use_distributed_optimizer=True, run_dir=str(tmp_path / f"{mesh}"),
                          **flags), progress=False)
        np.testing.assert_allclose([r.losses[s] for s in range(1, 11)], ref_losses, rtol=1e-5, err_msg=f"{mesh}")


@pytest.mark.parametrize("distributed", [False, True])
def test_clipping_binds_and_is_exact(distributed):
    """After one step Adam's first moment is (1 - beta1) x the clipped gradient: g x clip / ||g|| when the global
    norm exceeds the clip, with the norm summed over every shard of every parameter."""
    cfg = cfg_for((4, 1, 2), use_distributed_optimizer=distributed, hidden_dropout=0.0,
                  attention_dropout=0.0).validate(8)
    step = TrainStep.build(cfg, make_mesh(4, 1, 2))
    state = step.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (16, cfg.model.seq_length + 1), np.int32)
    batch = step.model.put_batch(tokens)
    _, grads = jax.jit(step.loss_and_grads)(state.params, batch, state.step)
    grads = jax.tree.map(np.asarray, grads)
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree.leaves(grads)))
    clip = cfg.optimizer.clip_grad
    assert norm > 2 * clip  # the clip binds
    state, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    mu = nnx.to_pure_dict(adam[0].mu)
    expected = jax.tree.map(lambda g: (1 - cfg.optimizer.adam_beta1) * g * clip / norm, nnx.to_pure_dict(grads))
    for got, want in zip(jax.tree.leaves(mu), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-9)


def _argument_bytes(dp, distributed):
    cfg = cfg_for((dp, 1, 1), use_distributed_optimizer=distributed, hidden_size=128, vocab_size=1000,
                  global_batch_size=8).validate(8)
    step = TrainStep.build(cfg, make_mesh(dp, 1, 1, devices=jax.devices()[:dp]))
    state = step.abstract_state()
    tokens = jax.ShapeDtypeStruct((8, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
    compiled = jax.jit(step._train_step, donate_argnums=0).lower(state, tokens).compile()
    split = sum(x.size for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(step.model.master_shardings))
                if "data" in s.spec)
    whole = sum(x.size for x in jax.tree.leaves(state.params)) - split
    return compiled.memory_analysis().argument_size_in_bytes, split, whole


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_argument_memory_falls_as_twelve_bytes_over_dp(dp):
    """fp32 master weights and both moments: 12 bytes per parameter replicated, 12 / DP split over "data" (the
    compute-dtype copy the forward uses is gathered into the step's temporaries, not kept between steps)."""
    replicated, _, _ = _argument_bytes(dp, False)
    distributed, split, whole = _argument_bytes(dp, True)
    assert split > 0.99 * (split + whole)  # all but a few vectors split
    assert replicated == pytest.approx(12 * (split + whole), rel=0.1)
    assert distributed == pytest.approx(12 * (split / dp + whole), rel=0.1)


OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)


@pytest.mark.parametrize("mesh, layout, overlap", [
    ((4, 1, 2), {}, {}), ((4, 1, 2), {}, OVERLAP),
    ((2, 2, 2), {}, {}), ((2, 2, 2), dict(virtual_pipeline_model_parallel_size=2), {}),  # 1F1B; interleaved
])
def test_bf16_gradients_equal_the_replicated_optimizer(mesh, layout, overlap):
    """In bf16 the layer stack is gathered into, and differentiated in, the compute dtype (and with interleaving
    moved into its chunk slots so); its gradients, accumulated in fp32 over the microbatches (2 a data rank), are
    those of the replicated optimizer's fp32 copy."""
    base = BASE.replace(bf16=True, hidden_dropout=0.0, attention_dropout=0.0, micro_batch_size=2,
                        global_batch_size=4 * mesh[0])
    loss, grads = loss_and_grads(base, *mesh, **layout)
    got_loss, got = loss_and_grads(base, *mesh, use_distributed_optimizer=True, **layout, **overlap)
    assert got_loss == pytest.approx(loss, rel=1e-6) and got.keys() == grads.keys()
    for name, want in grads.items():
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=name)


def _compiled_bytes(mesh, **flags):
    """bf16, 4 (8 with PP 2) microbatches a data rank -> (the compiled step's argument + temporary bytes per device,
    the parameters a device holds: the layer stack's 1 / PP share and the rest)."""
    cfg = cfg_for(mesh, hidden_size=128, vocab_size=512, bf16=True, global_batch_size=8 * mesh[1], **flags)
    cfg = cfg.validate(8)
    step = TrainStep.build(cfg, make_mesh(*mesh, devices=jax.devices()[:mesh[0] * mesh[1] * mesh[2]]))
    state = step.abstract_state()
    tokens = jax.ShapeDtypeStruct((cfg.training.global_batch_size, cfg.model.seq_length + 1), np.int32,
                                  sharding=step.model.batch_sharding)
    memory = jax.jit(step._train_step, donate_argnums=0).lower(state, tokens).compile().memory_analysis()
    params = nnx.to_pure_dict(state.params)
    stack = sum(p.size for p in jax.tree.leaves(params["layers"]))
    held = sum(p.size for p in jax.tree.leaves(params)) - stack + stack // mesh[1]
    return memory.argument_size_in_bytes + memory.temp_size_in_bytes, held


@pytest.mark.parametrize("mesh, flags", [
    ((2, 1, 1), {}), ((2, 1, 1), OVERLAP),
    ((2, 2, 1), {}), ((2, 2, 1), dict(virtual_pipeline_model_parallel_size=2)),  # 1F1B; interleaved
])
def test_with_accumulation_the_step_saves_what_the_shards_predict(mesh, flags):
    """bf16 at DP 2: the compiled step (state and temporaries) needs at least 0.7 x 6 bytes less per parameter a
    device holds than with the replicated optimizer (half of the fp32 weights and of both moments). Gathered back
    into fp32, the layer stack's copy that the microbatches share took back 4 of those 6 bytes (without pipelining
    and with 1F1B; with interleaving 2.6)."""
    layout = {k: v for k, v in flags.items() if k not in OVERLAP}
    replicated, held = _compiled_bytes(mesh, **layout)
    distributed, _ = _compiled_bytes(mesh, use_distributed_optimizer=True, **flags)
    assert replicated - distributed >= 0.7 * 6 * held, (replicated - distributed) / held


def test_checkpoints_move_between_data_parallel_sizes_and_optimizers(tmp_path):
    """Saved with the distributed optimizer at DP 4, resumed exactly at DP 2 and DP 8 with it and at DP 8 without."""
    base = dict(train_iters=6, save_interval=3, hidden_dropout=0.0, attention_dropout=0.0)
    ckpt = str(tmp_path / "ckpt")
    full = train(cfg_for((4, 1, 2), save=ckpt, use_distributed_optimizer=True, **base), progress=False)
    for mesh, distributed in [((2, 1, 4), True), ((8, 1, 1), True), ((8, 1, 1), False)]:
        resumed = train(cfg_for(mesh, load=ckpt, ckpt_step=3, run_dir=str(tmp_path / f"r{mesh}{distributed}"),
                                use_distributed_optimizer=distributed, **base), progress=False)
        np.testing.assert_allclose([resumed.losses[s] for s in (4, 5, 6)], [full.losses[s] for s in (4, 5, 6)],
                                   rtol=1e-5, err_msg=f"{mesh} distributed={distributed}")
