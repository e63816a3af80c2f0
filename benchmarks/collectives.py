"""Bus bandwidth of the tensor-parallel collectives, as mtx issues them: over the "model" axis of a (1, 1, n) mesh
inside `jax.shard_map`, on bf16 activations of the shapes a layer sees (nccl-tests' busbw convention).

    python benchmarks/collectives.py                           # 8 simulated CPU devices, small sizes (CI)
    NCCL_PROTO=Simple python benchmarks/collectives.py --sizes-mb 25 50 100 --out simple.jsonl   # on GPUs

One JSON line per (collective, size): the whole tensor's size, the time of one collective, the algorithm bandwidth
(size / time) and the bus bandwidth (algbw x (n - 1) / n for all-gather and reduce-scatter, x 2 (n - 1) / n for
all-reduce, x 1 for a ring `ppermute` of one shard), i.e. what each GPU link carries. The time is the median over
`--repeats` runs of one compiled program of `--iters` collectives, each waiting for the one before (as a layer's
collectives wait on the kernels before them), divided by `--iters`. One dispatch per run keeps the host's per-call
launch cost out; each call's time includes the one-element update that ties it to the call before and whatever
synchronization XLA places between that kernel and the collective (which a layer pays too). Environment variables
(NCCL_*) and XLA_FLAGS apply as set, so one setting per process. Forward only: a backward moves the same bytes the
other way.

`peer_all_gather` and `peer_reduce_scatter` are the same exchanges through mtx's peer-memory kernels
(mtx/kernels/collective_matmul.py, `--tp-comm-overlap`; Hopper GPUs, the axis spanning every device), with the
thinnest matmul they can carry: the gather multiplies the gathered rows by a (width, 128)
matrix, the scatter sums (rows, 64) @ (64, width) products, so the time is the exchange plus a matmul of 1/12 (1/24)
of a layer's at width 1,536. Their small sizes give the fixed cost of a call beside NCCL's (chained calls, which on
two H200s cost more than the kernels do inside the training step: docs/benchmarks.md 3h). Elsewhere their line says
why they cannot run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.devices import simulate_cpu_devices  # noqa: E402
from mtx.files import json_line  # noqa: E402

simulate_cpu_devices(8)

from mtx.cli import COUNT, OneLineParser, ranged  # noqa: E402

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "ppermute", "peer_all_gather", "peer_reduce_scatter")
PEER_WIDTH = {"peer_all_gather": 128, "peer_reduce_scatter": 64}  # the thin matmul's other dimension


def bus_factor(collective: str, n: int) -> float:
    return 1.0 if collective == "ppermute" else 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def peer_fn(collective: str, mesh, iters: int, width: int):
    """`iters` x a peer-memory kernel over "model" (module docstring), chained as `collective_fn`'s: the gather's
    input split by rows, (rows, width) in all; the scatter's (rows, 64) whole on each rank, its output (rows / n,
    width) this rank's rows of the sum."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from mtx.kernels import collective_matmul as cm
    from mtx.kernels import ring_tiles
    from mtx.parallel.mesh import MODEL

    thin = PEER_WIDTH[collective]
    gather = collective == "peer_all_gather"
    w = jnp.ones((width, thin) if gather else (thin, width), jnp.bfloat16) / thin
    config = cm.default_config(w.shape[1])
    if gather:
        once = lambda x: ring_tiles.all_gather_matmul_kernel(x, w, MODEL, config=config)[0]
    else:
        once = lambda x: ring_tiles.matmul_reduce_scatter_kernel(x, w, MODEL, config=config)

    def body(x):
        out = once(x)
        for _ in range(iters - 1):
            x = jax.lax.dynamic_update_slice(x, out[:1, :1].astype(x.dtype), (0, 0))
            out = once(x)
        return out

    in_spec = P(MODEL) if gather else P(None, MODEL)  # the scatter: each rank its own 64 columns of the depth
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=P(MODEL), check_vma=False))


def collective_fn(collective: str, mesh, iters: int = 1):
    """`iters` x `collective` over "model" as mtx's layers issue it, one after another in one jitted program, and
    whether its (rows, width) input is split by rows: split for the gather and ppermute (sequence parallelism's
    residual stream), whole on each rank for the scatter and the all-reduce (the partial sums out of a row-parallel
    linear). Each call's input is the previous input with one element replaced from the previous output, so no call
    can be merged with another or start before the one before it has finished."""
    import jax
    from jax.sharding import PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    n = mesh.shape[MODEL]
    once = {
        "all_gather": lambda x: jax.lax.all_gather(x, MODEL, axis=0, tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, MODEL, scatter_dimension=0, tiled=True),
        "all_reduce": lambda x: jax.lax.psum(x, MODEL),
        "ppermute": lambda x: jax.lax.ppermute(x, MODEL, [(i, (i + 1) % n) for i in range(n)]),
    }[collective]
    split = collective in ("all_gather", "ppermute")

    def body(x):
        if not split:  # each rank holds its own partial sums: the replicated input becomes varying over "model"
            x = jax.lax.pcast(x, MODEL, to="varying")
        out = once(x)
        for _ in range(iters - 1):
            x = jax.lax.dynamic_update_slice(x, out[:1, :1], (0, 0))
            out = once(x)
        return out

    in_spec = P(MODEL) if split else P()
    out_spec = P(MODEL)  # every rank's result stays where it is: stacking them moves nothing
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=True)), split


