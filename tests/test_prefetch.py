"""The background batch prefetcher: same batches in the same order, errors at their step, stops when abandoned."""

import threading
import time

import pytest

from mtx.data.prefetch import BatchTimes, prefetch


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


@pytest.mark.parametrize("depth", [0, 2])
def test_times_count_making_and_the_wait_for_a_batch_not_ready(depth):
    """A batch that takes 50 ms to make, consumed at once: the making is counted, and the consumer waits for most of
    it (with depth 0 all of it); consumed 100 ms apart with prefetching, the batches are ready and nothing waits."""
    times = BatchTimes()
    slow = lambda step: time.sleep(0.05) or step
    assert list(prefetch(slow, range(4), depth=depth, times=times)) == [0, 1, 2, 3]
    making, waiting = times.take()
    assert making >= 0.2 and waiting >= (0.2 if depth == 0 else 0.1)
    assert times.take() == (0.0, 0.0)
    if depth:
        for _ in prefetch(slow, range(4), depth=depth, times=times):
            time.sleep(0.1)
        making, waiting = times.take()
        assert making >= 0.2 and waiting < 0.08  # only the first batch is waited for
