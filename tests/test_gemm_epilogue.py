"""The GeLU MLP with its bias + GeLU and their backward inside the matmuls, and the q, k, v matmuls with their biases
inside (mtx/kernels/gemm_epilogue.py): autodiff's values and gradients through XLA (how the CPU runs it), the whole
model the same with it on or off on a mesh with sequence parallelism and through 1F1B, `matmuls` recomputation
keeping what autodiff's keeps, and its library's build refusing a missing toolchain in one line. On GPUs, where the
tests do not run, benchmarks/gpu_checks.py checks cuBLASLt's epilogues."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mtx.config import Config
from mtx.kernels import gemm_epilogue
from mtx.models.stack import save_matmul_outputs
from mtx.presets import load_preset

from helpers import loss_and_grads, refused_in_one_line


def plain_mlp(x, w1, b1, w2):
    return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2


def operands(m=24, k=16, n=64, d=16, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (2, m // 2, k))
    w1, w2 = jax.random.normal(keys[1], (k, n)) / k ** 0.5, jax.random.normal(keys[2], (n, d)) / n ** 0.5
    b1, dy = 0.3 * jax.random.normal(keys[3], (n,)), jax.random.normal(keys[4], (2, m // 2, d))
    return tuple(a.astype(dtype) for a in (x, w1, b1, w2)), dy.astype(dtype)


@pytest.mark.parametrize("keep_activation", [True, False], ids=["kept", "recomputed"])
def test_values_and_gradients_are_autodiffs(keep_activation):
    args, dy = operands()
    y, pullback = jax.vjp(lambda *a: gemm_epilogue.gelu_mlp(*a, keep_activation), *args)
    y_ref, pullback_ref = jax.vjp(plain_mlp, *args)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    for grad, ref, name in zip(pullback(dy), pullback_ref(dy), ("x", "w1", "b1", "w2")):
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_biased_matmul_is_autodiffs():
    """bias_matmul (the q, k, v projections' matmuls with --gemm-epilogues): x w + b and autodiff's gradients."""
    (x, w, b, _), dy = operands(d=64)
    y, pullback = jax.vjp(gemm_epilogue.bias_matmul, x, w, b)
    y_ref, pullback_ref = jax.vjp(lambda x, w, b: x @ w + b, x, w, b)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    for grad, ref, name in zip(pullback(dy), pullback_ref(dy), ("x", "w", "b")):
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_bf16_gradients_keep_their_dtypes_and_are_as_accurate_as_autodiffs():
    """In bf16 each gradient is within twice the error autodiff's bf16 gradient makes, against float32 autodiff."""
    args, dy = operands(dtype=jnp.bfloat16)
    grads = jax.vjp(gemm_epilogue.gelu_mlp, *args)[1](dy)
    refs = jax.vjp(plain_mlp, *args)[1](dy)
    exact = jax.vjp(plain_mlp, *(a.astype(jnp.float32) for a in args))[1](dy.astype(jnp.float32))
    error = lambda a, e: np.linalg.norm(np.asarray(a, np.float32) - e) / np.linalg.norm(e)
    for grad, ref, want, name in zip(grads, refs, exact, ("x", "w1", "b1", "w2")):
        assert grad.dtype == jnp.bfloat16
        assert error(grad, want) <= 2 * error(ref, want), name


@pytest.mark.parametrize("keep_activation", [True, False], ids=["kept", "recomputed"])
def test_matmuls_recomputation_keeps_the_outputs_and_recomputes_no_matmul(keep_activation, capsys):
    """Under `--recompute-granularity matmuls` the backward reads h and GeLU(h) as saved (each (tokens, F)), or h
    alone where GeLU(h) is recomputed (as the model asks there): no matmul of the forward runs again."""
    args, dy = operands()
    mlp = functools.partial(gemm_epilogue.gelu_mlp, keep_activation=keep_activation)
    fn = jax.checkpoint(mlp, policy=save_matmul_outputs)
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
    saved = capsys.readouterr().out
    assert saved.count(f"[2,12,64] named '{gemm_epilogue.ACTIVATIONS}'") == 1 + keep_activation, saved
    assert _matmuls(fn, args, dy) == _matmuls(mlp, args, dy)  # as many as without recomputation
    assert _matmuls(jax.checkpoint(gemm_epilogue.gelu_mlp), args, dy) > _matmuls(gemm_epilogue.gelu_mlp, args, dy)
    x, w, b, _ = args  # the biased matmul's output, where what follows reads it (as attention does), is kept too
    biased = lambda x, w, b: jnp.sin(gemm_epilogue.bias_matmul(x, w, b))
    fn = jax.checkpoint(biased, policy=save_matmul_outputs)
    jax.ad_checkpoint.print_saved_residuals(fn, x, w, b)
    assert f"[2,12,64] named '{gemm_epilogue.ACTIVATIONS}'" in capsys.readouterr().out
    ct = jnp.ones((2, 12, 64))
    assert _matmuls(fn, (x, w, b), ct) == _matmuls(biased, (x, w, b), ct)


def _matmuls(fn, args, dy) -> int:
    """dot_generals in the forward and backward of fn, nested programs included."""
    def count(jaxpr):
        return sum((e.primitive.name == "dot_general")
                   + sum(count(getattr(v, "jaxpr", v)) for v in e.params.values()
                         if isinstance(getattr(v, "jaxpr", v), jax.extend.core.Jaxpr))
                   for e in jaxpr.eqns)
    return count(jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1](dy))(*args).jaxpr)


