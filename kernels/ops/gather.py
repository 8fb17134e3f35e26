"""Gather along one axis with int32/int64 indices (constant or computed), negative ones included."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, groups_1d
from vkpool.kernels.ops.dtypes import word_defines

_INDEX_BUFFERS = {np.dtype(np.int64): ("I64Buf", "int64_t"), np.dtype(np.int32): ("I32Buf", "int")}


class Gather(Op):
    op_type = "Gather"

    def check(self) -> None:
        data, indices = self.input(0), self.input(1)
        word_defines(data.dtype)
        if indices.dtype not in _INDEX_BUFFERS:
            raise OpError(f"Gather: indices must be int32 or int64, got {indices.dtype}")
        rank = len(data.shape)
        axis = int(self.attr("axis", 0))
        if not -rank <= axis < rank:
            raise OpError(f"Gather: axis {axis} out of range for rank {rank}")
        self.axis = axis % rank
        if 1 in self.constants:
            values = np.asarray(self.constants[1])
            dim = data.shape[self.axis]
            if values.size and (values.min() < -dim or values.max() >= dim):
                raise OpError(f"Gather: an index is out of range [-{dim}, {dim - 1}]")

    def output_infos(self) -> list[TensorInfo]:
        data, indices = self.input(0), self.input(1)
        shape = data.shape[:self.axis] + indices.shape + data.shape[self.axis + 1:]
        return [TensorInfo(shape, data.dtype)]

    def flops(self) -> int:
        return 0

    def bytes_read(self) -> int:
        # only the gathered rows of the data are read, plus the indices
        return self.output_infos()[0].nbytes + self.input(1).nbytes

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        data, indices = inputs[0], inputs[1]
        assert data is not None and indices is not None
        return [np.take(data, indices.astype(np.int64), axis=self.axis)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        data, indices = self.input(0), self.input(1)
        n = self.output_infos()[0].size
        if n == 0:
            return []
        inner = math.prod(data.shape[self.axis + 1:])
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n), U32(inner),
                U32(indices.size), U32(data.shape[self.axis])]
        buf, index_type = _INDEX_BUFFERS[indices.dtype]
        defines = {"IBUF": buf, "IT": index_type, **word_defines(data.dtype)}
        return [Dispatch("gather", args, groups_1d(n, 256, ctx.caps), defines)]
