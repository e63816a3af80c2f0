"""The peer-memory collective matmuls (mtx/kernels/collective_matmul.py): off a Hopper GPU they are XLA's collectives
and matmuls; their Mosaic GPU kernels lower for CUDA here (checked without a GPU), and run and are compared with XLA's
result on GPUs by benchmarks/collective_matmul.py and benchmarks/gpu_checks.py, whose runs here are tested too."""

import json
import sys
import unittest.mock
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mtx.errors import UsageError
from mtx.kernels import collective_matmul as cm, ring_tiles
from mtx.parallel.mesh import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import collective_matmul as benchmark, gpu_checks  # noqa: E402

AG = (P(MODEL), P(None, MODEL), P(None, MODEL))  # x, w, out: rows gathered, columns split
RS = (P(None, MODEL), P(MODEL), P(MODEL))  # contraction split, output rows scattered


def _run(fn, specs, x, w, mesh):
    x_spec, w_spec, out_spec = specs
    x, w = jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))(x, w)


def test_off_a_gpu_they_are_the_collective_and_the_matmul():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    x = jax.random.normal(jax.random.key(0), (8, 6))
    w = jax.random.normal(jax.random.key(1), (6, 4))
    np.testing.assert_allclose(_run(cm.all_gather_matmul, AG, x, w, mesh), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(cm.matmul_reduce_scatter, RS, x, w, mesh), x @ w, rtol=1e-5, atol=1e-5)
    reason = cm.kernel_condition(x, w, 2, cm.default_config(4), rows_split=True)
    assert reason.startswith("needs NVIDIA Hopper GPUs")


def _lower_for_hopper(program, *args) -> str:
    """The StableHLO of `program` lowered for CUDA here, on the CPU. The kernels ask the device for its SM count, and
    jax's for a mesh of every device (the tests simulate 8; the programs use 2)."""
    with unittest.mock.patch.object(type(jax.devices()[0]), "core_count", 132, create=True), \
            unittest.mock.patch.object(jax, "device_count", lambda: 2), \
            unittest.mock.patch.object(jax, "local_device_count", lambda: 2):
        return program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("pattern", ["ag", "rs"])
def test_the_kernels_lower_for_hopper(pattern):
    """Traced and lowered for CUDA on the CPU (a Mosaic GPU custom call in the module): catches a kernel written
    against another jax's Pallas API; whether it computes the right thing is the GPU benchmark's check."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    config = cm.default_config(1536)
    if pattern == "ag":
        fn = lambda x, w: ring_tiles.all_gather_matmul_kernel(x, w, MODEL, config=config, num_sms=132)[0]
        shapes, specs = ((1024, 1536), (1536, 2 * 1536)), AG
    else:
        fn = lambda x, w: ring_tiles.matmul_reduce_scatter_kernel(x, w, MODEL, config=config, num_sms=132)
        shapes, specs = ((1024, 2 * 768), (2 * 768, 1536)), RS
    program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs[:2], out_specs=specs[2], check_vma=False))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    assert "mosaic_gpu" in _lower_for_hopper(program, *args)


@pytest.mark.parametrize("collective", ["peer_all_gather", "peer_reduce_scatter"])
def test_the_collectives_benchmarks_peer_rows_lower_for_hopper(collective):
    """benchmarks/collectives.py's peer-memory rows (the kernels with a thin matmul, chained 3 times) lower for CUDA
    to three Mosaic GPU calls and no NCCL collective."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks import collectives

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    shape = (1024, 1536) if collective == "peer_all_gather" else (1024, 2 * 64)
    text = _lower_for_hopper(collectives.peer_fn(collective, mesh, 3, 1536), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line and "mosaic_gpu" in line]
    assert len(calls) == 3 and "all_gather" not in text and "reduce_scatter" not in text


