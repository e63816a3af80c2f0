"""BERT's sharded loss and gradients equal a plain single-device jnp reference at TP 1, 2 and 4; padding is ignored;
attention is bidirectional."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.presets import load_preset
from mtx.state import state_shardings
from mtx.step import TrainStep

VOCAB = 1000  # padded to 1024
BASE = Config().replace(**load_preset("configs/bert_tiny.toml")).replace(
    vocab_size=VOCAB, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0)


def make_batch(seed=0, g=16, s=32):
    """Random sentence-pair-shaped fields: real lengths 12..s, types 1 after a random split, ~15% masked (at most
    round-up(0.15 s) a row, as BERT's dataset)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, s + 1, g)
    real = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
    split = rng.integers(3, 10, g)
    masked = (rng.random((g, s)) < 0.15) * real
    masked *= np.cumsum(masked, axis=1) <= math.ceil(0.15 * s)
    return dict(text=(rng.integers(5, VOCAB, (g, s)) * real).astype(np.int32),
                types=((np.arange(s)[None] >= split[:, None]) * real).astype(np.int32),
                labels=rng.integers(0, VOCAB, (g, s)).astype(np.int32),
                loss_mask=masked.astype(np.int32),
                padding_mask=real, is_random=rng.integers(0, 2, g).astype(np.int32))


# ---- the reference: global weights, plain jnp, one device ----

def _ln(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_loss(p, batch, cfg):
    m = cfg.model
    eps, n, h = m.layernorm_epsilon, m.num_attention_heads, m.head_dim
    post = m.layernorm_placement == "post"
    text, mask = batch["text"], batch["padding_mask"]
    b, s = text.shape
    x = p["embedding"]["embedding"][text] + p["position_embeddings"][:s] + p["tokentype_embeddings"][batch["types"]]
    if post:
        x = _ln(x, p["embedding_layernorm"], eps)

    def attention(y, lp):
        qkv = (y @ lp["attention"]["qkv"]["kernel"] + lp["attention"]["qkv"]["bias"]).reshape(b, s, n, 3, h)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(h)
        scores = jnp.where(mask[:, None, None, :] > 0, scores, -1e30)  # no causal mask: bidirectional
        ctx = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, -1), v).reshape(b, s, n * h)
        return ctx @ lp["attention"]["proj"]["kernel"] + lp["attention"]["proj"]["bias"]

    def mlp(y, lp):
        z = jax.nn.gelu(y @ lp["mlp"]["fc1"]["kernel"] + lp["mlp"]["fc1"]["bias"], approximate=True)
        return z @ lp["mlp"]["fc2"]["kernel"] + lp["mlp"]["fc2"]["bias"]

    for layer in range(m.num_layers):
        lp = jax.tree.map(lambda a: a[layer], p["layers"])
        if post:
            x = _ln(x + attention(x, lp), lp["ln1"], eps)
            x = _ln(x + mlp(x, lp), lp["ln2"], eps)
        else:
            x = x + attention(_ln(x, lp["ln1"], eps), lp)
            x = x + mlp(_ln(x, lp["ln2"], eps), lp)
    if not post:
        x = _ln(x, p["final_layernorm"], eps)
    y = _ln(jax.nn.gelu(x @ p["lm_dense"]["kernel"] + p["lm_dense"]["bias"], approximate=False),
            p["lm_layernorm"], eps)
    logits = (y @ p["embedding"]["embedding"].T + p["lm_bias"])[..., :m.vocab_size]  # padded ids are no tokens
    mlm = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["labels"][..., None], -1)[..., 0]
    loss = jnp.sum(mlm * batch["loss_mask"]) / batch["loss_mask"].sum()
    pooled = jnp.tanh(x[:, 0] @ p["pooler"]["kernel"] + p["pooler"]["bias"])
    sop = pooled @ p["sop_head"]["kernel"] + p["sop_head"]["bias"]
    sop_loss = jax.nn.logsumexp(sop, -1) - jnp.take_along_axis(sop, batch["is_random"][:, None], -1)[:, 0]
    return loss + sop_loss.mean()


def train_step_on(mesh, **flags):
    dp, pp, tp = mesh
    cfg = BASE.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                       **flags).validate(8)
    return TrainStep.build(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))


def flat(tree):
    tree = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("placement,meshes", [("pre", [(1, 1, 1), (1, 1, 2), (2, 1, 4)]), ("post", [(1, 1, 2)])])
