"""Training batches built by worker processes (`--num-workers`, as Megatron's data loader workers).

A BERT sample is Python work (sentence pairs, truncation, whole-word masking: ~0.4 ms a sample of WikiText-2 at
sequence length 512 on a 2-core CPU), single-threaded under the GIL, so a background thread makes one batch at a
time on one core. Each worker process
builds the dataset from the same flags (a batch is a pure function of the seed, the split and its index, so every
process builds the same batches) and then whole batches, as PyTorch's data loader workers do: the next W batches
are in flight on W workers, on other cores. Workers are spawned (a fork would copy a process already running JAX's
threads) and build their dataset at once, while the model compiles.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing

_dataset = None  # the worker process's dataset


def _build(cfg):
    global _dataset
    from mtx.data.build import build_dataset

    _dataset = build_dataset(cfg)


def _ready():
    return _dataset.num_samples("train")


def _batch(split: str, index: int, batch_size: int, rows: slice):
    return _dataset.batch(split, index, batch_size, rows)


class BatchWorkers:
    """`batch(split, index, batch_size, rows)` of the dataset `cfg` builds, the same arrays, made by `workers`
    processes: asking for batch k sends batches k .. k + W - 1 to the workers (those not sent yet), so consecutive
    requests find their batch made or in the making. Close it (or use it as a context manager) to stop the workers."""

    def __init__(self, cfg, workers: int):
        self.workers = workers
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_build, initargs=(cfg,))
        self._jobs: dict[tuple, concurrent.futures.Future] = {}
        for _ in range(workers):  # spawns them now: each builds its dataset while the caller goes on
            self._pool.submit(_ready)

    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)):
        for key in [key for key in self._jobs if key[0] == split and not index <= key[1] < index + self.workers]:
            self._jobs.pop(key).cancel()  # a jump: batches sent ahead that will not be asked for
        part = (rows.start, rows.stop, rows.step)  # (a slice is no dict key before Python 3.12)
        try:
            for k in range(index, index + self.workers):
                if (split, k, batch_size, part) not in self._jobs:
                    self._jobs[split, k, batch_size, part] = self._pool.submit(_batch, split, k, batch_size, rows)
            return self._jobs.pop((split, index, batch_size, part)).result()
        except concurrent.futures.process.BrokenProcessPool:
            raise RuntimeError("a batch worker process stopped (killed, out of memory, or its dataset build failed: "
                               "its traceback is above); rerun with --num-workers 0 to build batches in this "
                               "process.") from None

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
