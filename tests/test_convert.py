"""Hugging Face GPT-2 <-> mtx conversion: a converted model must compute GPT-2's logits on every TP size.

The reference is an independent NumPy GPT2LMHeadModel forward (float64) on random HF-format weights, so these tests
need neither torch nor transformers; `test_matches_transformers` repeats the check against the real library where it
is installed (the GPU machine).
"""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtx.architecture import ModelConfig
from mtx.convert import config_from_hf, config_to_hf, from_hf, main, params_from_hf, read_hf, to_hf
from mtx.loading import load_model
from mtx.parallel.ops import gather_from_model_parallel

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="pip install safetensors (the `hf` extra)")

L, D, N, S_MAX = 2, 64, 4, 32


def hf_config(vocab: int, **changes) -> dict:
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
           "n_layer": L, "n_embd": D, "n_head": N, "n_inner": None, "n_positions": S_MAX, "n_ctx": S_MAX,
           "vocab_size": vocab, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "resid_pdrop": 0.1,
           "embd_pdrop": 0.1, "attn_pdrop": 0.1, "bos_token_id": 50256, "eos_token_id": 50256,
           "tie_word_embeddings": True}
    return cfg | changes


def random_hf_tensors(vocab: int, seed: int = 0, prefix: str = "transformer.") -> dict[str, np.ndarray]:
    """Random GPT-2 weights in HF layout; LN scales and every bias are nonzero so a mis-mapped one shows."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, std=0.1, mean=0.0: (mean + std * rng.standard_normal(shape)).astype(np.float32)
    t = {"wte.weight": r(vocab, D), "wpe.weight": r(S_MAX, D), "ln_f.weight": r(D, mean=1.0), "ln_f.bias": r(D)}
    for i in range(L):
        h = f"h.{i}."
        t |= {h + "ln_1.weight": r(D, mean=1.0), h + "ln_1.bias": r(D), h + "ln_2.weight": r(D, mean=1.0),
              h + "ln_2.bias": r(D), h + "attn.c_attn.weight": r(D, 3 * D), h + "attn.c_attn.bias": r(3 * D),
              h + "attn.c_proj.weight": r(D, D), h + "attn.c_proj.bias": r(D),
              h + "mlp.c_fc.weight": r(D, 4 * D), h + "mlp.c_fc.bias": r(4 * D),
              h + "mlp.c_proj.weight": r(4 * D, D), h + "mlp.c_proj.bias": r(D)}
    return {prefix + k: v for k, v in t.items()}


def write_hf(path, vocab: int, *, config_changes=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(vocab, **(config_changes or {}))))
    safetensors_numpy.save_file(tensors if tensors is not None else random_hf_tensors(vocab),
                                str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def reference_logits(tensors: dict[str, np.ndarray], ids_BS: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """GPT2LMHeadModel's forward in float64 NumPy: pre-LN blocks, Conv1D x @ W + b, [q|k|v] split, tied head."""
    t = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in tensors.items()}
    n_layer = len({k.split(".")[1] for k in t if k.startswith("h.")})
    n_head, d = N, t["wte.weight"].shape[1]
    hd = d // n_head

    def ln(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    b, s = ids_BS.shape
    x = t["wte.weight"][ids_BS] + t["wpe.weight"][:s]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(n_layer):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ t[h + "attn.c_attn.weight"] + t[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(b, s, n_head, hd).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = x + ctx @ t[h + "attn.c_proj.weight"] + t[h + "attn.c_proj.bias"]
        m = gelu_new(ln(x, h + "ln_2") @ t[h + "mlp.c_fc.weight"] + t[h + "mlp.c_fc.bias"])
        x = x + m @ t[h + "mlp.c_proj.weight"] + t[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ t["wte.weight"].T


def mtx_logits(model, params, ids_BS) -> np.ndarray:
    """Full (B, S, V_padded) logits of the sharded model, vocab slices gathered over "model"."""
    def local(params, ids):
        hidden = model.local_final_hidden(params, ids)
        return gather_from_model_parallel(model.merge(params).embedding.attend(hidden))

    fn = jax.jit(jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, P()), out_specs=P()))
    return np.asarray(fn(model.forward_params(params), ids_BS))


def token_ids(vocab: int, b: int = 2, s: int = 16) -> np.ndarray:
    ids = np.random.default_rng(1).integers(0, vocab, (b, s), dtype=np.int32)
    ids[0, 0] = vocab - 1  # the last real id, next to the padding
    return ids


@pytest.fixture(scope="module", params=[1000, 50257], ids=["vocab1000", "vocab50257"])
def converted(request, tmp_path_factory):
    """(tensors, vocab, checkpoint dir) of a random HF GPT-2 converted with from-hf."""
    vocab = request.param
    root = tmp_path_factory.mktemp(f"hf{vocab}")
    tensors = random_hf_tensors(vocab)
    write_hf(root / "hf", vocab, tensors=tensors)
    assert main(["from-hf", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt"), "--seed", "7"]) == 0
    return tensors, vocab, root


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logits_match_gpt2_reference(converted, tp):
    tensors, vocab, root = converted
    model, params = load_model(str(root / "ckpt"), tensor_model_parallel_size=tp)
    assert model.mesh.shape["model"] == tp and model.cfg.training.seed == 7
    ids = token_ids(vocab)
    logits = mtx_logits(model, params, ids)
    assert logits.shape[-1] == model.cfg.model.padded_vocab_size > vocab
    np.testing.assert_array_less(np.abs(logits[..., :vocab] - reference_logits(tensors, ids)), 1e-4)
    assert not logits[..., vocab:].any(), "padded vocabulary rows must be zero"


def test_round_trip_is_exact(converted):
    tensors, vocab, root = converted
    out = root / f"back{vocab}"
    assert main(["to-hf", "--load", str(root / "ckpt"), "--hf-dir", str(out)]) == 0
    hf, back = read_hf(out)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == np.float32 and np.array_equal(back[name], value), name
    original = hf_config(vocab)
    assert {k: hf[k] for k in original if k != "bos_token_id" and k != "eos_token_id"} == \
        {k: v for k, v in original.items() if k != "bos_token_id" and k != "eos_token_id"}
    assert hf["eos_token_id"] == min(50256, vocab - 1) and hf["tie_word_embeddings"] is True
    assert config_from_hf(hf).model == config_from_hf(original).model
    # the weights as readable as config.json (safetensors wrote them 0600)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777


def test_the_epsilon_the_model_computes_with_is_exported():
    """--norm-epsilon (Megatron-Core's name) is the epsilon the layers use, whichever flag set it."""
    for m in (ModelConfig(norm_epsilon=0.01), ModelConfig(layernorm_epsilon=0.01)):
        assert config_to_hf(m)["layer_norm_epsilon"] == m.epsilon == 0.01
        assert config_from_hf(config_to_hf(m)).model.epsilon == 0.01


def test_names_without_prefix_and_tied_lm_head(tmp_path):
    tensors = random_hf_tensors(1000, prefix="")
    tensors["lm_head.weight"] = tensors["wte.weight"].copy()
    ref = params_from_hf(random_hf_tensors(1000), config_from_hf(hf_config(1000)).model)
    got = params_from_hf(tensors, config_from_hf(hf_config(1000)).model)
    assert ref.keys() == got.keys() and all(np.array_equal(ref[k], got[k]) for k in ref)


def test_qkv_columns_are_grouped_per_head():
    m = config_from_hf(hf_config(1000)).model
    tensors = random_hf_tensors(1000)
    w = tensors["transformer.h.1.attn.c_attn.weight"]  # (D, 3D): [q | k | v]
    qkv = params_from_hf(tensors, m)["layers.attention.qkv.kernel"][1].reshape(D, N, 3, D // N)
    hd = D // N
    for n in range(N):
        for j in range(3):  # head n's q, k, v sit together
            np.testing.assert_array_equal(qkv[:, n, j], w[:, j * D + n * hd: j * D + (n + 1) * hd])


def test_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        from_hf(tmp_path / "missing", tmp_path / "c0")
    write_hf(tmp_path / "relu", 1000, config_changes={"activation_function": "relu"})
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        from_hf(tmp_path / "relu", tmp_path / "c1")
    write_hf(tmp_path / "text_layers", 1000, config_changes={"n_layer": "2"})  # a config value of the wrong type:
    with pytest.raises(ValueError, match=r"^config.json: n_layer must be an integer, got '2'; fix config.json.$"):
        from_hf(tmp_path / "text_layers", tmp_path / "c1")  # the file's fix, not "the flag or the config file's"
    untied = random_hf_tensors(1000)
    untied["lm_head.weight"] = untied["transformer.wte.weight"] + 1.0
    write_hf(tmp_path / "untied", 1000, tensors=untied)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        from_hf(tmp_path / "untied", tmp_path / "c2")
    missing = random_hf_tensors(1000)
    del missing["transformer.h.1.mlp.c_fc.bias"]
    write_hf(tmp_path / "partial", 1000, tensors=missing)
    with pytest.raises(ValueError, match="no tensor 'h.1.mlp.c_fc.bias'"):
        from_hf(tmp_path / "partial", tmp_path / "c3")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        from_hf(tmp_path / "relu", tmp_path / "taken")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        to_hf(tmp_path / "c0", tmp_path / "taken")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        to_hf(tmp_path / "c0", tmp_path / "out")
    with pytest.raises(ValueError, match="--hf-dir is empty; pass a new model directory"):  # ". already exists" once
        to_hf(tmp_path / "c0", "")
    assert main(["from-hf", "--hf-dir", str(tmp_path / "missing"), "--save", str(tmp_path / "c4")]) == 2
    # config.json itself malformed: not JSON, not an object, a key missing, a value train.py would refuse
    for name, text, needle in [("notjson", "{n_layer: 2", "config.json is not valid JSON"),
                               ("list", "[1, 2]", "config.json is not a JSON object"),
                               ("nohead", {"n_head": None}, "config.json lacks n_head"),
                               ("heads", {"n_head": 7}, "config.json: n_embd 64 is not divisible by n_head 7"),
                               ("layers", {"n_layer": 0}, "config.json: n_layer must be >= 1")]:
        write_hf(tmp_path / name, 1000)
        if isinstance(text, dict):
            hf = json.loads((tmp_path / name / "config.json").read_text())
            hf.update(text)
            text = json.dumps({k: v for k, v in hf.items() if v is not None})
        (tmp_path / name / "config.json").write_text(text)
        with pytest.raises(ValueError, match=re.escape(needle)):
            from_hf(tmp_path / name, tmp_path / "c5")
    for e in ("c0", "c1", "c2", "c3", "c4", "c5", "out"):
        assert not (tmp_path / e).exists(), "a refused conversion must not leave a directory behind"


def test_damaged_or_mismatched_weights_are_one_line(tmp_path):
    """Weights that are cut, missing, outside the directory, of the wrong shape or kind: one line each, naming the
    file or tensor (tracebacks once, or a vocabulary of config.json's size whose other rows to-hf then dropped), and
    no --save directory left behind."""
    good = write_hf(tmp_path / "good", 1000)
    data = (good / "model.safetensors").read_bytes()
    cases = {"cut": (data[:1000], "model.safetensors cannot be read"), "empty": (b"", "cannot be read"),
             "noise": (bytes(range(256)) * 20, "cannot be read")}
    for name, (content, needle) in cases.items():
        write_hf(tmp_path / name, 1000)
        (tmp_path / name / "model.safetensors").write_bytes(content)
        with pytest.raises(ValueError, match=needle):
            from_hf(tmp_path / name, tmp_path / "c")
    for name, weight_map, needle in [("shard_missing", {"a": "model-00002-of-00002.safetensors"}, "which is missing"),
                                     ("shard_outside", {"a": "../good/model.safetensors"}, "not a file of the"),
                                     ("index_bad", None, "is not an index of shards")]:
        write_hf(tmp_path / name, 1000)
        index = tmp_path / name / "model.safetensors.index.json"
        index.write_text("{bad" if weight_map is None else json.dumps({"weight_map": weight_map}))
        with pytest.raises(ValueError, match=needle):
            from_hf(tmp_path / name, tmp_path / "c")
    tensors = random_hf_tensors(1000)
    for name, changed, config, needle in [
            ("vocab_small", {}, {"vocab_size": 100},
             r"wte.weight. has shape \(1000, 64\) but config.json implies \(100"),
            ("vocab_big", {"transformer.wte.weight": random_hf_tensors(1200)["transformer.wte.weight"]}, {},
             r"has shape \(1200, 64\)"),
            ("flat", {"transformer.wte.weight": tensors["transformer.wte.weight"].reshape(-1)}, {}, "has shape"),
            ("ints", {"transformer.ln_f.bias": np.zeros(D, np.int32)}, {}, "holds int32, not floating-point"),
            ("nan", {"transformer.ln_f.bias": np.full(D, np.nan, np.float32)}, {}, "holds NaN or inf"),
            ("width", {}, {"n_embd": 128}, "has shape")]:
        write_hf(tmp_path / name, 1000, tensors=tensors | changed, config_changes=config)
        with pytest.raises(ValueError, match=needle):
            from_hf(tmp_path / name, tmp_path / "c")
    assert not (tmp_path / "c").exists(), "a refused conversion must not leave a directory behind"
    # what is fine: a shard that is a link elsewhere (a Hugging Face cache snapshot), an older GPT-2's uint8 masks
    (tmp_path / "cache").mkdir()
    shutil.copy(good / "config.json", tmp_path / "cache" / "config.json")
    (tmp_path / "cache" / "model-00001-of-00001.safetensors").symlink_to(good / "model.safetensors")
    (tmp_path / "cache" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"wte.weight": "model-00001-of-00001.safetensors"}}))
    from_hf(tmp_path / "cache", tmp_path / "ok1")
    masks = {f"transformer.h.{i}.attn.bias": np.ones((1, 1, S_MAX, S_MAX), np.uint8) for i in range(L)}
    write_hf(tmp_path / "old", 1000, tensors=random_hf_tensors(1000) | masks)
    from_hf(tmp_path / "old", tmp_path / "ok2")


def test_matches_transformers(tmp_path):
    """The converted model against the real GPT2LMHeadModel, both ways (runs where torch + transformers exist)."""
    torch = pytest.importorskip("torch", reason="torch not installed (the GPU machine runs this test)")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (run on the GPU machine)")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=L, n_embd=D, n_head=N, n_positions=S_MAX, vocab_size=1000)).float().eval()
    with torch.no_grad():  # default init has zero biases and unit LN scales; perturb everything
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    ids = token_ids(1000)

    def torch_logits(m):
        with torch.no_grad():
            return m(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()

    expected = torch_logits(model)
    from_hf(tmp_path / "hf", tmp_path / "ckpt")
    for tp in (1, 2, 4):
        model, params = load_model(str(tmp_path / "ckpt"), tensor_model_parallel_size=tp)
        np.testing.assert_array_less(np.abs(mtx_logits(model, params, ids)[..., :1000] - expected), 1e-4)
    to_hf(tmp_path / "ckpt", tmp_path / "back")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").float().eval()
    np.testing.assert_array_less(np.abs(torch_logits(reloaded) - expected), 1e-5)


def test_eval_loss_matches_gpt2_reference(converted):
    """Converted weights must give GPT-2's own loss: padded vocabulary columns may not take probability mass."""
    tensors, vocab, root = converted
    model, params = load_model(str(root / "ckpt"), tensor_model_parallel_size=2)
    tokens = np.random.default_rng(2).integers(0, vocab, (model.mesh.shape["data"], 17), dtype=np.int32)
    logits = reference_logits(tensors, tokens[:, :-1])
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    expected = (log_z - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]).mean()
    assert abs(float(model.eval_loss(params, model.put_batch(tokens))) - expected) < 1e-5


def test_a_converted_checkpoint_is_taken_to_resume_at_any_batch_and_sequence_length(converted, shared_data, tmp_path):
    """A step-0 checkpoint has read no data: its converter's default batch and sequence length need not continue
    (--load of published weights was refused "its data and token count would not continue")."""
    from mtx.checkpoint import saved_step
    from mtx.run import prepare

    _, vocab, root = converted
    if vocab != 50257:
        pytest.skip("GPT-2's tokenizer reads the data: the 50,257-row checkpoint")
    saved = saved_step(root / "ckpt", None, "test")[1]
    data = shared_data / "tinyshakespeare" / "input.txt"
    plan = prepare(saved.replace(load=str(root / "ckpt"), run_dir=str(tmp_path / "r"), train_iters=1,
                                 global_batch_size=2 * saved.training.global_batch_size,
                                 seq_length=saved.model.seq_length // 2, data_path=(str(data),),
                                 vocab_file=str(shared_data / "gpt2" / "encoder.json"),
                                 merge_file=str(shared_data / "gpt2" / "vocab.bpe")))
    assert plan.load_step == 0 and plan.cfg.model.seq_length == saved.model.seq_length // 2
