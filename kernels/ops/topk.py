"""TopK (``shaders/topk.comp``): k fixes the output shape, so the kernel is built with k known.

A k computed at run time (opset 10's input) is where :class:`vkpool.Session` cuts the model
(:mod:`vkpool.dynamic`): the part that computes k runs first, k is read back, and the rest,
this TopK included, is compiled for that k.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
    serial_pieces, type_defines,
)
from vkpool.kernels.ops.reduce import axis_view, normalize_axes

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))
#: lines at least this long may be counted in pieces (a device's loop limit): they carry a rank
#: per element in the workspace between the pieces
_PIECES_FROM = 1024


class TopK(Op):
    op_type = "TopK"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"TopK: element type {x.dtype} has no kernel")
        self.axis = normalize_axes([self.attr("axis", -1)], len(x.shape), "TopK")[0]
        k = int(self.constants[1].reshape(-1)[0]) if self.opset >= 10 else int(self.attr("k"))
        if not 0 <= k <= x.shape[self.axis]:
            raise OpError(f"TopK: k={k} is out of range for an axis of {x.shape[self.axis]}")
        self.k = k
        self.largest = bool(self.attr("largest", 1))
        shape = list(x.shape)
        shape[self.axis] = k
        self.out_shape = tuple(shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype), TensorInfo(self.out_shape, np.int64)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        # a stable sort keeps equal values in index order, as ONNX requires for ties
        key = -x if self.largest else x
        if self.largest and x.dtype.kind in "iu":
            key = -(x.astype(np.float64))
        order = np.argsort(key, axis=self.axis, kind="stable")
        idx = np.take(order, np.arange(self.k), axis=self.axis)
        return [np.take_along_axis(x, idx, axis=self.axis), idx.astype(np.int64)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        _, n, inner = axis_view(x.shape, self.axis)
        if self.k == 0 or x.size == 0:
            return []
        if ctx.workspace is None:
            check_serial(n, ctx.caps, f"TopK along {n} elements")
        pieces = serial_pieces(n, 1, ctx.caps, "TopK")
        ranks = ctx.workspace if ctx.workspace is not None else ctx.inputs[0]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), Ptr(ctx.outputs[1]), Ptr(ranks), U32(x.size), U32(n),
                U32(inner), U32(self.k)]
        defines = {"LARGEST": int(self.largest), **type_defines(x.dtype)}
        groups = groups_1d(x.size, 64, ctx.caps)
        return [Dispatch("topk", [*args, U32(start), U32(count)], groups, defines) for start, count in pieces]

    def workspace_bytes(self) -> int:
        x = self.input(0)
        return 4 * x.size if x.shape[self.axis] >= _PIECES_FROM else 0

    def flops(self) -> int:
        x = self.input(0)
        return x.size * x.shape[self.axis]


__all__ = ["TopK"]
