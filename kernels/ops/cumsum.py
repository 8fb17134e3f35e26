"""CumSum and CumProd (``shaders/cumsum.comp``): the axis is read on the device, so it may be a
graph input."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, serial_pieces, type_defines,
)

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


class CumSum(Op):
    op_type = "CumSum"
    #: the running operation: numpy's cumulative function and the shader's PROD define
    numpy_op = staticmethod(np.cumsum)
    prod = 0

    def check(self) -> None:
        x, axis = self.input(0), self.input(1)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        if axis.dtype not in (np.dtype(np.int32), np.dtype(np.int64)) or axis.size != 1:
            raise OpError(f"{self.op_type}: axis must be an int32/int64 scalar")
        if not 1 <= len(x.shape) <= 6:
            raise UnsupportedOp(f"{self.op_type}: rank {len(x.shape)} (1 to 6 supported)")
        if 1 in self.constants:
            a = int(self.constants[1].reshape(-1)[0])
            if not -len(x.shape) <= a < len(x.shape):
                raise OpError(f"{self.op_type}: axis {a} out of range for rank {len(x.shape)}")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, axis = inputs[0], inputs[1]
        assert x is not None and axis is not None
        a = int(np.asarray(axis).reshape(-1)[0])
        if self.attr("reverse", 0):
            x = np.flip(x, a)
        y = self.numpy_op(x, axis=a, dtype=x.dtype)
        if self.attr("exclusive", 0):
            first = np.full_like(np.take(y, [0], axis=a), self.prod)
            y = np.concatenate([first, np.delete(y, -1, axis=a)], axis=a)
        if self.attr("reverse", 0):
            y = np.flip(y, a)
        return [np.ascontiguousarray(y)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, axis = self.input(0), self.input(1)
        if x.size == 0:
            return []
        shape = list(x.shape) + [1] * (6 - len(x.shape))
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(x.size), U32(len(x.shape))]
        args += [U32(v) for v in shape]
        defines = {
            "EXCLUSIVE": int(bool(self.attr("exclusive", 0))), "REVERSE": int(bool(self.attr("reverse", 0))),
            "PROD": self.prod,
            **type_defines(x.dtype), **type_defines(axis.dtype, "AXIS_"),
        }
        # NOTE: the line count depends on the run-time axis: cover the worst case (extent 1), and
        # split the worst-case line length (the longest dimension) into pieces within the loop limit.
        # A constant axis gives the exact line length.
        length = x.shape[int(ctx.constants[1].reshape(-1)[0])] if 1 in ctx.constants else max(x.shape)
        groups = groups_1d(x.size, 64, ctx.caps)
        return [Dispatch("cumsum", [*args, U32(start), U32(count)], groups, defines)
                for start, count in serial_pieces(length, 1, ctx.caps, self.op_type)]


class CumProd(CumSum):
    op_type = "CumProd"
    numpy_op = staticmethod(np.cumprod)
    prod = 1


__all__ = ["CumSum", "CumProd"]
