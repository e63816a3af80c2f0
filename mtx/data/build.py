"""`build_dataset(cfg)`: the --data-path entries (text, .npy, Megatron .bin/.idx prefixes, weighted blends) as one
dataset with the `GPTDataset` batch API; or, as Megatron's --train-data-path, --valid-data-path and
--test-data-path, each split from entries of its own (`SplitDatasets`), each in --data-path's forms.

--data-path forms, as Megatron's:
  a.txt b.npy            one corpus: the files joined with end-of-document tokens, split by tokens
  PREFIX                 an indexed dataset (PREFIX.bin + PREFIX.idx), split between documents
  0.7 PREFIX_A 0.3 b.txt a blend: weight then path, weights normalized; each entry one dataset
Unweighted lists that hold indexed prefixes blend every prefix (and the text/.npy files as one corpus) in
proportion to their tokens, which reads them like one concatenated corpus.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mtx.data.bert_dataset import build_bert_dataset
from mtx.data.blend import BlendedDataset, parse_weights
from mtx.data.dataset import GPTDataset, _parse_split, builtin_corpus, check_token_ids
from mtx.data.documents import FIELDS as DOCUMENT_FLAGS, DocumentBatches
from mtx.data.indexed import IndexedDataset
from mtx.data.paths import indexed_prefix, parse_data_path
from mtx.data.tokenizer import ByteTokenizer, NotIds, Tokenizer, build_tokenizer
from mtx.files import not_a_file, read_text, refuse_repeats
from mtx.schema_checks import SPLIT_PATHS, flag_name

_ALONE = {"train": "1,0,0", "valid": "0,1,0", "test": "0,0,1"}  # a split's own data: all of it that split's
_BUILTIN = ", or omit --data-path to train on the built-in corpus"  # (no fix for a split's own flag)
_NO_VALIDATION = "--eval-interval 0: no validation"  # (which would leave --valid-data-path idle: refused)


def build_dataset(cfg) -> GPTDataset | BlendedDataset | DocumentBatches | SplitDatasets:
    """The dataset of a `mtx.config.Config`: its --data-path entries (or the built-in corpus), or each split's own
    entries, and tokenizer; with --eod-mask-loss, --reset-position-ids or --reset-attention-mask its batches carry
    the document fields."""
    if own := {split: getattr(cfg.data, name) for split, name in SPLIT_PATHS.items() if getattr(cfg.data, name)}:
        if "train" not in own:  # (Config.validate says so first; an API caller may not have called it)
            raise ValueError(f"{flag_name(SPLIT_PATHS[next(iter(own))])} without --train-data-path: pass the "
                             "training data with --train-data-path too.")
        return SplitDatasets({split: _alone(cfg, split, paths) for split, paths in own.items()})
    if _parse_split(cfg.data.split)[0] == 0:
        raise ValueError(f"--split {cfg.data.split} gives training no share; give train a weight, e.g. --split "
                         "949,50,1.")
    return _dataset(cfg)


class SplitDatasets:
    """Each split read from a dataset of its own (`GPTDataset`'s batch API); a split given no data has no samples."""

    def __init__(self, datasets: dict):
        self.datasets = datasets
        self.tokenizer = datasets["train"].tokenizer  # (the same flags built every split's)

    def num_samples(self, split: str) -> int:
        return self.datasets[split].num_samples(split) if split in self.datasets else 0

    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)):
        if split not in self.datasets:
            raise ValueError(f"no {split} data was given; pass {flag_name(SPLIT_PATHS[split])}.")
        return self.datasets[split].batch(split, index, batch_size, rows)


def _alone(cfg, split: str, paths: tuple[str, ...]):
    """The dataset of one split's own entries: all of them that split's (the builders' messages name its flag)."""
    flag = flag_name(SPLIT_PATHS[split])
    try:
        dataset = _dataset(cfg.replace(data_path=paths, split=_ALONE[split]))
        if not dataset.num_samples(split):  # (train and, when evaluated, valid: refused by the dataset itself)
            fix = "more data, or a shorter --seq-length" if not cfg.model.is_bert else "more documents of sentences"
            raise ValueError(f"the {split} split of --data-path {' '.join(paths)} holds no sample of --seq-length "
                             f"{cfg.model.seq_length}; pass {fix}.")
    except ValueError as e:  # the fixes that name --data-path's ways out, in this flag's
        message = str(e).replace(_BUILTIN, "").replace(_NO_VALIDATION, f"leave {flag} out: no validation")
        raise ValueError(message.replace("--data-path", flag)) from None
    return dataset


