"""The pipeline's real bubble against its ideal (p - 1) / (m + p - 1).

For one model and global batch, times the step without pipelining on one device (T1) and pipelined over p devices
(Tp) for several microbatch counts m. With perfect scaling Tp = T1 / p; GPipe's bubble makes it
T1 / p x (m + p - 1) / m. The measured bubble is 1 - T1 / (p Tp), which also contains the shift communication.

    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 2 4 8 -- --config configs/gpt2_355m.toml \
        --micro-batch-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from bench import measure

    from mtx.cli import parse_config
    from mtx.devices import simulate_cpu_devices

    simulate_cpu_devices(8)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("flags", nargs="*", help="train.py flags, after --")
    a = ap.parse_args(argv)
    base = parse_config(a.flags)
    mb = base.training.micro_batch_size
    rows = []
    for m in a.microbatches:
        common = dict(global_batch_size=mb * m, data_parallel_size=1, tensor_model_parallel_size=1)
        flat = measure(base.replace(pipeline_model_parallel_size=1, **common), steps=a.steps)
        piped = measure(base.replace(pipeline_model_parallel_size=a.pp, **common), steps=a.steps)
        ideal = (a.pp - 1) / (m + a.pp - 1)
        measured = 1 - flat["step_s"] / (a.pp * piped["step_s"])
        row = {"pp": a.pp, "microbatches": m, "t1_s": flat["step_s"], "tp_s": piped["step_s"],
               "speedup": flat["step_s"] / piped["step_s"], "ideal_bubble": ideal, "measured_bubble": measured,
               "device": flat["device"], "layers": flat["layers"], "hidden": flat["hidden"],
               "micro_batch": mb, "seq": flat["seq"], "dtype": flat["dtype"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'m':>4} {'T1 s':>9} {'Tp s':>9} {'speedup':>8} {'ideal bubble':>13} {'measured':>9}")
    for r in rows:
        print(f"{r['microbatches']:>4} {r['t1_s']:>9.4f} {r['tp_s']:>9.4f} {r['speedup']:>8.2f} "
              f"{r['ideal_bubble']:>13.1%} {r['measured_bubble']:>9.1%}")
    if a.json:
        with open(a.json, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
