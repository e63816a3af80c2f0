"""Where a step's device time goes: a JAX profiler trace summed by kernel class and by kernel.

    python benchmarks/profile_summary.py TRACE_DIR [--steps 2] [--top 25]

TRACE_DIR is a directory written by `jax.profiler.trace(..., create_perfetto_trace=True)` (bench.py --profile DIR
writes one). Device events are the ones on a process named like "/device:GPU:0"; a CPU trace has none, and there the
XLA thunks each simulated device ran stand in (their args name its device_ordinal; the devices share the host's cores,
so a collective's time includes the wait for the others). Each kernel is put in a class by its name: matmul
(cuBLAS/cuBLASLt/CUTLASS GEMMs), attention (cuDNN flash attention), collective (NCCL; on CPU the all-reduce, psum and
permute thunks), copy (memcpy and memset), or fusion (XLA's own element-wise and reduction kernels: LayerNorm, GeLU,
softmax, loss, optimizer). Times are per step (the trace's total divided by --steps). "busy" is the union of kernel
intervals on all streams, so busy / step time shows how much of a step the device is idle (host overhead, waiting on
transfers); "collective exposed" is the time a collective runs with no other kernel beside it (communication the step
waits for). With several devices in the trace one is counted (--device, default the first).

    python benchmarks/profile_summary.py TRACE_DIR --calls mosaic --cycle 4 --segments 2 [--steps 2]

--calls: the kernels whose name matches, one step's in launch order, by their place in a cycle (a layer's four
peer-memory kernels forward, four backward): how long each call of a layer takes in the step itself.

    python benchmarks/profile_summary.py TRACE_DIR --ticks [--devices 0 1]

A pipelined step is a loop of ticks, each ending in its shifts (collective-permutes) to the neighbouring stages.
--ticks cuts each device's timeline at one of the tick loop's shifts (the shift op that runs most often) and lines
the devices' pieces up ("ticks" below): per piece, each device's compute (kernels other than collectives), its other
collectives (the head's sums) and the wall time of its shifts (the tick's and the head's sends), which is the
transfer plus the wait for the slower device. "skew" sums, over pieces, how much longer
the busiest device computed than each of the others: the time a lockstep loses to unequal work between shifts.
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from mtx.cli import COUNT, OneLineParser, flags_in, ranged  # noqa: E402
from mtx.flag_rules import refuse_idle  # noqa: E402

CLASSES = (  # first match wins
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                              r"\bp(sum|max|min)|collective|permute|send|recv", re.I)),
    ("attention", re.compile(r"cudnn|flash|fmha|fprop|dgrad|sdpa|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(tn|nt|nn|tt)|matmul|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_class(name: str) -> str:
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return "fusion"


def find_trace(trace_dir: str | Path) -> Path:
    found = sorted(Path(trace_dir).rglob("*perfetto_trace.json.gz")) or sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}; profile with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return found[-1]


@functools.lru_cache(maxsize=1)
def _load(trace_path: Path) -> list[dict]:
    try:
        with gzip.open(trace_path) as fh:
            data = json.load(fh)
    except (OSError, EOFError, ValueError) as e:  # not gzip, cut short, not JSON
        raise ValueError(f"{trace_path} is not a readable trace ({e}); profile the step again.") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not (isinstance(events, list) and all(isinstance(e, dict) for e in events)):
        raise ValueError(f"{trace_path} is JSON but not a profiler trace (a list of event objects, or an object "
                         "with one under traceEvents); pass the directory bench.py --profile wrote.")
    return events


def _is_timed(e: dict) -> bool:
    """A complete ('X') event with a name, start, duration > 0, a process id and (if any) an object of args."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    return (e.get("ph") == "X" and isinstance(e.get("name"), str) and number(e.get("ts")) and number(e.get("dur"))
            and e["dur"] > 0 and isinstance(e.get("args", {}), dict) and isinstance(e.get("pid"), (int, str)))


