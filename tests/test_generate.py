"""KV-cached generation: the cached logits equal the full forward's on every mesh, and the sampler does what it says."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mtx.config import Config
from mtx.generate import decoder_for, generate, sample_logits, top_p_filter
from mtx.parallel import make_mesh
from mtx.parallel.mesh import DATA
from mtx.parallel.ops import gather_from_model_parallel
from mtx.presets import load_preset
from mtx.sharded_model import ShardedModel
from mtx.state import init_state

from helpers import LLAMA_BLOCKS

VOCAB, S = 257, 32
TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(vocab_size=VOCAB, hidden_dropout=0.0,
                                                                    attention_dropout=0.0)


# Llama's blocks: 8 query heads of 8 dims and G key/value groups (split over TP when TP divides G, else replicated:
# tests/test_llama.py).
LLAMA = dict(LLAMA_BLOCKS, rotary_percent=0.5)


@functools.cache
def setup(mesh, num_layers=2, groups=None):
    """(model, randomly initialised params) of the tiny model (with Llama's blocks and `groups` key/value groups
    unless None) on a (data, pipeline, model) mesh. Parameters do not depend on the mesh, so they are initialised
    once per model on one device and laid out on the others."""
    dp, pp, tp = mesh
    uneven = {"num_layers_in_first_pipeline_stage": num_layers - (num_layers // pp) * (pp - 1)} if num_layers % pp \
        else {}
    llama = {} if groups is None else dict(LLAMA, num_query_groups=groups)
    cfg = TINY.replace(num_layers=num_layers, data_parallel_size=dp, pipeline_model_parallel_size=pp,
                       tensor_model_parallel_size=tp, micro_batch_size=1, global_batch_size=dp * pp,
                       **uneven, **llama).validate(8)
    model = ShardedModel(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))
    if mesh != (1, 1, 1):
        return model, jax.device_put(setup((1, 1, 1), num_layers, groups)[1], model.param_shardings)
    if num_layers == 2:
        return model, init_state(model).params
    # The training init's parameters without compiling the optimizer's init.
    return model, model.init_params()


@functools.cache
def _full_forward(model):
    def local(params, tokens_BS):  # test-only: gathers all B*S*V logits
        hidden_BSD = model.local_final_hidden(params, tokens_BS)
        logits_BSV = model.merge(params).attend(hidden_BSD)
        return gather_from_model_parallel(logits_BSV.astype(jnp.float32))

    sharded = jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, P(DATA)), out_specs=P(DATA))
    return jax.jit(lambda params, tokens: sharded(model.forward_params(params), tokens))


def full_logits(model, params, rows):
    """Uncached reference: (B, S, V) logits of the whole window, rows right-padded to S."""
    tokens = np.zeros((len(rows), S), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return np.asarray(_full_forward(model)(params, jax.device_put(tokens, model.batch_sharding)))


def uncached_greedy(model, params, prompt, n):
    """Greedy decoding by one full forward per token, with generate's window rule (keep S, slide by S // 2)."""
    ids, start = list(prompt), max(0, len(prompt) - S)
    for _ in range(n):
        if len(ids) - start > S:
            start = len(ids) - S // 2
        window = ids[start:]
        logits = full_logits(model, params, [window])[0, len(window) - 1, :VOCAB]
        ids.append(int(np.argmax(logits)))
    return ids


# (mesh, layers, key/value groups or None for GPT-2's blocks). Llama's: G = 2 on one device, split over TP 2 (one
# group a rank), replicated over TP 4 (G < TP), both with pipeline stages; G = 1 (multi-query) replicated over TP 2
# with two data ranks.
CACHED_CASES = [((1, 1, 1), 2, None), ((1, 1, 2), 2, None), ((2, 1, 4), 2, None), ((1, 2, 2), 2, None),
                ((1, 2, 1), 3, None), ((1, 1, 1), 2, 2), ((1, 1, 2), 2, 2), ((1, 1, 4), 2, 2), ((1, 2, 2), 2, 2),
                ((1, 2, 4), 2, 2), ((2, 1, 2), 2, 1)]


def prefill_two_prompts(model, params, seq, lengths):
    dec = decoder_for(model)
    return dec, *dec.prefill(params, *dec.windows([seq[b, : lengths[b]].tolist() for b in range(2)]))


