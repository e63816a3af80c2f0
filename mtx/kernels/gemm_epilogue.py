"""Matmuls with their element-wise neighbours inside cuBLASLt's epilogues (NVIDIA GPUs), as Transformer Engine does
for Megatron-Core: `--gemm-epilogues`.

XLA calls cuBLAS for every matmul but folds no GeLU into one, and in the training step no bias either (docs/
benchmarks.md 12, 14): the MLP's bias + GeLU forward, the GeLU's derivative backward and the q, k, v projections'
bias adds are passes of their own over the activations. Here, on this rank's columns (inside the training step's
shard_map, between the column-parallel layer's `f` and the row-parallel layer's `g`, so collectives are untouched):

`gelu_mlp(x, w1, b1, w2)` is gelu(x w1 + b1) w2 with its backward written out:

    forward   a, h = gelu(x w1 + b1), x w1 + b1       one matmul, epilogue GELU_AUX_BIAS (h kept for the backward)
              y = a w2
    backward  dh = (dy w2^T) * gelu'(h)               one matmul, epilogue DGELU; db1 = dh's column sums (XLA)
              dw2 = a^T dy, dw1 = x^T dh, dx = dh w1^T (autodiff's own transposes of the two matmuls)

`bias_matmul(x, w, b)` is x w + b, epilogue BIAS, with autodiff's backward (the fused q, k, v projection's three
matmuls, `ColumnParallelLinear(epilogues=True)`).

Measured (docs/benchmarks.md 20, 21): the MLP alone forward + backward 8.7% faster than autodiff's (H200), the 1.2B
step at micro batch 24 4.2% faster on an H100 and 1.9% on an H200, where it holds 11.3 GiB less (one (tokens, F)
activation a layer; 2.5 GiB less on the H100, whose step XLA had fitted to its share of the card). DGELU_BGRAD,
which sums the bias gradient inside the matmul too, made the MLP's forward + backward 7% slower than autodiff's
instead.

mtx/kernels/cublaslt_epilogues.cc holds the three epilogue matmuls as XLA FFI handlers; it is compiled on first use on
a host whose JAX runs on CUDA GPUs (a C++ compiler, jaxlib's FFI headers, and the cuBLASLt and CUDA runtime
libraries JAX loaded) into ~/.cache/mtx/kernels/, once per source and toolchain. Elsewhere, in other dtypes than
bf16, and where the library cannot be built (the reason said once on stderr), the same functions run through XLA
with the same backward, so the tests on simulated CPU devices cover it (tests/test_gemm_epilogue.py); on GPUs its
values are those of XLA's up to bf16 rounding (the epilogue adds the bias and applies GeLU to the float32
accumulator, rounding once; benchmarks/gpu_checks.py checks them).

h and a are what the MLP's backward reads, and bias_matmul's output is what attention's reads (`ACTIVATIONS`, kept
by `--recompute-granularity matmuls`); with `keep_activation=False` (`--bias-gelu-fusion`) only h is kept and a is
recomputed from it in the backward.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtx.kernels.elementwise import gelu_terms
from mtx.parallel.ops import cotangent_like, vary, varying_axes

ACTIVATIONS = "gemm_epilogue_activations"  # checkpoint name of the outputs the backward reads (h, gelu(h), x w + b)
SOURCE = Path(__file__).with_name("cublaslt_epilogues.cc")
CACHE = Path("~/.cache/mtx/kernels")
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace, an output of each call (cuBLAS's recommendation for Hopper)
TARGETS = {"mtx_gemm_bias": "MtxGemmBias", "mtx_gemm_gelu": "MtxGemmGelu", "mtx_gemm_dgelu": "MtxGemmDgelu"}
_READY_LOCK = threading.Lock()


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gelu_mlp(x, w1, b1, w2, keep_activation: bool = True):
    """x (..., K) this rank's MLP input, w1 (K, N) and b1 (N,) its columns of the first linear, w2 (N, D) its rows of
    the second -> gelu(x w1 + b1) w2, (..., D): this rank's partial sum, before the row-parallel reduction and bias."""
    return _gelu_mlp_fwd(x, w1, b1, w2, keep_activation)[0]


