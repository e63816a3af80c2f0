"""BERT's uncased WordPiece (Megatron's BertWordPieceLowerCase) from a local `vocab.txt`: in Rust through the
`tokenizers` package where it is installed (the same ids, ~4x faster: docs/design.md), else in the pure-Python code
below (BERT's basic tokenization, then greedy longest-match word pieces)."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Iterable

from mtx.files import read_tokenizer_file


class BertWordPieceTokenizer:
    """BERT's uncased WordPiece (Megatron's BertWordPieceLowerCase) from a local `vocab.txt`: ids are line numbers.

    Text is cleaned, lower-cased, stripped of accents and split on whitespace and punctuation (BERT's
    BasicTokenizer); each word is then cut greedily into the longest vocabulary pieces, continuations marked `##`,
    and a word with no such cut becomes [UNK]. No [CLS]/[SEP] are added: the BERT data pipeline places them.
    `eod` is [SEP], the token that separates segments in BERT's inputs.

    fast: encode with the `tokenizers` package (Rust) when it is installed (None, the default) or always (True);
    False keeps the pure-Python code. Both give the same ids (tests/test_tokenizer.py).
    """

    name = "bert-wordpiece-lowercase"
    max_word_chars = 100  # longer "words" are [UNK], as in BERT

    def __init__(self, vocab_file: str | Path, *, fast: bool | None = None):
        raw = read_tokenizer_file(str(vocab_file), "--vocab-file", "BERT's vocab.txt")
        try:
            tokens = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"--vocab-file {vocab_file} is not UTF-8 text; pass BERT's vocab.txt.") from None
        self.vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # the first line of a duplicate wins
        self.inv_vocab = tokens
        missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t not in self.vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file} has no {', '.join(missing)} line, so it is not a BERT "
                             "WordPiece vocab.txt; pass BERT's vocab.txt (one token a line).")
        self.vocab_size = len(tokens)
        self.pad, self.unk, self.cls, self.sep, self.mask = (
            self.vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
        self.eod = self.sep
        self._fast = _rust_wordpiece(self.vocab, self.max_word_chars) if fast is not False else None
        if fast and self._fast is None:
            raise ValueError("BertWordPieceTokenizer(fast=True) needs the tokenizers package: pip install "
                             "'mtx[tokenizers]'.")

    def tokenize(self, text: str) -> list[str]:
        return [piece for word in _basic_tokenize(text) for piece in self._wordpiece(word)]

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:  # line by line: "\n" separates words anyway, and short inputs encode faster
            return [i for line in text.split("\n") for i in self._fast.encode(line, add_special_tokens=False).ids]
        return [self.vocab[piece] for piece in self.tokenize(text)]

    def decode(self, ids: Iterable[int]) -> str:
        text = " ".join(self.inv_vocab[int(i)] for i in ids if 0 <= int(i) < self.vocab_size)
        return text.replace(" ##", "").replace("##", "")

    def _wordpiece(self, word: str) -> list[str]:
        # Greedy longest-match-first: the longest prefix in the vocabulary, then the longest "##" continuation.
        if len(word) > self.max_word_chars:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
            else:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces


def _rust_wordpiece(vocab: dict[str, int], max_word_chars: int):
    """The same uncased WordPiece as a `tokenizers.Tokenizer` (BERT's normalizer and pre-tokenizer, no [CLS]/[SEP]
    template) over mtx's own vocabulary dict; None where the package is not installed."""
    try:
        from tokenizers import Tokenizer as RustTokenizer, models, normalizers, pre_tokenizers
    except ImportError:
        return None
    tok = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=max_word_chars))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


def _basic_tokenize(text: str) -> list[str]:
    """BERT's BasicTokenizer(do_lower_case=True): clean, space out CJK, lower-case, strip accents, split punctuation."""
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r"):
            continue
        if _is_cjk(cp):
            chars += [" ", ch, " "]
        else:
            chars.append(" " if ch.isspace() else ch)
    words = []
    for word in "".join(chars).split():
        word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                words += [current, ch] if current else [ch]
                current = ""
            else:
                current += ch
        if current:
            words.append(current)
    return words


def _is_punctuation(ch: str) -> bool:
    # BERT counts every non-alphanumeric ASCII character as punctuation ("$", "^", "`"), plus Unicode P* classes.
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                             (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
                                             (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))
