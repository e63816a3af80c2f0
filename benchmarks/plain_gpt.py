"""The plain single-device JAX baseline: the same GPT and training step as mtx, with no shard_map and no mtx code.

    python benchmarks/plain_gpt.py --config configs/gpt_1.2b.toml --micro-batch-size 16 --global-batch-size 16 \
        [--steps 10 --warmup 3 --json out.jsonl --profile TRACE_DIR]

What mtx adds over this file is the SPMD machinery (mesh, shard_map, f/g, vocab-parallel loss, explicit gradient
reductions); at TP = PP = DP = 1 it should cost nothing, and this script is what "nothing" is measured against
(issue 6's target: mtx within 5%). It reads the preset through mtx's config only to get the same numbers; the model,
loss and step below are written from scratch in jax.numpy: pre-LN GPT with learned positions, fused QKV, tanh GeLU,
tied output layer, LayerNorm, softmax and loss in fp32, bf16 compute with fp32 master weights, a `lax.scan` over
layers (or, with --no-scan-layers, a Python loop over per-layer parameters) with the same recomputation policy,
cuDNN flash attention where mtx uses it, optax AdamW (no decay on biases and LayerNorm) with global-norm clipping,
donated state. The output JSON line has bench.py's fields.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.bench import run_cli, time_steps


def init_params(key, *, vocab, positions, layers, d, f, std):
    """fp32 parameters; residual projections scaled by 1 / sqrt(2 L) as in the paper."""
    ks = jax.random.split(key, 6)
    normal = lambda k, shape, s=std: s * jax.random.normal(k, shape, jnp.float32)
    out_std = std / math.sqrt(2 * layers)
    return {
        "wte": normal(ks[0], (vocab, d)),
        "wpe": normal(ks[1], (positions, d)),
        "layers": {
            "ln1_scale": jnp.ones((layers, d)), "ln1_bias": jnp.zeros((layers, d)),
            "qkv_kernel": normal(ks[2], (layers, d, 3 * d)), "qkv_bias": jnp.zeros((layers, 3 * d)),
            "out_kernel": normal(ks[3], (layers, d, d), out_std), "out_bias": jnp.zeros((layers, d)),
            "ln2_scale": jnp.ones((layers, d)), "ln2_bias": jnp.zeros((layers, d)),
            "fc1_kernel": normal(ks[4], (layers, d, f)), "fc1_bias": jnp.zeros((layers, f)),
            "fc2_kernel": normal(ks[5], (layers, f, d), out_std), "fc2_bias": jnp.zeros((layers, d)),
        },
        "lnf_scale": jnp.ones((d,)), "lnf_bias": jnp.zeros((d,)),
    }


def layer_norm(x, scale, bias, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def save_matmuls(prim, *args, **params) -> bool:
    """Recompute all but the weight matmuls and cuDNN attention (mtx's --recompute-granularity matmuls)."""
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or prim.name.startswith("dot_product_attention_fwd"))


