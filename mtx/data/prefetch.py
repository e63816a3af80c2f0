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

    An exception in `make` is raised here, at the step it belongs to. Stopping early (break, an error in the loop)
    stops the worker at its next batch.
    """
    if depth < 1:
        yield from (make(step) for step in steps)
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        try:
            for step in steps:
                item = make(step)
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, raised at the step that failed
            ready.put(e)
            return
        ready.put(_DONE)

    worker = threading.Thread(target=work, name="mtx-prefetch", daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
