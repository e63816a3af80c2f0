"""Training metrics: one JSON line per log interval, optional TensorBoard events, and a progress bar for people.

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s, with the model FLOPs of
`ModelConfig.flops_per_token()` (6N + 12 L D S). mfu is null where the peak is not known (e.g. CPU).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jax

# Dense bf16 peak FLOP/s per device (H100/H200 SXM: 989 TFLOP/s).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops_per_device(device=None) -> float | None:
    kind = (device or jax.devices()[0]).device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


class MetricsLogger:
    """Appends metrics to `<run_dir>/metrics.jsonl` and, given a directory, to TensorBoard."""

    def __init__(self, run_dir: str | Path, tensorboard_dir: str | None = None, *, enabled: bool = True,
                 resumed_at: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled  # False on every process but the first of a multi-host run: one writer per file
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_at is not None and self.path.exists():
                self._drop_after(resumed_at)
        self._tb = _TensorBoard(tensorboard_dir) if tensorboard_dir and enabled else None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.scalars(record["step"], {k: v for k, v in record.items()
                                              if k != "step" and isinstance(v, (int, float)) and v is not None})

    def _drop_after(self, step: int) -> None:
        """A run resumed at `step` re-runs the steps after it: their earlier records go (atomically: the file is
        replaced by a complete copy), so each step appears once and a plot of the file is right."""
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
        if len(kept) < len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class _TensorBoard:
    """TensorBoard scalars through the `tensorboard` package's own event writer (no TensorFlow needed)."""

    def __init__(self, logdir: str):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ValueError("--tensorboard-dir needs the tensorboard package; pip install 'mtx[tensorboard]'.")
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(logdir)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._writer.close()


def throughput(tokens: int, seconds: float, flops_per_token: float, num_devices: int) -> dict[str, float | None]:
    """tokens/s, model TFLOP/s per device and MFU (None without a known peak) of `tokens` processed in `seconds`."""
    tokens_per_s = tokens / seconds
    flops_per_device = tokens_per_s * flops_per_token / num_devices
    peak = peak_flops_per_device()
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / peak if peak else None}
