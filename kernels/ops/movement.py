"""Strided element copies (``shaders/strided_copy.comp``), shared by the data-movement ops.

Transpose, Slice, Expand and Tile are gathers from a strided view of their input; Concat is
one scatter per input into a strided view of the output. Adjacent dimensions that stay
contiguous are merged first, so most copies run at rank 1-3.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import I32, U32, Dispatch, DeviceCaps, Ptr, UnsupportedOp, groups_1d
from vkpool.kernels.ops.dtypes import word_defines

MAX_COPY_RANK = 8


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def merge_dims(shape: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Drops extent-1 dimensions and merges d-1 into d where ``stride[d-1] == stride[d] * shape[d]``
    (the walk over the contiguous side stays row-major, so merging is exact)."""
    dims: list[int] = []
    out: list[int] = []
    for extent, stride in zip(shape, strides):
        if extent == 1:
            continue
        if dims and out[-1] == stride * extent:
            dims[-1] *= extent
            out[-1] = stride
            continue
        dims.append(int(extent))
        out.append(int(stride))
    return (dims or [1]), (out or [0])


def copy_rank(shape: Sequence[int], strides: Sequence[int]) -> int:
    return len(merge_dims(shape, strides)[0])


def strided_copy(
    src: Any,
    dst: Any,
    shape: Sequence[int],
    strides: Sequence[int],
    dtype: np.dtype,
    caps: DeviceCaps,
    *,
    base: int = 0,
    scatter: bool = False,
) -> list[Dispatch]:
    """Dispatches copying ``prod(shape)`` elements: gather (contiguous ``dst`` from a strided
    view of ``src``) or, with ``scatter``, contiguous ``src`` into a strided view of ``dst``.
    Element offsets are 32-bit: tensors up to 2**31 elements."""
    n = math.prod(shape)
    if n == 0:
        return []
    if n >= 2**31 or any(abs(s) * (d - 1) >= 2**31 for s, d in zip(strides, shape)):
        raise UnsupportedOp(f"a strided copy of {n} elements exceeds the shader's 32-bit offsets")
    dims, merged = merge_dims(shape, strides)
    if len(dims) > MAX_COPY_RANK:
        raise UnsupportedOp(f"a strided copy over {len(dims)} non-mergeable dimensions "
                            f"(at most {MAX_COPY_RANK})")
    pad = MAX_COPY_RANK - len(dims)
    args: list[Any] = [Ptr(src), Ptr(dst), U32(n), U32(len(dims)), I32(base)]
    args += [U32(v) for v in dims + [1] * pad] + [I32(v) for v in merged + [0] * pad]
    defines = {"SCATTER": int(scatter), **word_defines(dtype)}
    return [Dispatch("strided_copy", args, groups_1d(n, 256, caps), defines)]
