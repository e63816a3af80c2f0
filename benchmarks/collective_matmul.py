"""All-gather then matmul, the pattern of sequence parallelism's column-parallel linears (QKV, MLP up) and of the
row-parallel linears' input gradients: XLA's all-gather (NCCL) followed by its matmul (cuBLAS), against jax's Mosaic GPU
collective matmul (`jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul`: each device's rows
passed around the ring by stores into the next device's memory over NVLink, beside the matmul; no multicast), over a
"model" axis that spans every device (the kernel's condition).

    python benchmarks/collective_matmul.py                                       # simulated CPU devices: XLA only
    python benchmarks/collective_matmul.py --tokens 16384 1024 --out cm.jsonl    # on 2 GPUs: both

Shapes (`--shapes`), per rank at TP 2 of the 1.2B model (hidden 1536; micro batch 16 x seq 1024 = 16384 tokens):
K x N of the matmul after the gather, K = 1536 (the gathered activations, or the gathered output gradient), N = the
rank's columns: QKV 2304, MLP up 3072, attention out's input gradient 768, MLP down's 3072. A small `--tokens` gives
the fixed cost of a call.

One JSON line per (shape, tokens, implementation): the time of one call (the median over `--repeats` runs of one
program of `--iters` calls, each call's input tied to the previous output so none overlaps another), the matmul's
TFLOP/s per device, the gathered tensor's size over the time (algbw, as if the call were all transfer), and for the
kernel its largest deviation from XLA's result relative to that result's largest value, and the tuning config that
ran fastest of a few (those that do not fit in shared memory are skipped). Where the kernel cannot run (no GPU, a
jax without Mosaic GPU) its line says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(2)

SHAPES = {"qkv": (1536, 2304), "mlp_up": (1536, 3072), "attn_out_dgrad": (1536, 768), "mlp_down_dgrad": (1536, 3072)}


def chained(once, iters: int):
    """`iters` calls of once(x, w), each x tied to the previous output by one element."""
    import jax

    def body(x, w):
        out = once(x, w)
        for _ in range(iters - 1):
            x = jax.lax.dynamic_update_slice(x, out[:1, :1].astype(x.dtype), (0, 0))
            out = once(x, w)
        return out

    return body


def xla_once(x, w):
    import jax

    from mtx.parallel.mesh import MODEL

    return jax.lax.all_gather(x, MODEL, axis=0, tiled=True) @ w


def mosaic_configs():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dims = hm.MatmulDimension
    return [hm.TuningConfig(tile_m=tm, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_minor_dim=dims.N,
                            grid_tile_width=width, wg_dimension=wg)
            for tm in (128, 256) for width in (4, 8) for wg in dims]


def mosaic_once(config):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

    from mtx.parallel.mesh import MODEL

    return lambda x, w: cm.all_gather_lhs_matmul(x, w, MODEL, config=config, dtype=jnp.bfloat16)


def program(once, mesh, iters: int):
    import jax
    from jax.sharding import PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    return jax.jit(jax.shard_map(chained(once, iters), mesh=mesh, in_specs=(P(MODEL), P(None, MODEL)),
                                 out_specs=P(None, MODEL), check_vma=False))


def timed(once, mesh, x, w, *, iters: int, repeats: int) -> float:
    import jax

    fn = program(once, mesh, iters)
    jax.block_until_ready(fn(x, w))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, w))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def measure(shape: str, tokens: int, mesh, *, iters: int, repeats: int) -> list[dict]:
    """XLA's all-gather + matmul and the Mosaic GPU kernel (where it can run) on one shape -> their JSON lines."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    n, (k, cols) = mesh.shape[MODEL], SHAPES[shape]
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (tokens, k), jnp.bfloat16), NamedSharding(mesh, P(MODEL)))
    w = jax.device_put((jax.random.normal(kw, (k, cols * n)) / k ** 0.5).astype(jnp.bfloat16),
                       NamedSharding(mesh, P(None, MODEL)))
    base = {"shape": shape, "tokens": tokens, "k": k, "n_per_rank": cols, "devices": n,
            "device_kind": jax.devices()[0].device_kind}

    def line(impl, t, **extra):
        return {**base, "impl": impl, "time_us": round(t * 1e6, 1),
                "tflops_per_device": round(2 * tokens * k * cols / t / 1e12, 1),
                "algbw_GBps": round(tokens * k * 2 / t / 1e9, 1), **extra}

    lines = [line("xla", timed(xla_once, mesh, x, w, iters=iters, repeats=repeats))]
    if jax.devices()[0].platform != "gpu":
        return lines + [{**base, "impl": "mosaic", "error": "needs GPUs (Mosaic GPU); measured XLA only"}]
    reference = np.asarray(program(xla_once, mesh, 1)(x, w), np.float32)
    best, errors = None, []
    for config in mosaic_configs():
        try:
            out = np.asarray(program(mosaic_once(config), mesh, 1)(x, w), np.float32)
            t = timed(mosaic_once(config), mesh, x, w, iters=iters, repeats=repeats)
        except Exception as e:  # a config that does not fit (shared memory) or a kernel condition not met
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        deviation = float(np.abs(out - reference).max() / np.abs(reference).max())
        if best is None or t < best[0]:
            best = (t, deviation, config)
    if best is None:
        return lines + [{**base, "impl": "mosaic", "error": errors[0] if errors else "no config ran"}]
    t, deviation, config = best
    return lines + [line("mosaic", t, rel_deviation=round(deviation, 5), config=repr(config),
                         configs_skipped=len(errors))]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[512],
                   help="rows after the gather (micro batch x seq); each rank holds tokens / devices")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from mtx.parallel.mesh import MODEL

    n = jax.device_count()
    if n < 2:
        p.error(f"{n} device: the kernel gathers over every device; run with 2 or more")
    for name, value, low in (("--iters", args.iters, 1), ("--repeats", args.repeats, 1)):
        if value < low:
            p.error(f"{name} must be >= {low}, got {value}")
    for tokens in args.tokens:
        if tokens < n or tokens % n:
            p.error(f"--tokens {tokens}: must be a positive multiple of the {n} devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (MODEL,))
    results = []
    for shape in args.shapes:
        for tokens in args.tokens:
            for r in measure(shape, tokens, mesh, iters=args.iters, repeats=args.repeats):
                print(json.dumps(r), flush=True)
                results.append(r)
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
    return results


if __name__ == "__main__":
    main()