def time_per_call(fn, args, *, iters: int, repeats: int) -> float:
    """Seconds per call of a program of `iters` chained calls: compiled and warmed up, then the median of `repeats`
    runs, each divided by `iters`."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def emit(records, out: str | None) -> list[dict]:
    """Appends each record to `out` when given, then prints it as a JSON line, as it comes (on disk first: a reader
    of the output that goes away loses none); -> the records."""
    results = []
    for r in records:
        if out:
            with open(out, "a") as fh:
                fh.write(json_line(r) + "\n")
        print(json_line(r), flush=True)
        results.append(r)
    return results


def measure(collective: str, size_bytes: int, mesh, *, width: int = 1536, iters: int = 50,
            repeats: int = 5) -> list[dict]:
    """One collective at one size -> its JSON record (in a list), for a peer-memory row one saying why the kernels
    cannot run where they cannot."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    n = mesh.shape[MODEL]
    peer = collective in PEER_WIDTH
    unit = n * 256 if peer else n  # the kernels' rows a rank: whole tiles of 256 (or of 128)
    rows = max(unit, size_bytes // (2 * width) // unit * unit)
    nbytes = rows * width * 2 // (n if collective == "ppermute" else 1)  # a ring ppermute moves one shard
    record = {"collective": collective, "devices": n, "bytes": nbytes,
              "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "platform": jax.devices()[0].platform,
              "device_kind": jax.devices()[0].device_kind}

    def timed(fn, x):
        t = time_per_call(fn, (x,), iters=iters, repeats=repeats)
        algbw = record["bytes"] / t / 1e9
        return {**record, "time_us": round(t * 1e6, 1), "algbw_GBps": round(algbw, 1),
                "busbw_GBps": round(algbw * bus_factor(collective.removeprefix("peer_"), n), 1)}

    if not peer:
        fn, split = collective_fn(collective, mesh, iters)
        return [timed(fn, jax.device_put(jnp.ones((rows, width), jnp.bfloat16),
                                         NamedSharding(mesh, P(MODEL) if split else P())))]
    from mtx.kernels import collective_matmul as cm

    gather, thin = collective == "peer_all_gather", PEER_WIDTH[collective]
    local = jax.ShapeDtypeStruct((rows // n, width) if gather else (rows, thin), jnp.bfloat16)
    w_local = jax.ShapeDtypeStruct((width, thin) if gather else (thin, width), jnp.bfloat16)
    if reason := cm.kernel_condition(local, w_local, n, cm.default_config(w_local.shape[1]), rows_split=gather):
        return [{**record, "error": reason}]
    x = jax.device_put(jnp.ones((rows, width) if gather else (rows, thin * n), jnp.bfloat16),
                       NamedSharding(mesh, P(MODEL) if gather else P(None, MODEL)))
    return [timed(peer_fn(collective, mesh, iters, width), x)]


def main(argv=None) -> list[dict]:
    p = OneLineParser(prog="collectives.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=ranged(int, ">= 2"), default=None,
                   help="size of the model axis (default: all devices)")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--sizes-mb", nargs="+", type=ranged(float, "(0, 100000]"), default=[1, 4],
                   help="whole-tensor sizes in MB (1e6 bytes); 1.2B at micro batch 16 moves 50 MB per collective")
    p.add_argument("--width", type=ranged(int, "[1, 1000000]"), default=1536, help="row width (the hidden size)")
    p.add_argument("--iters", type=ranged(int, COUNT), default=50)
    p.add_argument("--repeats", type=ranged(int, COUNT), default=5)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    from mtx.files import check_json_lines, refuse_empty

    try:
        refuse_empty(args.out, "--out", "a file to append the results to, or drop --out")
        if args.out:
            check_json_lines(args.out, "--out", ("collective",))
    except ValueError as e:
        p.error(str(e))

    import jax

    from mtx.parallel.mesh import make_mesh

    n = args.devices or jax.device_count()
    if n < 2 or n > jax.device_count():
        p.error(f"--devices {n}: need 2 to {jax.device_count()} devices (pass --devices within that range)")
    mesh = make_mesh(1, 1, n, devices=jax.devices()[:n])
    return emit((line for collective in args.collectives for mb in args.sizes_mb
                 for line in measure(collective, int(mb * 1e6), mesh, width=args.width, iters=args.iters,
                                     repeats=args.repeats)), args.out)


def cli(argv=None) -> int:
    """main as a command: exit status 1 when nothing was measured (each line says why its collective cannot run)."""
    if not any("time_us" in r for r in main(argv)):
        print("error: no collective was measured; each line says why.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(cli)
