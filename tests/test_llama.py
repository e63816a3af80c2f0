"""Llama's blocks (mtx/architecture.py): rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases, an
untied output layer. The mesh changes nothing (losses and every gradient, key/value groups split or replicated over
"model"), rope is the textbook rotation, the parameter count is the model's, and old checkpoints still load."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from mtx.architecture import ADDED_FIELDS
from mtx.checkpoint import MANIFEST
from mtx.config import Config, ModelConfig
from mtx.models.rotary import apply_rotary
from mtx.parallel.mesh import make_mesh
from mtx.presets import load_preset
from mtx.run import train
from mtx.sharded_model import ShardedModel

from helpers import LLAMA_BLOCKS, loss_and_grads

TINY = Config().replace(**load_preset("configs/tiny.toml"), hidden_dropout=0.0, attention_dropout=0.0)
# Every block on: 8 heads of 8 dims, 2 key/value groups (split over TP 2, replicated over TP 4 and 8), rope on 3 / 4
# of each head, SwiGLU of width 128 (Megatron's 8 / 3 rule at D = 64).
LLAMA = dict(LLAMA_BLOCKS, rotary_base=500000.0, rotary_percent=0.75, norm_epsilon=1e-6, num_query_groups=2)


@pytest.mark.parametrize("groups,meshes", [
    (2, [(1, 1, 2, {}), (1, 1, 4, {}), (2, 1, 4, {"sequence_parallel": True}), (1, 2, 2, {}), (1, 2, 4, {}),
         (2, 1, 4, {"use_distributed_optimizer": True})]),
    (4, [(1, 1, 4, {"use_flash_attn": True, "recompute_granularity": "matmuls", "scan_layers": False}),
         (1, 1, 8, {"sequence_parallel": True})]),
])
def test_loss_and_every_gradient_are_the_same_on_every_mesh(groups, meshes):
    """Key/value groups split over "model" (G >= TP) or replicated (G < TP, their gradients summed over "model" once
    per step), with sequence parallelism, 1F1B pipeline stages, the distributed optimizer and the presets' GPU
    settings (fused attention, XLA's here; matmul recomputation; unrolled layers): loss and every gradient equal one
    device's."""
    cfg = TINY.replace(**{**LLAMA, "num_query_groups": groups}, global_batch_size=16, micro_batch_size=8)
    ref_loss, ref = loss_and_grads(cfg, 1, 1, 1)
    assert "['output_layer']['embedding']" in ref and "['position_embeddings']" not in ref
    for dp, pp, tp, flags in meshes:
        loss, grads = loss_and_grads(cfg, dp, pp, tp, **flags)
        assert loss == pytest.approx(ref_loss, rel=1e-6), (dp, pp, tp, flags)
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            scale = np.abs(ref[name]).max()
            np.testing.assert_allclose(g, ref[name], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name} on {dp, pp, tp}")


def test_training_losses_are_the_same_on_every_mesh(tmp_path, shared_initial_state):
    """4 layers, 3 steps: DP x TP with sequence parallelism, 1F1B stages with replicated groups, interleaved 1F1B."""
    curves = {}
    for dp, pp, tp, flags in [(1, 1, 1, {}), (2, 1, 4, {"sequence_parallel": True}), (1, 2, 4, {}),
                              (2, 2, 2, {"sequence_parallel": True}),
                              (1, 2, 2, {"virtual_pipeline_model_parallel_size": 2})]:
        cfg = TINY.replace(**LLAMA, num_layers=4, train_iters=3, log_interval=1, micro_batch_size=4,
                           data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                           run_dir=str(tmp_path / f"r{dp}{pp}{tp}{len(flags)}"), **flags)
        result = train(cfg, progress=False)
        curves[dp, pp, tp, tuple(flags)] = np.array([result.losses[s] for s in (1, 2, 3)])
    reference = curves[1, 1, 1, ()]
    for mesh, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=1e-5, err_msg=f"mesh {mesh}")


