"""Megatron's --recompute-method and --recompute-num-layers: which layers --recompute-granularity recomputes. The
values never change (every gradient on every mesh and schedule), memory falls as more layers are recomputed, the
audit counts each recomputed layer's repeated all-reduce, and bad combinations are refused in one line."""

import jax
import numpy as np
import pytest

from mtx import audit
from mtx.config import Config
from mtx.models.stack import ParallelTransformer
from mtx.parallel import make_mesh
from mtx.presets import load_preset
from mtx.run import train
from mtx.step import TrainStep

from helpers import loss_and_grads, refused_in_one_line

DEEP = Config().replace(**load_preset("configs/tiny.toml")).replace(num_layers=8, hidden_dropout=0.0,
                                                                    attention_dropout=0.0, vocab_size=257)
FULL = dict(recompute_granularity="full")


def method(name, n, granularity="full"):
    return dict(recompute_granularity=granularity, recompute_method=name, recompute_num_layers=n)


@pytest.mark.parametrize("granularity,name,n,runs,two", [
    ("full", "block", 3, [(0, 3, 1), (3, 5, 0)], [(0, 2, 1)]), ("matmuls", "block", 9, [(0, 8, 1)], [(0, 2, 1)]),
    ("full", "block", 1, [(0, 1, 1), (1, 7, 0)], [(0, 1, 1), (1, 1, 0)]),
    ("full", "uniform", 3, [(0, 6, 3), (6, 2, 2)], [(0, 2, 2)]), ("full", "uniform", 1, [(0, 8, 1)], [(0, 2, 1)]),
    ("full", None, None, [(0, 8, 1)], [(0, 2, 1)]), (None, None, None, [(0, 8, 0)], [(0, 2, 0)]),
    ("selective", None, None, [(0, 8, 0)], [(0, 2, 0)])])
def test_runs_of_the_held_layers(granularity, name, n, runs, two):
    """Of 8 held layers, and of 2 (an uneven stage's real layers, fewer than it holds)."""
    stack = ParallelTransformer(DEEP.model, recompute=granularity, recompute_method=name, recompute_num_layers=n)
    assert stack.recomputed_runs(8) == runs and stack.recomputed_runs(2) == two


# (data, pipeline, model) meshes with the method and the layout: unpipelined scanned and unrolled, 1F1B with uneven
# stages, interleaved, GPipe, the overlapped data-parallel reductions (their per-layer hook outside the groups).
MESHES = [((1, 1, 1), method("block", 3) | {"scan_layers": False}),
          ((1, 1, 2), method("uniform", 3) | {"sequence_parallel": True}),
          ((2, 2, 2), method("uniform", 2) | {"num_layers_in_first_pipeline_stage": 3, "scan_layers": False}),
          ((1, 2, 1), method("uniform", 2) | {"num_layers_in_first_pipeline_stage": 3}),
          ((1, 2, 2), method("block", 1, "matmuls") | {"virtual_pipeline_model_parallel_size": 2}),
          ((2, 2, 1), method("block", 2) | {"pipeline_schedule": "gpipe"}),
          ((2, 1, 2), method("uniform", 2) | {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                              "overlap_param_gather": True})]


@pytest.fixture(scope="module")
def unrecomputed():
    return loss_and_grads(DEEP, 1, 1, 1)


@pytest.mark.parametrize("mesh,flags", MESHES, ids=[f"{m}-{f['recompute_method']}" for m, f in MESHES])
def test_gradients_match_the_unrecomputed_step_on_every_mesh(mesh, flags, unrecomputed):
    ref_loss, ref = unrecomputed
    loss, grads = loss_and_grads(DEEP, *mesh, **flags)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref[name], rtol=1e-5, atol=1e-5 * np.abs(ref[name]).max(),
                                   err_msg=f"{name} on {mesh}")


def test_dropout_masks_are_redrawn_alike_in_recomputed_groups():
    """Dropout on: uniform groups on (2, 2, 2) and block on (1, 1, 2) give the one-device step's loss and gradients
    (a recomputed layer draws the masks its forward drew)."""
    drop = dict(hidden_dropout=0.1, attention_dropout=0.1)
    ref_loss, ref = loss_and_grads(DEEP, 1, 1, 1, **drop)
    for mesh, flags in (((2, 2, 2), method("uniform", 2)), ((1, 1, 2), method("block", 5))):
        loss, grads = loss_and_grads(DEEP, *mesh, **drop, **flags)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name, g in grads.items():
            np.testing.assert_allclose(g, ref[name], rtol=1e-5, atol=1e-5 * np.abs(ref[name]).max(), err_msg=name)


