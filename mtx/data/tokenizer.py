"""Tokenizers: a byte-level one that needs no files, and GPT-2 BPE built with tiktoken from local vocab files.

Nothing here downloads: `tiktoken.get_encoding("gpt2")` fetches its files from the internet, so GPT-2's BPE is
assembled from the user's own `encoder.json` (`--vocab-file`) and `vocab.bpe` (`--merge-file`) instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Protocol

# GPT-2's pre-tokenization regex, as tiktoken_ext.openai_public uses it for "gpt2" (r50k_pat_str).
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_ENDOFTEXT = "<|endoftext|>"
_FIX = "pass GPT-2's encoder.json and vocab.bpe"


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


def build_tokenizer(vocab_file: str | None, merge_file: str | None) -> Tokenizer:
    """The byte tokenizer when neither file is given, GPT-2 BPE when both are; raises ValueError otherwise."""
    if vocab_file is None and merge_file is None:
        return ByteTokenizer()
    if vocab_file is None or merge_file is None:
        given, missing = ("--vocab-file", "--merge-file") if merge_file is None else ("--merge-file", "--vocab-file")
        raise ValueError(f"{given} was given without {missing}; pass both (GPT-2's encoder.json and vocab.bpe) "
                         "or neither (byte-level tokenizer).")
    return GPT2Tokenizer(vocab_file, merge_file)


def _read(path: str, flag: str) -> bytes:
    if not Path(path).is_file():
        what = "encoder.json" if flag == "--vocab-file" else "vocab.bpe"
        raise ValueError(f"{flag} {path}: no such file; pass the path to GPT-2's {what} (or drop --vocab-file and "
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
