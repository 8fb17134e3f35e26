"""LRN: local response normalisation across channels."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)

_F32 = np.dtype(np.float32)


class LRN(Op):
    op_type = "LRN"

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != _F32:
            raise UnsupportedOp(f"LRN: only float32 is supported, got {x.dtype}")
        if len(x.shape) < 3:
            raise OpError(f"LRN: X must be N x C x spatial, got {x.shape}")
        self.size = int(self.attr("size", 0))
        if self.size < 1:
            raise OpError("LRN: size (a positive integer) is required")
        self.alpha = float(self.attr("alpha", 1e-4))
        self.beta = float(self.attr("beta", 0.75))
        self.bias = float(self.attr("bias", 1.0))

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        c = x.shape[1]
        sq = np.square(x)
        total = np.zeros_like(x)
        lo_off, hi_off = (self.size - 1) // 2, self.size // 2
        for ch in range(c):
            lo, hi = max(0, ch - lo_off), min(c - 1, ch + hi_off)
            total[:, ch] = sq[:, lo:hi + 1].sum(axis=1)
        y = x / (np.float32(self.bias) + np.float32(self.alpha / self.size) * total) ** np.float32(self.beta)
        return [y.astype(np.float32, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        n = x.size
        return [Dispatch(
            "lrn",
            [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(n), U32(math.prod(x.shape[2:])), U32(x.shape[1]),
             F32(self.alpha), F32(self.beta), F32(self.bias)],
            groups_1d(n, 256, ctx.caps), {"SIZE": self.size},
        )]

    def flops(self) -> int:
        return (2 * self.size + 4) * self.input(0).size


__all__ = ["LRN"]
