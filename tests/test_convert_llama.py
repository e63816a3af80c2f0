"""Hugging Face Llama <-> mtx conversion: a converted LlamaForCausalLM must compute HF's logits on every TP size, with
key/value groups split or replicated over "model", tied or untied, and come back bitwise.

As in tests/test_convert.py, the reference is an independent NumPy forward of HF's Llama (float64) on random weights,
so CI needs neither torch nor transformers; `test_matches_transformers` checks mtx, that reference and the export
against the real library where it is installed.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtx.architecture import ModelConfig
from mtx.convert import main, read_hf
from mtx.convert_llama import config_from_hf, config_to_hf, params_from_hf, params_to_hf, refuse_unconvertible
from mtx.loading import load_model
from mtx.parallel.ops import gather_from_model_parallel

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="pip install safetensors (the `hf` extra)")

L, D, N, F, S_MAX, VOCAB = 2, 64, 4, 96, 32, 1000
# Two key/value groups: split over TP 2, replicated over TP 4; as many groups as heads: mtx's fused QKV.
CASES = {"gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
         "mha_tied": dict(num_key_value_heads=N, tie_word_embeddings=True)}


def hf_config(**changes) -> dict:
    """A Llama config.json as transformers 4 writes it (rope_theta at the top; transformers 5's rope_parameters are
    what `test_matches_transformers` saves)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": D,
           "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": 2,
           "head_dim": D // N, "max_position_embeddings": S_MAX, "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
           "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
           "initializer_range": 0.02, "tie_word_embeddings": False, "vocab_size": VOCAB, "bos_token_id": 1,
           "eos_token_id": 2, "pretraining_tp": 1, "use_cache": True, "dtype": "float32"}
    return cfg | changes


def random_hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random LlamaForCausalLM weights in HF layout (torch's Linear: (out, in)); norm scales away from 1."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, mean=0.0: (mean + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    kv = hf["num_key_value_heads"] * D // N
    t = {"model.embed_tokens.weight": r(VOCAB, D), "model.norm.weight": r(D, mean=1.0)}
    if not hf["tie_word_embeddings"]:
        t["lm_head.weight"] = r(VOCAB, D)
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(D, mean=1.0), p + "post_attention_layernorm.weight": r(D, mean=1.0),
              p + "self_attn.q_proj.weight": r(D, D), p + "self_attn.k_proj.weight": r(kv, D),
              p + "self_attn.v_proj.weight": r(kv, D), p + "self_attn.o_proj.weight": r(D, D),
              p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
              p + "mlp.down_proj.weight": r(D, F)}
    return t


