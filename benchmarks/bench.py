"""Time training steps of a preset on a mesh: warm-up, then timed steps on synthetic tokens.

    python benchmarks/bench.py --config configs/gpt_1.2b.toml --micro-batch-size 8 --global-batch-size 8 \
        [--steps 10 --warmup 3 --json out.jsonl --profile TRACE_DIR] [train.py flags of the step: --help lists them]

Prints one JSON line: median step time (each step waited for; `step_s_dispatched`: the mean with the steps dispatched
back to back, as train.py runs them), tokens/s, model TFLOP/s per device and MFU (6N + 12 L D S FLOPs per token,
against 989 TFLOP/s dense bf16 for H100/H200), peak device memory, and the mesh. Data loading is excluded: one
synthetic batch, made once (`synthetic_batch`: random tokens for GPT, BERT's real masking statistics for BERT).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtx.config import STEP_FIELDS  # noqa: E402
from mtx.devices import simulate_cpu_devices  # noqa: E402


def parse_flags(own, argv=None, *, uses, description=None):
    """A benchmark's command line -> (its namespace, the Config of its train.py flags). `own`: a parser of the tool's
    own flags and arguments (a OneLineParser, add_help=False); the other flags are train.py's, of which the tool takes
    those of the fields `uses` and --config, so that --help lists what the tool takes. A train.py flag outside `uses`
    given on the command line is refused as one the benchmark does not use, any other unknown flag with the closest
    one the tool takes: ValueError, one line."""
    import argparse

    from mtx.cli import OneLineParser, build_parser, flags_in, parse_config, with_negative_values

    class TrainFlag(argparse.Action):  # kept as given, for parse_config (which types and checks them)
        def __call__(self, parser, namespace, values, option_string=None):
            values = values if isinstance(values, list) else [values]
            setattr(namespace, self.dest, [*getattr(namespace, self.dest), option_string, *values])

    argv = with_negative_values(argv)
    ap = OneLineParser(prog=own.prog, description=description, parents=[own])
    group = ap.add_argument_group("train.py flags", "those that set the step (any other is refused)")
    train, taken = build_parser(), {"config", *uses}
    for action in train._actions:
        if action.dest in taken:
            group.add_argument(*action.option_strings, nargs=action.nargs, metavar=action.metavar, help=action.help,
                               dest="train_flags", default=[], action=TrainFlag)
    _, extras = ap.parse_known_args(argv)  # --help: the tool's flags, printed
    train_flags = {s for action in train._actions for s in action.option_strings}
    if unused := [flag for flag in flags_in(extras) if flag in train_flags]:
        raise ValueError(f"{unused[0]} is a train.py flag the benchmark does not use (it builds the training step "
                         "of random weights on synthetic batches); drop it.")
    args = ap.parse_args(argv)  # an unknown flag: "did you mean" the closest one the tool takes
    return args, parse_config(args.train_flags, prog=own.prog)


def build_step(cfg):
    """-> (model, its training step) on the mesh the flags ask for, the config checked against the devices there
    are (vocab_size as configured, GPT-2's 50,257 by default: the tokens are synthetic). Compiles nothing."""
    import jax

    from mtx.parallel.mesh import make_mesh
    from mtx.sharded_model import ShardedModel
    from mtx.step import TrainStep

    p = cfg.parallel
    cfg.validate(len(jax.devices()))
    model = ShardedModel(cfg, make_mesh(p.data_parallel_size, p.pipeline_model_parallel_size,
                                        p.tensor_model_parallel_size))
    return model, TrainStep(model)


def measure(cfg, *, steps: int = 10, warmup: int = 3, profile: str | None = None) -> dict:
    import jax

    from mtx.devices import use_compilation_cache
    from mtx.metrics import throughput

    if jax.default_backend() != "cpu":  # as train.py
        use_compilation_cache(cfg.training.compilation_cache_dir)
    model, train_step = build_step(cfg)
    mesh = model.mesh
    state = train_step.init_state()
    t, m = cfg.training, cfg.model
    batch = synthetic_batch(cfg)
    tokens = model.put_batch(batch)

    def run_step():
        nonlocal state, metrics
        state, metrics = train_step(state, tokens)
        jax.block_until_ready(metrics)

    metrics = None
    start = time.perf_counter()
    run_step()  # the first step: compilation and one step
    first_step_s = time.perf_counter() - start
    times, summary = time_steps(run_step, steps=steps, warmup=max(warmup - 1, 0), profile=profile)
    step_s = statistics.median(times)
    # As train.py runs them: the steps dispatched back to back, one wait at the end (between blocked steps the device
    # idles while the host dispatches the next one, which a short step feels).
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = train_step(state, tokens)
    jax.block_until_ready(metrics)
    dispatched_s = (time.perf_counter() - start) / steps
    rates = throughput(t.global_batch_size * m.seq_length, step_s, m.flops_per_token(cfg.mlm_positions), mesh.size)
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    return {
        "mesh": dict(mesh.shape), "device": jax.devices()[0].device_kind, "layers": m.num_layers,
        "hidden": m.hidden_size, "heads": m.num_attention_heads, "seq": m.seq_length,
        "params": m.num_params(), "micro_batch": t.micro_batch_size, "global_batch": t.global_batch_size,
        "microbatches": model.num_microbatches, "dtype": t.compute_dtype,
        "recompute": t.recompute_granularity, "recompute_method": t.recompute_method,
        "recompute_num_layers": t.recompute_num_layers, "first_step_s": first_step_s, "step_s": step_s,
        "step_s_min": min(times),
        "step_s_dispatched": dispatched_s,
        **rates, "peak_mem_gib": max((s.get("peak_bytes_in_use", 0) for s in stats), default=0) / 2**30,
        "loss": float(metrics["loss"]), "profile": summary,
        "padding": None if not m.is_bert else float(1 - batch["padding_mask"].mean()),  # BERT: the batch's padding
        "pipeline": None if model.pipeline is None else {
            "schedule": model.pipeline.kind, "stages": model.pipeline.stages, "virtual": model.pipeline.virtual,
            "microbatches": model.pipeline.microbatches, "ideal_bubble": model.pipeline.bubble},
    }


def synthetic_batch(cfg):
    """One global batch of synthetic data. GPT: random token ids. BERT: sentence pairs cut by mtx's own sample
    builder (mtx/data/bert_dataset.py: Megatron's targets, 10% short samples and their padding, whole-word n-gram
    masking of 15%) of random documents over a made-up WordPiece vocabulary of the config's size, a fifth of it "##"
    continuations as in BERT's, so the step sees BERT's real masking and padding statistics."""
    import tempfile

    import numpy as np

    t, m = cfg.training, cfg.model
    rng = np.random.default_rng(0)
    if not m.is_bert:
        return rng.integers(0, m.vocab_size, (t.global_batch_size, m.seq_length + 1)).astype(np.int32)
    from mtx.data.bert_dataset import BertDataset
    from mtx.data.tokenizer import BertWordPieceTokenizer

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [f"##p{i}" if i % 5 == 0 else f"p{i}" for i in range(m.vocab_size - len(special))]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as vocab:
        vocab.write("\n".join(special + pieces) + "\n")
        vocab.flush()
        tokenizer = BertWordPieceTokenizer(vocab.name, fast=False)
    # Documents of 10-60 sentences of 8-48 tokens (~1,000 tokens): about two samples each, the last one short;
    # 2 x the batch of them is enough.
    per_doc = rng.integers(10, 61, 2 * t.global_batch_size)
    sentences = rng.integers(8, 49, int(per_doc.sum()))
    offsets, doc_idx = np.concatenate([[0], np.cumsum(sentences)]), np.concatenate([[0], np.cumsum(per_doc)])
    tokens = rng.integers(len(special), m.vocab_size, offsets[-1]).astype(np.int32)
    data = BertDataset(tokens, offsets, doc_idx, seq_length=m.seq_length, tokenizer=tokenizer, seed=0, split="1,0,0",
                       mask_prob=cfg.data.mask_prob, short_seq_prob=cfg.data.short_seq_prob,
                       binary_head=m.bert_binary_head, source="synthetic documents")
    return data.batch("train", 0, t.global_batch_size)


def time_steps(run_step, *, steps: int, warmup: int, profile: str | None = None):
    """`warmup` calls, then `steps` timed calls of run_step() (each blocks until its step is done) -> (seconds of
    each, profile summary or None). With `profile`, 2 more steps are traced into that directory and summarized
    (after the timed steps, so tracing never slows what is reported; their busy time against their own wall time)."""
    for _ in range(warmup):
        run_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - start)
    summary = None
    if profile:
        from benchmarks.profile_summary import capture, format_summary

        summary = capture(run_step, profile)
        print(format_summary(summary, summary["step_ms"]), file=sys.stderr, flush=True)
    return times, summary


