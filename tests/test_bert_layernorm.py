"""The LayerNorm placement study (benchmarks/bert_layernorm.py) runs at toy size: two curves, same data and seed,
and the placement switch changes the model where it should."""

import importlib.util
import math
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "bert_layernorm", Path(__file__).parent.parent / "benchmarks" / "bert_layernorm.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_placement_switch_moves_the_layernorms():
    from flax import nnx

    from mtx.config import Config
    from mtx.models.bert import BERT

    cfg = Config().replace(model_type="bert", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                           vocab_size=100)
    post = BERT(cfg.replace(layernorm_placement="post").model, rngs=nnx.Rngs(0))
    pre = BERT(cfg.replace(layernorm_placement="pre").model, rngs=nnx.Rngs(0))
    # post: an embedding LN, LN after each residual add, no final LN; pre: the reverse
    assert post.embedding_layernorm is not None and post.final_layernorm is None and post.layers.post_layernorm
    assert pre.embedding_layernorm is None and pre.final_layernorm is not None and not pre.layers.post_layernorm


def test_study_gives_two_finite_learning_curves_that_differ(bert_toy, tmp_path):
    vocab, corpus = bert_toy
    steps = 8
    baseline = {}
    curves = study.compare(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, global_batch_size=8,
                           train_iters=steps, lr=1e-2, data_path=str(corpus), vocab_file=str(vocab),
                           run_dir=tmp_path / "runs", baseline=baseline)
    assert set(curves) == {"post", "pre"}
    vocab_size = len(vocab.read_text().splitlines())
    for placement, losses in curves.items():
        assert len(losses) == steps and all(math.isfinite(x) for x in losses), (placement, losses)
        # starts near uniform guessing: ln V for the masked tokens + ln 2 for the sentence order
        assert abs(losses[0] - (math.log(vocab_size) + math.log(2))) < 0.5, (placement, losses[0])
        assert np.mean(losses[-4:]) < losses[0] - 0.1, (placement, losses)  # and learns
    assert not np.allclose(curves["post"], curves["pre"], rtol=1e-3)  # the switch changes the training
    assert math.log(2) < baseline["masked_unigram"] < math.log(vocab_size) + math.log(2)
    s = study.summary(curves, window=2)
    assert s["pre"]["last_mean"] == np.mean(curves["pre"][-2:]) and s["pre"]["diverged_at"] is None
    study.plot(curves, tmp_path / "ln.png", "toy", baseline["masked_unigram"])
    assert (tmp_path / "ln.png").stat().st_size > 1000


def test_summary_flags_divergence_and_vocab_covers_the_text(tmp_path):
    s = study.summary({"post": [8.0, 6.0, 9.0, float("inf")], "pre": [8.0, 8.5, 6.0, 5.0]}, window=2)
    assert s["post"]["diverged_at"] == 3 and s["pre"]["diverged_at"] is None  # a rise before any drop is no divergence
    text = "The cat sat. The dog sat on the mat!\n\nZebras are rare."
    pieces = study.build_vocab(text, num_words=3)
    assert pieces[:5] == list(study.SPECIAL) and "the" in pieces and "##z" in pieces
    (tmp_path / "v.txt").write_text("\n".join(pieces) + "\n")
    from mtx.data.tokenizer import BertWordPieceTokenizer

    assert 1 not in BertWordPieceTokenizer(tmp_path / "v.txt").encode(text)  # no [UNK]
    assert 0 < study.unigram_entropy(text, tmp_path / "v.txt") < math.log(len(pieces))


def test_from_runs_pairs_the_placements_of_each_model(tmp_path):
    """--from-runs reads train.py run directories, pairs pre- with post-LN per model and schedule, and refuses a
    model with one placement only."""
    import json

    import pytest

    from mtx.config import Config
    from mtx.files import json_line

    def run(name, placement, hidden, losses):
        d = tmp_path / name
        d.mkdir()
        cfg = Config().replace(model_type="bert", num_layers=2, hidden_size=hidden, num_attention_heads=4,
                               layernorm_placement=placement, train_iters=len(losses) * 5,
                               data_path=(str(tmp_path / "absent"),))
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        lines = [{"step": 5 * (i + 1), "loss": x} for i, x in enumerate(losses)] + [{"step": 10, "val_loss": 6.5}]
        (d / "metrics.jsonl").write_text("".join(json_line(r) + "\n" for r in lines))  # a NaN as null, as mtx writes
        return str(d)

    dirs = [run("a", "pre", 32, [8.0, 7.0]), run("b", "post", 32, [8.0, 7.5]), run("c", "pre", 64, [8.0, 6.0])]
    with pytest.raises(ValueError, match="only \\['pre'\\]"):
        study.group_runs([study.read_run(d) for d in dirs])
    record = study.from_runs([*dirs, run("d", "post", 64, [8.0, float("nan")])], tmp_path / "out")
    small, large = record.values()  # sorted by size
    assert small["pre"]["last_100_mean"] == 7.5 and small["post"]["val"] == {10: 6.5}
    assert large["post"]["diverged_at"] == 2 and large["pre"]["diverged_at"] is None
    assert small["masked_unigram_loss"] is None  # no data here: no baseline
    assert (tmp_path / "out" / "bert_layernorm_gpu.png").stat().st_size > 1000
    # the command line never writes over existing outputs unasked
    dirs.append(str(tmp_path / "d"))
    assert study.main(["--from-runs", *dirs, "--out", str(tmp_path / "out")]) == 2
    assert study.main(["--from-runs", *dirs, "--out", str(tmp_path / "out"), "--overwrite"]) == 0


def test_the_study_writes_into_a_new_directory_of_its_own_and_only_after_its_checks(bert_toy, tmp_path):
    """A vocab.txt of the user's where the study's runs went, or bad settings: refused before anything is written
    (the vocabulary once replaced the user's file, then the settings were refused)."""
    import pytest

    _, corpus = bert_toy
    mine = tmp_path / "runs" / "vocab.txt"
    mine.parent.mkdir()
    mine.write_text("the user's")
    with pytest.raises(ValueError, match="exists already; the study's runs go into a new directory"):
        study.compare(data_path=str(corpus), run_dir=mine.parent)
    with pytest.raises(ValueError, match="not divisible by --num-attention-heads 3"):
        study.compare(num_attention_heads=3, data_path=str(corpus), run_dir=tmp_path / "runs" / "new")
    with pytest.raises(ValueError, match="--data-path .*absent no such file"):
        study.compare(data_path=str(tmp_path / "absent"), run_dir=tmp_path / "runs" / "new")
    assert mine.read_text() == "the user's" and sorted(p.name for p in tmp_path.rglob("*")) == ["runs", "vocab.txt"]
