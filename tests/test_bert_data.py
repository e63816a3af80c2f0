"""BERT samples: Megatron's fields, 15% whole-word n-gram masking split 80/10/10, sentence order ~50%, truncation,
determinism, and the --split-sentences preprocessing."""

import collections

import numpy as np
import pytest

from mtx.data.bert_dataset import BertDataset, replace_masked, sentences_from_text, truncate_seq_pair
from mtx.data.indexed import IndexedDataset
from mtx.data.preprocess import main as preprocess
from mtx.data.sentences import split_documents, split_sentences
from mtx.data.tokenizer import BertWordPieceTokenizer

SEQ = 128


@pytest.fixture(scope="module")
def wiki(shared_data_module):
    """WikiText-2's validation text with BERT's real uncased vocabulary (skips where the shared data is absent)."""
    tok = BertWordPieceTokenizer(shared_data_module / "bert" / "vocab.txt")
    text = (shared_data_module / "wikitext-2" / "valid.txt").read_text()[:300_000]
    return BertDataset(*sentences_from_text([text], tok), seq_length=SEQ, tokenizer=tok, seed=7, split="1,0,0")


@pytest.fixture(scope="module")
def shared_data_module():
    from mtx.data.paths import shared_data_dir

    path = shared_data_dir()
    if path is None or not (path / "bert" / "vocab.txt").is_file():
        pytest.skip("BERT's vocab.txt not found: set MTX_DATA_DIR to the folder holding bert/vocab.txt")
    return path


def test_sentences_and_documents():
    assert split_sentences('He left. "Why?" she asked!  3 cats came.\nThen none.') == [
        "He left.", '"Why?" she asked!', "3 cats came.", "Then none."]
    assert split_documents("a b.\n\n  \nc d.\ne f.\n") == ["a b.", "c d.\ne f."]


def test_fields_layout(wiki):
    tok = wiki.tokenizer
    b = wiki.batch("train", 3, 32)
    assert set(b) == {"text", "types", "labels", "is_random", "loss_mask", "padding_mask"}
    assert b["text"].shape == (32, SEQ) and b["is_random"].shape == (32,)
    for i in range(32):
        n = int(b["padding_mask"][i].sum())
        assert b["padding_mask"][i, :n].all() and not b["padding_mask"][i, n:].any()
        text, types = b["text"][i], b["types"][i]
        assert text[0] == tok.cls and text[n - 1] == tok.sep and (text[n:] == tok.pad).all()
        seps = np.flatnonzero(text[:n] == tok.sep)
        assert len(seps) == 2  # [CLS] A [SEP] B [SEP]
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all() and (types[n:] == 0).all()
        assert ((b["labels"][i] >= 0) == (b["loss_mask"][i] > 0)).all()
    # a pure function of (seed, position): the same sample whatever batch it is read in
    single = wiki.sample("train", 3 * 32 + 5)
    assert all(np.array_equal(single[k], b[k][5]) for k in b)


def test_masking_statistics(wiki):
    """Over ~1,500 samples: 15% of maskable tokens, 80/10/10, whole words, decreasing n-gram lengths, no special
    token masked, sentence order swapped half of the time."""
    tok = wiki.tokenizer
    continuation = wiki.continuation
    b = wiki.batch("train", 0, 1536)
    chosen, maskable, replaced, kept, randomized = 0, 0, 0, 0, 0
    for i in range(len(b["text"])):
        n = int(b["padding_mask"][i].sum())
        original = np.where(b["loss_mask"][i] > 0, b["labels"][i], b["text"][i])[:n]
        special = np.isin(original, [tok.cls, tok.sep, tok.pad])
        where = np.flatnonzero(b["loss_mask"][i])
        assert not special[where].any(), "a special token was masked"
        maskable += int((~special).sum())
        chosen += len(where)
        replaced += int((b["text"][i][where] == tok.mask).sum())
        same = b["text"][i][where] == original[where]
        kept += int(same.sum())
        randomized += int(((b["text"][i][where] != tok.mask) & ~same).sum())
        # whole words: a masked "##" piece comes with the piece before it, unless a special token precedes it
        for j in where:
            if continuation[original[j]] and not special[j - 1]:
                assert b["loss_mask"][i][j - 1], "a ## piece was masked without its word start"
        # and a masked word start takes its ## pieces with it
        for j in where:
            if j + 1 < n and continuation[original[j + 1]] and not special[j + 1]:
                assert b["loss_mask"][i][j + 1], "a word was masked without its ## pieces"
    assert chosen / maskable == pytest.approx(0.15, abs=0.015)
    assert replaced / chosen == pytest.approx(0.8, abs=0.02)
    assert kept / chosen == pytest.approx(0.1, abs=0.015)  # a random id equal to the original counts as kept
    assert randomized / chosen == pytest.approx(0.1, abs=0.015)
    assert b["is_random"].mean() == pytest.approx(0.5, abs=0.05)


def test_ngram_lengths_decrease(wiki):
    rng = np.random.default_rng(0)
    lengths = collections.Counter()
    for k in range(300):
        tokens = wiki.sample("train", k)["text"]  # any realistic token sequence
        tokens = [t for t in tokens.tolist() if t != wiki.tokenizer.pad]
        lengths.update(wiki.mask(tokens, rng)[3].tolist())
    total = sum(lengths.values())
    share = [lengths[n] / total for n in (1, 2, 3)]
    assert set(lengths) <= {1, 2, 3}
    assert share[0] > share[1] > share[2] > 0.05, share  # 1/n normalized: 0.55, 0.27, 0.18 before rejections


