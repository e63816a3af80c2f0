"""Models built from the tensor-parallel layers: the transformer layer and GPT."""

from mtx.models.gpt import GPT
from mtx.models.transformer import ParallelMLP, ParallelSelfAttention, TransformerLayer

__all__ = ["GPT", "TransformerLayer", "ParallelSelfAttention", "ParallelMLP"]