@pytest.mark.parametrize("bias_gelu_fusion,cuda_traced", [(False, True), (True, False)],
                         ids=["kept-cuda-traced", "recomputed"])
def test_the_model_trains_as_with_autodiffs_mlp_on_a_mesh(bias_gelu_fusion, cuda_traced, monkeypatch):
    """The whole model with the epilogue MLP (--gemm-epilogues) and with autodiff's (the default) on a mesh with
    sequence parallelism and data parallelism: the same loss and every gradient. cuda_traced: in bf16 with the
    library taken as built, so the FFI calls are traced too (and typed as XLA's branch inside shard_map), the CPU
    running XLA's branch."""
    preset = {**load_preset("configs/tiny.toml"), "global_batch_size": 8, "micro_batch_size": 4}
    cfg = Config().replace(**preset, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=True,
                           bias_gelu_fusion=bias_gelu_fusion, bf16=cuda_traced)
    monkeypatch.setattr(gemm_epilogue, "extension_ready", lambda: cuda_traced)
    loss, grads = loss_and_grads(cfg, 2, 1, 2, gemm_epilogues=True)
    ref_loss, ref = loss_and_grads(cfg, 2, 1, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3 if cuda_traced else 1e-6)
    assert grads.keys() == ref.keys()
    for path in ref:
        if cuda_traced:  # bf16: the GeLU's rounding differs from jax.nn.gelu's
            assert np.linalg.norm(grads[path] - ref[path]) <= 0.02 * np.linalg.norm(ref[path]), path
        else:
            np.testing.assert_allclose(grads[path], ref[path], rtol=1e-4, atol=1e-6 * np.abs(ref[path]).max(),
                                       err_msg=path)


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
def test_in_1f1b_under_matmuls_recomputation(biases, monkeypatch):
    """Through 1F1B's slots (the default schedule) with `matmuls` recomputation, on a (1, 2, 2) mesh, with biases (the
    q, k, v matmuls' epilogue too) and without (the MLP epilogue's bias a zero, its gradient dropped): the same loss
    and gradients as autodiff's MLP; and the MLP keeps only h, GeLU(h) recomputed, as autodiff's does there."""
    preset = {**load_preset("configs/tiny.toml"), "global_batch_size": 8, "micro_batch_size": 2}
    cfg = Config().replace(**preset, hidden_dropout=0.0, attention_dropout=0.0, disable_bias_linear=not biases,
                           recompute_granularity="matmuls")
    kept, gelu_mlp = [], gemm_epilogue.gelu_mlp
    monkeypatch.setattr(gemm_epilogue, "gelu_mlp", lambda *a: kept.append(a[-1]) or gelu_mlp(*a))
    loss, grads = loss_and_grads(cfg, 1, 2, 2, gemm_epilogues=True)
    ref_loss, ref = loss_and_grads(cfg, 1, 2, 2)
    assert kept and not any(kept)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert grads.keys() == ref.keys() and biases == any("bias" in path and "mlp" in path for path in ref)
    for path in ref:
        np.testing.assert_allclose(grads[path], ref[path], rtol=1e-4, atol=1e-6 * np.abs(ref[path]).max(),
                                   err_msg=path)


