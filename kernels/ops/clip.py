"""Clip: bounds as attributes (opset < 11) or as optional inputs (opset >= 11), constant or not."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, I32, U32, U64, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, groups_1d,
)
from vkpool.kernels.ops.dtypes import NUMERIC_TYPES, element_defines, require

_FLT_MAX = float(np.finfo(np.float32).max)


class Clip(Op):
    op_type = "Clip"

    def check(self) -> None:
        x = self.input(0)
        require(self.op_type, x.dtype, NUMERIC_TYPES)
        # bound -> (mode, value): mode 0 absent, 1 known at load time, 2 read from its tensor
        self.bounds: list[tuple[int, Any]] = []
        if self.opset < 11:
            self.bounds = [(1, float(self.attr("min", -_FLT_MAX))), (1, float(self.attr("max", _FLT_MAX)))]
            return
        for pos in (1, 2):
            if not self.has_input(pos):
                self.bounds.append((0, None))
                continue
            info = self.input(pos)
            if info.dtype != x.dtype or info.size != 1:
                raise OpError(f"Clip: bound {pos} must be a scalar of type {x.dtype}, got {info}")
            if pos in self.constants:
                self.bounds.append((1, np.asarray(self.constants[pos]).reshape(()).item()))
            else:
                self.bounds.append((2, None))

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def flops(self) -> int:
        return 2 * self.input(0).size

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        y = x
        for k, (mode, value) in enumerate(self.bounds):
            if mode == 0:
                continue
            bound = inputs[k + 1] if mode == 2 else value
            assert bound is not None
            b = np.asarray(bound).astype(x.dtype).reshape(())
            y = np.where(y < b, b, y) if k == 0 else np.where(y > b, b, y)
        return [np.asarray(y, dtype=x.dtype)]

    def _push_value(self, value: Any) -> Any:
        dtype = self.input(0).dtype
        if dtype.kind == "f":
            return F32(0.0 if value is None else float(value))
        v = 0 if value is None else int(value)
        if dtype.itemsize == 8:
            return U64(v & 0xFFFFFFFFFFFFFFFF)
        return I32(v) if dtype.kind == "i" else U32(v)

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        (lo_mode, lo), (hi_mode, hi) = self.bounds
        lo_ptr = ctx.inputs[1] if lo_mode == 2 else ctx.outputs[0]
        hi_ptr = ctx.inputs[2] if hi_mode == 2 else ctx.outputs[0]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), Ptr(lo_ptr), Ptr(hi_ptr), U32(n),
                self._push_value(lo), self._push_value(hi)]
        defines = {"LO_MODE": lo_mode, "HI_MODE": hi_mode, **element_defines(self.input(0).dtype, "X")}
        return [Dispatch("clip", args, groups_1d(n, 256, ctx.caps), defines)]
