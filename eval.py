"""Evaluate a trained GPT with Megatron-LM's flags: `python eval.py {wikitext,lambada,generate} --help`.

wikitext: perplexity with overlapping windows, normalized by WikiText's original token count (paper, appendix E).
lambada: last-word accuracy, every subword the argmax. generate: sample continuations of --prompt.
Each prints one JSON object on stdout (progress bars go to stderr); bad input fails with `error: ...` and exit
code 2 before any device work. Without an accelerator it runs on 8 simulated CPU devices.
"""

import sys

from mtx.cli import OneLineParser, add_config_flags, ranged, with_negative_values
from mtx.devices import simulate_cpu_devices
from mtx.files import json_line

simulate_cpu_devices(8)  # without an accelerator; a GPU host still lists its GPUs


# The checkpoint, tokenizer, mesh and process flags every task takes, from the config schema (mtx/cli.py). Unset,
# they mean "as the checkpoint was saved" where the checkpoint has a say: its micro batch, its tokenizer, its step.
_COMMON_FIELDS = ("load", "ckpt_step", "vocab_file", "merge_file", "tokenizer_type", "tokenizer_model",
                  "micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "data_parallel_size", "bf16", "coordinator_address", "num_processes", "process_id",
                  "distributed_timeout", "distributed_timeout_minutes")
_COMMON_DEFAULTS = {"micro_batch_size": None, "tensor_model_parallel_size": 1}
_COMMON_HELPS = {
    "load": "checkpoint directory (written by train.py --save)",
    "ckpt_step": "checkpoint step to load; None: the latest",
    "vocab_file": "GPT-2 encoder.json; None: the checkpoint's tokenizer",
    "merge_file": "GPT-2 vocab.bpe; None: the checkpoint's tokenizer",
    "tokenizer_type": "GPT2BPETokenizer | BertWordPieceLowerCase | HuggingFaceTokenizer | byte; None: by the files "
                      "given, or the checkpoint's tokenizer",
    "tokenizer_model": "HuggingFaceTokenizer: a local directory holding tokenizer.json, or that file; None: the "
                       "checkpoint's",
    "micro_batch_size": "sequences per data-parallel rank and batch; None: the checkpoint's",
}


