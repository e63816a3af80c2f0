"""BERT samples (Megatron's BertDataset): sentence pairs [CLS] A [SEP] B [SEP], sentence order, whole-word masking.

Source: documents of sentences, held as one token array cut into sentences (`sentence_offsets`) grouped into
documents (`doc_idx`, in sentences), which is exactly a Megatron indexed dataset written with `--split-sentences`.

Samples (Megatron's build_mapping): each document is walked sentence by sentence, and a sample closes once it holds
`target` tokens (seq_length - 3, or with probability `short_seq_prob` a random length in [2, seq_length - 3]) and
at least two sentences stay for the next one (one with --bert-no-binary-head). The mapping is one pass over a
split's documents; training reads it in an endless sequence of epochs, each a fresh permutation, as GPTDataset.

Sample k of a split is built by a generator seeded with (seed, split, k): a pure function of the seed and the
position, never of the number of devices (docs/design.md, decision 2), and each epoch masks its samples afresh:
  - A = the first a_end sentences, B = the rest (a_end uniform in [1, n - 1]); with probability 1/2 A and B are
    swapped and is_random = 1 (sentence-order prediction, paper section 4.2 following ALBERT);
  - Megatron's truncate_seq_pair: while too long, drop a token from the longer segment, at its front or back;
  - whole-word n-gram masking (Megatron's create_masked_lm_predictions with max_ngrams = 3): candidates are whole
    words (a `##` piece belongs to the word before it; [CLS] and [SEP] never); round(mask_prob x tokens) positions
    are chosen as n-grams of 1-3 words with probability proportional to 1/n; each chosen token becomes [MASK] (80%),
    a random id (10%) or stays (10%);
  - padding to seq_length with [PAD], padding_mask 0 there.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from mtx.data.dataset import SPLITS, _parse_split, _split_bounds, builtin_corpus, check_token_ids
from mtx.data.paths import indexed_prefix, parse_data_path, shared_data_dir
from mtx.data.sentences import split_documents, split_sentences
from mtx.files import read_text

MAX_NGRAMS = 3


def _ngram_cdfs() -> dict[int, list[float]]:
    """For k n-gram lengths that fit: the cumulative distribution `rng.choice(1..k, p)` draws against, p ~ 1 / n
    (computed as numpy's choice computes it, so one `rng.random()` picks exactly what choice would)."""
    pvals = 1.0 / np.arange(1, MAX_NGRAMS + 1)
    pvals /= pvals.sum()
    cdfs = {}
    for k in range(1, MAX_NGRAMS + 1):
        cdf = (pvals[:k] / pvals[:k].sum()).cumsum()
        cdfs[k] = (cdf / cdf[-1]).tolist()
    return cdfs


_NGRAM_CDF = _ngram_cdfs()


class BertDataset:
    """Documents of sentences -> batches of Megatron's BERT fields: text, types, labels, is_random, loss_mask,
    padding_mask ((G, S) int32 each, is_random (G,)); labels are -1 where nothing is predicted."""

    def __init__(self, tokens: np.ndarray, sentence_offsets: np.ndarray, doc_idx: np.ndarray, *, seq_length: int,
                 tokenizer, seed: int, split: str = "949,50,1", mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: bool = True, source: str = "the BERT corpus",
                 evaluated: bool = True):
        check_token_ids(tokens, tokenizer.vocab_size, source)
        self.tokens, self.offsets = tokens, np.asarray(sentence_offsets, np.int64)
        self.doc_idx = np.asarray(doc_idx, np.int64)
        self.seq_length, self.seed, self.tokenizer = seq_length, seed, tokenizer
        self.mask_prob, self.short_seq_prob, self.binary_head = mask_prob, short_seq_prob, binary_head
        self.source = source
        # A word-piece that starts with "##" continues the word before it.
        self.continuation = np.array([t.startswith("##") for t in tokenizer.inv_vocab], np.bool_)
        self._continues = self.continuation.tolist()  # per token, as mask() reads it (a list: no numpy scalar)
        bounds = _split_bounds(_parse_split(split), len(self.doc_idx) - 1)
        self._weights = dict(zip(SPLITS, _parse_split(split)))
        self._maps = {name: self._mapping(bounds[i], bounds[i + 1], i) for i, name in enumerate(SPLITS)}
        self._perm, self._perm_epoch = np.empty(0, np.int64), -1
        for name in ("train", "valid"):
            if self.num_samples(name) == 0 and self._weights[name] > 0 and (name == "train" or evaluated):
                sentences = np.diff(self.doc_idx)
                found = (f"; {int((sentences >= 2).sum())} of its {len(sentences)} documents have 2+ (a sentence "
                         "ends at . ! or ? before a capital, a digit or a quote)" if binary_head else "")
                raise ValueError(f"the {name} split of {source} holds no BERT sample (documents of "
                                 f"{2 if binary_head else 1}+ sentences{found}); use more data (--data-path)" +
                                 (" or a larger --split share for it" if self._weights[name] < 1 else "") +
                                 (" (or --eval-interval 0: no validation)." if name == "valid" else "."))

    # ---- the sample mapping ----
    def _mapping(self, first_doc: int, last_doc: int, split_index: int) -> np.ndarray:
        """(samples, 3) int64 rows (first sentence, end sentence, target tokens) of the documents of one split."""
        rng = np.random.default_rng((self.seed, split_index, 0))
        sizes = np.diff(self.offsets)
        max_tokens = self.seq_length - 3  # room for [CLS], [SEP], [SEP]
        min_sentences = 2 if self.binary_head else 1

        def target() -> int:
            if rng.random() < self.short_seq_prob:
                return int(rng.integers(2, max_tokens + 1))
            return max_tokens

        rows = []
        for d in range(first_doc, last_doc):
            first, last = int(self.doc_idx[d]), int(self.doc_idx[d + 1])
            if last - first < min_sentences:
                continue
            start, tokens, count, goal = first, 0, 0, target()
            for s in range(first, last):
                tokens, count = tokens + int(sizes[s]), count + 1
                remaining = last - s - 1
                if (tokens >= goal and remaining >= min_sentences and count >= min_sentences) or remaining == 0:
                    rows.append((start, s + 1, goal))
                    start, tokens, count, goal = s + 1, 0, 0, target()
        return np.asarray(rows, np.int64).reshape(-1, 3)

    def num_samples(self, split: str) -> int:
        return len(self._map(split))

    def _map(self, split: str) -> np.ndarray:
        if split not in self._maps:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}.")
        return self._maps[split]

    # ---- batches ----
    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Samples index*batch_size ... (index+1)*batch_size - 1 of the split's endless sequence, stacked; rows: only
        those rows of the batch (a process builds the rows its devices hold: a sample is Python work)."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"batch index must be >= 0 and batch size >= 1, got {index} and {batch_size}.")
        samples = [self.sample(split, index * batch_size + i) for i in range(batch_size)[rows]]
        return {key: np.stack([s[key] for s in samples]) for key in samples[0]}

    def sample(self, split: str, position: int) -> dict[str, np.ndarray]:
        """The sample at this place of the split's endless sequence (a pure function of seed, split, position)."""
        mapping = self._map(split)
        if not len(mapping):
            raise ValueError(f"the {split} split of {self.source} holds no BERT sample; give it a --split share.")
        epoch, within = divmod(position, len(mapping))
        row = self._permutation(epoch)[within] if split == "train" else within
        first, end, target = (int(v) for v in mapping[row])
        sentences = [np.asarray(self.tokens[self.offsets[s]:self.offsets[s + 1]], np.int64).tolist()
                     for s in range(first, end)]
        rng = np.random.default_rng((self.seed, SPLITS.index(split), position, 1))
        return self.build_sample(sentences, target, rng)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng((self.seed, epoch, SPLITS.index("train"), 2))
            self._perm, self._perm_epoch = rng.permutation(self.num_samples("train")), epoch
        return self._perm

    def build_sample(self, sentences: list[list[int]], target: int, rng) -> dict[str, np.ndarray]:
        """Sentences of one sample -> the padded fields (Megatron's build_training_sample)."""
        tok = self.tokenizer
        if self.binary_head:
            a, b, is_random = _a_and_b_segments(sentences, rng)
        else:
            a, b, is_random = [t for s in sentences for t in s], [], False
        truncate_seq_pair(a, b, target, rng)
        tokens = [tok.cls, *a, tok.sep] + ([*b, tok.sep] if b else [])
        types = [0] * (len(a) + 2) + [1] * (len(b) + 1 if b else 0)
        masked, positions, labels, _ = self.mask(tokens, rng, max_predictions=self.mask_prob * target)
        n, s = len(tokens), self.seq_length
        out = {"text": np.full(s, tok.pad, np.int32), "types": np.zeros(s, np.int32),
               "labels": np.full(s, -1, np.int32), "is_random": np.int32(is_random),
               "loss_mask": np.zeros(s, np.int32), "padding_mask": np.zeros(s, np.int32)}
        out["text"][:n], out["types"][:n], out["padding_mask"][:n] = masked, types, 1
        out["labels"][positions], out["loss_mask"][positions] = labels, 1
        return out

    def mask(self, tokens: list[int], rng, max_predictions: float | None = None):
        """Whole-word n-gram masking -> (masked tokens, positions, original ids, n-gram lengths in words).

        Megatron's create_masked_lm_predictions (masking_style "bert", max_ngrams 3, whole words, no geometric
        distribution, no permutation), step by step.
        """
        tok = self.tokenizer
        special, continues = (tok.cls, tok.sep, tok.pad), self._continues
        words: list[list[int]] = []  # candidate whole words, as lists of positions
        for i, t in enumerate(tokens):
            if t in special:
                continue
            if words and continues[t] and words[-1][-1] == i - 1:
                words[-1].append(i)
            else:
                words.append([i])
        output = list(tokens)
        num_to_predict = max(1, int(round(len(tokens) * self.mask_prob)))
        if max_predictions is not None:
            num_to_predict = min(int(max_predictions), num_to_predict)
        # Every word start with its 1-, 2- and 3-word n-grams, visited in random order (shuffling the starts draws
        # what shuffling Megatron's list of n-gram sets draws).
        starts = np.arange(len(words))
        rng.shuffle(starts)
        positions, labels, spans, covered = [], [], [], set()
        for w in starts.tolist():
            if len(positions) >= num_to_predict:
                break
            fit = min(MAX_NGRAMS, len(words) - w)  # n-grams that fit before the end
            n = bisect.bisect_right(_NGRAM_CDF[fit], rng.random()) + 1  # rng.choice(1..fit, p ~ 1 / n), same draw
            index_set = [i for word in words[w:w + n] for i in word]
            # Too many predictions: try shorter n-grams, else skip this candidate.
            while len(positions) + len(index_set) > num_to_predict and n > 1:
                n -= 1
                index_set = [i for word in words[w:w + n] for i in word]
            if len(positions) + len(index_set) > num_to_predict or covered.intersection(index_set):
                continue
            covered.update(index_set)
            replace_masked(output, tokens, index_set, tok, rng)
            positions += index_set
            labels += [tokens[index] for index in index_set]
            spans.append(n)
        order = np.argsort(positions)
        return (output, np.asarray(positions, np.int64)[order], np.asarray(labels, np.int64)[order],
                np.asarray(spans, np.int64))


