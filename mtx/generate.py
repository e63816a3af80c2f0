"""Text generation with a KV cache sharded by heads, batched, on any (data, pipeline, model) mesh.

- Cache: per layer, K and V of shape (B, S_max, g, H) on each rank, S_max = the model's max positions (the learned
  position table; with rope, the window generation runs in), g the rank's key/value heads: its n_local heads, or
  with grouped-query attention its G / TP groups (the one group of its heads when G < TP), N / G times less memory
  than a copy per query head. They split over "model" exactly like the columns that produce them, rows over "data",
  the stacked layer axis over "pipeline" like the layer parameters: the global spec (pipeline, data, None, model,
  None) is declared once, beside the layer stack (`KV_CACHE_SPEC`, mtx/models/stack.py).
- Prefill: the prompts, right-padded to (B, S_max), run once. Causal attention alone keeps real tokens from seeing
  the padding (it comes after them); every layer writes its K/V into the cache, and row b's next-token logits come
  from position len_b - 1.
- Decode: one jitted step per token. Row b's pending token sits at its own position len_b: every layer writes one
  K/V entry at slot len_b and attends over slots 0 .. len_b (later slots hold padding or stale entries, masked).
- Logits: only the last position's hidden vector goes through the output layer (this rank's vocab slice);
  the (B, V / tp) slices are gathered over "model" into (B, V) floats, never B*S*V. Padded vocab ids are masked,
  then temperature, top-k and top-p (nucleus) sampling run on the global (B, V) array (greedy at temperature 0).
- Pipeline (P > 1): each prefill or decode is one microbatch through the pipeline's tick loop (P ticks,
  `pipelined_decode` in mtx/parallel/pipeline.py). At tick t stage t runs its layers with its own cache slice and
  ppermutes the activation to stage t + 1; the other stages run the same program but leave their cache alone. The
  last stage's output is shared over "pipeline" for the output layer.
- Sequence parallelism: decoding runs whole rows, so it uses the model built with it off (`for_decoding`); the
  parameters are the same.
- Window: a prompt longer than S_max keeps its last S_max tokens (the returned ids still start with the whole
  prompt). Positions are learned only up to S_max, so when a row's cache is full the batch is prefilled again,
  each full row keeping its last S_max // 2 tokens (slide by half): generation goes on past the window at the cost
  of one prefill per S_max / 2 new tokens of a row, instead of a full-window forward per token.
- Stopping: a row stops after it emits `eod` (kept in its output). Shapes stay fixed, so stopped rows are still
  computed; the loop ends early once every row has stopped (checked every few tokens, which costs a device sync).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.models.stack import KV_CACHE_SPEC
from mtx.parallel.compat import all_gather_invariant
from mtx.parallel.mesh import BATCH, DATA, PIPELINE
from mtx.parallel.ops import gather_from_model_parallel
from mtx.parallel.pipeline import pipelined_decode

_EOD_CHECK_EVERY = 8  # tokens between early-exit checks (each one waits for the device)


def top_p_filter(logits_BV, top_p: float):
    """Keeps, per row, the smallest set of most likely tokens whose probability reaches top_p; -inf elsewhere.

    Sorted by probability, a token is kept while the mass of the tokens before it is still below top_p (so the most
    likely token always stays). Tokens tied with the last kept one are kept too.
    """
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV.astype(jnp.float32), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_B = jnp.sum(mass_before_BV < top_p, axis=-1, keepdims=True)  # >= 1
    threshold_B1 = jnp.take_along_axis(sorted_BV, kept_B - 1, axis=-1)
    return jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)


@functools.partial(jax.jit, static_argnames=("vocab_size", "temperature", "top_k", "top_p"))
def sample_logits(logits_BV, key, *, vocab_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """(B, V) float32 logits -> (B,) ids: padded ids (>= vocab_size) masked, then greedy (temperature 0) or
    temperature, top-k (k > 0) and top-p (p < 1) filtering and a categorical draw."""
    logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_size, logits_BV, -jnp.inf)
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, min(top_k, logits_BV.shape[-1]))[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p < 1.0:
        logits_BV = top_p_filter(logits_BV, top_p)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


class CachedDecoder:
    """The compiled prefill and decode steps of one ShardedModel (its config and mesh).

    prefill(params, tokens_BS, lengths_B) -> (logits_BV, cache): tokens right-padded to (B, S_max).
    decode(params, cache, tokens_B, positions_B) -> (logits_BV, cache): one token per row at its position (the
    number of tokens already in that row's cache, < S_max); the cache is donated.
    B must be a multiple of the data-parallel size; logits are float32 over the padded vocabulary, every row on every
    device (so each process of a multi-host run samples all rows alike and reads them without a transfer).
    """

    def __init__(self, model):
        self.model = model = model.for_decoding
        cfg = model.cfg.model
        self.window = cfg.max_positions
        self.batch_multiple = model.mesh.shape[DATA]
        self.rows = NamedSharding(model.mesh, BATCH)
        specs, mesh = model.param_specs, model.mesh
        out_specs = (P(), KV_CACHE_SPEC)  # logits on every device: each process samples every row
        prefill = jax.shard_map(self._local_prefill, mesh=mesh, in_specs=(specs, BATCH, BATCH),
                                out_specs=out_specs)
        decode = jax.shard_map(self._local_decode, mesh=mesh, in_specs=(specs, KV_CACHE_SPEC, BATCH, BATCH),
                               out_specs=out_specs)
        put = lambda x: jax.sharding.reshard(x, self.rows)
        self.prefill = jax.jit(lambda params, tokens_BS, lengths_B: prefill(
            model.forward_params(params), put(tokens_BS), put(lengths_B)))
        self.decode = jax.jit(lambda params, cache, tokens_B, positions_B: decode(
            model.forward_params(params), cache, put(tokens_B), put(positions_B)), donate_argnums=1)

    # ---- inside shard_map (local shapes) ----
    def _local_prefill(self, params, tokens_BS, lengths_B):
        model = self.model.merge(params)
        cache = model.stack.empty_cache(model.layers, tokens_BS.shape[0], self.window)
        start_B = jnp.zeros_like(lengths_B)
        return self._forward(model, cache, tokens_BS, start_B, lengths_B - 1)

    def _local_decode(self, params, cache, tokens_B, positions_B):
        model = self.model.merge(params)
        return self._forward(model, cache, tokens_B[:, None], positions_B, jnp.zeros_like(positions_B))

    def _forward(self, model, cache, tokens_BT, start_B, last_B):
        """T new tokens per row at positions start_B + t -> (logits (B, V) of token last_B of each row, cache)."""
        positions_BT = jnp.minimum(start_B[:, None] + jnp.arange(tokens_BT.shape[1]), self.window - 1)
        x_BTD = model.embed(tokens_BT, positions_BS=positions_BT)
        schedule = self.model.forward_pipeline
        if schedule is None:  # one stage: the layers vary over the size-1 "pipeline" axis only by type
            x_BTD, cache = model.transform_cached(x_BTD, cache, start_B)
            x_BTD = jax.lax.pmean(x_BTD, PIPELINE)
        else:
            x_BTD, cache = pipelined_decode(model, x_BTD, cache, start_B, schedule)
        x_BD = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)[:, 0]
        local_BV = model.attend(model.final_layernorm(x_BD))  # this rank's vocab slice
        logits_BV = gather_from_model_parallel(local_BV.astype(jnp.float32))
        return all_gather_invariant(logits_BV, DATA, axis=0), cache

    # ---- host side ----
    def windows(self, rows: list[list[int]]):
        """Rows of at most S_max ids -> (tokens (B, S_max) right-padded with 0, lengths (B,)), split over "data"."""
        tokens = np.zeros((len(rows), self.window), np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        lengths = np.array([len(row) for row in rows], np.int32)
        return self.put(tokens), self.put(lengths)

    def put(self, a: np.ndarray) -> jax.Array:
        """A host array (the same on every process) split over "data" by rows."""
        return jax.make_array_from_callback(a.shape, self.rows, lambda index: a[index])




def decoder_for(model) -> CachedDecoder:
    """The CachedDecoder of a ShardedModel, built (and compiled) once per model and kept on it (freed with it)."""
    if "_cached_decoder" not in model.__dict__:
        model.__dict__["_cached_decoder"] = CachedDecoder(model)
    return model.__dict__["_cached_decoder"]


def generate(model, params, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eod: int | None = None) -> list[list[int]]:
    """Each prompt followed by up to `max_new_tokens` sampled ids (fewer if it emits `eod`, which is kept).

    temperature 0 is greedy; top_k > 0 keeps the k most likely ids; top_p < 1 keeps the nucleus of mass top_p.
    The prompts run as one batch (padded to a multiple of the data-parallel size); the same seed gives the same
    samples. See the module docstring for the window (S_max) rules.
    """
    vocab = model.cfg.model.vocab_size
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {temperature}, {top_k}, "
                         f"{top_p}.")
    for i, prompt in enumerate(prompts):
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {i} must be a non-empty list of ids in [0, {vocab}).")
    if max_new_tokens <= 0 or not prompts:
        return [list(p) for p in prompts]
    dec = decoder_for(model)
    s_max, n = dec.window, len(prompts)
    histories = [list(p) for p in prompts] + [[0]] * (-n % dec.batch_multiple)  # padding rows, dropped at the end
    starts = np.array([max(0, len(h) - s_max) for h in histories])  # where each row's window begins
    logits, cache = dec.prefill(params, *dec.windows([h[st:] for h, st in zip(histories, starts)]))
    positions = np.array([len(h) - st for h, st in zip(histories, starts)], np.int32)  # tokens in each row's cache
    sample = functools.partial(sample_logits, vocab_size=vocab, temperature=float(temperature), top_k=int(top_k),
                               top_p=float(top_p))
    key = jax.random.key(seed)
    tokens_B = sample(logits, jax.random.fold_in(key, 0))
    out = [tokens_B]
    done_B = tokens_B == eod if eod is not None else None
    for i in range(1, max_new_tokens):
        if done_B is not None and i % _EOD_CHECK_EVERY == 0 and bool(done_B.all()):
            break
        if (positions >= s_max).any():  # a row's cache is full: prefill again, full rows keeping S_max // 2 tokens
            generated = np.asarray(jax.device_get(jnp.stack(out, axis=1)))
            histories_now = [h + g.tolist() for h, g in zip(histories, generated)]
            starts = np.array([len(h) - max(1, s_max // 2) if len(h) - st > s_max else st
                               for h, st in zip(histories_now, starts)])
            logits, cache = dec.prefill(params, *dec.windows([h[st:] for h, st in zip(histories_now, starts)]))
            positions = np.array([len(h) - st for h, st in zip(histories_now, starts)], np.int32)
        else:
            logits, cache = dec.decode(params, cache, tokens_B, dec.put(positions))
            positions = positions + 1
        tokens_B = sample(logits, jax.random.fold_in(key, i))
        out.append(tokens_B)
        if done_B is not None:
            done_B = done_B | (tokens_B == eod)
    generated = np.asarray(jax.device_get(jnp.stack(out, axis=1)))[:n]
    results = []
    for prompt, row in zip(prompts, generated.tolist()):
        if eod is not None and eod in row:
            row = row[: row.index(eod) + 1]
        results.append(list(prompt) + row)
    return results
