"""Models built from the tensor-parallel layers: the transformer layer, GPT and BERT."""

from mtx.models.bert import BERT
from mtx.models.gpt import GPT
from mtx.models.transformer import ParallelMLP, ParallelSelfAttention, TransformerLayer

__all__ = ["BERT", "GPT", "TransformerLayer", "ParallelSelfAttention", "ParallelMLP"]
