"""The peer-memory collective matmuls (mtx/kernels/collective_matmul.py): off a Hopper GPU they are XLA's collectives
and matmuls; their Mosaic GPU kernels lower for CUDA here (checked without a GPU), and run and are compared with XLA's
result by benchmarks/collective_matmul.py on GPUs."""

import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mtx.kernels import collective_matmul as cm
from mtx.parallel.mesh import MODEL

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


@pytest.mark.parametrize("pattern", ["ag", "rs"])
def test_the_kernels_lower_for_hopper(pattern):
    """Traced and lowered for CUDA on the CPU (a Mosaic GPU custom call in the module): catches a kernel written
    against another jax's Pallas API; whether it computes the right thing is the GPU benchmark's check."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    config = cm.default_config(1536)
    if pattern == "ag":
        fn = lambda x, w: collective_matmul_mgpu.all_gather_lhs_matmul(x, w, MODEL, config=config, dtype=x.dtype)
        shapes, specs = ((1024, 1536), (1536, 2 * 1536)), AG
    else:
        fn = lambda x, w: cm.matmul_reduce_scatter_kernel(x, w, MODEL, config=config, num_sms=132)
        shapes, specs = ((1024, 2 * 768), (2 * 768, 1536)), RS
    program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs[:2], out_specs=specs[2], check_vma=False))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    # The kernels ask the device for its SM count, and jax's for a mesh of every device (the tests simulate 8).
    with unittest.mock.patch.object(type(jax.devices()[0]), "core_count", 132, create=True), \
            unittest.mock.patch.object(jax, "device_count", lambda: 2), \
            unittest.mock.patch.object(jax, "local_device_count", lambda: 2):
        text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