def _gelu_mlp_fwd(x, w1, b1, w2, keep_activation):
    # no reshapes: the kept activations stay (micro batch, sequence, ...), which 1F1B's slots recognize as such
    a, h = (checkpoint_name(v, ACTIVATIONS) for v in _gemm_gelu(x, w1, b1))
    return a @ w2, (x, w1, b1, w2, h, a if keep_activation else None)


def _gelu_mlp_bwd(keep_activation, residuals, dy):
    x, w1, b1, w2, h, a = residuals
    if a is None:
        a = gelu_terms(h)[0]
    dh = _gemm_dgelu(dy, w2, h)
    db1 = dh.astype(jnp.float32).sum(tuple(range(dh.ndim - 1))).astype(h.dtype)  # XLA's column sums (see the .cc)
    dx, dw1 = jax.vjp(jnp.matmul, x, w1)[1](dh)  # autodiff's own transposes of the two matmuls
    dw2 = jax.vjp(jnp.matmul, a, w2)[1](dy)[1]
    return tuple(cotangent_like(grad.astype(p.dtype), p) for grad, p in zip((dx, dw1, db1, dw2), (x, w1, b1, w2)))


gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)


def bias_matmul(x, w, b):
    """x (..., K), w (K, N), b (N,) -> x w + b with the bias added inside the matmul (cuBLASLt's BIAS epilogue), its
    backward autodiff's; the output named `ACTIVATIONS`, so `matmuls` recomputation keeps it as it keeps XLA's
    matmuls' outputs."""
    return checkpoint_name(_bias_matmul(x, w, b), ACTIVATIONS)


@jax.custom_vjp
def _bias_matmul(x, w, b):
    return _gemm_bias(x, w, b)


def _bias_matmul_bwd(residuals, dy):
    grads = jax.vjp(_xla_gemm_bias, *residuals)[1](dy)
    return tuple(cotangent_like(grad.astype(p.dtype), p) for grad, p in zip(grads, residuals))


_bias_matmul.defvjp(lambda x, w, b: (_gemm_bias(x, w, b), (x, w, b)), _bias_matmul_bwd)


def _xla_gemm_bias(x, w, b):
    return x @ w + b


def _xla_gemm_gelu(x, w, b):
    h = x @ w + b
    return gelu_terms(h)[0], h


def _xla_gemm_dgelu(dy, w, h):
    return (dy @ w.T) * gelu_terms(h)[1]


def _ffi(target, xla, *args):
    """The FFI call `target` with XLA's function `xla` on the same arguments: the outputs typed as xla's (which
    `platform_dependent` requires of both branches), cuBLASLt's workspace a last output left out, and typed to vary
    over the mesh axes the inputs vary over inside shard_map, as xla's are (JAX types an FFI call's outputs
    invariant)."""
    outs = jax.eval_shape(xla, *args)
    single = not isinstance(outs, tuple)
    structs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in ((outs,) if single else outs)]
    workspace = jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)
    results = jax.ffi.ffi_call(target, (*structs, workspace), vmap_method="sequential")(*args)[:-1]
    axes = set().union(*(varying_axes(a) for a in args))
    results = tuple(vary(r, axes) for r in results)
    return results[0] if single else results


def _epilogue_operands(*arrays) -> bool:
    """Operands cuBLASLt's epilogues take here: bf16, every width a multiple of 8 (16-byte rows, and the kept
    activation's leading dimension)."""
    return all(a.dtype == jnp.bfloat16 and a.shape[-1] % 8 == 0 for a in arrays)


