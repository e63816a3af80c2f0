"""The paper's recipe: warmup + cosine to min_lr, no weight decay on biases/LayerNorm, dynamic loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config, OptimizerConfig, TrainingConfig
from mtx.optim import LossScale, learning_rate_schedule, make_optimizer, weight_decay_mask, weight_decay_schedule
from mtx.parallel import make_mesh
from mtx.presets import load_preset
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


def test_warmup_from_lr_warmup_init():
    sched = learning_rate_schedule(OptimizerConfig(lr=1.0, lr_warmup_iters=10, lr_warmup_init=0.2), train_iters=100)
    assert [float(sched(s)) for s in (0, 5, 10)] == pytest.approx([0.2, 0.6, 1.0])


@pytest.mark.parametrize("style,middle", [("linear", 0.5), ("cosine", 0.5), ("constant", None)])
def test_weight_decay_rises_over_train_iters(style, middle):
    """Megatron's increment: from --start-weight-decay at step 0 to --end-weight-decay at --train-iters, then flat;
    cosine along 0.5 (cos(pi (1 - t)) + 1), a quarter of the way at t = 1/3; constant is --weight-decay."""
    ends = {} if style == "constant" else dict(start_weight_decay=0.0, end_weight_decay=0.1)
    sched = weight_decay_schedule(OptimizerConfig(weight_decay=0.03, weight_decay_incr_style=style, **ends), 90)
    values = [float(sched(s)) for s in (0, 30, 45, 90, 200)]
    if style == "constant":
        assert values == pytest.approx([0.03] * 5)
    else:
        third = 1 / 3 if style == "linear" else 0.25
        assert values == pytest.approx([0.0, 0.1 * third, 0.1 * middle, 0.1, 0.1], abs=1e-7)


def test_the_update_decays_by_the_steps_weight_decay_with_adamws_state():
    """With zero gradients Adam's step is 0, so an update is -lr x decay(count) x weight, on matrices only; the
    optimizer state is optax.adamw's (checkpoints load whatever the schedules)."""
    import optax

    opt = OptimizerConfig(lr=0.5, lr_warmup_iters=0, lr_decay_style="constant", weight_decay_incr_style="linear",
                          start_weight_decay=0.0, end_weight_decay=0.2, clip_grad=1.0)
    params = {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((3,))}
    tx = make_optimizer(opt, train_iters=10)
    state = tx.init(params)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate_schedule(opt, 10),
                                                                         mask=weight_decay_mask)).init(params)
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for count, decay in ((0, 0.0), (5, 0.1), (10, 0.2)):
        updates, _ = tx.update(zeros, state, params, count=count)
        np.testing.assert_allclose(updates["kernel"], -0.5 * decay * np.ones((2, 3)), atol=1e-7)
        np.testing.assert_array_equal(updates["bias"], np.zeros(3))


@pytest.mark.parametrize("flags,match", [
    (dict(start_weight_decay=0.0), "--start-weight-decay sets an end of a rising weight decay; pass "
                                   "--weight-decay-incr-style linear or cosine with both ends, or "
                                   "--start-weight-decay none"),
    (dict(weight_decay_incr_style="cosine", end_weight_decay=0.1), "rises from --start-weight-decay to "
                                                                   "--end-weight-decay; pass both"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.2, end_weight_decay=0.1),
     "--end-weight-decay 0.1 is below --start-weight-decay 0.2; the weight decay rises"),
    (dict(lr=1e-3, lr_warmup_init=2e-3), "--lr-warmup-init 0.002 is above --lr 0.001"),
])
def test_weight_decay_schedule_refusals(flags, match):
    from helpers import refused_in_one_line

    refused_in_one_line(match, Config().replace(**flags).validate)


@pytest.mark.parametrize("argv,match", [
    ("--lr-warmup-iters 0 --lr-warmup-init 1e-4", "--lr-warmup-init only acts with a warmup"),
    ("--weight-decay 0.1 --weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1",
     "--weight-decay only acts with --weight-decay-incr-style constant; leave it out"),
])
def test_idle_schedule_flags_are_refused(argv, match):
    from mtx.cli import parse_config

    with pytest.raises(ValueError, match=match):
        parse_config(argv.split())


