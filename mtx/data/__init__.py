"""Data: tokenizers, the built-in corpus, token datasets and their batches (the same global batch on every mesh)."""

from mtx.data.dataset import GPTDataset, build_dataset, builtin_corpus, check_token_ids
from mtx.data.tokenizer import ByteTokenizer, GPT2Tokenizer, Tokenizer, build_tokenizer

__all__ = ["GPTDataset", "build_dataset", "builtin_corpus", "check_token_ids", "ByteTokenizer", "GPT2Tokenizer",
           "Tokenizer", "build_tokenizer"]
