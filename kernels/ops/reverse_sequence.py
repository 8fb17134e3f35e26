"""ReverseSequence (``shaders/reverse_sequence.comp``): per batch row, the first ``sequence_lens``
time steps reversed; the lengths are read on the device, so they may be a graph input."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, groups_1d
from vkpool.kernels.ops.dtypes import word_defines

_LENGTH_BUFFERS = {np.dtype(np.int64): "I64Buf", np.dtype(np.int32): "I32Buf"}


class ReverseSequence(Op):
    op_type = "ReverseSequence"

    def check(self) -> None:
        x, lens = self.input(0), self.input(1)
        word_defines(x.dtype)
        self.batch_axis = int(self.attr("batch_axis", 1))
        self.time_axis = int(self.attr("time_axis", 0))
        if {self.batch_axis, self.time_axis} != {0, 1} or len(x.shape) < 2:
            raise OpError("ReverseSequence: batch_axis and time_axis must be 0 and 1 of a rank >= 2 input")
        if lens.dtype not in _LENGTH_BUFFERS or lens.shape != (x.shape[self.batch_axis],):
            raise OpError("ReverseSequence: sequence_lens must be int32/int64 of shape "
                          f"({x.shape[self.batch_axis]},)")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, lens = inputs[0], inputs[1]
        assert x is not None and lens is not None
        y = np.array(x, copy=True)
        for b, length in enumerate(lens.astype(np.int64)):
            index: list[slice | int] = [slice(None)] * x.ndim
            index[self.batch_axis] = b
            index[self.time_axis] = slice(0, int(length))
            time = self.time_axis - (self.time_axis > self.batch_axis)  # the batch axis is indexed away
            y[tuple(index)] = np.flip(x[tuple(index)], axis=time)
        return [y]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        if x.size == 0:
            return []
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(x.size), U32(x.shape[1]),
                U32(math.prod(x.shape[2:]))]
        defines = {"BATCH_AXIS": self.batch_axis, "LBUF": _LENGTH_BUFFERS[self.input(1).dtype],
                   **word_defines(x.dtype)}
        return [Dispatch("reverse_sequence", args, groups_1d(x.size, 256, ctx.caps), defines)]
