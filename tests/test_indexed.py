"""Megatron .bin/.idx datasets, the preprocess CLI and blends: exact bytes, exact windows, weights, resume, errors."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from mtx.config import Config
from mtx.data import BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetWriter, build_dataset
from mtx.data.blend import blending_pattern
from mtx.data.paths import parse_data_path
from mtx.data.preprocess import main as preprocess
from mtx.data.tokenizer import ByteTokenizer, build_tokenizer


def _write(prefix, documents, dtype=np.int32):
    """Writes documents, each a list of sequences, and returns the prefix as a string."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            for seq in doc:
                w.add_item(seq)
            w.end_document()
    return str(prefix)


def _megatron_idx(code, sizes, doc_idx, itemsize):
    """The .idx bytes exactly as Megatron's _IndexWriter.write lays them out."""
    sizes = np.asarray(sizes, np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * itemsize
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(sizes))
            + struct.pack("<Q", len(doc_idx)) + sizes.tobytes() + pointers.tobytes()
            + np.asarray(doc_idx, np.int64).tobytes())


def _random_docs(rng, n, lo, hi):
    return [[rng.integers(lo, hi, rng.integers(5, 60))] for _ in range(n)]


# --- the format ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_round_trip_keeps_sequences_documents_and_dtype(tmp_path, dtype):
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10], [], [11]]]
    ds = IndexedDataset(_write(tmp_path / "d", docs, dtype))
    assert ds.dtype == np.dtype(dtype) and len(ds) == 6 and ds.num_documents == 3
    np.testing.assert_array_equal(ds.sizes, [3, 2, 1, 4, 0, 1])
    np.testing.assert_array_equal(ds.doc_idx, [0, 2, 3, 6])
    np.testing.assert_array_equal(ds[3], [7, 8, 9, 10])
    np.testing.assert_array_equal(ds.document_token_offsets(), [0, 5, 6, 11])
    np.testing.assert_array_equal(ds.document_tokens(1, 3), [6, 7, 8, 9, 10, 11])
    assert isinstance(ds.tokens, np.memmap)


def test_reads_megatron_bytes_and_writes_them_identically(tmp_path):
    seqs = [[50256, 15496, 995], [1, 2], [65535]]
    (tmp_path / "m.bin").write_bytes(np.concatenate(seqs).astype(np.uint16).tobytes())
    (tmp_path / "m.idx").write_bytes(_megatron_idx(8, [3, 2, 1], [0, 2, 3], 2))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.uint16
    np.testing.assert_array_equal(ds.pointers, [0, 6, 10])
    np.testing.assert_array_equal(ds.document_tokens(0, 1), [50256, 15496, 995, 1, 2])
    np.testing.assert_array_equal(ds[2], [65535])
    _write(tmp_path / "ours", [[seqs[0], seqs[1]], [seqs[2]]], np.uint16)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()


