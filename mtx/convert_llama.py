"""Hugging Face Llama (LlamaForCausalLM) <-> mtx: the config and tensor mappings that `python -m mtx.convert` uses
when config.json has model_type "llama" (or the checkpoint has Llama's blocks).

mtx's Llama blocks (mtx/architecture.py) compute HF's function, so only layouts move. torch's Linear stores
(out, in) and mtx's kernels (in, out): every projection is transposed. HF's q/k/v/o rows are head-major, (N, H) and
(G, H), which is already mtx's order for grouped-query attention (query head i uses group i // (N / G) in both), so
a contiguous split over "model" gives each rank whole heads and their groups. Without key/value groups
(num_key_value_heads = num_attention_heads) mtx fuses q, k and v into one kernel ordered (N, 3, H). SwiGLU's gate and
up matrices become fc1's (D, 2, F), gate first, whose F columns split alike. Rotary positions need no permutation:
mtx rotates halves (i, i + H / 2) as HF's rotate_half does, and HF's rope_type llama3 (Llama 3.1 and 3.2) is
mtx's --use-rope-scaling. The vocabulary is padded with zero rows (input and untied output table) and cut back on
export.
"""

from __future__ import annotations

import sys

import numpy as np

from mtx.config import Config, ModelConfig
from mtx.hf_checks import BUFFERS, check as _check, padded, validated

PREFIX = "model."
_HF_KEYS = {"--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size",
            "--num-attention-heads": "num_attention_heads", "--ffn-hidden-size": "intermediate_size",
            "--max-position-embeddings": "max_position_embeddings", "--seq-length": "max_position_embeddings",
            "--vocab-size": "vocab_size", "--attention-dropout": "attention_dropout", "--norm-epsilon": "rms_norm_eps",
            "--init-method-std": "initializer_range", "--num-query-groups": "num_key_value_heads",
            "--rotary-base": "rope_theta", "--rope-scaling-factor": "rope_scaling factor",
            "--rope-scaling-low-freq-factor": "rope_scaling low_freq_factor",
            "--rope-scaling-high-freq-factor": "rope_scaling high_freq_factor",
            "--rope-scaling-original-max-position-embeddings": "rope_scaling original_max_position_embeddings"}
# rope_type llama3's keys (Llama 3.1 and 3.2) -> mtx's fields of --use-rope-scaling
_LLAMA3 = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
           "high_freq_factor": "rope_scaling_high_freq_factor",
           "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


# ---- config ----
def config_from_hf(hf: dict, *, seed: int | None = None) -> Config:
    """Llama config.json -> an mtx Config with the same architecture (TP 1; other sizes are chosen at load). What
    mtx's blocks cannot compute is refused in one line naming the HF key."""
    act = hf.get("hidden_act", "silu")
    _check(act == "silu", f"config.json has hidden_act {act!r}; mtx's SwiGLU gates with silu, so only silu Llama "
           "models convert.")
    for key in ("attention_bias", "mlp_bias"):
        _check(not hf.get(key, False), f"config.json has {key} true; mtx's Llama blocks have no biases "
               "(--disable-bias-linear), so only models without them convert.")
    rope = _rope(hf)
    missing = [key for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                               "max_position_embeddings", "vocab_size") if hf.get(key) is None]
    _check(not missing, f"config.json lacks {', '.join(missing)}; pass a Llama config.json (save_pretrained).")
    tied = hf.get("tie_word_embeddings", False)  # HF Llama's default: an lm_head of its own
    _check(isinstance(tied, bool), f"config.json has tie_word_embeddings {tied!r}; pass true or false.")
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads")
    grouped = groups is not None and groups != heads  # as many groups as heads is multi-head attention
    values = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        position_embedding_type="rope", **rope, normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, group_query_attention=grouped,
        num_query_groups=groups if grouped else None, disable_bias_linear=True,
        untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02), tensor_model_parallel_size=1)
    cfg = validated(values, _HF_KEYS, seed)
    head_dim = hf.get("head_dim")
    _check(head_dim in (None, cfg.model.head_dim), f"config.json has head_dim {head_dim!r} but hidden_size / "
           f"num_attention_heads is {cfg.model.head_dim}; mtx's heads are D / N wide.")
    return cfg


