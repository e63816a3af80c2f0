"""Prepare the coming steps' batches on a background thread, so that reading, slicing and placing a batch never sits
between two training steps.

JAX dispatches a step asynchronously, so host work for step k + 1 already overlaps step k's device work, except after
every host sync (logging, evaluation, checkpointing), where the next batch would otherwise be prepared while the
device waits. `prefetch` keeps `depth` batches ready, already placed on the devices.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

_DONE = object()


class BatchTimes:
    """Seconds spent on the batches handed out since the last `take`: making them (`make`: building, reading and
    placing a batch, or waiting for a worker process's; counted when the batch is handed out, wherever it was made),
    and waiting for them (the training loop, when the next batch was not ready: the time data cost the step).
    Megatron's timers call the second "batch-generator"."""

    def __init__(self):
        self.lock, self.making, self.waiting = threading.Lock(), 0.0, 0.0

    def add(self, making: float = 0.0, waiting: float = 0.0) -> None:
        with self.lock:
            self.making += making
            self.waiting += waiting

    def take(self) -> tuple[float, float]:
        """(making, waiting) since the last take; both restart from zero."""
        with self.lock:
            taken, self.making, self.waiting = (self.making, self.waiting), 0.0, 0.0
        return taken


def _timed(make: Callable[[int], object]) -> Callable[[int], tuple[object, float]]:
    def timed_make(step):
        start = time.perf_counter()
        item = make(step)
        return item, time.perf_counter() - start
    return timed_make


def prefetch(make: Callable[[int], object], steps: range, depth: int = 2,
             times: BatchTimes | None = None) -> Iterator[object]:
    """Yields make(step) for each step, computed on a worker thread up to `depth` steps ahead; `times` (if given)
    adds up the time spent making batches and the time the consumer waited for one.

    An exception in `make` is raised here, at the step it belongs to. Stopping early (break, an error in the loop,
    closing the generator) stops the worker: closing returns once it has finished the batch it was making.
    """
    times = times or BatchTimes()
    make = _timed(make)
    if depth < 1:
        for step in steps:
            item, making = make(step)
            times.add(making, waiting=making)  # made on the loop's own time: all of it waited for
            yield item
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item) -> bool:
        """Puts item in the queue unless the consumer stopped first; whether it was put."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for step in steps:
                if not hand_over(make(step)):
                    return
        except BaseException as e:  # handed to the consumer, raised at the step that failed
            hand_over(e)
            return
        hand_over(_DONE)

    worker = threading.Thread(target=work, name="mtx-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            start = time.perf_counter()
            item = ready.get()
            times.add(waiting=time.perf_counter() - start)
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            item, making = item
            times.add(making=making)
            yield item
    finally:
        stop.set()
        worker.join()  # (after the batch it is making): nothing it uses is closed under it
