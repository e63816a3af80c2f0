"""Bus bandwidth of the tensor-parallel collectives, as mtx issues them: over the "model" axis of a (1, 1, n) mesh
inside `jax.shard_map`, on bf16 activations of the shapes a layer sees (nccl-tests' busbw convention).

    python benchmarks/collectives.py                           # 8 simulated CPU devices, small sizes (CI)
    NCCL_PROTO=Simple python benchmarks/collectives.py --sizes-mb 25 50 100 --out simple.jsonl   # on GPUs

One JSON line per (collective, size): the whole tensor's size, the median time of one call over `--iters` calls queued
back to back, the algorithm bandwidth (size / time) and the bus bandwidth (algbw x (n - 1) / n for all-gather and
reduce-scatter, x 2 (n - 1) / n for all-reduce, x 1 for a ring `ppermute` of one shard), i.e. what each GPU link
carries. `all_gather_p2p` / `reduce_scatter_p2p` are the same collectives built from ring `ppermute` steps, rows in
rank order, as `--tp-comm-p2p` does them (mtx/parallel/collective_matmul.py); XLA runs the steps as copy-engine peer
copies with XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true. Environment variables (NCCL_*) and XLA_FLAGS apply as
set, so one setting per process. Forward only: a backward moves the same bytes the other way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "ppermute", "all_gather_p2p", "reduce_scatter_p2p")


def bus_factor(collective: str, n: int) -> float:
    return 1.0 if collective == "ppermute" else 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def collective_fn(collective: str, mesh):
    """`collective` over "model" as mtx's layers issue it, jitted, and whether its (rows, width) input is split by
    rows: split for the gathers and ppermute (sequence parallelism's residual stream), whole on each rank for the
    scatters and the all-reduce (the partial sums out of a row-parallel linear)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from mtx.parallel.collective_matmul import all_gather_by_ring, reduce_scatter_by_ring
    from mtx.parallel.mesh import MODEL

    n = mesh.shape[MODEL]
    body = {
        "all_gather": lambda x: jax.lax.all_gather(x, MODEL, axis=0, tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, MODEL, scatter_dimension=0, tiled=True),
        "all_reduce": lambda x: jax.lax.psum(x, MODEL),
        "ppermute": lambda x: jax.lax.ppermute(x, MODEL, [(i, (i + 1) % n) for i in range(n)]),
        "all_gather_p2p": all_gather_by_ring,
        "reduce_scatter_p2p": reduce_scatter_by_ring,
    }[collective]
    split = collective in ("all_gather", "ppermute", "all_gather_p2p")
    in_spec = P(MODEL) if split else P()
    out_spec = P(MODEL)  # every rank's result stays where it is: stacking them moves nothing
    if not split:
        # Each rank holds its own partial sums: mark the replicated input as varying over "model" first.
        inner = body
        body = lambda x: inner(jax.lax.pcast(x, MODEL, to="varying"))  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=True)), split


def measure(collective: str, size_bytes: int, mesh, *, width: int = 1536, iters: int = 50, repeats: int = 5) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    n = mesh.shape[MODEL]
    rows = max(n, size_bytes // (2 * width) // n * n)
    fn, split = collective_fn(collective, mesh)
    x = jax.device_put(jnp.ones((rows, width), jnp.bfloat16), NamedSharding(mesh, P(MODEL) if split else P()))
    jax.block_until_ready(fn(x))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(x) for _ in range(iters)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / iters)
    t = statistics.median(times)
    nbytes = rows * width * 2 // (n if collective == "ppermute" else 1)  # a ring step moves one shard
    algbw = nbytes / t / 1e9
    return {"collective": collective, "devices": n, "bytes": nbytes, "time_us": round(t * 1e6, 1),
            "algbw_GBps": round(algbw, 1), "busbw_GBps": round(algbw * bus_factor(collective, n), 1),
            "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None, help="size of the model axis (default: all devices)")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 4],
                   help="whole-tensor sizes in MB (1e6 bytes); 1.2B at micro batch 16 moves 50 MB per collective")
    p.add_argument("--width", type=int, default=1536, help="row width (the hidden size)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)

    import jax

    from mtx.parallel.mesh import make_mesh

    n = args.devices or jax.device_count()
    if n < 2 or n > jax.device_count():
        p.error(f"--devices {n}: need 2 to {jax.device_count()} devices (pass --devices within that range)")
    mesh = make_mesh(1, 1, n, devices=jax.devices()[:n])
    results = []
    for collective in args.collectives:
        for mb in args.sizes_mb:
            r = measure(collective, int(mb * 1e6), mesh, width=args.width, iters=args.iters, repeats=args.repeats)
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
    return results


if __name__ == "__main__":
    main()
