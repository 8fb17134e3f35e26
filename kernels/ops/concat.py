"""Concat: any axis, any number of inputs; one scatter per input into its slab of the output."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import contiguous_strides, strided_copy


class Concat(Op):
    op_type = "Concat"

    def check(self) -> None:
        if not self.inputs or any(i is None for i in self.inputs):
            raise OpError("Concat: needs at least one input and no omitted one")
        first = self.input(0)
        word_defines(first.dtype)
        rank = len(first.shape)
        if "axis" in self.attrs:
            axis = int(self.attrs["axis"])
        elif self.opset < 4:
            axis = 1  # Concat-1's default
        else:
            raise OpError("Concat: the axis attribute is required")
        if rank == 0:
            raise OpError("Concat: inputs must have rank >= 1")
        if not -rank <= axis < rank:
            raise OpError(f"Concat: axis {axis} out of range for rank {rank}")
        self.axis = axis % rank
        shape = list(first.shape)
        for k in range(1, len(self.inputs)):
            info = self.input(k)
            if info.dtype != first.dtype or len(info.shape) != rank or any(
                    a != b for d, (a, b) in enumerate(zip(info.shape, first.shape)) if d != self.axis):
                raise OpError(f"Concat: input {k} {info} does not match input 0 {first} outside axis {axis}")
            shape[self.axis] += info.shape[self.axis]
        self.out_shape = tuple(shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [np.concatenate([np.asarray(x) for x in inputs], axis=self.axis)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        out_strides = contiguous_strides(self.out_shape)
        work: list[Dispatch] = []
        offset = 0
        for k, handle in enumerate(ctx.inputs):
            info = self.input(k)
            work += strided_copy(handle, ctx.outputs[0], info.shape, out_strides, info.dtype, ctx.caps,
                                 base=offset * out_strides[self.axis], scatter=True)
            offset += info.shape[self.axis]
        return work