def _rope(hf: dict) -> dict:
    """mtx's rope fields from rope_theta and rope_scaling (transformers 4) or rope_parameters (transformers 5):
    plain or Llama 3.1's llama3 frequencies; other scalings (linear, dynamic, yarn, longrope) refused."""
    parameters = hf.get("rope_parameters") or {}
    fields = {"rotary_base": hf.get("rope_theta", parameters.get("rope_theta", 10000.0))}
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key) or {}
        _check(isinstance(rope, dict), f"config.json has {key} {rope!r}, not an object; pass a Llama config.json.")
        kind = rope.get("rope_type", rope.get("type", "default"))
        _check(kind in ("default", "llama3"), f"config.json has {key} of rope_type {kind!r}; mtx scales rotary "
               "frequencies only as Llama 3.1 does, so only rope_type default or llama3 converts.")
        factor = rope.get("partial_rotary_factor", 1.0)
        _check(factor == 1.0, f"config.json has {key} with partial_rotary_factor {factor!r}; LlamaForCausalLM "
               "rotates whole heads.")
        if kind == "llama3":
            missing = [k for k in _LLAMA3 if rope.get(k) is None]
            _check(not missing, f"config.json's {key} of rope_type 'llama3' lacks {', '.join(missing)}; pass the "
                   "model's own config.json.")
            fields |= {"use_rope_scaling": True} | {field: rope[k] for k, field in _LLAMA3.items()}
    return fields


def config_to_hf(m: ModelConfig) -> dict:
    """An mtx ModelConfig with Llama's blocks -> the config.json of the equivalent LlamaForCausalLM (check first with
    `refuse_unconvertible`)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.query_groups, "head_dim": m.head_dim, "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.epsilon, "rope_theta": m.rotary_base, "rope_scaling": _rope_scaling(m),
        "attention_bias": False, "mlp_bias": False, "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_method_std, "tie_word_embeddings": m.tied, "pretraining_tp": 1,
        "use_cache": True, "dtype": "float32",
    }


def _rope_scaling(m: ModelConfig) -> dict | None:
    """--use-rope-scaling as HF's rope_scaling of rope_type llama3 (transformers 5 reads it into rope_parameters)."""
    if not m.use_rope_scaling:
        return None
    return {"rope_type": "llama3"} | {k: getattr(m, field) for k, field in _LLAMA3.items()}


def refuse_unconvertible(m: ModelConfig, load) -> None:
    """One line if the checkpoint in `load` (with some of Llama's blocks) is not a LlamaForCausalLM."""
    needed = {"--position-embedding-type rope": m.rope, "--normalization RMSNorm": m.normalization == "RMSNorm",
              "--swiglu": m.swiglu, "--disable-bias-linear": m.disable_bias_linear}
    lacking = [flag for flag, on in needed.items() if not on]
    _check(not lacking, f"--load {load} was trained with {', '.join(m.llama_blocks())} but without "
           f"{', '.join(lacking)}; GPT2LMHeadModel has none of these blocks and LlamaForCausalLM needs all of them.")
    _check(m.rotary_dim == m.head_dim, f"--load {load} rotates {m.rotary_dim} of each head's {m.head_dim} dimensions "
           f"(--rotary-percent {m.rotary_percent}); LlamaForCausalLM rotates whole heads.")


