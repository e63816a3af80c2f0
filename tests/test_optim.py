"""The paper's recipe: warmup + cosine to min_lr, no weight decay on biases/LayerNorm, dynamic loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config, OptimizerConfig, TrainingConfig
from mtx.presets import load_preset
from mtx.optim import LossScale, learning_rate_schedule, weight_decay_mask
from mtx.parallel import make_mesh
from mtx.sharded_model import build_model
from mtx.step import TrainStep

from helpers import LLAMA_BLOCKS


def test_warmup_then_cosine_to_min_lr():
    sched = learning_rate_schedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10), train_iters=110)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(0.5)
    assert float(sched(10)) == pytest.approx(1.0)
    assert float(sched(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # halfway through the cosine
    assert float(sched(110)) == pytest.approx(0.1)
    assert float(sched(500)) == pytest.approx(0.1)  # stays at min_lr after decay


def test_linear_and_constant_decay():
    linear = learning_rate_schedule(OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear"),
                                    train_iters=100)
    assert float(linear(50)) == pytest.approx(0.5)
    constant = learning_rate_schedule(OptimizerConfig(lr=0.3, lr_warmup_iters=0, lr_decay_style="constant"), 100)
    assert float(constant(99)) == pytest.approx(0.3)


@pytest.mark.parametrize("blocks", [{}, dict(model_type="bert"), LLAMA_BLOCKS], ids=["gpt", "bert", "llama"])
def test_weight_decay_on_the_matrices_only(blocks):
    """Decay on the weight matrices and embeddings, none on the vectors (biases, BERT's lm_bias, norms' scales and
    biases; Megatron's rule), read off each parameter's shape in one layer."""
    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(**blocks)
    _, state = nnx.split(nnx.eval_shape(build_model(cfg)))
    mask = nnx.to_pure_dict(weight_decay_mask(state))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    assert len(leaves) == len(jax.tree.leaves(mask)) >= 10
    for (path, leaf), decayed in zip(leaves, jax.tree.leaves(mask)):
        stacked = path[0].key == "layers"  # the layers' parameters have a leading L axis
        assert decayed == (leaf.ndim - stacked >= 2), jax.tree_util.keystr(path)


def test_loss_scale_halves_on_overflow_and_grows_after_a_window():
    train = TrainingConfig(fp16=True, initial_loss_scale=1024.0, loss_scale_window=3, min_loss_scale=256.0)
    ls = LossScale.create(train)
    ls = ls.update(jnp.asarray(False), train)
    assert float(ls.scale) == 512.0 and int(ls.skipped) == 1
    for _ in range(2):
        ls = ls.update(jnp.asarray(True), train)
    assert float(ls.scale) == 512.0
    ls = ls.update(jnp.asarray(True), train)  # third good step in a row
    assert float(ls.scale) == 1024.0 and int(ls.good_steps) == 0
    for _ in range(5):
        ls = ls.update(jnp.asarray(False), train)
    assert float(ls.scale) == 256.0  # floor
    top = TrainingConfig(fp16=True, initial_loss_scale=2.0**32, loss_scale_window=1)
    ls = LossScale.create(top)
    for _ in range(3):  # a good window at the largest scale the flags allow: no growth past it
        ls = ls.update(jnp.asarray(True), top)
    assert float(ls.scale) == 2.0**32


def test_fp16_overflow_skips_the_step():
    """The largest initial scale (2^32, Megatron's default) overflows fp16: the step keeps the weights and halves the
    scale."""
    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
        fp16=True, initial_loss_scale=2.0**32, vocab_size=257, data_parallel_size=2, tensor_model_parallel_size=2)
    train_step = TrainStep.build(cfg.validate(4), make_mesh(2, 1, 2, devices=jax.devices()[:4]))
    state = train_step.init_state()
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    tokens = np.random.default_rng(0).integers(0, 257, (16, 33)).astype(np.int32)
    state, metrics = train_step(state, train_step.model.put_batch(tokens))
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 2.0**31
    for a, b in zip(before, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(state.step) == 1
