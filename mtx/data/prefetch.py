"""Prepare the coming steps' batches on a background thread, so that reading, slicing and placing a batch never sits
between two training steps.

JAX dispatches a step asynchronously, so host work for step k + 1 already overlaps step k's device work, except after
every host sync (logging, evaluation, checkpointing), where the next batch would otherwise be prepared while the
device waits. `prefetch` keeps `depth` batches ready, already placed on the devices.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

_DONE = object()


def prefetch(make: Callable[[int], object], steps: range, depth: int = 2) -> Iterator[object]:
    """Yields make(step) for each step, computed on a worker thread up to `depth` steps ahead.

    An exception in `make` is raised here, at the step it belongs to. Stopping early (break, an error in the loop,
    closing the generator) stops the worker: closing returns once it has finished the batch it was making.
    """
    if depth < 1:
        yield from (make(step) for step in steps)
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
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()  # (after the batch it is making): nothing it uses is closed under it
