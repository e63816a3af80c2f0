"""Models built from the tensor-parallel layers: the transformer layer, the layer stack, GPT and BERT."""

from mtx.models.bert import BERT
from mtx.models.gpt import GPT
from mtx.models.stack import ParallelTransformer
from mtx.models.transformer import ParallelMLP, ParallelSelfAttention, TransformerLayer

__all__ = ["BERT", "GPT", "ParallelTransformer", "TransformerLayer", "ParallelSelfAttention", "ParallelMLP"]
