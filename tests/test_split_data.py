"""Megatron's --train-data-path, --valid-data-path and --test-data-path: each split read from data of its own, and
the test split evaluated once training ends."""

import json

import numpy as np
import pytest

from helpers import refused_in_one_line
from mtx.cli import parse_config
from mtx.config import Config
from mtx.data import build_dataset
from mtx.data.dataset import builtin_corpus
from mtx.presets import load_preset
from mtx.run import train

TINY = Config().replace(**load_preset("configs/tiny.toml"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Three files of the built-in corpus's text (byte-level, so a file's tokens are its bytes)."""
    root, corpus = tmp_path_factory.mktemp("splits"), builtin_corpus()
    parts = {"a": corpus[:40_000], "b": corpus[40_000:44_000], "c": corpus[44_000:46_000]}
    for name, text in parts.items():
        (root / f"{name}.txt").write_text(text)
    return {name: str(root / f"{name}.txt") for name in parts}


def _bytes(path):
    with open(path, encoding="utf-8") as f:
        return np.frombuffer(f.read().encode("utf-8"), np.uint8).astype(np.int32)


def test_each_split_reads_its_own_data(texts):
    """Training reads --train-data-path as --data-path with all of it for training (the same epochs and order);
    validation and test read their own files' windows in order, from their first token, wrapping around."""
    cfg = TINY.replace(seq_length=32)
    own = build_dataset(cfg.replace(train_data_path=(texts["a"],), valid_data_path=(texts["b"],),
                                    test_data_path=(texts["c"],)))
    whole = build_dataset(cfg.replace(data_path=(texts["a"],), split="1,0,0"))
    for k in (0, 7, 400):  # 400 x 8 samples: past the first epoch of 1,249
        np.testing.assert_array_equal(own.batch("train", k, 8), whole.batch("train", k, 8))
    for split, name in (("valid", "b"), ("test", "c")):
        tokens, n = _bytes(texts[name]), own.num_samples(split)
        assert n == (len(tokens) - 1) // 32
        windows = np.stack([tokens[j * 32:j * 32 + 33] for j in np.arange(n + 3) % n])
        np.testing.assert_array_equal(np.concatenate([own.batch(split, k, n + 3) for k in (0,)]), windows)
    no_test = build_dataset(cfg.replace(train_data_path=(texts["a"],), valid_data_path=(texts["b"],)))
    assert no_test.num_samples("test") == 0
    refused_in_one_line("^no test data was given; pass --test-data-path.$", no_test.batch, "test", 0, 1)


def test_a_split_may_blend_its_own_datasets(texts):
    """--valid-data-path 0.5 b 0.5 c: a blend of validation data alone (no member holds a training sample)."""
    own = build_dataset(TINY.replace(seq_length=32, train_data_path=(texts["a"],),
                                     valid_data_path=("0.5", texts["b"], "0.5", texts["c"])))
    rows = {tuple(row) for k in range(4) for row in own.batch("valid", k, 16)}
    assert {tuple(_bytes(texts[name])[:33]) for name in ("b", "c")} <= rows  # each file's first window is read
    assert not {tuple(row) for row in own.batch("train", 0, 16)} & rows  # and training reads neither


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "A", "--train-data-path", "A"], "^--data-path and --train-data-path both give data; pass one "
                                                      "--data-path"),
    (["--valid-data-path", "B"], "^--valid-data-path without --train-data-path: pass the training data"),
    (["--train-data-path", "A", "--split", "90,10"], "^--split only acts with --data-path .*; leave it out"),
    (["--train-data-path", "A", "--test-data-path", "C", "--eval-interval", "0"],
     "^--test-data-path only acts with --eval-interval N"),
])
def test_per_split_flags_that_cannot_act_together_are_refused(flags, message):
    refused_in_one_line(message, lambda: parse_config(flags).validate(8))


