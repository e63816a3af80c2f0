"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`, "MMapIndexedDataset"): writer and memory-mapped reader.

`PREFIX.bin` is every sequence's token ids back to back, in one dtype. `PREFIX.idx` is, little-endian, as written by
megatron/core/datasets/indexed_dataset.py:

    magic       9 bytes  b"MMIDIDX\\x00\\x00"
    version     uint64   1
    dtype code  uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    n           uint64   number of sequences
    d + 1       uint64   length of doc_idx
    sizes       int32[n]      tokens in each sequence
    pointers    int64[n]      byte offset of each sequence in the .bin
    doc_idx     int64[d + 1]  sequence index where each document starts, then n

A document is one or more consecutive sequences (sentences when Megatron's preprocessing split them). Reading
maps the .bin, so a corpus larger than memory costs only the pages that batches touch.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from mtx.files import new_temporary

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_CODES = {np.dtype(t): c for c, t in DTYPES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes before the arrays


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits (vocab < 65,500), else int32; half the disk for GPT-2's 50,257."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def is_indexed_prefix(path: str | Path) -> bool:
    """Whether PATH names an indexed dataset: PATH.bin and PATH.idx both exist (PATH itself need not)."""
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


class IndexedDatasetWriter:
    """Streams sequences into PREFIX.bin and writes PREFIX.idx on `close()`; use as a context manager.

    `add_document(ids)` writes a one-sequence document; `add_item(ids)` ... `end_document()` writes a document of
    several sequences (Megatron's sentence-split layout). Both files are written under a temporary name and take
    their names together at `close()`, so an existing dataset of that prefix stays whole until the new one is
    complete; `abort()` (or an exception inside the `with`) removes the partial files instead.
    """

    def __init__(self, prefix: str | Path, dtype=np.int32):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"indexed datasets store {', '.join(str(np.dtype(t)) for t in DTYPES.values())}, not "
                             f"{self.dtype}; pass one of those.")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = new_temporary(f"{self.prefix}.bin")
        self._idx_tmp = None
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"a sequence must be 1-D token ids, got shape {ids.shape}; flatten it first.")
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        if info is not None and ids.size and (ids.min() < info.min or ids.max() > info.max):
            raise ValueError(f"token ids {ids.min()}..{ids.max()} do not fit {self.dtype}; write with a wider dtype "
                             "(e.g. int32).")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(len(ids))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, ids) -> None:
        self.add_item(ids)
        self.end_document()

    def close(self) -> None:
        """Finishes the .bin and writes the .idx (a document left open by add_item is ended first)."""
        if self._bin.closed:
            return
        self._bin.close()
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()
        sizes = np.asarray(self._sizes, np.int32)
        starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)[:-1]]).astype(np.int64)
        pointers = starts * self.dtype.itemsize  # byte offsets: the sequences lie back to back
        self._idx_tmp = new_temporary(f"{self.prefix}.idx")
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(self._doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers[:len(sizes)].tobytes(order="C"))  # [:0] when there are no sequences
            f.write(np.asarray(self._doc_idx, np.int64).tobytes(order="C"))
        for tmp, suffix in ((self._bin_tmp, ".bin"), (self._idx_tmp, ".idx")):
            os.replace(tmp, f"{self.prefix}{suffix}")

    def abort(self) -> None:
        """Drops what was written (this writer's own temporary files); files of this prefix from before stay as they
        were."""
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.abort() if kind is not None else self.close()


