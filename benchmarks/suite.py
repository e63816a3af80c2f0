"""The paper's scaling study at the size of the machine: every row one benchmark process, then one table.

    python benchmarks/suite.py --rows 1gpu 2gpu [--out results.jsonl] [--steps 5 --warmup 2]
    python benchmarks/suite.py --rows 4gpu --baseline results.jsonl     # efficiency against 1-GPU rows run earlier
    python benchmarks/suite.py --table-only --baseline a.jsonl b.jsonl --plot docs/scaling.png   # the table, drawn

Rows are named groups (ROWS below): mtx rows run `benchmarks/bench.py`, the baselines `benchmarks/plain_gpt.py` (plain
JAX, no shard_map), `benchmarks/torch_gpt.py` (torch.compile nanoGPT) and `benchmarks/torch_llama.py` (torch.compile
Llama). Each row runs in its own process on the first `gpus` devices (CUDA_VISIBLE_DEVICES), so rows never share a GPU
and a failing row (out of memory) costs only itself. The table reports, besides bench.py's fields, each mtx row's
scaling against the 1-GPU mtx row of the same model (a GSPMD row's against the 1-GPU plain-JAX row): weak-scaling
efficiency = per-GPU tokens/s of the larger model and mesh / per-GPU tokens/s of 1.2B on 1 GPU, in model FLOPs (the
paper's Figure 5 uses FLOP/s: the models differ), and strong-scaling speedup = tokens/s on n GPUs / tokens/s on 1 GPU
for the same model and global batch (paper Table 8).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mtx's checks of the output paths, run from anywhere (no jax: rows run apart)
from mtx.cli import COUNT, WARMUP, OneLineParser, flags_in, ranged  # noqa: E402
from mtx.flag_rules import refuse_idle  # noqa: E402
from mtx.errors import exit_with  # noqa: E402
from mtx.files import check_json_lines, json_line, refuse_empty  # noqa: E402  (json_line: a diverged row's NaN as null)
# The fast settings measured in docs/benchmarks.md: bf16 (presets), cuDNN flash attention (no attention dropout),
# recompute everything but the matmuls, layers unrolled.
FAST = ["--use-flash-attn", "--hidden-dropout", "0", "--attention-dropout", "0", "--recompute-granularity",
        "matmuls", "--no-scan-layers"]
SP = ["--sequence-parallel"]
# sequence parallelism's gathers and scatters in the linears' matmuls, by peer memory (Hopper; the model axis all GPUs)
OVERLAP = [*SP, "--tp-comm-overlap"]
GPIPE = ["--pipeline-schedule", "gpipe", "--recompute-granularity", "full"]  # (it holds every microbatch's activations)
INTERLEAVED = ["--virtual-pipeline-model-parallel-size", "2"]
# XLA's collective matmuls for GSPMD-partitioned dots: each all-gather / reduce-scatter + matmul pair as a loop of
# partial matmuls and peer transfers on separate streams, whatever the size
WINDOWED_EINSUM = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"


def mtx(name, gpus, preset, dp, pp, tp, mb, gb, *extra, fast=True, scan=False, xla_flags=None, env=None):
    fast_flags = [a for a in FAST if a != "--no-scan-layers"] if fast else []
    if fast or scan:  # said either way, whatever the preset says
        fast_flags.append("--scan-layers" if scan else "--no-scan-layers")
    args = ["--config", f"configs/{preset}.toml", "--data-parallel-size", str(dp), "--pipeline-model-parallel-size",
            str(pp), "--tensor-model-parallel-size", str(tp), "--micro-batch-size", str(mb), "--global-batch-size",
            str(gb), *fast_flags, *extra]
    return {"name": name, "gpus": gpus, "script": "benchmarks/bench.py", "args": args, "model": preset,
            "xla_flags": xla_flags, "env": env}


def plain(name, preset, mb, *extra, gpus=1, xla_flags=None):
    """The plain-JAX baseline with scanned layers (beside mtx's scanned rows); on more than one GPU, tensor-parallel
    over all of them from GSPMD sharding annotations (plain_gpt.py --gspmd)."""
    split = ["--gspmd", "--data-parallel-size", "1", "--tensor-model-parallel-size", str(gpus)] if gpus > 1 else []
    args = ["--config", f"configs/{preset}.toml", "--micro-batch-size", str(mb), "--global-batch-size", str(mb),
            *[("--scan-layers" if a == "--no-scan-layers" else a) for a in FAST], *split, *extra]
    return {"name": name, "gpus": gpus, "script": "benchmarks/plain_gpt.py", "args": args, "model": preset,
            "xla_flags": xla_flags}


def torch_row(name, mb, layers=40, hidden=1536, heads=16, model="gpt_1.2b"):
    args = ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--micro-batch", str(mb)]
    return {"name": name, "gpus": 1, "script": "benchmarks/torch_gpt.py", "args": args, "model": model}


# The 1B Llama preset at 4,096 tokens a sequence, 4 a microbatch (16,384 tokens a step, as the 1.2B GPT rows' 16 x
# 1,024): mtx with the preset's own fast settings beside torch_llama.py's defaults (that preset's shape).
LLAMA_SEQ, LLAMA_MB = 4096, 4


def torch_llama_row(name, mb=LLAMA_MB, seq=LLAMA_SEQ, model="llama_1b"):
    args = ["--seq", str(seq), "--micro-batch", str(mb)]
    return {"name": name, "gpus": 1, "script": "benchmarks/torch_llama.py", "args": args, "model": model}


ROWS = {
    "1gpu": [
        mtx("1.2B, 1 GPU", 1, "gpt_1.2b", 1, 1, 1, 16, 16),
        mtx("1.2B, 1 GPU, mb 24", 1, "gpt_1.2b", 1, 1, 1, 24, 24),
        mtx("1.2B, 1 GPU, scanned layers", 1, "gpt_1.2b", 1, 1, 1, 16, 16, scan=True),
        plain("1.2B, plain JAX, scanned layers", "gpt_1.2b", 16),
        torch_row("1.2B, PyTorch", 16),
        mtx("355M, 1 GPU", 1, "gpt2_355m", 1, 1, 1, 16, 16),
        torch_row("355M, PyTorch", 16, layers=24, hidden=1024, heads=16, model="gpt2_355m"),
        mtx("BERT 336M, 1 GPU", 1, "bert_336m", 1, 1, 1, 16, 16),  # synthetic batches with BERT's masking statistics
        mtx("BERT 336M, 1 GPU, no recomputation", 1, "bert_336m", 1, 1, 1, 16, 16, "--recompute-granularity", "none"),
        mtx("355M, 1 GPU, no recomputation", 1, "gpt2_355m", 1, 1, 1, 16, 16, "--recompute-granularity", "none"),
        mtx("1B Llama, 1 GPU", 1, "llama_1b", 1, 1, 1, LLAMA_MB, LLAMA_MB, "--seq-length", str(LLAMA_SEQ),
            "--recompute-granularity", "none"),  # the preset's (with FAST's matmuls: 0.996x torch.compile)
        torch_llama_row("1B Llama, PyTorch"),
    ],
    "2gpu": [
        mtx("2.5B, TP 2 (weak)", 2, "gpt_2.5b", 1, 1, 2, 16, 16),
        mtx("2.5B, TP 2 (weak), sequence parallel", 2, "gpt_2.5b", 1, 1, 2, 16, 16, *SP),
        mtx("1.2B, TP 2 (strong)", 2, "gpt_1.2b", 1, 1, 2, 16, 16),
        mtx("1.2B, TP 2 (strong), sequence parallel", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *SP),
        mtx("2.5B, TP 2 (weak), peer-memory matmuls", 2, "gpt_2.5b", 1, 1, 2, 16, 16, *OVERLAP),
        mtx("1.2B, TP 2 (strong), peer-memory matmuls", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *OVERLAP),
        mtx("1.2B, TP 2 (strong), latency-hiding scheduler", 2, "gpt_1.2b", 1, 1, 2, 16, 16,
            xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true"),
        mtx("1.2B, DP 2", 2, "gpt_1.2b", 2, 1, 1, 16, 32),
        mtx("1.2B, PP 2, 8 microbatches, GPipe", 2, "gpt_1.2b", 1, 2, 1, 8, 64, *GPIPE),
        mtx("1.2B, PP 2, 8 microbatches, 1F1B", 2, "gpt_1.2b", 1, 2, 1, 8, 64),
        mtx("1.2B, PP 2, 8 microbatches, interleaved V 2", 2, "gpt_1.2b", 1, 2, 1, 8, 64, *INTERLEAVED),
    ],
    # NCCL settings for the 25-50 MB gathers/scatters of sequence parallelism (docs/benchmarks.md, 3b: no gain).
    # Run with the 1-GPU row; other settings with --env KEY=VALUE on any row:
    #   python benchmarks/suite.py --rows 1gpu 2gpu-nccl --only "1.2B, 1 GPU" "TP 2" --skip "mb 24" scanned
    "2gpu-nccl": [
        mtx("1.2B, TP 2 (strong), sequence parallel", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *SP),
        mtx("1.2B, TP 2 (strong), sequence parallel, NCCL_PROTO=Simple", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *SP,
            env={"NCCL_PROTO": "Simple"}),
        mtx("1.2B, TP 2 (strong), sequence parallel, NCCL_MIN_NCHANNELS=32", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *SP,
            env={"NCCL_MIN_NCHANNELS": "32"}),
    ],
    # mtx's shard_map TP against the same model split by GSPMD, with and without XLA's collective matmuls (windowed
    # einsum, which only GSPMD-partitioned matmuls get); docs/benchmarks.md 3d. Layers scanned in all three, as in
    # the 1-GPU rows they are compared with:
    #   python benchmarks/suite.py --rows 1gpu 2gpu-gspmd --only scanned "1.2B, plain JAX" "TP 2"
    "2gpu-gspmd": [
        mtx("1.2B, TP 2 (strong), sequence parallel, scanned layers", 2, "gpt_1.2b", 1, 1, 2, 16, 16, *SP, scan=True),
        plain("1.2B, TP 2 (strong), plain JAX GSPMD, sequence parallel", "gpt_1.2b", 16, *SP, gpus=2),
        plain("1.2B, TP 2 (strong), plain JAX GSPMD, sequence parallel, windowed einsum", "gpt_1.2b", 16, *SP,
              gpus=2, xla_flags=WINDOWED_EINSUM),
    ],
    "4gpu": [
        mtx("4.2B, TP 4 (weak)", 4, "gpt_4.2b", 1, 1, 4, 16, 16),
        mtx("4.2B, TP 4 (weak), sequence parallel", 4, "gpt_4.2b", 1, 1, 4, 16, 16, *SP),
        mtx("4.2B, TP 4 (weak), peer-memory matmuls", 4, "gpt_4.2b", 1, 1, 4, 16, 16, *OVERLAP),
        mtx("1.2B, TP 4 (strong)", 4, "gpt_1.2b", 1, 1, 4, 16, 16),
        mtx("1.2B, TP 4 (strong), sequence parallel", 4, "gpt_1.2b", 1, 1, 4, 16, 16, *SP),
        mtx("1.2B, TP 4 (strong), peer-memory matmuls", 4, "gpt_1.2b", 1, 1, 4, 16, 16, *OVERLAP),
        mtx("1.2B, TP 2 x DP 2", 4, "gpt_1.2b", 2, 1, 2, 16, 32),
        mtx("2.5B, TP 2 x PP 2, 8 microbatches, GPipe", 4, "gpt_2.5b", 1, 2, 2, 8, 64, *GPIPE),
        mtx("2.5B, TP 2 x PP 2, 8 microbatches, 1F1B", 4, "gpt_2.5b", 1, 2, 2, 8, 64, *SP),
        mtx("2.5B, TP 2 x PP 2, 8 microbatches, interleaved V 3", 4, "gpt_2.5b", 1, 2, 2, 8, 64, *SP,
            "--virtual-pipeline-model-parallel-size", "3"),
        mtx("1.2B, PP 4, 16 microbatches, 1F1B", 4, "gpt_1.2b", 1, 4, 1, 4, 64),
        mtx("1.2B, PP 4, 16 microbatches, interleaved V 2", 4, "gpt_1.2b", 1, 4, 1, 4, 64, *INTERLEAVED),
    ],
    # issue 10: needs an 8-GPU host (not lent yet); each row is validated for 8 devices by tests/test_benchmarks.py
    "8gpu": [
        mtx("8.3B, TP 8 (weak)", 8, "gpt_8.3b", 1, 1, 8, 16, 16),
        mtx("8.3B, TP 8, 16 heads", 8, "gpt_8.3b", 1, 1, 8, 16, 16, "--num-attention-heads", "16"),
        mtx("8.3B, TP 8, 24 heads", 8, "gpt_8.3b", 1, 1, 8, 16, 16, "--num-attention-heads", "24"),
        mtx("8.3B, TP 8, 32 heads", 8, "gpt_8.3b", 1, 1, 8, 16, 16, "--num-attention-heads", "32"),
        mtx("1.2B, TP 8 (strong)", 8, "gpt_1.2b", 1, 1, 8, 16, 16),
        mtx("1.2B, TP 8 (strong), peer-memory matmuls", 8, "gpt_1.2b", 1, 1, 8, 16, 16, *OVERLAP),
        mtx("1.2B, TP 4 x DP 2", 8, "gpt_1.2b", 2, 1, 4, 16, 32),
        mtx("8.3B, TP 4 x PP 2, 8 microbatches, GPipe", 8, "gpt_8.3b", 1, 2, 4, 4, 32, *GPIPE),
        mtx("8.3B, TP 4 x PP 2, 8 microbatches, 1F1B", 8, "gpt_8.3b", 1, 2, 4, 4, 32, *SP),
        mtx("4.2B, TP 2 x PP 4, 8 microbatches, GPipe", 8, "gpt_4.2b", 1, 4, 2, 8, 64, *GPIPE),
        mtx("4.2B, TP 2 x PP 4, 8 microbatches, 1F1B", 8, "gpt_4.2b", 1, 4, 2, 8, 64, *SP),
        mtx("4.2B, TP 2 x PP 4, 8 microbatches, interleaved V 2", 8, "gpt_4.2b", 1, 4, 2, 8, 64, *SP, *INTERLEAVED),
    ],
}


def _add_settings(env: dict, settings: dict) -> dict:
    """env with `settings` set in it; XLA_FLAGS are appended to any already there, other keys replaced."""
    env = dict(env)
    for key, value in settings.items():
        env[key] = f"{env[key]} {value}" if key == "XLA_FLAGS" and env.get(key) else value
    return env


def run_row(row, steps, warmup, timeout) -> dict:
    # The row's own settings: its XLA flags, then its environment (XLA_FLAGS there add to the row's flags).
    settings = _add_settings({"XLA_FLAGS": row["xla_flags"]} if row.get("xla_flags") else {}, row.get("env") or {})
    env = _add_settings(dict(os.environ, PYTHONPATH=str(ROOT),
                             CUDA_VISIBLE_DEVICES=",".join(map(str, range(row["gpus"])))), settings)
    own = ["--steps", str(steps), "--warmup", str(warmup)]
    cmd = [sys.executable, row["script"], *own, *row["args"]]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        result = json.loads(lines[-1]) if p.returncode == 0 and lines else {
            "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    except subprocess.TimeoutExpired as e:  # with how far the row got (plain_gpt.py reports its phases)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        last = [l for l in err.splitlines() if l.strip(" *")][-1:]
        result = {"error": f"timed out after {timeout} s" + (f"; last: {last[0][:200]}" if last else "")}
    result.pop("profile", None)
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in settings.items())
    return {**row, "command": prefix + " ".join(["python", row["script"], *own, *row["args"]]), "result": result}


def scaling(records) -> list[tuple[str, float] | None]:
    """Each record's scaling, as the table shows it: ("weak", efficiency), ("strong", speedup), ("tokens", tokens/s
    ratio at another global batch) or None (a 1-GPU row, a failed row, or no 1-GPU row to compare with)."""
    # mtx's 1-GPU rows by model and layers scanned or not ("1.2B, 1 GPU", "1.2B, 1 GPU, scanned layers"); scanned
    # by the row's flags, not its name (records from before --scan-layers existed were named scanned and were not)
    scanned = lambda r: "--scan-layers" in r.get("args", ())
    one_gpu = {(r["model"], scanned(r)): r["result"] for r in records
               if r["script"] == "benchmarks/bench.py" and r["gpus"] == 1 and "error" not in r["result"]
               and r.get("base_name", r["name"]).removesuffix(", scanned layers").endswith("1 GPU")}
    plain_one_gpu = {r["model"]: r["result"] for r in records
                     if r["script"] == "benchmarks/plain_gpt.py" and r["gpus"] == 1 and "error" not in r["result"]}
    base = one_gpu.get(("gpt_1.2b", False))
    out = []
    for r in records:
        x, found = r["result"], None
        if r["gpus"] > 1 and "error" not in x:  # mtx's rows against mtx's 1-GPU row of the same program (scanned
            # or unrolled layers), GSPMD's (scanned layers) against plain JAX's
            same = (plain_one_gpu.get(r["model"]) if r["script"] == "benchmarks/plain_gpt.py" else
                    one_gpu.get((r["model"], scanned(r))))
            if "weak" in r["name"] and base:
                found = ("weak", x["tflops_per_device"] / base["tflops_per_device"])
            elif same and x["global_batch"] == same["global_batch"]:
                found = ("strong", x["tokens_per_s"] / same["tokens_per_s"])
            elif same:
                found = ("tokens", x["tokens_per_s"] / same["tokens_per_s"])
        out.append(found)
    return out


def table(records) -> str:
    head = ("| row | GPUs | params | global batch | step (s) | tokens/s | TFLOP/s per GPU | MFU | peak mem (GiB) | "
            "scaling |\n|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r, found in zip(records, scaling(records)):
        x = r["result"]
        if "error" in x:
            out.append(f"| {r['name']} | {r['gpus']} | | | | {x['error'][:80]} | | | | |")
            continue
        kind, value = found or ("", 0.0)
        scale = {"weak": f"weak {value:.0%}", "strong": f"strong {value:.2f}x", "tokens": f"{value:.2f}x tokens/s",
                 "": ""}[kind]
        gb = x.get("global_batch", x.get("micro_batch"))
        mfu = f"{x['mfu']:.1%}" if x.get("mfu") else "n/a"
        out.append(f"| {r['name']} | {r['gpus']} | {x['params'] / 1e9:.2f}B | {gb} | {x['step_s']:.4f} | "
                   f"{x['tokens_per_s']:,.0f} | {x['tflops_per_device']:.1f} | {mfu} | "
                   f"{x.get('peak_mem_gib', 0):.1f} | {scale} |")
    return "\n".join(out)


def plot(records, path) -> Path:
    """The table as a figure (PNG): weak-scaling efficiency and strong-scaling speedup against GPUs beside the ideal,
    and every row's MFU. Written through mtx.plot (marked; a file it did not write is never replaced)."""
    from mtx.plot import pyplot, save_figure

    plt = pyplot()
    ok = [(r, found) for r, found in zip(records, scaling(records)) if "error" not in r["result"]]
    if not ok:
        raise ValueError("no successful rows to plot; run some rows first.")
    fig = plt.figure(figsize=(11, 4 + 0.22 * len(ok)), dpi=100)
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1 + 0.22 * len(ok)])
    most = max(r["gpus"] for r, _ in ok)
    for col, (kind, title, ideal, ylabel) in enumerate((
            ("weak", "weak scaling: TFLOP/s per GPU / 1.2B on 1 GPU", lambda g: 100.0, "efficiency (%)"),
            ("strong", "tokens/s over 1 GPU (solid: same global batch)", lambda g: float(g), "speedup (x)"))):
        ax = fig.add_subplot(grid[0, col])
        ax.plot([1, most], [ideal(1), ideal(most)], ":", color="gray", label="ideal")
        for r, found in ok:  # the right panel also shows rows at another global batch ("tokens"), dashed
            if found and (found[0] == kind or (kind, found[0]) == ("strong", "tokens")):
                y = 100 * found[1] if kind == "weak" else found[1]
                other_batch = found[0] == "tokens"
                label = f"{r['name']}: " + (f"{y:.0f}%" if kind == "weak" else f"{y:.2f}x")
                if other_batch:
                    label += f" (global batch {r['result']['global_batch']})"
                ax.plot([1, r["gpus"]], [ideal(1), y], "o--" if other_batch else "o-", label=label)
        ax.set(xlabel="GPUs", ylabel=ylabel, xticks=sorted({1, *(r["gpus"] for r, _ in ok)}))
        ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="lower left" if kind == "weak" else "upper left")
    ax = fig.add_subplot(grid[1, :])
    names = [f"{r['name']} ({r['gpus']} GPU{'s' if r['gpus'] > 1 else ''})" for r, _ in ok]
    mfu = [100 * (r["result"].get("mfu") or 0.0) for r, _ in ok]
    ax.barh(range(len(ok)), mfu, color=[f"C{min(r['gpus'], 8) - 1}" for r, _ in ok])
    ax.set_yticks(range(len(ok)), names, fontsize="x-small")
    ax.invert_yaxis()
    ax.set_xlabel("MFU (%)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def _read_records(names) -> list[dict]:
    """The --baseline files' records, or a ValueError naming the file and line (any JSON error first, then shape)."""
    # what table() and scaling() read: a record's fields, its result's numbers (and global batch, but in PyTorch's rows)
    fields = {"name": str, "gpus": int, "script": str, "model": str, "result": dict}
    numbers = ("params", "step_s", "tokens_per_s", "tflops_per_device")
    needs = lambda r: numbers if r["script"].startswith("benchmarks/torch_") else (*numbers, "global_batch")
    is_record = lambda r: (isinstance(r, dict) and all(isinstance(r.get(k), kind) for k, kind in fields.items())
                           and r["gpus"] >= 1 and (isinstance(r["result"].get("error"), str) or all(
                               isinstance(r["result"].get(k), (int, float)) for k in needs(r))))
    records = []
    for name in names:
        try:
            lines = open(name).read().splitlines()
        except OSError as e:
            raise ValueError(f"--baseline {name}: {e.strerror}; pass a file written by --out.") from None
        read = []
        for n, line in enumerate(lines, start=1):
            try:
                read += [(n, json.loads(line))] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"--baseline {name} line {n} is not JSON ({e.msg}); pass a file written by "
                                 "--out.") from None
        if bad := [n for n, record in read if not is_record(record)]:
            raise ValueError(f"--baseline {name} line {bad[0]} is not a suite record ({', '.join(fields)}: an error "
                             f"or {', '.join(numbers)}); pass a file written by --out.")
        records += [record for _, record in read]
    return records


