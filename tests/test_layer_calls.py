"""--layer-calls: the training step as one compiled call per layer (mtx/layer_calls.py) gives the fused step's loss and
gradients on every mesh, with dropout, sequence parallelism, recomputation and accumulation; it trains and resumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtx.audit import _NO_COMBINER
from mtx.cli import parse_config
from mtx.config import Config
from mtx.layer_calls import _part
from mtx.parallel.mesh import make_mesh
from mtx.presets import load_preset
from mtx.pullback import Pruned
from mtx.run import train
from mtx.state import state_shardings
from mtx.step import TrainStep
from helpers import LLAMA_BLOCKS, refused_in_one_line

TINY = Config().replace(**load_preset("configs/tiny.toml"))


def _both(cfg, dp, tp, **flags):
    """One step's (loss, grads by path) of the fused step and of --layer-calls on a (dp, 1, tp) mesh, same params."""
    results = []
    for calls in (False, True):
        c = cfg.replace(data_parallel_size=dp, tensor_model_parallel_size=tp, layer_calls=calls, **flags).validate(8)
        train_step = TrainStep.build(c, make_mesh(dp, 1, tp, devices=jax.devices()[: dp * tp]))
        params = jax.device_put(_params(train_step), state_shardings(train_step.model).params)
        tokens = np.random.default_rng(0).integers(0, c.model.vocab_size, (c.training.global_batch_size,
                                                                           c.model.seq_length + 1), np.int32)
        batch, step = train_step.model.put_batch(tokens), jax.numpy.int32(3)
        if calls:
            loss, grads = train_step._calls.loss_and_grads(params, batch, step)
        else:
            loss, grads = jax.jit(train_step.loss_and_grads)(params, batch, step)
        results.append((float(loss), {jax.tree_util.keystr(p): np.asarray(g)
                                      for p, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))}))
    return results


_PARAMS = {}


def _params(train_step):
    key = str(jax.tree.structure(train_step.abstract_state().params))
    if key not in _PARAMS:
        _PARAMS[key] = jax.device_get(train_step.init_state().params)
    return _PARAMS[key]


@pytest.mark.parametrize("dp, tp, flags", [
    (1, 1, {}),
    (2, 2, dict(hidden_dropout=0.1, attention_dropout=0.1)),  # dropout, accumulation over 4 microbatches
    (2, 4, dict(sequence_parallel=True, recompute_granularity="full", micro_batch_size=4)),
    (2, 2, dict(sequence_parallel=True, recompute_granularity="matmuls", micro_batch_size=4, hidden_dropout=0.1)),
    # Llama's blocks, key/value groups replicated (2 groups, TP 4), selective recomputation, label smoothing
    (2, 4, dict(LLAMA_BLOCKS, num_query_groups=2, sequence_parallel=True, recompute_granularity="selective",
                micro_batch_size=4, label_smoothing=0.1, hidden_dropout=0.1, attention_dropout=0.1)),
])
def test_the_fused_steps_loss_and_gradients(dp, tp, flags):
    (loss, grads), (calls_loss, calls_grads) = _both(TINY, dp, tp, **flags)
    np.testing.assert_allclose(calls_loss, loss, rtol=1e-6)
    assert calls_grads.keys() == grads.keys()
    for path, g in grads.items():
        np.testing.assert_allclose(calls_grads[path], g, rtol=1e-5, atol=1e-7, err_msg=path)


def _train(tmp_path, name, cfg, mesh, **flags):
    dp, _, tp = mesh
    where = {} if "save" in flags or "load" in flags and "run_dir" in flags else {"run_dir": str(tmp_path / name)}
    return train(cfg.replace(data_parallel_size=dp, tensor_model_parallel_size=tp, **where, **flags), progress=False)


def test_training_and_a_checkpoint_moved_to_the_fused_step_on_another_mesh(tmp_path):
    """Dropout on, 4 microbatches a step: --layer-calls on (2, 1, 2) trains as the fused step on one device, and its
    step-2 checkpoint, resumed by the fused step on (1, 1, 4), continues as the uninterrupted run."""
    base = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, train_iters=4, lr_decay_iters=4, log_interval=1,
                        global_batch_size=8)
    calls = _train(tmp_path, "calls", base, (2, 1, 2), layer_calls=True, save=str(tmp_path / "ckpt"), save_interval=2)
    fused = _train(tmp_path, "fused", base, (1, 1, 1))
    steps = (1, 2, 3, 4)
    np.testing.assert_allclose([calls.losses[s] for s in steps], [fused.losses[s] for s in steps], rtol=1e-5)
    resumed = _train(tmp_path, "resumed", base, (1, 1, 4), load=str(tmp_path / "ckpt"), ckpt_step=2,
                     run_dir=str(tmp_path / "resumed"))
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [calls.losses[s] for s in (3, 4)], rtol=1e-5)


