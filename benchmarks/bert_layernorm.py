"""The LayerNorm placement study (paper section 4.2, Figure 7) at toy scale: deep narrow BERTs trained with the
original post-LN block and with the paper's pre-LN block, on the same data, seed and steps, at one or more depths;
plots the training-loss curves (PNG) and writes them as JSON.

The paper's claim: with the original placement, LN(x + f(x)), BERT gets unstable or worse as it grows larger and
deeper; moving the LayerNorm to the input of each block, x + f(LN(x)), and adding a final one trains fine.

The data is WikiText-2 (valid) with a small WordPiece vocabulary built from that text (its most frequent words plus
single characters), so that a toy model learns context within a few hundred CPU steps: with BERT's 30,522-entry
vocabulary a toy model stays at the unigram loss in that time and the placement cannot show.

  python benchmarks/bert_layernorm.py                      # the documented result (docs/bert.md), CPU
  python benchmarks/bert_layernorm.py --num-layers 4 --train-iters 20 --out runs/ln_smoke
  # -> OUT/bert_layernorm.json, OUT/bert_layernorm.png

At full size the runs are train.py runs on GPUs (docs/bert.md has the commands); --from-runs plots their run
directories (config.json + metrics.jsonl), one panel per model and schedule, pre- against post-LN:

  python benchmarks/bert_layernorm.py --from-runs runs/fig7/* --out docs [--overwrite]  # -> OUT/bert_layernorm_gpu.*
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

from mtx.cli import OneLineParser, add_config_flags, ranged  # noqa: E402

PLACEMENTS = ("post", "pre")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_vocab(text: str, num_words: int) -> list[str]:
    """A small WordPiece vocabulary for `text`: the special tokens, every character (alone and as a "##"
    continuation, so no word is [UNK]) and the `num_words` most frequent words of BERT's basic tokenization."""
    from mtx.data.wordpiece import _basic_tokenize

    words = collections.Counter(_basic_tokenize(text))
    chars = sorted({c for w in words for c in w})
    pieces = [*SPECIAL, *chars, *("##" + c for c in chars), *(w for w, _ in words.most_common(num_words) if len(w) > 1)]
    return list(dict.fromkeys(pieces))


def unigram_entropy(text: str, vocab_file: str | Path) -> float:
    """Entropy (nats) of the token frequencies of `text`: the MLM loss of a model that ignores the context."""
    from mtx.data.tokenizer import BertWordPieceTokenizer

    counts = collections.Counter(BertWordPieceTokenizer(vocab_file).encode(text))
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


