"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B over "pipeline", composed with tensor and data parallelism,
without changing the math."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.parallel.layout import parse_layout, stage_layer_counts
from mtx.presets import load_preset
from mtx.run import train
from mtx.step import TrainStep

from helpers import loss_and_grads

# The tiny preset deepened to 8 layers, exact (fp32, no dropout).
DEEP = Config().replace(**load_preset("configs/tiny.toml")).replace(num_layers=8, hidden_dropout=0.0,
                                                                    attention_dropout=0.0)
# (data, pipeline, model) meshes, layouts and schedules (1F1B unless named); global batch 16 / micro batch 2 gives
# 8 / data microbatches.
MESHES = [
    ((1, 1, 1), {}),
    ((2, 2, 2), {}),
    ((1, 2, 4), {"pipeline_schedule": "gpipe"}),
    ((2, 4, 1), {"virtual_pipeline_model_parallel_size": 2}),
    ((1, 8, 1), {}),
    ((1, 4, 2), {"pipeline_model_parallel_layout": "Et|ttt|ttt|tL"}),
    ((2, 2, 2), {"num_layers_in_first_pipeline_stage": 3, "pipeline_schedule": "gpipe"}),
    ((1, 2, 2), {"pipeline_model_parallel_layout": "Et|t|tt|t|t|t|t|L"}),  # interleaved, V = 4, uneven, one empty
]


def cfg_for(mesh, layout, **extra):
    dp, pp, tp = mesh
    return DEEP.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                        **layout, **extra)


def _names(meshes) -> list[str]:
    return [f"{mesh}-{','.join(f'{k}={v}' for k, v in layout.items()) or '1f1b'}" for mesh, layout in meshes]


def _first_ten_losses(mesh, layout, run_dir) -> np.ndarray:
    r = train(cfg_for(mesh, layout, train_iters=10, log_interval=5, run_dir=str(run_dir)), progress=False)
    return np.array([r.losses[s] for s in range(1, 11)])


@pytest.fixture(scope="module")
def unpipelined_losses(tmp_path_factory):
    """The first ten losses on one device (once per test process), which every mesh below must give."""
    curve = _first_ten_losses(*MESHES[0], tmp_path_factory.mktemp("unpipelined"))
    assert curve[-1] < curve[0]
    return curve


# One test a mesh, so that the test processes share them out.
@pytest.mark.parametrize("mesh, layout", MESHES[1:], ids=_names(MESHES[1:]))
def test_pipelined_losses_match_on_every_mesh_and_layout(mesh, layout, unpipelined_losses, tmp_path):
    np.testing.assert_allclose(_first_ten_losses(mesh, layout, tmp_path), unpipelined_losses, rtol=1e-5)


GRADIENT_MESHES = [((2, 2, 2), {"num_layers_in_first_pipeline_stage": 3, "scan_layers": False}),
                   ((2, 2, 2), {"num_layers_in_first_pipeline_stage": 3, "pipeline_schedule": "gpipe"}),
                   ((1, 4, 2), {"pipeline_model_parallel_layout": "Et|ttt|ttt|tL"}), ((1, 8, 1), {}),
                   ((1, 2, 2), {"num_layers_per_virtual_pipeline_stage": 2, "recompute_granularity": "matmuls"})]


@pytest.fixture(scope="module")
def unpipelined_gradients():
    return loss_and_grads(DEEP.replace(vocab_size=257), 1, 1, 1)


@pytest.mark.parametrize("mesh, layout", GRADIENT_MESHES, ids=_names(GRADIENT_MESHES))
def test_gradients_of_every_parameter_match_the_unpipelined_run(mesh, layout, unpipelined_gradients):
    ref_loss, ref = unpipelined_gradients
    loss, grads = loss_and_grads(DEEP.replace(vocab_size=257), *mesh, **layout)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        scale = np.abs(ref[name]).max()
        np.testing.assert_allclose(g, ref[name], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name} on {mesh}")


@pytest.mark.parametrize("src, src_flags, dst, dst_flags", [
    ((2, 2, 2), {"virtual_pipeline_model_parallel_size": 2}, (1, 1, 8), {}),
    ((8, 1, 1), {}, (1, 4, 2), {"pipeline_schedule": "gpipe"}),
], ids=["interleaved-to-unpipelined", "data-parallel-to-gpipe"])
def test_checkpoints_move_between_pipelined_and_unpipelined_meshes(tmp_path, src, src_flags, dst, dst_flags):
    """Dropout on: an interleaved (2, 2, 2) checkpoint resumes on (1, 1, 8) and an (8, 1, 1) one on (1, 4, 2) with
    GPipe, exactly."""
    base = dict(hidden_dropout=0.1, attention_dropout=0.1, train_iters=6, save_interval=3)
    ckpt = str(tmp_path / "ckpt")
    full = train(cfg_for(src, src_flags, save=ckpt, **base), progress=False)
    resumed = train(cfg_for(dst, dst_flags, load=ckpt, ckpt_step=3, run_dir=str(tmp_path / "resumed"), **base),
                    progress=False)
    np.testing.assert_allclose([resumed.losses[s] for s in (4, 5, 6)], [full.losses[s] for s in (4, 5, 6)],
                               rtol=1e-5, err_msg=f"{src} -> {dst}")


