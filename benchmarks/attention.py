"""Attention forward + backward on one GPU: cuDNN, XLA, and mtx's Pallas kernel, with and without dropout.

    python benchmarks/attention.py [--batch 16 --seq 1024 --heads 16 --head-dim 96 --rate 0.1 --causal 1]

Every variant runs on the same bf16 inputs: cuDNN's flash attention (no dropout), XLA's attention
(`attention_core`, with and without dropout), and mtx's kernel (mtx/kernels/flash_attention.py) for each tile
choice in `--blocks`, with and without dropout. Prints one JSON line per variant (median ms of forward + backward,
and the kernel's largest error against the fp32 reference with the same dropout masks, beside XLA bf16's), then
a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from mtx.cli import COUNT, OneLineParser, ranged  # noqa: E402
from mtx.kernels.flash_attention import Blocks, flash_attention  # noqa: E402
from mtx.models.transformer import attention_core, fused_attention  # noqa: E402
from mtx.parallel.random import attention_dropout_hashes  # noqa: E402


def timed(fn, args, repeats: int) -> float:
    """Median milliseconds of fn(*args) after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def parse_blocks(text: str) -> Blocks:
    """'q,k,big,small,warps,warps_backward,stages' -> Blocks; an argparse `type`, so a bad one is refused by name."""
    parts = text.split(",")
    if len(parts) != len(dataclasses.fields(Blocks)) or not all(re.fullmatch("[0-9]+", x) and int(x) for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not q,k,big,small,warps,warps_backward,stages (positive "
                                         "integers, e.g. 64,64,64,64,4,4,2)")
    return Blocks(*map(int, parts))


def main(argv=None) -> int:
    ap = OneLineParser(prog="attention.py", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=ranged(int, ">= 1"), default=16)
    ap.add_argument("--seq", type=ranged(int, ">= 1"), default=1024)
    ap.add_argument("--heads", type=ranged(int, ">= 1"), default=16)
    ap.add_argument("--head-dim", type=ranged(int, ">= 1"), default=96)
    ap.add_argument("--rate", type=ranged(float, "[0, 1)"), default=0.1, help="attention dropout rate")
    ap.add_argument("--causal", type=ranged(int, "[0, 1]"), default=1, help="1: causal (GPT), 0: not (BERT)")
    ap.add_argument("--repeats", type=ranged(int, COUNT), default=20)
    ap.add_argument("--blocks", nargs="*", type=parse_blocks, default=[Blocks(64, 64, 64, 64, 4, 4, 2)],
                    help="kernel tiles to try, each q,k,big,small,warps,warps_backward,stages")
    a = ap.parse_args(argv)
    b, s, n, h, causal = a.batch, a.seq, a.heads, a.head_dim, bool(a.causal)
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, dy = (jax.random.normal(key, (b, s, n, h), jnp.float32) for key in keys[:4])
    hashes = attention_dropout_hashes(jax.random.split(keys[4], b * n).reshape(b, n), s)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]

    def forward_backward(attend):
        def loss(q, k, v, dy, rows, cols):
            return jnp.sum(attend(q, k, v, (rows, cols)).astype(jnp.float32) * dy)
        step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
        return lambda q, k, v: step(q, k, v, dy, *hashes)  # operands, not constants: nothing to fold at compile

    def xla(rate):
        return lambda q, k, v, hashes: attention_core(q, k, v, dropout_rate=rate, hashes=hashes if rate else None,
                                                      causal=causal)

    def kernel(rate, blocks):
        return lambda q, k, v, hashes: flash_attention(q, k, v, causal=causal, dropout_rate=rate, hashes=hashes,
                                                       blocks=blocks)

    references = {}

    def error(fn, rate):
        """Largest |out - ref| and relative gradient errors of fn in bf16 against XLA's attention in fp32."""
        if rate not in references:
            references[rate] = (jax.jit(xla(rate))(q, k, v, hashes), forward_backward(xla(rate))(q, k, v)[1])
        out_ref, ref = references[rate]
        out = jax.jit(fn)(*low, hashes).astype(jnp.float32)
        _, grads = forward_backward(fn)(*low)
        errs = {"out": float(jnp.max(jnp.abs(out - out_ref)))}
        for name, g, r in zip("qkv", grads, ref):
            errs[f"grad_{name}"] = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
        return errs

    rows = []

    def record(name, fn, rate, check=False):
        row = {"variant": name, "rate": rate, "device": jax.devices()[0].device_kind, "shape": [b, s, n, h],
               "causal": causal}
        try:
            row["ms"] = timed(forward_backward(fn), low, a.repeats)
            if check:
                row["errors"] = error(fn, rate)
        except Exception as e:  # a tile choice the compiler refuses is a result, not the end of the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    cudnn = functools.partial(fused_attention, causal=causal)
    record("cudnn", lambda q, k, v, hashes: cudnn(q, k, v), 0.0)
    record("xla", xla(0.0), 0.0, check=True)
    record("xla", xla(a.rate), a.rate, check=True)
    for blocks in a.blocks:
        text = ",".join(map(str, dataclasses.astuple(blocks)))
        record(f"kernel {text}", kernel(0.0, blocks), 0.0, check=True)
        record(f"kernel {text}", kernel(a.rate, blocks), a.rate, check=True)
    print(f"\n{'variant':34} {'rate':>5} {'ms':>8}  worst error (out, grads)")
    for row in rows:
        errs = row.get("errors", {})
        worst = f"{errs.get('out', float('nan')):.2e} {max([errs[x] for x in errs if x != 'out'] or [np.nan]):.2e}"
        print(f"{row['variant']:34} {row['rate']:5.2f} {row.get('ms', float('nan')):8.3f}  {worst}"
              f"  {row.get('error', '')[:80]}")
    if not any("ms" in row for row in rows):
        print("error: no variant ran; see each line's error.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
