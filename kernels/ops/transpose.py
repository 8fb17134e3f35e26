"""Transpose: any permutation, as one strided gather (``movement.strided_copy``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import contiguous_strides, strided_copy


class Transpose(Op):
    op_type = "Transpose"

    def check(self) -> None:
        x = self.input(0)
        word_defines(x.dtype)
        rank = len(x.shape)
        perm = self.attr("perm")
        self.perm = [int(p) for p in perm] if perm is not None else list(range(rank - 1, -1, -1))
        if sorted(self.perm) != list(range(rank)):
            raise OpError(f"Transpose: perm {self.perm} is not a permutation of {rank} axes")

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        return [TensorInfo(tuple(x.shape[p] for p in self.perm), x.dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [np.ascontiguousarray(np.transpose(x, self.perm))]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        strides = contiguous_strides(x.shape)
        return strided_copy(ctx.inputs[0], ctx.outputs[0], self.output_infos()[0].shape,
                            [strides[p] for p in self.perm], x.dtype, ctx.caps)