def test_a_missing_compiler_or_cuda_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_epilogue, "CACHE", tmp_path)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(gemm_epilogue.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C.. compiler") as e:
        gemm_epilogue.build()
    assert "\n" not in str(e.value)
    monkeypatch.setenv("CXX", "c++")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(gemm_epilogue, "_nvidia_roots", lambda: [])
    monkeypatch.setattr(gemm_epilogue, "_loaded_library", lambda name: None)
    with pytest.raises(RuntimeError, match="no libcublasLt.so") as e:
        gemm_epilogue.build()
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


TP_COMM_OVERLAP = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "tp_comm_overlap": True}


@pytest.mark.parametrize("other", [{"swiglu": True, "disable_bias_linear": True},
                                   {"swiglu": True, "group_query_attention": True, "num_query_groups": 2},
                                   TP_COMM_OVERLAP], ids=["swiglu-no-biases", "swiglu-grouped", "tp-comm-overlap"])
def test_the_flag_where_it_would_do_nothing_is_one_line(other):
    """--gemm-epilogues acts on the GeLU MLP's and the fused q, k, v projection's XLA matmuls: with SwiGLU and no
    biases or grouped projections, or with the peer-memory kernels running the matmuls, it would do nothing, and is
    refused before any device work. (SwiGLU with biases keeps the q, k, v epilogue: accepted.)"""
    from mtx.flag_rules import check_unused_flags

    given = {"gemm_epilogues", *other}
    message = refused_in_one_line("--gemm-epilogues only acts with", check_unused_flags,
                                  Config().replace(gemm_epilogues=True, **other), given)
    assert "leave" in message
    check_unused_flags(Config().replace(gemm_epilogues=True, swiglu=True), {"gemm_epilogues", "swiglu"})


def test_a_checkpoint_resumes_with_either_setting():
    """--gemm-epilogues changes how the MLP computes, no parameter: a run saved with it resumes without it and the
    other way round, and --use-checkpoint-args leaves this run's choice alone."""
    from mtx.checkpoint import check_compatible
    from mtx.config import ModelConfig
    from mtx.resume import ARCHITECTURE

    check_compatible(Config(), ModelConfig(gemm_epilogues=True), "ck")
    check_compatible(Config().replace(gemm_epilogues=True), ModelConfig(), "ck")
    assert "gemm_epilogues" not in ARCHITECTURE


def test_the_gpu_check_passes_xlas_function_and_catches_a_dropped_bias(monkeypatch):
    """benchmarks/gpu_checks.py's `gemm_epilogue` check (on GPUs: cuBLASLt's epilogues) within XLA bf16's errors of
    the fp32 reference here, and far outside them for an MLP whose first matmul drops its bias."""
    from benchmarks import gpu_checks

    def worst(result):
        return max(result["fused"][key] / (result["xla_bf16"][key] + 1e-3) for key in result["fused"])

    assert worst(gpu_checks.gemm_epilogue(64, 32, 128)) < 2
    for name in ("_gemm_gelu", "_gemm_bias"):
        with monkeypatch.context() as patch:
            fused = getattr(gemm_epilogue, name)
            patch.setattr(gemm_epilogue, name, lambda x, w, b, fused=fused: fused(x, w, 0 * b))
            assert worst(gpu_checks.gemm_epilogue(64, 32, 128)) > 2, name


@pytest.mark.parametrize("sp", [False, True], ids=["all-reduces", "sequence-parallel"])
def test_the_audit_finds_the_papers_collectives(sp):
    """The epilogue MLP sits between the column-parallel `f` and the row-parallel `g`: a layer still has two
    all-reduces of b*s*h forward and two backward (with sequence parallelism and `matmuls` recomputation: two
    all-gathers and two reduce-scatters each way, none repeated), nothing over "data"."""
    from mtx import audit

    b, s, d, tp = 4, 16, 64, 2
    cfg = audit.audit_config(hidden_size=d, num_attention_heads=8, seq_length=s, micro_batch_size=b,
                             tensor_model_parallel_size=tp, data_parallel_size=2, gemm_epilogues=True,
                             sequence_parallel=sp, recompute_granularity="matmuls" if sp else None)
    r = audit.audit_layer(cfg)
    kinds = {"all-gather model": 2, "reduce-scatter model": 2} if sp else {"all-reduce model": 2}
    assert r["by_axis"] == {"forward": kinds, "backward": kinds}, r["ops"]
