"""benchmarks/torch_llama.py is a fair baseline only if it is mtx's Llama: the same parameter count (so the same
FLOPs, padded vocabulary included) and the same loss on the same weights. Skipped where torch is not installed (CI)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks.torch_llama import Llama, flops_per_token  # noqa: E402
from mtx.config import Config  # noqa: E402
from mtx.convert import _param_name  # noqa: E402
from mtx.convert_llama import params_to_hf  # noqa: E402
from mtx.parallel.mesh import make_mesh  # noqa: E402
from mtx.presets import load_preset  # noqa: E402
from mtx.step import TrainStep  # noqa: E402

L, D, N, G, F, S, VOCAB = 2, 64, 4, 2, 96, 32, 256
BLOCKS = dict(position_embedding_type="rope", rotary_base=10000.0, normalization="RMSNorm", norm_epsilon=1e-5,
              swiglu=True, group_query_attention=True, disable_bias_linear=True, hidden_dropout=0.0,
              attention_dropout=0.0)


def tiny(untied: bool) -> Config:
    return Config().replace(**BLOCKS, num_layers=L, hidden_size=D, num_attention_heads=N, num_query_groups=G,
                            ffn_hidden_size=F, seq_length=S, vocab_size=VOCAB, micro_batch_size=2,
                            global_batch_size=2, untie_embeddings_and_output_weights=untied, data_parallel_size=1,
                            tensor_model_parallel_size=1, pipeline_model_parallel_size=1).validate(1)


def torch_llama(m, untied: bool) -> Llama:
    return Llama(m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size, m.seq_length,
                 m.vocab_size, base=m.rotary_base, eps=m.epsilon, untied=untied)


@pytest.mark.parametrize("untied", [False, True])
def test_parameters_and_flops_are_mtxs(untied):
    m = tiny(untied).model
    model = torch_llama(m, untied)
    assert sum(p.numel() for p in model.parameters()) == m.num_params()
    assert flops_per_token(model, L, D, S) == m.flops_per_token()


def test_the_1b_preset_has_mtxs_parameters():
    m = Config().replace(**load_preset("configs/llama_1b.toml")).model
    with torch.device("meta"):  # shapes only: no 5 GB of weights
        model = Llama(m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size, 8,
                      m.vocab_size, base=m.rotary_base, eps=m.epsilon)
    assert sum(p.numel() for p in model.parameters()) == m.num_params() == 1_237_387_264


@pytest.mark.parametrize("untied", [False, True])
def test_loss_is_mtxs_on_the_same_weights(untied):
    """mtx's weights copied into the torch model (through the HF layout); float32 on CPU. The initialized weights
    are pushed far from init (std 0.02 gives a loss of ln V whatever the blocks), so every block counts."""
    cfg = tiny(untied)
    train_step = TrainStep.build(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    state = train_step.init_state()
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, S + 1)).astype(np.int32)
    tokens[0, 5] = VOCAB - 1  # the last real id, next to the padding
    loss, _ = jax.jit(train_step.loss_and_grads)(params, train_step.model.put_batch(tokens), state.step)
    flat = {_param_name(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    model = torch_llama(cfg.model, untied).load_hf(params_to_hf(flat, cfg.model))
    idx = torch.as_tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        got = float(model(idx[:, :-1], idx[:, 1:]))
    assert got == pytest.approx(float(loss), abs=1e-4) and abs(got - np.log(VOCAB)) > 0.1
