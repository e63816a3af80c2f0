"""mtx: Megatron-LM's tensor, pipeline and data parallelism as one SPMD program over a JAX mesh.

The public names: the config schema, the mesh, the GPT and BERT models, the sharded model handle, the compiled train
step and its state, and the training loop.
The parallel building blocks (f, g, parallel layers, vocab-parallel loss) live in `mtx.parallel`. Names load on
first use, so `import mtx.data` (e.g. in a preprocessing worker) does not pay for JAX.
"""

import importlib

_WHERE = {
    "Config": "mtx.config", "DataConfig": "mtx.config", "ModelConfig": "mtx.config", "OptimizerConfig": "mtx.config",
    "ParallelConfig": "mtx.config", "TrainingConfig": "mtx.config", "load_preset": "mtx.presets",
    "GPT": "mtx.models.gpt", "BERT": "mtx.models.bert", "ParallelTransformer": "mtx.models.stack",
    "make_mesh": "mtx.parallel.mesh", "ShardedModel": "mtx.sharded_model", "TrainStep": "mtx.step",
    "TrainState": "mtx.state", "train": "mtx.run",
}
__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mtx' has no attribute {name!r}")
