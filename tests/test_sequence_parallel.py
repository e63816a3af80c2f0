"""Sequence parallelism (--sequence-parallel) and its overlapped collectives (--tp-comm-overlap) change where the
element-wise work and the communication happen, never the math: loss and every gradient equal the paper's layers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx.config import Config, load_preset
from mtx.parallel.collective_matmul import ring_gather, ring_reduce_scatter, ring_rows
from mtx.parallel.mesh import MODEL, make_mesh
from mtx.parallel.ops import gather_from_model_parallel
from mtx.step import Trainer, sequence_parallel_mode

TINY = Config().replace(**load_preset("configs/tiny.toml"))


def loss_and_grads(cfg, dp, pp, tp):
    trainer = Trainer(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))
    state = trainer.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.training.global_batch_size,
                                                                         cfg.model.seq_length + 1))
    loss, grads = jax.jit(trainer.loss_and_grads)(state.params, trainer.put_batch(tokens), state.step)
    return float(loss), {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(grads)}


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for path in want[1]:
        np.testing.assert_allclose(got[1][path], want[1][path], rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_sequence_parallel_is_the_same_math():
    """Dropout on (the masks follow the sequences, whichever rank holds them): loss and gradients on (data, pipeline,
    model) meshes with each microbatch's rows split over "model", plain and overlapped, equal the unsplit run's
    (BERT's in tests/test_bert_training.py)."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=16, micro_batch_size=8)
    reference = loss_and_grads(cfg.replace(tensor_model_parallel_size=1), 1, 1, 1)
    for dp, pp, tp, overlap in [(1, 1, 2, False), (1, 1, 4, True), (2, 1, 4, False), (1, 2, 2, True),
                                (1, 1, 8, True)]:
        sp = cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                         sequence_parallel=True, tp_comm_overlap=overlap)
        assert_same(loss_and_grads(sp, dp, pp, tp), reference)


def test_sequence_parallel_with_recomputation_and_unrolled_layers():
    """Every recomputation policy, unrolled layers, and the benchmarked mix (plain gathers, `matmuls`, unrolled,
    fused attention)."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.0, global_batch_size=4, tensor_model_parallel_size=2)
    reference = loss_and_grads(cfg, 1, 1, 2)
    for recompute in ("full", "selective", "matmuls"):
        sp = cfg.replace(sequence_parallel=True, tp_comm_overlap=True, recompute_granularity=recompute,
                         scan_layers=False)
        assert_same(loss_and_grads(sp, 1, 1, 2), reference)
    fast = dict(recompute_granularity="matmuls", scan_layers=False, use_flash_attn=True)
    assert_same(loss_and_grads(cfg.replace(sequence_parallel=True, **fast), 1, 1, 2),
                loss_and_grads(cfg.replace(**fast), 1, 1, 2))


def test_sequence_parallel_pipeline_with_a_padding_microbatch():
    """3 microbatches over 2 uneven stages (1 + 2 layers): each stage scores 2 microbatches, one of them padding; rows
    ordered rank-major throughout."""
    cfg = TINY.replace(hidden_dropout=0.1, attention_dropout=0.1, global_batch_size=12, micro_batch_size=4,
                       num_layers=3)
    reference = loss_and_grads(cfg.replace(tensor_model_parallel_size=1), 1, 1, 1)
    sp = cfg.replace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1,
                     sequence_parallel=True, num_layers_in_first_pipeline_stage=1)
    assert_same(loss_and_grads(sp, 1, 2, 2), reference)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ring_steps_equal_gather_then_multiply(tp):
    """An MLP on ring-ordered row chunks (ring_gather / ring_reduce_scatter) against all_gather / psum_scatter around
    whole matmuls, forward and backward, and both against the plain MLP."""
    mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])
    rng = np.random.default_rng(tp)
    x = jnp.asarray(rng.normal(size=(2 * tp, 8, 16)), jnp.float32)  # global (B, S, D), rows split over "model"
    w1 = jnp.asarray(rng.normal(size=(16, 6 * tp)), jnp.float32)  # column-parallel (D, F)
    w2 = jnp.asarray(rng.normal(size=(6 * tp, 16)), jnp.float32)  # row-parallel (F, D)
    specs = (P(MODEL), P(None, MODEL), P(MODEL, None))
    x, w1, w2 = (jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip((x, w1, w2), specs))

    def mlp(x, w1, w2, ring):
        if ring:
            return ring_reduce_scatter([jnp.tanh(c @ w1) @ w2 for c in ring_gather(x)])
        h = jax.lax.all_gather(x, MODEL, axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(jnp.tanh(h) @ w2, MODEL, scatter_dimension=0, tiled=True)

    def loss(x, w1, w2, ring):
        y = jax.shard_map(lambda *a: mlp(*a, ring), mesh=mesh, in_specs=specs, out_specs=P(MODEL))(x, w1, w2)
        return jnp.sum(y * jnp.cos(y)), y

    grad = lambda ring: jax.jit(jax.value_and_grad(lambda *a: loss(*a, ring), argnums=(0, 1, 2), has_aux=True))
    (_, y_ref), g_ref = grad(False)(x, w1, w2)
    (_, y), g = grad(True)(x, w1, w2)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_ref, np.tanh(np.asarray(x) @ np.asarray(w1)) @ np.asarray(w2), rtol=1e-5,
                               atol=1e-5)
    for a, b in zip(g, g_ref):  # fp32 sums in another order: equal to 1e-5 of the gradient's scale
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_ring_rows_follow_the_ring():
    """Chunk j of ring_gather holds the rows of rank (r - j) % tp; ring_rows cuts a replicated array the same way."""
    tp = 4
    mesh = make_mesh(1, 1, tp, devices=jax.devices()[:tp])
    rows = jnp.arange(2 * tp, dtype=jnp.float32)  # global row ids

    def local(own):
        whole = gather_from_model_parallel(own, axis=0)  # the same on every rank
        return jnp.stack(ring_gather(own))[None], jnp.stack(ring_rows(whole, tp))[None]

    gathered, cut = jax.shard_map(local, mesh=mesh, in_specs=P(MODEL), out_specs=(P(MODEL), P(MODEL)))(
        jax.device_put(rows, NamedSharding(mesh, P(MODEL))))
    gathered, cut = np.asarray(gathered), np.asarray(cut)
    for r in range(tp):
        for j in range(tp):
            want = np.arange(2) + 2 * ((r - j) % tp)
            np.testing.assert_array_equal(gathered[r, j], want)
            np.testing.assert_array_equal(cut[r, j], want)


def test_sequence_parallel_mode_follows_the_flags():
    """The layers' `sp` mode: whole-tensor collectives or the overlapped ring; none at TP 1."""
    sp = TINY.replace(sequence_parallel=True, tensor_model_parallel_size=2)
    assert sequence_parallel_mode(sp) == "gather"
    assert sequence_parallel_mode(sp.replace(tp_comm_overlap=True)) == "overlap"
    assert sequence_parallel_mode(sp.replace(tensor_model_parallel_size=1, tp_comm_overlap=True)) is None
    assert sequence_parallel_mode(TINY) is None


@pytest.mark.parametrize("flags,needle", [
    (dict(tp_comm_overlap=True), "pass --sequence-parallel"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=4, micro_batch_size=2), "multiple of 4"),
])
def test_bad_sequence_parallel_flags_are_refused(flags, needle):
    with pytest.raises(ValueError, match=needle):
        TINY.replace(**flags).validate()
