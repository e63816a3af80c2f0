"""One token stream, its train/valid/test split, and the batches of every step.

Batch k is a pure function of (tokens, seq_length, seed, k, batch_size): it never depends on how many devices
exist, so the global batch of a step is the same on every mesh (docs/design.md, decision 2) and resuming at step k
needs no saved data state (data position = step). Several streams are mixed by `mtx.data.blend`.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from mtx.cli import STRICT
from mtx.data.tokenizer import Tokenizer

SPLITS = ("train", "valid", "test")
# Modules whose docstrings stand in for the built-in corpus where pydoc_data is not installed.
_FALLBACK_MODULES = ("argparse", "collections", "dataclasses", "functools", "itertools", "json", "os", "pathlib",
                     "re", "statistics", "string", "textwrap", "typing", "unittest")


@functools.cache
def builtin_corpus() -> str:
    """English text shipped with Python itself, so a first run needs no download and no data files.

    It is the reference documentation behind `help("topic")` (`pydoc_data.topics`): 493,500 bytes on Python 3.12,
    99.6% ASCII. Its contents vary slightly between Python versions, so only runs on the same Python compare.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; docstrings are the next best English prose
        import importlib
        import inspect

        texts = []
        for name in _FALLBACK_MODULES:
            module = importlib.import_module(name)
            own = [obj for _, obj in sorted(vars(module).items())  # the module's own classes and functions
                   if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name]
            texts += [inspect.getdoc(obj) or "" for obj in (module, *own)]
        return "\n\n".join(t for t in texts if t)
    return "\n\n".join(topics[key] for key in sorted(topics))


def check_token_ids(ids: np.ndarray, vocab_size: int, source: str) -> None:
    """Refuses ids outside [0, vocab_size): data tokenized with another vocabulary would index past the embedding."""
    if ids.size == 0:
        return
    if np.issubdtype(ids.dtype, np.integer) and 0 <= np.iinfo(ids.dtype).min and np.iinfo(ids.dtype).max < vocab_size:
        return  # every value of the dtype is a valid id (uint16 data for a 65,536+ vocabulary): skip the scan
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} in {source} is outside the vocabulary of {vocab_size}; the data was "
                         "tokenized with a different vocabulary — re-tokenize it or pass the tokenizer it was made "
                         "with (--vocab-file, --tokenizer-type" + (f"; NullTokenizer: --vocab-size {bad} or more" if
                                                                   bad > 0 else "") + ").")