# ---- tensors ----
def params_from_hf(tensors: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """LlamaForCausalLM state dict -> flat mtx params {dotted name: float32 array}; shapes checked against `m`."""
    t = {k.removeprefix(PREFIX): np.asarray(v, np.float32) for k, v in tensors.items() if not k.endswith(BUFFERS)}
    hf_name = {k.removeprefix(PREFIX): k for k in tensors}
    d, f, v, n_layers = m.hidden_size, m.ffn_size, m.vocab_size, m.num_layers
    q_cols, kv_cols = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    lm_head = t.pop("lm_head.weight", None)
    out = {"embedding.embedding": padded(_take(t, "embed_tokens.weight", (v, d)), m.padded_vocab_size),
           "final_layernorm.scale": _take(t, "norm.weight", (d,))}
    if m.tied:
        _check(lm_head is None or np.array_equal(lm_head, out["embedding.embedding"][:v]), "lm_head.weight differs "
               "from model.embed_tokens.weight but config.json has tie_word_embeddings true; fix one of the two.")
    else:
        _check(lm_head is not None, "the checkpoint has no tensor 'lm_head.weight' and config.json has "
               "tie_word_embeddings false; pass the whole LlamaForCausalLM directory.")
        _check(lm_head.shape == (v, d), f"tensor 'lm_head.weight' has shape {lm_head.shape} but config.json "
               f"implies {(v, d)}; check config.json against the weights.")
        out["output_layer.embedding"] = padded(lm_head, m.padded_vocab_size)

    def layers(name, shape):  # (L, *shape), torch's Linear (out, in) turned into mtx's (in, out)
        stacked = np.stack([_take(t, f"layers.{i}.{name}", shape) for i in range(n_layers)])
        return stacked.swapaxes(-1, -2) if len(shape) == 2 else stacked

    out["layers.ln1.scale"] = layers("input_layernorm.weight", (d,))
    out["layers.ln2.scale"] = layers("post_attention_layernorm.weight", (d,))
    q = layers("self_attn.q_proj.weight", (q_cols, d))
    k, val = (layers(f"self_attn.{x}_proj.weight", (kv_cols, d)) for x in "kv")
    if m.group_query_attention:
        out |= {"layers.attention.query.kernel": q, "layers.attention.key.kernel": k,
                "layers.attention.value.kernel": val}
    else:  # columns (N, 3, H): each head's q, k and v side by side
        heads = [a.reshape(n_layers, d, m.num_attention_heads, m.head_dim) for a in (q, k, val)]
        out["layers.attention.qkv.kernel"] = np.stack(heads, axis=-2).reshape(n_layers, d, 3 * q_cols)
    out["layers.attention.proj.kernel"] = layers("self_attn.o_proj.weight", (d, q_cols))
    out["layers.mlp.fc1.kernel"] = np.stack([layers("mlp.gate_proj.weight", (f, d)),
                                             layers("mlp.up_proj.weight", (f, d))], axis=-2)
    out["layers.mlp.fc2.kernel"] = layers("mlp.down_proj.weight", (d, f))
    unexpected = sorted(hf_name[k] for k in t)
    _check(not t, f"unexpected tensors in the checkpoint ({', '.join(unexpected[:3])}); is it a LlamaForCausalLM "
           f"with num_hidden_layers {n_layers}?")
    return out


def params_to_hf(params: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """Flat mtx params -> a LlamaForCausalLM state dict (unpadded vocabulary; lm_head omitted when tied, as
    save_pretrained does)."""
    p = {k: np.asarray(v, np.float32) for k, v in params.items()}
    v, n_layers, d = m.vocab_size, m.num_layers, m.hidden_size
    out = {"model.embed_tokens.weight": p["embedding.embedding"][:v], "model.norm.weight": p["final_layernorm.scale"]}
    if not m.tied:
        out["lm_head.weight"] = p["output_layer.embedding"][:v]
    if m.group_query_attention:
        q, k, val = (p[f"layers.attention.{x}.kernel"] for x in ("query", "key", "value"))
    else:
        qkv = p["layers.attention.qkv.kernel"].reshape(n_layers, d, m.num_attention_heads, 3, m.head_dim)
        q, k, val = (qkv[..., j, :].reshape(n_layers, d, -1) for j in range(3))
    fc1 = p["layers.mlp.fc1.kernel"]
    linears = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": val,
               "self_attn.o_proj": p["layers.attention.proj.kernel"], "mlp.gate_proj": fc1[:, :, 0],
               "mlp.up_proj": fc1[:, :, 1], "mlp.down_proj": p["layers.mlp.fc2.kernel"]}
    norms = {"input_layernorm": p["layers.ln1.scale"], "post_attention_layernorm": p["layers.ln2.scale"]}
    for i in range(n_layers):
        out |= {f"model.layers.{i}.{name}.weight": w[i].T for name, w in linears.items()}
        out |= {f"model.layers.{i}.{name}.weight": w[i] for name, w in norms.items()}
    return {k: np.ascontiguousarray(x) for k, x in out.items()}


def _take(t: dict, name: str, shape: tuple) -> np.ndarray:
    _check(name in t, f"the checkpoint has no tensor {PREFIX + name!r}; pass a LlamaForCausalLM directory.")
    x = t.pop(name)
    _check(x.shape == shape, f"tensor {PREFIX + name!r} has shape {x.shape} but config.json implies {shape}; check "
           "config.json against the weights.")
    return x


if __name__ == "__main__":  # the converter's command line is mtx.convert's: refuse in one line, not silently
    print("error: mtx.convert_llama is the Llama half of the converter; run python -m mtx.convert from-hf or to-hf "
          "(it reads the model type from config.json).", file=sys.stderr)
    sys.exit(2)
