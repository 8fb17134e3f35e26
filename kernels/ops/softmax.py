"""Softmax and LogSoftmax: opset-13 semantics (one axis) and the older flatten-to-2-D ones."""
from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.ops.dtypes import element_defines

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


class SoftmaxBase(Op):
    """Rows of ``D`` elements ``inner`` apart; one workgroup per row (``shaders/softmax.comp``)."""

    mode: ClassVar[int]

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _FLOATS:
            raise UnsupportedOp(f"{self.op_type}: only float32 and float16 are supported, got {x.dtype}")
        rank = len(x.shape)
        axis = int(self.attr("axis", -1 if self.opset >= 13 else 1))
        if rank == 0:
            if axis not in (0, -1):
                raise OpError(f"{self.op_type}: axis {axis} out of range for a scalar")
            self.outer, self.D, self.inner = 1, 1, 1
            return
        if not -rank <= axis < rank:
            raise OpError(f"{self.op_type}: axis {axis} out of range for rank {rank}")
        axis %= rank
        self.axis = axis
        if self.opset >= 13:
            self.outer = math.prod(x.shape[:axis])
            self.D = x.shape[axis]
            self.inner = math.prod(x.shape[axis + 1:])
        else:  # coerced to 2-D: [prod(shape[:axis]), prod(shape[axis:])], over the second
            self.outer = math.prod(x.shape[:axis])
            self.D = math.prod(x.shape[axis:])
            self.inner = 1

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        v = x.astype(np.float32).reshape(self.outer, self.D, self.inner)
        shifted = v - v.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=1, keepdims=True)
        y = e / s if self.mode == 0 else shifted - np.log(s)
        return [y.reshape(x.shape).astype(x.dtype, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        rows = self.outer * self.inner
        return [softmax_dispatch(ctx.inputs[0], ctx.outputs[0], self.D, self.inner, rows, self.mode,
                                 ctx.caps, self.input(0).dtype)]

    def flops(self) -> int:
        return 4 * self.input(0).size


def softmax_dispatch(src: Any, dst: Any, D: int, inner: int, rows: int, mode: int,
                     caps: DeviceCaps, dtype: np.dtype = np.dtype(np.float32)) -> Dispatch:
    """One ``softmax.comp`` dispatch (``mode`` 0 Softmax, 1 LogSoftmax) over ``rows`` rows of ``D``
    elements ``inner`` apart, of ``dtype`` (float32 or float16)."""
    # long rows get wide workgroups: the lone row after a big GEMV is latency-bound
    widest = min(1024 if D >= 4096 else 256, caps.max_workgroup_invocations)
    local = min(widest, max(32, 1 << max(0, D - 1).bit_length()))
    return Dispatch(
        "softmax",
        [Ptr(src), Ptr(dst), U32(D), U32(inner), U32(rows)],
        groups_1d(rows, 1, caps),
        {"MODE": mode, "LOCAL_SIZE": local, "SUBGROUP_REDUCE": int(caps.subgroup_arithmetic),
         **element_defines(dtype, "X")},
    )


class Softmax(SoftmaxBase):
    op_type = "Softmax"
    mode = 0


class LogSoftmax(SoftmaxBase):
    op_type = "LogSoftmax"
    mode = 1


__all__ = ["Softmax", "LogSoftmax", "softmax_dispatch"]