def write_hf(path, hf: dict, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    safetensors_numpy.save_file(tensors if tensors is not None else random_hf_tensors(hf),
                                str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def reference_logits(t: dict[str, np.ndarray], hf: dict, ids_BS: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's forward in float64 NumPy: RMSNorm, rotate_half rope, key/value heads repeated to the query
    heads, SwiGLU, the output layer lm_head or (tied) embed_tokens."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n, g, hd = hf["num_attention_heads"], hf["num_key_value_heads"], D // N
    b, s = ids_BS.shape
    angles = np.arange(s)[:, None] * hf["rope_theta"] ** (-np.arange(0, hd, 2) / hd)  # (S, H / 2)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

    def norm(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + hf["rms_norm_eps"]) * w

    def heads(x, count, rotate=True):  # (B, S, count H) -> (B, count, S, H), rotated
        x = x.reshape(b, s, count, hd).transpose(0, 2, 1, 3)
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin if rotate else x

    x = t["model.embed_tokens.weight"][ids_BS]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(L):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in t.items() if k.startswith(f"model.layers.{i}.")}
        h = norm(x, w["input_layernorm.weight"])
        q = heads(h @ w["self_attn.q_proj.weight"].T, n)
        k, v = (np.repeat(heads(h @ w[f"self_attn.{c}_proj.weight"].T, g, c == "k"), n // g, axis=1) for c in "kv")
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, D) @ w["self_attn.o_proj.weight"].T
        h = norm(x, w["post_attention_layernorm.weight"])
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return norm(x, t["model.norm.weight"]) @ head.T


def mtx_logits(model, params, ids_BS) -> np.ndarray:
    """Full (B, S, V_padded) logits of the sharded model (tied or untied output layer), gathered over "model"."""
    def local(params, ids):
        return gather_from_model_parallel(model.merge(params).attend(model.local_final_hidden(params, ids)))

    fn = jax.jit(jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, P()), out_specs=P()))
    return np.asarray(fn(model.forward_params(params), ids_BS))


def token_ids(b: int = 2, s: int = 16) -> np.ndarray:
    ids = np.random.default_rng(1).integers(0, VOCAB, (b, s), dtype=np.int32)
    ids[0, 0] = VOCAB - 1  # the last real id, next to the padding
    return ids


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(HF config, tensors, root with hf/ and the from-hf checkpoint ckpt/) of each case."""
    root = tmp_path_factory.mktemp(request.param)
    hf = hf_config(**CASES[request.param])
    tensors = random_hf_tensors(hf)
    write_hf(root / "hf", hf, tensors)
    assert main(["from-hf", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    return hf, tensors, root


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logits_match_llama_reference(converted, tp):
    hf, tensors, root = converted
    if tp != 2 and hf["tie_word_embeddings"]:
        pytest.skip("the tied, fused-QKV case runs at TP 2 only (the other layout runs every TP)")
    model, params = load_model(str(root / "ckpt"), tensor_model_parallel_size=tp)
    assert any(jax.tree.leaves(model.replicated_groups)) == (hf["num_key_value_heads"] < tp)
    logits = mtx_logits(model, params, token_ids())
    np.testing.assert_array_less(np.abs(logits[..., :VOCAB] - reference_logits(tensors, hf, token_ids())), 1e-4)
    assert not logits[..., VOCAB:].any(), "padded vocabulary rows must be zero"


def test_export_round_trip_is_exact(converted):
    hf, tensors, root = converted
    out = root / "back"
    assert main(["to-hf", "--load", str(root / "ckpt"), "--hf-dir", str(out)]) == 0
    back_hf, back = read_hf(out)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == np.float32 and np.array_equal(back[name], value), name
    tokens = ("bos_token_id", "eos_token_id")  # mtx keeps no special tokens; transformers' defaults apply
    assert {k: v for k, v in back_hf.items() if k not in tokens} == {k: v for k, v in hf.items() if k not in tokens}


@pytest.mark.parametrize("case", list(CASES))
def test_params_and_config_map_both_ways(case):
    """NumPy only: HF tensors -> mtx's layout (shapes of the model, head-ordered QKV, gate/up columns, zero padding)
    -> HF again bitwise; config.json -> ModelConfig -> config.json."""
    from mtx.parallel.mesh import make_mesh
    from mtx.sharded_model import ShardedModel

    hf = hf_config(**CASES[case], rope_scaling={"rope_type": "default"})
    cfg = config_from_hf(hf, seed=3)
    m = cfg.model
    groups = hf["num_key_value_heads"]
    assert (m.rope, m.rotary_base, m.rotary_dim, m.normalization, m.epsilon, m.swiglu, m.ffn_size) == (
        True, 5000.0, D // N, "RMSNorm", 1e-5, True, F)
    assert (m.group_query_attention, m.query_groups, m.tied, m.disable_bias_linear) == (
        groups < N, groups, hf["tie_word_embeddings"], True)
    assert cfg.training.seed == 3 and m.hidden_dropout == 0.0 and m.max_positions == S_MAX
    assert config_from_hf(config_to_hf(m)).model == m
    tensors = random_hf_tensors(hf)
    flat = params_from_hf(tensors | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}, m)
    model = ShardedModel(cfg.replace(data_parallel_size=1).validate(8), make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    shapes = {".".join(str(k.key) for k in path if hasattr(k, "key")): leaf.shape
              for path, leaf in jax.tree_util.tree_flatten_with_path(model.abstract_params)[0]}
    assert {k: v.shape for k, v in flat.items()} == shapes
    hd, w = D // N, tensors["model.layers.1.self_attn.k_proj.weight"]
    if m.group_query_attention:  # HF's rows (G, H) are mtx's columns as they are
        np.testing.assert_array_equal(flat["layers.attention.key.kernel"][1], w.T)
    else:  # head n's q, k, v side by side
        qkv = flat["layers.attention.qkv.kernel"][1].reshape(D, N, 3, hd)
        for n in range(N):
            np.testing.assert_array_equal(qkv[:, n, 1], w[n * hd:(n + 1) * hd].T)
    fc1 = flat["layers.mlp.fc1.kernel"][0]
    np.testing.assert_array_equal(fc1[:, 0], tensors["model.layers.0.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(fc1[:, 1], tensors["model.layers.0.mlp.up_proj.weight"].T)
    assert not flat["embedding.embedding"][VOCAB:].any() and flat["embedding.embedding"].shape[0] == 1024
    back = params_to_hf(flat, m)
    assert back.keys() == tensors.keys() and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    # transformers 5 keeps rope_theta in rope_parameters
    v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    assert config_from_hf(v5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}).model == m


def refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("changes,needle", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling of rope_type 'longrope'"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope_parameters of rope_type 'yarn'"),
    ({"rope_scaling": "linear"}, "rope_scaling 'linear', not an object"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"mlp_bias": True}, "mlp_bias true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 32}, "head_dim 32 but hidden_size / num_attention_heads is 16"),
    ({"intermediate_size": None}, "config.json lacks intermediate_size"),
    ({"num_key_value_heads": 3}, "config.json: num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"rms_norm_eps": -1.0}, "config.json: rms_norm_eps must be > 0"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings 'yes'; pass true or false"),
])
def test_what_mtx_cannot_compute_is_refused_in_one_line(tmp_path, capsys, changes, needle):
    hf = {k: v for k, v in (hf_config() | changes).items() if v is not None or k == "rope_scaling"}
    write_hf(tmp_path / "hf", hf, random_hf_tensors(hf_config()))
    assert re.search(re.escape(needle), refused(capsys, ["from-hf", "--hf-dir", str(tmp_path / "hf"),
                                                         "--save", str(tmp_path / "ckpt")]))
    assert not (tmp_path / "ckpt").exists()


def test_tensors_that_do_not_fit_are_refused_in_one_line(tmp_path, capsys):
    hf = hf_config()
    good = random_hf_tensors(hf)
    for name, tensors, config, needle in [
        ("nohead", {k: v for k, v in good.items() if k != "lm_head.weight"}, hf, "no tensor 'lm_head.weight'"),
        ("tied", good, hf | {"tie_word_embeddings": True}, "lm_head.weight differs from model.embed_tokens.weight"),
        ("shape", good | {"model.layers.1.self_attn.k_proj.weight": np.zeros((D, D), np.float32)}, hf,
         "'model.layers.1.self_attn.k_proj.weight' has shape (64, 64) but config.json implies (32, 64)"),
        ("extra", good | {"model.layers.2.mlp.up_proj.weight": good["model.layers.0.mlp.up_proj.weight"]}, hf,
         "unexpected tensors in the checkpoint (model.layers.2.mlp.up_proj.weight)")]:
        write_hf(tmp_path / name, config, tensors)
        line = refused(capsys, ["from-hf", "--hf-dir", str(tmp_path / name), "--save", str(tmp_path / "c")])
        assert needle in line, line
        assert not (tmp_path / "c").exists()


def test_bfloat16_checkpoints_are_read(tmp_path):
    """Llama checkpoints are mostly bfloat16, which NumPy reads only with ml_dtypes imported: read_hf does so itself
    (a fresh process, as this one has imported JAX and so ml_dtypes), and the weights widen to float32 exactly."""
    import subprocess
    import sys

    import ml_dtypes

    hf = hf_config()
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_hf_tensors(hf).items()}
    write_hf(tmp_path / "hf", hf, tensors)
    code = ("import sys; from mtx.convert import read_hf; t = read_hf(sys.argv[1])[1]; "
            "print(t['model.norm.weight'].dtype, len(t))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf")], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["bfloat16", str(len(tensors))]
    flat = params_from_hf(read_hf(tmp_path / "hf")[1], config_from_hf(hf).model)
    assert np.array_equal(flat["final_layernorm.scale"], tensors["model.norm.weight"].astype(np.float32))


def test_checkpoints_without_all_of_llamas_blocks_do_not_export():
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True)
    refuse_unconvertible(ModelConfig(**llama), "ckpt")
    with pytest.raises(ValueError, match=r"^--load ckpt was trained with --position-embedding-type rope, --swiglu, "
                       r"--disable-bias-linear but without --normalization RMSNorm; GPT2LMHeadModel"):
        refuse_unconvertible(ModelConfig(**(llama | {"normalization": "LayerNorm"})), "ckpt")
    with pytest.raises(ValueError, match="rotates 8 of each head's 16 dimensions"):
        refuse_unconvertible(ModelConfig(**llama, rotary_percent=0.5), "ckpt")


def test_matches_transformers(tmp_path):
    """The real LlamaForCausalLM: mtx's logits on TP 1, 2, 4 (groups split and replicated) and the NumPy reference
    within 1e-4, tied and untied; the export reloads with the same logits and the same tensors, bitwise."""
    torch = pytest.importorskip("torch", reason="torch not installed (pip install torch transformers to run this)")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    ids = token_ids()
    for case, changes in CASES.items():
        torch.manual_seed(0)
        hf = hf_config(**changes)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).float().eval()
        with torch.no_grad():  # default init has unit norm scales; perturb everything
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(tmp_path / case / "hf")

        def torch_logits(m):
            with torch.no_grad():
                return m(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()

        expected = torch_logits(model)
        _, tensors = read_hf(tmp_path / case / "hf")
        np.testing.assert_array_less(np.abs(reference_logits(tensors, hf, ids) - expected), 1e-4)
        assert main(["from-hf", "--hf-dir", str(tmp_path / case / "hf"), "--save", str(tmp_path / case / "c")]) == 0
        for tp in (1, 2, 4):
            mtx_model, params = load_model(str(tmp_path / case / "c"), tensor_model_parallel_size=tp)
            diff = np.abs(mtx_logits(mtx_model, params, ids)[..., :VOCAB] - expected)
            print(f"{case} TP {tp}: max |mtx - transformers| = {diff.max():.2e}")
            np.testing.assert_array_less(diff, 1e-4)
        assert main(["to-hf", "--load", str(tmp_path / case / "c"), "--hf-dir", str(tmp_path / case / "back")]) == 0
        _, back = read_hf(tmp_path / case / "back")
        assert back.keys() == tensors.keys() and all(np.array_equal(back[k], tensors[k]) for k in tensors)
        reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / case / "back").float().eval()
        np.testing.assert_array_equal(torch_logits(reloaded), expected)


def test_run_as_a_script_it_names_the_converter():
    """`python -m mtx.convert_llama ...` did nothing and exited 0; it names the command that converts."""
    proc = subprocess.run([sys.executable, "-m", "mtx.convert_llama", "--garbage"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "python -m mtx.convert from-hf" in proc.stderr
