"""The LayerNorm placement study (paper section 4.2, Figure 7) at toy scale: one deep BERT trained twice, with the
original post-LN block and with the paper's pre-LN block, on the same data, seed and steps; plots both training-loss
curves (PNG) and writes them as JSON.

The paper's claim: with the original placement, LN(x + f(x)), BERT gets unstable or worse as it grows larger and
deeper; moving the LayerNorm to the input of each block, x + f(LN(x)), and adding a final one trains fine.

  python benchmarks/bert_layernorm.py                       # deep narrow BERT on WikiText-2 (valid), CPU, minutes
  python benchmarks/bert_layernorm.py --num-layers 48 --lr 2e-3 --train-iters 300 --out runs/ln_study
  # -> runs/ln_study/bert_layernorm.json, runs/ln_study/bert_layernorm.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PLACEMENTS = ("post", "pre")


def compare(*, num_layers: int = 24, hidden_size: int = 64, num_attention_heads: int = 4, seq_length: int = 64,
            global_batch_size: int = 16, train_iters: int = 200, lr: float = 1e-3, lr_warmup_iters: int = 0,
            init_method_std: float = 0.02, data_path: str | None = None, vocab_file: str | None = None, seed: int = 1234,
            run_dir: str | Path | None = None) -> dict[str, list[float]]:
    """Training losses of every step for each LayerNorm placement: {"post": [...], "pre": [...]}, each
    `train_iters` long (inf where the loss overflowed). One device, fp32, no dropout: the runs differ only in the
    placement."""
    from mtx.config import Config
    from mtx.data_path import shared_data_dir
    from mtx.run import train

    if data_path is None:
        root = shared_data_dir()
        if root is None:
            raise ValueError("no --data-path given and no shared data folder; pass --data-path and --vocab-file.")
        data_path = str(root / "wikitext-2" / "valid.txt")
    base = Config().replace(
        model_type="bert", num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=seq_length, micro_batch_size=global_batch_size, global_batch_size=global_batch_size,
        train_iters=train_iters, lr=lr, min_lr=lr / 10, lr_warmup_iters=lr_warmup_iters, seed=seed,
        init_method_std=init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=1, data_parallel_size=1,
        log_interval=max(1, train_iters // 10), eval_interval=0, split="1,0,0", data_path=(data_path,),
        vocab_file=vocab_file)
    run_dir = Path(run_dir or f"runs/bert_layernorm-{time.strftime('%Y%m%d-%H%M%S')}")
    from mtx.parallel.mesh import make_mesh
    import jax

    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    curves = {}
    for placement in PLACEMENTS:
        result = train(base.replace(layernorm_placement=placement, run_dir=str(run_dir / placement)),
                       progress=False, mesh=mesh)
        curves[placement] = [_finite_or_inf(result.losses[s]) for s in range(1, train_iters + 1)]
    return curves


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    labels = {"post": "post-LN: LN(x + f(x)) (original BERT)", "pre": "pre-LN: x + f(LN(x)) (paper)"}
    for placement, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=labels[placement], linewidth=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (MLM + SOP)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary(curves: dict[str, list[float]], window: int = 20) -> dict[str, dict[str, float]]:
    """First loss, mean of the last `window` losses and the minimum, per placement."""
    out = {}
    for placement, losses in curves.items():
        tail = losses[-window:]
        out[placement] = {"first": losses[0], "last_mean": sum(tail) / len(tail), "min": min(losses)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--init-method-std", type=float, default=0.02,
                   help="weight init std; ~0.02 x sqrt(1024 / hidden) gives a narrow model BERT-Large's branch scale")
    p.add_argument("--data-path", help="text file (default: WikiText-2 valid from the shared data folder)")
    p.add_argument("--vocab-file", help="BERT's vocab.txt (default: the shared data folder's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="runs/bert_layernorm", help="folder for the JSON, the PNG and the two runs")
    args = p.parse_args(argv)
    out = Path(args.out)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    try:
        curves = compare(**{k: v for k, v in settings.items()}, run_dir=out / "runs")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "settings": settings, "summary": summary(curves),
              "losses": curves}
    (out / "bert_layernorm.json").write_text(json.dumps(record, indent=1) + "\n")
    title = (f"BERT {args.num_layers} layers x {args.hidden_size}, lr {args.lr:g}, warmup {args.lr_warmup_iters}, "
             f"init std {args.init_method_std:g}, batch {args.global_batch_size} x {args.seq_length}")
    plot(curves, out / "bert_layernorm.png", title)
    print(json.dumps(record["summary"], indent=1))
    print(f"wrote {out / 'bert_layernorm.json'} and {out / 'bert_layernorm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
