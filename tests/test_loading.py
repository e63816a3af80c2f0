"""Loading a trained model for evaluation, generation and conversion (mtx/loading.py): the saved model on any mesh,
whatever the run that saved it chose."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from mtx.checkpoint import MANIFEST
from mtx.config import Config, load_preset
from mtx.loading import load_model
from mtx.run import train

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT at step 0, saved from one device."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    train(Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
        train_iters=0, save=str(path), tensor_model_parallel_size=1, data_parallel_size=1), progress=False)
    return path


TRAINING_CHOICES = {  # a run's choices no other mesh need allow: what a saved config may hold besides its model
    "parallel": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
                     sequence_parallel=True, tp_comm_overlap=True, pipeline_schedule="interleaved",
                     virtual_pipeline_model_parallel_size=2, overlap_grad_reduce=True, overlap_param_gather=True,
                     use_distributed_optimizer=True, num_processes=2, process_id=1,
                     coordinator_address="10.0.0.1:1234"),
    "training": dict(finetune=True, use_checkpoint_args=True, load="elsewhere", ckpt_step=7, profile=True,
                     global_batch_size=64, exit_interval=3),
    "data": dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, data_path=["nowhere"]),
}


def test_a_checkpoint_loads_on_any_mesh_whatever_its_run_chose(checkpoint, tmp_path):
    """load_model takes the model and tokenizer of the saved config, not its run's parallel, data and checkpoint
    choices: an interleaved, sequence-parallel, overlapped, multi-process run's checkpoint loads on one device (was
    refused: --tp-comm-overlap without the sequence parallelism it had turned off) and on TP 2 x PP 2."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    (path / "0" / MANIFEST).unlink()  # the record of the step's file sizes: the config below is edited
    metadata = path / "0" / "config" / "metadata"
    saved = json.loads(metadata.read_text())
    for section, fields in TRAINING_CHOICES.items():
        saved[section].update(fields)
    metadata.write_text(json.dumps(saved))
    _, expected = load_model(str(checkpoint), data_parallel_size=1)
    for tp, pp in ((1, 1), (2, 2)):
        model, params = load_model(str(path), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        p = model.cfg.parallel
        assert (p.sequence_parallel, p.tp_comm_overlap, p.virtual_pipeline_model_parallel_size, p.num_processes,
                model.cfg.training.load, model.cfg.data.reset_attention_mask) == (False, False, None, None, None, False)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
