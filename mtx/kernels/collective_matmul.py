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
  stored into its memory at step s - 1 (the Hopper matmul's C operand) and stores the result into device d - 1's
  memory, then signals it; at the last step the chunk is d's own and the sum is its output. Partial sums travel in
  the output dtype, as NCCL's bf16 reduce-scatter sums in bf16.

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

from mtx.parallel.mesh import MODEL
from mtx.parallel.ops import cotangent_like, vary_like


# Which ring the layers run: "steps" (this module's kernels: each ring step a whole matmul, a grid-wide wait between
# steps) or "tiles" (mtx/kernels/ring_tiles.py: one loop over all steps' tiles, each waiting only for what it reads).
# The step ring was exact on 2 GPUs before it ran through the tile loop, the tile ring is; neither yet faster in the
# training step than NCCL (docs/benchmarks.md 3f, 3g).
RINGS = ("steps", "tiles")
RING = "steps"
# Checkpoint name of the kernels' outputs, which `--recompute-granularity matmuls` keeps (mtx/models/stack.py): a
# Mosaic GPU kernel is a `custom_vmap_call` to a remat policy, so without the name each layer recomputed three.
KERNEL_OUTPUT = "peer_memory_matmul"


def ring_kernel(kernel: str):
    """The kernel function of that name ("all_gather_matmul_kernel", "matmul_reduce_scatter_kernel") of the ring
    `RING` selects."""
    from mtx.kernels import ring_tiles

    if RING not in RINGS:
        raise ValueError(f"collective_matmul.RING is {RING!r}; set one of {', '.join(RINGS)}.")
    return getattr(ring_tiles, kernel) if RING == "tiles" else globals()[kernel]


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
    kernel, the rows it received, put in order), for a weight gradient that needs them."""
    config = config or default_config(w.shape[1])
    p = lax.axis_size(axis_name)
    if kernel_condition(x, w, p, config, rows_split=True) is not None:
        return xla_all_gather_matmul(x, w, axis_name, gathered=gathered)
    kernel = ring_kernel("all_gather_matmul_kernel")
    out, rows = (checkpoint_name(_typed_like(a, x, w), KERNEL_OUTPUT) for a in kernel(x, w, axis_name, config=config))
    if gathered and RING == "steps":  # the step ring returns the chunks it received; the tile ring all rows in order
        rows = rows_in_order(x, rows, lax.axis_index(axis_name), p)
    return (out, rows) if gathered else out


def rows_in_order(x, received, device, p: int):
    """The all-gather kernel's rows in the order of the P devices: this device's x (m, k) and the P - 1 chunks it
    received, received[s] (m, k) from device (device + s + 1) mod P -> (P m, k)."""
    chunks = jnp.concatenate([x[None], received[:p - 1]], axis=0)  # chunk j is device (device + j) mod P's
    return jnp.roll(chunks, device, axis=0).reshape(-1, x.shape[1])


def matmul_reduce_scatter(x, w, axis_name=MODEL, *, config=None):
    """Inside shard_map: x (m, k), this device's share of the contraction -> this device's rows of the sum over
    devices of x @ w, (m / P, n), through peer memory where the kernel can run, else XLA's matmul and
    reduce-scatter."""
    config = config or default_config(w.shape[1])
    if kernel_condition(x, w, lax.axis_size(axis_name), config, rows_split=False) is not None:
        return xla_matmul_reduce_scatter(x, w, axis_name)
    out = ring_kernel("matmul_reduce_scatter_kernel")(x, w, axis_name, config=config)
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


def matmul_reduce_scatter_kernel(x, w, axis_name, *, config, num_sms: int | None = None):
    """The ring kernel (module docstring); the caller has checked `kernel_condition`. num_sms: the GPU's streaming
    multiprocessors (one program each; default: the device's count)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu

    p = lax.axis_size(axis_name)
    m, _ = x.shape
    n = w.shape[1]
    shard = m // p
    num_sms = num_sms or jax.devices()[0].core_count
    compute_wgs = 2  # hopper_matmul_mgpu's compute warpgroups, each storing its own output tiles; the third loads

    def body(x_ref, w_ref, out_ref, scratch_ref):
        received = pl.get_global(plgpu.SemaphoreType.REGULAR)
        wg = lax.axis_index("wg")
        device = lax.axis_index(axis_name)
        # device d - 1 of the axis, addressed by its mesh coordinates (this device's on every other mesh axis)
        previous = {axis_name: lax.rem(device + p - 1, jnp.int32(p))}
        previous_scratch = plgpu.remote_ref(scratch_ref, previous)
        for s in range(p):
            chunk = lax.rem(device + s + 1, jnp.int32(p))
            if s > 0:  # every program of device d + 1 has stored its tiles of step s - 1's partial sum here
                pl.semaphore_wait(received, value=s * compute_wgs * num_sms, decrement=False)
            hopper_matmul_mgpu.kernel(x_ref.at[pl.ds(chunk * shard, shard)], w_ref,
                                      None if s == 0 else scratch_ref.at[s - 1],
                                      out_ref if s == p - 1 else previous_scratch.at[s], config=config)
            if s < p - 1:
                @pl.when(wg < compute_wgs)
                def _signal():  # this warpgroup's stores into device d - 1 have landed
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.semaphore_signal(received, device_id=previous)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out, _ = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((shard, n), x.dtype),
                  jax.ShapeDtypeStruct((max(p - 1, 1), shard, n), x.dtype)],  # the partial sums received
        grid=(num_sms,), grid_names=("cluster_grid",), num_threads=compute_wgs + 1, thread_name="wg",
        cluster=(1,), cluster_names=("cluster",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
    return out


def all_gather_matmul_kernel(x, w, axis_name, *, config, num_sms: int | None = None):
    """The all-gather ring (module docstring): at step s device d multiplies the rows of chunk (d + s) mod P (its own
    at step 0, then the chunk device d + 1 stored into its scratch at step s - 1) into those rows of its output,
    and while the matmul streams that chunk's tiles through shared memory, warpgroup 0 stores each (row, depth) tile
    once (with the first column of output tiles) into device d - 1's scratch, then signals it. -> [the product
    (P m, n), the P - 1 chunks received (`rows_in_order`)]. The caller has checked `kernel_condition`; num_sms as in
    `matmul_reduce_scatter_kernel`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from mtx.kernels.ring_tiles import tile_loop

    p = lax.axis_size(axis_name)
    shard, k = x.shape
    n = w.shape[1]
    num_sms = num_sms or jax.devices()[0].core_count
    cta_m = _cta_tile(config)[0]

    def body(x_ref, w_ref, out_ref, scratch_ref):
        received = pl.get_global(plgpu.SemaphoreType.REGULAR)
        sender = lax.axis_index("wg") == 0
        device = lax.axis_index(axis_name)
        previous = {axis_name: lax.rem(device + p - 1, jnp.int32(p))}  # mesh coordinates, as in the other kernel
        previous_scratch = plgpu.remote_ref(scratch_ref, previous)

        def step(s, chunk_ref):
            forward = sender & (s < p - 1)  # the last chunk goes nowhere: device d - 1 has computed it already

            def store_tile(_, m_idx, n_idx, k_idx, x_smem):
                @pl.when(forward & (n_idx == 0))
                def _store():
                    tile = (pl.ds(m_idx * cta_m, cta_m), pl.ds(k_idx * config.tile_k, config.tile_k))
                    plgpu.copy_smem_to_gmem(x_smem, previous_scratch.at[s].at[tile])
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the tile's buffer is released one step late

            rows = pl.ds(lax.rem(device + s, jnp.int32(p)) * shard, shard)
            # mtx's tile loop, not jax's Hopper matmul: with a tile released one depth step late, its loader waits
            # for the previous tile's mainloop before refilling that slot (ring_tiles.tile_loop)
            tile_loop(1, lambda _: chunk_ref, w_ref, lambda _: out_ref.at[rows], config, on_k=store_tile,
                      delay_release=1)

            @pl.when(forward)
            def _signal():  # this program's stores into device d - 1 have landed
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                pl.semaphore_signal(received, device_id=previous)

            @pl.when(s < p - 1)
            def _wait():  # every program of device d + 1 has stored chunk (d + s + 1) here
                pl.semaphore_wait(received, value=(s + 1) * num_sms, decrement=False)

        step(0, x_ref)

        @pl.loop(1, p)
        def _ring(s):
            step(s, scratch_ref.at[s - 1])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((p * shard, n), x.dtype),
                  jax.ShapeDtypeStruct((max(p - 1, 1), shard, k), x.dtype)],  # the chunks received
        grid=(num_sms,), grid_names=("cluster_grid",), num_threads=3, thread_name="wg",
        cluster=(1,), cluster_names=("cluster",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x, w)
