"""The training loop's controls (mtx/run.py): when to stop before --train-iters (signals, --exit-interval,
--exit-duration-in-mins, agreed on by every process), the --profile trace's window, --manual-gc's collections, and
where the time to the first step went."""

from __future__ import annotations

import gc
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np

from mtx.metrics import seconds_since_process_start


def _collect(generation: int = 2) -> None:
    gc.collect(generation)


class ManualGC:
    """Megatron's --manual-gc: Python's collector off for the loop (each process would otherwise pause whenever its
    own allocations trip a threshold, and the others wait for it at the next collective), a full collection at the
    start, after every --manual-gc-interval'th step and, with --manual-gc-eval, before each evaluation, and one of
    the youngest generation (what the evaluation made) after it, as Megatron's; the collector's own state is
    restored at the end. Nothing without --manual-gc."""

    def __init__(self, t):
        self.t, self.was_enabled = t, gc.isenabled()

    def __enter__(self) -> "ManualGC":
        if self.t.manual_gc:
            self.was_enabled = gc.isenabled()
            gc.disable()
            _collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.t.manual_gc and self.was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        """After `step` steps."""
        if self.t.manual_gc and self.t.manual_gc_interval and step % self.t.manual_gc_interval == 0:
            _collect()

    def before_evaluation(self) -> None:
        if self.t.manual_gc and self.t.manual_gc_eval:
            _collect()

    def after_evaluation(self) -> None:
        if self.t.manual_gc and self.t.manual_gc_eval:
            _collect(generation=0)


class StopRequests:
    """Why training should stop before --train-iters, checked after each step: SIGTERM or SIGINT (with
    --exit-signal-handler, the default: the step finishes, a checkpoint is saved, the process exits 0; a second
    SIGINT interrupts at once), --exit-interval, --exit-duration-in-mins. With several processes all must stop at the
    same step: signals and the clock are agreed on at logging steps (a host sync there anyway), the interval is the
    same everywhere."""

    def __init__(self, t, log_interval: int):
        self.t, self.start, self.signal, self.previous = t, time.monotonic(), None, {}
        self.log_interval = log_interval  # (the logging steps: a host sync anyway)

    def __enter__(self) -> "StopRequests":
        if self.t.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # (None: set outside Python)
        self.previous = {}

    def _on_signal(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def reason(self, step: int) -> str | None:
        t = self.t
        if t.exit_interval and step % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        minutes = (time.monotonic() - self.start) / 60
        local = (f"{self.signal} received" if self.signal else f"--exit-duration-in-mins {t.exit_duration_in_mins}"
                 if t.exit_duration_in_mins and minutes >= t.exit_duration_in_mins else None)
        if jax.process_count() == 1:
            return local
        if step % self.log_interval:
            return None
        from jax.experimental import multihost_utils

        anyone = bool(np.any(multihost_utils.process_allgather(np.int32(local is not None))))
        return local or ("another process was asked to stop" if anyone else None)


class Profiler:
    """--profile: a jax.profiler trace of steps --profile-step-start + 1 .. --profile-step-end (0-based loop steps
    start .. end - 1, as Megatron counts), written by process 0 into `log_dir` (TensorBoard's profile plugin reads
    <dir>/plugins/profile). The trace is stopped when the traced steps are done, or when the run leaves the loop
    early (a stop request, an error)."""

    def __init__(self, t, log_dir, *, enabled: bool):
        self.t, self.log_dir, self.enabled, self.running = t, Path(log_dir), enabled and t.profile, False
        self.done = t.profile_step_start  # steps completed so far in the trace's window

    def before(self, step: int) -> None:
        if self.enabled and step == self.t.profile_step_start:
            jax.profiler.start_trace(str(self.log_dir))
            self.running = True

    def after(self, step: int, metrics) -> None:
        if self.running:
            self.done = step + 1
            if self.done == self.t.profile_step_end:
                jax.block_until_ready(metrics)  # the traced steps' device work, not just their dispatch
                self.stop()

    def stop(self) -> None:
        if self.running:
            self.running = False
            jax.profiler.stop_trace()
            print(f"mtx: profile of steps {self.t.profile_step_start + 1}..{self.done} written to {self.log_dir} "
                  "(TensorBoard's profile tab)")

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Startup:
    """Where the time to the first step went, as Megatron's "time to initialize" and setup timers: the process's
    start up to train() (Python, imports, flag parsing), train() up to a ready state (checks, data, model, the
    state initialized or loaded), and the first step (tracing it, compiling it or loading it from the compilation
    cache, running it). Printed when the first step is done; its seconds go into the first metrics record."""

    def __init__(self, entered: float, state_ready: float):
        since_start = seconds_since_process_start()
        now = time.perf_counter()
        self.process_start = None if since_start is None else now - since_start  # on the perf_counter clock
        self.entered, self.state_ready, self.fields = entered, state_ready, {}

    def first_step_done(self, now: float) -> str:
        self.fields = {"startup_state_s": self.state_ready - self.entered,
                       "startup_first_step_s": now - self.state_ready}
        if self.process_start is not None:
            self.fields = {"startup_s": now - self.process_start,
                           "startup_to_train_s": max(self.entered - self.process_start, 0.0), **self.fields}
        f = self.fields
        total = f"{f['startup_s']:.1f} s after the process started" if "startup_s" in f else "done"
        before = f"{f['startup_to_train_s']:.1f} s to train(), " if "startup_to_train_s" in f else ""
        return (f"mtx: first step {total} ({before}{f['startup_state_s']:.1f} s to the initialized or loaded state, "
                f"{f['startup_first_step_s']:.1f} s for the first step: tracing, compiling or loading it from the "
                "compilation cache, running it)")

    def take(self) -> dict:
        """The startup fields once (for the first record written after the first step), then nothing."""
        fields, self.fields = self.fields, {}
        return fields
