"""Evaluate a trained GPT with Megatron-LM's flags: `python eval.py {wikitext,lambada,generate} --help`.

wikitext: perplexity with overlapping windows, normalized by WikiText's original token count (paper, appendix E).
lambada: last-word accuracy, every subword the argmax. generate: sample continuations of --prompt.
Each prints one JSON object on stdout (progress bars go to stderr); bad input fails with `error: ...` and exit
code 2 before any device work. Without an accelerator it runs on 8 simulated CPU devices.
"""

import sys

from mtx.errors import script_needs

script_needs("jax", "pip install -e . here first; '.[cuda12]' for NVIDIA GPUs", __name__)  # (else a traceback)

from mtx.cli import (OneLineParser, add_config_flags, flags_in, ranged, subcommand,  # noqa: E402
                     with_negative_values)
from mtx.flag_rules import refuse_idle  # noqa: E402
from mtx.devices import simulate_cpu_devices  # noqa: E402
from mtx.files import expand_home, json_line  # noqa: E402

simulate_cpu_devices(8)  # without an accelerator; a GPU host still lists its GPUs


# The checkpoint, tokenizer, mesh and process flags every task takes, from the config schema (mtx/cli.py). Unset,
# they mean "as the checkpoint was saved" where the checkpoint has a say: its micro batch, its tokenizer, its step.
_COMMON_FIELDS = ("load", "ckpt_step", "vocab_file", "merge_file", "tokenizer_type", "tokenizer_model",
                  "micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "data_parallel_size", "bf16", "coordinator_address", "num_processes", "process_id",
                  "distributed_timeout", "distributed_timeout_minutes")
_COMMON_DEFAULTS = {"micro_batch_size": None, "tensor_model_parallel_size": 1, "bf16": None}
_COMMON_HELPS = {
    "load": "checkpoint directory (written by train.py --save)",
    "ckpt_step": "checkpoint step to load; None: the latest",
    "vocab_file": "GPT-2 encoder.json; None: the checkpoint's tokenizer",
    "merge_file": "GPT-2 vocab.bpe; None: the checkpoint's tokenizer",
    "tokenizer_type": "GPT2BPETokenizer | BertWordPieceLowerCase | HuggingFaceTokenizer | NullTokenizer | byte; "
                      "None: by the files given, or the checkpoint's tokenizer",
    "tokenizer_model": "HuggingFaceTokenizer: a local directory holding tokenizer.json, or that file; None: the "
                       "checkpoint's",
    "micro_batch_size": "sequences per data-parallel rank and batch; None: the checkpoint's",
    "bf16": "bf16 compute (--no-bf16: float32); None: the checkpoint's precision",
}


def build_parser() -> OneLineParser:
    """eval.py's parser: one subcommand a task, each with the common flags and its own."""
    def common(fields):
        flags = OneLineParser(add_help=False)
        add_config_flags(flags, fields, defaults=_COMMON_DEFAULTS, helps=_COMMON_HELPS)
        return flags

    scoring = common(_COMMON_FIELDS)
    generating = common(tuple(f for f in _COMMON_FIELDS if f != "micro_batch_size"))  # every prompt in one batch
    parser = OneLineParser(prog="eval.py", reads_checkpoint=True, description=__doc__.splitlines()[0],
                           epilog="`python eval.py TASK --help` lists the flags of a task, with their defaults.")
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK", title="tasks")

    def task(name: str, summary: str):  # -> the group of the task's own flags, listed after the common ones
        sub = tasks.add_parser(name, parents=[generating if name == "generate" else scoring], help=summary,
                               description=f"{name}: {summary}.")
        return sub.add_argument_group(f"{name} flags")

    wiki = task("wikitext", "WikiText perplexity with overlapping windows, normalized by the original token count")
    wiki.add_argument("--data-path", required=True, metavar="FILE", type=expand_home,
                      help="word-level WikiText file, e.g. wiki.test.tokens (required)")
    wiki.add_argument("--seq-length", type=ranged(int, ">= 1"), metavar="INT",
                      help="window length S (default: the model's)")
    wiki.add_argument("--overlapping-eval", type=ranged(int, ">= 1"), metavar="INT",
                      help="tokens each window advances and scores (default: 32, or S if shorter)")
    wiki.add_argument("--no-detokenize", action="store_true",
                      help="score the raw word-level text (default: detokenize it with the paper's rules)")
    wiki.add_argument("--dry-run", action="store_true", help="only count tokens and windows, with no model")
    lam = task("lambada", "LAMBADA last-word accuracy (every subword of the last word the argmax)")
    lam.add_argument("--data-path", required=True, metavar="FILE", type=expand_home,
                     help='.jsonl of {"text": ...} lines (required)')
    lam.add_argument("--seq-length", type=ranged(int, ">= 1"), metavar="INT",
                     help="longest window (default: the model's)")
    gen = task("generate", "sample continuations of --prompt (KV-cached)")
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                     help="prompt text; repeat the flag for a batch (required)")
    gen.add_argument("--max-new-tokens", type=ranged(int, "[1, 65536]"), default=64, metavar="INT",
                     help="tokens to generate per prompt (default: %(default)s)")
    gen.add_argument("--temperature", type=ranged(float, ">= 0"), default=1.0, metavar="FLOAT",
                     help="softmax temperature; 0 is greedy (default: %(default)s)")
    gen.add_argument("--top-k", type=ranged(int, ">= 0"), default=0, metavar="INT",
                     help="sample among the k likeliest tokens; 0: no top-k filter (default: %(default)s)")
    gen.add_argument("--top-p", type=ranged(float, "(0, 1]"), default=1.0, metavar="FLOAT",
                     help="nucleus sampling; 1: no filter (default: %(default)s)")
    gen.add_argument("--seed", type=ranged(int, ">= 0"), default=0, metavar="INT",
                     help="sampling seed (default: %(default)s)")
    return parser