def compare(*, num_layers: int = 24, hidden_size: int = 64, num_attention_heads: int = 4, seq_length: int = 64,
            global_batch_size: int = 16, train_iters: int = 200, lr: float = 1e-2, lr_warmup_iters: int = 0,
            init_method_std: float = 0.08, clip_grad: float = 0.0, data_path: str | None = None,
            vocab_file: str | None = None, vocab_words: int = 500, seed: int = 1234,
            placements=PLACEMENTS, run_dir: str | Path | None = None,
            baseline: dict | None = None) -> dict[str, list[float]]:
    """Training losses of every step for each LayerNorm placement: {"post": [...], "pre": [...]}, each
    `train_iters` long (inf where the loss overflowed). One device, fp32, no dropout: the runs differ only in the
    placement. `run_dir`, a directory that must not exist yet (default: runs/bert_layernorm-<time>), holds the runs
    (run_dir/post, run_dir/pre) and, without `vocab_file`, the vocabulary of `vocab_words` words built from the data
    (run_dir/vocab.txt). A `baseline` dict gets "masked_unigram": the loss a model that ignores the context reaches on
    these batches. Bad settings are refused (ValueError) before anything is written."""
    from mtx.config import Config
    from mtx.files import check_writable, not_a_file
    from mtx.run import train

    data_path = data_path or str(default_data())
    if not Path(data_path).is_file():
        raise ValueError(f"--data-path {data_path} {not_a_file(data_path)}; pass a text file.")
    run_dir = Path(run_dir or f"runs/bert_layernorm-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists():  # (its runs and vocabulary are this study's own: never over an earlier one's, or a user's)
        raise ValueError(f"{run_dir} exists already; the study's runs go into a new directory: start it again (a "
                         "directory of its own each second), or pass another --out.")
    check_writable(run_dir, "the runs' directory")
    base = Config().replace(
        model_type="bert", num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=seq_length, micro_batch_size=global_batch_size, global_batch_size=global_batch_size,
        train_iters=train_iters, lr=lr, min_lr=lr / 10, lr_warmup_iters=lr_warmup_iters, seed=seed,
        init_method_std=init_method_std, clip_grad=clip_grad,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=1, data_parallel_size=1,
        log_interval=max(1, train_iters // 10), eval_interval=0, split="1,0,0", data_path=(data_path,),
        vocab_file=vocab_file or str(run_dir / "vocab.txt"))
    for placement in placements:
        base.replace(layernorm_placement=placement).validate(1)
    if vocab_file is None:
        text = Path(data_path).read_text()
        run_dir.mkdir(parents=True)
        (run_dir / "vocab.txt").write_text("\n".join(build_vocab(text, vocab_words)) + "\n")
    from mtx.parallel.mesh import make_mesh
    import jax

    if baseline is not None:  # the context-free loss on exactly the batches these runs train on
        baseline["masked_unigram"] = masked_unigram_loss(base, train_iters)

    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    curves = {}
    for placement in placements:
        result = train(base.replace(layernorm_placement=placement, run_dir=str(run_dir / placement)),
                       progress=False, mesh=mesh)
        curves[placement] = [_finite_or_inf(result.losses[s]) for s in range(1, train_iters + 1)]
    return curves


def default_data() -> Path:
    from mtx.data.paths import shared_data_dir

    root = shared_data_dir()
    if root is None:
        raise ValueError("no --data-path given and no shared data folder (MTX_DATA_DIR); pass --data-path.")
    return root / "wikitext-2" / "valid.txt"


def _finite_or_inf(x: float | None) -> float:
    """A loss as a number to plot: a diverged one (NaN, or metrics.jsonl's null for it) as infinity."""
    return x if x is not None and math.isfinite(x) else float("inf")


def masked_unigram_loss(cfg, train_iters: int) -> float:
    """MLM + SOP loss of the best context-free predictor on the batches of steps 1..train_iters: the entropy of the
    masked tokens' frequencies in those batches plus ln 2 (sentence order is a coin flip without context). A model
    that ends at this value has learned token frequencies only. In-sample, so a slight underestimate."""
    import numpy as np

    from mtx.data.build import build_dataset

    dataset = build_dataset(cfg.validate(1))
    g = cfg.training.global_batch_size
    labels = np.concatenate([b["labels"][b["loss_mask"] > 0] for b in (dataset.batch("train", step, g)
                                                                       for step in range(train_iters))])
    p = np.bincount(labels) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() + math.log(2))


def plot(curves: dict[str, list[float]], path: Path, title: str, baseline: float | None = None,
         window: int = 10) -> None:
    """Each curve faint per step and as a `window`-step running mean; the context-free baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    labels = {"post": "post-LN: LN(x + f(x)) (original BERT)", "pre": "pre-LN: x + f(LN(x)) (paper)"}
    for (placement, losses), color in zip(curves.items(), ("tab:red", "tab:blue")):
        steps = np.arange(1, len(losses) + 1)
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.6)
        w = min(window, len(losses))
        smooth = np.convolve(np.asarray(losses, float), np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], smooth, color=color, linewidth=1.4, label=labels[placement])
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label=f"context-free (unigram) {baseline:.2f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (MLM + SOP)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary(curves: dict[str, list[float]], window: int = 20) -> dict[str, dict[str, float | int | None]]:
    """Per placement: first loss, mean of the last `window` losses, minimum, and the first step whose loss is not
    finite or above the first loss after the loss had dropped below it (None: no divergence)."""
    out = {}
    for placement, losses in curves.items():
        tail = losses[-window:]
        diverged, dropped = None, False
        for step, x in enumerate(losses, 1):
            if not math.isfinite(x) or (dropped and x > losses[0]):
                diverged = step
                break
            dropped = dropped or x < losses[0]
        out[placement] = {"first": losses[0], "last_mean": sum(tail) / len(tail), "min": min(losses),
                          "diverged_at": diverged}
    return out


def read_run(run_dir: str | Path) -> dict:
    """A train.py run directory -> its model, placement and schedule, the logged training losses (each the mean over
    its log interval) and the validation losses."""
    from mtx.config import Config

    run_dir = Path(run_dir)
    cfg = Config.from_dict(json.loads((run_dir / "config.json").read_text()))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_records = [r for r in records if "loss" in r]
    m, o, t = cfg.model, cfg.optimizer, cfg.training
    return {"run": run_dir.name, "cfg": cfg, "placement": m.layernorm_placement, "params": m.num_params(),
            "shape": f"{m.num_layers} x {m.hidden_size}", "warmup": o.lr_warmup_iters, "iters": t.train_iters,
            "lr": o.lr, "batch": f"{t.global_batch_size} x {m.seq_length}",
            "steps": [r["step"] for r in train_records], "loss": [_finite_or_inf(r["loss"]) for r in train_records],
            "val": {r["step"]: _finite_or_inf(r["val_loss"]) for r in records if "val_loss" in r}}


def group_runs(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Runs by (model, schedule) -> {placement: run}; each group must hold one pre- and one post-LN run."""
    groups: dict[str, dict[str, dict]] = {}
    for run in sorted(runs, key=lambda r: (r["params"], r["warmup"], r["iters"])):
        key = (f"BERT {run['params'] / 1e6:,.0f}M ({run['shape']}), lr {run['lr']:g}, warmup {run['warmup']} of "
               f"{run['iters']} steps, batch {run['batch']}")
        if run["placement"] in groups.setdefault(key, {}):
            raise ValueError(f"two {run['placement']}-LN runs of {key}: pass one run directory per placement.")
        groups[key][run["placement"]] = run
    for key, pair in groups.items():
        if set(pair) != set(PLACEMENTS):
            raise ValueError(f"{key} has only {sorted(pair)}: pass a pre- and a post-LN run of each model.")
    return groups


def plot_groups(groups: dict[str, dict[str, dict]], path: Path, baselines: dict[str, float | None],
                window: int = 10) -> None:
    """One panel per group: each placement's logged losses faint and as a `window`-record running mean, on one
    y scale across the panels, and the group's context-free baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(groups), 1, figsize=(6.4, 2.8 * len(groups)), dpi=100, sharey=True, squeeze=False)
    labels = {"post": "post-LN (original BERT)", "pre": "pre-LN (paper)"}
    for ax, (title, pair) in zip(axes[:, 0], groups.items()):
        for placement, color in (("post", "tab:red"), ("pre", "tab:blue")):
            steps, losses = np.asarray(pair[placement]["steps"]), np.asarray(pair[placement]["loss"], float)
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.6)
            w = min(window, len(losses))
            ax.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"), color=color, linewidth=1.4,
                    label=labels[placement])
        if baselines.get(title) is not None:
            ax.axhline(baselines[title], color="gray", linestyle="--", linewidth=1,
                       label=f"context-free (unigram) {baselines[title]:.2f}")
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("training loss (MLM + SOP)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("iteration")
    axes[0, 0].set_ylim(top=min(12.0, axes[0, 0].get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def from_runs(run_dirs: list[str], out: Path) -> dict:
    """--from-runs: the groups' summaries (first and last 100 steps' mean loss, validation losses, and the
    context-free baseline of the batches trained on where the data is here) as JSON and the figure, under `out`."""
    groups = group_runs([read_run(d) for d in run_dirs])
    record, baselines = {}, {}
    for title, pair in groups.items():
        cfg = pair["pre"]["cfg"]  # both runs read the same batches
        here = all(Path(p).with_suffix(".idx").exists() for p in cfg.data.data_path)
        baselines[title] = masked_unigram_loss(cfg, cfg.training.train_iters) if here else None
        record[title] = {"masked_unigram_loss": baselines[title]}
        for placement, run in sorted(pair.items()):
            steps, losses = run["steps"], run["loss"]
            last = [x for s, x in zip(steps, losses) if s > steps[-1] - 100]
            first = [x for s, x in zip(steps, losses) if s <= 100]
            record[title][placement] = {"run": run["run"], "first_100_mean": sum(first) / len(first),
                                        "last_100_mean": sum(last) / len(last), "val": run["val"],
                                        "diverged_at": summary({placement: losses})[placement]["diverged_at"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bert_layernorm_gpu.json").write_text(json.dumps({"summary": record, "runs": {
        t: {p: {"steps": r["steps"], "loss": r["loss"]} for p, r in pair.items()} for t, pair in groups.items()}},
        indent=None) + "\n")
    plot_groups(groups, out / "bert_layernorm_gpu.png", baselines)
    return record


def main(argv=None) -> int:
    p = OneLineParser(prog="bert_layernorm.py", description=__doc__.split("\n\n")[0])
    # train.py's flags (typed and range-checked by the schema, mtx/cli.py) with this study's defaults
    add_config_flags(p, ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size",
                         "train_iters", "lr", "lr_warmup_iters", "init_method_std", "clip_grad", "seed"),
                     defaults=dict(num_layers=24, hidden_size=64, num_attention_heads=4, seq_length=64,
                                   global_batch_size=16, train_iters=200, lr=1e-2, lr_warmup_iters=0,
                                   init_method_std=0.08, clip_grad=0.0, seed=1234),
                     helps=dict(lr="peak learning rate (cosine decay to lr / 10)",
                                lr_warmup_iters="0: no warmup, post-LN's known weak spot",
                                init_method_std="weight init std; 0.02 x sqrt(1024 / hidden) gives a narrow model "
                                                "BERT-Large's branch scale",
                                clip_grad="global gradient-norm clip; 0 disables it"))
    p.add_argument("--data-path", help="text file (default: WikiText-2 valid from the shared data folder)")
    p.add_argument("--vocab-file", help="a WordPiece vocab.txt (default: build one of --vocab-words words)")
    p.add_argument("--vocab-words", type=ranged(int, ">= 1"), default=500,
                   help="words in the vocabulary built from the data")
    p.add_argument("--out", default="runs/bert_layernorm", help="folder for the JSON, the PNG and the runs (each "
                   "study's in a new runs/<time> of its own)")
    p.add_argument("--from-runs", nargs="+", metavar="RUN_DIR",
                   help="plot these train.py run directories (a pre- and a post-LN run of each model) instead")
    p.add_argument("--overwrite", action="store_true", help="replace the JSON and PNG if --out holds them already")
    args = p.parse_args(argv)
    out = Path(args.out)
    stem = "bert_layernorm_gpu" if args.from_runs else "bert_layernorm"
    try:  # before any work: never write over a file unasked
        from mtx.files import check_new_files

        check_new_files([out / f"{stem}.json", out / f"{stem}.png"], "--out", overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.from_runs:
        try:
            print(json.dumps(from_runs(args.from_runs, out), indent=1))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out / 'bert_layernorm_gpu.json'} and {out / 'bert_layernorm_gpu.png'}")
        return 0
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "from_runs", "overwrite")}
    baseline: dict = {}
    start = time.perf_counter()
    try:
        curves = compare(**settings, run_dir=out / "runs" / time.strftime("%Y%m%d-%H%M%S"), baseline=baseline)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(time.perf_counter() - start),
              "settings": settings, "masked_unigram_loss": baseline.get("masked_unigram"),
              "summary": summary(curves), "losses": curves}
    (out / "bert_layernorm.json").write_text(json.dumps(record, indent=1) + "\n")
    title = (f"BERT {args.num_layers} x {args.hidden_size}, lr {args.lr:g}, warmup {args.lr_warmup_iters}, "
             f"clip {args.clip_grad:g}, init std {args.init_method_std:g}, batch {args.global_batch_size} x "
             f"{args.seq_length}, WikiText-2 / {args.vocab_words}-word vocab" if not args.vocab_file else
             f"BERT {args.num_layers} x {args.hidden_size}, lr {args.lr:g}, warmup {args.lr_warmup_iters}")
    plot(curves, out / "bert_layernorm.png", title, baseline.get("masked_unigram"))
    print(json.dumps({"masked_unigram_loss": record["masked_unigram_loss"], **record["summary"]}, indent=1))
    print(f"wrote {out / 'bert_layernorm.json'} and {out / 'bert_layernorm.png'}")
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
