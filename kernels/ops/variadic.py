"""Variadic elementwise ops with multidirectional broadcasting: Sum, Mean, Max, Min.

``y = x0 (op) x1 (op) ... (op) xn`` runs as a chain of ``binary.comp`` dispatches: the first
reads x0 and x1 broadcast to the output shape, each next one updates y in place with one more
input; Mean ends with a scaling pass (``unary.comp``). One input is a broadcast copy.
"""
from __future__ import annotations

from functools import reduce
from typing import Callable, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.broadcast import broadcast_shape
from vkpool.kernels.ops.binary import broadcast_dispatch
from vkpool.kernels.ops.dtypes import FLOAT_TYPES, NUMERIC_TYPES, element_defines, require
from vkpool.kernels.ops.unary import unary_dispatch

_ADD, _MAX, _MIN = 0, 4, 5


class Variadic(Op):
    code: ClassVar[int]
    numpy_op: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray]]
    input_types: ClassVar[frozenset[np.dtype]] = NUMERIC_TYPES

    def check(self) -> None:
        present = [i for i in self.inputs if i is not None]
        if not present or len(present) != len(self.inputs):
            raise OpError(f"{self.op_type}: needs at least one input and no omitted one")
        dtype = present[0].dtype
        if any(i.dtype != dtype for i in present):
            raise OpError(f"{self.op_type}: input types differ ({sorted({str(i.dtype) for i in present})})")
        require(self.op_type, dtype, self.input_types)
        self.out_shape = broadcast_shape(*(i.shape for i in present))

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def flops(self) -> int:
        return max(1, len(self.inputs) - 1) * self.output_infos()[0].size

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        arrays = [np.asarray(x) for x in inputs if x is not None]
        dtype = arrays[0].dtype
        with np.errstate(all="ignore"):
            y = reduce(type(self).numpy_op, arrays[1:], np.broadcast_to(arrays[0], self.out_shape))
        return [np.array(y, dtype=dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        out = (ctx.outputs[0], self.output_infos()[0])
        first = (ctx.inputs[0], self.input(0))
        if len(self.inputs) == 1:
            # max(x, x) is x: a broadcast copy through the same shader
            return [broadcast_dispatch(_MAX, first, first, out, ctx)]
        work = [broadcast_dispatch(self.code, first, (ctx.inputs[1], self.input(1)), out, ctx)]
        for k in range(2, len(self.inputs)):
            work.append(broadcast_dispatch(self.code, out, (ctx.inputs[k], self.input(k)), out, ctx))
        return work


class Sum(Variadic):
    op_type = "Sum"
    code = _ADD
    numpy_op = np.add
    input_types = FLOAT_TYPES


class Max(Variadic):
    op_type = "Max"
    code = _MAX
    numpy_op = np.maximum


class Min(Variadic):
    op_type = "Min"
    code = _MIN
    numpy_op = np.minimum


class Mean(Variadic):
    op_type = "Mean"
    code = _ADD
    numpy_op = np.add
    input_types = FLOAT_TYPES

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        total = super().reference(inputs)[0]
        return [(total / np.float32(len(self.inputs))).astype(total.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        work = super().dispatches(ctx)
        if len(self.inputs) == 1:
            return work
        info = self.output_infos()[0]
        defines = {"OP": 4, **element_defines(info.dtype, "X")}
        scale = unary_dispatch(ctx.outputs[0], ctx.outputs[0], info.size, defines, ctx.caps,
                               (1.0 / len(self.inputs), 0.0, 0.0))
        return work + [scale]
