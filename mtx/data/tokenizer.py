"""Tokenizers: a byte-level one that needs no files, GPT-2 BPE built with tiktoken from local vocab files, BERT's
uncased WordPiece from a local `vocab.txt` (mtx/data/wordpiece.py), any local Hugging Face `tokenizer.json`, and
Megatron's NullTokenizer (ids only, for data that is ids already). The type names are Megatron's `--tokenizer-type`
values.

Nothing here downloads: `tiktoken.get_encoding("gpt2")` fetches its files from the internet, so GPT-2's BPE is
assembled from the user's own `encoder.json` (`--vocab-file`) and `vocab.bpe` (`--merge-file`) instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Protocol

from mtx.data.wordpiece import BertWordPieceTokenizer  # noqa: F401 (BERT's, imported with the others from here)
from mtx.errors import first_line
from mtx.files import not_a_file, read_tokenizer_file
from mtx.schema_checks import TOKENIZER_TYPES

# GPT-2's pre-tokenization regex, as tiktoken_ext.openai_public uses it for "gpt2" (r50k_pat_str).
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_ENDOFTEXT = "<|endoftext|>"
_FIX = "pass GPT-2's encoder.json and vocab.bpe"
# HuggingFaceTokenizer's end-of-document token when tokenizer_config.json names no eos_token: the first one present.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


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
        vocab_bytes = read_tokenizer_file(vocab_file, "--vocab-file")
        merge_bytes = read_tokenizer_file(merge_file, "--merge-file")
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
                             f"({type(e).__name__}: {first_line(e)}); {_FIX}.") from None
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


class HuggingFaceTokenizer:
    """Any local Hugging Face tokenizer (Megatron's HuggingFaceTokenizer): DIR/tokenizer.json (or that file given
    itself), loaded with `tokenizers.Tokenizer.from_file` (no download, no transformers).

    Text is encoded without the tokenizer's special-token template (no BOS/EOS added: documents are separated by
    `eod`). `eod` is DIR/tokenizer_config.json's eos_token where it names one, else the first of _EOD_CANDIDATES in
    the vocabulary; vocab_size is one past the largest id (added tokens included).
    """

    name = "huggingface"

    def __init__(self, directory: str | Path):
        given = folder = Path(directory)  # the path named in every refusal: the one the user passed
        file = folder / "tokenizer.json"
        if folder.is_file():  # the tokenizer.json itself: its directory holds any tokenizer_config.json
            folder, file = folder.parent, folder
        elif not folder.is_dir():
            raise ValueError(f"--tokenizer-model {given}: {not_a_file(given)}; pass a local directory holding a "
                             "Hugging Face tokenizer.json, or that file.")
        elif not file.is_file():
            raise ValueError(f"--tokenizer-model {folder} holds no tokenizer.json; pass the directory a Hugging Face "
                             "tokenizer was saved to (tokenizer.save_pretrained(DIR)).")
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs the tokenizers package: pip install "
                             "'mtx[tokenizers]'.") from None
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as e:  # the Rust loader raises plain Exceptions (and a file of other bytes a decode error)
            raise ValueError(f"--tokenizer-model {given}: does not load as a tokenizer.json ({first_line(e)}); pass a "
                             "tokenizer.json written by the tokenizers package.") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"--tokenizer-model {given}: tokenizer.json has an empty vocabulary; pass the directory "
                             "of a trained tokenizer.")
        self.vocab_size = max(vocab.values()) + 1
        eos = _configured_eos(folder, given)
        names = [eos] if eos is not None else [t for t in _EOD_CANDIDATES if t in vocab]
        if not names or names[0] not in vocab:
            raise ValueError(f"--tokenizer-model {given}: no end-of-document token (tokenizer_config.json's eos_token "
                             f"{eos!r} is not in the vocabulary); name one of its tokens there." if eos is not None else
                             f"--tokenizer-model {given}: no end-of-document token (no eos_token in "
                             f"tokenizer_config.json, none of {', '.join(_EOD_CANDIDATES)} in the vocabulary); "
                             "add an eos_token to tokenizer_config.json.")
        self.eod = vocab[names[0]]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=False)


class NotIds(ValueError):
    """Text that NullTokenizer cannot read (no ids); its callers name the file it is in."""


class NullTokenizer:
    """Megatron's NullTokenizer: no vocabulary, for data already in ids (--mock-data, preprocessed or .npy data).
    For --vocab-size N its ids are 0 .. N - 1 and end-of-document is N, one more, as Megatron adds it (so vocab_size is
    N + 1); a text is its ids in decimal between whitespace, as Megatron reads one ("3 14 15")."""

    name = "null"

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = self.eod + 1

    def encode(self, text: str) -> list[int]:
        words = text.split()
        # decimal digits only (Megatron's int() takes "+5" and "1_0" too); at most 19 of them, leading zeros aside
        is_id = (lambda w: w.isascii() and w.isdigit() and len(w.lstrip("0")) < 20 and int(w) <= self.eod)
        if bad := next((w for w in words if not is_id(w)), None):
            raise NotIds(f"NullTokenizer reads text as token ids (decimal digits) between spaces, each 0 to "
                         f"{self.eod}, and {bad[:40]!r} is none; pass text of ids (NullTokenizer has no words: data "
                         "of words needs a tokenizer of words, and so does a model that reads them).")
        return [int(w) for w in words]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _configured_eos(folder: Path, given: str) -> str | None:
    """tokenizer_config.json's eos_token (a string, or an AddedToken dict's content); None without the file or the
    key (or with null, as Hugging Face writes "none"). A file that is there but unreadable, or an eos_token of
    another kind, is refused (it was once passed over for a fallback token: another end-of-document id)."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return None
    where = f"--tokenizer-model {given}: {path.name}"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} is not readable JSON ({first_line(e)}); mend it, or remove it to use the "
                         "tokenizer's own end-of-document token.") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(config, dict) or not (eos is None or isinstance(eos, str)):
        raise ValueError(f"{where} must be a JSON object whose eos_token is a token's text (or {{\"content\": ...}}); "
                         f"got {json.dumps(eos if isinstance(config, dict) else config)[:60]}.")
    return eos


