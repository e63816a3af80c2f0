"""mtx: Megatron-LM's tensor, pipeline and data parallelism as one SPMD program over a JAX mesh.

The public names: the config schema, the mesh, the GPT model, the compiled train step and the training loop.
The parallel building blocks (f, g, parallel layers, vocab-parallel loss) live in `mtx.parallel`.
"""

from mtx.config import Config, DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig, load_preset
from mtx.models.gpt import GPT
from mtx.parallel.mesh import make_mesh
from mtx.run import train
from mtx.step import Trainer, TrainState

__all__ = ["Config", "DataConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainingConfig",
           "load_preset", "GPT", "make_mesh", "train", "Trainer", "TrainState"]
