"""Communication audit: the collectives XLA actually compiles for one transformer layer and for the loss.

The Megatron paper (section 3, Fig. 4) promises exactly four all-reduces of b*s*h elements per layer over the
tensor-parallel group: two forward (the `g` after attention and after the MLP) and two backward (the `f` before
them), nothing else. This module checks the promise on the compiled program rather than on the source: it lowers
one `TransformerLayer` inside `jax.shard_map` over a (data, 1, model) mesh, compiles it, reads the optimized HLO
text and counts every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute, with the mesh
axes its replica groups span and the elements it moves (its result shape; summed over tuple results).

It compiles twice, forward alone and forward+backward (the gradient w.r.t. the layer input and all parameters of
sum(y * dy) for an arbitrary cotangent dy, the loss value kept alive so no forward collective is dead code), and
reports backward = (forward+backward) - forward. As in mtx/step.py, parameters are cast to varying over "data"
before differentiating, so no data-parallel gradient reduction appears inside the layer: in training it happens
once per step, not per layer. The vocab-parallel cross-entropy is audited the same way (`audit_loss`); its
collectives should move O(b*s) elements each, never the b*s*v logits.

Counts are static: a collective inside a loop body counts once. The audit compiles with XLA's all-reduce combiner
off (`cpu-all-reduce-combiner`, `gpu-all-reduce-combiner`; per compilation through `compiler_options`, not
process-wide XLA_FLAGS). The combiner merges independent all-reduces into one tuple all-reduce: the same bytes in
fewer launches, a scheduling choice rather than the algorithm's communication. On a lone layer it even merges the
MLP's forward `g` with its own backward `f` (nothing downstream waits for the layer's output, unlike in a stack),
and in the loss it merges the sum-of-exponentials and target-logit psums; left on, it would hide the per-op counts.

Runs on CPU with simulated devices (tp x dp x pp of them unless XLA_FLAGS already sets a count); JAX_PLATFORMS=cuda
audits the GPU compilation instead (async start/done pairs count once; same counts on 2 H200s at tp = 2).

    python -m mtx.audit --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
        --micro-batch-size 4 --tensor-model-parallel-size 8 [--json]
"""

from __future__ import annotations

from collections import Counter
import json
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.hlo import KINDS, collectives, loop_collectives, summarize
from mtx.models.stack import save_matmul_outputs
from mtx.models.transformer import TransformerLayer
from mtx.architecture import ADDED_FIELDS
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.mesh import DATA, MODEL, make_mesh
from mtx.parallel.sharded import named_shardings, partition_specs, replicated_groups

# The model's blocks beyond GPT-2's (mtx/architecture.py: Llama's, the activations' fusions), taken as train.py does.
BLOCKS = sorted(ADDED_FIELDS)
_NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner,gpu-all-reduce-combiner"}  # see the docstring


# ---- what is compiled ----

def audit_config(*, hidden_size: int, num_attention_heads: int, seq_length: int, micro_batch_size: int,
                 tensor_model_parallel_size: int, data_parallel_size: int = 1, ffn_hidden_size: int | None = None,
                 recompute_granularity: str | None = None, vocab_size: int = 50257,
                 pipeline_model_parallel_size: int = 1, num_layers: int | None = None,
                 num_microbatches: int | None = None, num_devices: int | None = None,
                 sequence_parallel: bool = False, pipeline_schedule: str = "1f1b",
                 virtual_pipeline_model_parallel_size: int | None = None,
                 use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False, tp_comm_overlap: bool = False, **blocks) -> Config:
    """The validated Config of one audit (dropout off: its masks would add no communication, only noise).

    blocks: the fields of the model's blocks (`BLOCKS`: --swiglu, --group-query-attention, ...), GPT-2's by default,
    and of the pipeline's layout (--pipeline-model-parallel-layout, --num-layers-in-first-pipeline-stage, ...).

    With pipeline stages, the step holds num_microbatches (default 2 x stages) microbatches per data rank and
    num_layers (default 2 x stages x virtual stages) layers."""
    pp, dp = pipeline_model_parallel_size, max(data_parallel_size, 1)
    if num_microbatches is not None and pp == 1 and data_parallel_size == 1:  # only the layer: one micro batch
        raise ValueError("--num-microbatches sets the microbatches of the pipelined step or of the data-parallel "
                         "one's accumulation; pass --pipeline-model-parallel-size or --data-parallel-size 2 or more "
                         "with it, or leave it out.")
    m = num_microbatches or (2 * pp if pp > 1 else 1)
    return Config().replace(
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, seq_length=seq_length,
        micro_batch_size=micro_batch_size, global_batch_size=micro_batch_size * dp * m,
        tensor_model_parallel_size=tensor_model_parallel_size, data_parallel_size=data_parallel_size,
        pipeline_model_parallel_size=pp, num_layers=num_layers or 2 * pp * (virtual_pipeline_model_parallel_size or 1),
        pipeline_schedule=pipeline_schedule, virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        ffn_hidden_size=ffn_hidden_size, recompute_granularity=recompute_granularity, vocab_size=vocab_size,
        hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sequence_parallel,
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather, tp_comm_overlap=tp_comm_overlap, **blocks,
    ).validate(len(jax.devices()) if num_devices is None else num_devices)


