"""Pad (``shaders/pad.comp``): constant, reflect, edge and wrap modes; pads (and axes) must be
known at load time since they fix the output shape; the constant value is read on the device."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, I32, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)
from vkpool.kernels.ops.attrs import str_attr
from vkpool.kernels.ops.reduce import normalize_axes

_MODES = {"constant": 0, "reflect": 1, "edge": 2, "wrap": 3}
_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))


def _padded_rank(op: Op) -> int:
    """The rank of input 0, which pad.comp takes in its element types and up to rank 6."""
    x = op.input(0)
    if x.dtype not in _DTYPES:
        raise UnsupportedOp(f"{op.op_type}: element type {x.dtype} has no kernel")
    if not 1 <= len(x.shape) <= 6:
        raise UnsupportedOp(f"{op.op_type}: rank {len(x.shape)} (1 to 6 supported)")
    return len(x.shape)


class Pad(Op):
    op_type = "Pad"
    constant_inputs = (1, 3)

    def check(self) -> None:
        x = self.input(0)
        rank = _padded_rank(self)
        self.mode = str_attr(self, "mode", "constant")
        if self.mode not in _MODES:
            raise OpError(f"Pad: unknown mode {self.mode!r}")
        if self.opset < 11:
            pads = [int(p) for p in self.attr("pads")]
            axes = list(range(rank))
            self.value = float(self.attr("value", 0.0))
        else:
            pads = [int(p) for p in self.constants[1].reshape(-1)]
            axes = (normalize_axes(self.constants[3].reshape(-1).tolist(), rank, "Pad")
                    if self.has_input(3) else list(range(rank)))
        if len(pads) != 2 * len(axes):
            raise OpError(f"Pad: {len(pads)} pads for {len(axes)} axes")
        self.begin, self.end = [0] * rank, [0] * rank
        for i, a in enumerate(axes):
            self.begin[a], self.end[a] = pads[i], pads[len(axes) + i]
        self.out_shape = tuple(n + b + e for n, b, e in zip(x.shape, self.begin, self.end))
        if min(self.out_shape) < 0:
            raise OpError(f"Pad: pads {pads} crop {x.shape} below zero")
        if self.mode != "constant" and any(
            n == 0 and (b > 0 or e > 0) for n, b, e in zip(x.shape, self.begin, self.end)
        ):
            raise OpError(f"Pad: mode {self.mode!r} cannot pad an empty axis")

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        # crop first (negative pads), then pad with numpy's matching mode
        crop = tuple(slice(max(-b, 0), n - max(-e, 0)) for n, b, e in zip(x.shape, self.begin, self.end))
        widths = [(max(b, 0), max(e, 0)) for b, e in zip(self.begin, self.end)]
        x = x[crop]
        if self.mode == "constant":
            value = self.value if self.opset < 11 else (
                inputs[2].reshape(-1)[0] if len(inputs) > 2 and inputs[2] is not None and inputs[2].size else 0)
            return [np.pad(x, widths, mode="constant", constant_values=value).astype(x.dtype)]
        mode = {"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[self.mode]
        return [np.pad(x, widths, mode=mode)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        n = TensorInfo(self.out_shape, x.dtype).size
        if n == 0:
            return []
        rank = len(x.shape)
        has_value = self.opset >= 11 and self.has_input(2) and self.input(2).size > 0
        fill = [1] * (6 - rank)
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[2]) if has_value else Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]),
                U32(n), U32(rank)]
        args += [U32(v) for v in list(x.shape) + fill] + [U32(v) for v in list(self.out_shape) + fill]
        args += [I32(v) for v in self.begin + [0] * (6 - rank)]
        defines = {"MODE": _MODES[self.mode], **type_defines(x.dtype)}
        # before opset 11 the value is an attribute: a compile-time constant of the variant
        defines["FILL"] = repr(float(self.value)) if self.opset < 11 else "0"
        defines["HAS_VALUE"] = int(has_value)
        return [Dispatch("pad", args, groups_1d(n, 64, ctx.caps), defines)]



class CenterCropPad(Pad):
    """Crops or zero-pads ``axes`` (all by default) to the ``shape`` input around their centres: a
    constant Pad whose pads are negative where it crops."""

    op_type = "CenterCropPad"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        rank = _padded_rank(self)
        shape = [int(v) for v in self.constants[1].reshape(-1)]
        given = [int(a) for a in self.attr("axes", range(rank))]
        normalize_axes(given, rank, "CenterCropPad")  # range and repeats; sizes pair in given order
        axes = [a % rank for a in given]
        if len(shape) != len(axes):
            raise OpError(f"CenterCropPad: {len(shape)} sizes for {len(axes)} axes")
        self.mode, self.value = "constant", 0.0
        self.begin, self.end = [0] * rank, [0] * rank
        for a, size in zip(axes, shape):
            if size < 0:
                raise OpError(f"CenterCropPad: size {size} is negative")
            diff = size - x.shape[a]
            # the odd element of a crop or a pad goes to the end
            self.begin[a] = abs(diff) // 2 if diff > 0 else -(abs(diff) // 2)
            self.end[a] = diff - self.begin[a]
        self.out_shape = tuple(n + b + e for n, b, e in zip(x.shape, self.begin, self.end))


__all__ = ["Pad", "CenterCropPad"]