def _temp_bytes(pp=1, **flags):
    cfg = DEEP.replace(seq_length=128, pipeline_model_parallel_size=pp, tensor_model_parallel_size=1,
                       data_parallel_size=1, micro_batch_size=4, global_batch_size=4 * (2 * pp - 1),
                       **flags).validate(8)
    step = TrainStep.build(cfg, make_mesh(1, pp, 1, devices=jax.devices()[:pp]))
    tokens = jax.ShapeDtypeStruct((cfg.training.global_batch_size, 129), np.int32, sharding=step.model.batch_sharding)
    return jax.jit(step._train_step).lower(step.abstract_state(), tokens).compile().memory_analysis().temp_size_in_bytes


def test_memory_falls_with_each_layer_block_recomputes():
    """The unpipelined step's temporaries, 8 layers: none > block 2 > block 5 > full = block 8 = uniform 1."""
    none, two, five, eight = (_temp_bytes(**flags) for flags in ({}, method("block", 2), method("block", 5),
                                                                  method("block", 8)))
    assert none > two > five > eight == _temp_bytes(**FULL) == _temp_bytes(**method("uniform", 1)), (none, two, five)


def test_1f1b_keeps_only_what_the_recomputed_layers_leave():
    """Inside 1F1B's chunk checkpoint (which keeps every activation of the layers the method leaves), a recomputed
    layer keeps its input only: block 4 of each stage's 4 layers is `full`, block 2 between it and no recomputation."""
    none, two, four, full = (_temp_bytes(2, **flags) for flags in ({}, method("block", 2), method("block", 4), FULL))
    assert none > two > four and four == pytest.approx(full, rel=0.01), (none, two, four, full)


def test_audit_counts_each_recomputed_layers_all_reduce():
    """TP 2, four layers unrolled: each recomputed layer repeats attention's all-reduce in the backward (the MLP's
    output feeds only the next layer); a uniform group of U layers repeats 2 U - 1; matmuls keeps them all."""
    def backward(**flags):
        cfg = audit.audit_config(hidden_size=64, num_attention_heads=8, seq_length=16, micro_batch_size=2,
                                 tensor_model_parallel_size=2, num_layers=4, scan_layers=False, **flags)
        report = audit.audit_data_parallel(cfg)["by_axis"]
        assert report["forward"] == {"all-reduce model": 12}  # 2 a layer, the embedding's, the loss's 3
        return report["backward"]["all-reduce model"]

    none = backward()
    assert backward(**FULL) == none + 4
    assert backward(**method("block", 1)) == none + 1
    assert backward(**method("uniform", 2)) == none + 2 * 3
    assert backward(**method("block", 2, "matmuls")) == none


def test_a_checkpoint_moves_between_meshes_and_methods(tmp_path):
    """Dropout on: saved at step 2 on (2, 2, 2) recomputing uniform groups, resumed on one device with block: the
    losses of steps 3 and 4 are the uninterrupted run's."""
    base = DEEP.replace(hidden_dropout=0.1, attention_dropout=0.1, train_iters=4, lr_decay_iters=4, save_interval=2,
                        global_batch_size=8)
    full = train(base.replace(data_parallel_size=2, pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                              save=str(tmp_path / "ckpt"), **method("uniform", 2)), progress=False)
    resumed = train(base.replace(data_parallel_size=1, tensor_model_parallel_size=1, load=str(tmp_path / "ckpt"),
                                 ckpt_step=2, run_dir=str(tmp_path / "resumed"), **method("block", 3)), progress=False)
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [full.losses[s] for s in (3, 4)], rtol=1e-5)


@pytest.mark.parametrize("flags,match", [
    (dict(recompute_method="block", recompute_num_layers=2), "granularity is none; pass --recompute-granularity full "
                                                             "with it, or --recompute-method none "
                                                             "--recompute-num-layers none"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "granularity is selective"),
    (dict(FULL, recompute_num_layers=2), "needs --recompute-method: uniform"),
    (dict(FULL, recompute_method="block"), "needs --recompute-num-layers N"),
    (method("uniform", 2, "matmuls"), "pass --recompute-granularity full, or --recompute-method block"),
    (method("block", 5) | {"pipeline_model_parallel_size": 2}, "more than the 4 layers a pipeline stage"),
    (method("block", 5) | {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
     "pass at most 4"),  # Megatron's bound: a pipeline rank's layers, all its virtual stages'
    (method("block", 6) | {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 3},
     "pass at most 5"),
])
def test_bad_combinations_are_refused_in_one_line(flags, match):
    refused_in_one_line(match, DEEP.replace(tensor_model_parallel_size=1, data_parallel_size=1, **flags).validate)


def test_flags_and_their_range():
    from mtx.cli import parse_config

    cfg = parse_config("--recompute-granularity full --recompute-method block --recompute-num-layers 2".split())
    assert (cfg.training.recompute_method, cfg.training.recompute_num_layers) == ("block", 2)
    refused_in_one_line("--recompute-num-layers", Config().replace(**FULL, recompute_method="block",
                                                                   recompute_num_layers=0).validate)
    refused_in_one_line("--recompute-method", Config().replace(**FULL, recompute_method="blocks",
                                                               recompute_num_layers=1).validate)
