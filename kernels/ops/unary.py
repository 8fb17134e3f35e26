"""Elementwise float32 activations sharing ``shaders/unary.comp``."""
from __future__ import annotations

from typing import ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)


class UnaryFloat(Op):
    """Base of ``y = f(x)`` ops on float32: subclasses set ``code`` and ``compute``."""

    code: ClassVar[int]

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != np.float32:
            raise UnsupportedOp(f"{self.op_type}: only float32 is supported, got {x.dtype}")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def params(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [self.compute(x).astype(np.float32, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        alpha, beta = self.params()
        return [
            Dispatch(
                "unary",
                [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(n), F32(alpha), F32(beta)],
                groups_1d(n, 256, ctx.caps),
                {"OP": self.code},
            )
        ]


class Relu(UnaryFloat):
    op_type = "Relu"
    code = 0

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x, np.float32(0))


class LeakyRelu(UnaryFloat):
    op_type = "LeakyRelu"
    code = 1

    def params(self) -> tuple[float, float]:
        return (float(self.attr("alpha", 0.01)), 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.where(x >= 0, x, x * np.float32(self.params()[0]))


__all__ = ["Relu", "LeakyRelu", "UnaryFloat", "OpError"]
