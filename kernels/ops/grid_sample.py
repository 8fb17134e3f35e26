"""GridSample (``shaders/grid_sample.comp``): 2-D and 3-D float32 inputs; nearest, linear and
cubic (2-D) modes (opset 16's bilinear/bicubic names too); zeros, border and reflection padding."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)

_F32 = np.dtype(np.float32)
_MODES = {"nearest": 0, "linear": 1, "bilinear": 1, "cubic": 2, "bicubic": 2}
_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GridSample(Op):
    op_type = "GridSample"

    def check(self) -> None:
        x, grid = self.input(0), self.input(1)
        if x.dtype != _F32 or grid.dtype != _F32:
            raise UnsupportedOp(f"GridSample: only float32 is supported, got {x.dtype} and {grid.dtype}")
        nd = len(x.shape) - 2
        if nd not in (2, 3):
            raise UnsupportedOp(f"GridSample: {nd}-D inputs (2-D and 3-D supported)")
        if grid.shape != (x.shape[0], *grid.shape[1:-1], nd) or len(grid.shape) != nd + 2:
            raise OpError(f"GridSample: grid {grid.shape} does not fit input {x.shape}")
        mode = _text(self.attr("mode", "linear" if self.opset >= 20 else "bilinear"))
        padding = _text(self.attr("padding_mode", "zeros"))
        if mode not in _MODES or padding not in _PADDING:
            raise OpError(f"GridSample: mode {mode!r} or padding_mode {padding!r} is unknown")
        if _MODES[mode] == 2 and nd == 3:
            raise UnsupportedOp("GridSample: cubic mode on a 3-D input has no kernel")
        self.mode, self.padding = _MODES[mode], _PADDING[padding]
        self.align = int(bool(self.attr("align_corners", 0)))
        self.nd = nd

    def output_infos(self) -> list[TensorInfo]:
        x, grid = self.input(0), self.input(1)
        return [TensorInfo((*x.shape[:2], *grid.shape[1:-1]), _F32)]

    def flops(self) -> int:
        return self.output_infos()[0].size * (1, 2, 4)[self.mode] ** self.nd * 2

    def _geometry(self) -> dict[str, int]:
        x, out = self.input(0), self.output_infos()[0]
        pad = (1,) * (3 - self.nd)
        idims, odims = pad + x.shape[2:], pad + out.shape[2:]
        return {"C": x.shape[1], "ND": self.nd, "ID": idims[0], "IH": idims[1], "IW": idims[2],
                "OD": odims[0], "OH": odims[1], "OW": odims[2]}

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, grid = inputs[0], inputs[1]
        assert x is not None and grid is not None
        g = self._geometry()
        n, c = x.shape[:2]
        vol = x.reshape(n, c, g["ID"], g["IH"], g["IW"])
        coords = grid.reshape(n, g["OD"], g["OH"], g["OW"], self.nd)
        axes: list[tuple[Any, Any]] = []  # per axis (d, h, w): tap indices [n, OD, OH, OW, taps], weights
        for axis, size in ((2, g["ID"]), (1, g["IH"]), (0, g["IW"])):
            if axis >= self.nd:
                shape = coords.shape[:-1] + (1,)
                axes.append((np.zeros(shape, np.int64), np.ones(shape, np.float64)))
            else:
                axes.append(self._taps(coords[..., axis].astype(np.float64), size))
        (di, dw), (hi, hw), (wi, wwt) = axes
        out = np.zeros((n, c, g["OD"], g["OH"], g["OW"]), np.float64)
        batch = np.arange(n).reshape(n, 1, 1, 1)
        for a in range(di.shape[-1]):
            for r in range(hi.shape[-1]):
                for s in range(wi.shape[-1]):
                    d, h, w = di[..., a], hi[..., r], wi[..., s]
                    valid = (d >= 0) & (h >= 0) & (w >= 0)
                    picked = vol[batch, :, np.maximum(d, 0), np.maximum(h, 0), np.maximum(w, 0)]
                    weight = (dw[..., a] * hw[..., r] * wwt[..., s] * valid)[..., None]
                    out += np.moveaxis(picked * weight, -1, 1)
        return [out.reshape(self.output_infos()[0].shape).astype(np.float32)]

    def _taps(self, coord: np.ndarray, size: int) -> tuple[Any, Any]:
        lo, hi = (0.0, size - 1.0) if self.align else (-0.5, size - 0.5)
        x = (coord + 1) / 2 * (size - 1) if self.align else ((coord + 1) * size - 1) / 2
        if self.mode == 0:
            x = np.rint(x)
        outside = (x < lo) | (x > hi)
        if self.padding == 1:
            x = np.where(outside, np.clip(x, 0, size - 1), x)
        elif self.padding == 2:
            x = np.where(outside, _reflect(x, lo, hi), x)
        if self.mode == 0:
            first, weights = np.trunc(x).astype(np.int64)[..., None], np.ones(x.shape + (1,))
        else:
            f = np.floor(x)
            t = (x - f)[..., None]
            if self.mode == 1:
                first, weights = f.astype(np.int64), np.concatenate([1 - t, t], axis=-1)
            else:
                first = f.astype(np.int64) - 1
                weights = _keys(np.abs(t + 1 - np.arange(4)))
            first = first[..., None] + np.arange(2 if self.mode == 1 else 4)
            return self._pixel(first, size, lo, hi), weights
        return self._pixel(first, size, lo, hi), weights

    def _pixel(self, index: np.ndarray, size: int, lo: float, hi: float) -> np.ndarray:
        if self.padding == 0:
            return np.where((index < 0) | (index >= size), -1, index)
        if self.padding == 1:
            return np.clip(index, 0, size - 1)
        return np.clip(np.trunc(_reflect(index.astype(np.float64), lo, hi)).astype(np.int64), 0, size - 1)

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.output_infos()[0].size
        if n == 0:
            return []
        defines = {**self._geometry(), "MODE": self.mode, "PAD": self.padding, "ALIGN": self.align}
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n)]
        return [Dispatch("grid_sample", args, groups_1d(n, 256, ctx.caps), defines)]


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = lo - x, x - hi
    dist = np.where(x < lo, below, np.where(x > hi, above, 0.0))
    turns = np.trunc(dist / span)
    rest = dist - turns * span
    even = turns % 2 == 0
    low_side = np.where(even, lo + rest, hi - rest)
    high_side = np.where(even, hi - rest, lo + rest)
    return np.where(x < lo, low_side, np.where(x > hi, high_side, x))


def _keys(t: np.ndarray) -> np.ndarray:
    a = -0.75
    inner = ((a + 2) * t - (a + 3)) * t * t + 1
    outer = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, inner, outer)


__all__ = ["GridSample"]