class IndexedDataset:
    """A read-only, memory-mapped PREFIX.bin/.idx pair, checked on open so that a broken pair fails at once.

    `tokens` is the whole .bin as one 1-D array (sequences are contiguous, in order); `document_tokens(i, j)` the
    tokens of documents i..j-1 as a view of it. Given `vocab_size`, ids outside [0, vocab_size) are refused (one
    vectorized pass over the map, skipped where the dtype cannot hold such ids).
    """

    def __init__(self, prefix: str | Path, vocab_size: int | None = None):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise ValueError(f"--data-path {self.prefix}: {p} does not exist; an indexed dataset needs both "
                                 "PREFIX.bin and PREFIX.idx (write them with `python -m mtx.data.preprocess`).")
        raw = idx_path.read_bytes()
        fix = (f"regenerate {self.prefix}.bin/.idx with `python -m mtx.data.preprocess` (or Megatron's "
               "preprocess_data.py)")
        if raw[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron indexed-dataset index (bad magic {raw[:9]!r}); {fix}.")
        if len(raw) < _HEADER:
            raise ValueError(f"{idx_path} is truncated ({len(raw)} bytes, shorter than its header); {fix}.")
        (version,), (code,) = struct.unpack_from("<Q", raw, 9), struct.unpack_from("<B", raw, 17)
        n, docs = struct.unpack_from("<QQ", raw, 18)
        if version != VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version {VERSION} is read, so {fix}.")
        if code not in DTYPES:
            raise ValueError(f"{idx_path} has unknown dtype code {code} (known: 1-8); {fix}.")
        self.dtype = np.dtype(DTYPES[code])
        if self.dtype.kind == "f":  # Megatron's codes include floats; token ids never are
            raise ValueError(f"{bin_path} holds {self.dtype} values, not token ids; {_RETOKENIZE}.")
        want = _HEADER + 4 * n + 8 * n + 8 * docs
        if len(raw) not in (want, want + n):  # + n: Megatron's multimodal indexes append one mode byte a sequence
            raise ValueError(f"{idx_path} holds {len(raw)} bytes but its header describes {want} ({n} sequences, "
                             f"{docs} doc_idx entries), so it is truncated or corrupt; {fix}.")
        self.sizes = np.frombuffer(raw, np.int32, n, _HEADER)
        self.pointers = np.frombuffer(raw, np.int64, n, _HEADER + 4 * n)
        self.doc_idx = np.frombuffer(raw, np.int64, docs, _HEADER + 12 * n)
        ends = np.cumsum(self.sizes, dtype=np.int64) * self.dtype.itemsize
        if (self.sizes < 0).any() or not np.array_equal(self.pointers, ends - self.sizes * self.dtype.itemsize):
            raise ValueError(f"{idx_path} has sequence sizes and byte pointers that disagree (the sequences are not "
                             f"contiguous from byte 0); {fix}.")
        if docs < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n or (np.diff(self.doc_idx) < 0).any():
            raise ValueError(f"{idx_path} has a doc_idx that does not run from 0 to its {n} sequences; {fix}.")
        total = int(ends[-1]) if n else 0
        if bin_path.stat().st_size != total:
            raise ValueError(f"{bin_path} holds {bin_path.stat().st_size} bytes but {idx_path} describes {total}; "
                             f"the .bin is truncated or belongs to another .idx, so {fix}.")
        self.tokens = (np.memmap(bin_path, self.dtype, mode="r") if total else np.empty(0, self.dtype))
        if vocab_size is not None:
            self._check_vocab(vocab_size)

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sizes[i])]

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def document_token_offsets(self) -> np.ndarray:
        """(documents + 1,) int64: document i is tokens[offsets[i]:offsets[i + 1]]."""
        starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        return starts[self.doc_idx]

    def document_tokens(self, first: int, last: int) -> np.ndarray:
        """Tokens of documents first .. last - 1, a view of the map."""
        offsets = self.document_token_offsets()
        return self.tokens[offsets[first]:offsets[last]]

    def _check_vocab(self, vocab_size: int) -> None:
        info = np.iinfo(self.dtype)
        if info.min >= 0 and info.max < vocab_size or not len(self.tokens):
            return  # every value the dtype can hold is a valid id
        lo, hi = int(self.tokens.min()), int(self.tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} in {self.prefix}.bin is outside the vocabulary of "
                             f"{vocab_size}; {_RETOKENIZE}" + (f" (NullTokenizer: --vocab-size {hi} or more)." if
                                                                  lo >= 0 else "."))


_RETOKENIZE = ("it was tokenized with a different vocabulary — pass the tokenizer it was made with (--vocab-file, "
               "--tokenizer-type) or re-run `python -m mtx.data.preprocess` with yours")