def _one_line_error(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


def test_broken_pairs_fail_on_open_with_one_line(tmp_path):
    prefix = _write(tmp_path / "d", [[[1, 2, 3]], [[4, 5]]])
    other = _write(tmp_path / "o", [[[1, 2, 3, 4]], [[5]], [[6]]])
    good_idx, good_bin = (tmp_path / "d.idx").read_bytes(), (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(good_bin[:-4])
    _one_line_error(r"d\.bin holds 16 bytes but .*d\.idx describes 20; the \.bin is truncated.*preprocess",
                    IndexedDataset, prefix)
    (tmp_path / "d.bin").write_bytes(good_bin + b"\0" * 8)
    _one_line_error("holds 28 bytes", IndexedDataset, prefix)
    (tmp_path / "d.bin").write_bytes(good_bin)
    (tmp_path / "d.idx").write_bytes((tmp_path / "o.idx").read_bytes())  # the .idx of another dataset
    _one_line_error(r"d\.bin holds 20 bytes but .*describes 24", IndexedDataset, prefix)
    (tmp_path / "d.idx").write_bytes(good_idx[:-8])
    _one_line_error("truncated or corrupt", IndexedDataset, prefix)
    (tmp_path / "d.idx").write_bytes(b"TNTIDX\x00\x00" + good_idx[8:])
    _one_line_error("bad magic", IndexedDataset, prefix)
    (tmp_path / "d.idx").write_bytes(good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:])
    _one_line_error("index version 2", IndexedDataset, prefix)
    (tmp_path / "d.idx").write_bytes(good_idx[:17] + b"\x09" + good_idx[18:])
    _one_line_error("unknown dtype code 9", IndexedDataset, prefix)
    (tmp_path / "d.idx").unlink()
    _one_line_error(r"d\.idx does not exist", IndexedDataset, prefix)
    assert IndexedDataset(other).num_documents == 3


def test_ids_outside_the_vocabulary_are_refused(tmp_path):
    prefix = _write(tmp_path / "d", [[[1, 2, 300]], [[4]]])
    _one_line_error(r"token id 300 in .*d\.bin is outside the vocabulary of 257", IndexedDataset, prefix, 257)
    IndexedDataset(prefix, 301)
    cfg = Config().replace(data_path=(prefix,), seq_length=2, split="1,0,0")
    _one_line_error(r"token id 300 in --data-path .*d\.bin is outside the vocabulary of 257", build_dataset, cfg)
    _write(tmp_path / "u", [[[1, 2, 255]]], np.uint8)  # uint8 ids always fit the byte vocabulary
    assert build_dataset(cfg.replace(data_path=(str(tmp_path / "u"),))).num_samples("train") == 1


# --- preprocess ---------------------------------------------------------------------------------------------------

def test_preprocess_jsonl_gives_the_expected_windows(tmp_path):
    texts = [f"document {i}: " + "abcdefghij"[i] * (7 + 3 * i) for i in range(10)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    prefix = preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--append-eod"])[0]
    assert prefix == str(tmp_path / "out_text_document")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.num_documents == 10
    want = [list(t.encode()) + [256] for t in texts]
    for i, doc in enumerate(want):
        np.testing.assert_array_equal(ds.document_tokens(i, i + 1), doc)
    S = 8
    data = build_dataset(Config().replace(data_path=(prefix,), seq_length=S, split="8,2,0"))
    # --split cuts between documents: train is documents 0-7, valid 8-9, read as windows of S + 1 at stride S.
    train, valid = np.concatenate(want[:8]), np.concatenate(want[8:])
    assert data.num_samples("train") == (len(train) - 1) // S and data.num_samples("valid") == (len(valid) - 1) // S
    n = data.num_samples("train")
    windows = sorted(tuple(train[j * S:j * S + S + 1]) for j in range(n))
    epoch = data.batch("train", 0, n)  # one epoch: every window once, in a seeded order
    assert sorted(tuple(r) for r in epoch.tolist()) == windows and epoch.tolist() != [list(w) for w in windows]
    np.testing.assert_array_equal(data.batch("valid", 0, 2), [valid[:S + 1], valid[S:2 * S + 1]])


def test_preprocess_gpt2_with_workers_matches_the_tokenizer(shared_data, tmp_path):
    enc, bpe = str(shared_data / "gpt2" / "encoder.json"), str(shared_data / "gpt2" / "vocab.bpe")
    lines = [ln for ln in (shared_data / "wikitext-2" / "valid.txt").read_text().split("\n") if ln.strip()][:40]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in lines[:25]))
    (tmp_path / "b.txt").write_text("\n".join(lines[25:]))
    prefix = preprocess(["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--json-keys", "body",
                         "--output-prefix", str(tmp_path / "w"), "--vocab-file", enc, "--merge-file", bpe,
                         "--workers", "2"])[0]
    tok, ds = build_tokenizer(enc, bpe), IndexedDataset(prefix)
    docs = lines[:25] + ["\n".join(lines[25:])]
    assert ds.num_documents == 26
    for i, text in enumerate(docs):
        assert ds.document_tokens(i, i + 1).tolist() == tok.encode(text)


def test_preprocess_errors(tmp_path, refused):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    out = ["--output-prefix", str(tmp_path / "o")]
    assert "bad.jsonl line 2 is not a JSON object with the --json-keys text" in refused(
        ["--input", str(tmp_path / "bad.jsonl"), *out])
    assert "exactly one" in refused(out)
    (tmp_path / "empty.jsonl").write_text("")
    assert "holds no documents" in refused(["--input", str(tmp_path / "empty.jsonl"), *out])
    (tmp_path / "number.jsonl").write_text('{"text": "ok"}\n{"text": 42}\n')
    assert "number.jsonl line 2: 'text' is int '42', not a string" in refused(
        ["--input", str(tmp_path / "number.jsonl"), *out])
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)))
    assert "--input " + str(tmp_path / "binary.txt") + " is not UTF-8 text" in refused(
        ["--input", str(tmp_path / "binary.txt"), *out])
    (tmp_path / "nul.txt").write_bytes(b"text\x00with a NUL")  # UTF-8, but binary: once tokenized
    assert "nul.txt holds NUL bytes, so it is binary" in refused(["--input", str(tmp_path / "nul.txt"), *out])
    (tmp_path / "folder").mkdir()
    assert "folder: is a directory; pass JSONL" in refused(["--input", str(tmp_path / "folder"), *out])
    assert "--output-prefix is empty" in refused(["--input", str(tmp_path / "nul.txt"), "--output-prefix", " "])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "binary.txt", "empty.jsonl", "folder",
                                                          "nul.txt", "number.jsonl"]  # nothing written


