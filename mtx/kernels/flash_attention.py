"""Flash attention with attention dropout whose masks depend on what they mask, never on who computes it.

A Pallas (Triton) kernel, forward and backward, for causal (GPT) or key-masked bidirectional (BERT's padding)
self-attention over (B, S, N, H) queries, keys and values. No S x S matrix reaches memory: each program keeps one
block of queries (or keys) on chip and streams the other side through it (FlashAttention-2's loops), keeping the
softmax's running maximum and sum, and the backward recomputes the probabilities from the saved log-sum-exp.

Dropout is drawn inside the kernel, from a counter-based hash of the element's coordinates: whether probability
(q, k) of head n of sequence b is kept is `attention_keep(rows[b, n, q], cols[b, n, k])`, where `rows` and `cols`
hash the positions under the four words of that (sequence, head)'s key (mtx/parallel/random.py derives the key from
the seed, the step, the sequence's index in the global batch and the head's global index). The XLA attention
(`attention_core`) draws the same masks from the same functions, so the fused and unfused paths compute one function,
and training with dropout stays identical on every mesh and resumes exactly.

The kernel runs on NVIDIA GPUs; elsewhere `interpret=True` runs its program on the host (the tests' way to check it
against `attention_core`). `supported` says when a shape can take it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mtx.parallel.compat import shape_varying_like
from mtx.parallel.random import attention_keep

_LOG2E = math.log2(math.e)
_MASKED = -0.7 * float(np.finfo(np.float32).max)  # a finite -inf: exp2(_MASKED - m) == 0 without inf - inf


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes. Forward: `q` queries a program, keys in steps of `k`. Backward: each program owns `big` keys
    (accumulating their dK, dV over query steps of `small`) and `big` queries (their dQ, over key steps of
    `small`)."""

    q: int = 64
    k: int = 64
    big: int = 64
    small: int = 64
    warps: int = 4
    warps_backward: int = 4
    stages: int = 2


INTERPRET = False  # True: `usable` on any backend, the kernel interpreted on the host (how the tests run it)


def usable(q_BSNH, k_BSNH, mask_BS, causal: bool) -> bool:
    """Whether attention of these operands goes through the kernel: on a GPU in bf16/fp16 (or INTERPRET), shapes it
    takes, and a mask it applies: none, or (bidirectional) a 0/1 key padding mask (GPT's document ids are not)."""
    half = q_BSNH.dtype in (jnp.bfloat16, jnp.float16)
    backend = INTERPRET or (jax.default_backend() == "gpu" and half)
    return backend and supported(q_BSNH, k_BSNH) and (mask_BS is None or not causal)


def supported(q_BSNH, k_BSNH, blocks: Blocks = Blocks()) -> bool:
    """Whether the kernel takes these shapes: self-attention (as many keys as queries, one key/value head per query
    head), a sequence the blocks divide in tiles of at least 16 (the matrix units' smallest) and a head dim up to
    256 (padded inside to a power of 2, at least 16)."""
    s, h = q_BSNH.shape[1], q_BSNH.shape[3]
    sizes = (blocks.q, blocks.k, blocks.big, blocks.small)
    tiles = [min(b, s) for b in sizes]  # Triton's tiles are powers of 2
    return (q_BSNH.shape == k_BSNH.shape and h <= 256 and blocks.big % blocks.small == 0
            and all(t >= 16 and t & (t - 1) == 0 and s % t == 0 for t in tiles))


def flash_attention(q_BSNH, k_BSNH, v_BSNH, *, causal: bool = True, key_valid_BS=None, dropout_rate: float = 0.0,
                    hashes=None, blocks: Blocks = Blocks(), interpret: bool = False):
    """softmax(Q K^T / sqrt(H)) V with dropout on the probabilities, (B, S, N, H) in and out.

    key_valid_BS: (B, S) True where a key may be attended to (BERT's real tokens), or None for all keys.
    hashes: (rows, cols), each (B, N, S) uint32 (`attention_dropout_hashes`); needed when dropout_rate > 0.
    """
    if dropout_rate > 0.0 and hashes is None:
        raise ValueError("attention dropout needs the (rows, cols) hashes of attention_dropout_hashes")
    b, s = q_BSNH.shape[:2]
    valid = None if key_valid_BS is None else key_valid_BS.astype(jnp.int32)
    rows, cols = hashes if dropout_rate > 0.0 else (None, None)
    sized = dataclasses.replace(blocks, q=min(blocks.q, s), k=min(blocks.k, s), big=min(blocks.big, s),
                                small=min(blocks.small, s))
    static = (causal, float(dropout_rate), sized, interpret or INTERPRET)
    return _attention(q_BSNH, k_BSNH, v_BSNH, valid, rows, cols, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, valid, rows, cols, static):
    return _forward(q, k, v, valid, rows, cols, static)[0]


