"""--tp-comm-batch-split runs each microbatch through every layer as k independent row groups (so XLA can overlap one
group's tensor-parallel collectives with another's matmuls): the same math as one group, on every mesh."""

import jax
import numpy as np
import pytest

from mtx.config import Config, load_preset
from mtx.models.gpt import split_rows

from test_sequence_parallel import assert_same, loss_and_grads

TINY = Config().replace(**load_preset("configs/tiny.toml"))


def test_batch_split_is_the_same_math():
    """Dropout on (masks follow the sequences): with and without sequence parallelism, overlapped ring steps,
    pipelined with uneven stages, `matmuls` and unrolled layers; loss and every gradient equal the unsplit run's."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=16, micro_batch_size=8)
    reference = loss_and_grads(cfg.replace(tensor_model_parallel_size=1), 1, 1, 1)
    for dp, pp, tp, split, extra in [
            (1, 1, 2, 2, dict(sequence_parallel=True)),
            (1, 1, 4, 2, dict(sequence_parallel=True, recompute_granularity="matmuls", scan_layers=False)),
            (1, 1, 2, 4, dict(sequence_parallel=True, tp_comm_overlap=True)),
            (1, 1, 2, 8, {}),
            (2, 2, 2, 2, dict(sequence_parallel=True, num_layers=3, num_layers_in_first_pipeline_stage=1)),
            (1, 1, 1, 4, dict(recompute_granularity="full"))]:
        run = cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                          tp_comm_batch_split=split, **extra)
        want = reference if "num_layers" not in extra else loss_and_grads(
            cfg.replace(tensor_model_parallel_size=1, num_layers=3), 1, 1, 1)
        assert_same(loss_and_grads(run, dp, pp, tp), want)


def test_split_rows_groups_each_ranks_rows():
    """Group j holds slice j of every owner's rows, in owner order: what a sequence-parallel layer gathers."""
    rows = np.arange(16)
    groups = [np.asarray(g) for g in split_rows(rows, 2, 4)]
    np.testing.assert_array_equal(groups[0], [0, 1, 4, 5, 8, 9, 12, 13])
    np.testing.assert_array_equal(groups[1], [2, 3, 6, 7, 10, 11, 14, 15])
    np.testing.assert_array_equal(np.concatenate([np.asarray(g) for g in split_rows(rows, 4, 1)]), rows)
    assert split_rows(None, 3, 2) == [None] * 3


@pytest.mark.parametrize("flags,needle", [
    (dict(tp_comm_batch_split=0), "--tp-comm-batch-split 0 must divide"),
    (dict(tp_comm_batch_split=3), "the 8 sequences"),
    (dict(tp_comm_batch_split=8, sequence_parallel=True), "the 4 sequences of a microbatch each rank holds with "
                                                           "--sequence-parallel"),
])
def test_bad_batch_split_is_refused(flags, needle):
    with pytest.raises(ValueError, match=needle):
        TINY.replace(micro_batch_size=8, tensor_model_parallel_size=2, **flags).validate(8)
