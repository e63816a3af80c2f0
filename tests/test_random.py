"""Model-parallel dropout RNG (paper appendix B.2): replicated activations get one mask on every model rank, each
rank's heads get their own, and the masks do not depend on the mesh."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtx.config import Config, load_preset
from mtx.parallel import make_mesh
from mtx.parallel.random import dropout, model_parallel_keys, sample_keys
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