def test_a_resume_keeps_a_rising_weight_decays_length():
    """--use-checkpoint-opt-param-scheduler keeps the checkpoint's rise (its --train-iters) when this run trains
    longer; without it, the refusal names --weight-decay-incr-iters to keep it."""
    from mtx.resume import check_same_schedule

    rising = dict(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1, lr_decay_iters=50,
                  load="ckpt")
    saved, longer = Config().replace(train_iters=100, **rising), Config().replace(train_iters=200, **rising)
    with pytest.raises(ValueError, match="a weight decay rising over 100 steps .* and this run has 200, so its weight "
                                         "decay would jump where it resumes; pass --weight-decay-incr-iters 100 to "
                                         "keep its rise, --override"):
        check_same_schedule(saved, longer)
    kept = check_same_schedule(saved, longer.replace(use_checkpoint_opt_param_scheduler=True))
    assert kept.optimizer.weight_decay_incr_iters == 100 and kept.training.train_iters == 200
    assert float(weight_decay_schedule(kept.optimizer, 200)(100)) == pytest.approx(0.1)
    assert check_same_schedule(saved, longer.replace(weight_decay_incr_iters=100)) is not None


def test_the_warmups_first_lr_is_compared_only_during_the_warmup():
    from mtx.resume import check_same_schedule

    saved = Config().replace(lr_warmup_iters=10, lr_warmup_init=1e-4, load="ckpt")
    with pytest.raises(ValueError, match="--lr-warmup-init 0.0001 and this run has 0.0, so its learning rate"):
        check_same_schedule(saved, saved.replace(lr_warmup_init=0.0), step=5)
    assert check_same_schedule(saved, saved.replace(lr_warmup_init=0.0), step=10) is not None  # warmed up


def test_a_saved_config_with_a_bad_schedule_is_a_broken_step():
    """--use-checkpoint-opt-param-scheduler takes the schedule from the checkpoint's config: its values are checked
    as the model's are (an edited file ran to NaN weights, or to a traceback)."""
    from mtx.checkpoint import config_problem

    good = Config().to_dict()
    assert config_problem(good) is None
    for section, values, said in (("optimizer", dict(end_weight_decay="x"), "a value mtx refuses"),
                                  ("optimizer", dict(lr_warmup_init=9e300), "a value mtx refuses"),
                                  ("optimizer", dict(weight_decay_incr_style="bogus"), "a value mtx refuses"),
                                  ("optimizer", dict(lr_warmup_init=2.0, lr=1.0), "values mtx refuses together"),
                                  ("training", dict(train_iters=-5), "a value mtx refuses")):
        bad = {k: dict(v) for k, v in good.items()}
        bad[section].update(values)
        assert said in config_problem(bad), values


def test_schedules_give_the_same_losses_on_every_mesh(tmp_path):
    """A warmup from --lr-warmup-init and a rising weight decay, with the replicated optimizer on one device and the
    distributed one on (4, 1, 2): the same losses."""
    from mtx.run import train

    cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
        hidden_dropout=0.0, attention_dropout=0.0, train_iters=4, lr=1e-2, lr_warmup_iters=2, lr_warmup_init=1e-3,
        weight_decay_incr_style="cosine", start_weight_decay=0.5, end_weight_decay=2.0)
    losses = []
    for dp, tp, flags in ((1, 1, {}), (4, 2, dict(use_distributed_optimizer=True))):
        r = train(cfg.replace(data_parallel_size=dp, tensor_model_parallel_size=tp, run_dir=str(tmp_path / str(dp)),
                              **flags), progress=False)
        losses.append([r.losses[s] for s in range(1, 5)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    plain = train(cfg.replace(data_parallel_size=1, tensor_model_parallel_size=1, weight_decay_incr_style="constant",
                              start_weight_decay=None, end_weight_decay=None, run_dir=str(tmp_path / "plain")),
                  progress=False)
    assert plain.losses[4] != pytest.approx(losses[0][3], rel=1e-6)  # the schedule acted


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
        fp16=True, initial_loss_scale=2.0**32, vocab_size=257, data_parallel_size=2, tensor_model_parallel_size=2,
        log_num_zeros_in_grad=True)
    train_step = TrainStep.build(cfg.validate(4), make_mesh(2, 1, 2, devices=jax.devices()[:4]))
    state = train_step.init_state()
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    tokens = np.random.default_rng(0).integers(0, 257, (16, 33)).astype(np.int32)
    state, metrics = train_step(state, train_step.model.put_batch(tokens))
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 2.0**31
    for a, b in zip(before, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert int(state.step) == 1
    assert np.isnan(float(metrics["num_zeros"]))  # a skipped step's gradients are not counted (Megatron's None)
    # the lr's count (optax's, in the state) and the weight decay's (passed in: step - skipped) stay one count
    counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
              if jax.tree_util.keystr(path).endswith(".count")]
    assert counts and all(int(c) == int(state.step - state.loss_scale.skipped) == 0 for c in counts)
    state, metrics = train_step(state, train_step.model.put_batch(tokens))  # 2^31 overflows as well; then ...
    while bool(metrics["skipped"]):
        state, metrics = train_step(state, train_step.model.put_batch(tokens))
    counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
              if jax.tree_util.keystr(path).endswith(".count")]
    assert all(int(c) == int(state.step - state.loss_scale.skipped) == 1 for c in counts)
