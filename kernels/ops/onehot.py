"""OneHot (``shaders/onehot.comp``): depth fixes the output shape so it must be known at load
time; the off/on values are read on the device."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))
_INDEX_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


class OneHot(Op):
    op_type = "OneHot"
    constant_inputs = (1,)

    def check(self) -> None:
        idx, values = self.input(0), self.input(2)
        if values.dtype not in _DTYPES:
            raise UnsupportedOp(f"OneHot: value type {values.dtype} has no kernel")
        if idx.dtype not in _INDEX_DTYPES:
            raise UnsupportedOp(f"OneHot: index type {idx.dtype} has no kernel")
        if values.size != 2:
            raise OpError(f"OneHot: values must hold [off, on], got shape {values.shape}")
        self.depth = int(np.asarray(self.constants[1]).reshape(-1)[0])
        if self.depth <= 0:
            raise OpError(f"OneHot: depth must be positive, got {self.depth}")
        rank = len(idx.shape) + 1
        axis = int(self.attr("axis", -1))
        if not -rank <= axis < rank:
            raise OpError(f"OneHot: axis {axis} out of range for output rank {rank}")
        self.axis = axis % rank
        self.out_shape = tuple(idx.shape[:self.axis]) + (self.depth,) + tuple(idx.shape[self.axis:])

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(2).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        idx, values = inputs[0], inputs[2]
        assert idx is not None and values is not None
        i = idx.astype(np.int64)
        i = np.where(i < 0, i + self.depth, i)
        hot = np.expand_dims(i, self.axis) == np.arange(self.depth).reshape(
            [-1 if d == self.axis else 1 for d in range(len(self.out_shape))])
        off, on = values.reshape(-1)
        return [np.where(hot, on, off).astype(values.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = math.prod(self.out_shape)
        if n == 0:
            return []
        inner = math.prod(self.out_shape[self.axis + 1:])
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[2]), Ptr(ctx.outputs[0]), U32(n), U32(self.depth), U32(inner)]
        defines = {**type_defines(self.input(2).dtype), **type_defines(self.input(0).dtype, "I_")}
        return [Dispatch("onehot", args, groups_1d(n, 64, ctx.caps), defines)]


__all__ = ["OneHot"]
