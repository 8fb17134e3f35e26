"""NonZero and Size: ops whose output depends on values or shapes known only at load time.

NonZero's output shape is the count of non-zeros, so vkpool runs it only when its input is a
constant (the loader usually folds such a node away; a chunk that still holds one gets a
serial kernel). A NonZero of a run-time tensor is refused with :class:`UnsupportedOp`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, Ptr, TensorInfo, U32, U64, UnsupportedOp, type_defines,
)

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))


class NonZero(Op):
    op_type = "NonZero"

    def check(self) -> None:
        x = self.input(0)
        if 0 not in self.constants:
            raise UnsupportedOp(
                "NonZero: the output shape depends on the input's values, so vkpool runs NonZero only "
                "on a tensor known at load time (an initializer or a folded constant)")
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
        if x.ndim == 0:
            return [np.zeros((1, int(x != 0)), dtype=np.int64)]
        return [np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        if self.nnz == 0:
            return []
        shape = list(x.shape) or [1]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(x.size), U32(self.nnz), U32(len(shape))]
        args += [U32(v) for v in shape + [1] * (6 - len(shape))]
        return [Dispatch("nonzero", args, (1, 1, 1), type_defines(x.dtype))]

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


__all__ = ["NonZero", "Size"]
