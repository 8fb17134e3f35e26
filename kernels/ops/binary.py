"""Elementwise binary ops with multidirectional broadcasting (``shaders/binary.comp``)."""
from __future__ import annotations

from typing import Callable, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)
from vkpool.kernels.broadcast import MAX_RANK, broadcast_shape, collapse

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


class Binary(Op):
    """Base of ``y = a (op) b``: subclasses set ``code`` and ``numpy_op``."""

    code: ClassVar[int]
    numpy_op: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray]]

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        if a.dtype != b.dtype:
            raise OpError(f"{self.op_type}: input types differ ({a.dtype} and {b.dtype})")
        if a.dtype not in _DTYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {a.dtype} has no kernel")
        self.out_shape = broadcast_shape(a.shape, b.shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [np.asarray(type(self).numpy_op(a, b)).astype(a.dtype, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        dims, (sa, sb) = collapse(self.out_shape, self.input(0).shape, self.input(1).shape)
        pad = [1] * (MAX_RANK - len(dims))
        zeros = [0] * (MAX_RANK - len(dims))
        n = TensorInfo(self.out_shape, self.input(0).dtype).size
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n), U32(len(dims))]
        args += [U32(v) for v in dims + pad] + [U32(v) for v in sa + zeros] + [U32(v) for v in sb + zeros]
        return [
            Dispatch(
                "binary", args, groups_1d(n, 256, ctx.caps),
                {"OP": self.code, **type_defines(self.input(0).dtype)},
            )
        ]


class Add(Binary):
    op_type = "Add"
    code = 0
    numpy_op = np.add


class Sub(Binary):
    op_type = "Sub"
    code = 1
    numpy_op = np.subtract


class Mul(Binary):
    op_type = "Mul"
    code = 2
    numpy_op = np.multiply


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer Div truncates toward zero
    return np.divide(a, b)


class Div(Binary):
    op_type = "Div"
    code = 3
    numpy_op = staticmethod(_divide)


__all__ = ["Add", "Sub", "Mul", "Div", "Binary"]
