"""Checks of the fused GPU paths against their references, in the precision they run in on a GPU.

The unit tests run on simulated CPU devices, where the fused paths fall back to XLA's implementation; this script
runs the GPU's own kernels (cuDNN's flash attention) on the same inputs as an fp32 reference and as XLA's attention in
the same low precision, and fails (exit 1) when the fused path is further from the reference than XLA's bf16
attention by more than `--slack`. It prints one JSON line per check.

    python benchmarks/gpu_checks.py            # on a GPU: cuDNN; on CPU: XLA's fallback (a smoke run)

Checks:
  bert_padding  BERT's padding mask as each row's count of real keys (`fused_attention`, bidirectional) against the
                explicit (S, S) mask: outputs at real and padding queries, and the q, k, v gradients.
  flash_dropout mtx's flash-attention kernel with dropout 0.1 (causal, and BERT's padding) against XLA's attention
                in fp32 with the same masks: outputs and the q, k, v gradients.
  flash_training  a small GPT trained 30 steps in bf16 with hidden and attention dropout 0.1, through the kernel
                (--use-flash-attn) and through XLA's attention: the two loss curves (the same masks) must agree to
                `--loss-tol`.
  collective_matmul  an MLP's two matmuls under sequence parallelism through the peer-memory kernels (2+ Hopper
                GPUs; XLA's collectives elsewhere) against XLA's in bf16 and fp32: the output and the gradients; on
                GPUs it fails if the kernels did not run.
  gemm_epilogue  the GeLU MLP with its bias + GeLU and their backward in cuBLASLt's epilogues, and a matmul with its
                bias in one (--gemm-epilogues), against autodiff's in bf16 and fp32: the outputs and the gradients;
                on GPUs it fails if the epilogues did not run.
  tp_comm_overlap_training  on 2+ GPUs, the small GPT of flash_training trained 50 steps with TP over every GPU,
                --sequence-parallel with and without --tp-comm-overlap: the curves must agree to `--loss-tol`.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere
TINY = os.path.join(ROOT, "configs", "tiny.toml")  # the training checks' model, whatever the working directory
from mtx.cli import OneLineParser, ranged  # noqa: E402
from mtx.kernels import flash_attention as flash  # noqa: E402
from mtx.models.transformer import attention_core, fused_attention  # noqa: E402
from mtx.parallel.random import attention_dropout_hashes  # noqa: E402


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


def flash_dropout(batch: int, seq: int, heads: int, head_dim: int, causal: bool, rate: float = 0.1) -> dict:
    """Errors of the kernel in bf16 and of XLA's attention in bf16 against XLA's in fp32, all with the same masks."""
    keys = jax.random.split(jax.random.key(1), 5)
    q, k, v, dy = (jax.random.normal(key, (batch, seq, heads, head_dim)) for key in keys[:4])
    hashes = attention_dropout_hashes(jax.random.split(keys[4], batch * heads).reshape(batch, heads), seq)
    real = np.random.default_rng(1).integers(1, seq + 1, size=batch)
    mask_BS = None if causal else jnp.asarray(np.arange(seq)[None, :] < real[:, None], jnp.int32)
    read_BS = np.ones((batch, seq), bool) if causal else np.asarray(mask_BS, bool)

    def kernel(q, k, v):
        valid = None if mask_BS is None else mask_BS > 0
        return flash.flash_attention(q, k, v, causal=causal, key_valid_BS=valid, dropout_rate=rate, hashes=hashes)

    def xla(q, k, v):
        return attention_core(q, k, v, mask_BS=mask_BS, causal=causal, dropout_rate=rate, hashes=hashes)

    def run(attend, dtype):
        def loss(q, k, v):
            out = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32)
            return jnp.sum(out * dy * read_BS[:, :, None, None]), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
        return np.asarray(out), [np.asarray(g) for g in grads]

    ref_out, ref_grads = run(xla, jnp.float32)

    def errors(out, grads):
        return {"out": float(np.abs(out - ref_out)[read_BS].max()),
                **{f"grad_{n}": float(np.abs(g - r).max() / np.abs(r).max())
                   for n, g, r in zip("qkv", grads, ref_grads)}}

    return {"fused": errors(*run(kernel, jnp.bfloat16)), "xla_bf16": errors(*run(xla, jnp.bfloat16)),
            "causal": causal}


def _loss_curves(steps: int, tp: int, **variants) -> dict:
    """Loss curves of a small GPT (bf16, dropout 0.1, TP `tp` over the first tp devices) trained `steps` steps with
    each variant's flags: {name: [loss of step 1 .. steps]}."""
    import tempfile

    from mtx.config import Config
    from mtx.presets import load_preset
    from mtx.run import train

    cfg = Config().replace(**load_preset(TINY)).replace(
        num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, max_position_embeddings=256,
        micro_batch_size=8, global_batch_size=8, data_parallel_size=1, tensor_model_parallel_size=tp,
        train_iters=steps, bf16=True, hidden_dropout=0.1, attention_dropout=0.1, log_interval=steps, lr=3e-4)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in variants.items():
            run = train(cfg.replace(run_dir=f"{tmp}/{name}", **flags), progress=False)
            curves[name] = [run.losses[s] for s in range(1, steps + 1)]
    return curves


