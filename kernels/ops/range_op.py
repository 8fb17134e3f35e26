"""Range with start, limit and delta known at load time (their values fix the output length)."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, I32, U32, U64, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, groups_1d,
)
from vkpool.kernels.ops.dtypes import element_defines, require

_TYPES = frozenset(np.dtype(t) for t in (np.float32, np.float16, np.int16, np.int32, np.int64))


class Range(Op):
    op_type = "Range"
    constant_inputs = (0, 1, 2)

    def check(self) -> None:
        dtype = self.input(0).dtype
        if any(self.input(k).dtype != dtype for k in (1, 2)):
            raise OpError("Range: start, limit and delta must have one type")
        require(self.op_type, dtype, _TYPES)
        self.start, self.limit, self.delta = (np.asarray(self.constants[k]).reshape(()) for k in range(3))
        if self.delta == 0:
            raise OpError("Range: delta must not be 0")
        count = math.ceil((float(self.limit) - float(self.start)) / float(self.delta))
        self.count = max(count, 0)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((self.count,), self.input(0).dtype)]

    def bytes_read(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        dtype = self.input(0).dtype
        return [(self.start + np.arange(self.count, dtype=np.float64 if dtype.kind == "f" else np.int64)
                 * self.delta).astype(dtype)]

    def _push(self, value: np.ndarray) -> Any:
        dtype = self.input(0).dtype
        if dtype.kind == "f":
            return F32(float(value))
        if dtype.itemsize == 8:
            return U64(int(value) & 0xFFFFFFFFFFFFFFFF)
        return I32(int(value))

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        if self.count == 0:
            return []
        args = [Ptr(ctx.outputs[0]), U32(self.count), self._push(self.start), self._push(self.delta)]
        return [Dispatch("range", args, groups_1d(self.count, 256, ctx.caps),
                         element_defines(self.input(0).dtype, "Y"))]