def _attention_fwd(q, k, v, valid, rows, cols, static):
    out, lse = _forward(q, k, v, valid, rows, cols, static)
    return out, (q, k, v, valid, rows, cols, out, lse)


def _attention_bwd(static, residuals, d_out):
    q, k, v, valid, rows, cols, out, lse = residuals
    delta_BNS = jnp.einsum("bsnh,bsnh->bns", out.astype(jnp.float32), d_out.astype(jnp.float32))
    dq, dk, dv = _backward(q, k, v, valid, rows, cols, d_out, lse, delta_BNS, static)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _specs(s: int, hp: int, block: int, valid, rows, cols):
    """BlockSpecs over the grid (S / block, B, N) for the (B, S, N, H) operands and the key mask / hashes."""
    tile = pl.BlockSpec((None, block, None, hp), lambda i, b, n: (b, i, n, 0))
    whole = pl.BlockSpec((None, s, None, hp), lambda i, b, n: (b, 0, n, 0))
    extra = [None if valid is None else pl.BlockSpec((None, s), lambda i, b, n: (b, 0)),
             None if rows is None else pl.BlockSpec((None, None, s), lambda i, b, n: (b, n, 0)),
             None if cols is None else pl.BlockSpec((None, None, s), lambda i, b, n: (b, n, 0))]
    return tile, whole, extra


