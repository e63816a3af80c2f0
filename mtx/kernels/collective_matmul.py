"""Matmuls that move their operands between the GPUs of the "model" axis through peer memory, beside the matmul:
sequence parallelism's two patterns without a NCCL call (Transformer Engine's userbuffers idea, in Mosaic GPU).

- `all_gather_matmul(x, w)`: all_gather(x over rows) @ w, the column-parallel linears' forward (QKV, MLP up) and the
  row-parallel linears' input gradient. On GPUs a ring of P steps in one kernel (the mechanism of jax's
  `collective_matmul_mgpu.all_gather_lhs_matmul`, whose single peer coordinate cannot address a device of a mesh
  with more axes than one): at step s device d multiplies row chunk (d + s) mod P, its own first, and while the
  matmul streams the chunk's tiles it stores them into device d - 1's memory for that device's next step.
- `matmul_reduce_scatter(x, w)`: psum_scatter(x @ w over rows), the row-parallel linears' forward (attention out,
  MLP down) and the column-parallel linears' input gradient. On GPUs the same mechanism reversed: a ring of P
  steps; at step s device d computes the rows of chunk (d + s + 1) mod P, adds the partial sum that device d + 1
  stored into its memory at step s - 1 (the matmul's C operand) and stores the result into device d - 1's memory;
  at the last step the chunk is d's own and the sum is its output. Partial sums travel in the output dtype, as
  NCCL's bf16 reduce-scatter sums in bf16.

Both kernels are mtx/kernels/ring_tiles.py's: one loop over every output tile of every ring step, each tile waiting
only for the rows or partial sum it reads. (A first ring ran each step as a whole Hopper matmul behind a grid-wide
wait; rebuilt on the same tile loop, it never completed a training step on two GPUs, so it was removed:
docs/benchmarks.md 3f-3h.)

`column_parallel_matmul` and `row_parallel_matmul` are a linear layer's matmul under sequence parallelism with its
backward written out: each pattern's input gradient is the other pattern (Megatron's conjugate pair), its weight
gradient a matmul with the rows the all-gather kernel received (kept by the column-parallel forward, as sequence
parallelism keeps its gathered input; taken from the input gradient's kernel by the row-parallel backward), so no
NCCL collective is left in either.

Both address their peer by its mesh coordinates (this device's on every other axis), so they run inside the
training step's (data, pipeline, model) shard_map, where `--tp-comm-overlap` makes the linear layers call
`column_parallel_matmul` / `row_parallel_matmul` (mtx/parallel/layers.py). Neither uses NVLink multicast (multimem).
Both need what `kernel_condition` checks: NVIDIA Hopper GPUs with Mosaic GPU, one process for all of them or one
each, the axis spanning every device, bf16 or f16 operands and tile-divisible sizes; otherwise (CPU, the simulated
devices of the tests) the XLA collectives run, and they define the result.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mtx.kernels import ring_tiles
from mtx.parallel.mesh import MODEL
from mtx.parallel.ops import cotangent_like, vary_like


# Checkpoint name of the kernels' outputs, which `--recompute-granularity matmuls` keeps (mtx/models/stack.py): a
# Mosaic GPU kernel is a `custom_vmap_call` to a remat policy, so without the name each layer recomputed three.
KERNEL_OUTPUT = "peer_memory_matmul"


def xla_all_gather_matmul(x, w, axis_name=MODEL, *, gathered: bool = False):
    rows = lax.all_gather(x, axis_name, axis=0, tiled=True)
    return (rows @ w, rows) if gathered else rows @ w


def xla_matmul_reduce_scatter(x, w, axis_name=MODEL):
    return lax.psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)


def default_config(n: int):
    """A Hopper tuning (`hopper_matmul_mgpu.TuningConfig`) for an output n columns wide: 128 x 128 tiles per
    warpgroup, the two warpgroups side by side along N when n allows it (benchmarks/collective_matmul.py tries
    others)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    wg = hm.MatmulDimension.N if n % 256 == 0 else hm.MatmulDimension.M
    return hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                           grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=4, wg_dimension=wg)


def machine_condition(p: int) -> str | None:
    """Why this machine cannot run the kernels over an axis of p devices, whatever the operands (None: it can)."""
    device = jax.devices()[0]
    if device.platform != "gpu" or not str(getattr(device, "compute_capability", "")).startswith("9."):
        return "needs NVIDIA Hopper GPUs (compute capability 9.x: wgmma)"
    try:
        importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    except ImportError as e:
        return f"this jax has no Mosaic GPU ({e})"
    if jax.device_count() not in (jax.process_count(), jax.local_device_count()):
        return "needs one process for all GPUs or one process per GPU"
    if p != jax.device_count():
        return f"the axis ({p} devices) must span all {jax.device_count()} devices"
    return None


def _cta_tile(config) -> tuple[int, int]:
    """Rows and columns of output one program computes at a time: a warpgroup's tile, doubled along the dimension
    the two compute warpgroups split."""
    return (config.tile_m * (2 if config.wg_dimension.name == "M" else 1),
            config.tile_n * (2 if config.wg_dimension.name == "N" else 1))


