"""Hardmax (``shaders/hardmax.comp``): one-hot of the first maximum along an axis.

Before opset 13 the input is coerced to 2-D at ``axis`` (default 1) and the row is everything
from ``axis`` on; from 13 the row is the single axis (default -1).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
)
from vkpool.kernels.ops.reduce import axis_view, normalize_axes


class Hardmax(Op):
    op_type = "Hardmax"

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != np.float32:
            raise UnsupportedOp(f"Hardmax: element type {x.dtype} has no kernel")
        rank = len(x.shape)
        if self.opset >= 13:
            axis = normalize_axes([self.attr("axis", -1)], rank, "Hardmax")[0]
            self.view = axis_view(x.shape, axis)
        else:
            axis = int(self.attr("axis", 1))
            axis = axis + rank if axis < 0 else axis
            self.view = (math.prod(x.shape[:axis]), math.prod(x.shape[axis:]), 1)

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        v = x.reshape(self.view)
        y = np.zeros_like(v)
        np.put_along_axis(y, np.argmax(v, axis=1)[:, None, :], 1.0, axis=1)
        return [y.reshape(x.shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        outer, n, inner = self.view
        lines = outer * inner
        if lines == 0 or n == 0:
            return []
        check_serial(2 * n, ctx.caps, f"Hardmax along {n} elements")
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(lines), U32(n), U32(inner)]
        return [Dispatch("hardmax", args, groups_1d(lines, 64, ctx.caps))]


__all__ = ["Hardmax"]