@pytest.mark.parametrize("kind", ["column", "row"])
def test_the_linear_layers_matmuls_and_their_gradients_equal_autodiffs(kind):
    """column_parallel_matmul / row_parallel_matmul (custom backward: the other pattern for the input gradient, the
    gathered operand for the weight's) against autodiff of the plain collectives, inside a shard_map that checks
    which values vary, on 4 devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (MODEL,))
    keys = jax.random.split(jax.random.key(0), 3)
    if kind == "column":
        x, w, specs = jax.random.normal(keys[0], (16, 6)), jax.random.normal(keys[1], (6, 8)), AG
        fn, plain = cm.column_parallel_matmul, cm.xla_all_gather_matmul
    else:
        x, w, specs = jax.random.normal(keys[0], (16, 8)), jax.random.normal(keys[1], (8, 6)), RS
        fn, plain = cm.row_parallel_matmul, cm.xla_matmul_reduce_scatter
    ct = jax.random.normal(keys[2], (16, w.shape[1]))  # a cotangent for every output row

    def loss(f):
        def run(x, w, ct):
            return jax.lax.psum((f(x, w) * ct).sum(), MODEL)[None]
        x_spec, w_spec, out_spec = specs
        sharded = jax.shard_map(run, mesh=mesh, in_specs=(x_spec, w_spec, out_spec), out_specs=P(MODEL))
        return lambda x, w: sharded(x, w, ct)[0]

    np.testing.assert_allclose(loss(fn)(x, w), loss(plain)(x, w), rtol=1e-5)
    for got, want in zip(jax.grad(loss(fn), (0, 1))(x, w), jax.grad(loss(plain), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_on_hopper_the_layers_matmuls_and_input_gradients_are_kernels(kind, monkeypatch):
    """Lowered for CUDA with the kernels' condition met (as on 2 H200s), inside a shard_map that checks which values
    vary: the forward and the input gradient are the peer-memory kernels (two Mosaic GPU calls),
    and no NCCL all-gather or reduce-scatter is left (the weight gradient takes the rows the all-gather kernel
    received)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    monkeypatch.setattr(cm, "kernel_condition", lambda *args, **kwargs: None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    if kind == "column":
        fn, specs, shapes = cm.column_parallel_matmul, AG, ((2048, 1536), (1536, 2 * 1536))
    else:
        fn, specs, shapes = cm.row_parallel_matmul, RS, ((2048, 2 * 768), (2 * 768, 1536))

    def run(x, w):  # the loss kept, so the forward's kernel is not dead code
        loss, grads = jax.value_and_grad(lambda x, w: fn(x, w).astype(jnp.float32).sum(), (0, 1))(x, w)
        return jax.lax.psum(loss, MODEL), grads

    program = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs[:2], out_specs=(P(), specs[:2])))
    text = _lower_for_hopper(program, *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes))
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line and "mosaic_gpu" in line]
    assert len(calls) == 2, len(calls)
    assert "reduce_scatter" not in text and "all_gather" not in text
    # the all-gather kernel returns the gathered rows in the devices' order: XLA puts nothing together
    assert "stablehlo.concatenate" not in text


def test_the_all_gather_kernel_needs_two_depth_steps(monkeypatch):
    monkeypatch.setattr(cm, "machine_condition", lambda p: None)  # as on 2 Hopper GPUs
    config = cm.default_config(512)
    x, w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
    assert "at least two depth steps" in cm.kernel_condition(x, w, 2, config, rows_split=True)
    assert cm.kernel_condition(x, w, 2, config, rows_split=False) is None  # the reduce-scatter releases no tile late
    x, w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
    assert cm.kernel_condition(x, w, 2, config, rows_split=True) is None


def test_collective_matmul_benchmark_runs_xla_and_says_why_the_kernel_cannot(tmp_path):
    """benchmarks/collective_matmul.py on simulated devices: XLA's all-gather + matmul, matmul + reduce-scatter and a
    layer's matmul forward and backward timed, the peer-memory kernels' lines saying they need Hopper GPUs; bad sizes
    refused in one line."""
    out = tmp_path / "cm.jsonl"
    results = benchmark.main(["--shapes", "qkv", "attn_out", "mlp_down_layer", "--tokens", "8", "--iters",
                                      "2", "--repeats", "1", "--out", str(out)])
    assert [(r["pattern"], r["impl"]) for r in results] == [("ag", "xla"), ("ag", "kernel"), ("rs", "xla"),
                                                            ("rs", "kernel"), ("row", "xla"), ("row", "kernel")]
    assert all(r["time_us"] > 0 for r in results[::2]) and all("Hopper" in r["error"] for r in results[1::2])
    assert len(out.read_text().splitlines()) == 6
    for bad, said in ((["--tokens", "7"], "--tokens 7: must be a positive multiple"), (["--iters", "0"], "--iters")):
        with pytest.raises(UsageError, match=said):  # (exit_with: one line, status 2)
            benchmark.main(bad)