def device_events(trace_path: Path, device_index: int = 0, flag: str = "--device") -> list[dict]:
    """Complete ('X') events of device `device_index`: those on its processes (named "/device:GPU:0", TPU alike); in
    a CPU trace, which has no device processes, the XLA thunks run for it (the events whose args name its
    device_ordinal and an hlo_op; the simulated devices share the host's threads). A device the trace does not hold
    is refused naming `flag`, the option that chose it."""
    events = _load(trace_path)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and isinstance(e.get("pid"), (int, str)) and isinstance(e.get("args"), dict)
             and isinstance(e["args"].get("name"), str)}
    on_device = {pid: int(m.group(1)) for pid, n in names.items() if (m := re.search(r"/device:(?:GPU|TPU):(\d+)", n))}
    if on_device:
        device_of = lambda e: on_device.get(e.get("pid"))
    else:
        device_of = lambda e: (int(args["device_ordinal"]) if "hlo_op" in (args := e.get("args", {}))
                               and str(args.get("device_ordinal", "")).isdigit() else None)
    timed = [(e, device_of(e)) for e in events if _is_timed(e)]
    held = sorted({d for _, d in timed if d is not None})
    if not held:
        raise ValueError(f"{trace_path} holds no device events (no /device: process, no XLA thunk of a device); "
                         "profile steps that run on a device (bench.py --profile DIR).")
    if device_index not in held:
        raise ValueError(f"{flag} {device_index}: the trace holds devices {held}; pass one of them.")
    return [e for e, d in timed if d == device_index]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(trace_dir: str | Path, *, steps: int = 1, top: int = 25, device: int = 0) -> dict:
    """Per-step device milliseconds by class and for the `top` kernels, plus the busy (union) time, of one device."""
    events = device_events(find_trace(trace_dir), device)
    by_class, by_kernel, op = defaultdict(float), defaultdict(lambda: [0.0, 0]), {}
    for e in events:
        by_class[kernel_class(e["name"])] += e["dur"]
        by_kernel[e["name"]][0] += e["dur"]
        by_kernel[e["name"]][1] += 1
        op.setdefault(e["name"], str(e.get("args", {}).get("hlo_op", "")))
    busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in events])
    busy_without_collectives = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in events
                                          if kernel_class(e["name"]) != "collective"])
    ms = lambda us: us / 1000 / steps
    kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps, "events": len(events), "busy_ms": ms(busy),
        "collective_exposed_ms": ms(busy - busy_without_collectives), "kernel_ms": ms(sum(by_class.values())),
        "by_class_ms": {k: ms(v) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "class": kernel_class(n), "ms": ms(t), "calls": c // steps,
                         "hlo_op": op[n]} for n, (t, c) in kernels],
    }


SHIFT = re.compile(r"permute|sendrecv", re.I)


def _is_shift(e) -> bool:
    return bool(SHIFT.search(e["name"]) or SHIFT.search(str((e.get("args") or {}).get("hlo_op", ""))))


def _op(e) -> str:
    return str((e.get("args") or {}).get("hlo_op") or e["name"])


def ticks(trace_dir: str | Path, device: int = 0) -> list[dict]:
    """One device's timeline cut at its tick shifts -> its ticks, each {start, compute_us, collective_us, shift_us}:
    the union of its non-collective kernels and of its other collectives since the previous cut, and the wall time of
    its shifts (shift kernels with no other kernel starting between them are one shift). The cuts are the shifts of
    the op that runs most often (ties: the first name): the tick loop's own, which every device runs once a tick;
    the head's sends (1F1B) run only at the head's ticks, so cut at they would put the devices' pieces out of line."""
    events = sorted(device_events(find_trace(trace_dir), device, "--devices"), key=lambda e: e["ts"])
    shifts, open_ = [], None  # [start, end, ops]
    for e in events:
        if _is_shift(e):
            if open_ is None:
                open_ = [e["ts"], e["ts"] + e["dur"], set()]
                shifts.append(open_)
            open_[1] = max(open_[1], e["ts"] + e["dur"])
            open_[2].add(_op(e))
        elif open_ is not None and e["ts"] >= open_[1]:
            open_ = None
    runs = Counter(op for _, _, ops in shifts for op in ops)
    tick_op = min(runs, key=lambda op: (-runs[op], op)) if runs else None
    cuts = [(s, t) for s, t, ops in shifts if tick_op in ops]
    starts = [s for s, _ in cuts]
    windows, shift_us = [[] for _ in cuts], [t - s for s, t in cuts]
    for s, t, ops in shifts:  # the other shifts (the head's sends) count as shift time of their tick
        k = bisect.bisect_left(starts, s)
        if tick_op not in ops and k < len(cuts):
            shift_us[k] += t - s
    for e in events:  # each other kernel belongs to the tick of the next cut (those after the last: none)
        k = bisect.bisect_left(starts, e["ts"])
        if not _is_shift(e) and k < len(cuts):
            windows[k].append(e)
    span = lambda es: _union_us([(e["ts"], e["ts"] + e["dur"]) for e in es])
    return [{"start": s, "compute_us": span([e for e in w if kernel_class(e["name"]) != "collective"]),
             "collective_us": span([e for e in w if kernel_class(e["name"]) == "collective"]), "shift_us": u}
            for (s, _), w, u in zip(cuts, windows, shift_us)]


