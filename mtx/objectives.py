"""What each model family trains on: how a step's batch becomes one scalar loss, in pieces the step can schedule.

A batch is a pytree of arrays whose leading axis is the global batch (split over "data"): GPT's is one (G, S + 1)
token array, BERT's a dict of (G, S) / (G,) fields. An objective splits the loss into the pieces the training step
needs, so that plain gradient accumulation and the pipeline schedule run any family the same way:

  check_batch(batch)          on the host, before the batch is placed: refuses one the loss cannot take (BERT)
  normalizers(batch)          the step's global counts (inside shard_map, from this data rank's share)
  for_evaluation()            the same objective as evaluation scores it (GPT: no label smoothing)
  embed(model, mb, keys_B)    the first stage: (B, S, D) embeddings of a microbatch
  attention_mask(mb)          (B, S) padding mask that travels with the microbatch through the stages, or None
  head_loss(model, x, mb, n)  the last layer's output -> this microbatch's share of the step's loss (already
                              divided by the step's global counts, so summing over microbatches, data ranks and
                              pipeline stages gives the step's loss)

All of it but check_batch runs in the local view inside the step's shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtx.config import Config
from mtx.parallel.mesh import DATA


class NextTokenPrediction:
    """GPT: a (B, S + 1) token window per sequence; the loss is the mean next-token cross-entropy over every token
    of the step.

    With Megatron's document flags the batch is a dict (mtx/data/documents.py): "tokens" and any of "loss_mask"
    (the mean is then over the tokens it weights, counted over the whole step), "position_ids" (the embedding's
    positions) and "segments" (the attention mask: no attention across documents).
    """

    # 1F1B may spread the head over the stages by vocabulary (`head_loss`'s pipeline_share): the loss is the output
    # layer's logits' cross-entropy alone (mtx/parallel/one_f_one_b.py)
    head_spreads_over_stages = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def for_evaluation(self):
        return NextTokenPrediction()  # the plain cross-entropy: validation loss and perplexity are comparable

    def check_batch(self, batch) -> None:
        """Any token window is a batch."""

    def normalizers(self, batch):
        """Predicted (loss-weighted) tokens of the whole batch; without a loss mask a static count (every data rank
        holds the same number of rows)."""
        if isinstance(batch, dict) and "loss_mask" in batch:
            return jnp.maximum(jax.lax.psum(batch["loss_mask"].astype(jnp.float32).sum(), DATA), 1.0)
        tokens = _tokens(batch)
        return jax.lax.psum(tokens.shape[0], DATA) * (tokens.shape[-1] - 1)

    def embed(self, model, batch, keys_B):
        positions_BS = batch.get("position_ids") if isinstance(batch, dict) else None
        return model.embed(_tokens(batch)[:, :-1], keys_B=keys_B, positions_BS=positions_BS)

    def attention_mask(self, batch):
        return batch.get("segments") if isinstance(batch, dict) else None

    def head_loss(self, model, x_BSD, batch, n_tokens, weight_B=None, pipeline_share=False):
        """weight_B: 0 for padding sequences (pipeline loss shares), which then count nothing. pipeline_share: this
        pipeline stage computes the logits of its 1 / P of the vocabulary (the loss is still the whole one)."""
        per_token = model.head_loss(x_BSD, _tokens(batch)[:, 1:], label_smoothing=self.label_smoothing,
                                    pipeline_share=pipeline_share)
        if isinstance(batch, dict) and "loss_mask" in batch:
            per_token = per_token * batch["loss_mask"].astype(per_token.dtype)
        if weight_B is not None:
            per_token = jnp.where(weight_B[:, None] > 0, per_token, 0.0)
        return per_token.sum() / n_tokens


def _tokens(batch):
    """GPT's (B, S + 1) token windows, of a plain batch or of one with document fields."""
    return batch["tokens"] if isinstance(batch, dict) else batch


