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
donated state. The output JSON line has bench.py's fields. It takes the train.py flags of what it builds (--help lists
them) and refuses the others, and a preset of another model (Llama's blocks, BERT).

With --gspmd, the same program runs tensor-parallel over --tensor-model-parallel-size devices the way MaxText does it:
no shard_map, only sharding annotations (Megatron's layout: QKV and fc1 split by columns, the attention projection
and fc2 by rows, heads and the vocabulary split; with --sequence-parallel the residual stream split by rows) from
which XLA's SPMD partitioner inserts the collectives. That is the baseline for mtx's TP rows, and the program on which
XLA's own collective matmuls (windowed einsum: XLA_FLAGS=--xla_gpu_threshold_for_windowed_einsum_mib=0) apply.

    python benchmarks/plain_gpt.py --gspmd --config configs/gpt_1.2b.toml --tensor-model-parallel-size 2 \
        --sequence-parallel --micro-batch-size 16 --global-batch-size 16
"""

from __future__ import annotations

import functools
import math
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.bench import run_cli, time_steps
from mtx.flag_rules import refuse_idle
from mtx.devices import simulate_cpu_devices, use_memory_fraction
from mtx.schema_checks import flag_name

# The Config fields this baseline reads (the train.py flags it takes; run_cli refuses the others): its GPT's shape,
# AdamW at a constant --lr, the batch, precision (fp16 without loss scaling), recomputation, the layer scan, flash
# attention and the seed; with --gspmd the tensor-parallel mesh (without it only one device's sizes). The dropouts
# only as 0: the model has none, and the suite's rows pass 0 as they do to mtx's (check_config refuses another value).
USES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
        "vocab_size", "make_vocab_size_divisible_by", "init_method_std", "hidden_dropout", "attention_dropout",
        "lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "micro_batch_size",
        "global_batch_size", "seed", "bf16", "fp16", "recompute_granularity", "scan_layers", "use_flash_attn",
        "tensor_model_parallel_size", "sequence_parallel", "data_parallel_size")
GSPMD_HELP = ("split the model over the first --tensor-model-parallel-size devices by sharding annotations alone "
              "(as MaxText does); the mesh flags act only with it")


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


EPSILON = 1e-5  # GPT-2's LayerNorm epsilon, the one this model computes with


def layer_norm(x, scale, bias, eps=EPSILON):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def save_matmuls(prim, *args, **params) -> bool:
    """Recompute all but the weight matmuls and cuDNN attention (mtx's --recompute-granularity matmuls)."""
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or prim.name.startswith("dot_product_attention_fwd"))


class Layout:
    """Megatron's tensor-parallel layout as GSPMD sharding annotations over a one-axis ("model") mesh."""

    COLUMNS = ("qkv_kernel", "qkv_bias", "fc1_kernel", "fc1_bias")  # split along the last (output) dimension
    ROWS = ("out_kernel", "fc2_kernel")  # split along the input dimension
    WHOLE = ("wpe", "ln1_scale", "ln1_bias", "out_bias", "ln2_scale", "ln2_bias", "fc2_bias", "lnf_scale", "lnf_bias")

    def __init__(self, mesh, sequence_parallel: bool):
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def param_spec(self, name: str | None, ndim: int) -> P:
        """Per-layer arrays may carry a leading layer dimension (scanned layers): the split counts from the end.
        name None: an optimizer's own counter. A parameter init_params gains must be listed here, not replicated
        by default."""
        if name in self.COLUMNS:
            return P(*[None] * (ndim - 1), "model")
        if name in self.ROWS:
            return P(*[None] * (ndim - 2), "model", None)
        if name == "wte":  # split by vocabulary rows
            return P("model", None)
        if name in self.WHOLE or name is None:
            return P()
        raise ValueError(f"no tensor-parallel layout for parameter {name!r}: add it to plain_gpt.Layout")

    def shardings(self, tree):
        """Shardings for parameters or optimizer state (whose moments repeat the parameters' names), by leaf name."""
        return jax.tree_util.tree_map_with_path(
            lambda path, a: NamedSharding(self.mesh, self.param_spec(getattr(path[-1], "key", None), a.ndim)), tree)

    def __call__(self, x, kind: str):
        """kind: "residual" (B, S, D): split by rows under sequence parallelism, else whole; "last" (..., F): split
        along the last dimension (column-parallel outputs, the vocabulary); "heads" (B, S, N, H)."""
        spec = {"residual": P(None, "model", None) if self.sequence_parallel else P(),
                "last": P(*[None] * (x.ndim - 1), "model"), "heads": P(None, None, "model", None)}[kind]
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def vocab_parallel_cross_entropy(logits, targets):
    """Mean cross-entropy from fp32 logits as reductions over the vocabulary only (a max, a sum of exponentials, the
    target's logit), so that with the vocabulary split GSPMD communicates (B, S) scalars, not the logits."""
    m = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    lse = jnp.log(jnp.exp(logits - m).sum(-1)) + m[..., 0]
    target_logit = jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0).sum(-1)
    return (lse - target_logit).mean()