def test_sharded_loss_and_gradients_equal_the_reference(placement, meshes):
    batch = make_batch()
    initial = None  # built once, placed on each mesh: the state is mesh-independent (docs/design.md, decision 2)
    for mesh in meshes:
        train_step = train_step_on(mesh, layernorm_placement=placement)
        initial = jax.device_get(train_step.init_state()) if initial is None else initial
        state = jax.device_put(initial, state_shardings(train_step.model))
        loss, grads = jax.jit(train_step.loss_and_grads)(state.params, train_step.model.put_batch(batch), state.step)
        if mesh == meshes[0]:  # one reference for all meshes (the same weights)
            params = jax.tree.map(np.asarray, nnx.to_pure_dict(state.params))
            ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference_loss), static_argnums=2)(
                params, jax.tree.map(jnp.asarray, batch), train_step.cfg)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6), mesh
        ref, got = flat(ref_grads), flat(grads)
        assert got.keys() == ref.keys()
        for name, g in got.items():
            scale = np.abs(ref[name]).max()
            np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name} on {mesh}")


def test_padding_gets_no_attention_and_attention_is_bidirectional():
    train_step = train_step_on((2, 1, 2))
    state = train_step.init_state()
    loss_fn = jax.jit(lambda p, b: train_step.loss_and_grads(p, b, state.step)[0])
    batch = make_batch(1)
    base = float(loss_fn(state.params, train_step.model.put_batch(batch)))
    # Padded positions: any token and type there changes nothing.
    noisy = dict(batch)
    pad = batch["padding_mask"] == 0
    assert pad.any()
    noisy["text"] = np.where(pad, np.random.default_rng(2).integers(5, VOCAB, pad.shape), batch["text"]).astype(np.int32)
    noisy["types"] = np.where(pad, 1, batch["types"]).astype(np.int32)
    assert float(loss_fn(state.params, train_step.model.put_batch(noisy))) == base
    # Without the padding mask those tokens would be attended to: the loss moves.
    unmasked = dict(noisy, padding_mask=np.ones_like(batch["padding_mask"]))
    assert abs(float(loss_fn(state.params, train_step.model.put_batch(unmasked))) - base) > 1e-4
    # Bidirectional: with only position 1 predicted, changing the last real token of each sequence changes its loss.
    only_first = dict(batch, loss_mask=np.zeros_like(batch["loss_mask"]))
    only_first["loss_mask"][:, 1] = 1
    late = dict(only_first, text=only_first["text"].copy())
    last = batch["padding_mask"].sum(1) - 1
    late["text"][np.arange(len(last)), last] = (late["text"][np.arange(len(last)), last] + 7) % VOCAB
    a = float(loss_fn(state.params, train_step.model.put_batch(only_first)))
    assert abs(float(loss_fn(state.params, train_step.model.put_batch(late))) - a) > 1e-5


def test_eval_loss_is_the_training_loss_on_every_mesh():
    """ShardedModel.eval_loss (one path for GPT and BERT) on a batch equals the training step's loss of that batch
    as one global batch on one device, also pipelined with sequence parallelism."""
    from mtx.sharded_model import ShardedModel

    batch = make_batch(seed=3, g=8)
    one = train_step_on((1, 1, 1), global_batch_size=8, micro_batch_size=8)
    state = one.init_state()
    want = float(jax.jit(one.loss_and_grads)(state.params, one.model.put_batch(batch), state.step)[0])
    params = jax.device_get(state.params)
    for (dp, pp, tp), flags in [((1, 1, 1), {}), ((2, 2, 2), dict(sequence_parallel=True, micro_batch_size=2))]:
        cfg = BASE.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                           global_batch_size=8, **flags).validate(8)
        model = ShardedModel(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))
        got = float(model.eval_loss(jax.device_put(params, model.param_shardings), model.put_batch(batch)))
        assert got == pytest.approx(want, rel=1e-5), (dp, pp, tp)


def test_a_batch_masking_more_than_the_head_reads_is_refused_on_the_host():
    """With the masked-only MLM head a sequence with more masked positions than it runs at would lose the rest from
    the loss: put_batch refuses it in one line naming the fix; --mlm-head-positions all takes it."""
    batch = make_batch()
    batch["loss_mask"][3] = batch["padding_mask"][3]  # every real token masked
    refusal = r"masks \d+ positions of one sequence, more than the 5 .* --mlm-head-positions all"
    with pytest.raises(ValueError, match=refusal):
        train_step_on((1, 1, 1)).model.put_batch(batch)
    train_step_on((1, 1, 1), mlm_head_positions="all").model.put_batch(batch)