class MaskedLMAndSentenceOrder:
    """BERT (paper section 4.2): masked-LM loss averaged over the step's masked tokens, plus the sentence-order loss
    averaged over the step's sequences (when the binary head is on), as Megatron's BERT loss.

    Batch fields (Megatron's BERT dataset): text, types, padding_mask, labels, loss_mask (B, S); is_random (B,).
    """

    head_spreads_over_stages = False  # its heads (masked LM, sentence order) run on the last stage

    def __init__(self, cfg: Config):
        self.binary_head, self.mlm_positions = cfg.model.bert_binary_head, cfg.mlm_positions

    def for_evaluation(self):
        return self

    def normalizers(self, batch):
        masked = jax.lax.psum(batch["loss_mask"].astype(jnp.float32).sum(), DATA)
        sequences = jax.lax.psum(batch["loss_mask"].shape[0], DATA)
        return {"masked": jnp.maximum(masked, 1.0), "sequences": sequences}

    def embed(self, model, batch, keys_B):
        return model.embed(batch["text"], batch["types"], keys_B=keys_B)

    def check_batch(self, batch) -> None:
        """A host batch with more masked positions in a sequence than the masked-LM head runs at is refused (its
        loss would leave the rest out); BERT's dataset never makes one."""
        mask = batch.get("loss_mask") if isinstance(batch, dict) else None
        if self.mlm_positions is None or mask is None:
            return
        if isinstance(mask, jax.Array) and not mask.is_fully_addressable:
            return  # a global array of several processes: checked where its rows were built
        most = int(np.max(np.sum(np.asarray(mask) > 0, axis=1), initial=0))
        if most > self.mlm_positions:
            raise ValueError(f"a BERT batch masks {most} positions of one sequence, more than the "
                             f"{self.mlm_positions} the masked-LM head runs at (round-up(--mask-prob x "
                             "--seq-length)); pass the data's --mask-prob, or --mlm-head-positions all.")

    def attention_mask(self, batch):
        return batch["padding_mask"]

    def head_loss(self, model, x_BSD, batch, counts, weight_B=None):
        labels_BS, loss_mask_BS = batch["labels"], batch["loss_mask"]
        if self.mlm_positions is None:  # the MLM head at every position, as Megatron
            mlm_BS, sop_B = model.head_losses(x_BSD, labels_BS, batch["is_random"])
        else:  # only at the (at most K) masked positions of each sequence: (B, K) losses and mask in place of (B, S)
            at_BK, loss_mask_BS = masked_positions(loss_mask_BS, self.mlm_positions)
            mlm_BS, sop_B = model.head_losses(x_BSD, jnp.take_along_axis(labels_BS, at_BK, axis=1),
                                              batch["is_random"], positions_BK=at_BK)
        loss_mask_BS = loss_mask_BS.astype(jnp.float32)
        weight_B = jnp.ones(sop_B.shape, jnp.float32) if weight_B is None else weight_B.astype(jnp.float32)
        loss = jnp.sum(jnp.where(loss_mask_BS * weight_B[:, None] > 0, mlm_BS, 0.0)) / counts["masked"]
        if self.binary_head:
            loss = loss + jnp.sum(sop_B * weight_B) / counts["sequences"]
        return loss


def masked_positions(loss_mask_BS, k: int):
    """(B, S) 0/1 loss mask -> (B, K) the first K masked positions of each sequence and (B, K) 0/1 which of them are
    real (a sequence with fewer than K masked positions fills the rest with position 0, marked 0). K must be at least
    the most positions any sequence masks (`Config.mlm_positions`: BERT's dataset never masks more)."""
    at_BK = jax.vmap(lambda row_S: jnp.nonzero(row_S, size=k, fill_value=0)[0])(loss_mask_BS)
    real_BK = jnp.arange(k)[None, :] < jnp.sum(loss_mask_BS > 0, axis=1, keepdims=True)
    return at_BK.astype(jnp.int32), real_BK.astype(loss_mask_BS.dtype)


def objective_for(cfg: Config):
    """The objective of the config's model family."""
    return MaskedLMAndSentenceOrder(cfg) if cfg.model.is_bert else NextTokenPrediction(cfg.model.label_smoothing)


def micro_loss(objective, model, batch_B, counts, keys_B=None):
    """One microbatch through every layer (no pipeline): its share of the step's loss."""
    x_BSD = objective.embed(model, batch_B, keys_B)
    x_BSD = model.transform(x_BSD, mask_BS=objective.attention_mask(batch_B), keys_B=keys_B)
    return objective.head_loss(model, x_BSD, batch_B, counts)
