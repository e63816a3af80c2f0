"""Shared by the Hugging Face converters (mtx/convert.py, mtx/convert_llama.py): a config.json's values validated as
train.py's flags are, the vocabulary padded with zero rows, and refusals in one line (a ValueError that
`python -m mtx.convert` prints, exit status 2). Its own module so that the two converters import it, not each
other."""

from __future__ import annotations

import re

import numpy as np

from mtx.config import Config

# Tensors saved beside the weights that are no weights, dropped by both converters: older transformers' GPT-2 causal
# masks (uint8 or bool) and Llama's rotary frequencies (they follow from rope_theta).
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def check(ok: bool, message: str) -> None:
    """Refuses with `message` (one line naming the key or flag and the fix) unless `ok`."""
    if not ok:
        raise ValueError(message)


def validated(values: dict, hf_keys: dict[str, str], seed: int | None) -> Config:
    """The Config of `values`, validated as train.py's flags are; a refusal names config.json's key (`hf_keys`: flag
    -> key), not the flag."""
    if seed is not None:
        values["seed"] = seed
    try:
        return Config().replace(**values).validate()
    except ValueError as e:
        message = str(e)
        for flag, key in hf_keys.items():
            message = message.replace(flag, key)
        # a value's refusal names train.py's way to fix it; here there is no flag, only the file
        message = re.sub(r"; fix the flag or the config file's \w+\.$", "; fix config.json.", message)
        raise ValueError(f"config.json: {message}") from None


def padded(table: np.ndarray, padded_vocab_size: int) -> np.ndarray:
    """(V, D) -> (padded_vocab_size, D) with zero rows: no token maps there, and their logits are 0."""
    return np.concatenate([table, np.zeros((padded_vocab_size - table.shape[0], table.shape[1]), np.float32)])
