"""The peer-memory ring kernels of mtx/kernels/collective_matmul.py: one loop over every output tile of every ring
step, synchronized tile by tile.

A ring that runs each step as a whole Hopper matmul starts step s only once every program of the sending device
has signalled the end of its step s - 1: a grid-wide barrier between steps, so each step pays its last wave's tail
(at TP 2 of the 1.2B model, 4.4 waves of output tiles a step become 5) and nothing of step s starts while the last
tiles of step s - 1 are still being sent. Here each program walks the tiles of all P steps in one loop (step 0's
tiles first), and a tile of step s >= 1 waits only for what it reads:

- all-gather then matmul: the tile (m, n) of step s reads the rows m of the chunk the next device stored at its step
  s - 1; that device's program that computed the tile (m, 0) stored those rows (while its pipeline streamed them)
  and then signalled the semaphore of (s - 1, m) here.
- matmul then reduce-scatter: the tile (m, n) of step s adds the partial sum the next device stored for the same
  tile at its step s - 1; each of that device's compute warpgroups signals the semaphore of (s - 1, m, n, its half)
  once its half has landed here (checked while it computes its next tile), and the warpgroup of this device that
  adds that half waits for it before its epilogue reads it.

No program waits at step 0, and every program finishes its step-s tiles before its step-s + 1 ones, so the waits
cannot form a cycle (all programs are resident: one per SM). The tile loop is mtx's own, written on Pallas Mosaic
GPU's warp-specialized pipeline (the structure of jax's Hopper matmul: two compute warpgroups, one loading).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

COMPUTE_WGS = 2  # compute warpgroups, each owning half of a program's output tile; a third loads


def tile_loop(steps: int, a_of, b_ref, out_of, config, *, c_of=None, on_k=None, before_tile=None,
              before_epilogue=None, after_tile=None, landed=None, delay_release: int = 0):
    """Inside a `plgpu.kernel` of grid (programs,) named "cluster_grid", 3 warpgroups named "wg": for every ring step
    s < steps and output tile (m, n), out_of(s)[tile] = a_of(s)[rows m] @ b_ref[:, columns n] (+ c_of(s)[tile] when
    c_of(s) is not None). A program walks the tiles index = program, program + programs, ... (step-major).

    a_of, c_of, out_of map a static step to a ref. Hooks take (s, m, n): before_tile and after_tile run on every
    warpgroup; on the compute warpgroups before_epilogue (before C is read), on_k(s, m, n, k, a_smem) (after a depth
    step's wgmma is issued, with the A tile in shared memory, released `delay_release` steps late) and landed (once
    the warpgroup's stores of that tile's output have landed: checked at the start of its next tile's epilogue, or
    after its last tile, so the store's flight overlaps the next mainloop; s is traced there).

    With delay_release the pipeline leaves a tile's last A slot unguarded (the next tile's loads may refill it while
    a late wgmma or an on_k store still reads it), so the loading warpgroup waits before each tile until both compute
    warpgroups have finished the previous tile's mainloop and its stores have read shared memory."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    a0 = a_of(0)
    (rows, depth), cols = a0.shape, b_ref.shape[1]
    dtype, out_dtype = a0.dtype, out_of(steps - 1).dtype
    wide_m = config.wg_dimension.name == "M"
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    cta_m, cta_n = tm * (2 if wide_m else 1), tn * (1 if wide_m else 2)
    m_tiles, n_tiles, k_steps = rows // cta_m, cols // cta_n, depth // tk
    per_step, epi_m, epi_n = m_tiles * n_tiles, config.epi_tile_m or tm, config.epi_tile_n or tn
    slots = min(2, (tm * tn) // (epi_m * epi_n))

    def locate(index):
        m, n = plgpu.planar_snake(lax.rem(index, per_step), (m_tiles, n_tiles), config.grid_minor_dim,
                                  config.grid_tile_width)
        return lax.div(index, per_step), m, n

    def swizzled(width, item_dtype):
        swizzle = plgpu.find_swizzle(width * jnp.dtype(item_dtype).itemsize * 8)
        return (plgpu.TilingTransform((8, swizzle // jnp.dtype(item_dtype).itemsize)), plgpu.SwizzleTransform(swizzle))

    def pipeline(body, context):
        spec = functools.partial(plgpu.BlockSpec, transforms=swizzled(tk, dtype), memory_space=plgpu.SMEM,
                                 delay_release=delay_release)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40,
            in_specs=[spec((cta_m, tk), lambda k: (0, k)), spec((tk, cta_n), lambda k: (k, 0))],
            wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=config.max_concurrent_steps,
            compute_context=context)

    ignore = lambda *_, **__: None
    any_c = c_of is not None and any(c_of(s) is not None for s in range(steps))

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a0, b_ref),
        out_smem=plgpu.SMEM((COMPUTE_WGS, slots, epi_m, epi_n), out_dtype, transforms=swizzled(epi_n, out_dtype)),
        c_barrier=plgpu.Barrier(num_barriers=COMPUTE_WGS * slots) if any_c else None,
        mainloop_done=plgpu.Barrier(num_arrivals=COMPUTE_WGS) if delay_release else None,
        collective_axes="wg")
    def _scope(allocations, out_smem, c_barrier, mainloop_done):
        wg = lax.axis_index("wg")
        computing = wg < COMPUTE_WGS
        program, programs = lax.axis_index("cluster_grid"), lax.axis_size("cluster_grid")
        wg_rows = pl.ds(wg * tm, tm) if wide_m else slice(None)
        wg_cols = slice(None) if wide_m else pl.ds(wg * tn, tn)
        if mainloop_done is not None:  # as if a tile before the first had finished
            pl.when(computing)(lambda: plgpu.barrier_arrive(mainloop_done))

        def tile(s, m, n, index):
            a_ref, c_ref, out_ref = a_of(s), None if c_of is None else c_of(s), out_of(s)
            here = (pl.ds(m * cta_m, cta_m), pl.ds(n * cta_n, cta_n))
            if before_tile is not None:
                before_tile(s, m, n)
            if mainloop_done is not None:
                pl.when(wg == COMPUTE_WGS)(lambda: plgpu.barrier_wait(mainloop_done))

            def context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                def _accumulate(acc):
                    run(acc)
                    value = acc[...].astype(out_dtype)  # every wgmma of the tile has completed
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store has read shared memory
                    if mainloop_done is not None:
                        plgpu.barrier_arrive(mainloop_done)
                    if landed is not None:
                        @pl.when(index >= programs)
                        def _previous_landed():
                            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                            landed(*locate(index - programs))
                    if c_ref is not None and before_epilogue is not None:
                        before_epilogue(s, m, n)
                    for i in range(tm // epi_m):
                        for j in range(tn // epi_n):
                            part = (slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n))
                            slot = (i * (tn // epi_n) + j) % 2
                            place = lambda ref: ref.at[here].at[wg_rows, wg_cols].at[part]
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            if c_ref is None:
                                out_smem[wg, slot] = value[part]
                            else:
                                barrier = c_barrier.at[wg * slots + slot]
                                plgpu.copy_gmem_to_smem(place(c_ref), out_smem.at[wg, slot], barrier)
                                plgpu.barrier_wait(barrier)
                                out_smem[wg, slot] += value[part]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], place(out_ref))

            def multiply(indices, a_smem, b_smem, acc):
                plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
                if on_k is not None:
                    on_k(s, m, n, indices[0], a_smem)
                plgpu.wgmma_wait(delay_release)
                return acc

            pipeline(multiply, context)(a_ref.at[here[0], :], b_ref.at[:, here[1]], allocations=allocations)
            if after_tile is not None:
                after_tile(s, m, n)

        total = steps * per_step

        @plgpu.nd_loop((total,), collective_axes="cluster_grid")
        def _tiles(info):
            (index,) = info.index
            step, m, n = locate(index)
            for s in range(steps):  # each step's refs are static: one copy of the tile's code a step
                pl.when(step == s)(functools.partial(tile, s, m, n, index))

        if landed is not None:
            @pl.when(computing & (program < total))
            def _last_landed():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                landed(*locate(program + programs * lax.div(total - 1 - program, programs)))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(body, out_type, num_sms):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(body, out_type=out_type, grid=(num_sms,), grid_names=("cluster_grid",),
                        num_threads=COMPUTE_WGS + 1, thread_name="wg", cluster=(1,), cluster_names=("cluster",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def all_gather_matmul_kernel(x, w, axis_name, *, config, num_sms: int | None = None):
    """all_gather(x over rows) @ w as one tile loop over the P steps (module docstring): step s multiplies row chunk
    (d + s) mod P, its own at step 0, then the chunk device d + 1 stored into this device's copy of the gathered
    rows, row block by row block as each arrives. -> [the product (P m, n), all_gather(x) (P m, k)]: the rows in
    the devices' order, as NCCL's all-gather gives them (this device's own chunk stored there by warpgroup 1 at step
    0, the others by the devices that sent them), for the weight gradients that need them."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p = lax.axis_size(axis_name)
    shard, k = x.shape
    n = w.shape[1]
    cta_m = config.tile_m * (2 if config.wg_dimension.name == "M" else 1)
    arrived = plgpu.SemaphoreType.REGULAR((max(p - 1, 1), shard // cta_m))

    def body(x_ref, w_ref, out_ref, rows_ref):
        rows_here = pl.get_global(arrived)
        device = lax.axis_index(axis_name)
        previous = {axis_name: lax.rem(device + p - 1, jnp.int32(p))}
        to_previous = plgpu.remote_ref(rows_ref, previous)
        wg = lax.axis_index("wg")
        chunk = lambda ref, s: ref.at[pl.ds(lax.rem(device + s, jnp.int32(p)) * shard, shard)]  # same on every device

        def wait_rows(s, m, n):
            if s > 0:
                pl.semaphore_wait(rows_here.at[s - 1, m], value=1, decrement=False)

        def keep_and_send(s, m, n, k_idx, a_smem):
            tile = (pl.ds(m * cta_m, cta_m), pl.ds(k_idx * config.tile_k, config.tile_k))
            stores = [(1, chunk(rows_ref, s))] if s == 0 else []  # this device's own rows, kept
            if s < p - 1:  # the last chunk goes nowhere: device d - 1 computed it first
                stores.append((0, chunk(to_previous, s)))
            for who, target in stores:
                @pl.when((wg == who) & (n == 0))
                def _store():
                    plgpu.copy_smem_to_gmem(a_smem, target.at[tile])
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the tile is released one depth step late

        def signal_rows(s, m, n):
            if s < p - 1:
                @pl.when((wg == 0) & (n == 0))
                def _signal():  # rows m of this step's chunk have landed in device d - 1
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.semaphore_signal(rows_here.at[s, m], device_id=previous)

        tile_loop(p, lambda s: x_ref if s == 0 else chunk(rows_ref, s), w_ref, lambda s: chunk(out_ref, s), config,
                  on_k=keep_and_send, before_tile=wait_rows, after_tile=signal_rows, delay_release=1)

    return _kernel(body, [jax.ShapeDtypeStruct((p * shard, n), x.dtype), jax.ShapeDtypeStruct((p * shard, k), x.dtype)],
                   num_sms or jax.devices()[0].core_count)(x, w)


def matmul_reduce_scatter_kernel(x, w, axis_name, *, config, num_sms: int | None = None):
    """psum_scatter(x @ w over rows) as one tile loop over the P steps (module docstring): step s computes chunk
    (d + s + 1) mod P, each tile adding the partial sum device d + 1 stored for it (once both its halves have
    landed) and storing the sum into device d - 1, or, at the last step, into this device's output."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p = lax.axis_size(axis_name)
    m, _ = x.shape
    n = w.shape[1]
    shard = m // p
    cta_m, cta_n = (config.tile_m * (2 if config.wg_dimension.name == "M" else 1),
                    config.tile_n * (1 if config.wg_dimension.name == "M" else 2))
    arrived = plgpu.SemaphoreType.REGULAR((max(p - 1, 1), shard // cta_m, n // cta_n, COMPUTE_WGS))

    def body(x_ref, w_ref, out_ref, partial_ref):
        halves_here = pl.get_global(arrived)  # (step, m, n, warpgroup): one half of a tile's partial sum
        device = lax.axis_index(axis_name)
        previous = {axis_name: lax.rem(device + p - 1, jnp.int32(p))}
        to_previous = plgpu.remote_ref(partial_ref, previous)
        wg = lax.axis_index("wg")
        chunk_of = lambda s: x_ref.at[pl.ds(lax.rem(device + s + 1, jnp.int32(p)) * shard, shard)]

        def wait_partial(s, m_idx, n_idx):  # each compute warpgroup, before its epilogue reads its half of C
            pl.semaphore_wait(halves_here.at[s - 1, m_idx, n_idx, wg], value=1, decrement=False)

        def signal_partial(s, m_idx, n_idx):  # this warpgroup's half of the tile has landed in device d - 1
            pl.when(s < p - 1)(lambda: pl.semaphore_signal(halves_here.at[s, m_idx, n_idx, wg], device_id=previous))

        tile_loop(p, chunk_of, w_ref, lambda s: out_ref if s == p - 1 else to_previous.at[s], config,
                  c_of=lambda s: None if s == 0 else partial_ref.at[s - 1], before_epilogue=wait_partial,
                  landed=signal_partial)

    out, _ = _kernel(body, [jax.ShapeDtypeStruct((shard, n), x.dtype),
                            jax.ShapeDtypeStruct((max(p - 1, 1), shard, n), x.dtype)],
                     num_sms or jax.devices()[0].core_count)(x, w)
    return out