# The files each tokenizer type does not read (build_tokenizer refuses them; checkpoints saved before it did may name
# them, and were trained without them).
UNREAD_FILES = {"byte": ("--vocab-file", "--merge-file"), "HuggingFaceTokenizer": ("--vocab-file", "--merge-file"),
                "BertWordPieceLowerCase": ("--merge-file",), "NullTokenizer": ("--vocab-file", "--merge-file")}


def saved_tokenizer_args(data) -> tuple:
    """build_tokenizer's first arguments for a saved run's `data` config, less the files its tokenizer does not read
    (an older checkpoint may name them: build_tokenizer refuses them)."""
    unread = UNREAD_FILES.get(data.tokenizer_type, ())
    return (None if "--vocab-file" in unread else data.vocab_file,
            None if "--merge-file" in unread else data.merge_file, data.tokenizer_type, data.tokenizer_model)


def saved_tokenizer(data, vocab_size: int) -> Tokenizer | None:
    """The tokenizer a saved run's `data` config builds, where it builds one of `vocab_size` ids, the saved model's
    (NullTokenizer's count its end-of-document id: --vocab-size one less); None where its files moved or went, and
    for a converted checkpoint, whose data config holds the defaults (the byte tokenizer's 257 ids)."""
    try:
        tokenizer = build_tokenizer(*saved_tokenizer_args(data), vocab_size - 1)
    except (ValueError, OSError):
        return None
    return tokenizer if tokenizer.vocab_size == vocab_size else None


def tokenizer_flags(data, vocab_size: int) -> str | None:
    """The flags that build the tokenizer of a saved run's `data` config whose model has `vocab_size` ids, as a
    refusal names them; None where that config builds no such tokenizer (`saved_tokenizer`)."""
    if saved_tokenizer(data, vocab_size) is None:
        return None
    vocab_file, merge_file, kind, model = saved_tokenizer_args(data)
    kind = kind or ("GPT2BPETokenizer" if vocab_file else "byte")
    files = [f"{flag} {value}" for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file),
                                                   ("--tokenizer-model", model)) if value is not None]
    size = [f"--vocab-size {vocab_size - 1}"] if kind == "NullTokenizer" else []
    return " ".join([f"--tokenizer-type {kind}", *files, *size])


def build_tokenizer(vocab_file: str | None, merge_file: str | None, tokenizer_type: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer named by `tokenizer_type` (Megatron's --tokenizer-type names, see TOKENIZER_TYPES);
    HuggingFaceTokenizer reads `tokenizer_model` (a directory holding tokenizer.json, or that file), NullTokenizer
    takes `vocab_size` (--vocab-size: its ids before end-of-document; the others ignore it).

    Without a type: the byte tokenizer when neither file is given, GPT-2 BPE when both are; ValueError otherwise.
    """
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is unknown; use one of {', '.join(TOKENIZER_TYPES)}.")
    if tokenizer_type not in (None, "HuggingFaceTokenizer") and tokenizer_model is not None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} does not read --tokenizer-model; drop it, or pass "
                         "--tokenizer-type HuggingFaceTokenizer for a tokenizer.json.")
    if (tokenizer_type == "HuggingFaceTokenizer") != (tokenizer_model is not None):
        raise ValueError("--tokenizer-type HuggingFaceTokenizer and --tokenizer-model DIR (a directory holding "
                         "tokenizer.json, or the file) go together; pass both or neither.")
    # files the chosen tokenizer would not read are refused, not ignored (the run would train on another vocabulary)
    unused = UNREAD_FILES.get(tokenizer_type, ())
    given = [flag for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file))
             if value is not None and flag in unused]
    if given:
        raise ValueError(f"--tokenizer-type {tokenizer_type} does not read {' or '.join(given)}; drop "
                         f"{'it' if len(given) == 1 else 'them'}, or pick the tokenizer that reads "
                         f"{'it' if len(given) == 1 else 'them'} (GPT2BPETokenizer: --vocab-file and --merge-file).")
    if tokenizer_model is not None:
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (its ids 0 .. N - 1; "
                             "end-of-document is N).")
        return NullTokenizer(vocab_size)
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
                         f"{first_line(e)}); {_FIX}.") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 BPE encoder.json (expected a JSON object of "
                         f"token -> id); {_FIX}.")
    return encoder


