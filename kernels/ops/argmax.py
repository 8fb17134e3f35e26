"""ArgMax and ArgMin (``shaders/argreduce.comp``) with keepdims and select_last_index."""
from __future__ import annotations

from typing import ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, Ptr, TensorInfo, U32, UnsupportedOp, type_defines,
)
from vkpool.kernels.ops.reduce import axis_view, normalize_axes, row_geometry

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


class ArgReduce(Op):
    code: ClassVar[int]

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        self.axis = normalize_axes([self.attr("axis", 0)], len(x.shape), self.op_type)[0]
        self.keepdims = bool(self.attr("keepdims", 1))
        self.last = bool(self.attr("select_last_index", 0))
        shape = list(x.shape)
        if self.keepdims:
            shape[self.axis] = 1
        else:
            del shape[self.axis]
        self.out_shape = tuple(shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, np.int64)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        fn = np.argmax if self.code == 0 else np.argmin
        if self.last:
            n = x.shape[self.axis]
            idx = n - 1 - fn(np.flip(x, self.axis), axis=self.axis)
        else:
            idx = fn(x, axis=self.axis)
        return [idx.astype(np.int64).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        outer, n, inner = axis_view(x.shape, self.axis)
        nout = outer * inner
        threads, groups = row_geometry(nout, n, ctx.caps)
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(nout), U32(n), U32(inner)]
        defines = {"OP": self.code, "ROW_THREADS": threads, "LAST": int(self.last), **type_defines(x.dtype)}
        return [Dispatch("argreduce", args, groups, defines)]

    def flops(self) -> int:
        return self.input(0).size


class ArgMax(ArgReduce):
    op_type = "ArgMax"
    code = 0


class ArgMin(ArgReduce):
    op_type = "ArgMin"
    code = 1


__all__ = ["ArgMax", "ArgMin"]
