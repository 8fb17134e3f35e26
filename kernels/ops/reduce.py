"""The Reduce* family (``shaders/reduce.comp``): one shader, the op selected by a define.

Axes come from the ``axes`` attribute (before opset 13 for ReduceSum, 18 for the others) or
from the second input, which must then be known at load time since it fixes the output shape.
The input is viewed as a collapsed shape with a bit mask of reduced dimensions
(:func:`reduction_view`), so reducing any axis set costs no transposition.
"""
from __future__ import annotations

from abc import abstractmethod

import math
from typing import Callable, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d, type_defines,
)

MAX_VIEW_RANK = 6
#: reductions at least this long get a workgroup per output and a shared-memory tree
LONG_REDUCTION = 64


def normalize_axes(axes: Sequence[int], rank: int, op_type: str) -> list[int]:
    out = []
    for a in axes:
        a = int(a)
        if not -rank <= a < max(rank, 1):
            raise OpError(f"{op_type}: axis {a} is out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    if len(set(out)) != len(out):
        raise OpError(f"{op_type}: repeated axis in {list(axes)}")
    return sorted(out)


def reduction_view(shape: Sequence[int], axes: Sequence[int]) -> tuple[list[int], int]:
    """Collapses ``shape`` into at most 6 dimensions, merging neighbours that are both reduced
    or both kept and dropping extent-1 dimensions; returns the view and its reduced-bit mask."""
    reduced = set(axes)
    dims: list[int] = []
    flags: list[bool] = []
    for d, n in enumerate(shape):
        if n == 1:
            continue
        r = d in reduced
        if flags and flags[-1] == r:
            dims[-1] *= n
        else:
            dims.append(n)
            flags.append(r)
    if not dims:
        dims, flags = [1], [False]
    if len(dims) > MAX_VIEW_RANK:
        raise UnsupportedOp(f"reduction over {len(dims)} alternating kept/reduced dimensions (at most 6)")
    mask = sum(1 << d for d, r in enumerate(flags) if r)
    return dims, mask


def extreme_defines(dtype: np.dtype, acc: str) -> dict[str, str]:
    """LOWEST/HIGHEST: the identities of max and min in the accumulator type."""
    if acc == "float":
        return {"LOWEST": "uintBitsToFloat(0xff800000u)", "HIGHEST": "uintBitsToFloat(0x7f800000u)"}
    if acc == "int64_t":
        # NOTE: glslang rejects 64-bit literals in command-line defines (tokenised before the
        # shader's #extension lines), so the extremes are built from 32-bit ones.
        return {"LOWEST": "int64_t(uint64_t(1u)<<63)", "HIGHEST": "int64_t(~(uint64_t(1u)<<63))"}
    if acc == "int":
        return {"LOWEST": "(-2147483647 - 1)", "HIGHEST": "2147483647"}
    return {"LOWEST": "0u", "HIGHEST": "255u"}  # bool / uint8 held in a uint


def row_geometry(nout: int, nred: int, caps) -> tuple[int, tuple[int, int, int]]:
    """Threads per output and workgroup counts: a workgroup per output for long reductions."""
    if nred >= LONG_REDUCTION:
        threads = 256 if nred >= 4096 else 64
        return threads, groups_1d(nout, 1, caps)
    return 1, groups_1d(nout, 64, caps)


_ACC_OF = {np.dtype(np.float32): "float", np.dtype(np.int64): "int64_t", np.dtype(np.int32): "int",
           np.dtype(np.uint8): "uint", np.dtype(np.bool_): "uint"}


class Reduce(Op):
    """Base of the Reduce* ops: subclasses set ``code``, ``compute`` and ``axes_input_since``."""

    code: ClassVar[int]
    axes_input_since: ClassVar[int] = 18
    dtypes: ClassVar[tuple[type, ...]] = (np.float32, np.int64, np.int32)
    float_only_math: ClassVar[bool] = False  # L2, LogSum, LogSumExp accumulate in float
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in [np.dtype(t) for t in self.dtypes]:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        rank = len(x.shape)
        if self.opset >= self.axes_input_since:
            raw = self.constants[1].reshape(-1).tolist() if self.has_input(1) else []
        else:
            raw = list(self.attr("axes", []) or [])
        self.keepdims = bool(self.attr("keepdims", 1))
        if not raw:
            noop = self.opset >= self.axes_input_since and bool(self.attr("noop_with_empty_axes", 0))
            self.axes = [] if noop else list(range(rank))
        else:
            self.axes = normalize_axes(raw, rank, self.op_type)
        if self.keepdims:
            self.out_shape = tuple(1 if d in self.axes else n for d, n in enumerate(x.shape))
        else:
            self.out_shape = tuple(n for d, n in enumerate(x.shape) if d not in self.axes)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    @abstractmethod
    def compute(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        """numpy reduction over ``axes`` (kept as size-1 dimensions)."""

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        if not self.axes:
            return [x.copy()]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = self.compute(x, tuple(self.axes))
        return [np.asarray(y).astype(x.dtype).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        dims, mask = reduction_view(x.shape, self.axes)
        nout = math.prod(self.out_shape)
        nred = math.prod(x.shape[a] for a in self.axes)
        if nout == 0:
            return []
        acc = "float" if self.float_only_math else _ACC_OF[x.dtype]
        threads, groups = row_geometry(nout, nred, ctx.caps)
        defines = {"OP": self.code, "ROW_THREADS": threads, "ACC": acc, **type_defines(x.dtype),
                   **extreme_defines(x.dtype, acc)}
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(nout), U32(nred), U32(len(dims)), U32(mask)]
        args += [U32(v) for v in dims + [1] * (MAX_VIEW_RANK - len(dims))]
        return [Dispatch("reduce", args, groups, defines)]

    def flops(self) -> int:
        return self.input(0).size


def _reducer(fn: Callable[..., np.ndarray]) -> Callable[[Reduce, np.ndarray, tuple[int, ...]], np.ndarray]:
    def compute(self: Reduce, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return fn(x, axes)
    return compute


def _log_sum_exp(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    xf = x.astype(np.float64)
    m = np.max(xf, axis=axes, keepdims=True) if xf.size else np.zeros([1] * xf.ndim)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.log(np.sum(np.exp(xf - m), axis=axes, keepdims=True)) + m


def _extreme(fn: Callable[..., np.ndarray], empty: float) -> Callable[..., np.ndarray]:
    def run(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        if x.size == 0:
            shape = [1 if d in axes else n for d, n in enumerate(x.shape)]
            if x.dtype.kind == "f":
                return np.full(shape, empty, x.dtype)
            info = np.iinfo(x.dtype) if x.dtype.kind in "iu" else np.iinfo(np.uint8)
            return np.full(shape, info.min if empty < 0 else info.max, x.dtype)
        return fn(x, axis=axes, keepdims=True)
    return run


class ReduceSum(Reduce):
    op_type = "ReduceSum"
    code = 0
    axes_input_since = 13
    compute = _reducer(lambda x, a: np.sum(x, axis=a, keepdims=True))


class ReduceMean(Reduce):
    op_type = "ReduceMean"
    code = 1
    compute = _reducer(lambda x, a: np.mean(x, axis=a, keepdims=True))


class ReduceMax(Reduce):
    op_type = "ReduceMax"
    code = 2
    dtypes = (np.float32, np.int64, np.int32, np.uint8, np.bool_)
    compute = _reducer(_extreme(np.max, -np.inf))


class ReduceMin(Reduce):
    op_type = "ReduceMin"
    code = 3
    dtypes = (np.float32, np.int64, np.int32, np.uint8, np.bool_)
    compute = _reducer(_extreme(np.min, np.inf))


class ReduceProd(Reduce):
    op_type = "ReduceProd"
    code = 4
    compute = _reducer(lambda x, a: np.prod(x, axis=a, keepdims=True))


class ReduceL1(Reduce):
    op_type = "ReduceL1"
    code = 5
    compute = _reducer(lambda x, a: np.sum(np.abs(x), axis=a, keepdims=True))


class ReduceL2(Reduce):
    op_type = "ReduceL2"
    code = 6
    float_only_math = True
    compute = _reducer(lambda x, a: np.sqrt(np.sum(np.square(x.astype(np.float64)), axis=a, keepdims=True)))


class ReduceLogSum(Reduce):
    op_type = "ReduceLogSum"
    code = 7
    float_only_math = True
    compute = _reducer(lambda x, a: np.log(np.sum(x.astype(np.float64), axis=a, keepdims=True)))


class ReduceLogSumExp(Reduce):
    op_type = "ReduceLogSumExp"
    code = 8
    float_only_math = True
    compute = _reducer(_log_sum_exp)


class ReduceSumSquare(Reduce):
    op_type = "ReduceSumSquare"
    code = 9
    compute = _reducer(lambda x, a: np.sum(np.square(x), axis=a, keepdims=True))


__all__ = [
    "Reduce", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
    "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "normalize_axes",
    "reduction_view", "row_geometry", "axis_view",
]


def axis_view(shape: Sequence[int], axis: int) -> tuple[int, int, int]:
    """``shape`` seen as ``[outer, shape[axis], inner]``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