def idle_rules(parser, args) -> list:
    """The flags that a task, as the others set it, would not read: mtx.flag_rules.refuse_idle's rules. A flag given
    at its default (`--top-k 0`, `--top-p 1`: their off settings; the defaults are `parser`'s) is let be, as
    train.py lets a preset's feature be turned off."""
    task = subcommand(parser, [args.task])

    def changed(*flags):  # those of `flags` whose value is not the task's default
        return [f for f in flags if getattr(args, dest := f[2:].replace("-", "_")) != task.get_default(dest)]

    rules = [(changed("--distributed-timeout", "--distributed-timeout-minutes"), args.coordinator_address is not None,
              "with several processes (--coordinator-address)", "pass that too, or leave it out.")]
    if args.task == "wikitext":  # a dry run reads the checkpoint's config (tokenizer, sequence length), no model
        rules.append(([*changed("--micro-batch-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                "--data-parallel-size"), *(["--bf16", "--no-bf16"] if args.bf16 is not None else [])],
                      not args.dry_run, "with a model, not with --dry-run (which counts tokens and windows)",
                      "leave it out."))
    if args.task == "generate":
        rules.append((changed("--top-k", "--top-p", "--seed"), args.temperature > 0,
                      "with a --temperature above 0 (0 is greedy: nothing is sampled)",
                      "drop it, or pass a temperature above 0."))
    return rules


def main(argv=None) -> int:
    from mtx.devices import devices, use_memory_fraction
    from mtx.distributed import initialize_from, is_main_process, watch_peers
    from mtx.eval_tasks import prepare

    try:  # bad input fails here, in one line that names the fix, before any device work
        argv, parser = with_negative_values(sys.argv[1:] if argv is None else argv), build_parser()
        args = parser.parse_args(argv)
        refuse_idle(flags_in(argv), idle_rules(parser, args))
        use_memory_fraction()  # train.py's share of GPU memory (mtx's 0.9, or the environment's), before joining
        initialize_from(args)  # before any device is asked for
        devices()  # a backend JAX cannot start (JAX_PLATFORMS, XLA_FLAGS): one line, not a traceback
        load, task = prepare(args)  # mtx/eval_tasks.py
        loaded = load()
    except ValueError as e:  # every process finds the same bad input
        if peers := watch_peers():
            peers.finish()
        print(f"error: {e}", file=sys.stderr)
        return 2
    peers = watch_peers()  # several processes: a peer that stops answering ends this one in a line
    import jax

    from mtx.errors import more_devices, out_of_memory

    try:
        result = task(loaded)  # every process takes part in the computation
    except jax.errors.JaxRuntimeError as e:
        fixes = ["fewer --prompt or --max-new-tokens" if args.task == "generate" else
                 "a smaller --micro-batch-size or --seq-length",
                 more_devices(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)]
        if (message := out_of_memory(e, fixes)) is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    if peers:
        peers.finish()
    if is_main_process():  # and one prints it
        print(json_line(result))  # a non-finite loss or perplexity as null
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
