"""What several test files share: one step's loss and every gradient on a mesh, and Llama's blocks as flags."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtx.parallel.mesh import make_mesh
from mtx.state import state_shardings
from mtx.step import TrainStep

# Llama's blocks as Megatron-Core's flags (the key/value groups are each test's).
LLAMA_BLOCKS = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True)

_INITIAL_PARAMS = {}


def loss_and_grads(cfg, dp, pp, tp, **flags) -> tuple[float, dict[str, np.ndarray]]:
    """The loss and every gradient (by parameter path) of one step of `cfg` with `flags` on a (dp, pp, tp) mesh, on
    a fixed batch of random tokens. The initial parameters are built once per shape and seed on the first mesh
    asked and placed on the others: they do not depend on the mesh (tests/test_training.py), and building them costs
    as much as a compile."""
    cfg = cfg.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                      **flags).validate(8)
    train_step = TrainStep.build(cfg, make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))
    abstract = jax.tree.leaves(train_step.abstract_state().params)
    key = (str(jax.tree.structure(train_step.abstract_state().params)), tuple((x.shape, x.dtype) for x in abstract),
           cfg.training.seed, cfg.model.init_method_std)
    if key not in _INITIAL_PARAMS:
        _INITIAL_PARAMS[key] = jax.device_get(train_step.init_state().params)
    shardings = state_shardings(train_step.model)
    params, step = jax.device_put(_INITIAL_PARAMS[key], shardings.params), jax.device_put(np.int32(0), shardings.step)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.training.global_batch_size,
                                                                         cfg.model.seq_length + 1), np.int32)
    loss, grads = jax.jit(train_step.loss_and_grads)(params, train_step.model.put_batch(tokens), step)
    return float(loss), {jax.tree_util.keystr(path): np.asarray(g)
                         for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))}


def refused_in_one_line(match: str, fn, *args, **kw) -> str:
    """The ValueError `fn(*args, **kw)` raises, matching `match`, checked to be one line; -> its message."""
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def status_and_errors(main, argv, capsys) -> tuple[int, list[str]]:
    """main(argv), run as its script runs it (mtx.errors.exit_with) -> (its exit status, the lines of stderr)."""
    from mtx.errors import exit_with

    with pytest.raises(SystemExit) as exited:
        exit_with(lambda: main(argv))
    return exited.value.code, capsys.readouterr().err.strip().splitlines()
