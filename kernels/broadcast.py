"""ONNX multidirectional broadcasting: output shapes and per-input element strides."""
from __future__ import annotations

import math
from typing import Sequence

from vkpool.kernels.base import OpError

MAX_RANK = 6


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        padded = [1] * (rank - len(shape)) + list(shape)
        for d, (o, s) in enumerate(zip(out, padded)):
            if s == o or s == 1:
                continue
            if o == 1:
                out[d] = s
            else:
                raise OpError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
    return tuple(out)


def broadcast_strides(shape: Sequence[int], out_shape: Sequence[int]) -> list[int]:
    """Element strides of ``shape`` viewed as ``out_shape`` (0 where broadcast)."""
    rank = len(out_shape)
    padded = [1] * (rank - len(shape)) + list(shape)
    strides = [0] * rank
    acc = 1
    for d in range(rank - 1, -1, -1):
        strides[d] = 0 if padded[d] == 1 and out_shape[d] != 1 else acc
        acc *= padded[d]
    return strides


def collapse(out_shape: Sequence[int], *in_shapes: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Merges adjacent output dimensions where every input is contiguous or broadcast alike.

    Returns the collapsed output shape and each input's strides on it; keeps the rank within
    MAX_RANK for any realistic ONNX model and makes the common cases (same shape, scalar,
    per-channel bias) rank 1 or 2, which is cheaper for the shader's index arithmetic.
    """
    strides = [broadcast_strides(s, out_shape) for s in in_shapes]
    dims: list[int] = []
    cols: list[list[int]] = [[] for _ in in_shapes]
    for d, extent in enumerate(out_shape):
        if extent == 1:
            continue
        if dims:
            mergeable = all(
                (cols[k][-1] == 0 and strides[k][d] == 0)
                or (cols[k][-1] != 0 and strides[k][d] != 0 and cols[k][-1] == strides[k][d] * extent)
                for k in range(len(in_shapes))
            )
            if mergeable:
                dims[-1] *= extent
                for k in range(len(in_shapes)):
                    cols[k][-1] = strides[k][d]
                continue
        dims.append(extent)
        for k in range(len(in_shapes)):
            cols[k].append(strides[k][d])
    if not dims:
        dims = [1]
        cols = [[1] for _ in in_shapes]
    if len(dims) > MAX_RANK:
        raise OpError(f"broadcast over {len(dims)} non-mergeable dimensions (at most {MAX_RANK})")
    assert math.prod(dims) == math.prod(out_shape)
    return dims, cols