def flash_training(steps: int = 30) -> dict:
    """Loss curves of a small GPT with dropout 0.1, through the kernel and through XLA's attention."""
    curves = _loss_curves(steps, 1, kernel={"use_flash_attn": True}, xla={"use_flash_attn": False})
    diff = max(abs(a - b) for a, b in zip(curves["kernel"], curves["xla"]))
    return {"max_loss_difference": diff, "first": curves["xla"][0], "last": curves["xla"][-1],
            "kernel_last": curves["kernel"][-1]}


def tp_comm_overlap_training(steps: int = 50) -> dict:
    """Issue item: the loss curve of --tp-comm-overlap (the peer-memory kernels inside the layers) against sequence
    parallelism's NCCL collectives, TP over every GPU, 50 steps."""
    sp = {"sequence_parallel": True, "use_flash_attn": True}
    curves = _loss_curves(steps, len(jax.devices()), kernels={**sp, "tp_comm_overlap": True}, nccl=sp)
    diff = max(abs(a - b) for a, b in zip(curves["kernels"], curves["nccl"]))
    return {"max_loss_difference": diff, "first": curves["nccl"][0], "last": curves["nccl"][-1],
            "kernels_last": curves["kernels"][-1]}


def _relative_errors(names, outs, reference) -> dict:
    """Each output's largest error relative to its reference's largest magnitude, by name."""
    return {name: float(np.abs(o - r).max() / np.abs(r).max()) for name, o, r in zip(names, outs, reference)}


