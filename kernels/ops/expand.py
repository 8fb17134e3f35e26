"""Expand: broadcast the input to a constant shape (bidirectionally), as one strided gather."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.broadcast import broadcast_shape, broadcast_strides
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import strided_copy


class Expand(Op):
    op_type = "Expand"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        word_defines(x.dtype)
        shape = [int(v) for v in np.asarray(self.constants[1]).reshape(-1)]
        if any(d < 0 for d in shape):
            raise OpError(f"Expand: negative dimension in shape {shape}")
        self.out_shape = broadcast_shape(x.shape, shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [np.ascontiguousarray(np.broadcast_to(x, self.out_shape))]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        return strided_copy(ctx.inputs[0], ctx.outputs[0], self.out_shape,
                            broadcast_strides(x.shape, self.out_shape), x.dtype, ctx.caps)
