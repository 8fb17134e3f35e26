"""MaxPool (with its optional Indices), AveragePool, LpPool, GlobalMaxPool and GlobalAveragePool."""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    LOOP_SLACK, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial,
    groups_1d, type_defines,
)
from vkpool.kernels.ops.spatial import Window, window, window_view

_F32 = np.dtype(np.float32)
_MAX_DTYPES = (_F32, np.dtype(np.uint8))


def _element_defines(dtype: np.dtype) -> dict[str, str | int]:
    return {**type_defines(dtype), "BYTE_T": int(np.dtype(dtype).itemsize == 1)}


def _spatial_input(op: Op) -> TensorInfo:
    """Input 0 of a pool: N x C x spatial, of one of the op's ``dtypes``."""
    x = op.input(0)
    if x.dtype not in op.dtypes:  # type: ignore[attr-defined]
        raise UnsupportedOp(f"{op.op_type}: element type {x.dtype} has no kernel")
    if len(x.shape) < 3:
        raise OpError(f"{op.op_type}: X must be N x C x spatial, got {x.shape}")
    return x


class Pool(Op):
    """Shared checking of the windowed pools; subclasses set ``mode`` and the dtypes."""

    mode: ClassVar[int]  # shader MODE: 0 max, 1 average, 2 Lp norm
    dtypes: ClassVar[tuple[np.dtype, ...]] = (_F32,)

    def check(self) -> None:
        x = _spatial_input(self)
        kernel = self.attr("kernel_shape")
        if kernel is None:
            raise OpError(f"{self.op_type}: kernel_shape is required")
        if self.mode == 1 and self.opset < 19 and "dilations" in self.attrs:
            raise OpError("AveragePool: dilations need opset 19")
        self.win: Window = window(
            self.op_type, self.attrs, x.shape[2:], [int(k) for k in kernel],
            ceil_mode=bool(int(self.attr("ceil_mode", 0))),
        )
        self.out_shape = (*x.shape[:2], *self.win.out_shape)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def defines(self) -> dict[str, int | str]:
        return {"MODE": self.mode, **self.win.defines()}

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        total = math.prod(self.out_shape)
        idx = ctx.outputs[1] if len(ctx.outputs) > 1 and ctx.outputs[1] is not None else ctx.outputs[0]
        k = self.win.kernel  # every level of the window's loops
        check_serial(sum(math.prod(k[:level]) for level in range(1, len(k) + 1)), ctx.caps,
                     f"{self.op_type} window of {math.prod(k)} elements")
        return [Dispatch(
            "pool", [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), Ptr(idx), U32(total)],
            groups_1d(total, 256, ctx.caps), self.defines(),
        )]

    def flops(self) -> int:
        return math.prod(self.out_shape) * math.prod(self.win.kernel)


class MaxPool(Pool):
    op_type = "MaxPool"
    mode = 0
    dtypes = _MAX_DTYPES

    def check(self) -> None:
        super().check()
        self.storage_order = int(self.attr("storage_order", 0))
        if self.storage_order not in (0, 1):
            raise OpError(f"MaxPool: storage_order must be 0 or 1, got {self.storage_order}")
        self.with_indices = self.num_outputs > 1

    def output_infos(self) -> list[TensorInfo]:
        y = TensorInfo(self.out_shape, self.input(0).dtype)
        return [y, TensorInfo(self.out_shape, np.int64)] if self.with_indices else [y]

    def defines(self) -> dict[str, int | str]:
        return {**super().defines(), **_element_defines(self.input(0).dtype),
                "INDICES": int(self.with_indices), "STORAGE_ORDER": self.storage_order}

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        vals = window_view(x, self.win, low)
        n, c = x.shape[:2]
        k = math.prod(self.win.kernel)
        flat = vals.reshape(n, c, k, -1)
        y = flat.max(axis=2).reshape(self.out_shape).astype(x.dtype)
        if not self.with_indices:
            return [y]
        spatial = x.shape[2:]
        grid = np.indices(spatial)
        if self.storage_order == 1:  # column-major within the spatial dimensions
            pos = sum(g * int(np.prod(spatial[:a])) for a, g in enumerate(grid))
        else:
            pos = sum(g * int(np.prod(spatial[a + 1:])) for a, g in enumerate(grid))
        pos = np.broadcast_to(pos, x.shape).astype(np.int64)
        where = window_view(pos, self.win, -1).reshape(n, c, k, -1)
        # the first maximum inside the input wins; padding (index -1) never does
        masked = np.where(where >= 0, flat, low)
        best = np.argmax(masked, axis=2)
        chosen = np.take_along_axis(where, best[:, :, None, :], axis=2)[:, :, 0, :]
        plane = int(np.prod(spatial))
        chosen = chosen + (np.arange(n * c, dtype=np.int64) * plane).reshape(n, c, 1)
        return [y, chosen.reshape(self.out_shape)]