def run_cli(measure_fn, argv=None, check=None, *, uses=None, prog="bench.py", description=None) -> int:
    """--steps/--warmup/--json/--profile, the rest train.py flags (those of the fields `uses`, default
    STEP_FIELDS) -> one JSON line on stdout (and appended to --json); a bad flag, or a config that `check` refuses
    (ValueError), is one line on stderr and exit status 2."""
    from mtx.cli import COUNT, WARMUP, OneLineParser, ranged
    from mtx.files import check_json_lines, check_writable, json_line, refuse_empty

    ap = OneLineParser(prog=prog, add_help=False)
    ap.add_argument("--steps", type=ranged(int, COUNT), default=10, help="timed steps (default: %(default)s)")
    ap.add_argument("--warmup", type=ranged(int, WARMUP), default=3,
                    help="steps run before the timed ones, the first compiling (default: %(default)s)")
    ap.add_argument("--json", default=None, metavar="FILE", help="append the result line to this file")
    ap.add_argument("--profile", default=None, metavar="DIR", help="trace 2 more steps into this directory and "
                    "summarize them (train.py's --profile switch is not taken here)")
    try:
        own, cfg = parse_flags(ap, argv, uses=STEP_FIELDS if uses is None else uses, description=description)
        for flag, value, fix in (("--json", own.json, "a file to append the results to"),
                                 ("--profile", own.profile, "a directory for the trace")):
            refuse_empty(value, flag, f"{fix}, or drop {flag}")  # once ignored: no results file, no trace
        if own.json:  # appended to: an existing file of results is fine, any other file refused
            check_json_lines(own.json, "--json", ("step_s",))
        if own.profile:
            check_writable(own.profile, "--profile")
        if check is not None:
            check(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = measure_fn(cfg, steps=own.steps, warmup=own.warmup, profile=own.profile)
    line = json_line(result)
    if own.json:  # (on disk first: a reader of the output that goes away loses nothing)
        with open(own.json, "a") as fh:
            fh.write(line + "\n")
    print(line, flush=True)
    return 0


def check_mesh(cfg) -> None:
    """The mesh against the devices there are (measure's own check), before any device work; first the GPU memory
    share (--gpu-memory-fraction), as train.py sets it."""
    import jax

    from mtx.devices import use_memory_fraction

    use_memory_fraction(cfg.training.gpu_memory_fraction)
    cfg.validate(len(jax.devices()))


def main(argv=None) -> int:
    simulate_cpu_devices()
    # (measure reads the compilation cache on GPUs, as train.py does)
    return run_cli(measure, argv, check=check_mesh, uses=(*STEP_FIELDS, "compilation_cache_dir"),
                   description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