def _dataset(cfg):
    """The dataset of --data-path (split by --split), or of the built-in corpus."""
    if cfg.model.is_bert:  # sentence-pair samples (mtx/data/bert_dataset.py)
        return build_bert_dataset(cfg)
    dataset = _gpt_dataset(cfg)
    return DocumentBatches(dataset, cfg.data) if any(getattr(cfg.data, f) for f in DOCUMENT_FLAGS) else dataset


def say_what_data_overrides(cfg, dataset) -> None:
    """One line each (main process, stderr) where the data decides what a setting asked for: the vocabulary is the
    tokenizer's whatever --vocab-size or the preset says (the schema's default is said by no one; NullTokenizer's
    is --vocab-size, said when it is that default), and with no validation share of --split, --eval-interval has
    nothing to evaluate; a blend's dataset of weight 0 is never read; an indexed dataset whose documents all end in
    another end-of-document id was made by another tokenizer."""
    from mtx.config import ModelConfig
    from mtx.distributed import is_main_process

    if not is_main_process():
        return
    vocab, default = cfg.model.vocab_size, ModelConfig().vocab_size
    if cfg.data.tokenizer_type == "NullTokenizer":  # --vocab-size is its vocabulary (and one id more)
        if vocab == default:
            print(f"mtx: NullTokenizer with vocab_size {vocab}, the schema's default: pass --vocab-size N for N ids "
                  "(and end-of-document, id N).", file=sys.stderr)
    elif vocab != dataset.tokenizer.vocab_size and vocab != default:
        print(f"mtx: vocab_size {vocab} (--vocab-size or the preset) is replaced by the tokenizer's "
              f"{dataset.tokenizer.vocab_size}: the tokenizer sets it.", file=sys.stderr)
    indexed = {}  # each indexed dataset, with the flag that first gives it (GPT's: BERT's samples are sentences)
    for name in ("data_path", *SPLIT_PATHS.values()):
        weights, paths = parse_data_path(getattr(cfg.data, name)) if getattr(cfg.data, name) else (None, [])
        if never := [path for weight, path in zip(weights or (), paths) if weight == 0]:
            print(f"mtx: {flag_name(name)} {', '.join(never)}: weight 0, never sampled.", file=sys.stderr)
        for prefix in filter(None, map(indexed_prefix, paths if not cfg.model.is_bert else ())):
            indexed.setdefault(prefix, flag_name(name))
    read = {split: set(parse_data_path(getattr(cfg.data, name))[1] if getattr(cfg.data, name) else ())
            for split, name in SPLIT_PATHS.items()}
    for split in ("valid", "test"):  # (Megatron allows it: said, not refused)
        if both := sorted(read["train"] & read[split]):
            print(f"mtx: {', '.join(both)} is training data and {flag_name(SPLIT_PATHS[split])} data: the {split} "
                  "loss is then measured on samples trained on.", file=sys.stderr)
    for prefix, flag in indexed.items():
        _say_if_other_eod(f"{flag} {prefix}", prefix, dataset.tokenizer)
    t = cfg.training
    if t.eval_interval and not dataset.num_samples("valid"):
        gives, fix = ((f"--split {cfg.data.split} gives validation no share", "give valid a --split share (e.g. "
                       "949,50,1)") if not cfg.data.train_data_path else ("no --valid-data-path was given",
                                                                          "pass --valid-data-path"))
        if dataset.num_samples("test"):  # (--eval-interval 0 would drop the test evaluation too)
            print(f"mtx: {gives}, so --eval-interval {t.eval_interval} validates nothing (the test split is "
                  f"evaluated once training ends); {fix} to validate.", file=sys.stderr)
        else:
            print(f"mtx: {gives}, so --eval-interval {t.eval_interval} evaluates nothing; pass --eval-interval 0, "
                  f"or {fix}.", file=sys.stderr)