@pytest.mark.parametrize("mesh,num_layers,groups", CACHED_CASES)
def test_cached_logits_equal_the_full_forward_at_every_step(mesh, num_layers, groups):
    """Prefill two prompts of different lengths, then teacher-force the rest of a random sequence token by token:
    every step's (B, V) logits equal the uncached forward's at that position ((1, 2, 1) x 3 layers: uneven stages;
    Llama's blocks: rotary positions of the cache slots, a cache of the key/value groups, split or replicated)."""
    model, params = setup(mesh, num_layers, groups)
    seq = np.random.default_rng(0).integers(0, VOCAB, (2, S)).astype(np.int32)
    ref = full_logits(model, params, seq.tolist())
    tol = 1e-5 * np.abs(ref).max()
    lengths = np.array([5, 9], np.int32)
    dec, logits, cache = prefill_two_prompts(model, params, seq, lengths)
    np.testing.assert_allclose(np.asarray(logits), ref[[0, 1], lengths - 1], rtol=0, atol=tol)
    positions = lengths.copy()
    while positions.max() < S:
        tokens = jax.device_put(seq[[0, 1], positions], dec.rows)
        logits, cache = dec.decode(params, cache, tokens, jax.device_put(positions, dec.rows))
        np.testing.assert_allclose(np.asarray(logits), ref[[0, 1], positions], rtol=0, atol=tol,
                                   err_msg=f"positions {positions} on {mesh}")
        positions = positions + 1


