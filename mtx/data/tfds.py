"""Documents from a TensorFlow Datasets dataset, read through `tfds.data_sources` (array_record), without TensorFlow.

Used by `python -m mtx.data.preprocess --tfds NAME[:split]`. Asking for a named TFDS dataset is the one place mtx
may download data (docs/design.md, decision 6): TFDS prepares it under its data_dir on first use.
"""

from __future__ import annotations

from typing import Iterator, Sequence

INSTALL = "pip install tensorflow-datasets array_record"


def parse_spec(spec: str) -> tuple[str, str]:
    """"NAME[:split]" -> (NAME, split); the split defaults to "train". NAME may carry a version ("wikipedia/en:1.0")."""
    name, _, split = spec.partition(":")
    if not name:
        raise ValueError(f"--tfds {spec!r} names no dataset; pass NAME[:split], e.g. --tfds tiny_shakespeare:train.")
    return name, split or "train"


def tfds_documents(spec: str, keys: Sequence[str], data_dir: str | None = None) -> Iterator[dict[str, str]]:
    """Yields {key: text} for every example of the split, in the dataset's order."""
    name, split = parse_spec(spec)
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ValueError(f"--tfds {spec} needs tensorflow_datasets, which is not installed; {INSTALL}.") from None
    try:
        source = tfds.data_sources(name, split=split, data_dir=data_dir)
    except ImportError as e:  # array_record missing: TFDS would need TensorFlow's tf.data instead
        raise ValueError(f"--tfds {spec} reads through array_record, which is not installed ({e}); {INSTALL}.") \
            from None
    except Exception as e:  # noqa: BLE001 - TFDS raises many types for unknown names, splits and formats
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--tfds {spec} could not be opened as an array_record data source ({message}); check the "
                         "name and split, or prepare it with file_format='array_record'.") from None
    for i in range(len(source)):
        example = source[i]
        missing = [k for k in keys if k not in example]
        if missing:
            raise ValueError(f"--tfds {spec} examples have no {', '.join(missing)} feature (they have "
                             f"{', '.join(sorted(example))}); pass those with --json-keys.")
        yield {k: _text(example[k]) for k in keys}


def _text(value) -> str:
    if hasattr(value, "item"):  # numpy scalars and 0-d arrays
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
