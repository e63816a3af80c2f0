"""Tensor parallelism: the mesh, Megatron's f/g operators (and sequence parallelism's), parallel layers, vocab-parallel
loss, dropout RNG."""

from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.layers import ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from mtx.parallel.mesh import AXES, DATA, MODEL, PIPELINE, make_mesh
from mtx.parallel.ops import (f, g, gather_from_model_parallel, gather_from_sequence_parallel,
                              reduce_scatter_to_sequence_parallel, scatter_to_model_parallel)
from mtx.parallel.random import dropout

__all__ = ["AXES", "DATA", "MODEL", "PIPELINE", "make_mesh", "f", "g", "gather_from_model_parallel",
           "scatter_to_model_parallel", "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "LayerNorm", "RMSNorm", "vocab_parallel_cross_entropy", "dropout"]
