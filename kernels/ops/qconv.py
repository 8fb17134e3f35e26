"""ConvInteger and QLinearConv (``shaders/qconv.comp``): a direct convolution of 8-bit integers
accumulated in int32, with Conv's geometry (1-3 spatial dimensions, groups, strides, dilations,
pads, auto_pad). The input's zero point is per tensor; the weight's zero point and scale per
tensor or per output channel; QLinearConv's scales are float32."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
)
from vkpool.kernels.ops.dtypes import element_defines
from vkpool.kernels.ops.spatial import Window, window, window_view

_BYTES = frozenset(np.dtype(t) for t in (np.uint8, np.int8))
_F32 = np.dtype(np.float32)


class ConvInteger(Op):
    op_type = "ConvInteger"
    rereads_inputs = True
    #: input positions of x, w, their zero points, and (QLinearConv) the scales, y's zero point, B
    x_pos, w_pos, x_zero, w_zero = 0, 1, 2, 3
    mode = 0

    def check(self) -> None:
        x, w = self.input(self.x_pos), self.input(self.w_pos)
        if x.dtype not in _BYTES or w.dtype not in _BYTES:
            raise UnsupportedOp(f"{self.op_type}: only 8-bit integer x and w, got {x.dtype} and {w.dtype}")
        if len(x.shape) < 3 or len(w.shape) != len(x.shape):
            raise OpError(f"{self.op_type}: X {x.shape}, W {w.shape} must be N x C x spatial, M x C/group x kernel")
        self.group = int(self.attr("group", 1))
        n, c = x.shape[:2]
        m, cg = w.shape[:2]
        if self.group < 1 or c % self.group or m % self.group or cg * self.group != c:
            raise OpError(f"{self.op_type}: {c} input and {m} output channels do not split in {self.group} "
                          f"groups of W {w.shape}")
        kernel = tuple(int(k) for k in self.attr("kernel_shape", w.shape[2:]))
        if kernel != tuple(w.shape[2:]):
            raise OpError(f"{self.op_type}: kernel_shape {kernel} differs from W's {w.shape[2:]}")
        self.win: Window = window(self.op_type, self.attrs, x.shape[2:], kernel)
        self.out_shape = (n, m, *self.win.out_shape)
        if self.has_input(self.x_zero) and self.input(self.x_zero).size != 1:
            raise UnsupportedOp(f"{self.op_type}: x_zero_point must be per tensor (one value)")
        self.w_zero_per_m = self.per_channel(self.w_zero, "w_zero_point")

    def per_channel(self, pos: int, what: str) -> int:
        """1 when input ``pos`` holds one value per output channel, 0 for one value (or absent)."""
        if not self.has_input(pos):
            return 0
        size, m = self.input(pos).size, self.input(self.w_pos).shape[0]
        if size not in (1, m):
            raise OpError(f"{self.op_type}: {what} must have 1 or {m} values, got {size}")
        return int(size == m and m != 1)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, np.dtype(np.int32))]

    def accumulate(self, inputs: Sequence[np.ndarray | None]) -> np.ndarray:
        """The int32 sums of (x - x_zero) (w - w_zero) per output element."""
        x, w = inputs[self.x_pos], inputs[self.w_pos]
        assert x is not None and w is not None

        def zero(pos: int, shape: tuple[int, ...]) -> Any:
            value = inputs[pos] if len(inputs) > pos else None
            return 0 if value is None else value.astype(np.int32).reshape(shape if value.size > 1 else ())

        xs = x.astype(np.int32) - zero(self.x_zero, ())
        ws = w.astype(np.int32) - zero(self.w_zero, (-1,) + (1,) * (w.ndim - 1))
        cols = window_view(xs, self.win, 0)
        n, c = x.shape[:2]
        m, cg = w.shape[:2]
        g, kp, op = self.group, math.prod(self.win.kernel), math.prod(self.win.out_shape)
        y = np.einsum("gmk,ngkp->ngmp", ws.reshape(g, m // g, cg * kp), cols.reshape(n, g, cg * kp, op))
        return y.reshape(self.out_shape).astype(np.int32)

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [self.accumulate(inputs)]

    def flops(self) -> int:
        return math.prod(self.out_shape) * 2 * math.prod(self.input(self.w_pos).shape[1:])

    def dispatch_args(self, ctx: DispatchContext) -> tuple[list[Any], dict[str, Any]]:
        """Pointers and defines of QLinearConv's scales, y's zero point and B (placeholders here)."""
        y = ctx.outputs[0]
        return [Ptr(ctx.inputs[self.x_pos])] * 3 + [Ptr(y), Ptr(y)], {
            "HAS_BIAS": 0, "W_SCALE_PER_M": 0, "QMIN": "0.0", "QMAX": "0.0", **element_defines(np.dtype(np.int32), "Y")}

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        total = math.prod(self.out_shape)
        if total == 0:
            return []
        x, w = self.input(self.x_pos), self.input(self.w_pos)
        check_serial(math.prod(w.shape[1:]) + w.shape[1] * (1 + math.prod(w.shape[2:-1])), ctx.caps,
                     f"{self.op_type} over {math.prod(w.shape[1:])} products")
        xp, wp = Ptr(ctx.inputs[self.x_pos]), Ptr(ctx.inputs[self.w_pos])
        zx = Ptr(ctx.inputs[self.x_zero]) if self.has_input(self.x_zero) else xp
        zw = Ptr(ctx.inputs[self.w_zero]) if self.has_input(self.w_zero) else wp
        tail, extra = self.dispatch_args(ctx)
        args = [xp, wp, zx, zw, *tail, Ptr(ctx.outputs[0]), U32(total), U32(int(self.has_input(self.x_zero))),
                U32(int(self.has_input(self.w_zero)))]
        defines = {"MODE": self.mode, "C": x.shape[1], "M": w.shape[0], "G": self.group,
                   "W_ZERO_PER_M": self.w_zero_per_m, **element_defines(x.dtype, "X"), **element_defines(w.dtype, "W"),
                   **{k: v for k, v in self.win.defines().items() if not k.startswith("Q")}, **extra}
        return [Dispatch("qconv", args, groups_1d(total, 256, ctx.caps), defines)]


class QLinearConv(ConvInteger):
    op_type = "QLinearConv"
    # x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B
    x_pos, w_pos, x_zero, w_zero = 0, 3, 2, 5
    mode = 1

    def check(self) -> None:
        super().check()
        for pos, what in ((1, "x_scale"), (6, "y_scale")):
            if self.input(pos).dtype != _F32 or self.input(pos).size != 1:
                raise UnsupportedOp(f"{self.op_type}: {what} must be one float32")
        if self.input(4).dtype != _F32:
            raise UnsupportedOp(f"{self.op_type}: w_scale must be float32")
        self.w_scale_per_m = self.per_channel(4, "w_scale")
        y_zero = self.input(7)
        if y_zero.dtype not in _BYTES or y_zero.size != 1:
            raise UnsupportedOp(f"{self.op_type}: y_zero_point must be one 8-bit integer")
        if self.has_input(8) and (self.input(8).dtype != np.dtype(np.int32) or self.input(8).shape != (self.out_shape[1],)):
            raise OpError(f"{self.op_type}: B must be int32 of shape ({self.out_shape[1]},)")

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(7).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        acc = self.accumulate(inputs)
        if len(inputs) > 8 and inputs[8] is not None:
            acc = acc + inputs[8].reshape(1, -1, *([1] * self.win.rank))
        x_scale, w_scale, y_scale, y_zero = (np.asarray(inputs[p]) for p in (1, 4, 6, 7))
        scale = (x_scale.astype(np.float32).reshape(()) * w_scale.astype(np.float32).reshape(-1)
                 / y_scale.astype(np.float32).reshape(())).astype(np.float32)
        scaled = acc.astype(np.float32) * scale.reshape(1, -1, *([1] * self.win.rank))
        info = np.iinfo(y_zero.dtype)
        y = np.clip(np.rint(scaled) + y_zero.astype(np.float32).reshape(()), info.min, info.max)
        return [y.astype(y_zero.dtype)]

    def dispatch_args(self, ctx: DispatchContext) -> tuple[list[Any], dict[str, Any]]:
        y_dtype = self.input(7).dtype
        info = np.iinfo(y_dtype)
        bias = Ptr(ctx.inputs[8]) if self.has_input(8) else Ptr(ctx.outputs[0])
        return [Ptr(ctx.inputs[1]), Ptr(ctx.inputs[4]), Ptr(ctx.inputs[6]), Ptr(ctx.inputs[7]), bias], {
            "HAS_BIAS": int(self.has_input(8)), "W_SCALE_PER_M": self.w_scale_per_m,
            "QMIN": f"{float(info.min)}", "QMAX": f"{float(info.max)}", **element_defines(y_dtype, "Y")}


__all__ = ["ConvInteger", "QLinearConv"]
