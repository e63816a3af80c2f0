"""Loading a trained model for evaluation, generation and conversion (mtx/loading.py): the saved model on any mesh,
whatever the run that saved it chose."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from mtx.checkpoint import MANIFEST
from mtx.config import Config
from mtx.loading import load_model
from mtx.presets import load_preset
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


def test_eval_precision_flags_replace_the_checkpoints(checkpoint, tmp_path):
    """eval.py's --bf16 / --no-bf16 replace the saved precision, fp16 included (--bf16 on an fp16 checkpoint was
    refused naming --fp16, which eval.py does not take; --no-bf16 was ignored); without them the checkpoint's."""
    import importlib.util

    from mtx.eval_tasks import prepare

    spec = importlib.util.spec_from_file_location("eval_script", ROOT / "eval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    (path / "0" / MANIFEST).unlink()
    metadata = path / "0" / "config" / "metadata"
    saved = json.loads(metadata.read_text())
    saved["training"].update(fp16=True)
    metadata.write_text(json.dumps(saved))
    for flags, dtype in (([], "float16"), (["--bf16"], "bfloat16"), (["--no-bf16"], "float32")):
        args = script.build_parser().parse_args(["generate", "--load", str(path), "--prompt", "hi", *flags])
        model, _ = prepare(args)[0]()
        assert model.cfg.training.compute_dtype == dtype, flags
