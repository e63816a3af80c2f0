"""Where the training step's start goes: tracing + lowering, then XLA's compile, with the compile's host events
(a JAX profiler trace of it) summed by name: XLA's passes (fusion, SPMD partitioning, scheduling), code generation.

    python benchmarks/compile_probe.py OUT_DIR [--top 30] [train.py flags of the step: --help lists them]

OUT_DIR receives the trace. Host events overlap across XLA's threads, so their sums can exceed the wall time; the
named stages say which part of the compile is serial (HLO optimization) and which runs in parallel (LLVM IR emission
and PTX -> CUBIN, many kernels at once). Nothing is executed: the state and batch are abstract.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.devices import simulate_cpu_devices  # noqa: E402


def probe(cfg, out: Path, top: int = 30) -> dict:
    """-> {"trace_lower_s", "compile_s", "custom_calls": {target: count}, "events": [(name, seconds, count)]}."""
    import jax

    from benchmarks.bench import build_step, synthetic_batch

    model, step = build_step(cfg)
    batch = synthetic_batch(cfg)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=model.batch_sharding), batch)
    start = time.perf_counter()
    lowered = step._step.lower(step.abstract_state(), abstract)
    traced = time.perf_counter()
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        compiled = lowered.compile()
    done = time.perf_counter()
    targets = collections.Counter(line.split('custom_call_target="')[1].split('"')[0]
                                  for line in compiled.as_text().splitlines() if 'custom_call_target="' in line)
    trace = json.load(gzip.open(sorted(out.rglob("*perfetto_trace.json.gz"))[-1]))
    total, count = collections.Counter(), collections.Counter()
    for e in trace["traceEvents"] if isinstance(trace, dict) else trace:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$"):  # XLA's events, not Python frames
            total[e["name"]] += e["dur"] / 1e6
            count[e["name"]] += 1
    return {"trace_lower_s": traced - start, "compile_s": done - traced, "custom_calls": dict(targets),
            "events": [(name, s, count[name]) for name, s in total.most_common(top)]}


def main(argv=None) -> int:
    from benchmarks.bench import check_mesh, parse_flags
    from mtx.config import STEP_FIELDS
    from mtx.cli import OneLineParser, ranged
    from mtx.files import check_writable

    simulate_cpu_devices()
    ap = OneLineParser(prog="compile_probe.py", add_help=False)
    ap.add_argument("out", metavar="OUT_DIR", help="directory the compile's trace is written into")
    ap.add_argument("--top", type=ranged(int, ">= 1"), default=30, help="events listed (default: %(default)s)")
    try:
        # the fused step's one program; --layer-calls' programs compile as they are first called (bench.py times it)
        uses = tuple(name for name in STEP_FIELDS if name != "layer_calls")
        own, cfg = parse_flags(ap, argv, uses=uses, description=__doc__.split("\n\n")[0])
        if cfg.training.layer_calls:  # a preset's (the flag is refused above)
            print("compile_probe.py: the preset's --layer-calls left out: this probes the fused step's one program",
                  file=sys.stderr)
            cfg = cfg.replace(layer_calls=False)
        check_writable(own.out, "OUT_DIR")
        check_mesh(cfg)  # the GPU memory share (XLA plans within it), the mesh against the devices there are
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = probe(cfg, Path(own.out), own.top)
    print(f"trace + lower {r['trace_lower_s']:.1f} s, compile {r['compile_s']:.1f} s; custom calls "
          f"{r['custom_calls']}")
    for name, s, n in r["events"]:
        print(f"{s:9.2f} s  x{n:<6d} {name[:100]}")
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
