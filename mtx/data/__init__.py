"""Data: tokenizers, the built-in corpus, token datasets (text, .npy, Megatron .bin/.idx), blends, and their batches
(the same global batch on every mesh)."""

from mtx.data.bert_dataset import BertDataset
from mtx.data.blend import BlendedDataset
from mtx.data.build import build_dataset, say_what_data_overrides
from mtx.data.dataset import GPTDataset, builtin_corpus, check_token_ids
from mtx.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtx.data.paths import parse_data_path
from mtx.data.tokenizer import (TOKENIZER_TYPES, BertWordPieceTokenizer, ByteTokenizer, GPT2Tokenizer, Tokenizer,
                                build_tokenizer)

__all__ = ["BertDataset", "BlendedDataset", "build_dataset", "parse_data_path", "GPTDataset", "builtin_corpus",
           "check_token_ids", "IndexedDataset", "IndexedDatasetWriter", "TOKENIZER_TYPES", "BertWordPieceTokenizer",
           "ByteTokenizer", "GPT2Tokenizer", "Tokenizer", "build_tokenizer", "say_what_data_overrides"]
