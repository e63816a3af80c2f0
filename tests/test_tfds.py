"""`python -m mtx.data.preprocess --tfds`: a TFDS split -> .bin/.idx through TFDS's array_record data source, offline
(a tiny builder defined here, prepared under tmp_path) and without TensorFlow; and its one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REASON = "needs tensorflow_datasets, array_record and importlib_resources: pip install -e '.[tfds]'"
tfds = pytest.importorskip("tensorflow_datasets", reason=REASON)
pytest.importorskip("array_record.python.array_record_data_source", reason=REASON)
pytest.importorskip("importlib_resources", reason=REASON)

from mtx.data.indexed import IndexedDataset  # noqa: E402
from mtx.data.preprocess import main as preprocess  # noqa: E402

TRAIN = ["hello world", "", "naïve café, two words\nand a second line"]  # the empty document is skipped
TEST = ["the test split"]


class MtxTinyDocs(tfds.core.GeneratorBasedBuilder):
    """Registered with TFDS as "mtx_tiny_docs": two splits of text documents, generated locally (no download)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(TRAIN), "test": self._generate_examples(TEST)}

    def _generate_examples(self, docs):
        for i, doc in enumerate(docs):
            yield i, {"text": doc}


@pytest.fixture
def no_tensorflow():
    """TensorFlow must stay unimported: where it is not installed an import of it fails the run, and where it is,
    the check at the end of the test finds it in sys.modules."""
    if "tensorflow" in sys.modules:
        pytest.skip("TensorFlow was imported earlier in this process; run this file alone")
    yield
    assert "tensorflow" not in sys.modules


def _documents(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    offsets = ds.document_token_offsets()
    return [ds.tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(ds.num_documents)]


def test_tfds_split_to_indexed_dataset_without_tensorflow(tmp_path, no_tensorflow):
    data_dir = tmp_path / "tfds"
    common = ["--tfds-data-dir", str(data_dir), "--tokenizer-type", "byte", "--append-eod"]
    prefix = preprocess(["--tfds", "mtx_tiny_docs:train", "--output-prefix", str(tmp_path / "train"), *common])[0]
    assert prefix == str(tmp_path / "train_text_document")
    # byte tokenizer: a document's ids are its UTF-8 bytes, then end-of-document (256); the empty one is skipped
    assert _documents(prefix) == [list(doc.encode("utf-8")) + [256] for doc in TRAIN if doc]
    # prepared as array_record even though a data_dir was given (TFDS then defaults to tfrecord, which needs TF)
    assert sorted(p.name for p in (data_dir / "mtx_tiny_docs" / "1.0.0").glob("*.array_record*")) == [
        "mtx_tiny_docs-test.array_record-00000-of-00001", "mtx_tiny_docs-train.array_record-00000-of-00001"]
    test = preprocess(["--tfds", "mtx_tiny_docs:test", "--output-prefix", str(tmp_path / "test"), *common])[0]
    assert _documents(test) == [list(TEST[0].encode()) + [256]]  # read from the prepared data, other split


def test_tfds_errors_are_one_line(tmp_path, refused, no_tensorflow):
    common = ["--tfds-data-dir", str(tmp_path / "tfds"), "--tokenizer-type", "byte", "--output-prefix",
              str(tmp_path / "out")]
    err = refused(["--tfds", "mtx_no_such_dataset", *common])
    assert "TFDS has no dataset 'mtx_no_such_dataset'; check the name" in err
    err = refused(["--tfds", "mtx_tiny_docs:validation", *common])
    assert "Unknown split 'validation'" in err and err.endswith("pass one of its splits (test, train) as NAME:SPLIT.")
    err = refused(["--tfds", "mtx_tiny_docs:train[:x]", *common])
    assert "Error parsing split 'train[:x]'" in err
    err = refused(["--tfds", "mtx_tiny_docs:9.9.9", *common])
    assert "cannot be loaded at version 9.9.9, only: 1.0.0" in err and err.endswith("the dataset has.")
    err = refused(["--tfds", "mtx_tiny_docs", "--json-keys", "body", *common])
    assert "examples have no body feature (they have text); pass those with --json-keys." in err
    assert not list(tmp_path.glob("out*"))  # nothing written


@pytest.mark.parametrize("blocked, expected", [
    # TFDS imports importlib_resources without declaring it: a named dataset then fails before any download
    ("importlib_resources", "needs the importlib_resources package, which is not installed; "
                            "pip install importlib_resources."),
    ("tensorflow_datasets", "needs tensorflow_datasets, which is not installed; pip install 'mtx[tfds]', i.e. "
                            "pip install importlib_resources and pip install tensorflow-datasets array_record."),
])
def test_missing_package_is_named(tmp_path, blocked, expected):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            "from mtx.data.preprocess import main\n"
            f"main(['--tfds', 'tiny_shakespeare', '--tfds-data-dir', {str(tmp_path / 'tfds')!r}, "
            f"'--tokenizer-type', 'byte', '--output-prefix', {str(tmp_path / 'out')!r}])")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors == [f"error: --tfds tiny_shakespeare {expected}"]
    assert not list(tmp_path.glob("out*"))


def test_import_errors_name_what_to_do():
    from mtx.data.tfds import _missing

    reraised = ModuleNotFoundError("Failed to finalize writing of split \"train\": No module named 'tensorflow'")
    assert "needs TensorFlow, which mtx does not use; prepare it elsewhere as array_record" in str(
        _missing("d", reraised))
    named = ModuleNotFoundError("No module named 'apache_beam.io'", name="apache_beam.io")
    assert str(_missing("d", named)).endswith("needs the apache_beam package, which is not installed; "
                                              "pip install apache_beam.")


def test_spec_name_version_split():
    from mtx.data.tfds import parse_spec

    assert parse_spec("mnist") == ("mnist", "train") and parse_spec("mnist:test") == ("mnist", "test")
    assert parse_spec("wikipedia/20230601.en:1.0.0") == ("wikipedia/20230601.en:1.0.0", "train")
    assert parse_spec("mnist:3.*.*:train[:10%]+test[5:]") == ("mnist:3.*.*", "train[:10%]+test[5:]")
    for bad in (":test", "a:b:c"):
        with pytest.raises(ValueError, match="--tfds"):
            parse_spec(bad)


def test_text_of_numpy_values():
    from mtx.data.tfds import _text

    assert _text(np.array(b"caf\xc3\xa9")) == "café" and _text(np.bytes_(b"x")) == "x" and _text("y") == "y"


def test_a_feature_that_is_not_text_is_one_line(monkeypatch):
    from mtx.data import tfds as mtx_tfds

    monkeypatch.setattr(mtx_tfds, "data_source", lambda spec, data_dir: [{"text": b"ok", "image": np.bytes_(b"\xff")}])
    with pytest.raises(ValueError, match=r"^--tfds x:train example 0: its 'image' feature is not UTF-8 text; pass"):
        list(mtx_tfds.tfds_documents("x:train", ["text", "image"]))  # the codec's bare error, once
