"""--overlap-grad-reduce and --overlap-param-gather: the layer stack's data-parallel reductions (and the distributed
optimizer's gathers) move into each layer's backward (forward), with the same gradients, losses and checkpoints."""

import numpy as np
import pytest

from mtx.audit import audit_config, audit_data_parallel
from mtx.config import Config
from mtx.presets import load_preset
from mtx.run import train
from mtx.step import compiler_options

from helpers import loss_and_grads

# Tiny GPT, 3 layers, dropout on, clipping that binds; 2 microbatches a data rank at DP 4.
BASE = Config().replace(**load_preset("configs/tiny.toml")).replace(
    num_layers=3, hidden_dropout=0.1, attention_dropout=0.1, clip_grad=0.5, micro_batch_size=2, global_batch_size=16)
REPLICATED = dict(overlap_grad_reduce=True)
SCATTERED = dict(use_distributed_optimizer=True, overlap_grad_reduce=True)
GATHERED = dict(SCATTERED, overlap_param_gather=True)


def cfg_for(mesh, **flags):
    dp, pp, tp = mesh
    return BASE.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, **flags)


@pytest.mark.parametrize("mesh, flags", [
    ((4, 1, 2), REPLICATED), ((4, 1, 2), SCATTERED), ((4, 1, 2), GATHERED),
    ((8, 1, 1), dict(GATHERED, scan_layers=False, micro_batch_size=1)),  # unrolled layers, accumulation over 2
    ((2, 1, 4), dict(GATHERED, sequence_parallel=True, recompute_granularity="matmuls", micro_batch_size=4)),
    ((2, 1, 4), dict(REPLICATED, scan_layers=False, group_query_attention=True, num_query_groups=2,
                     recompute_granularity="full")),  # key/value groups replicated over "model" (G < TP)
])
def test_gradients_equal_the_reduction_after_the_backward(mesh, flags):
    """Every gradient as one device computes it (the replicated optimizer on a data-only mesh, same blocks)."""
    blocks = {k: v for k, v in flags.items() if k in ("group_query_attention", "num_query_groups")}
    loss, grads = loss_and_grads(BASE, *mesh, **flags)
    ref_loss, ref_grads = loss_and_grads(BASE, 8, 1, 1, **blocks)
    assert loss == pytest.approx(ref_loss, rel=1e-6) and grads.keys() == ref_grads.keys()
    top = max(np.abs(g).max() for g in ref_grads.values())
    for got, want in zip(grads.values(), ref_grads.values()):
        # Each gradient at its own scale, except the keys' bias: its gradient is 0 in exact arithmetic (softmax
        # ignores a constant added to every key), so what is computed is rounding noise, at the scale of the others.
        scale = max(np.abs(want).max(), 1e-4 * top)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_losses_and_resume_across_meshes_and_flags(tmp_path):
    """Trained with the overlap at DP 4 x TP 2 the losses are those without it at DP 8; a checkpoint saved without
    the flags resumes exactly with them (the state's layout does not depend on them). The overlapped run also
    passes --scheduler-memory-percent to XLA (a misspelt option fails the compile; it never changes the math)."""
    base = dict(train_iters=4, save_interval=2)
    ref = train(cfg_for((8, 1, 1), save=str(tmp_path / "ref"), **base), progress=False)
    overlapped_cfg = cfg_for((4, 1, 2), run_dir=str(tmp_path / "o"), scheduler_memory_percent=30, **GATHERED, **base)
    assert compiler_options(overlapped_cfg) == {"xla_gpu_memory_limit_slop_factor": 30}
    assert compiler_options(cfg_for((4, 1, 2))) is None  # XLA's own setting
    overlapped = train(overlapped_cfg, progress=False)
    resumed = train(cfg_for((2, 1, 4), load=str(tmp_path / "ref"), ckpt_step=2, run_dir=str(tmp_path / "r"),
                            **REPLICATED, **base), progress=False)
    want = [ref.losses[s] for s in (1, 2, 3, 4)]
    np.testing.assert_allclose([overlapped.losses[s] for s in (1, 2, 3, 4)], want, rtol=1e-5)
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], want[2:], rtol=1e-5)


