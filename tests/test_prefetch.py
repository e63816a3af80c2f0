"""The background batch prefetcher: same batches in the same order, errors at their step, stops when abandoned."""

import threading
import time

import pytest

from mtx.data.prefetch import prefetch


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_yields_every_step_in_order(depth):
    assert list(prefetch(lambda k: k * k, range(5, 12), depth=depth)) == [k * k for k in range(5, 12)]


def test_runs_ahead_by_at_most_depth():
    made = []
    batches = prefetch(lambda k: made.append(k) or k, range(100), depth=2)
    assert next(batches) == 0
    deadline = time.time() + 10  # wait for the worker (a loaded CI machine may be slow), then give it time to overrun
    while len(made) < 4 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert made == [0, 1, 2, 3]  # step 0 consumed, 1 and 2 queued, 3 made and waiting for room
    batches.close()


def test_an_error_is_raised_at_its_step():
    def make(k):
        if k == 3:
            raise ValueError("bad batch 3")
        return k

    got = []
    with pytest.raises(ValueError, match="bad batch 3"):
        for x in prefetch(make, range(10), depth=2):
            got.append(x)
    assert got == [0, 1, 2]


def test_closing_stops_the_worker():
    batches = prefetch(lambda k: k, range(10**9), depth=2)
    next(batches)
    batches.close()
    deadline = time.time() + 2
    while any(t.name == "mtx-prefetch" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "mtx-prefetch" for t in threading.enumerate())