def tick_summary(trace_dir: str | Path, devices=(0, 1), *, steps: int = 1, top: int = 10) -> dict:
    """The devices' ticks lined up (the k-th shift of each): per device its compute, other collectives and shift wall
    time per step, and its skew (over ticks, the busiest device's compute less its own: its wait for unequal ticks);
    the `top` ticks with the largest spread of compute."""
    per = {d: ticks(trace_dir, d) for d in devices}
    n = min(len(t) for t in per.values())
    busiest = [max(per[d][k]["compute_us"] for d in devices) for k in range(n)]
    spread = [busiest[k] - min(per[d][k]["compute_us"] for d in devices) for k in range(n)]
    ms = lambda us: us / 1000 / steps
    return {
        "ticks": {d: len(t) for d, t in per.items()}, "lined_up": n,
        "per_device_ms": {d: {"compute": ms(sum(x["compute_us"] for x in t[:n])),
                              "collective": ms(sum(x["collective_us"] for x in t[:n])),
                              "shift": ms(sum(x["shift_us"] for x in t[:n])),
                              "skew": ms(sum(busiest[k] - t[k]["compute_us"] for k in range(n)))}
                          for d, t in per.items()},
        "widest": [{"tick": k, "compute_ms": [per[d][k]["compute_us"] / 1000 for d in devices],
                    "shift_ms": [per[d][k]["shift_us"] / 1000 for d in devices]}
                   for k in sorted(range(n), key=lambda k: -spread[k])[:top]],
    }


def format_ticks(s: dict) -> str:
    lines = [f"ticks per device {s['ticks']}, {s['lined_up']} lined up; per step (ms):"]
    lines += [f"  device {d}: compute {v['compute']:.1f}  other collectives {v['collective']:.1f}  shifts "
              f"{v['shift']:.1f}  skew {v['skew']:.1f}" for d, v in s["per_device_ms"].items()]
    lines.append("ticks with the widest spread of compute (ms, per device):")
    lines += [f"  tick {w['tick']:4d}: compute " + " / ".join(f"{c:.2f}" for c in w["compute_ms"])
              + "   shift " + " / ".join(f"{c:.2f}" for c in w["shift_ms"]) for w in s["widest"]]
    return "\n".join(lines)