def loss_fn(params, tokens_BS1, *, heads, dtype, flash, recompute, vocab_size):
    """Mean next-token cross-entropy of a (B, S + 1) batch. params["layers"] is one dict of (L, ...) arrays (run as a
    scan) or a list of L per-layer dicts (unrolled)."""
    inputs, targets = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    b, s = inputs.shape
    cast = lambda w: w.astype(dtype)
    x = (params["wte"][inputs] + params["wpe"][:s]).astype(dtype)

    def block(x, p):
        d = x.shape[-1]
        h = cast(layer_norm(x, p["ln1_scale"], p["ln1_bias"]))
        qkv = (h @ cast(p["qkv_kernel"]) + cast(p["qkv_bias"])).reshape(b, s, heads, 3, d // heads)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn" if flash else None)
        x = x + ctx.reshape(b, s, d) @ cast(p["out_kernel"]) + cast(p["out_bias"])
        h = cast(layer_norm(x, p["ln2_scale"], p["ln2_bias"]))
        h = jax.nn.gelu(h @ cast(p["fc1_kernel"]) + cast(p["fc1_bias"]), approximate=True)
        return x + h @ cast(p["fc2_kernel"]) + cast(p["fc2_bias"]), None

    if recompute == "full":
        block = jax.checkpoint(block)
    elif recompute == "matmuls":
        block = jax.checkpoint(block, policy=save_matmuls)
    if isinstance(params["layers"], list):
        for layer in params["layers"]:
            x, _ = block(x, layer)
    else:
        x, _ = jax.lax.scan(block, x, params["layers"])
    x = cast(layer_norm(x, params["lnf_scale"], params["lnf_bias"]))
    logits = (x @ cast(params["wte"]).T).astype(jnp.float32)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)  # padded ids: no probability
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(cfg):
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[t.compute_dtype]
    flash = t.use_flash_attn and jax.default_backend() == "gpu" and dtype != jnp.float32
    loss = lambda p, tok: loss_fn(p, tok, heads=m.num_attention_heads, dtype=dtype, flash=flash,
                                  recompute=t.recompute_granularity, vocab_size=m.vocab_size)
    decay = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: not jax.tree_util.keystr(path).endswith(("bias']", "scale']")), params)
    optimizer = optax.chain(optax.clip_by_global_norm(o.clip_grad),
                            optax.adamw(o.lr, b1=o.adam_beta1, b2=o.adam_beta2, eps=o.adam_eps,
                                        weight_decay=o.weight_decay, mask=decay))
    accumulation = t.global_batch_size // t.micro_batch_size

    def step(params, opt_state, tokens_GS1):
        micro = tokens_GS1.reshape(accumulation, t.micro_batch_size, -1)

        def one(acc, tok):
            l, g = jax.value_and_grad(loss)(params, tok)
            return jax.tree.map(jnp.add, acc, (l, g)), None

        if accumulation == 1:
            l, grads = jax.value_and_grad(loss)(params, micro[0])
        else:
            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (l, grads), _ = jax.lax.scan(one, zeros, micro)
            grads = jax.tree.map(lambda g: g / accumulation, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, l / accumulation

    def init(key):
        params = init_params(key, vocab=m.padded_vocab_size, positions=m.max_positions, layers=m.num_layers,
                             d=m.hidden_size, f=m.ffn_size, std=m.init_method_std)
        if not t.scan_layers:  # one dict per layer, so nothing is sliced out of a stack inside the step
            params["layers"] = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(m.num_layers)]
        return params
    return init, optimizer, jax.jit(step, donate_argnums=(0, 1))


def measure(cfg, *, steps: int = 10, warmup: int = 3, profile: str | None = None) -> dict:
    from mtx.metrics import peak_flops_per_device

    cfg.validate()
    m, t = cfg.model, cfg.training
    init, optimizer, step = make_step(cfg)
    params = jax.jit(init)(jax.random.key(t.seed))
    opt_state = jax.jit(optimizer.init)(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.vocab_size, (t.global_batch_size, m.seq_length + 1)),
                         jnp.int32)
    def run_step():
        nonlocal params, opt_state, loss
        params, opt_state, loss = step(params, opt_state, tokens)
        jax.block_until_ready(loss)

    loss = None
    times, summary = time_steps(run_step, steps=steps, warmup=warmup, profile=profile)
    step_s = statistics.median(times)
    tokens_per_s = t.global_batch_size * m.seq_length / step_s
    flops = tokens_per_s * m.flops_per_token()
    peak = peak_flops_per_device()
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "impl": "plain-jax", "device": jax.devices()[0].device_kind, "layers": m.num_layers, "hidden": m.hidden_size,
        "heads": m.num_attention_heads, "seq": m.seq_length, "params": m.num_params(),
        "micro_batch": t.micro_batch_size, "global_batch": t.global_batch_size, "dtype": t.compute_dtype,
        "recompute": t.recompute_granularity, "flash": t.use_flash_attn, "step_s": step_s, "step_s_min": min(times),
        "tokens_per_s": tokens_per_s, "tflops_per_device": flops / 1e12, "mfu": flops / peak if peak else None,
        "peak_mem_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "loss": float(loss),
        "profile": summary,
    }


def main(argv=None) -> int:
    return run_cli(measure, argv)


if __name__ == "__main__":
    sys.exit(main())