def loss_fn(params, tokens_BS1, *, heads, dtype, flash, recompute, vocab_size, layout=None):
    """Mean next-token cross-entropy of a (B, S + 1) batch. params["layers"] is one dict of (L, ...) arrays (run as a
    scan) or a list of L per-layer dicts (unrolled). `layout` (a Layout, or None on one device) annotates the
    activations for GSPMD."""
    inputs, targets = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    b, s = inputs.shape
    cast = lambda w: w.astype(dtype)
    shard = layout or (lambda x, kind: x)
    x = shard((params["wte"][inputs] + params["wpe"][:s]).astype(dtype), "residual")

    def block(x, p):
        d = x.shape[-1]
        h = shard(cast(layer_norm(x, p["ln1_scale"], p["ln1_bias"])), "residual")  # gathered in bf16 for the matmul
        qkv = shard(h @ cast(p["qkv_kernel"]) + cast(p["qkv_bias"]), "last").reshape(b, s, heads, 3, d // heads)
        q, k, v = (shard(qkv[..., i, :], "heads") for i in range(3))
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn" if flash else None)
        ctx = shard(shard(ctx, "heads").reshape(b, s, d), "last")
        x = x + shard(ctx @ cast(p["out_kernel"]), "residual") + cast(p["out_bias"])
        h = shard(cast(layer_norm(x, p["ln2_scale"], p["ln2_bias"])), "residual")
        h = jax.nn.gelu(shard(h @ cast(p["fc1_kernel"]) + cast(p["fc1_bias"]), "last"), approximate=True)
        return x + shard(h @ cast(p["fc2_kernel"]), "residual") + cast(p["fc2_bias"]), None

    if recompute == "full":
        block = jax.checkpoint(block)
    elif recompute == "matmuls":
        block = jax.checkpoint(block, policy=save_matmuls)
    if isinstance(params["layers"], list):
        for layer in params["layers"]:
            x, _ = block(x, layer)
    else:
        x, _ = jax.lax.scan(block, x, params["layers"])
    x = shard(cast(layer_norm(x, params["lnf_scale"], params["lnf_bias"])), "residual")
    logits = shard(x @ cast(params["wte"]).T, "last").astype(jnp.float32)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)  # padded ids: no probability
    if layout is not None:
        return vocab_parallel_cross_entropy(logits, targets)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_layout(cfg) -> Layout:
    """--gspmd: a ("model",) mesh of the first --tensor-model-parallel-size devices (check_config checks it)."""
    tp = cfg.parallel.tensor_model_parallel_size
    return Layout(jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("model",)), cfg.parallel.sequence_parallel)


