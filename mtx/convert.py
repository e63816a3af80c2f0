"""Hugging Face GPT-2 and Llama <-> mtx checkpoints, so published weights can be fine-tuned, evaluated and shared back.

    python -m mtx.convert from-hf --hf-dir DIR --save CKPT [--seed N]   # config.json + model.safetensors -> orbax
    python -m mtx.convert to-hf --load CKPT --hf-dir OUT [--ckpt-step N]  # -> GPT2LMHeadModel / LlamaForCausalLM

config.json's model_type picks the family: gpt2 here, llama in mtx/convert_llama.py; on export, a checkpoint with
Llama's blocks (mtx/architecture.py) becomes a LlamaForCausalLM, one without a GPT2LMHeadModel. The rest is GPT-2's.

The two models compute the same function; only layouts differ. HF's Conv1D stores weights (in, out), as mtx's
`kernel` does, so linears copy straight across. Two things move: the fused QKV columns, which HF orders [q | k | v]
(each block (N, H)) and mtx orders (N, 3, H) so that a contiguous split over "model" gives each rank whole heads; and
the vocabulary, which mtx pads to a multiple of 1024 with zero rows (`ModelConfig.padded_vocab_size`). Per-layer
tensors `h.{i}.*` are stacked on mtx's leading L axis. `from-hf` writes a full TrainState at step 0 with a fresh
optimizer state, so `train.py --load`, eval.py and `mtx.loading.load_model` all read it. Local directories only.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np

from mtx.cli import OneLineParser, ranged
from mtx.config import Config, ModelConfig
from mtx.devices import devices
from mtx.errors import first_line
from mtx.files import check_writable, refuse_empty
from mtx.hf_checks import BUFFERS, check as _check, padded, validated

PREFIX = "transformer."
# HF name inside block h.{i} -> mtx name under `layers` (stacked over L).
LAYER_MAP = {
    "ln_1.weight": "ln1.scale", "ln_1.bias": "ln1.bias",
    "attn.c_attn.weight": "attention.qkv.kernel", "attn.c_attn.bias": "attention.qkv.bias",
    "attn.c_proj.weight": "attention.proj.kernel", "attn.c_proj.bias": "attention.proj.bias",
    "ln_2.weight": "ln2.scale", "ln_2.bias": "ln2.bias",
    "mlp.c_fc.weight": "mlp.fc1.kernel", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.kernel", "mlp.c_proj.bias": "mlp.fc2.bias",
}
GLOBAL_MAP = {"wte.weight": "embedding.embedding", "wpe.weight": "position_embeddings",
              "ln_f.weight": "final_layernorm.scale", "ln_f.bias": "final_layernorm.bias"}
# gelu_pytorch_tanh is the same tanh approximation as gelu_new (and as mtx's jax.nn.gelu(approximate=True)).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


# ---- config ----
def config_from_hf(hf: dict, *, seed: int | None = None) -> Config:
    """GPT-2 config.json -> an mtx Config with the same architecture (TP 1; other sizes are chosen at load)."""
    act = hf.get("activation_function", "gelu_new")
    _check(hf.get("model_type", "gpt2") == "gpt2",
           f"config.json has model_type {hf.get('model_type')!r}; only gpt2 and llama convert.")
    _check(act in TANH_GELUS, f"config.json has activation_function {act!r} but mtx uses the tanh GeLU; "
           "convert only gelu_new models.")
    _check(hf.get("scale_attn_weights", True) and not hf.get("scale_attn_by_inverse_layer_idx", False),
           "config.json changes the attention scale (scale_attn_weights / scale_attn_by_inverse_layer_idx); "
           "mtx supports only 1/sqrt(head dim).")
    _check(not hf.get("add_cross_attention", False), "config.json adds cross-attention; mtx GPT has none.")
    _check(hf.get("tie_word_embeddings", True), "config.json has tie_word_embeddings false; mtx ties lm_head "
           "to wte, so only tied models convert.")
    missing = [key for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size") if key not in hf]
    _check(not missing, f"config.json lacks {', '.join(missing)}; pass a GPT-2 config.json (save_pretrained).")
    values = dict(
        num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"), seq_length=hf["n_positions"], max_position_embeddings=hf["n_positions"],
        vocab_size=hf["vocab_size"], hidden_dropout=hf.get("resid_pdrop", 0.1),  # mtx uses it for embd_pdrop too
        attention_dropout=hf.get("attn_pdrop", 0.1), layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        init_method_std=hf.get("initializer_range", 0.02), tensor_model_parallel_size=1)
    return validated(values, _HF_KEYS, seed)


_HF_KEYS = {"--num-layers": "n_layer", "--hidden-size": "n_embd", "--num-attention-heads": "n_head",
            "--ffn-hidden-size": "n_inner", "--max-position-embeddings": "n_positions", "--seq-length": "n_positions",
            "--vocab-size": "vocab_size", "--hidden-dropout": "resid_pdrop", "--attention-dropout": "attn_pdrop",
            "--layernorm-epsilon": "layer_norm_epsilon", "--init-method-std": "initializer_range"}


def config_to_hf(m: ModelConfig) -> dict:
    """An mtx ModelConfig -> the config.json of the equivalent GPT2LMHeadModel."""
    eos = min(50256, m.vocab_size - 1)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": m.vocab_size, "n_positions": m.max_positions, "n_ctx": m.max_positions,
        "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
        "n_inner": None if m.ffn_size == 4 * m.hidden_size else m.ffn_size,
        "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
        "layer_norm_epsilon": m.epsilon, "initializer_range": m.init_method_std,
        "summary_type": "cls_index", "summary_use_proj": True, "summary_activation": None,
        "summary_proj_to_labels": True, "summary_first_dropout": 0.1,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "use_cache": True, "bos_token_id": eos, "eos_token_id": eos, "tie_word_embeddings": True,
        "dtype": "float32",
    }


# ---- tensors ----
def _qkv_from_hf(x, n_heads: int):
    """(..., 3D) columns [q | k | v], each (N, H) -> mtx's (N, 3, H) order."""
    lead = x.shape[:-1]
    return x.reshape(*lead, 3, n_heads, -1).swapaxes(-3, -2).reshape(*lead, -1)