def test_rope_is_the_rotation_of_each_pair_by_position_times_frequency():
    b, s, n, h, rotary, base = 2, 5, 3, 8, 6, 500.0
    x = np.random.default_rng(0).standard_normal((b, s, n, h)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 9, 0, 2]])
    got = np.asarray(apply_rotary(x, positions, rotary_dim=rotary, base=base))
    want = x.copy()
    for bi in range(b):
        for si in range(s):
            for i in range(rotary // 2):  # dims i and i + R / 2 rotate by p / base^(2i / R)
                angle = positions[bi, si] / base ** (2 * i / rotary)
                c, d = x[bi, si, :, i], x[bi, si, :, i + rotary // 2]
                want[bi, si, :, i] = c * np.cos(angle) - d * np.sin(angle)
                want[bi, si, :, i + rotary // 2] = d * np.cos(angle) + c * np.sin(angle)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[..., rotary:], x[..., rotary:])  # the rest of each head passes through
    # (S,) positions are every row's
    np.testing.assert_array_equal(apply_rotary(x, positions[0], rotary_dim=rotary, base=base),
                                  apply_rotary(x, np.stack([positions[0]] * b), rotary_dim=rotary, base=base))
    # q . k depends on the positions' difference only
    q, k = x[:1, :1], x[:1, 1:2]

    def score(pq, pk):
        rq, rk = (apply_rotary(v, np.array([p]), rotary_dim=rotary, base=base) for v, p in ((q, pq), (k, pk)))
        return float(np.sum(np.asarray(rq)[0, 0, 0] * np.asarray(rk)[0, 0, 0]))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5) and score(5, 2) != pytest.approx(score(5, 3))


@pytest.mark.parametrize("name,hf,padded,flops", [("llama_1b", 1_235_814_400, 1_237_387_264, 10_645_549_056),
                                                  ("llama_8b", 8_030_261_248, 8_036_552_704, 57_933_324_288)])
def test_llama_presets_count_hugging_faces_parameters(name, hf, padded, flops):
    """Llama-3.2-1B (tied) and Llama-3-8B (untied): Hugging Face's counts with the tokenizer's 128,256 ids; mtx pads
    them to 129,024 (a multiple of 1,024, so 128 per shard up to TP 8). FLOPs per token: 6 N (the tied table counted
    once, an untied input table not at all) + 12 L D S."""
    m = Config().replace(**load_preset(f"configs/{name}.toml")).validate(8).model
    assert (m.num_params_unpadded(), m.num_params(), m.padded_vocab_size) == (hf, padded, 129_024)
    lookup = 0 if m.tied else 129_024 * m.hidden_size
    assert m.flops_per_token() == 6 * (padded - lookup) + 12 * m.num_layers * m.hidden_size * 8192 == flops


@pytest.mark.parametrize("blocks", [{}, LLAMA, {**LLAMA, "untie_embeddings_and_output_weights": False},
                                    {"swiglu": True, "group_query_attention": True},
                                    {"normalization": "RMSNorm", "disable_bias_linear": True}])
def test_parameter_count_is_the_models(blocks):
    model = ShardedModel(TINY.replace(**blocks, tensor_model_parallel_size=1, data_parallel_size=1).validate(8),
                         make_mesh(1, 1, 1))
    assert sum(x.size for x in jax.tree.leaves(model.abstract_params)) == model.cfg.model.num_params()


def test_key_value_groups_are_split_or_replicated_by_the_mesh_alone():
    """The same parameters (and metadata) on every mesh; 2 groups split over TP 2, replicated over TP 4, where only
    they sum their gradients over "model" (once per step)."""
    from mtx.parallel.mesh import MODEL
    from mtx.step import gradient_axes

    kv = {"['layers']['attention']['key']['kernel']", "['layers']['attention']['value']['kernel']"}
    trees = set()
    for tp, replicated in ((2, False), (4, True)):
        cfg = TINY.replace(**LLAMA, tensor_model_parallel_size=tp, data_parallel_size=1).validate(8)
        model = ShardedModel(cfg, make_mesh(1, 1, tp, devices=jax.devices()[:tp]))
        trees.add(jax.tree.structure(model.abstract_params))
        specs = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(
            nnx.to_pure_dict(model.param_specs), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}
        assert {specs[k][-1] for k in kv} == {None if replicated else MODEL}
        assert specs["['layers']['attention']['query']['kernel']"][-1] == MODEL
        axes = gradient_axes(model.param_specs, model.master_specs, False, model.replicated_groups)
        summed = {jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_leaves_with_path(
            nnx.to_pure_dict(axes), is_leaf=lambda x: isinstance(x, tuple)) if MODEL in a}
        assert summed == (kv if replicated else set())
    assert len(trees) == 1


@pytest.mark.parametrize("flags,needle", [
    (dict(group_query_attention=True, num_query_groups=3), "--num-query-groups 3 does not divide"),
    (dict(group_query_attention=True, num_query_groups=3, num_attention_heads=12, hidden_size=96,
          tensor_model_parallel_size=2), "--num-query-groups 3 neither splits over --tensor-model-parallel-size 2"),
    (dict(position_embedding_type="rope", rotary_percent=0.4), "head dim 8 rotates 3 dimensions, which must be even"),
    (dict(position_embedding_type="rotary"), "--position-embedding-type must be learned_absolute or rope"),
    (dict(normalization="rmsnorm"), "--normalization must be LayerNorm or RMSNorm"),
    (dict(rotary_percent=1.5), r"--rotary-percent must be in \(0, 1\]"),
    (dict(rotary_base=0), "--rotary-base must be > 0"),
    (dict(num_query_groups=0), "--num-query-groups must be >= 1"),
    (dict(norm_epsilon=1e-6, layernorm_epsilon=1e-4), "name the same epsilon"),
    (dict(position_embedding_type="rope", reset_position_ids=True), "needs --reset-attention-mask"),
    (dict(swiglu=True, model_type="bert", vocab_file="v.txt"), "--swiglu: Llama's blocks are built for GPT only"),
    (dict(swiglu=True, hidden_size=16, num_attention_heads=2), "is 0; pass --ffn-hidden-size"),
])
def test_bad_blocks_are_refused_in_one_line(flags, needle):
    with pytest.raises(ValueError, match=needle):
        TINY.replace(**flags).validate(8)


def test_the_flags_have_megatron_cores_names():
    from mtx.cli import parse_config

    m = parse_config(["--position-embedding-type", "rope", "--rotary-base", "500000", "--rotary-percent", "0.5",
                      "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention",
                      "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                      "--ffn-hidden-size", "96"]).validate(8).model
    assert (m.rope, m.rotary_base, m.rotary_dim, m.normalization, m.epsilon, m.query_groups, m.ffn_size) == (
        True, 500000.0, 8, "RMSNorm", 1e-6, 2, 96)
    assert m.swiglu and not m.tied and m.disable_bias_linear and len(m.llama_blocks()) == 6
    assert parse_config(["--group-query-attention"]).model.query_groups == 1  # Megatron's default: one group
    assert ModelConfig(hidden_size=64, swiglu=True).ffn_size == 128  # Megatron's 8 / 3 rule, a multiple of 64


def test_checkpoints_move_between_meshes_with_the_groups_split_or_replicated(tmp_path):
    """Dropout on: saved with the 2 key/value groups split over TP 2, resumed with them replicated over TP 4 in 2
    pipeline stages, on the same trajectory."""
    base = dict(**LLAMA, hidden_dropout=0.1, attention_dropout=0.1, train_iters=4, save_interval=2, log_interval=1)
    ckpt = str(tmp_path / "ckpt")
    full = train(TINY.replace(**base, data_parallel_size=4, tensor_model_parallel_size=2, save=ckpt), progress=False)
    resumed = train(TINY.replace(**base, data_parallel_size=1, pipeline_model_parallel_size=2,
                                 tensor_model_parallel_size=4, load=ckpt, ckpt_step=2, run_dir=str(tmp_path / "r")),
                    progress=False)
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [full.losses[s] for s in (3, 4)], rtol=1e-5)
    from mtx.convert import to_hf

    with pytest.raises(ValueError, match="rotates 6 of each head's 8 dimensions .* LlamaForCausalLM rotates whole"):
        to_hf(ckpt, tmp_path / "hf")


def test_a_checkpoint_saved_before_the_new_fields_resumes(tmp_path):
    """A config.json without the new fields (as every checkpoint before them) is intact and means GPT-2's blocks."""
    ckpt = tmp_path / "old"
    base = dict(train_iters=4, save_interval=2, log_interval=1)
    full = train(TINY.replace(**base, save=str(ckpt)), progress=False)
    step_dir = ckpt / "2"
    (step_dir / MANIFEST).unlink()  # the file record would (rightly) see the edited config's size
    metadata = step_dir / "config" / "metadata"
    config = json.loads(metadata.read_text())
    config["model"] = {k: v for k, v in config["model"].items() if k not in ADDED_FIELDS}
    metadata.write_text(json.dumps(config))
    assert Config.from_dict(config).model == TINY.replace(vocab_size=257).model  # the byte tokenizer's
    resumed = train(TINY.replace(**base, load=str(ckpt), ckpt_step=2, run_dir=str(tmp_path / "r")), progress=False)
    assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]