def _mesh(cfg: Config, *, pipeline: bool = False):
    p = cfg.parallel
    return make_mesh(cfg.data_parallel_size(len(jax.devices())), p.pipeline_model_parallel_size if pipeline else 1,
                     p.tensor_model_parallel_size)


def _audit(mesh, forward, forward_backward, args, *, hlo: list | None = None) -> dict:
    """Collectives of forward and forward+backward (backward = the difference); `hlo` receives their HLO texts."""
    sizes = dict(mesh.shape)
    compiled = [jax.jit(fn).lower(*args).compile(compiler_options=_NO_COMBINER).as_text()
                for fn in (forward, forward_backward)]
    if hlo is not None:
        hlo.extend(compiled)
    return summarize(*(collectives(text, sizes) for text in compiled))


def audit_layer(cfg: Config) -> dict:
    """Collectives of one TransformerLayer, forward and backward, local batch b = micro_batch_size (split over
    "model" by rows with sequence parallelism)."""
    mesh = _mesh(cfg)
    recompute = cfg.training.recompute_granularity
    sp = cfg.sequence_parallel
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TransformerLayer(
        cfg.model, dtype=jnp.float32, rngs=nnx.Rngs(0), selective_recompute=recompute == "selective",
        sequence_parallel=sp, tp_comm_overlap=cfg.tp_comm_overlap, recompute_elementwise=recompute == "matmuls")))
    tp = mesh.shape[MODEL]
    specs = partition_specs(abstract, tp)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, named_shardings(abstract, mesh))
    m, t = cfg.model, cfg.training
    rows = P((DATA, MODEL)) if sp else P(DATA)  # each data rank's rows, with sp split again over "model"
    x = jax.ShapeDtypeStruct((t.micro_batch_size * mesh.shape[DATA], m.seq_length, m.hidden_size), jnp.float32,
                             sharding=NamedSharding(mesh, rows))

    grad_axes = jax.tree.map(lambda spec, local: (DATA, MODEL) if (sp or local) and MODEL not in spec else (DATA,),
                             specs, replicated_groups(abstract, tp), is_leaf=lambda s: isinstance(s, P))

    def layer(p, x_BSD):
        return nnx.merge(graphdef, p)(x_BSD)

    if recompute == "full":  # keep the layer input only; the backward recomputes the rest (as GPT does per layer)
        layer = jax.checkpoint(layer)
    elif recompute == "matmuls":
        layer = jax.checkpoint(layer, policy=save_matmul_outputs)

    def forward(p, x_BSD, dy_BSD):
        return layer(p, x_BSD)

    def forward_backward(p, x_BSD, dy_BSD):
        # No all-reduce per layer over "data", nor (sequence parallelism) of the replicated LayerNorm/bias gradients
        # or of replicated key/value groups over "model": the training step sums them once per step (mtx/step.py,
        # gradient_axes).
        p = jax.tree.map(lambda v, axes: jax.lax.pcast(v, axes, to="varying"), p, grad_axes)
        loss, (dp, dx) = jax.value_and_grad(lambda p, x: jnp.sum(layer(p, x) * dy_BSD), argnums=(0, 1))(p, x_BSD)
        return loss[None], jax.tree.map(lambda g: g[None], dp), dx

    # leading axis: one gradient per rank it varies over
    with_data = jax.tree.map(lambda s, axes: P(axes, *s), specs, grad_axes, is_leaf=lambda s: isinstance(s, P))
    return _audit(mesh,
                  jax.shard_map(forward, mesh=mesh, in_specs=(specs, rows, rows), out_specs=rows),
                  jax.shard_map(forward_backward, mesh=mesh, in_specs=(specs, rows, rows),
                                out_specs=(rows, with_data, rows)),
                  (params, x, x))


