"""Model-parallel dropout RNG (paper appendix B.2): replicated activations get one mask on every model rank, each
rank's heads get their own, and the masks do not depend on the mesh."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.parallel.random import dropout, model_parallel_keys, sample_keys
from mtx.presets import load_preset
from mtx.run import train

B, S, D, N = 4, 8, 16, 8


def masks_per_rank(tp, model_parallel):
    """The dropout mask each model rank draws, stacked over ranks: (tp, ...)."""
    mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])

    def local(key):
        keys_B = sample_keys(key, 0, B)
        if model_parallel:  # this rank's N / tp heads
            x = jnp.ones((B, N // tp, S, S))
            return dropout(x, 0.5, model_parallel_keys(keys_B, N // tp))[None]
        return jax.lax.pcast(dropout(jnp.ones((B, S, D)), 0.5, keys_B), "model", to="varying")[None]

    return np.asarray(jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P("model")))(
        jax.random.key(0)))


def test_replicated_region_draws_the_same_mask_on_every_model_rank():
    masks = masks_per_rank(4, model_parallel=False)
    assert 0.3 < (masks == 0).mean() < 0.7
    for rank in range(1, 4):
        np.testing.assert_array_equal(masks[rank], masks[0])


def test_model_parallel_region_draws_a_different_mask_per_rank():
    masks = masks_per_rank(4, model_parallel=True)
    for rank in range(1, 4):
        assert (masks[rank] != masks[0]).mean() > 0.3


def test_head_masks_do_not_depend_on_tp():
    """Rank r of TP=4 holds heads 2r, 2r+1: their masks equal those of the same heads under TP=1."""
    one = masks_per_rank(1, model_parallel=True)[0]  # (B, N, S, S)
    four = masks_per_rank(4, model_parallel=True)  # (4, B, N/4, S, S)
    np.testing.assert_array_equal(np.concatenate(list(four), axis=1), one)


def test_dropout_training_is_mesh_invariant(tmp_path):
    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(train_iters=4, hidden_dropout=0.1,
                                                                        attention_dropout=0.1)
    curves = [
        [r.losses[s] for s in range(1, 5)]
        for r in (train(cfg.replace(run_dir=str(tmp_path / f"{dp}x{tp}"), data_parallel_size=dp,
                                    tensor_model_parallel_size=tp), progress=False)
                  for dp, tp in [(1, 1), (2, 4)])
    ]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-5)
    no_dropout = train(cfg.replace(run_dir=str(tmp_path / "off"), hidden_dropout=0.0, attention_dropout=0.0),
                       progress=False)
    assert abs(no_dropout.losses[4] - curves[0][3]) > 1e-4  # dropout is really on


def _stack():
    from mtx.models.stack import ParallelTransformer

    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
        hidden_dropout=0.1, attention_dropout=0.1, data_parallel_size=1, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1).validate(1)
    return cfg, ParallelTransformer(cfg.model)


def test_a_layers_draws_depend_on_its_global_index_not_on_which_layers_are_drawn_with_it():
    """The stack draws its layers' dropout all at once; layer l's draws are the same whether it is drawn with the
    whole stack or as the first of a pipeline stage's layers, and the same as drawing it alone (`dropout_draws`
    from its key folded with l + 1)."""
    from mtx.models.transformer import dropout_draws
    from mtx.parallel.random import fold

    cfg, stack = _stack()
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    keys_B = sample_keys(jax.random.key(3), 0, B)

    def draws(count, first):
        return jax.jit(jax.shard_map(lambda k: stack.draws(k, count, first, S), mesh=mesh, in_specs=P(),
                                     out_specs=P(), check_vma=False))(keys_B)

    whole, stage = draws(6, 0), draws(3, jnp.int32(2))
    alone = jax.jit(jax.shard_map(lambda k: dropout_draws(cfg.model, fold(k, 5), S), mesh=mesh, in_specs=P(),
                                  out_specs=P(), check_vma=False))(keys_B)
    leaves = jax.tree.leaves
    assert len(leaves(whole)) == 6  # rows and columns of the attention's and the two residual branches' masks
    for w, st, a in zip(leaves(whole), leaves(stage), leaves(alone)):
        np.testing.assert_array_equal(np.asarray(w)[2:5], np.asarray(st))
        np.testing.assert_array_equal(np.asarray(w)[4], np.asarray(a))
    assert not np.array_equal(np.asarray(leaves(whole)[2])[0], np.asarray(leaves(whole)[2])[1])


def test_dropout_does_not_grow_the_compiled_step_per_layer():
    """The paper's dropout adds under 1,000 instructions a layer to the compiled training step: the masks' hashing is
    drawn once for the stack, not fused into every layer's uses (that added ~2,300 a layer at 24 layers,
    docs/benchmarks.md 8f; now ~550 at 8 layers). Counted per layer, not as a ratio to the step without dropout,
    whose size other changes move (LayerNorm's written-out backward took 2,200 instructions off it)."""
    from mtx.step import TrainStep

    def instructions(rate):
        cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
            num_layers=8, hidden_dropout=rate, attention_dropout=rate, recompute_granularity="matmuls",
            scan_layers=False, micro_batch_size=2, global_batch_size=2, data_parallel_size=1,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1).validate(1)
        step = TrainStep.build(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        tokens = jax.ShapeDtypeStruct((2, cfg.model.seq_length + 1), np.int32, sharding=step.model.batch_sharding)
        text = jax.jit(step._train_step).lower(step.abstract_state(), tokens).compile().as_text()
        return sum(" = " in line for line in text.splitlines())

    off, on = instructions(0.0), instructions(0.1)
    assert on - off < 1000 * 8, (on, off)
