"""Tokenizers: a byte-level one that needs no files, GPT-2 BPE built with tiktoken from local vocab files, and
BERT's uncased WordPiece from a local `vocab.txt`.

Nothing here downloads: `tiktoken.get_encoding("gpt2")` fetches its files from the internet, so GPT-2's BPE is
assembled from the user's own `encoder.json` (`--vocab-file`) and `vocab.bpe` (`--merge-file`) instead.
The type names are Megatron's `--tokenizer-type` values.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path
from typing import Iterable, Protocol

# GPT-2's pre-tokenization regex, as tiktoken_ext.openai_public uses it for "gpt2" (r50k_pat_str).
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_ENDOFTEXT = "<|endoftext|>"
_FIX = "pass GPT-2's encoder.json and vocab.bpe"
TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "byte")


class Tokenizer(Protocol):
    """What the data pipeline and text generation need from a tokenizer."""

    name: str
    vocab_size: int  # ids are 0 .. vocab_size - 1 (before the model pads the vocabulary)
    eod: int  # end-of-document id, placed between documents in the token stream

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and 256 is end-of-document: works on any text with no vocab files."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # eod and ids from the padded part of the vocabulary (a model may sample them) carry no bytes; a sampled
        # byte sequence need not be valid UTF-8, hence errors="replace".
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE (50,257 ids, `<|endoftext|>` = 50256) from local `encoder.json` and `vocab.bpe` files."""

    name = "gpt2"

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        vocab_file, merge_file = str(vocab_file), str(merge_file)
        vocab_bytes, merge_bytes = _read(vocab_file, "--vocab-file"), _read(merge_file, "--merge-file")
        encoder = _check_files(vocab_file, vocab_bytes, merge_file, merge_bytes)
        try:
            # tiktoken caches every file it reads under its path's name, even a local one, and would hand back a
            # stale copy if a file at the same path changed; passing each file's hash makes it check the cache.
            ranks = data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=merge_file, encoder_json_file=vocab_file,
                vocab_bpe_hash=hashlib.sha256(merge_bytes).hexdigest(),
                encoder_json_hash=hashlib.sha256(vocab_bytes).hexdigest())
        except AssertionError:  # tiktoken asserts that the encoder's ids are the merges' ranks
            raise ValueError(f"--vocab-file {vocab_file} does not match --merge-file {merge_file} (the encoder's "
                             f"token ids are not the merge ranks), so they are not one GPT-2 BPE; {_FIX}.") from None
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"--vocab-file {vocab_file} and --merge-file {merge_file} are not GPT-2 BPE files "
                             f"({type(e).__name__}: {_one_line(e)}); {_FIX}.") from None
        # GPT-2's end-of-text id comes right after the mergeable tokens (50256); a file that says otherwise is
        # not a GPT-2 encoder.json.
        eod = encoder.get(_ENDOFTEXT, len(ranks))
        if eod != len(ranks):
            raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 BPE encoder.json ({_ENDOFTEXT} is {eod}, "
                             f"expected {len(ranks)}); {_FIX}.")
        self.eod = eod
        self.vocab_size = eod + 1
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=_GPT2_PAT, mergeable_ranks=ranks,
                                      special_tokens={_ENDOFTEXT: eod}, explicit_n_vocab=self.vocab_size)

    def encode(self, text: str) -> list[int]:
        # "<|endoftext|>" written in the text is a document boundary (as in GPT-2's own training data), not five
        # ordinary tokens; any other special-looking text is encoded as plain text.
        return self._enc.encode(text, allowed_special={_ENDOFTEXT}, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        # Ids in the padded part of the vocabulary (>= 50257) have no text; drop them instead of failing.
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], errors="replace")


class BertWordPieceTokenizer:
    """BERT's uncased WordPiece (Megatron's BertWordPieceLowerCase) from a local `vocab.txt`: ids are line numbers.

    Text is cleaned, lower-cased, stripped of accents and split on whitespace and punctuation (BERT's
    BasicTokenizer); each word is then cut greedily into the longest vocabulary pieces, continuations marked `##`,
    and a word with no such cut becomes [UNK]. No [CLS]/[SEP] are added: the BERT data pipeline places them.
    `eod` is [SEP], the token that separates segments in BERT's inputs.
    """

    name = "bert-wordpiece-lowercase"
    max_word_chars = 100  # longer "words" are [UNK], as in BERT

    def __init__(self, vocab_file: str | Path):
        raw = _read(str(vocab_file), "--vocab-file", "BERT's vocab.txt")
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

    def tokenize(self, text: str) -> list[str]:
        return [piece for word in _basic_tokenize(text) for piece in self._wordpiece(word)]

    def encode(self, text: str) -> list[int]:
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


def build_tokenizer(vocab_file: str | None, merge_file: str | None, tokenizer_type: str | None = None) -> Tokenizer:
    """The tokenizer named by `tokenizer_type` (Megatron's --tokenizer-type names, see TOKENIZER_TYPES).

    Without a type: the byte tokenizer when neither file is given, GPT-2 BPE when both are; ValueError otherwise.
    """
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is unknown; use one of {', '.join(TOKENIZER_TYPES)}.")
    if tokenizer_type == "byte" or (tokenizer_type is None and vocab_file is None and merge_file is None):
        return ByteTokenizer()
    if tokenizer_type == "BertWordPieceLowerCase":
        if vocab_file is None:
            raise ValueError("--tokenizer-type BertWordPieceLowerCase needs --vocab-file (BERT's vocab.txt).")
        return BertWordPieceTokenizer(vocab_file)
    if vocab_file is None or merge_file is None:
        given, missing = ("--vocab-file", "--merge-file") if merge_file is None else ("--merge-file", "--vocab-file")
        if tokenizer_type is None:
            raise ValueError(f"{given} was given without {missing}; pass both (GPT-2's encoder.json and vocab.bpe), "
                             "neither (byte-level tokenizer), or --tokenizer-type BertWordPieceLowerCase for BERT.")
        raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {missing} too; pass GPT-2's encoder.json and "
                         "vocab.bpe.")
    return GPT2Tokenizer(vocab_file, merge_file)


def _read(path: str, flag: str, what: str | None = None) -> bytes:
    if not Path(path).is_file():
        what = what or ("GPT-2's encoder.json" if flag == "--vocab-file" else "GPT-2's vocab.bpe")
        raise ValueError(f"{flag} {path}: no such file; pass the path to {what} (or drop --vocab-file and "
                         "--merge-file to use the byte-level tokenizer).")
    return Path(path).read_bytes()


def _check_files(vocab_file: str, vocab_bytes: bytes, merge_file: str, merge_bytes: bytes) -> dict:
    """Cheap checks that name the wrong file before tiktoken's slower, vaguer ones; returns the parsed encoder."""
    if not merge_bytes.startswith(b"#version"):
        swapped = "; it looks like JSON: are the two flags swapped?" if merge_bytes.lstrip()[:1] == b"{" else ""
        raise ValueError(f"--merge-file {merge_file} is not a GPT-2 BPE vocab.bpe (it does not start with "
                         f"'#version'{swapped}); {_FIX}.")
    try:
        encoder = json.loads(vocab_bytes)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 BPE encoder.json (not valid JSON: "
                         f"{_one_line(e)}); {_FIX}.") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 BPE encoder.json (expected a JSON object of "
                         f"token -> id); {_FIX}.")
    return encoder


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "no details"