def audit_loss(cfg: Config) -> dict:
    """Collectives of vocab_parallel_cross_entropy on logits (b, s, V / tp) per rank, forward and backward."""
    mesh = _mesh(cfg)
    m, t = cfg.model, cfg.training
    b, s, v = t.micro_batch_size * mesh.shape[DATA], m.seq_length, m.padded_vocab_size
    logits = jax.ShapeDtypeStruct((b, s, v), jnp.float32, sharding=NamedSharding(mesh, P(DATA, None, MODEL)))
    targets = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=NamedSharding(mesh, P(DATA)))
    weights = jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=NamedSharding(mesh, P(DATA)))
    ce = lambda z, y: vocab_parallel_cross_entropy(z, y, label_smoothing=m.label_smoothing)

    def forward(z, y, w):
        return ce(z, y)

    def forward_backward(z, y, w):
        loss, dz = jax.value_and_grad(lambda z: jnp.sum(ce(z, y) * w))(z)
        return loss[None], dz

    specs = (P(DATA, None, MODEL), P(DATA), P(DATA))
    return _audit(mesh, jax.shard_map(forward, mesh=mesh, in_specs=specs, out_specs=P(DATA)),
                  jax.shard_map(forward_backward, mesh=mesh, in_specs=specs, out_specs=(P(DATA), specs[0])),
                  (logits, targets, weights))


def audit_pipeline(cfg: Config) -> dict:
    """Collectives of a whole pipelined training step's loss and gradients (mtx/step.py), with the pipeline's
    shifts counted per step: the collective-permutes over "pipeline" in the body of a tick scan run once a tick.
    GPipe: one in the body of the tick scan, which runs M + P - 1 times forward and again backward. 1F1B /
    interleaved: two in the body of one scan of forward and backward slots (the activations to the next stage, the
    input gradients to the previous one), and the head's collectives over "pipeline" once a microbatch (the last
    stage's output sent to every stage, the loss's three sums over the stages' vocabulary shares, the gradients wrt
    that output sent back; GPT, mtx/parallel/one_f_one_b.py). Outside the ticks, uneven or virtual stages move the
    layers stored on another device into each device's chunk slots, and their gradients back, once a step
    (`layer exchange`)."""
    from mtx.sharded_model import ShardedModel
    from mtx.step import TrainStep

    mesh = _mesh(cfg, pipeline=True)
    model = ShardedModel(cfg, mesh)
    train_step = TrainStep(model)
    state = train_step.abstract_state()
    t, m = cfg.training, cfg.model
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, m.seq_length + 1), jnp.int32, sharding=model.batch_sharding)
    forward = lambda p, x, step: train_step.loss_and_grads(p, x, step)[0]  # the backward is dead code here
    hlo = []
    report = _audit(mesh, forward, train_step.loss_and_grads, (state.params, tokens, state.step), hlo=hlo)
    schedule = model.pipeline
    report["schedule"] = {"schedule": schedule.kind, "stages": schedule.stages, "virtual_stages": schedule.virtual,
                          "microbatches": schedule.microbatches, "layers_per_stage": list(schedule.counts),
                          "ticks": schedule.ticks, "ideal_bubble": schedule.bubble}
    permutes = lambda ops: Counter(op for op in ops if op[:2] == ("collective-permute", "pipeline"))
    sizes = dict(mesh.shape)
    every, ticked = [permutes(collectives(text, sizes)) for text in hlo], [permutes(loop_collectives(text, sizes))
                                                                         for text in hlo]
    if schedule.kind == "gpipe":  # backward = (forward + backward) - forward, as everywhere in the audit
        phases = {"forward": ticked[0], "backward": ticked[1] - ticked[0]}
    else:  # one program: the backward is not dead code in the loss-only compile
        phases = {"forward and backward": ticked[1]}
    report["per_step"] = {phase: {"collective-permute pipeline": ops.total() * schedule.ticks,
                                  "elements_each": sorted({op[2] for op in ops})} for phase, ops in phases.items()}
    head = Counter()  # the head spread over the stages: its collectives over "pipeline", once a microbatch
    if schedule.kind != "gpipe":
        head = Counter(op for op in loop_collectives(hlo[1], sizes, branches=True) if "pipeline" in op[1].split(","))
        if head:
            tally = Counter()
            for (kind, axes, _), n in head.items():
                tally[f"{kind} {axes}"] += n * schedule.microbatches
            report["per_step"]["head"] = {**tally, "elements_each": sorted({op[2] for op in head})}
    exchange = every[1] - ticked[1] - permutes(head.elements())  # the head's sends are not the layers'
    report["layer_exchange"] = {"collective-permute pipeline": exchange.total(),
                                "elements": sum(op[2] * n for op, n in exchange.items())}
    return report


