"""Tokenizers, the token stream split and the batch order: real ids, exact windows, epoch coverage, clear errors."""

import functools
import json

import numpy as np
import pytest

from mtx.config import Config
from mtx.data import GPTDataset, build_dataset, builtin_corpus, check_token_ids
from mtx.data.tokenizer import BertWordPieceTokenizer, ByteTokenizer, GPT2Tokenizer, build_tokenizer


@functools.cache
def _gpt2(folder):
    return build_tokenizer(str(folder / "gpt2" / "encoder.json"), str(folder / "gpt2" / "vocab.bpe"))


class _Wide:
    """A tokenizer stand-in whose vocabulary holds arange(N), so a token's value is its position in the stream."""
    name, vocab_size, eod = "wide", 1 << 20, 0


def _arange_dataset(n=10_000, seq_length=16, split="949,50,1", seed=7):
    return GPTDataset(np.arange(n), seq_length=seq_length, split=split, seed=seed, tokenizer=_Wide())


# --- tokenizers ---------------------------------------------------------------------------------------------------

def test_byte_tokenizer_roundtrip_and_ignores_eod():
    tok = build_tokenizer(None, None)
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eod) == (257, 256)
    ids = tok.encode("héllo ✓")
    assert ids == [104, 195, 169, 108, 108, 111, 32, 226, 156, 147]
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([104, 256, 105, 300]) == "hi"
    assert tok.decode([195]) == "\ufffd"  # a cut UTF-8 sequence is replaced, not an error


def test_gpt2_tokenizer_known_ids(shared_data):
    tok = _gpt2(shared_data)
    assert isinstance(tok, GPT2Tokenizer) and (tok.vocab_size, tok.eod) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256]
    text = "The quick brown fox. <|endoftext|>Zwölf Boxkämpfer!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([15496, 51000, 995]) == "Hello world"  # padded-vocab ids are dropped


def test_bert_vocab_is_refused(shared_data):
    with pytest.raises(ValueError, match=r"--vocab-file .*bert/vocab.txt is not a GPT-2 BPE encoder.json"):
        build_tokenizer(str(shared_data / "bert" / "vocab.txt"), str(shared_data / "gpt2" / "vocab.bpe"))


def test_garbage_and_mismatched_files_are_refused(shared_data, tmp_path):
    merges = shared_data / "gpt2" / "vocab.bpe"
    garbage = tmp_path / "encoder.json"
    garbage.write_text('{"a": 0, ')
    with pytest.raises(ValueError, match="not valid JSON.*GPT-2") as e:
        build_tokenizer(str(garbage), str(merges))
    assert "\n" not in str(e.value)
    # Valid JSON whose tokens are not the merges' (tiktoken's AssertionError becomes a ValueError).
    garbage.write_text(json.dumps({"!": 0, "a": 1}))
    with pytest.raises(ValueError, match="does not match --merge-file.*GPT-2") as e:
        build_tokenizer(str(garbage), str(merges))
    assert e.value.__suppress_context__
    # The real encoder with truncated merges: also a mismatch.
    short = tmp_path / "vocab.bpe"
    short.write_text("\n".join(merges.read_text().split("\n")[:1000]) + "\n")
    with pytest.raises(ValueError, match="does not match"):
        build_tokenizer(str(shared_data / "gpt2" / "encoder.json"), str(short))
    # Swapped flags: caught by the cheap '#version' check.
    with pytest.raises(ValueError, match="--merge-file .* is not a GPT-2 BPE vocab.bpe.*swapped"):
        build_tokenizer(str(merges), str(shared_data / "gpt2" / "encoder.json"))


def test_missing_tokenizer_files_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"^--vocab-file .*nope.json: no such file"):
        build_tokenizer(str(tmp_path / "nope.json"), str(tmp_path / "nope.bpe"))
    (tmp_path / "enc.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^--merge-file .*nope.bpe: no such file"):
        build_tokenizer(str(tmp_path / "enc.json"), str(tmp_path / "nope.bpe"))
    with pytest.raises(ValueError, match="--vocab-file was given without --merge-file"):
        build_tokenizer(str(tmp_path / "enc.json"), None)