def _on_cuda(target, xla):
    """The FFI call `target` where the program runs on CUDA GPUs and the library is ready for these operands, else
    xla(*operands) (the same values up to bf16 rounding)."""
    def dispatch(*operands):
        if not (_epilogue_operands(*operands) and extension_ready()):
            return xla(*operands)
        return jax.lax.platform_dependent(*operands, cuda=functools.partial(_ffi, target, xla), default=xla)
    return dispatch


_gemm_bias = _on_cuda("mtx_gemm_bias", _xla_gemm_bias)  # x, w, b -> x w + b
_gemm_gelu = _on_cuda("mtx_gemm_gelu", _xla_gemm_gelu)  # x, w, b -> gelu(x w + b), x w + b
_gemm_dgelu = _on_cuda("mtx_gemm_dgelu", _xla_gemm_dgelu)  # dy, w, h -> (dy w^T) gelu'(h)


def extension_ready() -> bool:
    """Whether the epilogue matmuls are registered with XLA: built (or found built) and loaded on a host whose JAX
    runs on CUDA GPUs; False elsewhere, and where they cannot be built (why, said once on stderr). Decided once, under
    a lock (threads tracing at once register the targets once)."""
    with _READY_LOCK:
        return _ready()


@functools.cache
def _ready() -> bool:
    try:
        if jax.default_backend() != "gpu" or not jax.devices("cuda"):
            return False
    except RuntimeError:  # no CUDA backend (ROCm GPUs)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, RuntimeError) as e:
        print(f"mtx: --gemm-epilogues: XLA runs the functions instead: {e}", file=sys.stderr, flush=True)
        return False
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="CUDA")
    return True


def _nvidia_roots() -> list[Path]:
    """The folders of the `nvidia` namespace package of the pip CUDA wheels (none without them)."""
    try:
        import nvidia
    except ImportError:
        return []
    return [Path(p) for p in nvidia.__path__]


def _loaded_library(name: str) -> Path | None:
    """The file of the shared library `name` this process has loaded, if any (Linux)."""
    maps = Path("/proc/self/maps")
    for line in maps.read_text().splitlines() if maps.exists() else []:
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, path (which may hold spaces)
        path = Path(fields[5]) if len(fields) == 6 else None
        if path and path.name.startswith(f"{name}.so") and path.exists():  # not a "(deleted)" one
            return path
    return None


def _library(name: str) -> Path:
    """The shared library `name` (libcublasLt, libcudart): the one this process loaded (JAX's CUDA plugin's), else
    the first in the pip CUDA wheels or CUDA_HOME."""
    loaded = _loaded_library(name)
    if loaded:
        return loaded
    for root in [*_nvidia_roots(), Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]:
        found = sorted(glob.glob(str(root / "**" / "lib*" / f"{name}.so*"), recursive=True))
        if found:
            return Path(found[0])
    raise RuntimeError(f"no {name}.so (pip install jax[cuda12] or jax[cuda13], or set CUDA_HOME)")


def build() -> Path:
    """The compiled library, built once per source and toolchain into ~/.cache/mtx/kernels/ (atomically: a
    concurrent build of another process is never read half written)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) to build mtx/kernels/cublaslt_epilogues.cc")
    libraries = _library("libcublasLt"), _library("libcudart")
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-isystem{jax.ffi.include_dir()}", str(SOURCE),
               *(arg for lib in libraries for arg in (f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"))]
    key = hashlib.sha256(SOURCE.read_bytes() + repr((command, jax.__version__)).encode()).hexdigest()[:16]
    cache = CACHE.expanduser()
    target = cache / f"cublaslt_epilogues-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True)
        if done.returncode:
            lines = done.stderr.splitlines()  # the first error, not the linker driver's summary of it
            errors = [line for line in lines if "error" in line and "collect2" not in line] or lines
            raise RuntimeError(f"{Path(compiler).name} could not build {SOURCE.name}: "
                               f"{(errors or ['(no output)'])[0].strip()}")
        os.replace(built, target)
    return target