def audit_data_parallel(cfg: Config) -> dict:
    """The collectives over "data" of a whole training step's loss and gradients: one all-reduce of the gradients
    (parameters replicated over "data"), or with the distributed optimizer a reduce-scatter of the gradients and an
    all-gather of the parameters (each once per step and parameter; the layer stack is one parameter per weight).
    With --overlap-grad-reduce (and --overlap-param-gather) the layer stack's move into the scanned layer's forward
    and backward bodies, run once a layer: `in_layer_loop` counts those (static counts, once per body); with gradient
    accumulation too, `in_loop_branches` counts those in the last microbatch's branch of the accumulation loop."""
    from mtx.step import TrainStep

    mesh = _mesh(cfg, pipeline=True)
    state = (train_step := TrainStep.build(cfg, mesh)).abstract_state()
    t, m = cfg.training, cfg.model
    tokens = jax.ShapeDtypeStruct((t.global_batch_size, m.seq_length + 1), jnp.int32,
                                  sharding=train_step.model.batch_sharding)
    forward = lambda p, x, step: train_step.loss_and_grads(p, x, step)[0]
    hlo = []
    report = _audit(mesh, forward, train_step.loss_and_grads, (state.params, tokens, state.step), hlo=hlo)
    ops = [op for phase in ("forward", "backward") for op in report["ops"][phase] if op["axes"] == DATA]
    for key, branches in (("in_layer_loop", False), ("in_loop_branches", True)):
        report[key] = dict(Counter(kind for kind, axes, _ in loop_collectives(hlo[1], dict(mesh.shape),
                                                                              branches=branches) if axes == DATA))
    report["data"] = {kind: {"ops": sum(op["kind"] == kind for op in ops),
                             "elements": sum(op["elements"] for op in ops if op["kind"] == kind)}
                      for kind in KINDS if any(op["kind"] == kind for op in ops)} | {
                          "parameters": sum(x.size for x in jax.tree.leaves(state.params))}
    return report


# ---- command line ----

def _table(title: str, report: dict) -> str:
    keys = sorted(set(report["by_axis"]["forward"]) | set(report["by_axis"]["backward"]))
    lines = [title, f"  {'collective':<28}{'fwd ops':>8}{'fwd elements':>16}{'bwd ops':>9}{'bwd elements':>16}"]
    for k in keys:
        row = [report[t][p].get(k, 0) for p in ("forward", "backward") for t in ("by_axis", "elements")]
        lines.append(f"  {k:<28}{row[0]:>8}{row[1]:>16,}{row[2]:>9}{row[3]:>16,}")
    return "\n".join(lines if keys else lines[:1] + ["  no collectives"])


# The audit lists every choice itself, whatever the schema's help abbreviates.
_RECOMPUTE_HELP = ("activations the backward recomputes: none (keep them all), full (keep each layer's input, "
                   "recompute the layer), selective (recompute the attention core), matmuls (keep the matmul, "
                   "attention and all-reduce outputs; recompute LayerNorm, GeLU, bias adds and dropout)")


def build_parser():
    """`python -m mtx.audit`'s parser: train.py's model and mesh flags (mtx/cli.py) with the audit's own defaults,
    each shown in --help."""
    from mtx.cli import OneLineParser, add_config_flags, ranged

    ap = OneLineParser(prog="python -m mtx.audit", description=__doc__.split("\n\n")[0],
                       epilog="Example: python -m mtx.audit --tensor-model-parallel-size 4 --data-parallel-size 2 "
                              "--recompute-granularity matmuls --sequence-parallel")
    # One data rank, and a layer count that follows the pipeline stages.
    fields = ("hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "tensor_model_parallel_size",
              "data_parallel_size", "ffn_hidden_size", "recompute_granularity", "vocab_size",
              "pipeline_model_parallel_size", "num_layers")
    helps = {"pipeline_model_parallel_size": "PP; > 1 also audits a whole pipelined step (its activation ppermutes)",
             "num_layers": "layers of the pipelined step; None: 2 x stages x virtual stages",
             "recompute_granularity": _RECOMPUTE_HELP}
    add_config_flags(ap, fields, defaults={"data_parallel_size": 1, "num_layers": None}, helps=helps)
    add_config_flags(ap, ("pipeline_schedule", "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
                          "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"), defaults={})
    ap.add_argument("--num-microbatches", type=ranged(int, ">= 1"), metavar="INT",
                    help="per data rank (default: 2 x stages)")
    add_config_flags(ap, ("sequence_parallel", "tp_comm_overlap", "use_distributed_optimizer", "overlap_grad_reduce",
                          "overlap_param_gather"), defaults={})
    add_config_flags(ap, BLOCKS, defaults={})
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return ap