def test_a_splits_data_too_small_or_missing_is_named_by_its_flag(texts, tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    cfg = TINY.replace(seq_length=32, train_data_path=(texts["a"],), eval_interval=10)
    refused_in_one_line(r"^the valid split of --valid-data-path .*short.txt holds 9 tokens, fewer than one sequence"
                        r" of --seq-length 32 \+ 1; use a shorter --seq-length, more data \(--valid-data-path\) \(or "
                        r"leave --valid-data-path out: no validation\).$",
                        build_dataset, cfg.replace(valid_data_path=(str(tmp_path / "short.txt"),)))
    refused_in_one_line("^the test split of --test-data-path .*short.txt holds no sample of --seq-length 32",
                        build_dataset, cfg.replace(test_data_path=(str(tmp_path / "short.txt"),)))
    refused_in_one_line(r"^--valid-data-path .*nope.txt: no such file or indexed dataset \(PATH.bin \+ PATH.idx\); "
                        "pass text, .npy or indexed-dataset prefixes.$", build_dataset,
                        cfg.replace(valid_data_path=(str(tmp_path / "nope.txt"),)))
    refused_in_one_line("^--split 0,1,0 gives training no share", build_dataset, TINY.replace(split="0,1,0"))


def test_the_test_split_is_evaluated_once_training_ends_the_same_on_every_mesh(texts, tmp_path):
    """Megatron's test evaluation: after the last step, --eval-iters batches of the test data; the losses (training,
    validation and test) are the same on every mesh."""
    records = {}
    for dp, pp, tp in ((1, 1, 1), (2, 2, 2)):
        run_dir = tmp_path / f"mesh{dp}{pp}{tp}"
        train(TINY.replace(train_data_path=(texts["a"],), valid_data_path=(texts["b"],), test_data_path=(texts["c"],),
                           seq_length=32, train_iters=4, log_interval=2, eval_interval=2, eval_iters=2,
                           hidden_dropout=0.0, attention_dropout=0.0, run_dir=str(run_dir), data_parallel_size=dp,
                           pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp), progress=False)
        records[dp] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in records[1] if "test_loss" in r]
    assert [r["step"] for r in tests] == [4] and [r["step"] for r in records[1] if "val_loss" in r] == [2, 4]
    assert np.isclose(tests[0]["test_ppl"], np.exp(tests[0]["test_loss"]))
    for key in ("loss", "val_loss", "test_loss"):
        one, many = ([r[key] for r in records[dp] if key in r] for dp in (1, 2))
        np.testing.assert_allclose(many, one, rtol=1e-5, err_msg=key)


def test_bert_evaluates_its_own_splits_the_same_on_every_mesh(bert_toy, tmp_path, shared_initial_state):
    """BERT's losses normalize by the masked tokens, which differ between the parts of an evaluation batch: each part
    divides by the whole batch's count (a mean of the parts' own means differed by mesh)."""
    vocab, corpus = bert_toy
    text = corpus.read_text()
    for name, part in (("train", text[:30_000]), ("valid", text[30_000:36_000]), ("test", text[36_000:])):
        (tmp_path / f"{name}.txt").write_text(part)
    cfg = Config().replace(**load_preset("configs/bert_tiny.toml")).replace(
        seq_length=32, vocab_file=str(vocab), lr_warmup_iters=2, hidden_dropout=0.0, attention_dropout=0.0,
        train_iters=2, log_interval=1, eval_interval=2, eval_iters=2,
        **{f"{name}_data_path": (str(tmp_path / f"{name}.txt"),) for name in ("train", "valid", "test")})
    records = {}
    for dp, pp, tp in ((1, 1, 1), (2, 2, 2)):
        run_dir = tmp_path / f"mesh{dp}{pp}{tp}"
        train(cfg.replace(run_dir=str(run_dir), data_parallel_size=dp, pipeline_model_parallel_size=pp,
                          tensor_model_parallel_size=tp), progress=False)
        records[dp] = {key: [r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                             if key in r] for key in ("loss", "val_loss", "test_loss")}
    assert [len(records[1][key]) for key in ("loss", "val_loss", "test_loss")] == [2, 1, 1]
    for key, one in records[1].items():
        np.testing.assert_allclose(records[2][key], one, rtol=1e-5, err_msg=key)


def test_no_validation_data_says_what_is_still_evaluated(texts, capsys):
    """Without validation data --eval-interval validates nothing: said in one line, whose fix keeps the test split's
    evaluation where there is one (--eval-interval 0, the fix without test data, would drop it)."""
    from mtx.data import say_what_data_overrides

    cfg = TINY.replace(seq_length=32, eval_interval=2, train_data_path=(texts["a"],))
    for test, said in (((), "evaluates nothing; pass --eval-interval 0, or pass --valid-data-path."),
                       ((texts["c"],), "validates nothing (the test split is evaluated once training ends); pass "
                                       "--valid-data-path to validate.")):
        with_test = cfg.replace(test_data_path=test)
        say_what_data_overrides(with_test, build_dataset(with_test))
        assert capsys.readouterr().err == f"mtx: no --valid-data-path was given, so --eval-interval 2 {said}\n"


def test_training_data_read_for_validation_too_is_said(texts, capsys):
    """The same file given for training and validation (easily done by accident; Megatron allows it): one line."""
    from mtx.data import say_what_data_overrides

    cfg = TINY.replace(seq_length=32, eval_interval=2, train_data_path=(texts["a"],),
                       valid_data_path=("0.5", texts["a"], "0.5", texts["b"]))
    say_what_data_overrides(cfg, build_dataset(cfg))
    assert capsys.readouterr().err == (f"mtx: {texts['a']} is training data and --valid-data-path data: the valid "
                                       "loss is then measured on samples trained on.\n")
