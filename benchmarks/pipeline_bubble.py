"""The pipeline's real bubble against its schedule's ideal, (p - 1) / (v m + p - 1), for each schedule.

For one model and global batch, times the step without pipelining on one device (T1) and pipelined over p devices
(Tp) for several microbatch counts m and schedules (gpipe, 1f1b, interleaved with v virtual stages). With perfect
scaling Tp = T1 / p; the bubble makes it T1 / p x (v m + p - 1) / (v m). The measured bubble is 1 - T1 / (p Tp),
which also contains the shift communication and the wait of each tick for its busiest stage.

    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 4 8 --schedules gpipe 1f1b interleaved -- \
        --config configs/gpt2_355m.toml --micro-batch-size 4
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from mtx.devices import simulate_cpu_devices

    simulate_cpu_devices(8)

    from benchmarks.bench import check_mesh, measure
    from mtx.cli import COUNT, OneLineParser, parse_config, ranged
    from mtx.files import check_json_lines, json_line, refuse_empty
    from mtx.schema_checks import CHOICES

    ap = OneLineParser(prog="pipeline_bubble.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=ranged(int, ">= 2"), default=2, help="pipeline stages of the pipelined step")
    ap.add_argument("--microbatches", type=ranged(int, COUNT), nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=CHOICES["pipeline_schedule"])
    ap.add_argument("--virtual", type=ranged(int, ">= 2"), default=None,
                    help="virtual stages of the interleaved schedule (default: 2)")
    ap.add_argument("--steps", type=ranged(int, COUNT), default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("flags", nargs="*", help="train.py flags, after --")
    a = ap.parse_args(argv)
    virtual = 2 if a.virtual is None else a.virtual
    try:  # every config checked against the devices before anything is measured
        if a.virtual is not None and "interleaved" not in a.schedules:
            raise ValueError(f"--virtual {a.virtual} is for the interleaved schedule; add interleaved to --schedules "
                             "or drop --virtual.")
        refuse_empty(a.json, "--json", "a file to append the results to, or drop --json")
        base = parse_config(a.flags, prog="pipeline_bubble.py")
        if a.json:
            check_json_lines(a.json, "--json", ("pp", "schedule", "measured_bubble"))
        mb = base.training.micro_batch_size
        runs = []  # per microbatch count: the step without pipelining, and the pipelined step of each schedule
        for m in a.microbatches:
            # (the fused step without pipelining, as the pipelined one: a preset's --layer-calls left out)
            common = dict(global_batch_size=mb * m, data_parallel_size=1, tensor_model_parallel_size=1,
                          layer_calls=False)
            flat = base.replace(pipeline_model_parallel_size=1, **common)
            piped = [(schedule, base.replace(pipeline_model_parallel_size=a.pp, **common, **(
                {"pipeline_schedule": "1f1b", "virtual_pipeline_model_parallel_size": virtual}
                if schedule == "interleaved" else {"pipeline_schedule": schedule}))) for schedule in a.schedules]
            for what, cfg in [("without pipelining", flat), *piped]:
                try:
                    check_mesh(cfg)
                except ValueError as e:
                    raise ValueError(f"--pp {a.pp}, --microbatches {m}, {what}: {e}") from None
            runs.append((m, flat, piped))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for m, flat_cfg, piped_cfgs in runs:
        flat = measure(flat_cfg, steps=a.steps)
        for schedule, cfg in piped_cfgs:
            piped = measure(cfg, steps=a.steps)
            measured = 1 - flat["step_s"] / (a.pp * piped["step_s"])
            row = {"pp": a.pp, "microbatches": m, "schedule": schedule,
                   "virtual": virtual if schedule == "interleaved" else 1, "t1_s": flat["step_s"],
                   "tp_s": piped["step_s"], "speedup": flat["step_s"] / piped["step_s"],
                   "ideal_bubble": piped["pipeline"]["ideal_bubble"], "measured_bubble": measured,
                   "t1_peak_mem_gib": flat["peak_mem_gib"], "tp_peak_mem_gib": piped["peak_mem_gib"],
                   "device": flat["device"], "layers": flat["layers"], "hidden": flat["hidden"],
                   "micro_batch": mb, "seq": flat["seq"], "dtype": flat["dtype"]}
            rows.append(row)
            if a.json:  # (on disk first, as it comes)
                with open(a.json, "a") as fh:
                    fh.write(json_line(row) + "\n")
            print(json_line(row), flush=True)
    print(f"{'m':>4} {'schedule':>12} {'T1 s':>9} {'Tp s':>9} {'speedup':>8} {'ideal bubble':>13} {'measured':>9} "
          f"{'peak GiB':>9}")
    for r in rows:
        print(f"{r['microbatches']:>4} {r['schedule']:>12} {r['t1_s']:>9.4f} {r['tp_s']:>9.4f} {r['speedup']:>8.2f} "
              f"{r['ideal_bubble']:>13.1%} {r['measured_bubble']:>9.1%} {r['tp_peak_mem_gib']:>9.1f}")
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