def test_bert_trains_as_the_fused_step(bert_toy, tmp_path):
    vocab, corpus = bert_toy
    cfg = Config().replace(**load_preset("configs/bert_tiny.toml")).replace(
        seq_length=32, vocab_file=str(vocab), data_path=(str(corpus),), eval_interval=0, lr_warmup_iters=2,
        train_iters=3, log_interval=1, global_batch_size=8)
    fused, calls = (_train(tmp_path, f"bert{c}", cfg, (2, 1, 2), layer_calls=c) for c in (False, True))
    np.testing.assert_allclose([calls.losses[s] for s in (1, 2, 3)], [fused.losses[s] for s in (1, 2, 3)], rtol=1e-5)


def test_collectives_the_papers_per_layer_and_one_data_reduction_a_step():
    """Audit, (2, 1, 2) mesh, 2 microbatches: each layer's forward call has the two `g` all-reduces over "model" of
    b*s*h elements and its backward call the two `f`; nothing moves over "data" but the gradients' one reduction
    (every parameter's elements once), in the last call; the head's over "model" move b*s scalars, never logits,
    and b*s*h for the output layer's `f`."""
    cfg = TINY.replace(data_parallel_size=2, tensor_model_parallel_size=2, layer_calls=True, global_batch_size=8,
                       hidden_dropout=0.0, attention_dropout=0.0).validate(8)
    train_step = TrainStep.build(cfg, make_mesh(2, 1, 2, devices=jax.devices()[:4]))
    state = train_step.init_state()
    tokens = np.zeros((8, cfg.model.seq_length + 1), np.int32)
    local_sizes = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(state.params))
    train_step(state, train_step.model.put_batch(tokens))  # the state is donated
    found = train_step._calls.collectives(_NO_COMBINER)
    m, b, s = cfg.model, cfg.training.micro_batch_size, cfg.model.seq_length
    layer = sorted(("all-reduce", "model", b * s * m.hidden_size) for _ in range(2))
    assert [sorted(ops) for ops in found["layer"]] == [layer]
    assert [sorted(ops) for ops in found["layer_back"]] == [layer, layer]  # the first microbatch's, the other's
    data = [op for ops in found["finish"] for op in ops if op[1] == "data"]
    assert {kind for kind, _, _ in data} == {"all-reduce"}
    assert sum(n for _, _, n in data) == local_sizes + 1  # every gradient, and the loss
    for name, variants in found.items():
        assert name == "finish" or all(op[1] != "data" for ops in variants for op in ops), name
    # The head: the cross-entropy's three sums of b*s scalars, and the output layer's `f` (its input's gradient)
    assert sorted(found["head"][0]) == [("all-reduce", "model", b * s)] * 3 + [("all-reduce", "model", layer[0][2])]
    assert found["embed"] == [[("all-reduce", "model", layer[0][2])]]  # the vocab-parallel embedding's `g`


@pytest.mark.parametrize("flags, match", [
    (dict(pipeline_model_parallel_size=2), "pass --pipeline-model-parallel-size 1, or drop --layer-calls"),
    (dict(use_distributed_optimizer=True), r"not run with --use-distributed-optimizer \(only the fused step shards"),
    (dict(use_distributed_optimizer=True, overlap_grad_reduce=True), "not run with --use-distributed-optimizer"),
    (dict(overlap_grad_reduce=True), r"not run with --overlap-grad-reduce \(its reductions run inside"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
     "pass --recompute-method none"),
])
def test_what_it_does_not_run_is_refused_in_one_line(flags, match):
    refused_in_one_line(match, TINY.replace(layer_calls=True, data_parallel_size=2, tensor_model_parallel_size=2,
                                            **flags).validate, 8)