def calls(trace_dir: str | Path, pattern: str, *, cycle: int, segments: int = 1, steps: int = 1,
          device: int = 0) -> list[dict]:
    """The kernels whose name matches `pattern`, those of the first of the trace's `steps` steps in launch order,
    cut into `segments` equal runs (a step's forward and backward: 2) and each run into cycles of `cycle` calls (a
    layer's) -> per (segment, place in the cycle) the calls' count and median, least and largest microseconds."""
    if min(cycle, segments, steps) < 1:
        raise ValueError(f"--cycle {cycle}, --segments {segments}, --steps {steps}: each must be at least 1.")
    try:
        found = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--calls {pattern!r} is no regular expression ({e}); fix it.") from None
    events = sorted((e for e in device_events(find_trace(trace_dir), device) if found.search(e["name"])),
                    key=lambda e: e["ts"])
    step = events[:len(events) // steps]
    run = len(step) // segments
    rows = []
    for seg in range(segments):
        for place in range(cycle):
            d = sorted(e["dur"] for e in step[seg * run:(seg + 1) * run][place::cycle])
            if d:
                rows.append({"segment": seg, "place": place, "calls": len(d), "median_us": statistics.median(d),
                             "min_us": d[0], "max_us": d[-1], "ms_per_step": sum(d) / 1000})
    return rows


def capture(run_step, trace_dir: str | Path, *, steps: int = 2, top: int = 40) -> dict:
    """Profiles `steps` calls of run_step() (each must block until its step is done) and summarizes them, with the
    traced steps' own wall time ("step_ms": tracing slows them, so busy time is compared with it)."""
    import time

    import jax

    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        step_ms = (time.perf_counter() - start) * 1000 / steps
    return {**summarize(trace_dir, steps=steps, top=top), "step_ms": step_ms}


def format_summary(s: dict, step_ms: float | None = None) -> str:
    lines = [f"device busy {s['busy_ms']:.1f} ms/step" + (f" of {step_ms:.1f} ms ({s['busy_ms'] / step_ms:.0%})"
                                                          if step_ms else "")]
    total = s["kernel_ms"] or 1.0
    lines += [f"  {cls:<10} {t:9.1f} ms  {t / total:6.1%}" for cls, t in s["by_class_ms"].items()]
    if s["by_class_ms"].get("collective"):
        lines.append(f"  collective exposed (nothing else running) {s['collective_exposed_ms']:.1f} ms")
    lines.append("top kernels:")
    lines += [(f"  {k['ms']:8.2f} ms  x{k['calls']:<5} {k['class']:<10} {k['name'][:70]}  "
               f"{k.get('hlo_op') if k.get('hlo_op') != k['name'] else ''}").rstrip()  # (on CPU: the event's name)
              for k in s["top_kernels"]]
    return "\n".join(lines)


def _idle_rules(args) -> tuple:
    """The flags that act in one report only, as mtx.flag_rules.refuse_idle's rules: given elsewhere they would do
    nothing."""
    summary, out = not (args.calls or args.ticks), "leave it out."
    return ((("--ticks",), not args.calls, "without --calls (two reports: pass one)", out),
            (("--devices",), args.ticks, "with --ticks", out),
            (("--cycle", "--segments"), args.calls, "with --calls REGEX", out),
            (("--device",), not args.ticks, "without --ticks (--ticks lines up --devices)", out),
            (("--top",), summary or args.ticks, "in the summary and with --ticks, not with --calls", out))


def main(argv=None) -> int:
    ap = OneLineParser(prog="profile_summary.py", description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=ranged(int, COUNT), default=1,
                    help="steps the trace holds (times are divided by it)")
    ap.add_argument("--top", type=ranged(int, ">= 1"), default=25)
    ap.add_argument("--device", type=ranged(int, ">= 0"), default=0,
                    help="which device of the trace (e.g. a later pipeline stage)")
    ap.add_argument("--ticks", action="store_true", help="a pipelined step's ticks, lined up over --devices")
    ap.add_argument("--devices", type=ranged(int, ">= 0"), nargs="+", default=[0, 1])
    ap.add_argument("--calls", metavar="REGEX", help="the matching kernels' durations by their place in a cycle of "
                    "--cycle calls (e.g. 'mosaic' --cycle 4 --segments 2: each peer-memory kernel of a layer)")
    ap.add_argument("--cycle", type=ranged(int, ">= 1"), default=1)
    ap.add_argument("--segments", type=ranged(int, ">= 1"), default=1,
                    help="equal runs of a step's calls (forward, backward: 2)")
    try:  # a bad flag, a missing or unreadable trace: one line naming it
        args = ap.parse_args(argv)
        refuse_idle(flags_in(argv if argv is not None else sys.argv[1:]), _idle_rules(args))
        if len(set(args.devices)) < len(args.devices):
            raise ValueError(f"--devices {' '.join(map(str, args.devices))} names a device twice; name each once.")
        if not Path(args.trace_dir).is_dir():
            raise ValueError(f"{args.trace_dir} is not a directory; pass the directory a trace was written into "
                             "(bench.py --profile DIR).")
        if args.calls:
            rows = calls(args.trace_dir, args.calls, cycle=args.cycle, segments=args.segments, steps=args.steps,
                         device=args.device)
            if not rows:
                raise ValueError(f"no kernel of the trace matches --calls {args.calls!r}; pass part of a kernel's "
                                 "name.")
            text = "\n".join(f"  segment {r['segment']} place {r['place']}: {r['calls']} calls, median "
                             f"{r['median_us']:.1f} us (least {r['min_us']:.1f}, most {r['max_us']:.1f}), "
                             f"{r['ms_per_step']:.2f} ms a step" for r in rows)
        elif args.ticks:
            summary = tick_summary(args.trace_dir, args.devices, steps=args.steps, top=args.top)
            if not summary["lined_up"]:  # (a table of zeros, once)
                raise ValueError("--ticks: the trace holds no shifts (collective-permutes) to cut each device's "
                                 "timeline at; profile a pipelined step (--pipeline-model-parallel-size 2 or more).")
            text = format_ticks(summary)
        else:
            text = format_summary(summarize(args.trace_dir, steps=args.steps, top=args.top, device=args.device))
    except (ValueError, OSError, EOFError) as e:  # OSError: FileNotFoundError (no trace in it), a bad gzip file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