def replace_masked(output: list[int], tokens: list[int], index_set: list[int], tok, rng) -> None:
    """BERT's 80/10/10, in place: each chosen position of `output` becomes [MASK] (80%), keeps its token (10%) or
    takes a random id (10%), drawn position by position as Megatron draws them."""
    for index in index_set:
        if rng.random() < 0.8:
            output[index] = tok.mask
        elif rng.random() < 0.5:
            output[index] = tokens[index]
        else:
            output[index] = int(rng.integers(0, tok.vocab_size))


def _a_and_b_segments(sentences: list[list[int]], rng) -> tuple[list[int], list[int], bool]:
    """A = sentences[:a_end], B = the rest, a_end uniform in [1, n - 1]; swapped with probability 1/2."""
    a_end = int(rng.integers(1, len(sentences))) if len(sentences) >= 3 else 1
    a = [t for s in sentences[:a_end] for t in s]
    b = [t for s in sentences[a_end:] for t in s]
    if rng.random() < 0.5:
        return b, a, True
    return a, b, False


def truncate_seq_pair(a: list[int], b: list[int], max_tokens: int, rng) -> bool:
    """Megatron's truncate_segments, in place: while len(a) + len(b) > max_tokens, drop one token from the longer
    segment (a on ties goes to b), at its front or back with equal probability. True if anything was dropped."""
    if len(a) + len(b) <= max_tokens:
        return False
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()
    return True


