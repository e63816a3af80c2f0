"""Training metrics: one JSON line per log interval, optional TensorBoard and Weights & Biases, and the console.

Each record of `metrics.jsonl` carries `tokens`, the tokens trained on up to its step (step x global batch x sequence
length, so a resumed run continues the count), and `wall_time`, the Unix time in seconds when it was written (the
clock of TensorBoard's events; a resumed run's records continue on the same axis). TensorBoard and W&B get the same
scalars, every number of the record but its step and wall time, against the step. On a terminal the console shows a
tqdm bar; otherwise (a batch job's log) one Megatron-style line per record (`log_line`).

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s, with the model FLOPs of
`ModelConfig.flops_per_token()` (6N + 12 L D S). mfu is null where the peak is not known (e.g. CPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax

from mtx.errors import first_line
from mtx.files import METRICS, WANDB_ID, json_line

# Dense bf16 peak FLOP/s per device (H100/H200 SXM: 989 TFLOP/s).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops_per_device(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def check_trackers(log) -> None:
    """Refuses (before any device work) a tracker whose package is not installed, naming the extra to install, and
    --log-memory-to-tensorboard where the devices report no memory (the CPU)."""
    for flag, value, package in (("--tensorboard-dir", log.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", log.wandb_project, "wandb")):
        if value and not _installed(package):
            raise ValueError(f"{flag} needs the {package} package, which is not installed: pip install "
                             f"'mtx[{package}]'.")
    if log.log_memory_to_tensorboard and not _memory_stats():
        raise ValueError(f"--log-memory-to-tensorboard: the {jax.default_backend()} devices report no memory "
                         "statistics (GPUs do); leave it out here.")


def _memory_stats() -> list[dict]:
    """This process's devices' allocator statistics (empty where the backend keeps none, as the CPU's)."""
    return [stats for device in jax.local_devices() if (stats := device.memory_stats())]


# Megatron's memory scalars, from XLA's allocator statistics (each field the first of its keys reported)
_MEMORY = {"mem_allocated_bytes": ("bytes_in_use",), "mem_max_allocated_bytes": ("peak_bytes_in_use",),
           "mem_reserved_bytes": ("pool_bytes", "bytes_reserved"), "mem_limit_bytes": ("bytes_limit",)}


def device_memory() -> dict[str, int]:
    """--log-memory-to-tensorboard's fields: the statistics of this process's fullest device (the most bytes in use:
    the one that runs out first), those its allocator reports."""
    fullest = max(_memory_stats(), key=lambda s: s.get("bytes_in_use", 0))
    found = {name: next((fullest[k] for k in keys if k in fullest), None) for name, keys in _MEMORY.items()}
    return {name: int(value) for name, value in found.items() if value is not None}


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # a module set to None in sys.modules (import blocked)
        return False


class MetricsLogger:
    """Appends metrics to `<run_dir>/metrics.jsonl` and, when asked, to TensorBoard and a W&B run.

    `tokens_per_step` (global batch x sequence length) gives each record its `tokens`; `wandb` holds wandb.init's
    project, name, dir and config (None: no W&B)."""

    def __init__(self, run_dir: str | Path, tensorboard_dir: str | None = None, *, enabled: bool = True,
                 resumed_at: int | None = None, tokens_per_step: int | None = None,
                 wandb: dict[str, Any] | None = None, tracker_interval: int = 1):
        self.path = Path(run_dir) / METRICS
        self.enabled = enabled  # False on every process but the first of a multi-host run: one writer per file
        self.tokens_per_step, self.tracker_interval = tokens_per_step, tracker_interval
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_at is not None and self.path.exists():
                self._drop_after(resumed_at)
        self._trackers, self._held = [], []  # (the evaluations' scalars not yet written: `log`)
        if enabled and tensorboard_dir:
            self._trackers.append(_TensorBoard(tensorboard_dir))
        if enabled and wandb:  # a resumed run goes on in the W&B run it started (its id kept beside the metrics)
            self._trackers.append(_WandB(**wandb, id_file=self.path.parent / WANDB_ID, resume=resumed_at is not None))

    def log(self, record: dict[str, Any], steps=()) -> dict[str, Any]:
        """Writes `record` with its tokens and wall time added; returns it as written. The trackers get a training
        record (one with a loss) only at a step divisible by --tensorboard-log-interval, as Megatron writes its
        scalars, and an evaluation's always; `steps`, the (step, metrics) of the steps the record ends, give them
        each such step's own scalars in between. They get it all in step order (W&B drops a step older than one it
        has): an evaluation's record waits for the next training record, which brings the steps before it."""
        step = record["step"]
        events = [(s, {k: float(v) for k, v in metrics.items() if k in _STEP_SCALARS}) for s, metrics in steps
                  if self._trackers and s % self.tracker_interval == 0 and s != step]  # (its own step: the record)
        record = {"step": step, **({"tokens": step * self.tokens_per_step} if self.tokens_per_step else {}),
                  **{k: v for k, v in record.items() if k != "step"}, "wall_time": time.time()}
        if not self.enabled:
            return record
        with self.path.open("a") as fh:
            fh.write(json_line(record) + "\n")  # a diverged loss as null
        scalars = {k: v for k, v in record.items()
                   if k not in ("step", "wall_time") and isinstance(v, (int, float)) and v is not None}
        if "loss" not in record:  # an evaluation
            self._held += [(step, scalars)] if self._trackers else []
            return record
        events += self._held + [(step, scalars)] * (step % self.tracker_interval == 0)
        self._held = []
        self._write(sorted(events, key=lambda event: event[0]))  # (stable: an evaluation after its step's scalars)
        return record

    def _write(self, events) -> None:
        for step, scalars in events:
            for tracker in self._trackers:
                tracker.scalars(step, scalars)

    def _drop_after(self, step: int) -> None:
        """A run resumed at `step` re-runs the steps after it: their earlier records go (atomically: the file is
        replaced by a complete copy), so each step appears once and a plot of the file is right."""
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) <= step]  # a line a kill cut short goes too
        if len(kept) < len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)

    def close(self) -> None:
        self._write(self._held)  # the evaluations after the last training record
        self._held = []
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