def build_parser() -> OneLineParser:
    """eval.py's parser: one subcommand a task, each with the common flags and its own."""
    common = OneLineParser(add_help=False)
    add_config_flags(common, _COMMON_FIELDS, defaults=_COMMON_DEFAULTS, helps=_COMMON_HELPS)
    parser = OneLineParser(prog="eval.py", description=__doc__.splitlines()[0],
                           epilog="`python eval.py TASK --help` lists the flags of a task, with their defaults.")
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK", title="tasks")

    def task(name: str, summary: str):  # -> the group of the task's own flags, listed after the common ones
        sub = tasks.add_parser(name, parents=[common], help=summary, description=f"{name}: {summary}.")
        return sub.add_argument_group(f"{name} flags")

    wiki = task("wikitext", "WikiText perplexity with overlapping windows, normalized by the original token count")
    wiki.add_argument("--data-path", required=True, metavar="FILE",
                      help="word-level WikiText file, e.g. wiki.test.tokens (required)")
    wiki.add_argument("--seq-length", type=ranged(int, ">= 1"), metavar="INT",
                      help="window length S (default: the model's)")
    wiki.add_argument("--overlapping-eval", type=ranged(int, ">= 1"), metavar="INT",
                      help="tokens each window advances and scores (default: 32, or S if shorter)")
    wiki.add_argument("--no-detokenize", action="store_true",
                      help="score the raw word-level text (default: detokenize it with the paper's rules)")
    wiki.add_argument("--dry-run", action="store_true", help="only count tokens and windows, with no model")
    lam = task("lambada", "LAMBADA last-word accuracy (every subword of the last word the argmax)")
    lam.add_argument("--data-path", required=True, metavar="FILE", help='.jsonl of {"text": ...} lines (required)')
    lam.add_argument("--seq-length", type=ranged(int, ">= 1"), metavar="INT",
                     help="longest window (default: the model's)")
    gen = task("generate", "sample continuations of --prompt (KV-cached)")
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                     help="prompt text; repeat the flag for a batch (required)")
    gen.add_argument("--max-new-tokens", type=ranged(int, ">= 1"), default=64, metavar="INT",
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


def prepare(args):
    """Every check of the input, without device work -> (load, task): `load()` gives (model, params) (None for a
    dry run) and refuses a mesh that does not fit before reading any array; `task(loaded)` returns the result."""
    from mtx import evaluation as ev

    if not args.load and not getattr(args, "dry_run", False):
        raise ValueError(f"{args.task} needs --load; pass a checkpoint directory written by train.py --save.")
    cfg = ev.checkpoint_config(args.load, args.ckpt_step) if args.load else None
    if cfg is not None and cfg.model.is_bert:  # its masked-LM head scores no next token; nor is there a KV cache
        raise ValueError(f"--load {args.load} holds a BERT model; eval.py scores and samples causal language models "
                         "(GPT, Llama): pass a checkpoint trained with --model-type gpt.")
    tokenizer = ev.checkpoint_tokenizer(cfg, args.vocab_file, args.merge_file, args.tokenizer_type,
                                        args.tokenizer_model)
    max_positions = cfg.model.max_positions if cfg else None
    seq = getattr(args, "seq_length", None) or (cfg.model.seq_length if cfg else 1024)
    if seq < 1 or (max_positions and seq > max_positions):
        raise ValueError(f"--seq-length {seq} must lie in [1, {max_positions or seq}] (the model's position table); "
                         "pass a shorter one.")

    def load():
        from mtx.loading import load_model

        overrides = {k: v for k, v in (("micro_batch_size", args.micro_batch_size), ("bf16", args.bf16)) if v}
        return load_model(args.load, tensor_model_parallel_size=args.tensor_model_parallel_size,
                          pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                          data_parallel_size=args.data_parallel_size, ckpt_step=args.ckpt_step, **overrides)

    if args.task == "wikitext":
        overlap = args.overlapping_eval if args.overlapping_eval is not None else min(32, seq)
        if not 1 <= overlap <= seq:
            raise ValueError(f"--overlapping-eval {overlap} must lie in [1, --seq-length {seq}]; pass a smaller one.")
        tokens, original = ev.read_wikitext(args.data_path, tokenizer, detokenize=not args.no_detokenize)
        if len(tokens) < 2:  # nothing to predict: a perplexity of 1 would be reported
            raise ValueError(f"--data-path {args.data_path} holds {len(tokens)} token(s), nothing to score; pass the "
                             "WikiText file with its text.")
        if args.dry_run:
            counts = {"original_tokens": original, "tokens": len(tokens), "scored_tokens": max(len(tokens) - 1, 0),
                      "windows": ev.num_windows(len(tokens), seq, overlap), "seq_length": seq,
                      "overlapping_eval": overlap}
            return (lambda: None), (lambda _: counts)

        def wikitext(loaded):
            scorer = ev.Scorer(*loaded, most=ev.num_windows(len(tokens), seq, overlap))
            return ev.wikitext_perplexity(scorer, scorer.batch_size, tokens, seq_length=seq, overlap=overlap,
                                          original_tokens=original)
        return load, wikitext
    if args.task == "lambada":
        texts = ev.read_lambada(args.data_path)
        examples = [ev.lambada_tokens(tokenizer, t) for t in texts]  # tokenized once, checked before the model
        longest = max(k for _, k in examples)
        if longest > seq:  # the target word must fit the window, or the example cannot be scored
            raise ValueError(f"--data-path {args.data_path} has a target word of {longest} tokens, more than "
                             f"--seq-length {seq}; pass a longer --seq-length.")

        def lambada(loaded):
            scorer = ev.Scorer(*loaded, most=len(examples))
            return ev.lambada_accuracy(scorer, scorer.batch_size, tokenizer, texts, seq_length=seq,
                                       examples=examples)
        return load, lambada
    for p in args.prompt:  # bytes the shell passed that are not UTF-8 arrive as lone surrogates
        if not p.isascii() and any("\ud800" <= c <= "\udfff" for c in p):
            raise ValueError("--prompt is not valid UTF-8 text; pass the prompt as UTF-8.")
    prompts = [tokenizer.encode(p) for p in args.prompt]
    if not all(prompts):
        raise ValueError("--prompt is empty; pass some text to continue.")
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ValueError("need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1.")

    def sample(loaded):
        from mtx.generate import generate

        sharded_model, params = loaded
        outs = generate(sharded_model, params, prompts, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, eod=tokenizer.eod)
        new = [out[len(p):] for p, out in zip(prompts, outs)]  # each output is its prompt + the new tokens
        return {"samples": [{"prompt": text, "completion": tokenizer.decode(ids), "new_tokens": len(ids)}
                            for text, ids in zip(args.prompt, new)]}
    return load, sample


def main(argv=None) -> int:
    from mtx.distributed import initialize_from, is_main_process, watch_peers

    try:  # bad input fails here, in one line that names the fix, before any device work
        args = build_parser().parse_args(with_negative_values(argv))
        initialize_from(args)  # before any device is asked for
        load, task = prepare(args)
        loaded = load()
    except ValueError as e:  # every process finds the same bad input
        if peers := watch_peers():
            peers.finish()
        print(f"error: {e}", file=sys.stderr)
        return 2
    peers = watch_peers()  # several processes: a peer that stops answering ends this one in a line
    result = task(loaded)  # every process takes part in the computation
    if peers:
        peers.finish()
    if is_main_process():  # and one prints it
        print(json_line(result))  # a non-finite loss or perplexity as null
    return 0


if __name__ == "__main__":
    sys.exit(main())