@pytest.mark.parametrize("flags, in_loop", [
    ({}, set()),
    (REPLICATED, {"all-reduce"}),
    (SCATTERED, {"reduce-scatter"}),
    (GATHERED, {"all-gather", "reduce-scatter"}),
])
def test_audit_shows_the_reductions_in_the_layer_loop(flags, in_loop):
    """One reduction (and with --overlap-param-gather one gather) of each of the layer's parameters that "data"
    splits, inside the scanned layer; none there without the flags."""
    cfg = audit_config(hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                       tensor_model_parallel_size=2, data_parallel_size=2, num_layers=2, vocab_size=256,
                       num_devices=4, **flags)
    report = audit_data_parallel(cfg)
    loop = report["in_layer_loop"]
    # The layer's 12 parameters (4 linears' kernels and biases, 2 LayerNorms' scales and biases); the distributed
    # optimizer splits all but the two column-parallel biases (whose one dimension "model" splits already) over
    # "data", and all-reduces those two.
    split = 12 if not flags.get("use_distributed_optimizer") else 10
    assert {k for k, n in loop.items() if n} >= in_loop
    if not flags:
        assert not any(loop.values()), loop
    for kind in in_loop:
        assert loop[kind] == split, (kind, loop)
    assert not flags or sum(loop.values()) == (12 + 10 * ("all-gather" in in_loop))


@pytest.mark.parametrize("flags", [REPLICATED, GATHERED])
def test_with_accumulation_only_the_last_microbatch_reduces(flags):
    """Three microbatches a data rank, 2 layers unrolled: the layers' reductions over "data" sit in the last
    microbatch's branch of the accumulation loop, once per layer parameter (the earlier microbatches only
    accumulate), and the step moves what it moves with one microbatch; with --overlap-param-gather the parameters
    are then gathered once before the forward (one all-gather a stacked parameter, not one a layer)."""
    def audit(m):
        cfg = audit_config(hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                           tensor_model_parallel_size=2, data_parallel_size=2, num_layers=2, vocab_size=256,
                           num_devices=4, num_microbatches=m, **flags)
        return audit_data_parallel(cfg.replace(scan_layers=False))

    one, three = audit(1), audit(3)
    assert three["in_layer_loop"] == {}  # nothing in the loop body itself: the earlier microbatches do not reduce
    # 2 layers x the layer's 12 parameters (with the distributed optimizer 10 reduce-scattered, 2 all-reduced)
    scattered = "use_distributed_optimizer" in flags
    assert three["in_loop_branches"] == ({"reduce-scatter": 20, "all-reduce": 4} if scattered else {"all-reduce": 24})
    reductions = ("all-reduce", "reduce-scatter")
    assert {k: v for k, v in three["data"].items() if k in reductions} == {
        k: v for k, v in one["data"].items() if k in reductions}
    if "overlap_param_gather" in flags:  # per layer with one microbatch, up front with three
        assert three["data"]["all-gather"]["ops"] == one["data"]["all-gather"]["ops"] - 10


@pytest.mark.parametrize("flags, fix", [
    (dict(overlap_param_gather=True), "--use-distributed-optimizer and --overlap-grad-reduce"),
    (dict(use_distributed_optimizer=True, overlap_param_gather=True), "--overlap-grad-reduce"),
    (dict(REPLICATED, pipeline_model_parallel_size=2), "drop the flag"),
])
def test_bad_combinations_fail_in_one_line(flags, fix):
    with pytest.raises(ValueError, match=fix) as e:
        cfg_for((4, 1, 2)).replace(**flags).validate(8)
    assert "\n" not in str(e.value)