# A step's own scalars (its metrics as the training step returns them), for the trackers between records
_STEP_SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "params_norm", "num_zeros")


class _TensorBoard:
    """TensorBoard scalars through the `tensorboard` package's own event writer (no TensorFlow needed)."""

    def __init__(self, logdir: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(logdir)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._writer.close()


class TrackerError(RuntimeError):
    """An experiment tracker that would not start (train.py reports it in one line)."""


class _WandB:
    """One W&B run (wandb.init's project, name, dir and config), imported only when asked for: the optional extra
    `pip install 'mtx[wandb]'`. WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later).

    With `resume`, the W&B run whose id `id_file` holds goes on. W&B keeps a run's steps increasing, so steps logged
    after the checkpoint a run resumes from and run again are not logged twice: the W&B run keeps their first values
    (metrics.jsonl holds the new ones)."""

    def __init__(self, project: str, name: str, dir: str, config: dict[str, Any], id_file: Path, resume: bool):
        import wandb

        Path(dir).mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        try:
            self._run = wandb.init(project=project, name=name, dir=dir, config=config,
                                   **({"id": run_id, "resume": "allow"} if run_id else {}))
        except Exception as e:  # not logged in, no network, a project it may not write to
            raise TrackerError(f"--wandb-project {project}: W&B did not start ({type(e).__name__}: "
                               f"{first_line(e)}); run `wandb login`, or set WANDB_MODE=offline to keep the run on "
                               "disk.") from e
        if self._run.id != run_id:
            tmp = id_file.with_name(id_file.name + ".tmp")
            tmp.write_text(self._run.id + "\n")
            os.replace(tmp, id_file)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=int(step))

    def close(self) -> None:
        self._run.finish()


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started, from Linux's /proc (to about a second: the boot time is whole
    seconds); None where that is not available."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as fh:
            boot = next(float(line.split()[1]) for line in fh if line.startswith("btime "))
        return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def throughput(tokens: int, seconds: float, flops_per_token: float, num_devices: int) -> dict[str, float | None]:
    """tokens/s, model TFLOP/s per device and MFU (None without a known peak) of `tokens` processed in `seconds`."""
    tokens_per_s = tokens / seconds
    flops_per_device = tokens_per_s * flops_per_token / num_devices
    peak = peak_flops_per_device()
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / peak if peak else None}