def test_gpu_checks_catch_a_wrong_collective_matmul_backward(monkeypatch, capsys):
    """The collective_matmul check (XLA's collectives inside the layer functions here) fails a row-parallel matmul
    whose weight gradient is off by 5%."""
    def wrong(x, w):
        y = cm.xla_matmul_reduce_scatter(x, w)
        return y + cm.xla_matmul_reduce_scatter(x, 0.05 * (w - jax.lax.stop_gradient(w)))

    monkeypatch.setattr(cm, "row_parallel_matmul", wrong)
    assert gpu_checks.main(["--batch", "2", "--seq", "16", "--heads", "2", "--head-dim", "8"]) == 1
    check = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert check["check"] == "collective_matmul" and check["failed"] == ["dw2"]


@pytest.mark.parametrize("recompute", [None, "matmuls"])
def test_with_tp_comm_overlap_the_training_step_lowers_to_the_kernels(recompute, monkeypatch):
    """The model's training step with --sequence-parallel on a (1, 1, 2) mesh, lowered for CUDA as on 2 H200s (the
    machine's condition met, the shapes' still checked), in bf16 at sizes the tiles divide, with and without
    --tp-comm-overlap: with it, each of the layer's four linears runs its forward and its input gradient as Mosaic GPU
    calls (typed inside the step's shard_map that checks which values vary); the layer's four all-gathers and four
    reduce-scatters are gone (the embedding's collectives stay). With `matmuls` recomputation the kernels' outputs
    are kept, not recomputed (the policy saw the kernels as `custom_vmap_call`s: 11 calls a layer on 2 H200s)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from mtx.config import Config
    from mtx.parallel import make_mesh
    from mtx.presets import load_preset
    from mtx.step import TrainStep

    monkeypatch.setattr(cm, "machine_condition", lambda p: None)
    counts = {}
    for overlap in (False, True):
        cfg = Config().replace(**load_preset("configs/tiny.toml")).replace(
            num_layers=1, hidden_size=256, num_attention_heads=2, seq_length=256, max_position_embeddings=256,
            vocab_size=1000, micro_batch_size=2, global_batch_size=2, bf16=True, hidden_dropout=0.0,
            attention_dropout=0.0, data_parallel_size=1, tensor_model_parallel_size=2, sequence_parallel=True,
            tp_comm_overlap=overlap, recompute_granularity=recompute).validate(2)
        step = TrainStep.build(cfg, make_mesh(1, 1, 2, devices=jax.devices()[:2]))
        tokens = np.zeros((2, cfg.model.seq_length + 1), np.int32)
        lines = _lower_for_hopper(step._step, step.init_state(), step.model.put_batch(tokens)).splitlines()
        counts[overlap] = {op: sum(op in line for line in lines) for op in (
            "stablehlo.reduce_scatter", "stablehlo.all_gather", "stablehlo.all_reduce")}
        counts[overlap]["kernels"] = sum("stablehlo.custom_call" in line and "mosaic_gpu" in line for line in lines)
    plain, overlapped = counts[False], counts[True]
    assert plain["kernels"] == 0 and overlapped["kernels"] == 8
    assert overlapped["stablehlo.reduce_scatter"] == plain["stablehlo.reduce_scatter"] - 4
    assert overlapped["stablehlo.all_gather"] == plain["stablehlo.all_gather"] - 4
    assert overlapped["stablehlo.all_reduce"] == plain["stablehlo.all_reduce"]
