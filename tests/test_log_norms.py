"""Megatron's --log-params-norm and --log-num-zeros-in-grad: the same numbers on every mesh, the parameters' norm that
of the weights the step leaves, the zeros at least the padded vocabulary's rows, printed as Megatron prints them,
and nothing but scalars added to the step's communication."""

import json
from collections import Counter

import jax
import numpy as np
import pytest

from mtx import audit
from mtx.config import Config
from mtx.files import METRICS
from mtx.hlo import collectives
from mtx.metrics import log_line
from mtx.parallel import make_mesh
from mtx.presets import load_preset
from mtx.run import train
from mtx.step import TrainStep

TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(
    hidden_dropout=0.0, attention_dropout=0.0, train_iters=3, log_interval=1, log_params_norm=True,
    log_num_zeros_in_grad=True)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def test_norms_and_zeros_are_the_same_on_every_mesh(tmp_path):
    runs = {}
    for mesh, flags in [((1, 1, 1), {}), ((2, 2, 2), {}), ((4, 1, 2), {"use_distributed_optimizer": True})]:
        dp, pp, tp = mesh
        run_dir = tmp_path / "-".join(map(str, mesh))
        r = train(TINY.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                               run_dir=str(run_dir), **flags), progress=False)
        runs[mesh] = [(rec["params_norm"], rec["num_zeros"]) for rec in _records(run_dir)]
        assert len(runs[mesh]) == 3
        weights = jax.tree.leaves(jax.device_get(r.state.params))
        norm = np.sqrt(sum(np.sum(np.asarray(w, np.float64) ** 2) for w in weights))
        assert runs[mesh][-1][0] == pytest.approx(norm, rel=1e-5)  # the weights after the last step
    m = r.model.cfg.model  # the byte tokenizer's 257 ids
    padded_rows = (m.padded_vocab_size - m.vocab_size) * m.hidden_size  # never looked up, never a logit
    one = runs[(1, 1, 1)]
    assert all(zeros >= padded_rows for _, zeros in one) and one[0][0] != one[-1][0]
    for mesh, values in runs.items():
        norms, zeros = np.array(values).T
        np.testing.assert_allclose(norms, [n for n, _ in one], rtol=1e-5, err_msg=str(mesh))
        # The structural zeros (the padded rows) are every mesh's; a sum that lands on exactly 0 by rounding is a
        # mesh's own (one entry of 49,089 on one device at step 2, measured), so a few counts may differ.
        assert all(z >= padded_rows and abs(z - z1) <= 2 for z, (_, z1) in zip(zeros, one)), (mesh, values, one)


def test_printed_as_megatron_prints_them():
    record = {"step": 10, "lr": 1e-3, "loss": 2.5, "loss_scale": 1.0, "grad_norm": 0.5, "params_norm": 123.4567,
              "num_zeros": 16384.0}
    line = log_line(record, 100, 32)
    assert "| grad norm: 0.500 | num zeros: 16384.0 | params norm: 123.457 | number of skipped" in line
    del record["params_norm"], record["num_zeros"]
    assert "norm: 0.500 | number of skipped" in log_line(record, 100, 32)


def test_only_scalar_reductions_are_added_to_the_step():
    def step_collectives(**flags):
        cfg = TINY.replace(data_parallel_size=2, tensor_model_parallel_size=2, **flags).validate(8)
        mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
        step = TrainStep.build(cfg, mesh)
        tokens = jax.ShapeDtypeStruct((cfg.training.global_batch_size, cfg.model.seq_length + 1), np.int32,
                                      sharding=step.model.batch_sharding)
        hlo = jax.jit(step._train_step).lower(step.abstract_state(), tokens).compile(
            compiler_options=audit._NO_COMBINER).as_text()  # each reduction on its own
        return Counter(collectives(hlo, dict(mesh.shape)))

    off = step_collectives(log_params_norm=False, log_num_zeros_in_grad=False)
    added = step_collectives() - off
    assert not off - step_collectives()  # nothing the step did is gone
    assert added and all(kind == "all-reduce" and elements == 1 for kind, _, elements in added), added
