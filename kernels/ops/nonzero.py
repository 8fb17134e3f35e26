"""NonZero and Size: ops whose output depends on values or shapes.

NonZero's output shape is the count of non-zeros, so its input is one of the op's
``constant_inputs``: the kernel runs only on a tensor whose values are known when the op is
built (an initializer or a folded constant; the loader usually folds such a node away, and a
chunk that still holds one gets a serial kernel). A NonZero of a run-time tensor is a point
where :class:`vkpool.Session` cuts the model (:mod:`vkpool.dynamic`): the part before it runs
on the device, its input is read back, :func:`nonzero_indices` computes the indices on the
host, and the rest of the model is compiled with them as a constant, once per distinct result.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, Ptr, TensorInfo, U32, U64, UnsupportedOp, serial_pieces, type_defines,
)

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))


def nonzero_indices(x: np.ndarray) -> np.ndarray:
    """ONNX NonZero: the indices of the non-zero elements, one row per axis ([1, n] for a scalar)."""
    x = np.asarray(x)
    if x.ndim == 0:
        return np.zeros((1, int(x != 0)), dtype=np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


class NonZero(Op):
    op_type = "NonZero"
    #: the input's values fix the output's shape
    constant_inputs = (0,)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"NonZero: element type {x.dtype} has no kernel")
        if len(x.shape) > 6:
            raise UnsupportedOp(f"NonZero: rank {len(x.shape)} (at most 6)")
        self.nnz = int(np.count_nonzero(self.constants[0]))

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((max(len(self.input(0).shape), 1), self.nnz), np.int64)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [nonzero_indices(x)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        if self.nnz == 0:
            return []
        shape = list(x.shape) or [1]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(x.size), U32(self.nnz), U32(len(shape))]
        args += [U32(v) for v in shape + [1] * (6 - len(shape))]
        flat = np.asarray(self.constants[0]).reshape(-1)
        pieces = serial_pieces(x.size, len(shape) + 1, ctx.caps, "NonZero")
        return [Dispatch("nonzero", [*args, U32(start), U32(count), U32(np.count_nonzero(flat[:start]))], (1, 1, 1),
                         type_defines(x.dtype)) for start, count in pieces]

    def flops(self) -> int:
        return self.input(0).size


class Size(Op):
    op_type = "Size"

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((), np.int64)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [np.array(self.input(0).size, dtype=np.int64)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return [Dispatch("fill_i64", [Ptr(ctx.outputs[0]), U64(self.input(0).size)], (1, 1, 1))]

    def bytes_read(self) -> int:
        return 0


__all__ = ["NonZero", "Size", "nonzero_indices"]
