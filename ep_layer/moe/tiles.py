"""Row-wise computations on fixed tiles of rows, so that a row's bits never depend on its batch.

On CPU, MKL picks a different GEMM kernel (with a different summation order) for a different row
count, and elementwise transcendentals (sigmoid, SiLU) take a scalar path with other rounding for
the tail of a tensor that is not a whole number of vectors. Running every row-wise step on tiles of
exactly ROW_TILE rows (zero-padded) gives every call the same shapes, so a row's result depends only
on the row and its place in the tile, and MKL's kernels treat every place in a tile alike (observed,
and checked by tests/test_moe.py's two-micro-batch tests). That is what makes the two-micro-batch
schedule equal the plain one bit for bit. It holds with any number of threads while a tile's
elementwise steps stay below torch's parallel grain (32768 elements, i.e. intermediate <= 1024), and
always with one thread. CUDA tensors are computed whole: nothing on the GPU is promised to be
batch-invariant, and fixed tiles would only add work there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

ROW_TILE = 32  # at or above the row counts where MKL switches kernels; a multiple of 2 AVX-512 vectors

Out = TypeVar("Out", torch.Tensor, tuple[torch.Tensor, ...])


def map_row_tiles(fn: Callable[..., Out], *rows: torch.Tensor) -> Out:
    """fn(*rows) for a row-wise `fn` (row i of every output depends only on row i of every input).

    `rows` share their first dimension; on CPU fn sees ROW_TILE-row tiles of them, zero-padded.
    """
    if rows[0].is_cuda:
        return fn(*rows)
    n = rows[0].shape[0]
    tiles = max(-(-n // ROW_TILE), 1)  # an empty batch still runs one tile, for the output shapes
    padded = [_pad_rows(r, tiles * ROW_TILE) for r in rows]
    results = [fn(*(p[i * ROW_TILE:(i + 1) * ROW_TILE] for p in padded)) for i in range(tiles)]
    if isinstance(results[0], torch.Tensor):
        return torch.cat(results)[:n]
    return tuple(torch.cat(parts)[:n] for parts in zip(*results))  # type: ignore[return-value]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows and x.is_contiguous():
        return x
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[:x.shape[0]] = x
    return padded
