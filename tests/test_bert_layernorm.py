"""The LayerNorm placement study (benchmarks/bert_layernorm.py) runs at toy size: two curves, same data and seed."""

import importlib.util
import math
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "bert_layernorm", Path(__file__).parent.parent / "benchmarks" / "bert_layernorm.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_study_gives_two_finite_curves_that_differ_only_by_placement(bert_toy, tmp_path):
    vocab, corpus = bert_toy
    steps = 6
    curves = study.compare(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, global_batch_size=8,
                           train_iters=steps, lr=3e-3, data_path=str(corpus), vocab_file=str(vocab),
                           run_dir=tmp_path / "runs")
    assert set(curves) == {"post", "pre"}
    vocab_size = len(vocab.read_text().splitlines())
    for placement, losses in curves.items():
        assert len(losses) == steps and all(math.isfinite(x) for x in losses), (placement, losses)
        # starts near uniform guessing: ln V for the masked tokens + ln 2 for the sentence order
        assert abs(losses[0] - (math.log(vocab_size) + math.log(2))) < 0.5, (placement, losses[0])
        assert min(losses[1:]) < losses[0], (placement, losses)  # and learns
    assert not np.allclose(curves["post"], curves["pre"], rtol=1e-3)  # the switch changes the model
    study.plot(curves, tmp_path / "ln.png", "toy")
    assert (tmp_path / "ln.png").stat().st_size > 1000
    assert study.summary(curves, window=2)["pre"]["last_mean"] == np.mean(curves["pre"][-2:])
