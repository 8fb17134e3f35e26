"""Where: ``cond ? x : y`` with multidirectional broadcasting of all three inputs, any element type."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.broadcast import broadcast_shape, collapse
from vkpool.kernels.ops.dtypes import BOOL, word_defines

_MAX_RANK = 5


class Where(Op):
    op_type = "Where"

    def check(self) -> None:
        cond, x, y = self.input(0), self.input(1), self.input(2)
        if cond.dtype != BOOL:
            raise OpError(f"Where: condition must be bool, got {cond.dtype}")
        if x.dtype != y.dtype:
            raise OpError(f"Where: X and Y types differ ({x.dtype} and {y.dtype})")
        word_defines(x.dtype)  # raises UnsupportedOp for types without device storage
        self.out_shape = broadcast_shape(cond.shape, x.shape, y.shape)
        self.dims, self.strides = collapse(self.out_shape, cond.shape, x.shape, y.shape)
        if len(self.dims) > _MAX_RANK:
            raise UnsupportedOp(f"Where: broadcast over {len(self.dims)} non-mergeable dimensions "
                                f"(at most {_MAX_RANK})")

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(1).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        cond, x, y = inputs
        assert cond is not None and x is not None and y is not None
        return [np.where(cond, x, y).astype(x.dtype, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.output_infos()[0].size
        pad = _MAX_RANK - len(self.dims)
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]), Ptr(ctx.outputs[0]), U32(n),
                U32(len(self.dims))]
        args += [U32(v) for v in self.dims + [1] * pad]
        for strides in self.strides:
            args += [U32(v) for v in strides + [0] * pad]
        return [Dispatch("where", args, groups_1d(n, 256, ctx.caps), word_defines(self.input(1).dtype))]
