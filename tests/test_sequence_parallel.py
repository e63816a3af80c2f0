"""Sequence parallelism (--sequence-parallel) changes where the element-wise work and the communication happen, never
the math: loss and every gradient equal the paper's layers'."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config
from mtx.parallel.mesh import make_mesh
from mtx.presets import load_preset
from mtx.sharded_model import ShardedModel

from helpers import LLAMA_BLOCKS, loss_and_grads

TINY = Config().replace(**load_preset("configs/tiny.toml"))


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for path in want[1]:
        np.testing.assert_allclose(got[1][path], want[1][path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_sequence_parallel_is_the_same_math():
    """Dropout on (the masks follow the sequences, whichever rank holds them): loss and gradients on (data, pipeline,
    model) meshes with each microbatch's rows split over "model" equal the unsplit run's (BERT's in
    tests/test_bert_training.py)."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=16, micro_batch_size=8)
    reference = loss_and_grads(cfg.replace(tensor_model_parallel_size=1), 1, 1, 1)
    for dp, pp, tp in [(1, 1, 2), (1, 1, 4), (2, 1, 4), (1, 2, 2), (1, 1, 8)]:
        sp = cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                         sequence_parallel=True)
        assert_same(loss_and_grads(sp, dp, pp, tp), reference)


def test_sequence_parallel_with_recomputation_and_unrolled_layers():
    """Every recomputation policy, unrolled layers, and the benchmarked mix (plain gathers, `matmuls`, unrolled,
    fused attention)."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.0, global_batch_size=4, tensor_model_parallel_size=2)
    reference = loss_and_grads(cfg, 1, 1, 2)
    for recompute in ("full", "selective", "matmuls"):
        sp = cfg.replace(sequence_parallel=True, recompute_granularity=recompute, scan_layers=False)
        assert_same(loss_and_grads(sp, 1, 1, 2), reference)
    fast = dict(recompute_granularity="matmuls", scan_layers=False, use_flash_attn=True)
    assert_same(loss_and_grads(cfg.replace(sequence_parallel=True, **fast), 1, 1, 2),
                loss_and_grads(cfg.replace(**fast), 1, 1, 2))


def test_sequence_parallel_pipeline_with_a_padding_microbatch():
    """3 microbatches over 2 uneven stages (1 + 2 layers): each stage scores 2 microbatches, one of them padding; rows
    ordered rank-major throughout."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=12, micro_batch_size=4,
                       num_layers=3)
    reference = loss_and_grads(cfg.replace(tensor_model_parallel_size=1), 1, 1, 1)
    sp = cfg.replace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1,
                     sequence_parallel=True, num_layers_in_first_pipeline_stage=1)
    assert_same(loss_and_grads(sp, 1, 2, 2), reference)


def test_sequence_parallel_is_one_switch_on_the_config():
    """--sequence-parallel is on only with TP > 1 (one model rank has nothing to split); every layer of the built model
    reads that one value, and the model for decoding has it off (whole rows) with the same parameters."""
    sp = TINY.replace(sequence_parallel=True, tensor_model_parallel_size=2)
    assert sp.sequence_parallel and not TINY.sequence_parallel
    assert not sp.replace(tensor_model_parallel_size=1).sequence_parallel
    model = ShardedModel(sp.validate(2), make_mesh(1, 1, 2, devices=jax.devices()[:2]))
    built = model.make_model()
    modules = [m for _, m in nnx.iter_graph(built) if isinstance(m, nnx.Module) and hasattr(m, "sequence_parallel")]
    assert len(modules) > 5 and all(m.sequence_parallel for m in modules) and built.stack.sequence_parallel
    decoding = model.for_decoding
    assert not decoding.cfg.sequence_parallel and decoding.param_specs == model.param_specs


@pytest.mark.parametrize("flags,needle", [
    (dict(sequence_parallel=True, tensor_model_parallel_size=4, micro_batch_size=2), "multiple of 4"),
])
def test_bad_sequence_parallel_flags_are_refused(flags, needle):
    with pytest.raises(ValueError, match=needle):
        TINY.replace(**flags).validate()


def test_tp_comm_overlap_is_the_same_math_and_the_same_collectives():
    """--tp-comm-overlap routes the linears' gathers and scatters through mtx/kernels/collective_matmul.py (whose
    Hopper kernels are checked on GPUs by benchmarks/gpu_checks.py); here, as on any device without the kernels, those
    are XLA's collectives: loss and gradients equal the unsplit run's (pipelined too, and with `matmuls` recomputation
    and unrolled layers), and the layer's collectives are sequence parallelism's own, no more."""
    from mtx import audit

    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=16, micro_batch_size=8)
    llama = {**LLAMA_BLOCKS, "num_query_groups": 4}  # SwiGLU's gate and up side by side; GQA keeps its gather
    run = {"recompute_granularity": "matmuls", "scan_layers": False}  # how the step runs: the same math
    for (dp, pp, tp), model, how in [((2, 1, 2), {}, run), ((1, 2, 2), {}, {}), ((1, 1, 2), llama, {})]:
        overlap = cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                              sequence_parallel=True, tp_comm_overlap=True, **model, **how)
        assert overlap.tp_comm_overlap
        assert_same(loss_and_grads(overlap, dp, pp, tp), loss_and_grads(cfg.replace(**model), 1, 1, 1))
    layer = dict(hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=4, tensor_model_parallel_size=2,
                 sequence_parallel=True, recompute_granularity="matmuls")
    plain, overlapped = (audit.audit_layer(audit.audit_config(**layer, tp_comm_overlap=on)) for on in (False, True))
    assert overlapped["by_axis"] == plain["by_axis"] and overlapped["elements"] == plain["elements"]


def test_tp_comm_overlap_says_which_collectives_run_and_its_checkpoint_moves(tmp_path, capsys):
    """The banner names the path; a checkpoint saved with --tp-comm-overlap at (1, 1, 2) resumes at (4, 1, 2) without
    it, exactly (the flag changes no parameter)."""
    from mtx.run import train

    ckpt, base = str(tmp_path / "ckpt"), dict(global_batch_size=8, micro_batch_size=2, train_iters=4, save_interval=2)
    full = train(TINY.replace(tensor_model_parallel_size=2, data_parallel_size=1, sequence_parallel=True,
                              tp_comm_overlap=True, save=ckpt, **base), progress=False)
    assert "mtx: --tp-comm-overlap: XLA's collectives (no kernels: needs NVIDIA Hopper GPUs" in capsys.readouterr().out
    resumed = train(TINY.replace(tensor_model_parallel_size=2, data_parallel_size=4, load=ckpt,
                                 ckpt_step=2, run_dir=str(tmp_path / "resumed"), **base), progress=False)
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [full.losses[s] for s in (3, 4)], rtol=1e-5)


def test_tp_comm_overlap_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="--tp-comm-overlap .* pass it with --sequence-parallel"):
        TINY.replace(tensor_model_parallel_size=2, tp_comm_overlap=True).validate()
    assert not TINY.replace(tensor_model_parallel_size=1, sequence_parallel=True, tp_comm_overlap=True).tp_comm_overlap