def test_masking_draws_what_megatrons_formulation_draws(wiki):
    """mask() picks its n-gram candidates and lengths with cheaper calls (a shuffled index array, one uniform draw
    against the n-gram distribution); with the same seed it must mask exactly what Megatron's formulation does:
    shuffle the list of n-gram sets, rng.choice each length, then 80/10/10 (the shared `replace_masked`)."""
    tok = wiki.tokenizer

    def megatron(tokens, rng):
        words = []
        for i, t in enumerate(tokens):
            if t not in (tok.cls, tok.sep, tok.pad):
                if words and wiki.continuation[t] and words[-1][-1] == i - 1:
                    words[-1].append(i)
                else:
                    words.append([i])
        output, num = list(tokens), max(1, int(round(len(tokens) * wiki.mask_prob)))
        ngrams = np.arange(1, 4)
        pvals = 1.0 / ngrams
        pvals /= pvals.sum()
        sets = [[words[w:w + n] for n in ngrams] for w in range(len(words))]
        rng.shuffle(sets)
        positions, covered = [], set()
        for cand in sets:
            if len(positions) >= num:
                break
            available = [c for k, c in enumerate(cand) if len(c) == k + 1]
            n = int(rng.choice(ngrams[:len(available)], p=pvals[:len(available)] / pvals[:len(available)].sum()))
            while len(positions) + len(sum(available[n - 1], [])) > num and n > 1:
                n -= 1
            index_set = sum(available[n - 1], [])
            if len(positions) + len(index_set) > num or covered.intersection(index_set):
                continue
            covered.update(index_set)
            replace_masked(output, tokens, index_set, tok, rng)  # the same 80/10/10 draws after each candidate
            positions += index_set
        return output, sorted(positions)

    for k in range(40):
        tokens = [t for t in wiki.sample("train", k)["text"].tolist() if t != tok.pad]
        masked, positions, _, _ = wiki.mask(tokens, np.random.default_rng(k))
        assert (masked, positions.tolist()) == megatron(tokens, np.random.default_rng(k))


def test_truncate_seq_pair_drops_from_the_longer_segment():
    rng = np.random.default_rng(0)
    a, b = list(range(10)), list(range(100, 104))
    assert truncate_seq_pair(a, b, 9, rng)
    assert len(a) + len(b) == 9 and len(b) == 4 and set(a) <= set(range(10))
    a, b = list(range(5)), list(range(5))
    assert not truncate_seq_pair(a, b, 10, rng)


def test_short_sequences_and_no_binary_head(wiki):
    tok = wiki.tokenizer
    short = BertDataset(wiki.tokens, wiki.offsets, wiki.doc_idx, seq_length=SEQ, tokenizer=tok, seed=1,
                        split="1,0,0", short_seq_prob=1.0)
    lengths = short.batch("train", 0, 64)["padding_mask"].sum(1)
    assert lengths.mean() < 0.75 * wiki.batch("train", 0, 64)["padding_mask"].sum(1).mean()
    single = BertDataset(wiki.tokens, wiki.offsets, wiki.doc_idx, seq_length=SEQ, tokenizer=tok, seed=1,
                         split="1,0,0", binary_head=False)
    b = single.batch("train", 0, 16)
    assert not b["is_random"].any() and not b["types"].any()
    assert ((b["text"] == tok.sep).sum(1) == 1).all()


def test_preprocess_split_sentences_feeds_the_same_samples(bert_toy, tmp_path):
    vocab, corpus = bert_toy
    prefix = preprocess(["--input", str(corpus), "--output-prefix", str(tmp_path / "c"), "--vocab-file", str(vocab),
                         "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences"])[0]
    assert prefix.endswith("c_text_sentence")
    ds = IndexedDataset(prefix)
    tok = BertWordPieceTokenizer(vocab)
    tokens, offsets, doc_idx = sentences_from_text([corpus.read_text()], tok)
    assert np.array_equal(ds.tokens, tokens) and np.array_equal(ds.doc_idx, doc_idx)
    assert np.array_equal(np.concatenate([[0], np.cumsum(ds.sizes)]), offsets)
    assert ds.num_documents > 50 and len(ds) > 1.5 * ds.num_documents


def test_text_of_one_sentence_documents_says_why_it_holds_no_sample(bert_toy):
    """Lower-case text has no sentence ends mtx can see: the refusal counts the documents of 2+ sentences and says
    what ends a sentence (it said only "use more data", with plenty there)."""
    tok = BertWordPieceTokenizer(bert_toy[0])
    text = "\n\n".join(["the cat sat on the mat. the dog ran to the park. it was a good day"] * 50)
    with pytest.raises(ValueError, match=r"holds no BERT sample \(documents of 2\+ sentences; 0 of its 50 documents "
                                         r"have 2\+ \(a sentence ends at \. ! or \? before a capital"):
        BertDataset(*sentences_from_text([text], tok), seq_length=64, tokenizer=tok, seed=1, split="1,0,0")
    capital = text.replace(". the", ". The").replace(". it", ". It")
    assert BertDataset(*sentences_from_text([capital], tok), seq_length=64, tokenizer=tok, seed=1,
                       split="1,0,0").num_samples("train") > 0