def test_preprocess_never_replaces_a_dataset_unless_told(tmp_path, refused):
    (tmp_path / "a.jsonl").write_text('{"text": "one document"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "another, longer document"}\n')
    prefix = ["--output-prefix", str(tmp_path / "w")]
    written = preprocess(["--input", str(tmp_path / "a.jsonl"), *prefix])[0]
    before = Path(written + ".bin").read_bytes()
    assert "exist(s) already" in refused(["--input", str(tmp_path / "b.jsonl"), *prefix])
    assert Path(written + ".bin").read_bytes() == before
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": ["not", "text"]}\n')
    assert "not a string" in refused(["--input", str(tmp_path / "c.jsonl"), *prefix, "--overwrite"])
    assert Path(written + ".bin").read_bytes() == before  # a failed --overwrite leaves the old dataset whole
    preprocess(["--input", str(tmp_path / "b.jsonl"), *prefix, "--overwrite"])
    assert Path(written + ".bin").read_bytes() != before
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "file").write_text("")
    assert "is a file, not a directory" in refused(
        ["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "file" / "x")])
    # an input that is one of the outputs: even --overwrite does not replace what it reads (once it did)
    kept = Path(written + ".bin").read_bytes()
    assert "is one of the files --output-prefix" in refused(
        ["--input", written + ".bin", *prefix, "--overwrite", "--tokenizer-type", "byte"])
    assert Path(written + ".bin").read_bytes() == kept


def test_preprocess_refuses_names_that_are_no_file_names(tmp_path, refused, monkeypatch):
    """Keys and prefixes that once wrote into folders or '..' (a/b, ../in), files named x__document.bin or
    pp/_text_document.bin; inputs given twice (documents written twice); empty paths once read as '.'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some words")
    (tmp_path / "pp").mkdir()
    out = ["--output-prefix", "o"]
    for key in ["a/b", "../in", "", ".", "..", "a\\b"]:
        assert f"--json-keys {key!r}: each key is part of its output files' names" in refused(
            ["--input", "a.txt", *out, "--json-keys", "text", key])
    assert "--output-prefix pp/ ends in '/'; the prefix must end in a file-name part, e.g. pp/corpus" in refused(
        ["--input", "a.txt", "--output-prefix", "pp/"])
    assert "--output-prefix new/ ends in '/'; the prefix must end in a file-name part" in refused(
        ["--input", "a.txt", "--output-prefix", "new/"])
    assert "--input a.txt is given twice; pass each file once" in refused(["--input", "a.txt", "a.txt", *out])
    assert "--input a.txt is given twice (as ./a.txt and a.txt)" in refused(["--input", "./a.txt", "a.txt", *out])
    assert "--input is empty; pass JSONL or plain-text files" in refused(["--input", "", *out])
    assert "--input a.txt '': path 2 of 2 is empty" in refused(["--input", "a.txt", "", *out])
    assert "--tfds is empty" in refused(["--tfds", "", *out])
    assert "--vocab-file is empty; pass GPT-2's encoder.json" in refused(["--input", "a.txt", *out, "--vocab-file", ""])
    assert "--tfds-data-dir is where --tfds reads its datasets; with --input drop it." in refused(
        ["--input", "a.txt", *out, "--tfds-data-dir", "tf"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "pp"] and not any((tmp_path / "pp").iterdir())


# --- blends -------------------------------------------------------------------------------------------------------

@pytest.fixture
def two_prefixes(tmp_path):
    rng = np.random.default_rng(0)
    a = _write(tmp_path / "a", _random_docs(rng, 300, 0, 100), np.uint16)  # ids 0..99
    b = _write(tmp_path / "b", _random_docs(rng, 200, 100, 200), np.uint16)  # ids 100..199
    return a, b


def _blend(a, b, seed=1, wa="0.7", wb="0.3"):
    return build_dataset(Config().replace(data_path=(wa, a, wb, b), seq_length=16, split="969,30,1", seed=seed))


def test_blend_hits_the_weights_and_is_deterministic(two_prefixes):
    a, b = two_prefixes
    ds = _blend(*two_prefixes)
    assert isinstance(ds, BlendedDataset) and ds.weights == pytest.approx([0.7, 0.3])
    rows = np.concatenate([ds.batch("train", k, 100) for k in range(100)])  # 10k samples, > 1 epoch of both
    from_a = rows.max(axis=1) < 100
    assert np.all(from_a | (rows.min(axis=1) >= 100))  # a sample never mixes the two datasets
    assert abs(from_a.mean() - 0.7) < 0.01
    np.testing.assert_array_equal(rows[:300], np.concatenate([_blend(a, b).batch("train", k, 100) for k in range(3)]))
    assert not np.array_equal(rows[:100], _blend(a, b, seed=2).batch("train", 0, 100))
    np.testing.assert_array_equal(ds.batch("train", 4, 100, slice(50, 100)), rows[450:500])  # one process's rows
    valid = ds.batch("valid", 0, 50)
    assert abs((valid.max(axis=1) < 100).mean() - 0.7) <= 0.02
    unweighted = build_dataset(Config().replace(data_path=(a, b), seq_length=16, split="969,30,1"))
    tokens = [len(IndexedDataset(p).tokens) for p in (a, b)]  # unweighted: in proportion to size, like one corpus
    assert unweighted.weights == pytest.approx([t / sum(tokens) for t in tokens])


def test_blending_pattern_is_megatrons_greedy_index_and_long_run_exact():
    weights = (0.5, 0.3, 0.2)
    pattern, rank, counts = blending_pattern(weights, 1000)
    current = [0, 0, 0]
    for i in range(1000):  # helpers.cpp build_blending_indices, line by line
        errors = [w * max(i, 1) - c for w, c in zip(weights, current)]
        d = int(np.argmax(errors))
        assert (pattern[i], rank[i]) == (d, current[d])
        current[d] += 1
    assert counts.tolist() == current == [500, 300, 200]


def test_blend_resume_and_cutting(two_prefixes):
    used = _blend(*two_prefixes)
    for k in range(7):
        used.batch("train", k, 48)
    k = 7
    np.testing.assert_array_equal(used.batch("train", k, 48), _blend(*two_prefixes).batch("train", k, 48))
    far = 10**9 // 48  # a resumed step far into training costs no replay
    whole = _blend(*two_prefixes).batch("train", far, 48)
    ones = np.concatenate([_blend(*two_prefixes).batch("train", far * 48 + j, 1) for j in range(48)])
    np.testing.assert_array_equal(whole, ones)


def test_single_indexed_dataset_resume(two_prefixes):
    cfg = Config().replace(data_path=(two_prefixes[0],), seq_length=16, split="969,30,1", seed=3)
    used = build_dataset(cfg)
    assert isinstance(used, GPTDataset)
    batches = [used.batch("train", k, 32) for k in range(30)]  # crosses an epoch
    np.testing.assert_array_equal(batches[-1], build_dataset(cfg).batch("train", 29, 32))


def test_data_path_parsing_and_blend_errors(two_prefixes, tmp_path):
    a, b = two_prefixes
    assert parse_data_path(["0.7", a, "0.3", b]) == ([0.7, 0.3], [a, b])
    assert parse_data_path([a, b]) == (None, [a, b])
    for bad in (["0.7", a, "0.3"], ["0.7", a, b, "0.3"]):
        _one_line_error("must alternate weight and path, e.g. --data-path 0.7 a 0.3 b", parse_data_path, bad)
    _one_line_error("blend weights .* must be non-negative", _blend, a, b, wa="-1")
    _one_line_error(r"--data-path .*nope: no such file or indexed dataset", _blend, a, str(tmp_path / "nope"))
    os.mkfifo(tmp_path / "fifo")  # exists: once "no such file" (as was a directory)
    _one_line_error(r"--data-path .*fifo: is not a regular file; pass text", _blend, a, str(tmp_path / "fifo"))
    _one_line_error(r"--data-path .*: is a directory; pass text", _blend, a, str(tmp_path))
    # A text file blends with an indexed dataset; a .bin/.idx suffix names the same prefix.
    (tmp_path / "t.txt").write_text("x" * 5000)
    ds = build_dataset(Config().replace(data_path=("1", a + ".bin", "1", str(tmp_path / "t.txt")), seq_length=16))
    rows = np.concatenate([ds.batch("train", k, 100) for k in range(10)])
    assert abs((rows == ord("x")).all(axis=1).mean() - 0.5) < 0.01
    with pytest.raises(ValueError, match="share one tokenizer"):
        BlendedDataset([ds.datasets[0], GPTDataset(np.arange(100), seq_length=8, split="1", seed=0,
                                                         tokenizer=ByteTokenizer())],
                       [1, 1])
