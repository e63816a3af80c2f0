"""BERT's WordPiece through the `tokenizers` package gives the pure-Python ids; any local Hugging Face
tokenizer.json works for preprocessing and training (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)."""

import json
import sys

import numpy as np
import pytest

from mtx.config import Config
from mtx.data import build_dataset
from mtx.data.indexed import IndexedDataset
from mtx.data.preprocess import main as preprocess
from mtx.data.tokenizer import BertWordPieceTokenizer, HuggingFaceTokenizer, build_tokenizer

pytest.importorskip("tokenizers", reason="the tokenizers package is not installed (pip install 'mtx[tokenizers]')")

TRICKY = ["Café naïve RÉSUMÉ Ångström", "中文字符和日本語 mixed with text",
          "hello,world!!... $5^2 `x` ~a~ «quote»", "a" * 101, "b" * 100, "", "\n\n", "İstanbul ß ﬁ Ǆ ⅷ", "nul\x00 and \ufffd, tab\tnew\nline\r\n",
          "control\x1cchar", "emoji 😀 and \u200b zero width", "[CLS] [SEP] [MASK] written as text"]


def test_rust_wordpiece_gives_the_python_ids(shared_data):
    vocab = shared_data / "bert" / "vocab.txt"
    python, rust = BertWordPieceTokenizer(vocab, fast=False), BertWordPieceTokenizer(vocab, fast=True)
    assert python._fast is None and rust._fast is not None
    for text in TRICKY:
        assert rust.encode(text) == python.encode(text), text
    wiki = (shared_data / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")[:400_000]
    ids = rust.encode(wiki)
    assert ids == python.encode(wiki) and len(ids) > 80_000


def test_without_the_package_the_python_code_runs(tmp_path, monkeypatch):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "."]) + "\n")
    folder = _hf_tokenizer(tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    tok = BertWordPieceTokenizer(vocab)
    assert tok._fast is None and tok.encode("The cats.") == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="needs the tokenizers package"):
        BertWordPieceTokenizer(vocab, fast=True)
    with pytest.raises(ValueError, match="needs the tokenizers package"):
        HuggingFaceTokenizer(folder)


def _hf_tokenizer(folder, eos="<|endoftext|>"):
    """A small byte-level BPE trained on a few sentences, saved as folder/tokenizer.json (+ tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "tokenizer.json").exists():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "a packed document ends with its token"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    if eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return folder


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
    tok = build_tokenizer(None, None, "HuggingFaceTokenizer", str(_hf_tokenizer(tmp_path / "hf")))
    assert tok.eod == 0 and tok.vocab_size >= 258
    ids = tok.encode("the quick brown fox, déjà vu")
    assert tok.decode(ids) == "the quick brown fox, déjà vu" and tok.eod not in ids
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_config" / "tokenizer.json").write_bytes((tmp_path / "hf" / "tokenizer.json").read_bytes())
    assert HuggingFaceTokenizer(tmp_path / "no_config").eod == 0  # <|endoftext|> found in the vocabulary
    # the tokenizer.json itself (tokenizer_config.json beside it still read: its eos_token is the end of document)
    assert HuggingFaceTokenizer(tmp_path / "hf" / "tokenizer.json").encode("the lazy dog") == tok.encode("the lazy dog")
    assert HuggingFaceTokenizer(_hf_tokenizer(tmp_path / "pad_eos", eos="<pad>") / "tokenizer.json").eod == 1


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "no such file; pass a local directory"),
    (lambda d: d.mkdir(), "holds no tokenizer.json"),
    (lambda d: (d.mkdir(), (d / "tokenizer.json").write_text("{}")), "does not load as a tokenizer.json"),
    (lambda d: (d.mkdir(), (d / "tokenizer.json").write_bytes(b"\xff\xfe")), "does not load as a tokenizer.json"),
    (lambda d: _hf_tokenizer(d, eos="</s>"), "eos_token '</s>' is not in the vocabulary\\); name one of its tokens"),
    # a tokenizer_config.json that does not read was passed over for a fallback token (another end-of-document id)
    (lambda d: (_hf_tokenizer(d, eos=None), (d / "tokenizer_config.json").write_text('{"eos_token": "<pad>",}')),
     "tokenizer_config.json is not readable JSON .*; mend it, or remove it"),
    (lambda d: (_hf_tokenizer(d, eos=None), (d / "tokenizer_config.json").write_text('{"eos_token": 1}')),
     "tokenizer_config.json must be a JSON object whose eos_token is a token's text .*; got 1"),
    (lambda d: (_hf_tokenizer(d, eos=None), (d / "tokenizer_config.json").write_text('["<pad>"]')),
     'must be a JSON object .*; got \\["<pad>"\\]'),
])
def test_hugging_face_tokenizer_errors_are_one_line(tmp_path, setup, message):
    setup(tmp_path / "tok")
    with pytest.raises(ValueError, match=message) as error:
        HuggingFaceTokenizer(tmp_path / "tok")
    assert "\n" not in str(error.value) and "--tokenizer-model" in str(error.value)
    with pytest.raises(ValueError, match="go together"):
        build_tokenizer(None, None, "HuggingFaceTokenizer")


def test_hugging_face_tokenizer_preprocesses_and_trains_on_raw_text(tmp_path):
    folder = str(_hf_tokenizer(tmp_path / "hf"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in ["the lazy dog", "a quick fox"]) + "\n")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]
    [prefix] = preprocess(["--input", str(docs), "--output-prefix", str(tmp_path / "out"), "--append-eod", *flags])
    tok = HuggingFaceTokenizer(folder)
    written = IndexedDataset(prefix)
    assert list(written.tokens) == tok.encode("the lazy dog") + [0] + tok.encode("a quick fox") + [0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = Config().replace(data_path=(str(corpus),), tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder,
                           seq_length=16, split="1,0,0").validate()
    ds = build_dataset(cfg)
    assert ds.tokenizer.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(ds.tokens, tok.encode(corpus.read_text()))


def test_a_resume_with_another_kind_of_tokenizer_says_so(capsys):
    """A checkpoint of the byte tokenizer resumed with a tokenizer of the same vocabulary size loaded in silence."""
    from types import SimpleNamespace

    from mtx.config import Config
    from mtx.resume import say_if_tokenizer_changed

    saved = Config().replace(vocab_size=257)  # trained on the built-in corpus: bytes
    say_if_tokenizer_changed(saved, SimpleNamespace(name="huggingface"), "run")
    assert capsys.readouterr().err == ("mtx: --load run was trained with the byte tokenizer, this run reads its data "
                                       "with the huggingface one (of the same vocabulary size): the ids the weights "
                                       "learned may now mean other tokens.\n")
    say_if_tokenizer_changed(saved, SimpleNamespace(name="byte"), "run")
    moved = saved.replace(vocab_file="/gone/encoder.json", merge_file="/gone/vocab.bpe")  # nothing to compare with
    say_if_tokenizer_changed(moved, SimpleNamespace(name="huggingface"), "run")
    converted = Config().replace(vocab_size=50257)  # mtx.convert from-hf: no data settings, GPT-2's vocabulary
    say_if_tokenizer_changed(converted, SimpleNamespace(name="gpt2"), "run")  # (said "byte", falsely, once)
    assert capsys.readouterr().err == ""