class AveragePool(Pool):
    op_type = "AveragePool"
    mode = 1

    def defines(self) -> dict[str, int | str]:
        return {**super().defines(), "COUNT_INCLUDE_PAD": int(self.attr("count_include_pad", 0))}

    def _counts(self) -> np.ndarray:
        """Window positions counted by the divisor; separable, so one vector per axis."""
        include = int(self.attr("count_include_pad", 0))
        w = self.win
        total = np.ones((), dtype=np.float32)
        for i, b, e, k, d, s, o in zip(w.in_shape, w.pads_begin, w.pads_end, w.kernel, w.dilations, w.strides,
                                       w.out_shape):
            pos = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
            lo, hi = (-b, i + e) if include else (0, i)
            per_axis = ((pos >= lo) & (pos < hi)).sum(axis=1).astype(np.float32)
            total = np.multiply.outer(total, per_axis)
        return total

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        vals = window_view(x, self.win, 0.0)
        n, c = x.shape[:2]
        sums = vals.reshape(n, c, math.prod(self.win.kernel), -1).sum(axis=2).reshape(self.out_shape)
        return [(sums / self._counts()).astype(np.float32)]


class LpPool(Pool):
    """The ``p``-norm of each window (positions inside the input; padding adds nothing)."""

    op_type = "LpPool"
    mode = 2

    def check(self) -> None:
        super().check()
        self.p = int(self.attr("p", 2))
        if self.p < 1:
            raise OpError(f"LpPool: p must be positive, got {self.p}")

    def defines(self) -> dict[str, int | str]:
        return {**super().defines(), "P": self.p}

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        vals = window_view(np.abs(x.astype(np.float64)) ** self.p, self.win, 0.0)
        n, c = x.shape[:2]
        sums = vals.reshape(n, c, math.prod(self.win.kernel), -1).sum(axis=2).reshape(self.out_shape)
        return [(sums ** (1.0 / self.p)).astype(np.float32)]


class GlobalPool(Op):
    mode: ClassVar[int]
    dtypes: ClassVar[tuple[np.dtype, ...]] = (_F32,)

    def check(self) -> None:
        x = _spatial_input(self)
        self.rows = x.shape[0] * x.shape[1]
        self.spatial = math.prod(x.shape[2:])

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        return [TensorInfo((*x.shape[:2], *([1] * (len(x.shape) - 2))), x.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        local = min(256, max(32, 1 << max(0, self.spatial - 1).bit_length()))
        caps = ctx.caps
        if caps is not None and caps.cpu_like and caps.subgroup_size & (caps.subgroup_size - 1) == 0 and \
                (not caps.max_loop_iterations or
                 -(-self.spatial // caps.subgroup_size) + 2 * LOOP_SLACK <= caps.max_loop_iterations):
            local = caps.subgroup_size  # a CPU's barriers switch between invocations: one SIMD-wide group
        return [Dispatch(
            "global_pool",
            [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(self.spatial), U32(self.rows)],
            groups_1d(self.rows, 1, ctx.caps),
            {"MODE": self.mode, "LOCAL_SIZE": local, **_element_defines(self.input(0).dtype)},
        )]

    def flops(self) -> int:
        return self.input(0).size


class GlobalMaxPool(GlobalPool):
    op_type = "GlobalMaxPool"
    mode = 0
    dtypes = _MAX_DTYPES

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]


class GlobalAveragePool(GlobalPool):
    op_type = "GlobalAveragePool"
    mode = 1

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=np.float32).astype(np.float32)]


__all__ = ["MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool"]
