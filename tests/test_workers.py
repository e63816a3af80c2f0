"""--num-workers: batches built by worker processes are the batches this process builds, for GPT and BERT, and a
run with workers trains on the same batches (the same losses) as one without."""

import jax
import numpy as np
import pytest

from mtx.config import Config
from mtx.data import build_dataset
from mtx.data.workers import BatchWorkers
from mtx.presets import load_preset
from mtx.run import train

GPT = Config().replace(**load_preset("configs/tiny.toml"))


def bert(bert_toy):
    vocab, corpus = bert_toy
    return Config().replace(**load_preset("configs/bert_tiny.toml")).replace(vocab_file=str(vocab),
                                                                              data_path=(str(corpus),))


def assert_same(got, want):
    if isinstance(want, dict):  # BERT's fields
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_workers_make_the_batches_this_process_makes(model, bert_toy):
    cfg = GPT if model == "gpt" else bert(bert_toy)
    dataset = build_dataset(cfg)
    with BatchWorkers(cfg, 2) as workers:
        for index in (0, 1, 2, 7, 3):  # in order, then a jump ahead and one back (batches sent ahead are dropped)
            assert_same(workers.batch("train", index, 4), dataset.batch("train", index, 4))
        assert_same(workers.batch("valid", 0, 2), dataset.batch("valid", 0, 2))
        assert_same(workers.batch("train", 3, 4, slice(2, 4)), dataset.batch("train", 3, 4, slice(2, 4)))
        whole = dataset.batch("train", 3, 4)  # and a part is the part of the whole batch (BERT's and GPT's)
        assert_same(dataset.batch("train", 3, 4, slice(2, 4)), jax.tree.map(lambda a: a[2:4], whole))


def test_a_run_with_workers_trains_on_the_same_batches(tmp_path, monkeypatch):
    import mtx.run

    asked = []

    class Counted(BatchWorkers):  # the run's batches come from the workers
        def batch(self, split, index, batch_size, rows=slice(None)):
            asked.append(index)
            return super().batch(split, index, batch_size, rows)

    monkeypatch.setattr(mtx.run, "BatchWorkers", Counted)
    cfg = GPT.replace(train_iters=3, hidden_dropout=0.0, attention_dropout=0.0)
    plain = train(cfg.replace(run_dir=str(tmp_path / "plain")), progress=False)
    workers = train(cfg.replace(run_dir=str(tmp_path / "workers"), num_workers=2), progress=False)
    assert asked == [0, 1, 2] and workers.losses == plain.losses
