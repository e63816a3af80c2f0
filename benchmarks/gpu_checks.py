"""Checks of the fused GPU paths against their references, in the precision they run in on a GPU.

The unit tests run on simulated CPU devices, where the fused paths fall back to XLA's implementation; this script
runs the GPU's own kernels (cuDNN's flash attention) on the same inputs as an fp32 reference and as XLA's attention in
the same low precision, and fails (exit 1) when the fused path is further from the reference than XLA's bf16
attention by more than `--slack`. It prints one JSON line per check.

    python benchmarks/gpu_checks.py            # on a GPU: cuDNN; on CPU: XLA's fallback (a smoke run)

Checks:
  bert_padding  BERT's padding mask as each row's count of real keys (`fused_attention`, bidirectional) against the
                explicit (S, S) mask: outputs at real and padding queries, and the q, k, v gradients.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from mtx.models.transformer import attention_core, fused_attention  # noqa: E402


def bert_padding(batch: int, seq: int, heads: int, head_dim: int) -> dict:
    """Errors of cuDNN's padded attention and of XLA's bf16 attention against the fp32 explicit-mask reference."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dy = (jax.random.normal(key, (batch, seq, heads, head_dim)) for key in keys)
    real = np.random.default_rng(0).integers(1, seq + 1, size=batch)
    real[:3] = (seq, 1, seq - 1)[:batch]  # a full row, a row of one token, one padding position
    mask_BS = jnp.asarray(np.arange(seq)[None, :] < real[:, None], jnp.int32)
    real_BS = np.asarray(mask_BS, bool)

    def loss(attend, dtype, q, k, v):
        out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype), mask_BS=mask_BS, causal=False)
        return jnp.sum(out.astype(jnp.float32) * dy * mask_BS[:, :, None, None]), out  # padding rows: never read

    def run(attend, dtype):
        grad = jax.value_and_grad(functools.partial(loss, attend, dtype), (0, 1, 2), has_aux=True)
        (_, out), grads = jax.jit(grad)(q, k, v)
        return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]

    ref_out, ref_grads = run(attention_core, jnp.float32)
    low = jnp.bfloat16

    def errors(out, grads):
        diff = np.abs(out - ref_out)
        return {"out_real": float(diff[real_BS].max()),
                "out_padding": float(diff[~real_BS].max()) if (~real_BS).any() else 0.0,
                **{f"grad_{n}": float(np.abs(g - r).max() / np.abs(r).max())
                   for n, g, r in zip("qkv", grads, ref_grads)}}

    hlo = jax.jit(functools.partial(loss, fused_attention, low)).lower(q, k, v).compile().as_text()
    return {"fused": errors(*run(fused_attention, low)), "xla_bf16": errors(*run(attention_core, low)),
            "cudnn_calls": hlo.count('custom_call_target="__cudnn$fmha')}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--slack", type=float, default=2.0,
                        help="fail when a fused error exceeds slack x XLA bf16's (plus 1e-3)")
    a = parser.parse_args(argv)
    result = {"check": "bert_padding", "backend": jax.default_backend(),
              **bert_padding(a.batch, a.seq, a.heads, a.head_dim)}
    worst = {key: (value, a.slack * result["xla_bf16"][key] + 1e-3) for key, value in result["fused"].items()}
    failed = sorted(key for key, (value, bound) in worst.items() if not value <= bound)
    gpu = jax.default_backend() == "gpu"
    if gpu and result["cudnn_calls"] == 0:
        failed.append("no cuDNN attention in the compiled program")
    result["failed"] = failed
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