@pytest.mark.parametrize("flags", [["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"],
                                   ["--overlap-grad-reduce"], ["--scan-layers"], ["--no-scan-layers"],
                                   ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"]])
def test_a_presets_layer_calls_yield_to_what_the_command_line_asks_for(flags):
    """The 1.2B preset runs each layer as a call; a layer stack (--scan-layers or not) or what the calls do not run,
    given on the command line, takes the fused step instead, as the preset's stack; asked for both it is refused."""
    preset = ["--config", "configs/gpt_1.2b.toml"]
    assert parse_config(preset).training.layer_calls
    cfg = parse_config([*preset, *flags])
    assert not cfg.training.layer_calls and cfg.training.scan_layers == ("--scan-layers" in flags)
    if flags != ["--no-scan-layers"]:  # (unrolled or not: no matter to the calls, so no refusal)
        with pytest.raises(ValueError, match="drop (--layer-calls|one of the two)|pass --no-layer-calls"):
            parse_config([*preset, *flags, "--layer-calls"]).validate(8)


def test_fp16_loss_scaling_trains_as_the_fused_step(tmp_path):
    base = TINY.replace(fp16=True, train_iters=3, log_interval=1, global_batch_size=8, initial_loss_scale=1024.0)
    fused, calls = (_train(tmp_path, f"fp16{c}", base, (2, 1, 2), layer_calls=c) for c in (False, True))
    np.testing.assert_allclose([calls.losses[s] for s in (1, 2, 3)], [fused.losses[s] for s in (1, 2, 3)], rtol=1e-4)


def test_nothing_stays_alive_between_steps_but_the_state():
    """The step's programs keep the shapes they were compiled for, never a call's buffers: after each step the device
    holds the state, the batch and the metrics, and the step indices (a few scalars). The second step compiles
    nothing."""
    cfg = TINY.replace(data_parallel_size=2, tensor_model_parallel_size=2, layer_calls=True, global_batch_size=8)
    train_step = TrainStep.build(cfg.validate(8), make_mesh(2, 1, 2, devices=jax.devices()[:4]))
    before = {id(x) for x in jax.live_arrays()}
    state = train_step.init_state()
    batch = train_step.model.put_batch(np.zeros((8, cfg.model.seq_length + 1), np.int32))
    calls, compiled = train_step._calls, []
    for _ in range(2):
        state, metrics = train_step(state, batch)
        kept = {id(x) for x in jax.tree.leaves((state, batch, metrics))}
        extra = [x for x in jax.live_arrays() if id(x) not in before | kept]
        assert sum(x.nbytes for x in extra) <= 4 * 8 and all(x.ndim == 0 for x in extra), extra
        compiled.append([len(p._compiled) for p in calls._programs().values()] + [len(calls._finishers)])
    assert compiled[0] == compiled[1], compiled


def test_a_pullback_keeps_a_value_once_not_its_views_or_the_inputs():
    """exp saves its output; the product after it the output squeezed (and v), the matmul the output reshaped (and w):
    the pruned pullback keeps the output once (the views and inputs are put back in the backward), vjp's cotangents."""
    def fn(w, x, v):
        e = jnp.exp(x)
        return (jnp.squeeze(e, -1) * v).sum() + e.reshape(-1) @ w

    w, x, v = jnp.arange(12.0) / 10, jnp.ones((3, 4, 1)) / 2, jnp.arange(12.0).reshape(3, 4)
    _, pullback = jax.vjp(fn, w, x, v)
    y, pruned = Pruned.vjp(fn, w, x, v)
    assert len(jax.tree.leaves(pullback)) == 5 and [a.shape for a in pruned.kept] == [(3, 4, 1)], pruned.where
    for got, want in zip(pruned.complete((w, x, v))(y), pullback(y)):
        np.testing.assert_array_equal(got, want)


def test_a_config_change_after_layer_calls_that_they_do_not_run_turns_them_off():
    """As flags over a preset, so a replace over a config (a checkpoint trained with the calls evaluated on a
    pipeline): what the calls do not run, or a layer stack, set later turns them off; set together, refused."""
    calls = TINY.replace(layer_calls=True)
    assert calls.replace(data_parallel_size=2, recompute_granularity="full").training.layer_calls
    assert not calls.replace(pipeline_model_parallel_size=2).training.layer_calls
    assert not calls.replace(scan_layers=True).training.layer_calls
    refused_in_one_line("--no-layer-calls where a preset sets it", TINY.replace(
        layer_calls=True, use_distributed_optimizer=True, data_parallel_size=2).validate, 8)


@pytest.mark.parametrize("recompute", [None, "full", "matmuls"])
def test_a_layers_pullback_keeps_no_copy_of_its_parameters_or_input(recompute):
    """The backward call gets the layer's parameters and input again, so its forward returns neither: no fp32
    parameter (under recomputation the casts are recomputed from them), and under `full` nothing but scalars."""
    cfg = TINY.replace(data_parallel_size=1, tensor_model_parallel_size=1, layer_calls=True, global_batch_size=2,
                       bf16=True, recompute_granularity=recompute, hidden_dropout=0.0,
                       attention_dropout=0.0).validate(8)
    train_step = TrainStep.build(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    state, calls = train_step.init_state(), train_step._calls
    micro = (train_step.model.put_batch(np.zeros((2, cfg.model.seq_length + 1), np.int32)), state.step,
             calls._index(0))
    x = _part(calls._embed((state.params, *micro)), 0)
    kept = [(a.shape[1:], a.dtype) for a in _part(calls._layer((state.params, *micro, calls._index(0)), x), 1).arrays]
    assert not {(a.shape[1:], a.dtype) for a in jax.tree.leaves(state.params["layers"])} & set(kept), kept
    if recompute == "full":
        assert all(shape == () for shape, _ in kept), kept
    if recompute is not None:  # the casts are recomputed too: no parameter's shape at all
        assert not {a.shape[1:] for a in jax.tree.leaves(state.params["layers"])} & {s for s, _ in kept}, kept
