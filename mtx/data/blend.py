"""Mixing datasets by weight (Megatron's `--data-path 0.7 a 0.3 b`), still with batch k a pure function of k.

Position p of a split's blended sample sequence is served by one dataset, chosen by Megatron's greedy blending
index (megatron/core/datasets/helpers.cpp, build_blending_indices): at each position pick the dataset whose
achieved count falls furthest below weight x position. That loop is sequential, so computing it up to a resumed
step would cost O(step x batch); instead it is computed once for a period of 2**16 positions and repeated. Within
a period every dataset's count is within one sample of weight x period, so the long-run shares are the weights to
~1e-5, and position p maps to (dataset, sample) in O(1): (p // period) x count + its rank inside the period.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from mtx.data.dataset import SPLITS, GPTDataset

PERIOD = 1 << 16


@functools.cache
def blending_pattern(weights: tuple[float, ...], period: int = PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's greedy blending index for `period` positions: (dataset_index, rank_within_dataset, counts)."""
    dataset_index = np.empty(period, np.int64)
    rank = np.empty(period, np.int64)
    counts = [0] * len(weights)
    for i in range(period):
        x = float(max(i, 1))  # Megatron uses max(i, 1), so positions 0 and 1 both aim at weight x 1
        errors = [w * x - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))  # the first dataset on ties, as the C++ loop's strict '>'
        dataset_index[i], rank[i] = d, counts[d]
        counts[d] += 1
    return dataset_index, rank, np.asarray(counts, np.int64)


def parse_weights(weights: Sequence[float]) -> list[float]:
    """Normalizes blend weights to sum to 1; refuses negative, non-finite or all-zero weights."""
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or not len(w) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"--data-path blend weights {list(weights)} must be non-negative numbers with a positive "
                         "sum, e.g. --data-path 0.7 a 0.3 b.")
    return list(w / w.sum())


class BlendedDataset:
    """Datasets of one tokenizer and sequence length, mixed by weight; the `GPTDataset` batch API.

    Each split blends the datasets whose own split holds samples (weights renormalized over them), so a dataset too
    small for a validation share still feeds training. Each dataset keeps its own sample order (its epochs and
    permutations), read at the position the blending index gives it.
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float]):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"a blend needs one weight per dataset, got {len(weights)} weights for "
                             f"{len(datasets)} datasets; pass --data-path as weight path pairs.")
        self.datasets, self.weights = list(datasets), parse_weights(weights)
        first = self.datasets[0]
        self.tokenizer, self.seq_length, self.seed = first.tokenizer, first.seq_length, first.seed
        for ds in self.datasets[1:]:
            if ds.tokenizer.vocab_size != self.tokenizer.vocab_size or ds.seq_length != self.seq_length:
                raise ValueError("blended datasets must share one tokenizer and --seq-length; tokenize every "
                                 "--data-path entry with the same --vocab-file.")
        self._members = {}
        for split in SPLITS:
            members = [i for i, (ds, w) in enumerate(zip(self.datasets, self.weights))
                       if w > 0 and ds.num_samples(split) > 0]
            self._members[split] = members
        if not self._members["train"] and first._weights["train"] > 0:  # (none: a blend of another split's own data)
            raise ValueError("no blended dataset holds a training sample; give a dataset with data a positive "
                             "--data-path weight.")
        if not self._members["valid"] and first._weights["valid"] > 0 and first.evaluated:  # refused now, not later
            share = " or a larger --split share for valid" if first._weights["valid"] < 1 else ""
            raise ValueError(f"no blended dataset holds a validation sample of --seq-length {self.seq_length} + 1 "
                             f"tokens; use more data, a shorter --seq-length{share} (or --eval-interval 0: no "
                             "validation).")

    def num_samples(self, split: str) -> int:
        """Samples of the split summed over its datasets: one pass over each, roughly (an epoch of the blend)."""
        if split not in self._members:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        return sum(self.datasets[i].num_samples(split) for i in self._members[split])

    def num_tokens(self, split: str) -> int:
        return sum(ds.num_tokens(split) for ds in self.datasets)

    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """(batch_size, seq_length + 1) int32: positions index*batch_size ... of the split's blended sequence; rows:
        only those rows of the batch."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch size >= 1, got {index} and {batch_size}.")
        which, within = self.locate(split, index * batch_size + np.arange(batch_size, dtype=np.int64)[rows])
        members = self._members[split]
        out = np.empty((len(which), self.seq_length + 1), np.int32)
        for j, i in enumerate(members):
            served = which == j
            if served.any():
                out[served] = self.datasets[i].samples(split, within[served])
        return out

    def locate(self, split: str, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For blended positions: which of the split's member datasets serves each, and at which of its positions."""
        members = self._split_members(split)
        pattern, rank, counts = blending_pattern(tuple(parse_weights([self.weights[i] for i in members])))
        block, offset = np.divmod(np.asarray(position, np.int64), len(pattern))
        which = pattern[offset]
        return which, block * counts[which] + rank[offset]

    def _split_members(self, split: str) -> list[int]:
        if split not in self._members:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        if not self._members[split]:
            raise ValueError(f"no blended dataset holds a {split} sample; give it a --split share (e.g. 969,30,1), "
                             "more data, or a shorter --seq-length.")
        return self._members[split]
