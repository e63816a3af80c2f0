"""Sequence parallelism's two communicating matmuls, XLA's way (NCCL collective + cuBLAS matmul) against the
peer-memory kernels of mtx/kernels/collective_matmul.py (Mosaic GPU: operands or partial sums stored into the next
device's memory over NVLink beside the matmul; no multicast), over a "model" axis that spans every device (the
kernels' condition):

- `ag`, all-gather then matmul: the column-parallel linears' forward (QKV, MLP up) and the row-parallel linears'
  input gradient;
- `rs`, matmul then reduce-scatter: the row-parallel linears' forward (attention out, MLP down) and the column-parallel
  linears' input gradient;
- `column`, `row` (the `_layer` shapes): a linear layer's matmul forward and backward, `column_parallel_matmul` /
  `row_parallel_matmul` (the kernels forward and for the input gradient, the weight gradient from a gathered operand)
  against autodiff of XLA's collective and matmul; TFLOP/s and bytes count the three matmuls and three moves.

    python benchmarks/collective_matmul.py                                       # simulated CPU devices: XLA only
    python benchmarks/collective_matmul.py --tokens 16384 1024 --out cm.jsonl    # on 2 GPUs: both

Shapes (`--shapes`), per rank at TP 2 of the 1.2B model (hidden 1536; micro batch 16 x seq 1024 = 16384 tokens):
the matmul's depth K and width N on one rank, e.g. QKV 1536 -> 2304 (ag), attention out 768 -> 1536 (rs). A small
`--tokens` gives the fixed cost of a call.

One JSON line per (shape, tokens, implementation): the time of one call (the median over `--repeats` runs of one
program of `--iters` calls, each call's input tied to the previous output so none overlaps another), the matmul's
TFLOP/s per device, the moved tensor's size (the gathered rows, or the partial sums scattered) over the time (algbw,
as if the call were all transfer), and for the kernel its largest deviation from XLA's result relative to that
result's largest value, and its tuning (the layers' default; with `--tune` the fastest of a few, those that do not
fit in shared memory skipped). Where the kernel cannot run (no Hopper GPU, a jax without Mosaic GPU) its line says why.

On two H200s the kernels' times here were 1.2-3.8x their durations inside the training step's profile (docs/
benchmarks.md 3h; the cause is not known): for what the step pays, profile the step (bench.py --profile).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(2)

from mtx.cli import COUNT, OneLineParser, ranged  # noqa: E402
from mtx.errors import first_line  # noqa: E402

SHAPES = {  # name: (pattern, K, N) on one rank
    "qkv": ("ag", 1536, 2304), "mlp_up": ("ag", 1536, 3072),
    "attn_out_dgrad": ("ag", 1536, 768), "mlp_down_dgrad": ("ag", 1536, 3072),
    "attn_out": ("rs", 768, 1536), "mlp_down": ("rs", 3072, 1536),
    "qkv_dgrad": ("rs", 2304, 1536), "mlp_up_dgrad": ("rs", 3072, 1536),
    # A linear layer's matmul forward and backward (input and weight gradients): column_parallel_matmul and
    # row_parallel_matmul against autodiff of XLA's collective and matmul.
    "qkv_layer": ("column", 1536, 2304), "mlp_up_layer": ("column", 1536, 3072),
    "attn_out_layer": ("row", 768, 1536), "mlp_down_layer": ("row", 3072, 1536),
}
LAYERS = {"column": "ag", "row": "rs"}  # a layer pattern's forward geometry


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


def tunings():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dims = hm.MatmulDimension
    return [hm.TuningConfig(tile_m=tm, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_minor_dim=dims.N,
                            grid_tile_width=width, wg_dimension=wg)
            for tm in (128, 256) for width in (4, 8) for wg in dims]


def layer_step(f):
    """A linear layer's matmul forward and backward: x -> dx, the cotangent being the output itself, the weight's
    gradient computed and folded into one element of dx so that none of it is dead code."""
    import jax
    import jax.numpy as jnp

    def step(x, w):
        y, pullback = jax.vjp(f, x, w)
        dx, dw = pullback(y)
        return dx.at[0, 0].add((dw.astype(jnp.float32).sum() * 0).astype(dx.dtype))

    return step


def xla_once(pattern: str):
    from mtx.kernels import collective_matmul as cm

    plain = cm.xla_all_gather_matmul if LAYERS.get(pattern, pattern) == "ag" else cm.xla_matmul_reduce_scatter
    return layer_step(plain) if pattern in LAYERS else plain


def kernel_once(pattern: str, config):
    from mtx.kernels import collective_matmul as cm
    from mtx.kernels import ring_tiles

    if pattern in LAYERS:  # the layer functions take their kernels' default tuning
        return layer_step(cm.column_parallel_matmul if pattern == "column" else cm.row_parallel_matmul)
    if pattern == "ag":  # not the rows gathered
        return lambda x, w: ring_tiles.all_gather_matmul_kernel(x, w, cm.MODEL, config=config)[0]
    return lambda x, w: ring_tiles.matmul_reduce_scatter_kernel(x, w, cm.MODEL, config=config)


def specs(pattern: str):
    """(x, w, out) partition specs: ag gathers x's rows and splits w's columns; rs splits the contraction and
    scatters the output's rows; a layer pattern returns dx, laid out as x."""
    from jax.sharding import PartitionSpec as P

    from mtx.parallel.mesh import MODEL

    x, w, out = ((P(MODEL), P(None, MODEL), P(None, MODEL)) if LAYERS.get(pattern, pattern) == "ag"
                 else (P(None, MODEL), P(MODEL), P(MODEL)))
    return x, w, (x if pattern in LAYERS else out)


