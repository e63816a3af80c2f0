"""Where data comes from: Megatron's --data-path entries and the reference data folder.

Both the GPT and the BERT dataset builders read --data-path through these functions, so neither builder imports the
other's module for them.
"""

from __future__ import annotations

import os
from pathlib import Path

from mtx.data.indexed import is_indexed_prefix

ENV = "MTX_DATA_DIR"
# Where the reference data folder is looked for when $MTX_DATA_DIR is not set: beside the repository checkout.
_DEFAULT = Path(__file__).resolve().parents[3] / "shared" / "data"


def shared_data_dir() -> Path | None:
    """The reference data folder (GPT-2 vocab files, WikiText, LAMBADA, BERT's vocab.txt, ...): $MTX_DATA_DIR if
    set, else its default place beside the repository; None where it does not exist."""
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else _DEFAULT
    return path if path.is_dir() else None


def parse_data_path(entries) -> tuple[list[float] | None, list[str]]:
    """Megatron's --data-path: paths, or "weight path weight path ..." (weights not yet normalized)."""
    entries = [str(e) for e in entries]
    if not _is_number(entries[0]) or Path(entries[0]).exists():
        return None, entries
    if len(entries) % 2 or not all(_is_number(w) for w in entries[::2]):
        raise ValueError(f"--data-path {' '.join(entries)} starts with a weight, so it must alternate weight and "
                         "path, e.g. --data-path 0.7 a 0.3 b.")
    return [float(w) for w in entries[::2]], entries[1::2]


def indexed_prefix(path: str) -> str | None:
    """The indexed-dataset prefix PATH names (PATH, or PATH without .bin/.idx), or None for a plain file."""
    for prefix in (path, path[:-4] if path.endswith((".bin", ".idx")) else None):
        if prefix and not Path(prefix).is_file() and is_indexed_prefix(prefix):
            return prefix
    return None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
