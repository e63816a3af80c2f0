"""Data and tokenizer files that are not what they claim: each refused in one line that names the file and the fix,
before any device work, and no file of the user's written or removed (a sweep of such inputs found each case)."""

import os
import re

import numpy as np
import pytest

from mtx.cli import parse_config
from mtx.config import Config
from mtx.data import IndexedDatasetWriter, build_dataset
from mtx.data.dataset import _parse_split
from mtx.data.preprocess import main as preprocess
from mtx.data.tokenizer import build_tokenizer
from helpers import refused_in_one_line as _refused



def _build(*paths, **fields):
    return build_dataset(Config().replace(data_path=tuple(str(p) for p in paths), seq_length=16, **fields))


def test_npy_files_numpy_cannot_read_name_the_file_not_numpys_advice(tmp_path):
    good = np.arange(100, dtype=np.int32)
    np.save(tmp_path / "good.npy", good)
    cases = {"empty.npy": b"", "truncated.npy": (tmp_path / "good.npy").read_bytes()[:300],
             "text.npy": b"just some text, named .npy\n"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for name in [*cases, "objects.npy"]:
        message = _refused(f"--data-path .*{name} is not a readable .npy array of token ids", _build, tmp_path / name)
        assert "allow_pickle" not in message  # numpy's own fix (load it unsafely) is not one to pass on


def test_binary_files_are_not_read_as_text(tmp_path):
    with IndexedDatasetWriter(tmp_path / "corpus_text_document", np.uint16) as w:
        w.add_document(np.arange(1, 300))
    (tmp_path / "corpus_text_document.idx").unlink()
    _refused("corpus_text_document.bin is half of an indexed dataset and .*corpus_text_document.idx does not exist",
             _build, tmp_path / "corpus_text_document.bin")
    (tmp_path / "blob.dat").write_bytes(b"ab\x00cd" * 100)  # valid UTF-8, but NUL bytes: binary
    _refused("blob.dat holds NUL bytes, so it is binary", _build, tmp_path / "blob.dat")


def test_indexed_datasets_of_floats_are_refused(tmp_path):
    prefix = tmp_path / "floats_text_sentence"
    with IndexedDatasetWriter(prefix, np.float32) as w:
        w.add_document(np.arange(200) + 0.5)
    _refused("holds float32 values, not token ids", _build, prefix)


def test_bert_refuses_floats_and_a_dataset_written_without_split_sentences(shared_data, tmp_path):
    bert = dict(model_type="bert", vocab_file=str(shared_data / "bert" / "vocab.txt"))
    with IndexedDatasetWriter(tmp_path / "floats_text_sentence", np.float32) as w:  # once trained on, exit 0
        for i in range(20):
            w.add_item(np.arange(1000, 1020) + i + 0.5)
            w.add_item(np.arange(1000, 1020) + i + 0.5)
            w.end_document()
    _refused("holds float32 values, not token ids", _build, tmp_path / "floats_text_sentence", **bert)
    with IndexedDatasetWriter(tmp_path / "docs_text_document", np.int32) as w:
        for i in range(20):
            w.add_document(np.arange(1000, 1040) + i)
    _refused("written without --split-sentences.*re-run .*preprocess.* with --split-sentences", _build,
             tmp_path / "docs_text_document", **bert)


def test_a_blend_member_too_small_for_a_validation_share_still_trains(tmp_path):
    (tmp_path / "big.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "small.txt").write_text("forty bytes of text, enough for training")  # valid share: 4 bytes
    ds = _build("0.5", tmp_path / "big.txt", "0.5", tmp_path / "small.txt", split="90,10,0")
    assert ds.num_samples("valid") > 0 and ds.datasets[1].num_samples("train") > 0
    # alone, or in a blend where no member has validation samples, it is refused, naming the file
    _refused("the valid split of --data-path .*small.txt holds", _build, tmp_path / "small.txt", split="90,10,0")
    # files without weights are one dataset, not a blend: its validation share is checked as one
    (tmp_path / "small2.txt").write_text("forty bytes of text, enough for training")
    _refused("the valid split of --data-path .*small.txt .*small2.txt holds", _build, tmp_path / "small.txt",
             tmp_path / "small2.txt", split="90,10,0")
    _refused("no blended dataset holds a validation sample", _build, "1", tmp_path / "small.txt", "1",
             tmp_path / "small2.txt", split="90,10,0")
    # a dataset given twice (spelt two ways too) would be blended with itself
    _refused(r"--data-path .*small.txt is given twice; pass each dataset once.", _build, "1", tmp_path / "small.txt",
             "1", tmp_path / "small.txt")
    _refused(r"is given twice \(as .*small.txt and .*/./small.txt\)", _build, tmp_path / "small.txt",
             f"{tmp_path}/./small.txt")


def test_a_run_that_does_not_evaluate_needs_no_validation_split(tmp_path, capsys):
    """With --eval-interval 0 nothing reads the valid split, so a corpus of one document (an indexed dataset's split
    falls between documents) trains; evaluating, the refusal names --eval-interval 0 too. Evaluating with no
    validation share says so (it was silent)."""
    with IndexedDatasetWriter(tmp_path / "one_text_document", np.uint16) as w:
        w.add_document(np.arange(1, 300) % 250)
    with IndexedDatasetWriter(tmp_path / "two_text_document", np.uint16) as w:
        w.add_document(np.arange(1, 300) % 250)
    one, two = tmp_path / "one_text_document", tmp_path / "two_text_document"
    _refused(r"the valid split of .* \(or --eval-interval 0: no validation\)", _build, one)
    assert _build(one, eval_interval=0).num_samples("train") > 0
    _refused(r"no blended dataset holds a validation sample .*\(or --eval-interval 0", _build, "1", one, "1", two)
    assert _build("1", one, "1", two, eval_interval=0).num_samples("train") > 0
    from mtx.data import say_what_data_overrides
    cfg = Config().replace(split="100,0,0", eval_interval=5, vocab_size=1000)
    say_what_data_overrides(cfg, build_dataset(cfg))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "replaced by the tokenizer's 257" in err[0] and "evaluates nothing" in err[1], err
    cfg = Config().replace(data_path=("0", str(one), "1", str(two)), eval_interval=0)
    say_what_data_overrides(cfg, build_dataset(cfg))
    assert capsys.readouterr().err == f"mtx: --data-path {one}: weight 0, never sampled.\n"  # silent once


def test_a_negative_blend_weight_is_named_as_such():
    cfg = parse_config(["--data-path", "-0.5", "a", "1", "b"])  # argparse once read -0.5 as a flag's value
    _refused("blend weights \\[-0.5, 1.0\\] must be non-negative", build_dataset, cfg)


def test_tokenizer_files_the_chosen_tokenizer_would_not_read_are_refused(tmp_path):
    for name in ("encoder.json", "vocab.bpe", "vocab.txt"):
        (tmp_path / name).write_text("x")
    enc, bpe, txt = (str(tmp_path / n) for n in ("encoder.json", "vocab.bpe", "vocab.txt"))
    _refused("--tokenizer-type byte does not read --vocab-file or --merge-file", build_tokenizer, enc, bpe, "byte")
    _refused("--tokenizer-type BertWordPieceLowerCase does not read --merge-file", build_tokenizer, txt, bpe,
             "BertWordPieceLowerCase")


def _checksums(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_preprocess_never_touches_a_users_temporary_files(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "hello world"}\n{"text": "again"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "hello world"}\nnot json\n')
    out = tmp_path / "out"
    out.mkdir()
    for name in ("o_text_document.bin.tmp", "o_text_document.idx.tmp", "z_text_document.bin.tmp"):
        (out / name).write_text("the user's own file")
    before = _checksums(out)
    with pytest.raises(SystemExit):  # a bad line: the writer's own partial files go, the user's stay
        preprocess(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(out / "z"),
                    "--tokenizer-type", "byte"])
    assert _checksums(out) == before
    preprocess(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(out / "o"), "--tokenizer-type", "byte"])
    after = _checksums(out)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"o_text_document.bin", "o_text_document.idx"}
    assert oct(os.stat(out / "o_text_document.bin").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("argv, message", [
    (["--input", "EMPTY"], "empty.txt holds no text; pass an input with text."),  # "under --json-keys text" once
    (["--input", "BLANKS", "--json-keys", "text"], "holds no text under --json-keys text"),
    (["--input", "DOCS", "--json-keys", "text", "text"], "--json-keys text text names a key twice"),
])
def test_preprocess_refuses_input_with_nothing_to_write(tmp_path, capsys, argv, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blanks.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp_path / "docs.jsonl").write_text('{"text": "some words"}\n')
    subs = {"EMPTY": "empty.txt", "BLANKS": "blanks.jsonl", "DOCS": "docs.jsonl"}
    argv = [str(tmp_path / subs[a]) if a in subs else a for a in argv]
    with pytest.raises(SystemExit) as e:
        preprocess([*argv, "--output-prefix", str(tmp_path / "out" / "o"), "--tokenizer-type", "byte"])
    lines = capsys.readouterr().err.strip().splitlines()  # the error alone: no progress bar before it
    assert e.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # temporary files gone too


@pytest.mark.parametrize("split", ["1_0,1,1", "1 0,1,1", "１,1,1", "-1,2", "0x1,1", "1,,1", "nan,1,1"])
def test_a_split_takes_plain_decimal_numbers_only(split):
    """float() takes "1_0" and non-ASCII digits, which every other numeric flag refuses (once accepted)."""
    _refused(f"--split {re.escape(repr(split))} must be up to three non-negative weights .* each a plain decimal "
             "number", _build, split=split)


def test_a_split_of_plain_decimal_numbers_reads():
    assert _parse_split("949,50,1") == [0.949, 0.05, 0.001]
    assert _parse_split("1e1/.5/2.") == pytest.approx([10 / 12.5, 0.5 / 12.5, 2 / 12.5])
    assert _parse_split("1") == [1.0, 0.0, 0.0]
    assert _parse_split(" 949, 50, 1") == [0.949, 0.05, 0.001]  # spaces around the numbers, as Megatron takes