def main(argv=None) -> int:
    ap = OneLineParser(prog="suite.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["1gpu"], choices=sorted(ROWS))
    ap.add_argument("--only", nargs="*", default=(), help="run only rows whose name contains one of these")
    ap.add_argument("--skip", nargs="*", default=(), help="leave out rows whose name contains one of these")
    ap.add_argument("--steps", type=ranged(int, COUNT), default=5)
    ap.add_argument("--warmup", type=ranged(int, WARMUP), default=2)
    ap.add_argument("--timeout", type=ranged(int, "[1, 1000000]"), default=240, help="seconds per row")
    ap.add_argument("--list", action="store_true", help="print the names of the rows selected and run none")
    ap.add_argument("--out", default=None, help="append each row's record (JSON) to this file")
    ap.add_argument("--baseline", nargs="+", default=(), help="earlier rows' records (--out files) to scale against")
    ap.add_argument("--table-only", action="store_true", help="run no rows: tabulate (and --plot) --baseline's records")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw the table as a figure into this file")
    ap.add_argument("--env", nargs="*", default=(), metavar="KEY=VALUE",
                    help="extra environment for every row (e.g. NCCL_PROTO=Simple), added to each row's name")
    said = {"list": "with --list", "table": "with --table-only", "run": "when rows run"}  # the modes a flag acts in
    acts_in = {"--rows": "list run", "--only": "list run", "--skip": "list run", "--list": "list",
               "--baseline": "table run", "--plot": "table run", "--table-only": "table"}  # any other flag: run
    try:  # a bad flag, or one that would do nothing: one line, exit status 2 (SystemExit, as argparse leaves)
        args = ap.parse_args(argv)
        mode = "list" if args.list else "table" if args.table_only else "run"
        given = list(flags_in(sys.argv[1:] if argv is None else argv))
        refuse_idle(given, [((f,), mode in modes, " or ".join(said[m] for m in modes), "leave it out.")
                            for f in given for modes in [acts_in.get(f, "run").split()]])
        if args.table_only and not args.baseline:  # (an empty table, once)
            raise ValueError("--table-only tabulates --baseline records; pass --baseline FILE, or drop --table-only.")
        if bad := [item for item in args.env if not item.partition("=")[0] or "=" not in item]:
            raise ValueError(f"--env {bad[0]!r}: expected KEY=VALUE, e.g. --env NCCL_PROTO=Simple")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    extra_env = dict(item.split("=", 1) for item in args.env)
    rows = [] if args.table_only else [(group, row) for group in args.rows for row in ROWS[group]]
    selected = [(group, row) for group, row in rows if not (args.only and not any(s in row["name"] for s in args.only))
                and not any(s in row["name"] for s in args.skip)]
    groups = " ".join(args.rows)
    fix = f"python benchmarks/suite.py --rows {groups} --list prints the row names."
    try:  # bad input fails here, before any row runs (rows can take hours)
        for flag, words in (("--only", args.only), ("--skip", args.skip)):  # a typo would run or skip rows unasked
            if unmatched := [w for w in words if not any(w in row["name"] for _, row in rows)]:
                raise ValueError(f"no row of --rows {groups} matches {flag} {shlex.quote(unmatched[0])}; {fix}")
        if rows and not selected:
            raise ValueError(f"--only and --skip together leave no row of --rows {groups}; {fix}")
        if args.list:
            print("\n".join(f"{group}: {row['name']}" for group, row in selected))
            return 0
        for flag in ("--out", "--plot", "--baseline"):
            refuse_empty(getattr(args, flag[2:]), flag, "a file, or drop " + flag)
        earlier = _read_records(args.baseline)
        if args.out:
            check_json_lines(args.out, "--out", ("name", "result"))
        if args.plot:
            from mtx.plot import check_png_path, pyplot

            pyplot()  # matplotlib is there
            check_png_path(args.plot)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = []
    for _, row in selected:
        if extra_env:  # named for the table; the 1-GPU baseline is still found by base_name
            row = {**row, "name": row["name"] + "".join(f", {k}={v}" for k, v in extra_env.items()),
                   "base_name": row["name"], "env": {**(row.get("env") or {}), **extra_env}}
        rec = run_row(row, args.steps, args.warmup, args.timeout)
        records.append(rec)
        if args.out:  # (on disk first: a reader of the output that goes away loses no row)
            with open(args.out, "a") as fh:
                fh.write(json_line(rec) + "\n")
        print(json_line({"name": rec["name"], **rec["result"]}), flush=True)
    print(table(earlier + records))
    if records and all("error" in r["result"] for r in records):  # nothing measured: never a success
        print("error: every row failed; the table says why.", file=sys.stderr)
        return 1
    if args.plot:
        try:
            print(f"wrote {plot(earlier + records, args.plot)}")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    exit_with(main)