# ---- sources ----

def sentences_from_text(texts: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain texts -> (tokens, sentence offsets, doc_idx): documents at blank lines, sentences within them."""
    pieces, sizes, doc_idx = [], [], [0]
    for text in texts:
        for doc in split_documents(text):
            for sentence in split_sentences(doc):
                ids = tokenizer.encode(sentence)
                if ids:
                    pieces.append(np.asarray(ids, np.int32))
                    sizes.append(len(ids))
            if len(sizes) > doc_idx[-1]:
                doc_idx.append(len(sizes))
    tokens = np.concatenate(pieces) if pieces else np.empty(0, np.int32)
    return tokens, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]), np.asarray(doc_idx, np.int64)


def sentences_from_indexed(prefix: str, pairs: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Megatron indexed dataset written with --split-sentences: sequences are sentences, doc_idx the documents.
    With `pairs` (the sentence-order head), one that holds a single sequence a document is refused: it was written
    without --split-sentences, and no sample could be made of it."""
    from mtx.data.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    if pairs and len(ds.doc_idx) > 1 and (np.diff(ds.doc_idx) <= 1).all():
        raise ValueError(f"--data-path {prefix}: every document is one sequence, so it was written without "
                         "--split-sentences; BERT reads documents of sentences: re-run `python -m mtx.data.preprocess` "
                         "with --split-sentences.")
    return ds.tokens, np.concatenate([[0], np.cumsum(ds.sizes, dtype=np.int64)]), ds.doc_idx


def build_bert_dataset(cfg) -> BertDataset:
    """The BERT dataset of a Config: --data-path text files and indexed prefixes (their documents concatenated),
    or the built-in corpus; the tokenizer is BERT's WordPiece from --vocab-file or the reference data folder."""
    from mtx.data.tokenizer import BertWordPieceTokenizer

    data = cfg.data
    tokenizer = BertWordPieceTokenizer(data.vocab_file or _shared_vocab())
    if not data.data_path:
        parts, source = [sentences_from_text([builtin_corpus()], tokenizer)], "the built-in corpus"
    else:
        weights, paths = parse_data_path(data.data_path)
        if weights is not None:
            raise ValueError("--model-type bert does not blend weighted datasets yet; pass the --data-path entries "
                             "without weights (their documents are read as one corpus).")
        parts = []
        for path in paths:
            if indexed_prefix(path):
                parts.append(sentences_from_indexed(indexed_prefix(path), pairs=cfg.model.bert_binary_head))
            elif Path(path).is_file():
                text = read_text(path, "--data-path", "pass plain UTF-8 text or an indexed-dataset prefix.")
                parts.append(sentences_from_text([text], tokenizer))
            else:
                raise ValueError(f"--data-path {path}: no such text file or indexed dataset (PATH.bin + PATH.idx); "
                                 "pass text files or prefixes written by `python -m mtx.data.preprocess "
                                 "--split-sentences`.")
        source = f"--data-path {' '.join(paths)}"
    tokens, offsets, doc_idx = _concatenate(parts)
    return BertDataset(tokens, offsets, doc_idx, seq_length=cfg.model.seq_length, tokenizer=tokenizer,
                       seed=cfg.training.seed, split=data.split, mask_prob=data.mask_prob,
                       short_seq_prob=data.short_seq_prob, binary_head=cfg.model.bert_binary_head, source=source,
                       evaluated=bool(cfg.training.eval_interval))


def _shared_vocab() -> str:
    root = shared_data_dir()
    path = None if root is None else root / "bert" / "vocab.txt"
    if path is None or not path.is_file():
        raise ValueError("--model-type bert needs BERT's WordPiece vocab.txt and none was found in the reference "
                         "data folder ($MTX_DATA_DIR/bert/vocab.txt); pass --vocab-file path/to/vocab.txt.")
    return str(path)


def _concatenate(parts):
    if len(parts) == 1:
        return parts[0]
    tokens = np.concatenate([np.asarray(t, np.int32) for t, _, _ in parts])
    offsets, doc_idx = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    for _, off, docs in parts:
        offsets.append(off[1:] + offsets[-1][-1])
        doc_idx.append(docs[1:] + doc_idx[-1][-1])
    return tokens, np.concatenate(offsets), np.concatenate(doc_idx)