def check_config(cfg, *, gspmd: bool = False, given=()) -> None:
    """Refuses (ValueError, one line), before any device work, a config this baseline would run other than asked:
    a model it does not build, selective recomputation, a dropout given on the command line (`given`: its flags),
    the mesh flags without --gspmd, a mesh --gspmd cannot split; then checks the config on the devices it runs on
    (one, or the first --tensor-model-parallel-size with --gspmd)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    use_memory_fraction()  # train.py's share of GPU memory (no flag here: mtx's 0.9, or the environment's)
    # a preset's model that is not the one built here (the flags that set these are refused as unused)
    blocks = {"--model-type bert": m.is_bert, "--layernorm-placement post": m.layernorm_placement == "post",
              f"--layernorm-epsilon {m.epsilon}": m.epsilon != EPSILON}
    if other := [*m.llama_blocks(), *(flag for flag, on in blocks.items() if on)]:
        raise ValueError(f"plain_gpt.py builds GPT-2's model only, not the preset's {', '.join(other)}; benchmark "
                         "that model with benchmarks/bench.py.")
    if t.recompute_granularity == "selective":
        raise ValueError("plain_gpt.py recomputes whole layers (--recompute-granularity full) or all but the matmuls "
                         "(matmuls), not selective (the attention core); pass one of those.")
    for name in ("hidden_dropout", "attention_dropout"):
        if flag_name(name) in given and getattr(m, name):
            raise ValueError(f"{flag_name(name)} {getattr(m, name)}: plain_gpt.py's model has no dropout; pass 0 "
                             "or drop the flag.")
    tp = p.tensor_model_parallel_size if gspmd else 1
    splits = {"tensor_model_parallel_size": p.tensor_model_parallel_size != 1, "sequence_parallel": p.sequence_parallel,
              "data_parallel_size": p.data_parallel_size not in (-1, 1)}  # (one device's sizes are fine without it)
    refuse_idle(given, [([flag_name(name) for name, on in splits.items() if on], gspmd,
                         "with --gspmd (without it plain_gpt.py runs on one device)", "pass --gspmd too, or drop it.")])
    if gspmd and (p.pipeline_model_parallel_size != 1 or p.data_parallel_size not in (-1, 1)):
        raise ValueError("--gspmd splits layers only (tensor parallelism): pass --pipeline-model-parallel-size 1 "
                         "--data-parallel-size 1.")
    if gspmd and not tp <= jax.device_count():
        raise ValueError(f"--gspmd: --tensor-model-parallel-size {tp} needs {tp} devices, and there are "
                         f"{jax.device_count()}; pass a size of at most {jax.device_count()}.")
    if gspmd and p.sequence_parallel and m.seq_length % tp:  # (heads: validate() checks them)
        raise ValueError(f"--gspmd --sequence-parallel: the sequence length ({m.seq_length}) must divide by "
                         f"--tensor-model-parallel-size {tp}; pass a size that divides it.")
    cfg.replace(data_parallel_size=1, pipeline_model_parallel_size=1, tensor_model_parallel_size=tp).validate(tp)


def make_step(cfg, layout: Layout | None = None):
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[t.compute_dtype]
    flash = t.use_flash_attn and jax.default_backend() == "gpu" and dtype != jnp.float32
    loss = lambda p, tok: loss_fn(p, tok, heads=m.num_attention_heads, dtype=dtype, flash=flash,
                                  recompute=t.recompute_granularity, vocab_size=m.vocab_size, layout=layout)
    decay = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: not jax.tree_util.keystr(path).endswith(("bias']", "scale']")), params)
    clip = [optax.clip_by_global_norm(o.clip_grad)] if o.clip_grad else []  # --clip-grad 0: none, as in mtx
    optimizer = optax.chain(*clip,
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
        params = jax.jit(functools.partial(init_params, vocab=m.padded_vocab_size, positions=m.max_positions,
                                           layers=m.num_layers, d=m.hidden_size, f=m.ffn_size,
                                           std=m.init_method_std))(key)
        if not t.scan_layers:  # one dict per layer, so nothing is sliced out of a stack inside the step; sliced
            # here, outside the jitted draw (with the 480 slices inside it, XLA took minutes to compile it on GPU)
            params["layers"] = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(m.num_layers)]
        return params
    if layout is None:
        return init, optimizer, jax.jit(step, donate_argnums=(0, 1))
    # pinned shardings: left to propagation, a step's outputs come back laid out differently from its inputs
    params = jax.eval_shape(init, jax.random.key(0))
    state = (layout.shardings(params), layout.shardings(jax.eval_shape(optimizer.init, params)))
    replicated = NamedSharding(layout.mesh, P())
    step = jax.jit(step, in_shardings=(*state, replicated), out_shardings=(*state, replicated), donate_argnums=(0, 1))
    return init, optimizer, step


def init_state(init, optimizer, layout: Layout | None, seed: int):
    """(parameters, optimizer state), laid out by `layout` where there is one. The parameters are drawn whole, then
    split: the same weights as the one-device run."""
    params = init(jax.random.key(seed))
    if layout is None:
        return params, jax.jit(optimizer.init)(params)
    params = jax.device_put(params, layout.shardings(params))
    state = jax.eval_shape(optimizer.init, params)
    return params, jax.jit(optimizer.init, out_shardings=layout.shardings(state))(params)


def count_collectives(hlo: str) -> dict:
    """Collective instructions in a compiled program's text, by kind: per program, not per step (a scanned layer's
    appear once, in the loop body; windowed einsum turns gathers and scatters into collective-permutes in loops)."""
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
            for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")}


def measure(cfg, *, steps: int = 10, warmup: int = 3, profile: str | None = None, gspmd: bool = False) -> dict:
    from mtx.metrics import throughput

    check_config(cfg, gspmd=gspmd)
    m, t = cfg.model, cfg.training
    layout = make_layout(cfg) if gspmd else None
    init, optimizer, step = make_step(cfg, layout)
    start = time.perf_counter()
    params, opt_state = init_state(init, optimizer, layout, t.seed)
    jax.block_until_ready(opt_state)
    # on stderr as they happen: a row that runs out of time still shows how far it got
    print(f"plain_gpt: state initialized in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.vocab_size, (t.global_batch_size, m.seq_length + 1)),
                         jnp.int32)
    collectives = None
    if layout is not None:  # compiled once, ahead of time: the program counted is the program timed
        start = time.perf_counter()
        tokens = jax.device_put(tokens, NamedSharding(layout.mesh, P()))
        step = step.lower(params, opt_state, tokens).compile()
        collectives = count_collectives(step.as_text())
        print(f"plain_gpt: step compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    def run_step():
        nonlocal params, opt_state, loss
        params, opt_state, loss = step(params, opt_state, tokens)
        jax.block_until_ready(loss)

    loss = None
    times, summary = time_steps(run_step, steps=steps, warmup=warmup, profile=profile)
    step_s = statistics.median(times)
    devices = layout.mesh.size if layout else 1
    rates = throughput(t.global_batch_size * m.seq_length, step_s, m.flops_per_token(), devices)
    stats = [d.memory_stats() or {} for d in jax.devices()[:devices]]
    return {
        "impl": "plain-jax-gspmd" if layout else "plain-jax", "device": jax.devices()[0].device_kind,
        "devices": devices, "sequence_parallel": bool(layout and layout.sequence_parallel),
        "layers": m.num_layers, "hidden": m.hidden_size,
        "heads": m.num_attention_heads, "seq": m.seq_length, "params": m.num_params(),
        "micro_batch": t.micro_batch_size, "global_batch": t.global_batch_size, "dtype": t.compute_dtype,
        "recompute": t.recompute_granularity, "flash": t.use_flash_attn, "step_s": step_s, "step_s_min": min(times),
        **rates, "peak_mem_gib": max(s.get("peak_bytes_in_use", 0) for s in stats) / 2**30, "loss": float(loss),
        "collectives": collectives, "profile": summary,
    }


def main(argv=None) -> int:
    from mtx.cli import OneLineParser, flags_in

    simulate_cpu_devices()  # --gspmd on CPU
    ap = OneLineParser(prog="plain_gpt.py", add_help=False)  # (run_cli's --help shows it through the description)
    ap.add_argument("--gspmd", action="store_true", help=GSPMD_HELP)
    try:
        own, rest = ap.parse_known_args(argv)
    except ValueError as e:  # --gspmd=VALUE
        print(f"error: {e}", file=sys.stderr)
        return 2
    check = functools.partial(check_config, gspmd=own.gspmd, given=set(flags_in(rest)))
    return run_cli(functools.partial(measure, gspmd=own.gspmd), rest, check, uses=USES, prog="plain_gpt.py",
                   description=f"{__doc__.split(chr(10) * 2)[0]} --gspmd: {GSPMD_HELP}.")


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
