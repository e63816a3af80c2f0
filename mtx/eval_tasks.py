"""eval.py's tasks (wikitext, lambada, generate): every check of the input before any device work, then the task.

`prepare(args)` takes eval.py's parsed flags (ranges already checked by its parser, mtx/cli.py) and returns
(load, task): `load()` reads the model onto its mesh, `task(loaded)` computes the result eval.py prints.
"""

from __future__ import annotations

from mtx import evaluation as ev


def prepare(args):
    """Every check of the input, without device work -> (load, task): `load()` gives (model, params) (None for a
    dry run) and refuses a mesh that does not fit before reading any array; `task(loaded)` returns the result."""
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
    if max_positions and seq > max_positions:
        raise ValueError(f"--seq-length {seq} must lie in [1, {max_positions}] (the model's position table); "
                         "pass a shorter one.")

    def load():
        from mtx.loading import load_model

        micro = getattr(args, "micro_batch_size", None)  # (generate batches every prompt at once: not its flag)
        overrides = {} if micro is None else {"micro_batch_size": micro}
        if args.bf16 is not None:  # --bf16 or --no-bf16 (fp32) in place of the checkpoint's precision, fp16 too
            overrides.update(bf16=args.bf16, fp16=False)
        return load_model(args.load, tensor_model_parallel_size=args.tensor_model_parallel_size,
                          pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                          data_parallel_size=args.data_parallel_size, ckpt_step=args.ckpt_step, **overrides)

    if args.task == "wikitext":
        overlap = args.overlapping_eval if args.overlapping_eval is not None else min(32, seq)
        if overlap > seq:
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
    prompts = [tokenizer.encode(p) for p in args.prompt]
    if not all(prompts):
        raise ValueError("--prompt is empty; pass some text to continue.")

    def sample(loaded):
        from mtx.generate import generate

        sharded_model, params = loaded
        outs = generate(sharded_model, params, prompts, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, eod=tokenizer.eod)
        new = [out[len(p):] for p, out in zip(prompts, outs)]  # each output is its prompt + the new tokens
        return {"samples": [{"prompt": text, "completion": tokenizer.decode(ids), "new_tokens": len(ids)}
                            for text, ids in zip(args.prompt, new)]}
    return load, sample
