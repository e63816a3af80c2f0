"""`python -m mtx.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--x steps tokens]`: training curves of runs as PNG files.

Reads each run directory's `metrics.jsonl` (mtx/metrics.py: one record per --log-interval, validation records
apart) and draws, for all runs together, one figure per metric and x axis: `loss_<x>.png` (training loss solid,
validation loss dashed), `lr_<x>.png`, `grad_norm_<x>.png`, `tokens_per_s_<x>.png` and `mfu_<x>.png`, where
<x> is `steps` or `tokens` (a record's `tokens`, or for records without one step x global batch x sequence length
from the run's config.json). A metric no run logged (MFU on CPU, validation without --eval-interval) is left out,
and so is a null value.

A record logged again for a step that an earlier record of the same kind already reached (the steps after a
checkpoint, re-run by a resumed run) replaces the earlier ones from that step on, so each curve is the run that
continued; mtx's own logger already drops those records when it resumes (MetricsLogger), this also holds for files
pieced together by hand.

The figures go into --out (default `plots`, created if needed). mtx.plot marks every PNG it writes (a PNG text
chunk, Software = mtx.plot) and replaces a file of those names only if it carries that mark: any other file is left
alone and the run is refused. Bad input (a missing, empty or repeated run directory, a missing metrics.jsonl, a
malformed line, an --out that is a file) is one "error: ..." line on stderr and exit status 2, before anything is
written. Needs matplotlib.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from mtx.cli import OneLineParser
from mtx.files import (CONFIG, MARK, METRICS, check_writable, made_by_mtx_plot, new_temporary, refuse_empty,
                       refuse_repeats)

# file stem -> (y label, [(field, line style)], scale); loss shows training and validation together
FIGURES = {
    "loss": ("loss", [("loss", "-"), ("val_loss", "--")], 1.0),
    "lr": ("learning rate", [("lr", "-")], 1.0),
    "grad_norm": ("gradient norm", [("grad_norm", "-")], 1.0),
    "tokens_per_s": ("tokens/s", [("tokens_per_s", "-")], 1.0),
    "mfu": ("MFU (%)", [("mfu", "-")], 100.0),
}
X_LABELS = {"steps": "step", "tokens": "tokens"}


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Runs the command line; returns the PNG files written. Bad input exits with status 2 and one line on stderr,
    having written nothing."""
    try:
        written = plot(**vars(_parser().parse_args(argv)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {len(written)} figures to {written[0].parent}: {', '.join(p.name for p in written)}")
    return written


def plot(run_dirs: Sequence[str], out: str = "plots", x: Sequence[str] = ("steps",)) -> list[Path]:
    """Draws the curves of `run_dirs` against each axis in `x` into the directory `out`; returns the files."""
    refuse_empty(str(out), "--out", "a directory for the figures (default: plots)")
    _check_run_dirs(run_dirs)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory; pass a directory for the figures.")
    check_writable(out_dir, "--out", a_run_dir=True)  # not through a file, a link to nothing, a read-only place
    runs = {_label(Path(d), run_dirs): _read_run(Path(d), need_tokens="tokens" in x) for d in run_dirs}
    figures = {f"{stem}_{axis}.png": (stem, axis) for axis in dict.fromkeys(x) for stem in FIGURES
               if any(r["records"].get(field) for r in runs.values() for field, _ in FIGURES[stem][1])}
    if not figures:
        raise ValueError(f"{', '.join(run_dirs)}: metrics.jsonl holds no values to plot yet; let the run log a "
                         "step first (--log-interval).")
    foreign = [name for name in figures if (out_dir / name).exists() and not made_by_mtx_plot(out_dir / name)]
    if foreign:
        raise ValueError(f"--out {out_dir} holds {', '.join(foreign)}, not written by mtx.plot; mtx never writes "
                         "over them: choose another --out.")
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (stem, axis) in figures.items():
        written.append(_draw(plt, runs, stem, axis, out_dir / name))
    return written


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m mtx.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (train.py's --save or --run-dir)")
    p.add_argument("--out", default="plots", help="directory for the PNG files (created if needed)")
    p.add_argument("--x", nargs="+", choices=sorted(X_LABELS), default=["steps"],
                   help="x axes: steps, tokens (step x global batch x sequence length), or both")
    return p


def _check_run_dirs(run_dirs: Sequence[str]) -> None:
    """Refuses an empty RUN_DIR (once read as ".") and a run given twice (also spelt two ways): drawn twice."""
    refuse_empty(run_dirs, "RUN_DIR", "a run directory (train.py's --save or --run-dir)")
    refuse_repeats(run_dirs, "", "run directory")


def _label(path: Path, run_dirs: Sequence[str]) -> str:
    """The legend name of a run: its directory's name, or its path where two runs share a name."""
    names = [Path(d).name for d in run_dirs]
    return path.name if names.count(path.name) == 1 else str(path)


def _read_run(path: Path, need_tokens: bool) -> dict:
    """{"records": {field: [(step, tokens, value), ...]}, "tokens_per_step": int | None} of one run directory
    (tokens_per_step from config.json, needed only for --x tokens where records lack their own `tokens`)."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass a run directory (train.py's --save or --run-dir).")
    metrics = path / METRICS
    if not metrics.is_file():
        raise ValueError(f"{path} holds no metrics.jsonl; pass a run directory (train.py's --save or --run-dir).")
    records = {}  # kind -> [record]: training records and validation records, each in step order
    with metrics.open(encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record["step"]
                if not isinstance(step, int):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{metrics} line {number} is not a JSON object with an integer step; fix or delete "
                                 "that line.") from None
            try:  # a number past a float's range (an integer of 400 digits) cannot be drawn
                for value in record.values():
                    if isinstance(value, (int, float)):
                        float(value)
            except OverflowError:
                raise ValueError(f"{metrics} line {number} holds a number too large to draw; fix or delete that "
                                 "line.") from None
            # (training, validation and, once training ends, test records: each kind continued on its own)
            kind = records.setdefault(next((k for k in ("val", "test") if f"{k}_loss" in record), "train"), [])
            while kind and kind[-1]["step"] >= step:  # logged again after a resume: the later run continues
                kind.pop()
            kind.append(record)
    fields = {}  # field -> [(step, tokens or None, value)]
    for kind in records.values():
        for record in kind:
            tokens = record.get("tokens") if isinstance(record.get("tokens"), int) else None
            for field, value in record.items():
                if field != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    fields.setdefault(field, []).append((record["step"], tokens, float(value)))
    counted = all(t is not None for points in fields.values() for _, t, _ in points)
    return {"records": fields, "tokens_per_step": _tokens_per_step(path) if need_tokens and not counted else None}


def _tokens_per_step(path: Path) -> int:
    """global batch x sequence length from the run's config.json (what --x tokens counts)."""
    try:
        config = json.loads((path / CONFIG).read_text())
        return int(config["training"]["global_batch_size"]) * int(config["model"]["seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--x tokens: {path}'s records have no tokens and it has no config.json with "
                         "training.global_batch_size and model.seq_length to count them; use --x steps.") from None


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or a ValueError naming the install."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("mtx.plot needs matplotlib, which is not installed; pip install matplotlib.") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _draw(plt, runs: dict, stem: str, axis: str, path: Path) -> Path:
    ylabel, fields, scale = FIGURES[stem]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        for i, (name, run) in enumerate(runs.items()):
            for field, style in fields:
                xs, ys = _points(run, field, axis)
                if xs:
                    part = "validation" if field.startswith("val") else "train"
                    label = name if len(fields) == 1 else f"{name} {part}"
                    ax.plot(xs, [y * scale for y in ys], style, color=f"C{i % 10}",
                            marker="." if len(xs) < 50 else None, label=label)
        ax.set_xlabel(X_LABELS[axis])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def _points(run: dict, field: str, axis: str) -> tuple[list, list]:
    """The x values (steps or tokens) and y values of one field of a run, in step order."""
    points = run["records"].get(field, [])
    xs = [step if axis == "steps" else tokens if tokens is not None else step * run["tokens_per_step"]
          for step, tokens, _ in points]
    return xs, [value for _, _, value in points]


def check_png_path(path: str | Path) -> Path:
    """`path` if a figure may be written there (its folder exists; no file of that name, or one mtx.plot wrote),
    else a ValueError naming the fix: checked before any work that would end in writing it."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"{path}: {path.parent} is not a directory; create it or choose another path.")
    if path.exists() and not made_by_mtx_plot(path):
        raise ValueError(f"{path} exists and was not written by mtx.plot; mtx never writes over it: choose another "
                         "path.")
    return path


NOTEBOOK_FIGURES = Path(tempfile.gettempdir()) / "mtx_notebook_figures"  # rendered by the notebooks, never committed


def show(fig, name: str) -> Path:
    """A notebook's figure: written as NOTEBOOK_FIGURES/<name>.png by `save_figure`, closed, and displayed when the
    notebook runs under IPython (else its path is printed). Returns the file."""
    NOTEBOOK_FIGURES.mkdir(exist_ok=True)
    try:
        path = save_figure(fig, NOTEBOOK_FIGURES / f"{name}.png")
    finally:
        pyplot().close(fig)
    try:
        from IPython.display import Image, display
    except ImportError:
        print("figure:", path)
    else:
        display(Image(filename=str(path)))
    return path


def save_figure(fig, path: str | Path) -> Path:
    """Writes a matplotlib figure as a PNG marked as mtx.plot's, under a temporary name renamed when complete, so a
    file of that name is whole or untouched; refuses (ValueError) to replace a file that does not carry the mark."""
    path = check_png_path(path)
    tmp = new_temporary(path)
    try:
        fig.savefig(tmp, format="png", metadata=dict([MARK]), bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