def _forward(q, k, v, valid, rows, cols, static):
    causal, rate, blocks, interpret = static
    b, s, n, h = q.shape
    hp = _padded(h)
    tile, whole, extra = _specs(s, hp, blocks.q, valid, rows, cols)
    kernel = functools.partial(_forward_kernel, scale=1.0 / math.sqrt(h), causal=causal, rate=rate,
                               block_k=blocks.k, head_dim=h)
    inputs = (q, k, v, valid, rows, cols)
    return pl.pallas_call(
        kernel, grid=(s // blocks.q, b, n),
        in_specs=[tile, whole, whole, *extra],
        out_specs=[tile, pl.BlockSpec((None, None, blocks.q), lambda i, b, n: (b, n, i))],
        out_shape=[shape_varying_like(q.shape, q.dtype, *inputs), shape_varying_like((b, n, s), jnp.float32, *inputs)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret, name="mtx_flash_forward",
    )(*inputs)


def _padded(h: int) -> int:
    """A tile's head dim: h rounded up to a power of 2, at least 16 (the matrix units' smallest)."""
    return max(pl.next_power_of_2(h), 16)


def _head_dims(hp: int, head_dim: int):
    """Which of a tile's hp (a power of 2) columns are real head dims: None when all are."""
    return None if hp == head_dim else (jnp.arange(hp) < head_dim)[None, :]


def _load(ref, dims):
    """A (rows, hp) tile; its columns past the head dim read as zeros."""
    return ref[...] if dims is None else plgpu.load(ref, mask=dims, other=0.0)


def _store(ref, value, dims):
    if dims is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=dims)


def _allowed(q_idx, k_idx, key_valid, causal: bool):
    """(Q, K) which scores count: causal order and the key mask (None when all do)."""
    allowed = q_idx[:, None] >= k_idx[None, :] if causal else None
    if key_valid is not None:
        allowed = key_valid[None, :] if allowed is None else allowed & key_valid[None, :]
    return allowed


def _forward_kernel(q_ref, k_ref, v_ref, valid_ref, rows_ref, cols_ref, o_ref, lse_ref, *, scale, causal, rate,
                    block_k, head_dim):
    block_q, hp = q_ref.shape
    first = pl.program_id(0) * block_q
    q_idx = first + jnp.arange(block_q)
    dims = _head_dims(hp, head_dim)
    q = _load(q_ref, dims)
    rows = None if rows_ref is None else rows_ref[pl.ds(first, block_q)]

    def step(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        k = _load(k_ref.at[keys, :], dims)
        scores = plgpu.dot(q, k.T) * (scale * _LOG2E)  # base 2: exp2 on the GPU's fast path
        key_valid = None if valid_ref is None else valid_ref[keys] > 0
        allowed = _allowed(q_idx, j * block_k + jnp.arange(block_k), key_valid, causal)
        if allowed is not None:
            scores = jnp.where(allowed, scores, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        correction = jnp.exp2(m - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l = l * correction + jnp.sum(p, axis=1)  # the softmax's sum counts dropped probabilities too
        if rate > 0.0:
            p = jnp.where(attention_keep(rows[:, None], cols_ref[keys][None, :], rate), p, 0.0)
        v = _load(v_ref.at[keys, :], dims)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l

    steps = jax.lax.div(first + block_q + block_k - 1, block_k) if causal else k_ref.shape[0] // block_k
    init = (jnp.zeros((block_q, hp), jnp.float32), jnp.full((block_q,), _MASKED, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, step, init)
    out = acc * (1.0 / (1.0 - rate)) / l[:, None]
    _store(o_ref, out.astype(o_ref.dtype), dims)
    lse_ref[...] = m + jnp.log2(l)


def _backward(q, k, v, valid, rows, cols, d_out, lse, delta, static):
    causal, rate, blocks, interpret = static
    b, s, n, h = q.shape
    hp = _padded(h)
    tile, whole, extra = _specs(s, hp, blocks.big, valid, rows, cols)
    per_row = pl.BlockSpec((None, None, s), lambda i, b, n: (b, n, 0))
    kernel = functools.partial(_backward_kernel, scale=1.0 / math.sqrt(h), causal=causal, rate=rate,
                               big=blocks.big, small=blocks.small, head_dim=h)
    inputs = (q, k, v, valid, rows, cols, d_out, lse, delta)
    shapes = [shape_varying_like(a.shape, a.dtype, *inputs) for a in (q, k, v)]
    return pl.pallas_call(
        kernel, grid=(s // blocks.big, b, n),
        in_specs=[whole, whole, whole, *extra, whole, per_row, per_row],
        out_specs=[tile, tile, tile], out_shape=shapes,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps_backward, num_stages=blocks.stages),
        interpret=interpret, name="mtx_flash_backward",
    )(*inputs)


def _backward_kernel(q_ref, k_ref, v_ref, valid_ref, rows_ref, cols_ref, do_ref, lse_ref, delta_ref,
                     dq_ref, dk_ref, dv_ref, *, scale, causal, rate, big, small, head_dim):
    """Program i: dK and dV of keys [i big, (i + 1) big) over every query that sees them, then dQ of queries
    [i big, (i + 1) big) over every key they see. The probabilities (and their dropout) are recomputed in both."""
    s, hp = q_ref.shape
    first = pl.program_id(0) * big
    dims = _head_dims(hp, head_dim)
    inv_keep = 1.0 / (1.0 - rate)

    def probabilities(q, k, lse, q_idx, k_idx, key_valid):
        p = jnp.exp2(plgpu.dot(q, k.T) * (scale * _LOG2E) - lse[:, None])
        allowed = _allowed(q_idx, k_idx, key_valid, causal)
        return p if allowed is None else jnp.where(allowed, p, 0.0)

    def dropped(x, keep):
        return x if keep is None else jnp.where(keep, x, 0.0) * inv_keep

    # dK, dV: this program's keys stay on chip; queries stream through in steps of `small`.
    mine = pl.ds(first, big)
    k_idx = first + jnp.arange(big)
    k = _load(k_ref.at[mine, :], dims)
    v = _load(v_ref.at[mine, :], dims)
    key_valid = None if valid_ref is None else valid_ref[mine] > 0
    cols = None if cols_ref is None else cols_ref[mine]

    def key_step(t, carry):
        dk, dv = carry
        rows_of = pl.ds(t * small, small)
        q = _load(q_ref.at[rows_of, :], dims)
        do = _load(do_ref.at[rows_of, :], dims)
        p = probabilities(q, k, lse_ref[rows_of], t * small + jnp.arange(small), k_idx, key_valid)
        keep = None if rate == 0.0 else attention_keep(rows_ref[rows_of][:, None], cols[None, :], rate)
        dv = dv + plgpu.dot(dropped(p, keep).astype(do.dtype).T, do)
        dp = dropped(plgpu.dot(do, v.T), keep)
        ds = p * (dp - delta_ref[rows_of][:, None])
        return dk + plgpu.dot(ds.astype(q.dtype).T, q), dv

    start = pl.program_id(0) * (big // small) if causal else 0
    zeros = jnp.zeros((big, hp), jnp.float32)
    dk, dv = jax.lax.fori_loop(start, s // small, key_step, (zeros, zeros))
    _store(dk_ref, (dk * scale).astype(dk_ref.dtype), dims)
    _store(dv_ref, dv.astype(dv_ref.dtype), dims)

    # dQ: this program's queries stay on chip; keys stream through in steps of `small`.
    q_idx = first + jnp.arange(big)
    q = _load(q_ref.at[mine, :], dims)
    do = _load(do_ref.at[mine, :], dims)
    lse, delta = lse_ref[mine], delta_ref[mine]
    rows = None if rows_ref is None else rows_ref[mine]

    def query_step(t, dq):
        keys = pl.ds(t * small, small)
        k = _load(k_ref.at[keys, :], dims)
        v = _load(v_ref.at[keys, :], dims)
        valid = None if valid_ref is None else valid_ref[keys] > 0
        p = probabilities(q, k, lse, q_idx, t * small + jnp.arange(small), valid)
        keep = None if rate == 0.0 else attention_keep(rows[:, None], cols_ref[keys][None, :], rate)
        ds = p * (dropped(plgpu.dot(do, v.T), keep) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    steps = (pl.program_id(0) + 1) * (big // small) if causal else s // small
    dq = jax.lax.fori_loop(0, steps, query_step, jnp.zeros((big, hp), jnp.float32))
    _store(dq_ref, (dq * scale).astype(dq_ref.dtype), dims)
