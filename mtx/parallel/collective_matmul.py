"""Sequence parallelism's collectives overlapped with the matmuls around them (Megatron-Core's `--tp-comm-overlap`).

With sequence parallelism a column-parallel linear all-gathers the ranks' rows before its matmul, and a row-parallel
linear reduce-scatters its partial sums after its matmul; done whole, the GPU waits for each. Here each collective
is cut into tp - 1 ring steps (`ppermute` to rank r + 1), and every step's transfer runs beside the matmul of rows
that are already here (Wang et al. 2023, "Overlap communication with dependent computation via decomposition").
The bytes moved are the same; the matmuls hide them.

Everything between the two collectives is row-wise (projections, attention within each row, GeLU), so the gathered
rows never need to be put back in rank order: a layer carries them as a list of tp row chunks in ring order, chunk j
holding the rows of rank (r - j) % tp (chunk 0 is this rank's own), and each op runs once per chunk:

  ring_gather(x):          this rank's rows -> [rows of rank r, r - 1, ..., r - tp + 1]: step j passes on the
                           chunk received at step j - 1 while the matmuls of that chunk run.
  ring_reduce_scatter(ps): partial sums per chunk (same order) -> this rank's rows of their sum over ranks. Step i adds
                           this rank's partial sum for the rows of rank r - 1 - i to the running sum received from
                           rank r - 1 and passes it on; after tp - 1 hops the sum of rank r's rows arrives complete.
                           The running sum's transfer runs beside the next chunk's matmul.
  ring_rows(a):            a replicated per-row value (attention mask, dropout keys) cut into the same chunks.

Autodiff gives the backward: ppermutes the other way beside the transposed matmuls. All run in the local view inside
shard_map; with tp = 1 they are the identity on one chunk.
"""

from __future__ import annotations

import jax

from mtx.parallel.mesh import MODEL
from mtx.parallel.ops import model_rank, model_size, vary


def _next_rank(tp: int):
    return [(i, (i + 1) % tp) for i in range(tp)]


def ring_gather(x_BSD) -> list:
    """(B / tp, S, D) rows of this rank -> tp chunks in ring order: chunk j holds the rows of rank (r - j) % tp."""
    tp = model_size()
    chunks = [x_BSD]
    for _ in range(tp - 1):
        chunks.append(jax.lax.ppermute(chunks[-1], MODEL, _next_rank(tp)))
    return chunks


def ring_reduce_scatter(parts: list):
    """tp partial sums in ring order (part j: this rank's contribution to the rows of rank (r - j) % tp) -> this
    rank's rows of the sum over ranks."""
    tp = len(parts)
    acc = None
    for i in range(tp):
        # The sum now here is bound for rank r - 1 - i, i.e. ring chunk (1 + i) % tp: add this rank's part of it.
        part = parts[(1 + i) % tp]
        acc = part if acc is None else acc + part
        if i + 1 < tp:
            acc = jax.lax.ppermute(acc, MODEL, _next_rank(tp))
    return acc


def ring_rows(a_B, tp: int) -> list:
    """A value every rank holds whole, (B, ...) -> its tp row chunks in ring order (None stays None)."""
    if a_B is None:
        return [None] * tp
    rows = a_B.shape[0] // tp
    rank, a_B = model_rank(), vary(a_B, [MODEL])
    return [jax.lax.dynamic_slice_in_dim(a_B, ((rank - j) % tp) * rows, rows, axis=0) for j in range(tp)]