def main(argv: list[str] | None = None) -> int:
    from mtx.cli import flags_in, unset_nones, with_negative_values
    from mtx.flag_rules import check_unused_flags
    from mtx.config import FIELD_SECTION
    from mtx.devices import devices, simulate_cpu_devices

    argv = with_negative_values(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Simulated CPU devices, one per mesh position (unless XLA_FLAGS sets a count): XLA reads the count when the CPU
    # backend starts (the first device query below), not when jax is imported.
    if simulate_cpu_devices(max(a.tensor_model_parallel_size, 1) * max(a.data_parallel_size, 1)
                            * max(a.pipeline_model_parallel_size, 1)):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = unset_nones({k: v for k, v in vars(a).items() if k != "json"})  # --recompute-granularity none, as train.py
    try:
        devices()  # a backend JAX cannot start (JAX_PLATFORMS, XLA_FLAGS): one line, not a traceback
        cfg = audit_config(**flags)
        given = set(flags_in(argv))  # a flag whose feature is off would audit nothing of it, as train.py refuses
        check_unused_flags(cfg, {action.dest for action in parser._actions
                                 if given & set(action.option_strings) and action.dest in FIELD_SECTION})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = cfg.model
    flags.update(data_parallel_size=cfg.data_parallel_size(len(jax.devices())), ffn_hidden_size=m.ffn_size,
                 padded_vocab_size=m.padded_vocab_size)
    report = {"config": flags, **audit_layer(cfg), "loss": audit_loss(cfg)}
    if cfg.parallel.pipeline_model_parallel_size > 1:
        report["pipeline"] = audit_pipeline(cfg)
    if flags["data_parallel_size"] > 1:
        report["data_parallel"] = audit_data_parallel(cfg)
    if a.json:
        print(json.dumps(report))
    else:
        print(_table(f"TransformerLayer  D={m.hidden_size} N={m.num_attention_heads} F={m.ffn_size} S={m.seq_length} "
                     f"b={cfg.training.micro_batch_size} tp={flags['tensor_model_parallel_size']} "
                     f"dp={flags['data_parallel_size']} fp32 recompute={flags['recompute_granularity'] or 'none'} "
                     f"sequence-parallel={'on' if cfg.sequence_parallel else 'off'} "
                     f"blocks={' '.join(m.llama_blocks()) or 'GPT-2'}",
                     report))
        print(_table(f"vocab-parallel cross-entropy  V={m.padded_vocab_size}", report["loss"]))
        if "pipeline" in report:
            pipe = report["pipeline"]
            sch = pipe["schedule"]
            print(_table(f"pipelined step ({sch['schedule']})  P={sch['stages']} V={sch['virtual_stages']} "
                         f"M={sch['microbatches']} layers={sch['layers_per_stage']} ticks={sch['ticks']} "
                         "(static counts; loop bodies count once)", pipe))
            for phase, row in pipe["per_step"].items():
                print(f"  per step, {phase}: {row['collective-permute pipeline']} collective-permutes over pipeline "
                      f"of {row['elements_each']} elements each")
            exchange = pipe["layer_exchange"]
            if exchange["collective-permute pipeline"]:
                print(f"  per step, layer exchange (chunk slots and their gradients): "
                      f"{exchange['collective-permute pipeline']} collective-permutes, "
                      f"{exchange['elements']:,} elements")
        if "data_parallel" in report:
            data = report["data_parallel"]["data"]
            kind = "distributed" if cfg.parallel.use_distributed_optimizer else "replicated"
            print(f"training step over data ({kind} optimizer, {data['parameters']:,} parameters):")
            for kind, row in data.items():
                if kind != "parameters":
                    print(f"  {kind:<16}{row['ops']:>5} ops {row['elements']:>16,} elements")
            if loop := report["data_parallel"]["in_layer_loop"]:
                print("  in the layer loop (once a layer): " + ", ".join(f"{n} {k}" for k, n in sorted(loop.items())))
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
