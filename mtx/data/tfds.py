"""Documents from a TensorFlow Datasets dataset, read through its array_record data source, without TensorFlow.

Used by `python -m mtx.data.preprocess --tfds NAME[:split]`. Asking for a named TFDS dataset is the one place mtx
may download data (docs/design.md, decision 6): TFDS prepares it under its data_dir on first use, always as
array_record (TFDS's default, tfrecord, needs TensorFlow to write and has no random access).

Errors are narrowed to what they mean: an unknown name, config or version, an unknown split, a dataset prepared in
another format or needing a manual download, a missing package, a failed download each become one line naming the
fix (ValueError); anything else propagates with its traceback.
"""

from __future__ import annotations

import re
from typing import Iterator, Sequence

from mtx.errors import first_line

# (importlib_resources: TFDS imports it without declaring it)
INSTALL = ("pip install 'mtx[tfds]', i.e. pip install importlib_resources and "
           "pip install tensorflow-datasets array_record")
FORMAT = "array_record"


def parse_spec(spec: str) -> tuple[str, str]:
    """"NAME[:version][:split]" -> (NAME[:version], split); the split defaults to "train". NAME may name a config
    ("wikipedia/20230601.en"); a second part of digits and dots is a version ("mnist:3.0.1"), not a split, and a
    split may be sliced ("mnist:3.0.1:train[:10%]")."""
    parts = re.split(r":(?![^\[]*\])", spec)  # at colons outside a slice such as train[:10%]
    if len(parts) > 1 and re.fullmatch(r"[\d*]+(\.[\d*]+)*", parts[1]):
        parts[:2] = [f"{parts[0]}:{parts[1]}"]
    if len(parts) > 2:
        raise ValueError(f"--tfds {spec!r} has more parts than NAME[:version][:split]; pass e.g. --tfds mnist:test.")
    name, split = parts[0], (parts[1:] or ["train"])[0] or "train"
    if not name:
        raise ValueError(f"--tfds {spec!r} names no dataset; pass NAME[:split], e.g. --tfds tiny_shakespeare:train.")
    return name, split


def data_source(spec: str, data_dir: str | None = None):
    """The split as a random-access sequence of example dicts (TFDS's array_record data source), prepared (and
    downloaded) under `data_dir` (TFDS's default when None) on first use."""
    name, split = parse_spec(spec)
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ValueError(f"--tfds {spec} needs tensorflow_datasets, which is not installed; {INSTALL}.") from None
    from tensorflow_datasets.core.registered import DatasetNotFoundError

    try:
        builder = tfds.builder(name, data_dir=data_dir, file_format=FORMAT)
    except ImportError as e:
        raise _missing(spec, e) from None
    except DatasetNotFoundError:
        raise ValueError(f"--tfds {spec}: TFDS has no dataset {name!r}; check the name (tfds.list_builders() lists "
                         "them) or import the module that defines it.") from None
    except AssertionError as e:  # TFDS's way of refusing a config or version it does not have
        raise ValueError(f"--tfds {spec}: {first_line(e, None)}; pass a config and version the dataset has.") from None
    if not builder.is_prepared():
        try:
            builder.download_and_prepare()
        except ImportError as e:
            raise _missing(spec, e) from None
        except AssertionError as e:
            if "Manual directory" not in str(e):
                raise
            raise ValueError(f"--tfds {spec} must be downloaded by hand first ({first_line(e, None)}); follow TFDS's "
                             f"instructions for {name}, then rerun.") from None
        except OSError as e:  # requests' connection errors are OSErrors too
            raise ValueError(f"--tfds {spec}: downloading or preparing it failed ({type(e).__name__}: "
                             f"{first_line(e, None)}); check the network and that --tfds-data-dir is "
                             "writable.") from None
    try:
        return builder.as_data_source(split=split)
    except NotImplementedError:  # prepared earlier in a format without random access (tfrecord, by TensorFlow)
        stored = getattr(builder.info.file_format, "value", "another format")
        raise ValueError(f"--tfds {spec} is prepared in {builder.data_dir} as {stored}, which has no random "
                         f"access; prepare it as {FORMAT} (tfds build {name} "
                         f"--file_format={FORMAT}) or pass another --tfds-data-dir.") from None
    except ValueError as e:  # an unknown or malformed split
        raise ValueError(f"--tfds {spec}: {first_line(e, None)}; pass one of its splits "
                         f"({', '.join(sorted(builder.info.splits))}) as NAME:SPLIT.") from None


def tfds_documents(spec: str, keys: Sequence[str], data_dir: str | None = None) -> Iterator[dict[str, str]]:
    """Yields {key: text} for every example of the split, in the dataset's order."""
    source = data_source(spec, data_dir)
    for i in range(len(source)):
        example = source[i]
        missing = [k for k in keys if k not in example]
        if missing:
            raise ValueError(f"--tfds {spec} examples have no {', '.join(missing)} feature (they have "
                             f"{', '.join(sorted(example))}); pass those with --json-keys.")
        texts = {}
        for k in keys:
            try:
                texts[k] = _text(example[k])
            except UnicodeDecodeError:  # an image's or an id's bytes, say
                raise ValueError(f"--tfds {spec} example {i}: its {k!r} feature is not UTF-8 text; pass text features "
                                 "with --json-keys.") from None
        yield texts


def _missing(spec: str, e: ImportError) -> ValueError:
    """A package TFDS imports on the way (importlib_resources, array_record, a dataset's own) -> the fix."""
    found = e.name or next(iter(re.findall(r"No module named '([\w.]+)'", str(e))), None)  # TFDS re-raises
    if not found:  # without the module's name
        return ValueError(f"--tfds {spec}: an import failed ({first_line(e, None)}); {INSTALL}.")
    module = found.split(".")[0]
    if module == "tensorflow":
        return ValueError(f"--tfds {spec}: preparing this dataset needs TensorFlow, which mtx does not use; prepare "
                          f"it elsewhere as {FORMAT} and pass its data_dir with --tfds-data-dir.")
    return ValueError(f"--tfds {spec} needs the {module} package, which is not installed; pip install {module}.")


def _text(value) -> str:
    if hasattr(value, "item"):  # numpy scalars and 0-d arrays
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
