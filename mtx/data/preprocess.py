"""`python -m mtx.data.preprocess`: text -> Megatron indexed dataset (PREFIX_KEY_document.bin/.idx).

Megatron's tools/preprocess_data.py in spirit: JSONL inputs (`.jsonl`/`.json`) are one document a line, each
`--json-keys` field (default "text") written to its own dataset; any other file is one document of plain text, which
has no fields: its text goes under the default key, or beside JSONL inputs under their one `--json-keys` key;
`--tfds NAME[:split]` reads a TensorFlow Datasets split. `--append-eod` ends every document with the tokenizer's
end-of-document id, so samples that cross documents show the boundary. Empty documents are skipped.
`--split-sentences` (for BERT) writes each sentence as one sequence of its document, as Megatron does; a plain-text
file is then cut into documents at blank lines (mtx/data/sentences.py; no NLTK download).

  python -m mtx.data.preprocess --input corpus.jsonl --output-prefix data/corpus \
      --vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe --append-eod --workers 8
  # -> data/corpus_text_document.bin, data/corpus_text_document.idx; train with --data-path data/corpus_text_document
  python -m mtx.data.preprocess --input wiki.txt --output-prefix data/wiki --vocab-file bert/vocab.txt \
      --tokenizer-type BertWordPieceLowerCase --split-sentences   # -> data/wiki_text_sentence.bin/.idx (BERT)
  python -m mtx.data.preprocess --input corpus.jsonl --output-prefix data/corpus \
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model my_tokenizer/ --append-eod   # any tokenizer.json
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

from tqdm import tqdm

from mtx.cli import OneLineParser, ranged
from mtx.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from mtx.data.sentences import split_documents, split_sentences
from mtx.data.tokenizer import TOKENIZER_TYPES, NotIds, build_tokenizer
from mtx.files import check_new_files, not_a_file, read_text, refuse_empty, refuse_repeats
from mtx.schema_checks import flag_name

_tokenizer = None  # one per worker process, built by _init


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Runs the command line; returns the written prefixes (what --data-path takes). Bad input exits with status 2
    and one line on stderr, having written nothing."""
    try:
        return _preprocess(_parser().parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _preprocess(args) -> list[str]:
    keys_given, args.json_keys = args.json_keys is not None, args.json_keys or ["text"]
    _refuse_empty_paths(args)
    if bool(args.input) == bool(args.tfds):
        raise ValueError("pass --input FILE(S) or --tfds NAME[:split], exactly one of them.")
    if args.tfds_data_dir and not args.tfds:  # files would be read, the directory never looked at
        raise ValueError("--tfds-data-dir is where --tfds reads its datasets; with --input drop it.")
    refuse_repeats(args.input or (), "--input", "file")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys {' '.join(args.json_keys)} names a key twice; name each key once.")
    level = "sentence" if args.split_sentences else "document"  # Megatron's suffix
    for key in args.json_keys:  # a key is part of the file names: "a/b" would write PREFIX_a/b_document.bin
        if not key.strip() or key in (".", "..") or any(c in key for c in "/\\\0"):
            raise ValueError(f"--json-keys {key!r}: each key is part of its output files' names (PREFIX_KEY_{level}"
                             ".bin), so it must be a plain file-name part, not empty, '.' or '..' and without '/' "
                             "or '\\'; pass the fields' names, such as text.")
    _check_prefix(args.output_prefix)
    if keys_given and args.input and args.json_keys != ["text"]:  # (the default, as Megatron's scripts pass it)
        _refuse_keys_for_plain_text(args.input, args.json_keys, f"{args.output_prefix}_text_{level}")
    prefixes = [f"{args.output_prefix}_{key}_{level}" for key in args.json_keys]
    outputs = [p + suffix for p in prefixes for suffix in (".bin", ".idx")]
    inputs = {Path(name).resolve() for name in args.input or ()}
    if clash := [o for o in outputs if Path(o).resolve() in inputs]:  # --overwrite would replace the input it reads
        raise ValueError(f"--input {clash[0]} is one of the files --output-prefix {args.output_prefix} writes; "
                         "choose another --output-prefix.")
    check_new_files(outputs, "--output-prefix", overwrite=args.overwrite)
    if (args.vocab_size is not None) != (args.tokenizer_type == "NullTokenizer"):
        raise ValueError("--vocab-size is NullTokenizer's and NullTokenizer needs it; pass both or neither.")
    tokenizer_args = (args.vocab_file, args.merge_file, args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    tokenizer = build_tokenizer(*tokenizer_args)
    documents = _documents(args)
    first = next(documents, None)  # opens the source now, so its errors come before any file is written
    source = f"--input {' '.join(args.input)}" if args.input else f"--tfds {args.tfds}"
    if first is None:
        raise ValueError(f"{source} holds no documents; pass a non-empty input.")
    writers = [IndexedDatasetWriter(p, dtype_for_vocab(tokenizer.vocab_size)) for p in prefixes]
    stream = _chain(first, documents)
    items = ((doc, args.json_keys, args.append_eod, args.split_sentences) for doc in stream)
    count, tokens = 0, 0
    # spawn, not fork: importing mtx starts JAX's threads, and a forked copy of a threaded process can deadlock.
    pool = multiprocessing.get_context("spawn").Pool(args.workers, _init, (tokenizer_args,)) \
        if args.workers > 1 else _Serial(tokenizer_args)
    try:
        with pool:
            # a transient bar, on a terminal only: an error (or the summary) is then the only line left
            for encoded in tqdm(pool.imap(_encode, items, chunksize=16), desc="tokenizing", unit="doc",
                                disable=None, leave=False):
                for writer, sentences in zip(writers, encoded):
                    if sentences:  # a document of one or more sequences
                        for ids in sentences:
                            writer.add_item(ids)
                            tokens += len(ids)
                        writer.end_document()
                count += 1
        if not tokens:
            under = f" under --json-keys {' '.join(args.json_keys)}" if keys_given else ""
            raise ValueError(f"{source} holds no text{under}; pass an input with text.")
    except BaseException as e:  # a bad input line, an interrupt: no half-written dataset, older outputs untouched
        for writer in writers:
            writer.abort()
        if isinstance(e, NotIds):  # a text that is not ids: where
            raise ValueError(f"{source}, document {count + 1}: {e}") from None
        raise
    for writer in writers:
        writer.close()
    print(f"wrote {count} documents, {tokens} tokens: {', '.join(p + '.bin/.idx' for p in prefixes)}")
    return prefixes


# Path flags, and what to pass in each: an empty value would be read as the working directory (".") or dropped
_PATH_FLAGS = {"input": "JSONL or plain-text files", "tfds": "a TensorFlow Datasets split NAME[:split]",
               "vocab_file": "GPT-2's encoder.json or BERT's vocab.txt", "merge_file": "GPT-2's vocab.bpe",
               "tokenizer_model": "a directory holding tokenizer.json, or that file",
               "tfds_data_dir": "a TFDS data directory, or drop the flag for TFDS's own"}


def _refuse_empty_paths(args) -> None:
    """Refuses an empty (or blank) value of a path flag: --input "" was once "--input .: is a directory"."""
    for dest, fix in _PATH_FLAGS.items():
        refuse_empty(getattr(args, dest), flag_name(dest), fix)


def _refuse_keys_for_plain_text(inputs, keys, default_dataset: str) -> None:
    """--json-keys given with plain-text input: such a file has no fields, so its whole text would be written under
    each key (one dataset per key, the same text in each). Refused, except for one key beside JSONL inputs: the
    plain text then joins that key's dataset."""
    plain = [name for name in inputs if not _is_json_lines(name) and Path(name).is_file()]  # (no file: refused later)
    beside_jsonl = any(map(_is_json_lines, inputs))
    if not plain or len(keys) == 1 and beside_jsonl:
        return
    fix = ("pass one key (the plain text then joins its dataset)" if beside_jsonl else
           f"drop --json-keys (the dataset is then {default_dataset})")
    copies = ": its whole text would be written under each key" if len(keys) > 1 else ""
    raise ValueError(f"--json-keys {' '.join(keys)} names fields of JSON-lines input (.jsonl or .json), but --input "
                     f"{plain[0]} is plain text, with no fields{copies}; {fix}, or name the file .jsonl if it holds "
                     "JSON lines.")


def _is_json_lines(name) -> bool:
    """Whether an --input file is read as JSON lines (by its suffix), not as one document of plain text."""
    return Path(name).suffix in (".jsonl", ".json")


def _check_prefix(prefix: str) -> None:
    """Refuses an --output-prefix that does not end in a file-name part: "" (files in the working directory) or
    "data/", "data/." (files named "_text_document.bin" in it). An existing directory "data" is fine: the files go
    beside it, data_text_document.bin."""
    refuse_empty(prefix, "--output-prefix", "a path prefix such as data/my-corpus")
    if os.path.basename(prefix) in ("", ".", ".."):
        raise ValueError(f"--output-prefix {prefix} ends in {os.path.basename(prefix) or os.sep!r}; the prefix must "
                         f"end in a file-name part, e.g. {os.path.join(prefix, 'corpus')}.")


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m mtx.data.preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", help="JSONL files (one document a line) or plain-text files (one each)")
    p.add_argument("--tfds", help="a TensorFlow Datasets split NAME[:split] instead of --input")
    p.add_argument("--json-keys", nargs="+",
                   help="JSONL (or --tfds) fields to tokenize, one dataset each (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--vocab-file", help="GPT-2 encoder.json, or BERT vocab.txt")
    p.add_argument("--merge-file", help="GPT-2 vocab.bpe")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: from the files given")
    p.add_argument("--tokenizer-model",
                   help="HuggingFaceTokenizer: a local directory holding tokenizer.json, or that file")
    p.add_argument("--vocab-size", type=ranged(int, "[1, 2147483646]"),
                   help="NullTokenizer: its ids 0 .. N - 1 (end-of-document is N); input text is ids between spaces")
    p.add_argument("--append-eod", action="store_true", help="end each document with the end-of-document id")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (BERT); plain-text files split into documents at blank lines")
    p.add_argument("--workers", type=ranged(int, "[1, 256]"), default=1, help="tokenizing processes")
    p.add_argument("--tfds-data-dir", help="TFDS data_dir (default: TFDS's own)")
    p.add_argument("--overwrite", action="store_true", help="replace output files that exist already")
    return p


def _documents(args) -> Iterator[dict[str, str]]:
    if args.tfds:
        from mtx.data.tfds import tfds_documents

        yield from tfds_documents(args.tfds, args.json_keys, args.tfds_data_dir)
        return
    for name in args.input:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--input {path}: {not_a_file(path)}; pass JSONL or plain-text files.")
        try:
            if not _is_json_lines(path):
                text = read_text(path, "--input", "pass plain UTF-8 text or JSONL files.")
                for doc in split_documents(text) if args.split_sentences else [text]:
                    yield {key: doc for key in args.json_keys}
                continue
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield _record(line, path, number, args.json_keys)
        except UnicodeDecodeError as e:
            raise ValueError(f"--input {path} is not UTF-8 text (byte {e.start}: {e.reason}); pass text or JSONL "
                             "files.") from None


def _record(line: str, path: Path, number: int, keys) -> dict[str, str]:
    """One JSONL line -> its --json-keys fields, each a string of valid Unicode."""
    try:
        record = json.loads(line)
        fields = {key: record[key] for key in keys}
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--input {path} line {number} is not a JSON object with the --json-keys {' '.join(keys)}; "
                         "fix the line or pass the right --json-keys.") from None
    for key, value in fields.items():
        if not isinstance(value, str):
            raise ValueError(f"--input {path} line {number}: {key!r} is {type(value).__name__} {str(value)[:40]!r}, "
                             "not a string; fix the line.")
        try:  # JSON's escapes can spell half of a UTF-16 pair ("\ud800"), which no tokenizer can encode
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"--input {path} line {number}: {key!r} holds an unpaired surrogate "
                             f"(\\u{ord(value[e.start]):04x} at character {e.start}), which is not valid Unicode; "
                             "repair or drop that line.") from None
    return fields


def _chain(first, rest):
    yield first
    yield from rest


def _init(tokenizer_args) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(*tokenizer_args)


def _encode(item) -> list[list[list[int]]]:
    """One document -> for each key, its sequences: the whole text, or (--split-sentences) each sentence; empty
    sequences are dropped, and --append-eod ends the last one with the end-of-document id."""
    doc, keys, append_eod, sentences = item
    out = []
    for key in keys:
        texts = split_sentences(doc[key]) if sentences else [doc[key]]
        seqs = [ids for ids in map(_tokenizer.encode, texts) if ids]
        if seqs and append_eod:
            seqs[-1] = seqs[-1] + [_tokenizer.eod]
        out.append(seqs)
    return out


class _Serial:
    """The Pool interface in this process, for --workers 1 (no fork, easy to debug)."""

    def __init__(self, tokenizer_args):
        _init(tokenizer_args)

    def imap(self, fn, items, chunksize=1):
        return map(fn, items)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