def _qkv_to_hf(x, n_heads: int):
    """(..., 3D) columns in mtx's (N, 3, H) order -> HF's [q | k | v]."""
    lead = x.shape[:-1]
    return x.reshape(*lead, n_heads, 3, -1).swapaxes(-3, -2).reshape(*lead, -1)


def params_from_hf(tensors: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """HF state dict (with or without the `transformer.` prefix) -> flat mtx params {dotted name: float32 array}."""
    t = {k.removeprefix(PREFIX): np.asarray(v, np.float32) for k, v in tensors.items()}
    lm_head = t.pop("lm_head.weight", None)
    for k in [k for k in t if k.endswith(BUFFERS)]:
        del t[k]  # h.{i}.attn.bias / masked_bias: causal-mask buffers of older HF versions, not weights
    if lm_head is not None and "wte.weight" in t:
        _check(lm_head.shape == t["wte.weight"].shape and np.array_equal(lm_head, t["wte.weight"]),
               "lm_head.weight differs from transformer.wte.weight; mtx ties the output layer, so only tied "
               "GPT-2 models convert.")
    out = {}
    for hf_name, name in GLOBAL_MAP.items():
        out[name] = _take(t, hf_name)
    for hf_name, name in LAYER_MAP.items():
        out["layers." + name] = np.stack([_take(t, f"h.{i}.{hf_name}") for i in range(m.num_layers)])
    _check(not t, f"unexpected tensors in the checkpoint ({', '.join(sorted(t)[:3])}); is it a GPT-2 with "
           f"n_layer {m.num_layers}?")
    for k in ("layers.attention.qkv.kernel", "layers.attention.qkv.bias"):
        out[k] = _qkv_from_hf(out[k], m.num_attention_heads)
    wte = out["embedding.embedding"]
    _check(wte.shape == (m.vocab_size, m.hidden_size), f"tensor 'transformer.wte.weight' has shape {wte.shape} but "
           f"config.json implies ({m.vocab_size}, {m.hidden_size}) (vocab_size, n_embd); check config.json against "
           "the weights.")  # extra rows would land in the padding that to-hf cuts off; missing ones, in it too
    out["embedding.embedding"] = padded(wte, m.padded_vocab_size)
    return out


def params_to_hf(params: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """Flat mtx params -> a GPT2LMHeadModel state dict (Conv1D layout, unpadded vocab, lm_head tied so omitted)."""
    p = {k: np.asarray(v, np.float32) for k, v in params.items()}
    for k in ("layers.attention.qkv.kernel", "layers.attention.qkv.bias"):
        p[k] = _qkv_to_hf(p[k], m.num_attention_heads)
    p["embedding.embedding"] = p["embedding.embedding"][:m.vocab_size]
    out = {PREFIX + hf_name: p[name] for hf_name, name in GLOBAL_MAP.items()}
    for hf_name, name in LAYER_MAP.items():
        for i in range(m.num_layers):
            out[f"{PREFIX}h.{i}.{hf_name}"] = p["layers." + name][i]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _take(t: dict, name: str) -> np.ndarray:
    _check(name in t, f"the checkpoint has no tensor {name!r}; pass a GPT-2 (GPT2LMHeadModel) directory.")
    return t.pop(name)


# ---- files ----
def read_hf(hf_dir: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, tensors) of a local HF model directory: model.safetensors (sharded or not), else
    pytorch_model.bin when torch is installed."""
    d = Path(hf_dir)
    _check(d.is_dir(), f"--hf-dir {d}: no such directory; pass a local Hugging Face model directory.")
    _check((d / "config.json").is_file(), f"--hf-dir {d} has no config.json; pass a Hugging Face model directory.")
    try:
        hf = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ValueError(f"--hf-dir {d}: config.json is not valid JSON ({e}); pass a Hugging Face model "
                         "directory.") from None
    _check(isinstance(hf, dict), f"--hf-dir {d}: config.json is not a JSON object; pass a Hugging Face model "
           "directory.")
    index = d / "model.safetensors.index.json"
    files = (_shards(d, index) if index.is_file()
             else ["model.safetensors"] if (d / "model.safetensors").is_file() else [])
    if files:
        tensors = {k: v for f in files for k, v in _read_safetensors(d, f).items()}
    elif (d / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise ValueError(f"--hf-dir {d} holds only pytorch_model.bin and torch is not installed; install torch "
                             "or re-save the model with safetensors.") from None
        state = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in state.items()}
    else:
        raise ValueError(f"--hf-dir {d} has neither model.safetensors nor pytorch_model.bin; pass a directory "
                         "written by save_pretrained.")
    for name, x in tensors.items():  # ints would convert silently; NaN or inf would train and evaluate as NaN
        if name.endswith(BUFFERS):
            continue
        _check(x.dtype.kind == "f" or x.dtype.name == "bfloat16", f"--hf-dir {d}: tensor {name!r} holds {x.dtype}, "
               "not floating-point weights; pass the model as save_pretrained wrote it.")
        _check(bool(np.isfinite(x.astype(np.float32)).all()), f"--hf-dir {d}: tensor {name!r} holds NaN or inf; "
               "pass a model with finite weights.")
    return hf, tensors


def _shards(d: Path, index: Path) -> list[str]:
    """The shard files model.safetensors.index.json names: each a file of the directory itself."""
    try:
        shards = json.loads(index.read_text())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--hf-dir {d}: {index.name} is not an index of shards (a JSON object with a weight_map; "
                         f"{type(e).__name__}: {first_line(e)}); pass the directory as save_pretrained wrote it."
                         ) from None
    files = sorted({str(f) for f in shards})
    for f in files:  # a name, no path: the files of a Hugging Face cache snapshot are links, which may point anywhere
        _check(Path(f).name == f and f not in ("", ".", ".."), f"--hf-dir {d}: {index.name} names {f!r}, not a "
               "file of the directory; pass the directory as save_pretrained wrote it.")
        _check((d / f).is_file(), f"--hf-dir {d}: {index.name} names {f}, which is missing; copy every shard of "
               "the model into the directory.")
    return files


def _read_safetensors(d: Path, name: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    importlib.import_module("ml_dtypes")  # NumPy reads bfloat16 (most Llama checkpoints) once it is imported
    try:
        return load_file(d / name)
    except Exception as e:  # safetensors' own errors: a cut, emptied or overwritten file
        raise ValueError(f"--hf-dir {d}: {name} cannot be read ({type(e).__name__}: {first_line(e)}); pass the "
                         "model as save_pretrained wrote it.") from None


def _state_with_params(model, flat: dict[str, np.ndarray]):
    """A step-0 TrainState holding `flat` params, a fresh optimizer state and loss scale, in the mesh's shardings."""
    import jax

    from mtx.state import state_with_params

    def place(path, leaf, sharding):
        name = _param_name(path)
        _check(flat[name].shape == leaf.shape, f"tensor {name} has shape {flat[name].shape} but the config "
               f"expects {leaf.shape}; check config.json against the weights.")
        return jax.device_put(flat[name].astype(leaf.dtype), sharding)

    params = jax.tree_util.tree_map_with_path(place, model.abstract_params, model.param_shardings)
    return state_with_params(model, params)


def _param_name(path) -> str:
    """A params tree path (['layers']['ln1']['scale'].value) -> 'layers.ln1.scale'."""
    return ".".join(str(k.key) for k in path if hasattr(k, "key"))


def from_hf(hf_dir: str | Path, save: str | Path, *, seed: int | None = None) -> Config:
    """Converts a local HF GPT-2 or Llama directory into an mtx checkpoint (step 0) in `save`; returns its Config."""
    import jax

    from mtx.checkpoint import Checkpointer
    from mtx.parallel.mesh import make_mesh
    from mtx.sharded_model import ShardedModel

    _check_fresh(save, "--save", "checkpoint")
    hf, tensors = read_hf(hf_dir)
    family = _family(hf.get("model_type"))
    cfg = family.config_from_hf(hf, seed=seed)
    flat = family.params_from_hf(tensors, cfg.model)
    model = ShardedModel(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    state = _state_with_params(model, flat)  # its shape checks before --save is made: no empty directory left
    ckpt = Checkpointer(save)
    try:
        ckpt.save(state, cfg)
        ckpt.wait()
    finally:
        ckpt.close()
    return cfg


def to_hf(load: str | Path, hf_dir: str | Path, *, ckpt_step: int | None = None) -> None:
    """Writes the mtx checkpoint in `load` as a GPT2LMHeadModel or, with Llama's blocks, a LlamaForCausalLM directory
    (config.json + model.safetensors)."""
    import jax
    from safetensors.numpy import save_file

    from mtx.checkpoint import saved_step
    from mtx.loading import load_model

    _check_fresh(hf_dir, "--hf-dir", "model")
    step, saved = saved_step(load, ckpt_step, "--save or by from-hf")
    model_cfg = saved.model  # (load_model turns dropout off; config.json keeps the trained values)
    _check(not model_cfg.is_bert, f"--load {load} holds a BERT model; to-hf writes causal language models only "
           "(GPT2LMHeadModel, LlamaForCausalLM).")
    llama = bool(model_cfg.llama_blocks())
    family = _family("llama" if llama else "gpt2")
    if llama:
        family.refuse_unconvertible(model_cfg, load)
    _, params = load_model(str(load), tensor_model_parallel_size=1, data_parallel_size=1, ckpt_step=step)
    flat = {_param_name(path): np.asarray(jax.device_get(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    out = Path(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(family.params_to_hf(flat, model_cfg), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(family.config_to_hf(model_cfg), indent=2) + "\n")
    # readable as config.json is (safetensors writes its files 0600)
    (out / "model.safetensors").chmod((out / "config.json").stat().st_mode & 0o777)


def _family(model_type):
    """The module that maps a config.json model_type: this one for gpt2, mtx/convert_llama.py for llama."""
    if model_type == "llama":
        from mtx import convert_llama  # imported here: it builds on this module

        return convert_llama
    return sys.modules[__name__]  # gpt2, or refused by name in config_from_hf


def _check_fresh(path: str | Path, flag: str, what: str) -> None:
    refuse_empty(str(path), flag, f"a new {what} directory")  # "." once
    p = Path(path)
    _check(not (p.exists() and (not p.is_dir() or any(p.iterdir()))),
           f"{flag} {p} already exists and is not empty; choose a new {what} directory.")
    check_writable(p, flag)  # not through a file, a link to nothing or a read-only place


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m mtx.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face GPT-2 or Llama directory -> mtx checkpoint")
    a.add_argument("--hf-dir", required=True, help="local directory with config.json and model.safetensors")
    a.add_argument("--save", required=True, help="new mtx checkpoint directory")
    a.add_argument("--seed", type=ranged(int, ">= 0"), default=None,
                   help="training seed stored in the checkpoint's config")
    b = sub.add_parser("to-hf", help="mtx checkpoint -> Hugging Face GPT2LMHeadModel or LlamaForCausalLM directory")
    b.add_argument("--load", required=True, help="mtx checkpoint directory")
    b.add_argument("--hf-dir", required=True, help="new output directory")
    b.add_argument("--ckpt-step", type=ranged(int, ">= 0"), default=None, help="step to convert (default: latest)")
    try:
        args = parser.parse_args(argv)
        devices()  # a backend JAX cannot start (JAX_PLATFORMS, XLA_FLAGS): one line, not a traceback
        if args.command == "from-hf":
            cfg = from_hf(args.hf_dir, args.save, seed=args.seed)
            m = cfg.model
            family = f"Llama G={m.query_groups} F={m.ffn_size}" if m.llama_blocks() else "GPT-2"
            print(f"wrote {args.save}: {family} L={m.num_layers} D={m.hidden_size} N={m.num_attention_heads} "
                  f"V={m.vocab_size} (padded {m.padded_vocab_size}), step 0")
        else:
            to_hf(args.load, args.hf_dir, ckpt_step=args.ckpt_step)
            print(f"wrote {args.hf_dir}: config.json + model.safetensors")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