def collective_matmul(tokens: int, hidden: int, ffn: int) -> dict:
    """An MLP's two matmuls under sequence parallelism (no activation between) through mtx/kernels/collective_matmul.py
    (column_parallel_matmul, then row_parallel_matmul: the peer-memory kernels on 2+ Hopper GPUs) and through XLA's
    collectives, both in bf16, against XLA's in fp32: errors of the output and of the x, w1, w2 gradients, and why the
    kernels did not run (None: they did)."""
    from jax.sharding import Mesh, PartitionSpec as P

    from mtx.kernels import collective_matmul as cm
    from mtx.parallel.mesh import MODEL

    devices = jax.devices() if jax.default_backend() == "gpu" else jax.devices()[:2]  # the kernels: every device
    mesh, n = Mesh(np.array(devices), (MODEL,)), len(devices)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, hidden))
    w1 = jax.random.normal(keys[1], (hidden, ffn)) / hidden ** 0.5
    w2 = jax.random.normal(keys[2], (ffn, hidden)) / ffn ** 0.5
    ct = jax.random.normal(keys[3], (tokens, hidden))
    specs = (P(MODEL), P(None, MODEL), P(MODEL, None))

    def run(column, row, dtype):
        mlp = jax.jit(jax.shard_map(lambda x, w1, w2: row(column(x, w1), w2), mesh=mesh, in_specs=specs,
                                    out_specs=P(MODEL)))
        y, pullback = jax.vjp(mlp, *(a.astype(dtype) for a in (x, w1, w2)))
        return [np.asarray(a, np.float32) for a in (y, *pullback(ct.astype(dtype)))]

    plain = (cm.xla_all_gather_matmul, cm.xla_matmul_reduce_scatter)
    reference = run(*plain, jnp.float32)

    def errors(outs):
        return _relative_errors(("out", "dx", "dw1", "dw2"), outs, reference)

    local = jax.ShapeDtypeStruct((tokens // n, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((hidden, ffn // n),
                                                                                            jnp.bfloat16)
    return {"fused": errors(run(cm.column_parallel_matmul, cm.row_parallel_matmul, jnp.bfloat16)),
            "xla_bf16": errors(run(*plain, jnp.bfloat16)), "devices": n,
            "kernels_not_used": cm.kernel_condition(*local, n, cm.default_config(ffn // n), rows_split=True)}


def gemm_epilogue(tokens: int, hidden: int, ffn: int) -> dict:
    """mtx/kernels/gemm_epilogue.py's two functions (cuBLASLt's epilogues on CUDA GPUs, XLA elsewhere) and autodiff's,
    both in bf16, against autodiff in fp32: errors of the GeLU MLP's output and x, w1, b1, w2 gradients, and of the
    biased matmul x w1 + b1's output and gradients (`bias_*`); whether the epilogues ran."""
    from mtx.kernels import gemm_epilogue as ge

    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, hidden))
    w1 = jax.random.normal(keys[1], (hidden, ffn)) / hidden ** 0.5
    b1 = 0.1 * jax.random.normal(keys[2], (ffn,))
    w2 = jax.random.normal(keys[3], (ffn, hidden)) / ffn ** 0.5
    ct = jax.random.normal(keys[4], (tokens, hidden))

    def plain(x, w1, b1, w2):
        return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2

    def plain_biased(x, w1, b1, w2):  # the MLP's first matmul alone, its output projected by w2 to give it a cotangent
        return (x @ w1 + b1) @ w2

    def biased(x, w1, b1, w2):
        return ge.bias_matmul(x, w1, b1) @ w2

    def run(mlp, dtype):
        args = tuple(a.astype(dtype) for a in (x, w1, b1, w2))
        step = jax.jit(lambda *a: (lambda y, pullback: (y, *pullback(ct.astype(dtype))))(*jax.vjp(mlp, *a)))
        return [np.asarray(a, np.float32) for a in step(*args)], step.lower(*args).as_text()

    names = ("out", "dx", "dw1", "db1", "dw2")
    reference = run(plain, jnp.float32)[0]
    bias_reference = run(plain_biased, jnp.float32)[0]
    (fused, program), (fused_bias, bias_program) = run(ge.gelu_mlp, jnp.bfloat16), run(biased, jnp.bfloat16)
    xla_bias = run(plain_biased, jnp.bfloat16)[0]
    ran = all(target in program for target in ("mtx_gemm_gelu", "mtx_gemm_dgelu")) and "mtx_gemm_bias" in bias_program
    return {"fused": {**_relative_errors(names, fused, reference),
                      **_relative_errors([f"bias_{n}" for n in names], fused_bias, bias_reference)},
            "xla_bf16": {**_relative_errors(names, run(plain, jnp.bfloat16)[0], reference),
                         **_relative_errors([f"bias_{n}" for n in names], xla_bias, bias_reference)},
            "epilogues_ran": ran}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="gpu_checks.py", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=ranged(int, ">= 1"), default=16)
    parser.add_argument("--seq", type=ranged(int, ">= 1"), default=512)
    parser.add_argument("--heads", type=ranged(int, ">= 1"), default=16)
    parser.add_argument("--head-dim", type=ranged(int, ">= 1"), default=64)
    parser.add_argument("--slack", type=ranged(float, ">= 0"), default=2.0,
                        help="fail when a fused error exceeds slack x XLA bf16's (plus 1e-3)")
    parser.add_argument("--loss-tol", type=ranged(float, ">= 0"), default=0.05,
                        help="flash_training, tp_comm_overlap_training: largest loss difference allowed between "
                        "the two bf16 curves")
    a = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    results = [{"check": "bert_padding", **bert_padding(*shape)}]
    if gpu or flash.INTERPRET:
        results += [{"check": "flash_dropout", **flash_dropout(*shape, causal=causal)} for causal in (True, False)]
    if gpu:
        results.append({"check": "flash_training", **flash_training()})
    # the 1.2B model's MLP at micro batch 8 on GPUs; elsewhere a small one
    results.append({"check": "gemm_epilogue", **gemm_epilogue(*((8192, 1536, 6144) if gpu else (256, 128, 512)))})
    if len(jax.devices()) >= 2:  # on GPUs the MLP of the 1.2B model at micro batch 4; elsewhere a small one
        dims = (4096, 1536, 6144) if gpu else (256, 128, 512)
        results.append({"check": "collective_matmul", **collective_matmul(*dims)})
        if gpu:
            results.append({"check": "tp_comm_overlap_training", **tp_comm_overlap_training()})
    if not gpu:  # (a pass here is mtx's fallbacks against their references, not the GPU paths: said, not implied)
        print(f"note: on {jax.default_backend()}, not a GPU: cuDNN's attention, and the peer-memory kernels, do not "
              "run; the checks test mtx's fallbacks (XLA's attention, the interpreted flash kernel).", file=sys.stderr)
    status = 0
    for result in results:
        result["backend"] = jax.default_backend()
        if result["check"] == "bert_padding":
            result["fused_path"] = "cudnn" if result["cudnn_calls"] else "xla (no cuDNN attention here)"
        failed = []
        if "fused" in result:
            bounds = {key: a.slack * result["xla_bf16"][key] + 1e-3 for key in result["fused"]}
            failed = sorted(key for key, value in result["fused"].items() if not value <= bounds[key])
        if result["check"] == "bert_padding" and gpu and result["cudnn_calls"] == 0:
            failed.append("no cuDNN attention in the compiled program")
        if result["check"] == "collective_matmul" and gpu and result["kernels_not_used"]:
            failed.append(f"the peer-memory kernels did not run: {result['kernels_not_used']}")
        if result["check"] == "gemm_epilogue" and gpu and not result["epilogues_ran"]:
            failed.append("the cuBLASLt epilogues did not run (see the note on stderr)")
        if result["check"] in ("flash_training", "tp_comm_overlap_training") and \
                not result["max_loss_difference"] <= a.loss_tol:
            failed.append(f"loss curves differ by {result['max_loss_difference']:.4f}")
        result["failed"] = failed
        status |= bool(failed)
        print(json.dumps(result), flush=True)
    return status


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
