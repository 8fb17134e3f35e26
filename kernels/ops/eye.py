"""EyeLike (``shaders/eye.comp``): ones on the ``k``-th diagonal of a 2-D tensor shaped like the
input, in the ``dtype`` attribute's type or the input's; the input's values are not read."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, I32, Op, OpError, Ptr, TensorInfo, U32, groups_1d
from vkpool.kernels.ops.cast import _onnx_dtype
from vkpool.kernels.ops.dtypes import element_defines


class EyeLike(Op):
    op_type = "EyeLike"

    def check(self) -> None:
        x = self.input(0)
        if len(x.shape) != 2:
            raise OpError(f"EyeLike: the input must be 2-D, got {x.shape}")
        dtype = self.attr("dtype")
        self.dtype = _onnx_dtype(int(dtype)) if dtype is not None else x.dtype
        element_defines(self.dtype, "Y")
        self.k = int(self.attr("k", 0))

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(0).shape, self.dtype)]

    def bytes_read(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        rows, cols = self.input(0).shape
        return [np.eye(rows, cols, k=self.k, dtype=self.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        rows, cols = self.input(0).shape
        n = rows * cols
        if n == 0:
            return []
        args = [Ptr(ctx.outputs[0]), U32(n), U32(cols), I32(self.k)]
        return [Dispatch("eye", args, groups_1d(n, 256, ctx.caps), element_defines(self.dtype, "Y"))]