class GPTDataset:
    """A 1-D token stream split contiguously into train/valid/test, served as windows of seq_length + 1 tokens.

    Sample j of a split is its tokens [j S, j S + S + 1): windows overlap by one token so that every token but a
    split's last is a target once (input = w[:-1], target = w[1:], as in Megatron). The training samples are read
    in an infinite sequence of epochs, each a fresh permutation; valid and test are read in order, wrapping around.

    With `doc_offsets` ((documents + 1,) token offsets, as an indexed dataset has), --split cuts between documents,
    as Megatron does, instead of between tokens. `tokens` may be a memory map: it is never copied whole. `stream`
    tells apart the training orders of the datasets of one blend, which share the seed.
    """

    def __init__(self, tokens: np.ndarray, *, seq_length: int, split: str = "949,50,1", seed: int,
                 tokenizer: Tokenizer, doc_offsets: np.ndarray | None = None, stream: int = 0,
                 source: str = "the token stream", in_blend: bool = False, evaluated: bool = True):
        tokens = tokens if isinstance(tokens, np.memmap) else np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"the token stream must be a 1-D integer array, got {tokens.dtype} of shape "
                             f"{tokens.shape}.")
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}.")
        check_token_ids(tokens, tokenizer.vocab_size, source)
        self.tokens = tokens if isinstance(tokens, np.memmap) else tokens.astype(np.int32, copy=False)
        self.seq_length, self.seed, self.stream, self.tokenizer = seq_length, seed, stream, tokenizer
        self.source = source
        weights = _parse_split(split)
        if doc_offsets is None:
            bounds = _split_bounds(weights, len(self.tokens))
        else:
            bounds = [int(doc_offsets[b]) for b in _split_bounds(weights, len(doc_offsets) - 1)]
        self._parts = {name: self.tokens[bounds[i]:bounds[i + 1]] for i, name in enumerate(SPLITS)}
        self._weights = dict(zip(SPLITS, weights))
        self._perm, self._perm_epoch = np.empty(0, np.int64), -1  # the last epoch's training order
        self.evaluated = evaluated  # whether the run reads the valid split (--eval-interval > 0)
        for name in ("train", "valid"):
            # Train must hold a sample where it has weight (a dataset of one other split's own data has none), and
            # valid too when the run evaluates, since evaluation reads it. Test is read only once training ends and its
            # default 0.1% share is often shorter than one sequence: an empty test split is skipped then, and only
            # refused when someone asks it for a batch. In a blend, the blend checks that some member holds
            # validation samples (`BlendedDataset`).
            needed = self._weights[name] > 0 and (name == "train" or evaluated and not in_blend)
            if self.num_samples(name) == 0 and needed:
                raise ValueError(self._too_small(name))

    def num_samples(self, split: str) -> int:
        """Windows of seq_length + 1 tokens at stride seq_length that fit in the split: (tokens - 1) // S."""
        return max(len(self._part(split)) - 1, 0) // self.seq_length

    def num_tokens(self, split: str) -> int:
        return len(self._part(split))

    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """(batch_size, seq_length + 1) int32: samples index*batch_size ... (index+1)*batch_size - 1 of the split;
        rows: only those rows of the batch (a process builds the rows its devices hold)."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch size >= 1, got {index} and {batch_size}.")
        return self.samples(split, index * batch_size + np.arange(batch_size, dtype=np.int64)[rows])

    def samples(self, split: str, position: np.ndarray) -> np.ndarray:
        """(len(position), seq_length + 1) int32: the samples at these places of the split's infinite sequence."""
        part, n = self._part(split), self.num_samples(split)
        if n == 0:
            raise ValueError(self._too_small(split))
        epoch, within = np.divmod(position, n)
        if split == "train":
            # A batch spans at most a few epochs (two unless batch_size > n); each epoch's order is drawn once.
            sample = np.empty_like(within)
            for e in np.unique(epoch):
                sample[epoch == e] = self._permutation(int(e))[within[epoch == e]]
        else:
            sample = within
        starts = sample * self.seq_length
        return np.asarray(part[starts[:, None] + np.arange(self.seq_length + 1)], dtype=np.int32)

    def _permutation(self, epoch: int) -> np.ndarray:
        # Seeded by (seed, epoch, split) alone, so any epoch's order can be recomputed on resume without replaying
        # earlier ones. Cached: consecutive batches almost always share an epoch.
        if self._perm_epoch != epoch:
            key = (self.seed, epoch, SPLITS.index("train")) + ((self.stream,) if self.stream else ())
            rng = np.random.default_rng(key)
            self._perm, self._perm_epoch = rng.permutation(self.num_samples("train")), epoch
        return self._perm

    def _part(self, split: str) -> np.ndarray:
        if split not in self._parts:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        return self._parts[split]

    def _too_small(self, split: str) -> str:
        if self._weights[split] == 0:
            return (f"the {split} split is empty because its --split weight is 0; give it a weight (e.g. "
                    "--split 949,50,1) to read from it.")
        share = ", or a larger --split share for it" if self._weights[split] < 1 else ""  # (not all of it already)
        return (f"the {split} split of {self.source} holds {self.num_tokens(split)} tokens, fewer than one sequence of "
                f"--seq-length {self.seq_length} + 1; use a shorter --seq-length, more data (--data-path){share}" +
                (" (or --eval-interval 0: no validation)." if split == "valid" else "."))


def _parse_split(split: str) -> list[float]:
    """Megatron's --split: up to three weights "train,valid,test" (',' or '/'), missing ones 0, normalized. Each a
    plain decimal number as numeric flags take them (spaces around it): float() alone also takes "1_0" and non-ASCII
    digits."""
    try:
        weights = [STRICT[float](w.strip()) for w in re.split(r"[,/]", split)]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or not 0 < sum(weights) < float("inf"):  # nan, inf too
        raise ValueError(f"--split {split!r} must be up to three non-negative weights train,valid,test with a "
                         "positive sum, each a plain decimal number, e.g. 949,50,1.")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def _split_bounds(weights: list[float], n: int) -> list[int]:
    # Rounding the cumulative fractions (not each share) keeps the three parts contiguous and summing to n.
    return [0] + [round(c * n) for c in np.cumsum(weights)[:-1]] + [n]