def stage_argument_bytes(pp):
    cfg = DEEP.replace(vocab_size=257, pipeline_model_parallel_size=pp, tensor_model_parallel_size=1,
                       data_parallel_size=1, num_layers=8, hidden_size=128).validate(8)
    train_step = TrainStep.build(cfg, make_mesh(1, pp, 1, devices=jax.devices()[:pp]))
    state = train_step.abstract_state()
    tokens = jax.ShapeDtypeStruct((16, 33), np.int32, sharding=train_step.model.batch_sharding)
    compiled = jax.jit(train_step._train_step).lower(state, tokens).compile()
    layer_share = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(state.params)["layers"]))
    total = sum(x.size for x in jax.tree.leaves(state.params))
    return compiled.memory_analysis().argument_size_in_bytes, layer_share / total


@pytest.mark.parametrize("pp", [2, 4])
def test_parameter_memory_per_device_falls_with_pipeline_size(pp):
    """Parameters + Adam moments per device: the layer stack's share falls as 1 / p, the embeddings stay."""
    one, layer_fraction = stage_argument_bytes(1)
    many, _ = stage_argument_bytes(pp)
    expected = (1 - layer_fraction) + layer_fraction / pp
    assert many / one == pytest.approx(expected, rel=0.05)


def test_layouts_parse():
    assert parse_layout("E|tt|tt|L") == (0, 2, 2, 0)
    assert parse_layout("Et*3|(tt|)*29,t|L") == (3,) + (2,) * 29 + (1, 0)
    assert stage_layer_counts(10, 4, first=1, last=3) == (1, 3, 3, 3)
    assert stage_layer_counts(8, 2) == (4, 4)


@pytest.mark.parametrize("flags,needle", [
    (dict(num_layers=6, pipeline_model_parallel_size=4), "--num-layers 6 is not divisible"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|(tt|L"), "unbalanced"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tL"), "--num-layers is 8"),
    (dict(pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Etttt|ttttL"), "has 2 stages"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*3|(tt|)*29,m|L"), "multi-token"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tttt|ttttL"), "embedding E"),
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=9), "does not split"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="zero-bubble"), "must be gpipe, 1f1b or interleaved"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3),
     "x --virtual-pipeline-model-parallel"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3), "choose N dividing 4"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          num_layers_per_virtual_pipeline_stage=1), "disagree"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="gpipe"),
     "gpipe runs one stage per device"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved"), "needs virtual stages"),
    (dict(virtual_pipeline_model_parallel_size=2), "pass --pipeline-model-parallel-size > 1"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          num_layers_in_first_pipeline_stage=1), "do not combine with virtual stages"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0), "must be >= 1"),
])
def test_bad_pipeline_requests_fail_in_one_line(flags, needle):
    with pytest.raises(ValueError, match=needle) as err:
        DEEP.replace(**flags).validate(8)
    assert "\n" not in str(err.value)


def test_audit_reports_the_pipeline_shifts_and_megatron_all_reduces():
    from mtx.audit import audit_config, audit_layer, audit_pipeline

    b, s, h = 2, 32, 64
    cfg = audit_config(hidden_size=h, num_attention_heads=8, seq_length=s, micro_batch_size=b,
                       tensor_model_parallel_size=2, data_parallel_size=1, pipeline_model_parallel_size=4,
                       num_microbatches=8, num_devices=8, pipeline_schedule="gpipe")
    report = audit_pipeline(cfg)
    ticks = 8 + 4 - 1
    for phase in ("forward", "backward"):
        assert report["per_step"][phase] == {"collective-permute pipeline": ticks, "elements_each": [b * s * h]}
    assert report["schedule"]["ideal_bubble"] == pytest.approx(3 / 11)
    # the stage's layers still do exactly Megatron's all-reduces
    layer = audit_layer(cfg)
    assert layer["by_axis"] == {"forward": {"all-reduce model": 2}, "backward": {"all-reduce model": 2}}
    # no logits are gathered anywhere in the step
    assert all(op["elements"] < b * s * cfg.model.padded_vocab_size // 2
               for phase in ("forward", "backward") for op in report["ops"][phase] if op["kind"] == "all-gather")


def test_recomputation_bounds_pipelined_activation_memory():
    """GPipe keeps activations of M + P - 1 ticks; with full recomputation only each layer's (b, S, D) input."""
    def temp_bytes(recompute):
        cfg = DEEP.replace(vocab_size=257, pipeline_model_parallel_size=2, tensor_model_parallel_size=1,
                           data_parallel_size=1, seq_length=128, recompute_granularity=recompute,
                           pipeline_schedule="gpipe").validate(8)
        train_step = TrainStep.build(cfg, make_mesh(1, 2, 1, devices=jax.devices()[:2]))
        tokens = jax.ShapeDtypeStruct((16, 129), np.int32, sharding=train_step.model.batch_sharding)
        compiled = jax.jit(train_step._train_step).lower(train_step.abstract_state(), tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, matmuls, none = temp_bytes("full"), temp_bytes("matmuls"), temp_bytes(None)
    assert full < 0.5 * none and full < matmuls < none, (full, matmuls, none)


def test_microbatches_not_divisible_by_stages():
    """M = 6 on P = 4 stages: the loss share is padded with empty microbatches that count nothing."""
    tokens = np.random.default_rng(1).integers(0, 257, (12, 33)).astype(np.int32)

    def loss_on(pp):
        cfg = DEEP.replace(vocab_size=257, global_batch_size=12, data_parallel_size=1, tensor_model_parallel_size=1,
                           pipeline_model_parallel_size=pp).validate(8)
        train_step = TrainStep.build(cfg, make_mesh(1, pp, 1, devices=jax.devices()[:pp]))
        state = train_step.init_state()
        assert train_step.model.num_microbatches == 6
        batch = train_step.model.put_batch(tokens)
        return float(jax.jit(train_step.loss_and_grads)(state.params, batch, state.step)[0])

    assert loss_on(4) == pytest.approx(loss_on(1), rel=1e-6)