# The key/value heads each rank caches in CACHED_CASES: N / tp of the 8 heads, then G / tp groups or one.
LOCAL_HEADS = [8, 4, 2, 4, 8, 2, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("case,local_heads", list(zip(CACHED_CASES, LOCAL_HEADS)))
def test_the_cache_holds_each_ranks_key_value_heads_only(case, local_heads):
    """Per device, K and V are (held L, B / dp, S_max, g, H): g = N / tp heads with GPT-2's blocks, G / tp groups
    when tp divides G, one group when G < tp. Llama's 2 groups on one device: 2 x (2, 2, 32, 2, 8) float32, 16 KiB,
    where a copy per query head was 64 KiB."""
    (dp, pp, _), num_layers, _ = case
    model, params = setup(*case)
    seq = np.random.default_rng(0).integers(0, VOCAB, (2, S)).astype(np.int32)
    _, _, cache = prefill_two_prompts(model, params, seq, np.array([5, 9], np.int32))
    held = -(-num_layers // pp)  # an uneven first stage holds the extra layer; every stage stores that many
    for array in cache:
        assert {s.data.shape for s in array.addressable_shards} == {(held, 2 // dp, S, local_heads, 8)}
    assert sum(a.addressable_shards[0].data.nbytes for a in cache) == 2 * held * (2 // dp) * S * local_heads * 8 * 4
    if case == ((1, 1, 1), 2, 2):
        assert sum(a.nbytes for a in cache) == 16 * 1024


def test_greedy_generation_is_the_argmax_of_the_full_forward_step_by_step():
    model, params = setup((1, 1, 1))
    prompts = [[5, 17, 200], [9, 8, 7, 6, 5, 4, 3]]
    out = generate(model, params, prompts, 12, temperature=0.0)
    assert out == [uncached_greedy(model, params, p, 12) for p in prompts]


def test_generation_slides_the_window_past_max_positions():
    """A 40-token prompt keeps its last 32; the full window then slides by 16, as the uncached reference does."""
    model, params = setup((1, 1, 1))
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    out = generate(model, params, [prompt, [1, 2]], 20, temperature=0.0)
    assert out[0][:40] == prompt and len(out[0]) == 60
    assert out[0] == uncached_greedy(model, params, prompt, 20)
    assert out[1] == uncached_greedy(model, params, [1, 2], 20)


def test_batched_prompts_of_different_lengths_continue_as_if_alone():
    """On (2, 1, 4): three prompts (padded to four rows over two data ranks) against each prompt alone."""
    model, params = setup((2, 1, 4))
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
    batched = generate(model, params, prompts, 10, temperature=0.0)
    assert batched == [generate(model, params, [p], 10, temperature=0.0)[0] for p in prompts]
    assert [len(r) for r in batched] == [len(p) + 10 for p in prompts]


def test_top_k_1_is_greedy_and_the_same_seed_gives_the_same_samples():
    model, params = setup((1, 1, 1))
    prompts = [[5, 17, 200], [9, 8, 7, 6, 5, 4, 3]]
    greedy = generate(model, params, prompts, 10, temperature=0.0)
    assert generate(model, params, prompts, 10, temperature=1.0, top_k=1, seed=7) == greedy
    a = generate(model, params, prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    assert a == generate(model, params, prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    assert a != generate(model, params, prompts, 10, temperature=1.0, top_p=0.9, seed=4)
    assert a != greedy  # near-uniform random-init logits: sampling does not collapse onto the argmax


def test_eod_stops_a_sequence_and_keeps_the_eod_token():
    model, params = setup((1, 1, 1))
    prompts = [[5, 17, 200], [9, 8, 7, 6, 5, 4, 3]]
    free = generate(model, params, prompts, 12, temperature=0.0)
    eod = free[0][3]  # row 0's first new id: row 0 stops at once, row 1 where (if) it emits it
    stopped = generate(model, params, prompts, 12, temperature=0.0, eod=eod)
    for full, got, prompt in zip(free, stopped, prompts):
        new = full[len(prompt):]
        expected = full[: len(prompt) + new.index(eod) + 1] if eod in new else full
        assert got == expected
    assert stopped[0] == prompts[0] + [eod]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = jnp.log(jnp.asarray(probs))[None]
    for p, kept in [(0.3, {1}), (0.5 - 1e-3, {1}), (0.7, {1, 3}), (0.9, {1, 2, 3}), (0.97, {0, 1, 2, 3}),
                    (1.0, {0, 1, 2, 3})]:
        filtered = np.asarray(top_p_filter(logits, p))[0]
        assert set(np.flatnonzero(np.isfinite(filtered))) == kept, p
        np.testing.assert_array_equal(filtered[list(kept)], np.asarray(logits)[0, list(kept)])


def test_sampling_never_draws_padded_vocab_ids_and_respects_top_k():
    logits = jnp.zeros((64, 1024)).at[:, 1000].set(50.0)  # a padded id (>= VOCAB) would win every draw
    key = jax.random.key(0)
    assert int(sample_logits(logits, key, vocab_size=VOCAB, temperature=0.0)[0]) < VOCAB
    ids = np.asarray(sample_logits(logits, key, vocab_size=VOCAB, temperature=1.0))
    assert ids.max() < VOCAB and len(set(ids.tolist())) > 1
    ranked = jnp.broadcast_to(-jnp.arange(1024, dtype=jnp.float32) * 0.01, (64, 1024))
    ids = np.asarray(sample_logits(ranked, key, vocab_size=VOCAB, temperature=1.0, top_k=3))
    assert set(ids.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("post_layernorm", [False, True])
def test_a_layer_decodes_like_its_forward_in_either_layernorm_placement(post_layernorm):
    """One TransformerLayer (TP 2): token-by-token decoding with its KV cache gives the causal forward's outputs."""
    from mtx.models.transformer import KVCache, TransformerLayer
    from mtx.parallel.sharded import named_shardings, partition_specs

    cfg = TINY.model
    layer = TransformerLayer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), post_layernorm=post_layernorm)
    graphdef, params = nnx.split(layer)
    specs = partition_specs(params, 2)
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    params = jax.device_put(params, named_shardings(params, mesh))
    x_BSD = jax.device_put(jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size)),
                           jax.sharding.NamedSharding(mesh, P()))
    n_local, h = cfg.num_attention_heads // 2, cfg.head_dim

    def local(params, x_BSD):
        model = nnx.merge(graphdef, params)
        full = model(x_BSD)
        cache = KVCache(*(jnp.zeros((2, 8, n_local, h)) for _ in range(2)))
        steps = []
        for t in range(8):
            y, cache = model.decode(x_BSD[:, t:t + 1], cache, jnp.full((2,), t, jnp.int32))
            steps.append(y)
        return full, jnp.concatenate(steps, axis=1)

    full, cached = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), P())))(params, x_BSD)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_a_sequence_parallel_model_generates_with_whole_rows():
    """A model trained with --sequence-parallel (TP 2, pipelined, interleaved) decodes through its `for_decoding` twin
    (same parameters, whole rows): the same greedy ids as the plain (1, 1, 1) model, and its eval loss is the same."""
    plain, params = setup((1, 1, 1))
    cfg = plain.cfg.replace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4,
                            sequence_parallel=True, micro_batch_size=2, global_batch_size=4,
                            virtual_pipeline_model_parallel_size=2).validate(8)
    sp = ShardedModel(cfg, make_mesh(1, 2, 2, devices=jax.devices()[:4]))
    assert sp.cfg.sequence_parallel and not sp.for_decoding.cfg.sequence_parallel
    deep, deep_params = setup((1, 1, 1), 4)
    sp_params = jax.device_put(deep_params, sp.param_shardings)
    prompts = [[5, 17, 200], [9, 8, 7, 6, 5, 4, 3]]
    assert generate(sp, sp_params, prompts, 6, temperature=0.0) == generate(deep, deep_params, prompts, 6,
                                                                          temperature=0.0)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, S + 1)).astype(np.int32)
    np.testing.assert_allclose(float(sp.eval_loss(sp_params, sp.put_batch(tokens))),
                               float(deep.eval_loss(deep_params, deep.put_batch(tokens))), rtol=1e-5)