def program(once, mesh, iters: int, pattern: str):
    import jax

    x_spec, w_spec, out_spec = specs(pattern)
    return jax.jit(jax.shard_map(chained(once, iters), mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                                 check_vma=False))


def timed(once, mesh, x, w, pattern: str, *, iters: int, repeats: int) -> float:
    from benchmarks.collectives import time_per_call

    return time_per_call(program(once, mesh, iters, pattern), (x, w), iters=iters, repeats=repeats)


def measure(shape: str, tokens: int, mesh, *, iters: int, repeats: int, tune: bool = False) -> list[dict]:
    """XLA's collective and matmul and the peer-memory kernel (where it can run) on one shape -> their JSON lines."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from mtx.kernels.collective_matmul import kernel_condition
    from mtx.parallel.mesh import MODEL

    n, (pattern, k, cols) = mesh.shape[MODEL], SHAPES[shape]
    geometry, passes = LAYERS.get(pattern, pattern), 3 if pattern in LAYERS else 1  # a layer: 3 matmuls, 3 moves
    x_spec, w_spec, _ = specs(pattern)
    x_shape, w_shape = ((tokens, k), (k, cols * n)) if geometry == "ag" else ((tokens, k * n), (k * n, cols))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, x_shape, jnp.bfloat16), NamedSharding(mesh, x_spec))
    w = jax.device_put((jax.random.normal(kw, w_shape) / (k * n) ** 0.5).astype(jnp.bfloat16),
                       NamedSharding(mesh, w_spec))
    moved = passes * tokens * (k if geometry == "ag" else cols) * 2  # the gathered rows, or the partial sums
    base = {"shape": shape, "pattern": pattern, "tokens": tokens, "k": k, "n": cols, "devices": n,
            "device_kind": jax.devices()[0].device_kind}

    def line(impl, t, **extra):
        return {**base, "impl": impl, "time_us": round(t * 1e6, 1),
                "tflops_per_device": round(passes * 2 * tokens * k * cols / t / 1e12, 1),
                "algbw_GBps": round(moved / t / 1e9, 1), **extra}

    lines = [line("xla", timed(xla_once(pattern), mesh, x, w, pattern, iters=iters, repeats=repeats))]
    local_x = jax.ShapeDtypeStruct((tokens // n, k) if geometry == "ag" else (tokens, k), jnp.bfloat16)
    local_w = jax.ShapeDtypeStruct((k, cols), jnp.bfloat16)
    from mtx.kernels import collective_matmul as cm

    configs = [None] if pattern in LAYERS else tunings() if tune else [cm.default_config(cols)]
    first = configs[0] or cm.default_config(cols)  # the layers take the default
    if reason := kernel_condition(local_x, local_w, n, first, rows_split=geometry == "ag"):
        return lines + [{**base, "impl": "kernel", "error": reason}]
    reference = np.asarray(program(xla_once(pattern), mesh, 1, pattern)(x, w), np.float32)
    best, errors = None, []
    for config in configs:
        try:
            out = np.asarray(program(kernel_once(pattern, config), mesh, 1, pattern)(x, w), np.float32)
            t = timed(kernel_once(pattern, config), mesh, x, w, pattern, iters=iters, repeats=repeats)
        except Exception as e:  # a tuning that does not fit (shared memory) or does not divide the shape
            errors.append(f"{type(e).__name__}: {first_line(e)}")
            continue
        deviation = float(np.abs(out - reference).max() / np.abs(reference).max())
        if best is None or t < best[0]:
            best = (t, deviation, config)
    if best is None:
        return lines + [{**base, "impl": "kernel", "error": errors[0] if errors else "no tuning ran"}]
    t, deviation, config = best
    lines.append(line("kernel", t, rel_deviation=round(deviation, 5), config=repr(config), tunings_skipped=len(errors)))
    return lines


def main(argv=None) -> list[dict]:
    p = OneLineParser(prog="collective_matmul.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=ranged(int, ">= 1"), default=[512],
                   help="rows after the gather (micro batch x seq); each rank holds tokens / devices")
    p.add_argument("--iters", type=ranged(int, COUNT), default=20)
    p.add_argument("--repeats", type=ranged(int, COUNT), default=5)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--tune", action="store_true",
                   help="try the kernel's tunings (each compiled: minutes a shape) instead of the layers' default one")
    args = p.parse_args(argv)
    if args.out:
        from mtx.files import check_json_lines

        try:
            check_json_lines(args.out, "--out", ("pattern", "impl"))
        except ValueError as e:
            p.error(str(e))

    import jax
    import numpy as np

    from mtx.parallel.mesh import MODEL

    n = jax.device_count()
    if n < 2:
        p.error(f"{n} device: the kernel gathers over every device; run with 2 or more")
    for tokens in args.tokens:
        if tokens < n or tokens % n:
            p.error(f"--tokens {tokens}: must be a positive multiple of the {n} devices")
    from benchmarks.collectives import emit

    mesh = jax.sharding.Mesh(np.array(jax.devices()), (MODEL,))
    return emit((r for shape in args.shapes for tokens in args.tokens
                 for r in measure(shape, tokens, mesh, iters=args.iters, repeats=args.repeats,
                                         tune=args.tune)), args.out)


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
