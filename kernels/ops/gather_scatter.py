"""GatherElements, GatherND, ScatterElements (and its deprecated name Scatter), ScatterND.

Scatters first copy ``data`` to the output, then apply the updates with invocations that own
disjoint output elements (a line along the axis, or an element of the slice) and walk the
indices in order, so duplicate indices follow ONNX's sequential semantics without atomics.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
    type_defines,
)
from vkpool.kernels.ops.attrs import str_attr
from vkpool.kernels.ops.reduce import normalize_axes

_DTYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.bool_))
_INDEX_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))
_REDUCTIONS = {"none": 0, "add": 1, "mul": 2, "max": 3, "min": 4}


def _pad6(values: Sequence[int], fill: int = 1) -> list[U32]:
    if len(values) > 6:
        raise UnsupportedOp(f"rank {len(values)} (at most 6)")
    return [U32(int(v)) for v in list(values) + [fill] * (6 - len(values))]


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


class _Indexed(Op):
    """Shared checks: data types, index type, reduction attribute."""

    index_pos: ClassVar[int] = 1

    def check(self) -> None:
        x, idx = self.input(0), self.input(self.index_pos)
        if x.dtype not in _DTYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        if idx.dtype not in _INDEX_DTYPES:
            raise OpError(f"{self.op_type}: indices must be int32 or int64, got {idx.dtype}")
        if len(x.shape) > 6 or len(idx.shape) > 6:
            raise UnsupportedOp(f"{self.op_type}: rank above 6")
        red = str_attr(self, "reduction", "none")
        if red not in _REDUCTIONS:
            raise OpError(f"{self.op_type}: unknown reduction {red!r}")
        if red != "none" and x.dtype.kind == "b":
            raise UnsupportedOp(f"{self.op_type}: reduction {red!r} on bool")
        self.reduction = red
        self.setup()

    def setup(self) -> None:
        pass

    def defines(self, **extra: int) -> dict[str, object]:
        return {**type_defines(self.input(0).dtype), **type_defines(self.input(self.index_pos).dtype, "I_"),
                "RED": _REDUCTIONS[self.reduction], **extra}


def _apply(out: np.ndarray, where: tuple, value: object, reduction: str) -> None:
    if reduction == "add":
        out[where] += value
    elif reduction == "mul":
        out[where] *= value
    elif reduction == "max":
        out[where] = max(out[where], value)
    elif reduction == "min":
        out[where] = min(out[where], value)
    else:
        out[where] = value


class GatherElements(_Indexed):
    op_type = "GatherElements"

    def setup(self) -> None:
        x, idx = self.input(0), self.input(1)
        if len(idx.shape) != len(x.shape):
            raise OpError(f"{self.op_type}: indices rank {len(idx.shape)} differs from data rank {len(x.shape)}")
        self.axis = normalize_axes([self.attr("axis", 0)], len(x.shape), self.op_type)[0]

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(1).shape, self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        idx = np.where(idx < 0, idx + x.shape[self.axis], idx)
        return [np.take_along_axis(x, idx.astype(np.int64), axis=self.axis)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, idx = self.input(0), self.input(1)
        if idx.size == 0:
            return []
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(idx.size), U32(len(x.shape)),
                U32(self.axis), *_pad6(idx.shape), *_pad6(x.shape)]
        return [Dispatch("gather_elements", args, groups_1d(idx.size, 64, ctx.caps), self.defines())]


class ScatterElements(_Indexed):
    op_type = "ScatterElements"

    def setup(self) -> None:
        x, idx, upd = self.input(0), self.input(1), self.input(2)
        if idx.shape != upd.shape or len(idx.shape) != len(x.shape):
            raise OpError(f"{self.op_type}: indices {idx.shape} and updates {upd.shape} must match, rank of data")
        if upd.dtype != x.dtype:
            raise OpError(f"{self.op_type}: updates type {upd.dtype} differs from data type {x.dtype}")
        self.axis = normalize_axes([self.attr("axis", 0)], len(x.shape), self.op_type)[0]

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, idx, upd = inputs[0], inputs[1], inputs[2]
        assert x is not None and idx is not None and upd is not None
        out = x.copy()
        for pos in np.ndindex(*idx.shape):
            j = int(idx[pos])
            target = list(pos)
            target[self.axis] = j + x.shape[self.axis] if j < 0 else j
            _apply(out, tuple(target), upd[pos], self.reduction)
        return [out]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, upd = self.input(0), self.input(2)
        io = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]), Ptr(ctx.outputs[0])]
        tail = [U32(len(x.shape)), U32(self.axis), *_pad6(upd.shape), *_pad6(x.shape)]
        out: list[Dispatch] = []
        if x.size:
            out.append(Dispatch("scatter_elements", io + [U32(x.size)] + tail, groups_1d(x.size, 64, ctx.caps),
                                self.defines(COPY=1)))
        if upd.size:
            check_serial(upd.shape[self.axis], ctx.caps, f"{self.op_type} of {upd.shape[self.axis]} updates a line")
            lines = upd.size // upd.shape[self.axis]
            out.append(Dispatch("scatter_elements", io + [U32(lines)] + tail, groups_1d(lines, 64, ctx.caps),
                                self.defines(COPY=0)))
        return out


class Scatter(ScatterElements):
    """Opset 9-10 name of ScatterElements (no reduction)."""

    op_type = "Scatter"


class GatherND(_Indexed):
    op_type = "GatherND"

    def setup(self) -> None:
        x, idx = self.input(0), self.input(1)
        b = int(self.attr("batch_dims", 0))
        k = idx.shape[-1] if idx.shape else 0
        if not idx.shape or b < 0 or b + k > len(x.shape) or x.shape[:b] != idx.shape[:b]:
            raise OpError(f"{self.op_type}: indices {idx.shape} do not index data {x.shape} with batch_dims={b}")
        self.b, self.k = b, k
        self.out_shape = tuple(idx.shape[:-1]) + tuple(x.shape[b + k:])

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, idx = inputs[0], inputs[1]
        assert x is not None and idx is not None
        b, k = self.b, self.k
        batch = math.prod(x.shape[:b])
        xs = x.reshape((batch,) + x.shape[b:])
        ts = idx.reshape((batch, -1, k))
        out = []
        for i in range(batch):
            for t in ts[i]:
                pos = tuple(int(v) + (x.shape[b + j] if v < 0 else 0) for j, v in enumerate(t))
                out.append(xs[i][pos])
        return [np.array(out, dtype=x.dtype).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, idx = self.input(0), self.input(1)
        b, k = self.b, self.k
        n = math.prod(self.out_shape)
        if n == 0:
            return []
        slice_ = math.prod(x.shape[b + k:])
        batch_inner = math.prod(idx.shape[b:-1])
        batch_stride = math.prod(x.shape[b:])
        strides = _strides(x.shape)[b:b + k]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n), U32(k), U32(slice_),
                U32(batch_inner), U32(batch_stride), *_pad6(x.shape[b:b + k]), *_pad6(strides, 0)]
        return [Dispatch("gather_nd", args, groups_1d(n, 64, ctx.caps), self.defines())]


class ScatterND(_Indexed):
    op_type = "ScatterND"

    def setup(self) -> None:
        x, idx, upd = self.input(0), self.input(1), self.input(2)
        k = idx.shape[-1] if idx.shape else 0
        if not idx.shape or k > len(x.shape) or tuple(upd.shape) != tuple(idx.shape[:-1]) + tuple(x.shape[k:]):
            raise OpError(f"{self.op_type}: indices {idx.shape}/updates {upd.shape} do not fit data {x.shape}")
        if upd.dtype != x.dtype:
            raise OpError(f"{self.op_type}: updates type {upd.dtype} differs from data type {x.dtype}")
        self.k = k

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, idx, upd = inputs[0], inputs[1], inputs[2]
        assert x is not None and idx is not None and upd is not None
        out = x.copy()
        k = self.k
        tuples = idx.reshape(-1, k)
        slices = upd.reshape((len(tuples),) + x.shape[k:])
        for t, s in zip(tuples, slices):
            pos = tuple(int(v) + (x.shape[j] if v < 0 else 0) for j, v in enumerate(t))
            if self.reduction == "none":
                out[pos] = s
            elif self.reduction == "add":
                out[pos] += s
            elif self.reduction == "mul":
                out[pos] *= s
            elif self.reduction == "max":
                out[pos] = np.maximum(out[pos], s)
            else:
                out[pos] = np.minimum(out[pos], s)
        return [out]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, idx = self.input(0), self.input(1)
        k = self.k
        slice_ = math.prod(x.shape[k:])
        tuples = idx.size // max(k, 1) if k else math.prod(idx.shape[:-1])
        io = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]), Ptr(ctx.outputs[0])]
        tail = [U32(tuples), U32(k), *_pad6(x.shape[:k]), *_pad6(_strides(x.shape)[:k], 0)]
        out: list[Dispatch] = []
        if x.size:
            out.append(Dispatch("scatter_nd", io + [U32(x.size)] + tail, groups_1d(x.size, 64, ctx.caps),
                                self.defines(COPY=1)))
            if tuples and slice_:
                check_serial(tuples * (k + 1), ctx.caps, f"ScatterND of {tuples} index tuples")
                out.append(Dispatch("scatter_nd", io + [U32(slice_)] + tail, groups_1d(slice_, 64, ctx.caps),
                                    self.defines(COPY=0)))
        return out


__all__ = ["GatherElements", "GatherND", "ScatterElements", "Scatter", "ScatterND"]
