"""DepthToSpace and SpaceToDepth (DCR and CRD modes): reshape-transpose-reshape, run as one strided
gather (``shaders/permute.comp``) over a 6-D view of the output."""
from __future__ import annotations

from abc import abstractmethod

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)
from vkpool.kernels.ops.attrs import str_attr

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))


class _Rearrange(Op):
    """Subclasses give ``view()``: the output as 6 dims and each dim's stride in x."""

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        if len(x.shape) != 4:
            raise OpError(f"{self.op_type}: input must be [N, C, H, W], got {x.shape}")
        self.b = int(self.attr("blocksize"))
        if self.b <= 0:
            raise OpError(f"{self.op_type}: blocksize must be positive")
        self.setup()

    @abstractmethod
    def setup(self) -> None:
        """Derives the block rearrangement from the attributes."""

    @abstractmethod
    def view(self) -> tuple[list[int], list[int]]:
        """The input viewed as (shape, strides) in output order."""

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        shape, strides = self.view()
        view = np.lib.stride_tricks.as_strided(
            np.ascontiguousarray(x), shape, [s * x.itemsize for s in strides])
        return [np.ascontiguousarray(view).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        if x.size == 0:
            return []
        shape, strides = self.view()
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(x.size), U32(6)]
        args += [U32(v) for v in shape] + [U32(v) for v in strides]
        return [Dispatch("permute", args, groups_1d(x.size, 64, ctx.caps), type_defines(x.dtype))]


class DepthToSpace(_Rearrange):
    op_type = "DepthToSpace"

    def setup(self) -> None:
        n, c, h, w = self.input(0).shape
        b = self.b
        if c % (b * b):
            raise OpError(f"DepthToSpace: {c} channels are not a multiple of blocksize² = {b * b}")
        self.mode = str_attr(self, "mode", "DCR")
        if self.mode not in ("DCR", "CRD"):
            raise OpError(f"DepthToSpace: unknown mode {self.mode!r}")
        self.out_shape = (n, c // (b * b), h * b, w * b)

    def view(self) -> tuple[list[int], list[int]]:
        n, c, h, w = self.input(0).shape
        b = self.b
        cc = c // (b * b)
        # output [N, C', H, b1, W, b2]
        if self.mode == "DCR":  # x viewed as [N, b1, b2, C', H, W]
            strides = [c * h * w, h * w, w, b * cc * h * w, 1, cc * h * w]
        else:  # CRD: x viewed as [N, C', b1, b2, H, W]
            strides = [c * h * w, b * b * h * w, w, b * h * w, 1, h * w]
        return [n, cc, h, b, w, b], strides


class SpaceToDepth(_Rearrange):
    op_type = "SpaceToDepth"

    def setup(self) -> None:
        n, c, h, w = self.input(0).shape
        b = self.b
        if h % b or w % b:
            raise OpError(f"SpaceToDepth: {h}x{w} is not a multiple of blocksize {b}")
        self.mode = str_attr(self, "mode", "DCR")  # the attribute exists from opset 25
        if self.mode not in ("DCR", "CRD"):
            raise OpError(f"SpaceToDepth: unknown mode {self.mode!r}")
        self.out_shape = (n, c * b * b, h // b, w // b)

    def view(self) -> tuple[list[int], list[int]]:
        n, c, h, w = self.input(0).shape
        b = self.b
        if self.mode == "CRD":  # output [N, C, b1, b2, H', W'] of x viewed as [N, C, H', b1, W', b2]
            return [n, c, b, b, h // b, w // b], [c * h * w, h * w, w, 1, b * w, b]
        # DCR: output [N, b1, b2, C, H', W']
        return [n, b, b, c, h // b, w // b], [c * h * w, w, 1, h * w, b * w, b]


__all__ = ["DepthToSpace", "SpaceToDepth"]
