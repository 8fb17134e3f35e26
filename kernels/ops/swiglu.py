"""SwiGLU: ``y = a * sigmoid(alpha * a) * b`` on equal-shaped float32 inputs."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)


class SwiGLU(Op):
    op_type = "SwiGLU"

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise OpError(f"SwiGLU: inputs must match in shape and type, got {a} and {b}")
        if a.dtype != np.float32:
            raise UnsupportedOp(f"SwiGLU: element type {a.dtype} has no kernel")
        self.alpha = float(self.attr("alpha", 1.0))

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [(a / (1 + np.exp(-np.float32(self.alpha) * a)) * b).astype(np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        if n == 0:
            return []
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n), F32(self.alpha)]
        return [Dispatch("swiglu", args, groups_1d(n, 256, ctx.caps))]

    def flops(self) -> int:
        return 5 * self.input(0).size


__all__ = ["SwiGLU"]