def interval_record(fetched, elapsed: float, steps: int, tokens_per_step: int, flops_per_token: float,
                    devices: int, batch_times: tuple[float, float]) -> dict:
    """The metrics record of a logging interval: the last step's values, skipped steps, and the interval's timing
    over its `steps` timed steps (none when the interval held only the compiling first step): step time, throughput,
    and per step the time spent making a batch (off the loop, on the prefetch thread) and waiting for one."""
    s, m = fetched[-1]
    timing = (throughput(tokens_per_step * steps, elapsed, flops_per_token, devices) if steps else
              {"tokens_per_s": None, "tflops_per_device": None, "mfu": None})
    making, waiting = batch_times
    timing["batch_make_s"], timing["batch_wait_s"] = (making / steps, waiting / steps) if steps else (None, None)
    return {"step": s, "loss": float(m["loss"]), "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
            "loss_scale": float(m["loss_scale"]), "skipped_steps": sum(bool(x["skipped"]) for _, x in fetched),
            **{k: float(m[k]) for k in ("params_norm", "num_zeros") if k in m},
            "step_time_s": elapsed / steps if steps else None, **timing}


def log_line(record: dict[str, Any], train_iters: int, global_batch_size: int, loss_name: str = "lm loss") -> str:
    """A training record as Megatron prints it: ` iteration      10/     100 | consumed samples: ... |`."""
    step = record["step"]
    parts = [f"iteration {step:8d}/{train_iters:8d}", f"consumed samples: {step * global_batch_size:12d}"]
    if record.get("step_time_s") is not None:
        parts.append(f"elapsed time per iteration (ms): {1000 * record['step_time_s']:.1f}")
    if record.get("tflops_per_device") is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {record['tflops_per_device']:.1f}")
    parts += [f"learning rate: {record['lr']:.6E}", f"global batch size: {global_batch_size:5d}",
              f"{loss_name}: {record['loss']:.6E}", f"loss scale: {record['loss_scale']:.1f}",
              f"grad norm: {record['grad_norm']:.3f}"]
    if record.get("num_zeros") is not None and math.isfinite(record["num_zeros"]):  # (none on a skipped step)
        parts.append(f"num zeros: {record['num_zeros']:.1f}")
    if record.get("params_norm") is not None:
        parts.append(f"params norm: {record['params_norm']:.3f}")
    parts.append(f"number of skipped iterations: {record.get('skipped_steps', 0):3d}")
    return "".join(f" {part} |" for part in parts)


class Progress:
    """Training progress on the console: a tqdm bar when stdout is a terminal, else a `log_line` per training record
    (a batch job's log sees lines, not carriage returns); nothing when disabled (other processes, quiet callers)."""

    def __init__(self, start: int, train_iters: int, global_batch_size: int, *, enabled: bool = True,
                 loss_name: str = "lm loss"):
        self.train_iters, self.global_batch_size, self.loss_name = train_iters, global_batch_size, loss_name
        self.mode = "off" if not enabled else "bar" if sys.stdout.isatty() else "lines"
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=train_iters, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any], steps: int) -> None:
        """Shows a training record that covers `steps` more steps."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s'] or 0:.0f}",
                                  mfu="n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%")
            self._bar.update(steps)
        elif self.mode == "lines":
            print(log_line(record, self.train_iters, self.global_batch_size, self.loss_name), flush=True)

    def write(self, text: str) -> None:
        """A message between updates (validation results), printed even when the progress itself is off."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line: 0 for a blank one, infinity for one that is not a whole record."""
    if not line.strip():
        return 0
    try:
        record = json.loads(line)
    except ValueError:
        return float("inf")
    return record.get("step", 0) if isinstance(record, dict) else float("inf")
