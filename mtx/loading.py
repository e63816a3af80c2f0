"""Loading a trained model for evaluation, generation and conversion, on any mesh that fits it."""

from __future__ import annotations

from typing import Any

import jax

from mtx.checkpoint import KEPT_FOR_INFERENCE, Checkpointer
from mtx.config import Config
from mtx.parallel.mesh import make_mesh
from mtx.sharded_model import ShardedModel
from mtx.state import abstract_state


def load_model(load: str, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               data_parallel_size: int = -1, ckpt_step: int | None = None, **overrides: Any):
    """(model, params) of the checkpoint in `load` (the newest intact step unless ckpt_step), laid out on a fresh
    mesh of the given sizes. The model is the checkpoint's own; dropout is off; `overrides` may set other fields (e.g.
    micro_batch_size, bf16). One-line ValueError for a missing checkpoint or a mesh that does not fit."""
    ckpt = Checkpointer(load)
    try:
        step, _ = ckpt.intact_step(ckpt_step, load)  # the newest intact step (callers say which they passed over)
        cfg = inference_config(ckpt.saved_config(step)).replace(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size, data_parallel_size=data_parallel_size,
            **overrides)
        layers, pp = cfg.model.num_layers, pipeline_model_parallel_size
        if layers % pp:  # (training's uneven layouts are not taken here: the flags say what evaluation takes)
            raise ValueError(f"--load {load} holds {layers} layers, which do not split evenly over "
                             f"--pipeline-model-parallel-size {pp}; pass a size that divides {layers}.")
        cfg = _fit_batch(cfg).validate(len(jax.devices()))
        p = cfg.parallel
        model = ShardedModel(cfg, make_mesh(p.data_parallel_size, p.pipeline_model_parallel_size,
                                            p.tensor_model_parallel_size))
        state = ckpt.restore(abstract_state(model), cfg, step=step)
    finally:
        ckpt.close()
    return model, state.params


def inference_config(saved: Config) -> Config:
    """The config to evaluate `saved`'s model with: its model with dropout off, the fields KEPT_FOR_INFERENCE, and
    defaults elsewhere."""
    kept = {name: saved.value(name) for name in KEPT_FOR_INFERENCE}
    return Config(model=saved.model).replace(hidden_dropout=0.0, attention_dropout=0.0, **kept)


def _fit_batch(cfg: Config) -> Config:
    """A global batch the new mesh can split (training's batch sizes do not matter for inference)."""
    p, t = cfg.parallel, cfg.training
    dp = cfg.data_parallel_size(len(jax.devices()))
    return cfg.replace(global_batch_size=t.micro_batch_size * dp * max(p.pipeline_model_parallel_size, 1))
