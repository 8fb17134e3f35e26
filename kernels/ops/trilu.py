"""Trilu (``shaders/trilu.comp``): k is read on the device, so it may be a graph input."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))


class Trilu(Op):
    op_type = "Trilu"

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"Trilu: element type {x.dtype} has no kernel")
        if len(x.shape) < 2:
            raise OpError(f"Trilu: input rank must be at least 2, got {x.shape}")
        if self.has_input(1) and (self.input(1).dtype != np.int64 or self.input(1).size != 1):
            raise OpError("Trilu: k must be an int64 scalar")
        self.upper = bool(self.attr("upper", 1))

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        k = int(inputs[1].reshape(-1)[0]) if len(inputs) > 1 and inputs[1] is not None else 0
        return [np.triu(x, k) if self.upper else np.tril(x, k)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        if x.size == 0:
            return []
        has_k = self.has_input(1)
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]) if has_k else Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]),
                U32(x.size), U32(x.shape[-2]), U32(x.shape[-1])]
        defines = {"UPPER": int(self.upper), "HAS_K": int(has_k), **type_defines(x.dtype)}
        return [Dispatch("trilu", args, groups_1d(x.size, 64, ctx.caps), defines)]


__all__ = ["Trilu"]
