"""Shape, ConstantOfShape and Constant: values known at load time from static shapes or
attributes. The loader folds them; their dispatches write the value where one is still needed."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.fill import fill_repeated, fill_value


class _Known(Op):
    """An op whose single output is ``self.value``, computed in ``check``."""

    value: np.ndarray

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.value.shape, self.value.dtype)]

    def flops(self) -> int:
        return 0

    def bytes_read(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [self.value.copy()]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return fill_value(ctx.outputs[0], self.value, ctx.caps)


class Shape(_Known):
    op_type = "Shape"

    def check(self) -> None:
        shape = self.input(0).shape
        rank = len(shape)
        start, end = int(self.attr("start", 0)), int(self.attr("end", rank))
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        self.value = np.array(shape[start:end], dtype=np.int64)


def _storable(value: np.ndarray, op_type: str) -> np.ndarray:
    if value.dtype.kind in "OUSV":
        raise UnsupportedOp(f"{op_type}: {value.dtype} values have no device storage")
    word_defines(value.dtype)
    return value


class Constant(_Known):
    op_type = "Constant"

    def check(self) -> None:
        given = [k for k in self.attrs if k.startswith("value") or k == "sparse_value"]
        if len(given) != 1:
            raise OpError(f"Constant: exactly one value attribute is required, got {given}")
        name, raw = given[0], self.attrs[given[0]]
        value: Any
        if name == "value":
            value = np.asarray(raw)
        elif name == "value_float":
            value = np.array(raw, dtype=np.float32)
        elif name == "value_floats":
            value = np.array(list(raw), dtype=np.float32)
        elif name == "value_int":
            value = np.array(raw, dtype=np.int64)
        elif name == "value_ints":
            value = np.array(list(raw), dtype=np.int64)
        else:
            raise UnsupportedOp(f"Constant: {name} has no device storage")
        self.value = _storable(value, self.op_type)


class ConstantOfShape(Op):
    op_type = "ConstantOfShape"
    constant_inputs = (0,)

    def check(self) -> None:
        shape = [int(v) for v in np.asarray(self.constants[0]).reshape(-1)]
        if any(d < 0 for d in shape):
            raise OpError(f"ConstantOfShape: negative dimension in {shape}")
        raw = self.attr("value")
        element = np.zeros(1, dtype=np.float32) if raw is None else np.asarray(raw).reshape(-1)
        if element.size != 1:
            raise OpError(f"ConstantOfShape: value must hold one element, got {element.size}")
        self.element = _storable(element, self.op_type)
        self.shape = tuple(shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.shape, self.element.dtype)]

    def flops(self) -> int:
        return 0

    def bytes_read(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [np.full(self.shape, self.element[0], dtype=self.element.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return fill_repeated(ctx.outputs[0], self.element, self.output_infos()[0].size, ctx.caps)