def _gpt2_reference_encoder(folder):
    """OpenAI's GPT-2 encoder.py (bytes_to_unicode, get_pairs, the BPE merge loop), written out independently."""
    regex = pytest.importorskip("regex", reason="the reference GPT-2 encoder needs the `regex` module (\\p{L})")
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes keep their code point; the rest get 256, 257, ...
    byte_encoder = dict(zip(bs, map(chr, cs)))
    encoder = json.loads((folder / "gpt2" / "encoder.json").read_text())
    merges = [tuple(m.split()) for m in (folder / "gpt2" / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]]
    ranks = dict(zip(merges, range(len(merges))))
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    @functools.cache
    def bpe(token):
        word = tuple(token)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            first, second = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if (first, second) not in ranks:
                break
            new, i = [], 0
            while i < len(word):
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
        return word

    def encode(text):
        return [encoder[piece] for token in pat.findall(text)
                for piece in bpe("".join(byte_encoder[b] for b in token.encode("utf-8")))]
    return encode


def test_gpt2_tokenizer_equals_the_reference_bpe(shared_data):
    reference, tok = _gpt2_reference_encoder(shared_data), _gpt2(shared_data)
    assert reference("Hello world") == [15496, 995]
    for name in ("wikitext-2/valid.txt", "tinyshakespeare/input.txt"):
        text = (shared_data / name).read_text(encoding="utf-8")
        for start in (0, len(text) // 2):
            chunk = text[start:start + 4000]
            assert tok.encode(chunk) == reference(chunk), name
    odd = "  Zwölf Boxkämpfer, 'll they've 3.14 \t\n\n  naïve — 東京 🙂 end  "
    assert tok.encode(odd) == reference(odd)


def test_bert_wordpiece_hand_checked_ids(shared_data):
    tok = build_tokenizer(str(shared_data / "bert" / "vocab.txt"), None, "BertWordPieceLowerCase")
    assert isinstance(tok, BertWordPieceTokenizer) and tok.vocab_size == 30522
    assert (tok.pad, tok.cls, tok.sep, tok.mask, tok.unk, tok.eod) == (0, 101, 102, 103, 100, 102)
    assert tok.encode("Hello, world!") == [7592, 1010, 2088, 999]  # hello , world ! - no [CLS]/[SEP]
    assert tok.tokenize("unaffable") == ["una", "##ffa", "##ble"]  # the BERT paper's example
    assert tok.tokenize("Héllo CAFÉ\tnaïve") == ["hello", "cafe", "naive"]  # lower-cased, accents stripped
    assert tok.tokenize("$5.00 東京") == ["$", "5", ".", "00", "東", "京"]  # punctuation and CJK split
    assert tok.tokenize("x" * 101) == ["[UNK]"] and tok.encode("\u2603") == [100]  # too long; not in vocab
    assert tok.decode(tok.encode("Unaffable people, really.")) == "unaffable people , really ."


def test_tokenizer_type_choice_and_errors(shared_data, tmp_path):
    vocab = str(shared_data / "bert" / "vocab.txt")
    assert build_tokenizer(None, None, "byte").name == "byte"
    with pytest.raises(ValueError, match="--tokenizer-type byte does not read --vocab-file or --merge-file"):
        build_tokenizer(vocab, str(shared_data / "gpt2" / "vocab.bpe"), "byte")  # once ignored them silently
    with pytest.raises(ValueError, match="--tokenizer-type 'Bert' is unknown; use one of GPT2BPETokenizer"):
        build_tokenizer(vocab, None, "Bert")
    with pytest.raises(ValueError, match="BertWordPieceLowerCase needs --vocab-file"):
        build_tokenizer(None, None, "BertWordPieceLowerCase")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file too"):
        build_tokenizer(vocab, None, "GPT2BPETokenizer")
    with pytest.raises(ValueError, match="or --tokenizer-type BertWordPieceLowerCase for BERT"):
        build_tokenizer(vocab, None)
    (tmp_path / "v.txt").write_text("a\nb\n[UNK]\n")
    with pytest.raises(ValueError, match=r"has no \[PAD\], \[CLS\], \[SEP\], \[MASK\] line"):
        build_tokenizer(str(tmp_path / "v.txt"), None, "BertWordPieceLowerCase")


# --- corpus and id checks -----------------------------------------------------------------------------------------

def test_builtin_corpus_is_english_text():
    text = builtin_corpus()
    raw = text.encode("utf-8")
    assert len(raw) > 100_000
    assert sum(b < 128 for b in raw) / len(raw) > 0.99
    words = text.lower().split()
    assert words.count("the") / len(words) > 0.02  # "the" is ~5% of English prose


def test_check_token_ids():
    check_token_ids(np.array([0, 50256]), 50257, "x")
    with pytest.raises(ValueError, match="^token id 70000 in data.npy is outside the vocabulary of 50257; .*"
                                         "re-tokenize it or pass the tokenizer it was made with"):
        check_token_ids(np.array([5, 70000, 3]), 50257, "data.npy")
    with pytest.raises(ValueError, match="token id -1 in"):
        check_token_ids(np.array([5, -1]), 50257, "data.npy")


# --- dataset ------------------------------------------------------------------------------------------------------

def test_split_sizes_follow_the_weights():
    ds = _arange_dataset(n=10_000, seq_length=16)
    assert [ds.num_tokens(s) for s in ("train", "valid", "test")] == [9490, 500, 10]
    assert [ds.num_samples(s) for s in ("train", "valid", "test")] == [(9490 - 1) // 16, (500 - 1) // 16, 0]


def test_batches_are_contiguous_windows_and_deterministic():
    ds, S = _arange_dataset(seq_length=16), 16
    b = ds.batch("train", 3, 8)
    assert b.shape == (8, S + 1) and b.dtype == np.int32
    # Each row is tokens [j S, j S + S + 1) of the stream: consecutive values starting at a multiple of S.
    np.testing.assert_array_equal(b, b[:, :1] + np.arange(S + 1))
    assert np.all(b[:, 0] % S == 0)
    np.testing.assert_array_equal(b[:, 1:][:, :-1], b[:, :-1][:, 1:])  # targets are the inputs shifted by one
    np.testing.assert_array_equal(b, _arange_dataset(seq_length=16).batch("train", 3, 8))
    assert not np.array_equal(b, ds.batch("train", 4, 8))
    assert not np.array_equal(b, _arange_dataset(seq_length=16, seed=8).batch("train", 3, 8))


def test_batch_does_not_depend_on_how_it_is_cut():
    # Batch k of size B is samples kB .. kB+B-1: the same rows whether read whole or one sample at a time, as
    # data-parallel ranks or microbatches would.
    ds = _arange_dataset(seq_length=16)
    whole = ds.batch("train", 70, 9)  # samples 630..638 cross the epoch boundary at 592
    ones = np.concatenate([ds.batch("train", 70 * 9 + j, 1) for j in range(9)])
    np.testing.assert_array_equal(whole, ones)


def test_rows_of_a_batch_are_those_rows_of_the_whole_batch():
    """dataset.batch(..., rows=) (what one process of a multi-process run builds) is that part of the whole batch,
    for plain windows (across an epoch boundary) and Megatron's document fields."""
    ds = _arange_dataset(seq_length=16)
    np.testing.assert_array_equal(ds.batch("train", 70, 9, slice(3, 7)), ds.batch("train", 70, 9)[3:7])
    docs = build_dataset(Config().replace(seq_length=16, eod_mask_loss=True, reset_position_ids=True))
    part, whole = docs.batch("train", 5, 8, slice(4, 8)), docs.batch("train", 5, 8)
    assert part.keys() == whole.keys()
    for key in whole:
        np.testing.assert_array_equal(part[key], whole[key][4:8], err_msg=key)


def test_each_epoch_covers_every_sample_once():
    ds, S = _arange_dataset(seq_length=16), 16
    n, B = ds.num_samples("train"), 7  # 592 samples; 7 does not divide it, so batches straddle epochs
    rows = np.concatenate([ds.batch("train", k, B) for k in range(-(-3 * n // B))])[:3 * n]
    epochs = (rows[:, 0] // S).reshape(3, n)
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], np.arange(n))


def test_valid_is_sequential_and_wraps():
    ds, S = _arange_dataset(seq_length=16), 16
    n = ds.num_samples("valid")  # 31
    starts = np.concatenate([ds.batch("valid", k, 10) for k in range(4)])[:, 0]
    np.testing.assert_array_equal(starts, 9490 + S * (np.arange(40) % n))


def test_too_small_and_empty_splits():
    with pytest.raises(ValueError, match="train split of the token stream holds .* fewer than one sequence of "
                                         "--seq-length 128.*"
                                         "shorter --seq-length"):
        _arange_dataset(n=100, seq_length=128)
    ds = _arange_dataset(n=1000, seq_length=16, split="1,0,0")
    assert ds.num_samples("valid") == 0
    with pytest.raises(ValueError, match="valid split is empty because its --split weight is 0"):
        ds.batch("valid", 0, 1)
    # The default 0.1% test share is shorter than one sequence here: allowed until someone reads it.
    ds = _arange_dataset(n=10_000, seq_length=16)
    with pytest.raises(ValueError, match="test split of the token stream holds 10 tokens"):
        ds.batch("test", 0, 1)
    with pytest.raises(ValueError, match="--split"):
        _arange_dataset(split="1,-1,0")
    with pytest.raises(ValueError, match="unknown split"):
        ds.batch("training", 0, 1)


# --- build_dataset ------------------------------------------------------------------------------------------------

def test_build_dataset_default_is_builtin_corpus():
    ds = build_dataset(Config().replace(seq_length=64))
    assert ds.tokenizer.name == "byte" and ds.tokenizer.vocab_size == 257
    assert ds.tokenizer.decode(ds.tokens[:len(ds.tokens) // 2]) in builtin_corpus()
    assert ds.batch("train", 0, 4).shape == (4, 65)


def test_build_dataset_gpt2_text_and_npy(shared_data, tmp_path):
    enc, bpe = str(shared_data / "gpt2" / "encoder.json"), str(shared_data / "gpt2" / "vocab.bpe")
    tok = _gpt2(shared_data)
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.npy"
    a.write_text("Hello world. " * 400)
    b.write_text("Zwölf Boxkämpfer jagen Viktor. " * 300)
    np.save(c, np.array([1, 2, 3], np.int64))
    cfg = Config().replace(data_path=(str(a), str(b), str(c)), vocab_file=enc, merge_file=bpe, seq_length=32)
    ds = build_dataset(cfg)
    assert ds.tokenizer.vocab_size == 50257
    want = tok.encode(a.read_text()) + [50256] + tok.encode(b.read_text()) + [50256, 1, 2, 3]
    np.testing.assert_array_equal(ds.tokens, want)
    np.save(c, np.array([1, 70000]))
    with pytest.raises(ValueError, match="token id 70000 in --data-path .*c.npy"):
        build_dataset(cfg)
    with pytest.raises(ValueError, match="^--data-path .*missing.txt: no such file"):
        build_dataset(cfg.replace(data_path=(str(tmp_path / "missing.txt"),)))
    # Text without vocab files is read byte by byte.
    ds = build_dataset(Config().replace(data_path=(str(a),), seq_length=32))
    assert ds.tokenizer.name == "byte" and bytes(ds.tokens.astype(np.uint8)) == a.read_bytes()


def test_build_dataset_tinyshakespeare(shared_data):
    path = shared_data / "tinyshakespeare" / "input.txt"
    ds = build_dataset(Config().replace(data_path=(str(path),), vocab_file=str(shared_data / "gpt2" / "encoder.json"),
                                        merge_file=str(shared_data / "gpt2" / "vocab.bpe"), seq_length=256))
    assert 300_000 < len(ds.tokens) < 400_000  # ~338k GPT-2 tokens in 1.1 MB
    np.testing.assert_array_equal(ds.tokens[:4], [5962, 22307, 25, 198])  # "First Citizen:\n"
    assert ds.tokenizer.decode(ds.batch("valid", 0, 1)[0]) in path.read_text()
