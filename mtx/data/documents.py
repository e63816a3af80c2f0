"""Megatron's document flags for packed GPT samples: --eod-mask-loss, --reset-position-ids, --reset-attention-mask.

A GPT sample is a window of the token stream, so it may hold the end of one document, an end-of-document (EOD)
token, and the start of the next. By default the model reads such a window as one text (Megatron's default too).
The flags make it see the documents apart, computed on the host from the window's input tokens (as Megatron's
`get_ltor_masks_and_position_ids`), and the batch becomes a dict of (G, S) fields beside the (G, S + 1) tokens:

  loss_mask     --eod-mask-loss: 0 where the input token is EOD (its target is the next document's first token), 1
                elsewhere; the step's loss is the mean over the 1s (mtx/objectives.py)
  position_ids  --reset-position-ids: 0, 1, 2, ... restarting after each EOD
  segments      --reset-attention-mask: 1 + the EODs before each token (an EOD ends its own document); attention
                stays within a segment (mtx/models/transformer.py), a block-diagonal causal mask

The fields depend only on the tokens, so the batch stays the same on every mesh.
"""

from __future__ import annotations

import numpy as np

FIELDS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")


def document_fields(tokens_GS1: np.ndarray, eod: int, *, eod_mask_loss: bool = False,
                    reset_position_ids: bool = False, reset_attention_mask: bool = False) -> dict[str, np.ndarray]:
    """(G, S + 1) token windows -> {"tokens", and the fields the flags ask for}, each (G, S) but the tokens."""
    inputs_GS = tokens_GS1[:, :-1]
    is_eod_GS = inputs_GS == eod
    batch = {"tokens": tokens_GS1}
    if eod_mask_loss:
        batch["loss_mask"] = (~is_eod_GS).astype(np.float32)
    if reset_position_ids:
        s = inputs_GS.shape[1]
        index_GS = np.broadcast_to(np.arange(s), inputs_GS.shape)
        starts_GS = np.zeros_like(is_eod_GS)
        starts_GS[:, 0] = True
        starts_GS[:, 1:] = is_eod_GS[:, :-1]  # a document starts after each EOD
        start_GS = np.maximum.accumulate(np.where(starts_GS, index_GS, 0), axis=1)
        batch["position_ids"] = (index_GS - start_GS).astype(np.int32)
    if reset_attention_mask:
        batch["segments"] = (1 + np.cumsum(is_eod_GS, axis=1) - is_eod_GS).astype(np.int32)
    return batch


class DocumentBatches:
    """A GPT dataset whose batches carry the document fields the config's flags ask for (everything else, such as
    `num_samples` and `tokenizer`, is the wrapped dataset's)."""

    def __init__(self, dataset, data_cfg):
        self.dataset = dataset
        self.flags = {name: getattr(data_cfg, name) for name in FIELDS}

    def batch(self, split: str, index: int, batch_size: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        return document_fields(self.dataset.batch(split, index, batch_size, rows), self.dataset.tokenizer.eod,
                               **self.flags)

    def __getattr__(self, name):  # only for names this class lacks
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