def _say_if_other_eod(given: str, prefix: str, tokenizer: Tokenizer) -> None:
    """A line when every document of an indexed dataset (of 4,096 spread over it) ends in one id that is not the
    tokenizer's end-of-document: --append-eod by another tokenizer (NullTokenizer's end-of-document is its
    --vocab-size), so this run would read that id as a token and not see where documents end (--eod-mask-loss,
    --reset-position-ids). Said, not refused: documents that all end in, say, a full stop look the same."""
    ds = IndexedDataset(prefix)
    offsets = ds.document_token_offsets()
    ends = offsets[1:][offsets[1:] > offsets[:-1]] - 1  # each non-empty document's last token
    last = np.asarray(ds.tokens[ends[::max(1, len(ends) // 4096)]])  # (4,096 of them at most: no second full read)
    if len(last) > 1 and (last == last[0]).all() and last[0] != tokenizer.eod:
        print(f"mtx: every document of {given} ends in id {last[0]}, and this tokenizer's end-of-document "
              f"is {tokenizer.eod}: if it was preprocessed with --append-eod by another tokenizer, pass that one "
              f"(NullTokenizer: --vocab-size {last[0]}).", file=sys.stderr)


def _gpt_dataset(cfg) -> GPTDataset | BlendedDataset:
    data = cfg.data
    common = dict(seq_length=cfg.model.seq_length, split=data.split, seed=cfg.training.seed,
                  evaluated=bool(cfg.training.eval_interval))
    if data.mock_data:
        tokenizer = build_tokenizer(data.vocab_file, data.merge_file, data.tokenizer_type, data.tokenizer_model,
                                    cfg.model.vocab_size)
        tokens, offsets = mock_documents(tokenizer, cfg.model.seq_length, cfg.training.seed)
        return GPTDataset(tokens, tokenizer=tokenizer, doc_offsets=offsets, source="--mock-data", **common)
    if not data.data_path:  # the built-in corpus is read byte by byte: tokenizer settings would be ignored
        given = [flag for flag, value in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file),
                                          ("--tokenizer-model", data.tokenizer_model)) if value is not None]
        given += ["--tokenizer-type"] if data.tokenizer_type not in (None, "byte") else []
        if given:
            data_flags = "--mock-data or --data-path with ids" if data.tokenizer_type == "NullTokenizer" else \
                "--data-path with your data"
            raise ValueError(f"{', '.join(given)} without --data-path: the built-in corpus is read byte by byte; pass "
                             f"{data_flags}, or leave the tokenizer flags out.")
        return GPTDataset(_tokenize(ByteTokenizer(), builtin_corpus()), tokenizer=ByteTokenizer(),
                          source="the built-in corpus", **common)
    tokenizer = build_tokenizer(data.vocab_file, data.merge_file, data.tokenizer_type, data.tokenizer_model,
                                cfg.model.vocab_size)
    weights, paths = parse_data_path(data.data_path)
    if weights is not None:
        parse_weights(weights)  # refused before any file is read
    refuse_repeats([indexed_prefix(p) or p for p in paths], "--data-path", "dataset")  # else blended with itself
    prefixes = [p for p in paths if indexed_prefix(p)]
    files = [p for p in paths if not indexed_prefix(p)]  # without weights: read as one dataset
    # the members of a blend may lack a validation share (`BlendedDataset` checks that one has it)
    common["in_blend"] = (len(paths) if weights is not None else len(prefixes) + bool(files)) > 1
    if weights is None:
        if not prefixes:
            return _files_dataset(files, tokenizer, stream=0, **common)
        datasets = [_indexed_dataset(indexed_prefix(p), tokenizer, stream=i + 1, **common)
                    for i, p in enumerate(prefixes)]
        if files:
            datasets.append(_files_dataset(files, tokenizer, stream=len(datasets) + 1, **common))
        weights = [len(ds.tokens) for ds in datasets]
    else:
        datasets = [_indexed_dataset(indexed_prefix(p), tokenizer, stream=i + 1, **common) if indexed_prefix(p)
                    else _files_dataset([p], tokenizer, stream=i + 1, **common) for i, p in enumerate(paths)]
    return datasets[0] if len(datasets) == 1 else BlendedDataset(datasets, weights)


def mock_documents(tokenizer: Tokenizer, seq_length: int, seed: int, documents: int = 4096):
    """Megatron's mock GPT data: document i is 1, 2, ..., n_i - 1 then end-of-document, n_i drawn from
    [1, seq_length) with the seed (ids past the vocabulary wrap to 1; the end-of-document id only ends a document)
    -> (tokens, (documents + 1,) offsets). 4,096 documents, read in epochs like any corpus."""
    if tokenizer.vocab_size < 3:
        raise ValueError(f"--mock-data counts 1, 2, ... in ids other than end-of-document, and this vocabulary has "
                         f"{tokenizer.vocab_size - 2} (of {tokenizer.vocab_size}); pass a larger --vocab-size.")
    lengths = np.random.default_rng(seed).integers(1, max(seq_length, 3), documents)  # (a token or two at S < 3)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)  # within its document
    tokens = 1 + position % (tokenizer.vocab_size - 2)  # 1 .. V - 2, then past end-of-document's id by one
    tokens += tokens >= tokenizer.eod
    tokens[offsets[1:] - 1] = tokenizer.eod
    return tokens.astype(np.int32), offsets


def _indexed_dataset(prefix: str, tokenizer: Tokenizer, **kw) -> GPTDataset:
    ds = IndexedDataset(prefix)  # the vocabulary check is GPTDataset's (one pass, skipped when the dtype fits)
    return GPTDataset(ds.tokens, tokenizer=tokenizer, doc_offsets=ds.document_token_offsets(),
                      source=f"--data-path {prefix}.bin", **kw)


def _files_dataset(paths: list[str], tokenizer: Tokenizer, **kw) -> GPTDataset:
    """Text and .npy files joined with the end-of-document token, so no sample runs across a file boundary
    without the model seeing where one document ended."""
    parts = []
    for i, path in enumerate(paths):
        if i:
            parts.append(np.array([tokenizer.eod], np.int32))
        parts.append(_load(Path(path), tokenizer))
    return GPTDataset(np.concatenate(parts), tokenizer=tokenizer, source=f"--data-path {' '.join(paths)}", **kw)


def _load(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    if not path.is_file():
        what = not_a_file(path) + (" or indexed dataset (PATH.bin + PATH.idx)" if not path.exists() else "")
        raise ValueError(f"--data-path {path}: {what}; pass text, .npy or indexed-dataset prefixes{_BUILTIN}.")
    if path.suffix in (".bin", ".idx") and not indexed_prefix(str(path.with_suffix(""))):
        missing = path.with_suffix(".idx" if path.suffix == ".bin" else ".bin")
        raise ValueError(f"--data-path {path} is half of an indexed dataset and {missing} does not exist; pass the "
                         f"prefix {path.with_suffix('')} with both files, or re-run `python -m mtx.data.preprocess`.")
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:  # empty, truncated, pickled objects, not a .npy at all
            reason = "it holds pickled objects or is not a .npy file" if "pickle" in str(e) else str(e).rstrip(".")
            raise ValueError(f"--data-path {path} is not a readable .npy array of token ids ({reason}); save a 1-D "
                             "integer array with numpy.save, or pass text or an indexed-dataset prefix.") from None
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"--data-path {path} holds a {ids.dtype} array of shape {ids.shape}; a .npy data "
                             "file must be a 1-D integer array of token ids.")
        check_token_ids(ids, tokenizer.vocab_size, f"--data-path {path}")
        return ids.astype(np.int32)
    text = read_text(path, "--data-path", "pass plain UTF-8 text, a .npy array of token ids, or an indexed-dataset "
                     "prefix (PATH for PATH.bin + PATH.idx).")
    try:
        return _tokenize(tokenizer, text)
    except NotIds as e:  # the file it is in
        raise ValueError(f"--data-path {path}: {e}") from None


def _tokenize(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # a view of the bytes; skips a Python int per byte
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    return np.asarray(tokenizer.encode(text), np.int32)
