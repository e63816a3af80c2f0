"""Zero-shot evaluation (Megatron-LM paper, appendix E): WikiText perplexity and LAMBADA accuracy, on any mesh.

The core is one scoring function built from a ShardedModel (mtx/sharded_model.py): inside a single shard_map over
the (data, pipeline, model) mesh it maps (B, S) input ids, targets and a 0/1 mask to per-token NLL and "target is the
argmax" flags. Logits stay split over "model" (B, S, V / tp): the loss is the vocab-parallel cross-entropy of
training, and the argmax is found from two B*S reductions (pmax, then pmin of the lowest id reaching it), never by
gathering B*S*V logits. Batches are split over "data" and always have one fixed (B, S) shape, so the program compiles
once per task.

The tasks are host-side arithmetic over that function: which tokens each window or example scores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtx.files import read_text
from mtx.parallel.compat import all_gather_invariant
from mtx.parallel.cross_entropy import vocab_parallel_cross_entropy
from mtx.parallel.mesh import BATCH, DATA, MODEL
from mtx.parallel.ops import model_rank

# A host-side scorer: (B, S) inputs, targets, mask -> (B, S) float NLL, (B, S) bool "target is the argmax".
ScoreFn = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


# ---- inside shard_map ----
def vocab_parallel_argmax(logits_BSV, vocab_size: int):
    """(B, S) global argmax id from this rank's logits slice (B, S, V / tp), replicated over "model".

    Padded vocabulary ids (>= vocab_size) never win. Ties go to the lowest id, as jnp.argmax breaks them: the global
    max m = pmax of the per-rank maxima, and the answer is the pmin over ranks of the lowest id whose logit equals m
    (ranks that hold no such id offer vocab_size, which loses to any real one).
    """
    z = logits_BSV.astype(jnp.float32)
    v_local = z.shape[-1]
    ids_V = model_rank() * v_local + jnp.arange(v_local)
    z = jnp.where(ids_V < vocab_size, z, -jnp.inf)
    m_BS = jax.lax.pmax(z.max(-1), MODEL)
    first_BS = jnp.min(jnp.where(z == m_BS[..., None], ids_V, vocab_size), axis=-1)
    return jax.lax.pmin(first_BS, MODEL)


def make_scorer(model):
    """jitted (params, inputs_BS, targets_BS, mask_BS) -> (nll_BS float32, correct_BS bool), split over "data".

    params are the model's global (stored) parameters. Masked positions give 0 and False. The model is causal and
    batches are right-padded, so padding never changes a real position and the model needs no attention mask.
    """
    vocab_size = model.cfg.model.vocab_size

    def local(params, inputs_BS, targets_BS, mask_BS):
        hidden_BSD = model.local_final_hidden(params, inputs_BS)
        logits_BSV = model.merge(params).attend(hidden_BSD)  # this rank's vocab slice
        nll_BS = vocab_parallel_cross_entropy(logits_BSV, targets_BS, vocab_size=vocab_size)
        correct_BS = vocab_parallel_argmax(logits_BSV, vocab_size) == targets_BS
        real_BS = mask_BS > 0
        # Every row to every device, so that each process of a multi-host run reads all of them.
        return (all_gather_invariant(jnp.where(real_BS, nll_BS, 0.0), DATA, axis=0),
                all_gather_invariant(correct_BS & real_BS, DATA, axis=0))

    sharded = jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, BATCH, BATCH, BATCH),
                            out_specs=(P(), P()), check_vma=True)
    return jax.jit(lambda params, inputs, targets, mask: sharded(model.forward_params(params), inputs, targets, mask))


class Scorer:
    """Host batches of up to `batch_size` rows -> numpy (nll, correct); pads the rows to the one compiled shape."""

    def __init__(self, model, params, batch_size: int | None = None, *, most: int | None = None):
        """most: the rows there are to score; no batch is compiled larger (--micro-batch-size 100000 for 13 windows
        allocated 52 GB once)."""
        dp = model.mesh.shape[DATA]
        size = batch_size or model.cfg.training.micro_batch_size * dp
        size = size if most is None else max(1, min(size, most))
        # Every data rank gets the same number of rows, which sequence parallelism splits over the model ranks.
        rows = dp * (model.mesh.shape[MODEL] if model.cfg.sequence_parallel else 1)
        self.batch_size = math.ceil(size / rows) * rows
        self.model, self.params, self._fn = model, params, make_scorer(model)

    def __call__(self, inputs_BS, targets_BS, mask_BS):
        n = inputs_BS.shape[0]
        if n > self.batch_size:
            raise ValueError(f"{n} rows exceed the scorer's batch size {self.batch_size}.")
        pad = [(0, self.batch_size - n), (0, 0)]
        arrays = [self.model.put_batch(np.pad(np.asarray(a, np.int32), pad))
                  for a in (inputs_BS, targets_BS, mask_BS)]
        nll, correct = jax.device_get(self._fn(self.params, *arrays))
        return np.asarray(nll)[:n], np.asarray(correct)[:n]


# ---- WikiText: overlapping windows ----
def num_windows(num_tokens: int, seq_length: int, overlap: int) -> int:
    """Windows needed to score targets 1 .. T-1: the first scores S of them, each later one `overlap` more."""
    targets = num_tokens - 1
    return 0 if targets <= 0 else 1 + max(0, math.ceil((targets - seq_length) / overlap))


def window(tokens: Sequence[int], i: int, seq_length: int, overlap: int):
    """Window i: (S,) inputs, targets and mask. It starts at token i * overlap and holds up to S + 1 tokens (the tail
    window fewer: right-padded, mask 0). Window 0 scores all its targets, later ones only their last `overlap`
    positions, which are exactly the targets the previous window did not reach."""
    chunk = np.asarray(tokens[i * overlap: i * overlap + seq_length + 1], np.int32)
    n = len(chunk) - 1  # real targets in this window
    inputs, targets = np.zeros((2, seq_length), np.int32)
    inputs[:n], targets[:n] = chunk[:-1], chunk[1:]
    pos = np.arange(seq_length)
    mask = (pos < n) & ((pos >= seq_length - overlap) if i > 0 else True)
    return inputs, targets, mask.astype(np.int32)


def wikitext_perplexity(score: ScoreFn, batch_size: int, tokens: Sequence[int], *, seq_length: int, overlap: int,
                        original_tokens: int, progress: bool = True) -> dict:
    """Loss and perplexities of a token stream (the paper's overlapping-window evaluation).

    loss = total NLL / scored targets (T - 1); ppl = exp(loss); adjusted_ppl = exp(total NLL / T_o), the perplexity
    per original word-level token, comparable across tokenizers (Megatron's script divides by T_o - 1 instead: the
    difference is negligible for any real test set).
    """
    n = num_windows(len(tokens), seq_length, overlap)
    total, scored = 0.0, 0
    for first in _bar(range(0, n, batch_size), progress, "wikitext", unit="batch"):
        inputs, targets, mask = map(np.stack, zip(*(window(tokens, i, seq_length, overlap)
                                                    for i in range(first, min(n, first + batch_size)))))
        nll, _ = score(inputs, targets, mask)
        total += float(nll.astype(np.float64)[mask > 0].sum())
        scored += int(mask.sum())
    assert scored == max(len(tokens) - 1, 0), (scored, len(tokens))
    loss = total / max(scored, 1)
    return {"original_tokens": original_tokens, "tokens": len(tokens), "scored_tokens": scored, "windows": n,
            "seq_length": seq_length, "overlapping_eval": overlap, "loss": loss, "ppl": perplexity(loss),
            "adjusted_ppl": perplexity(total / max(original_tokens, 1))}


# ---- LAMBADA: the last word, every subword the argmax ----
def lambada_split(text: str) -> tuple[str, str]:
    """(context, target): the text without its last word, and " " + last word (tokenized as a continuation)."""
    words = text.split()
    if not words:
        raise ValueError("a LAMBADA example has no text; every line needs {\"text\": ...} with at least one word.")
    last = words[-1]
    return text[: text.rfind(last)].strip(), " " + last


def lambada_tokens(tokenizer, text: str) -> tuple[list[int], int]:
    """(ids, k): the example's token ids, whose last k are the target word's subwords.

    Megatron encodes the context and " " + last word apart and joins the ids; any tokenizer encodes context + " " +
    last word here, whole, and the target is what follows the longest prefix those ids share with the context's own.
    For GPT-2's BPE, which never joins a space-led word to what precedes it, these are the same ids; a tokenizer that
    marks word starts itself (SentencePiece's "▁", prepended to every text) would give " word" alone one "▁" too many.
    Where the context's last tokens merge with the word, they count as the word's. When no token of the context is
    left before the word (an empty context), the end-of-document token precedes it: the first subword needs
    something to be predicted from."""
    context, target = lambada_split(text)
    ids, context_ids = tokenizer.encode(context + target), tokenizer.encode(context)
    shared = next((i for i, (a, b) in enumerate(zip(ids, context_ids)) if a != b), min(len(ids), len(context_ids)))
    if shared == len(ids):
        raise ValueError(f"the LAMBADA target {target.strip()!r} encodes to no token of its own.")
    return ([tokenizer.eod] if shared == 0 else []) + ids, len(ids) - shared


def _lambada_example(ids: Sequence[int], k: int, seq_length: int):
    """(S,) inputs, targets and mask of one example's ids; the mask covers the last k targets (the target word).
    A context longer than the window loses its oldest tokens."""
    if k > seq_length:
        raise ValueError(f"a LAMBADA target word has {k} tokens, more than --seq-length {seq_length}.")
    ids = list(ids)[-(seq_length + 1):]
    n = len(ids) - 1
    inputs, targets, mask = np.zeros((3, seq_length), np.int32)
    inputs[:n], targets[:n] = ids[:-1], ids[1:]
    mask[n - k: n] = 1
    return inputs, targets, mask


def lambada_accuracy(score: ScoreFn, batch_size: int, tokenizer, texts: Sequence[str], *, seq_length: int,
                     progress: bool = True, examples: Sequence[tuple[list[int], int]] | None = None) -> dict:
    """Fraction of examples whose last word is predicted exactly: every one of its subword tokens is the argmax
    under teacher forcing. Rows use the shortest window (a multiple of 8, at most seq_length) that fits them all,
    the same for every batch, so the scorer compiles once. `examples`: the texts' `lambada_tokens`, where the caller
    has them already (eval.py checks them before loading the model)."""
    examples = examples if examples is not None else [lambada_tokens(tokenizer, t) for t in texts]
    s = min(seq_length, 8 * math.ceil(max((len(ids) - 1 for ids, _ in examples), default=1) / 8))
    correct, nll_sum, target_tokens = 0, 0.0, 0
    for first in _bar(range(0, len(examples), batch_size), progress, "lambada", unit="batch"):
        inputs, targets, mask = map(np.stack, zip(*(_lambada_example(ids, k, s)
                                                    for ids, k in examples[first: first + batch_size])))
        nll, hit = score(inputs, targets, mask)
        correct += int(np.sum(np.all(hit | (mask == 0), axis=1)))
        nll_sum += float(nll.astype(np.float64)[mask > 0].sum())
        target_tokens += int(mask.sum())
    n = len(examples)
    return {"accuracy": correct / n if n else 0.0, "n": n, "correct": correct, "target_tokens": target_tokens,
            "target_loss": nll_sum / max(target_tokens, 1), "seq_length": s,
            "truncated": sum(len(ids) - 1 > s for ids, _ in examples)}


# ---- reading the data ----
def read_wikitext(path: str | Path, tokenizer, *, detokenize: bool = True) -> tuple[list[int], int]:
    """(tokens, T_o) of a WikiText file: T_o counted on the raw text, tokens after detokenization."""
    from mtx.data.detokenize import count_original_tokens, wikitext_detokenize

    text = _read_text(path)
    if not text.strip():  # a perplexity of whitespace (original_tokens 1 once)
        raise ValueError(f"--data-path {path} holds only whitespace; pass the WikiText file with its text.")
    first = text.lstrip().split("\n", 1)[0]
    if first.startswith("{") and _is_json_text(first):
        raise ValueError(f"--data-path {path} is JSON lines (LAMBADA's format), not WikiText; run eval.py lambada "
                         "with it, or pass WikiText's .tokens file.")
    original = count_original_tokens(text)
    return tokenizer.encode(wikitext_detokenize(text) if detokenize else text), original


def _is_json_text(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):  # RecursionError: a line of thousands of nested brackets
        return False


def read_lambada(path: str | Path) -> list[str]:
    """The texts of a LAMBADA .jsonl file (one {"text": ...} a line, as OpenAI released it)."""
    texts = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            lambada_split(text)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"--data-path {path} line {number} is not a JSON object with a non-empty \"text\"; "
                             "pass LAMBADA in the GPT-2 .jsonl format.") from None
        texts.append(text)
    if not texts:
        raise ValueError(f"--data-path {path} holds no examples; pass LAMBADA in the GPT-2 .jsonl format.")
    return texts


def _read_text(path: str | Path) -> str:
    return read_text(path, "--data-path", "pass the evaluation data as UTF-8 text (WikiText's .tokens file, LAMBADA's "
                     ".jsonl).")


def perplexity(loss: float) -> float:
    """exp(loss); inf past a float's range, NaN for NaN (a diverged run's: metrics.jsonl writes either as null)."""
    return float("inf") if loss >= 700 else math.exp(loss)


def _bar(items: Iterable, enabled: bool, desc: str, **kw):
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=not enabled, dynamic_ncols=True, **kw)


# ---- what the checkpoint says ----
def checkpoint_config(load: str, ckpt_step: int | None = None):
    """The resolved Config saved with a checkpoint (no arrays are read); one-line ValueError if there is none."""
    from mtx.checkpoint import saved_step

    return saved_step(load, ckpt_step, "--save (or by `python -m mtx.convert from-hf`)")[1]


def checkpoint_tokenizer(cfg, vocab_file: str | None = None, merge_file: str | None = None,
                         tokenizer_type: str | None = None, tokenizer_model: str | None = None):
    """The tokenizer the flags name (any of them given), else the one the checkpoint was trained with (GPT-2 BPE,
    WordPiece, a Hugging Face tokenizer.json, NullTokenizer's ids or bytes); refuses one whose vocabulary size
    differs from the model's."""
    from mtx.data import build_tokenizer
    from mtx.data.tokenizer import saved_tokenizer_args, tokenizer_flags

    flags = (vocab_file, merge_file, tokenizer_type, tokenizer_model)
    given = any(f is not None for f in flags)
    if not given and cfg is not None:
        flags = saved_tokenizer_args(cfg.data)
    if flags[2] == "NullTokenizer" and cfg is None:
        raise ValueError("--tokenizer-type NullTokenizer takes its vocabulary from the checkpoint; pass --load.")
    # (NullTokenizer's ids: those before its end-of-document id, which the saved vocabulary counts)
    tokenizer = build_tokenizer(*flags, vocab_size=cfg.model.vocab_size - 1 if cfg is not None else None)
    if cfg is not None and tokenizer.vocab_size != cfg.model.vocab_size:
        saved = tokenizer_flags(cfg.data, cfg.model.vocab_size)  # (None: a converted checkpoint's, say)
        fix = (f"drop the tokenizer flags (the checkpoint's own is then read: {saved})" if saved and given else
               "pass the tokenizer it was trained with (--vocab-file and --merge-file, or --tokenizer-type "
               "HuggingFaceTokenizer --tokenizer-model DIR)")
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the checkpoint's model has vocab_size "
                         f"{cfg.model.vocab_size}; {fix}.")
    return tokenizer