def kernel_condition(x, w, p: int, config, *, rows_split: bool) -> str | None:
    """Why the peer-memory kernel cannot run on these per-device operands over an axis of p devices (None: it can).
    rows_split: x's rows are this device's shard (the all-gather kernel) rather than all rows (the reduce-scatter
    kernel, whose output is this device's shard of them)."""
    if (reason := machine_condition(p)) is not None:
        return reason
    if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
        return f"needs bf16 or f16 operands of one dtype, got {x.dtype} and {w.dtype}"
    m, k = x.shape
    n = w.shape[1]
    cta_m, cta_n = _cta_tile(config)
    rows = m if rows_split else m // p
    if (not rows_split and m % p) or rows % cta_m or n % cta_n or k % config.tile_k:
        return f"rows {rows}, columns {n}, depth {k} do not divide the tiles ({cta_m}, {cta_n}, {config.tile_k})"
    if rows_split and k < 2 * config.tile_k:  # its stores read a tile released one depth step late
        return f"depth {k}: the all-gather kernel needs at least two depth steps of {config.tile_k}"
    return None


def all_gather_matmul(x, w, axis_name=MODEL, *, config=None, gathered: bool = False):
    """Inside shard_map: this device's rows x (m, k) -> all_gather(x) @ w, (P m, n), through peer memory where the
    kernel can run, else XLA's all-gather and matmul. gathered: also return all_gather(x), (P m, k) (from the
    kernel, the rows in the devices' order), for a weight gradient that needs them."""
    config = config or default_config(w.shape[1])
    p = lax.axis_size(axis_name)
    if kernel_condition(x, w, p, config, rows_split=True) is not None:
        return xla_all_gather_matmul(x, w, axis_name, gathered=gathered)
    kernel = ring_tiles.all_gather_matmul_kernel
    out, rows = (checkpoint_name(_typed_like(a, x, w), KERNEL_OUTPUT) for a in kernel(x, w, axis_name, config=config))
    return (out, rows) if gathered else out


def matmul_reduce_scatter(x, w, axis_name=MODEL, *, config=None):
    """Inside shard_map: x (m, k), this device's share of the contraction -> this device's rows of the sum over
    devices of x @ w, (m / P, n), through peer memory where the kernel can run, else XLA's matmul and
    reduce-scatter."""
    config = config or default_config(w.shape[1])
    if kernel_condition(x, w, lax.axis_size(axis_name), config, rows_split=False) is not None:
        return xla_matmul_reduce_scatter(x, w, axis_name)
    out = ring_tiles.matmul_reduce_scatter_kernel(x, w, axis_name, config=config)
    return checkpoint_name(_typed_like(out, x, w), KERNEL_OUTPUT)


def _typed_like(out, x, w):
    """A kernel's output typed as varying over the axes its operands vary over (a Pallas call's outputs carry no
    such type inside shard_map; the cast is a type, no data moves)."""
    return vary_like(out, (x, w), exclude=())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def column_parallel_matmul(x, w, axis_name=MODEL):
    """Sequence parallelism's column-parallel matmul: this device's rows x (m, k) and its columns w (k, n) -> every
    row's product with them, (P m, n): `all_gather_matmul` forward; backward the input gradient by
    `matmul_reduce_scatter` (dy @ w^T, each device's rows of it summed over devices) and the weight gradient from the
    gathered rows, kept from the forward's kernel. Each gradient is typed as its input (`cotangent_like`: summed over
    the axes it varies over and the input does not)."""
    return all_gather_matmul(x, w, axis_name)


def _column_forward(x, w, axis_name):
    out, rows = all_gather_matmul(x, w, axis_name, gathered=True)
    return out, (rows, w, x[:0])


def _column_backward(axis_name, residuals, dy):
    # all rows (the kernel's are typed by x and w together), and x's type: an empty slice of it, no bytes kept
    rows, w, x_type = residuals
    dx = matmul_reduce_scatter(dy, w.T.astype(dy.dtype), axis_name)
    return cotangent_like(dx.astype(x_type.dtype), x_type), cotangent_like((rows.T @ dy).astype(w.dtype), w)


column_parallel_matmul.defvjp(_column_forward, _column_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_parallel_matmul(x, w, axis_name=MODEL):
    """Sequence parallelism's row-parallel matmul: x (m, k), this device's share of the contraction, and its rows of
    the weight w (k, n) -> this device's rows of the sum over devices of x @ w, (m / P, n): `matmul_reduce_scatter`
    forward; backward the input gradient by `all_gather_matmul` (the gathered dy @ w^T) and the weight gradient from
    the gathered dy; each gradient typed as its input."""
    return matmul_reduce_scatter(x, w, axis_name)


def _row_forward(x, w, axis_name):
    return matmul_reduce_scatter(x, w, axis_name), (x, w)


def _row_backward(axis_name, residuals, dy):
    x, w = residuals
    dx, dy_rows = all_gather_matmul(dy, w.T.astype(dy.dtype), axis_name, gathered=True)
    return cotangent_like(dx.astype(x.dtype), x), cotangent_like((x.T @ dy_rows).astype(w.dtype), w)


row_parallel_matmul.defvjp(_row_forward, _row_backward)
