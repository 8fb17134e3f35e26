"""Resize (opsets 10-19+) and Upsample on ``shaders/resize.comp``, one pass per resized axis.

Scales or sizes fix the output shape and must be known at load time; roi is read on the
device. Every mode, nearest_mode and coordinate_transformation_mode, ``cubic_coeff_a``,
``exclude_outside``, ``extrapolation_value``, ``antialias``, ``axes`` and
``keep_aspect_ratio_policy`` are supported, for float32 data. Intermediate passes ping-pong
in the workspace. Coordinates are computed in float32 (the reference uses float64).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, I32, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
    type_defines,
)
from vkpool.kernels.ops.attrs import str_attr
from vkpool.kernels.ops.reduce import normalize_axes

_MODES = {"nearest": 0, "linear": 1, "bilinear": 1, "cubic": 2, "bicubic": 2}
_NEAREST = {"round_prefer_floor": 0, "round_prefer_ceil": 1, "floor": 2, "ceil": 3}
_CTM = {"half_pixel": 0, "half_pixel_symmetric": 1, "pytorch_half_pixel": 2, "align_corners": 3,
        "asymmetric": 4, "tf_crop_and_resize": 5}


class Resize(Op):
    op_type = "Resize"
    constant_inputs = (2, 3)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != np.float32:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel")
        rank = len(x.shape)
        self.mode = str_attr(self, "mode", "nearest")
        if self.mode not in _MODES:
            raise OpError(f"{self.op_type}: unknown mode {self.mode!r}")
        self.configure(rank)
        if self.ctm not in _CTM or self.nearest not in _NEAREST:
            raise OpError(f"{self.op_type}: unknown coordinate mode {self.ctm!r} or nearest mode {self.nearest!r}")
        if self.antialias and self.mode == "nearest":
            raise OpError(f"{self.op_type}: antialias applies to linear and cubic modes only")

    def configure(self, rank: int) -> None:
        x = self.input(0)
        self.ctm = str_attr(self, "coordinate_transformation_mode", "half_pixel" if self.opset >= 11 else "asymmetric")
        self.nearest = str_attr(self, "nearest_mode", "round_prefer_floor")
        self.cubic_a = float(self.attr("cubic_coeff_a", -0.75))
        self.exclude = bool(self.attr("exclude_outside", 0))
        self.extrapolation = float(self.attr("extrapolation_value", 0.0))
        self.antialias = bool(self.attr("antialias", 0))
        normalize_axes(self.attr("axes", list(range(rank))), rank, self.op_type)  # validates
        axes = [int(a) % rank for a in (self.attr("axes") or range(rank))]  # keep the given order
        if self.opset < 11:  # Resize-10: (X, scales)
            scale_pos, sizes_pos = 1, None
            if 1 not in self.constants:
                raise UnsupportedOp("Resize: scales must be known at load time")
        else:
            scale_pos, sizes_pos = 2, 3
        scales = self.constants.get(scale_pos) if self.has_input(scale_pos) else None
        sizes = self.constants.get(sizes_pos) if sizes_pos is not None and self.has_input(sizes_pos) else None
        if scales is not None and scales.size == 0:
            scales = None
        if sizes is not None and sizes.size == 0:
            sizes = None
        if (scales is None) == (sizes is None):
            raise OpError(f"{self.op_type}: exactly one of scales and sizes must be given")
        self.roi_axes = axes
        full_scales = [1.0] * rank
        out = list(x.shape)
        if scales is not None:
            if scales.size != len(axes):
                raise OpError(f"{self.op_type}: {scales.size} scales for {len(axes)} axes")
            for a, s in zip(axes, scales.reshape(-1).tolist()):
                if s <= 0:
                    raise OpError(f"{self.op_type}: scale {s} must be positive")
                full_scales[a] = float(s)
                out[a] = int(s * x.shape[a])
        else:
            assert sizes is not None
            if sizes.size != len(axes):
                raise OpError(f"{self.op_type}: {sizes.size} sizes for {len(axes)} axes")
            sz = [int(v) for v in sizes.reshape(-1)]
            ratios = [s / x.shape[a] for a, s in zip(axes, sz)]
            policy = str_attr(self, "keep_aspect_ratio_policy", "stretch")
            if policy == "stretch":
                for a, s, r in zip(axes, sz, ratios):
                    full_scales[a], out[a] = r, s
            elif policy in ("not_larger", "not_smaller"):
                r = min(ratios) if policy == "not_larger" else max(ratios)
                for a in axes:
                    full_scales[a], out[a] = r, int(r * x.shape[a] + 0.5)
            else:
                raise OpError(f"{self.op_type}: unknown keep_aspect_ratio_policy {policy!r}")
        self.scales = full_scales
        self.out_shape = tuple(out)
        # the passes: every axis whose mapping is not the identity, in axis order
        self.passes = [a for a in sorted(axes)
                       if not (math.isclose(full_scales[a], 1.0) and out[a] == x.shape[a] and self.ctm != "tf_crop_and_resize")]

    # -- shapes and costs -------------------------------------------------------------------
    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, np.float32)]

    def _shapes(self) -> list[tuple[int, ...]]:
        """Shape after each pass."""
        shape = list(self.input(0).shape)
        out = []
        for a in self.passes:
            shape[a] = self.out_shape[a]
            out.append(tuple(shape))
        return out

    def workspace_bytes(self) -> int:
        inter = [math.prod(s) for s in self._shapes()[:-1]]
        return 2 * 4 * max(inter) if inter else 0

    def flops(self) -> int:
        return 4 * sum(math.prod(s) for s in self._shapes()) or math.prod(self.out_shape)

    # -- taps -------------------------------------------------------------------------------------
    def _taps(self, axis: int) -> tuple[int, int, float]:
        """(first tap offset from floor(x), tap count, antialias factor) of one axis."""
        if self.mode == "nearest":
            return 0, 2, 1.0
        scale = self.scales[axis]
        aa = min(scale, 1.0) if self.antialias else 1.0
        support = 1 if _MODES[self.mode] == 1 else 2
        tap0 = int(math.floor(-support / aa) + 1) if self.antialias else 1 - support
        return tap0, 2 - 2 * tap0, aa

    def _roi(self, roi: np.ndarray | None, axis: int, rank: int) -> tuple[float, float]:
        if roi is None or roi.size == 0:
            return 0.0, 1.0
        roi = roi.reshape(-1).astype(np.float64)
        if roi.size == 2 * rank:
            return float(roi[axis]), float(roi[rank + axis])
        k = self.roi_axes.index(axis)
        return float(roi[k]), float(roi[len(self.roi_axes) + k])

    def _roi_index(self, axis: int, rank: int) -> tuple[int, int]:
        if self.has_input(1) and self.input(1).size == 2 * rank:
            return axis, rank + axis
        k = self.roi_axes.index(axis)
        return k, len(self.roi_axes) + k

    # -- reference ----------------------------------------------------------------------------
    def _axis_reference(self, data: np.ndarray, axis: int, roi: np.ndarray | None) -> np.ndarray:
        in_w, out_w, scale = data.shape[axis], self.out_shape[axis], self.scales[axis]
        out_wf = scale * in_w
        o = np.arange(out_w, dtype=np.float64)
        lo, hi = self._roi(roi, axis, data.ndim)
        ctm = self.ctm
        extrap = None
        if ctm == "half_pixel":
            xo = (o + 0.5) / scale - 0.5
        elif ctm == "half_pixel_symmetric":
            xo = in_w / 2 * (1 - out_w / out_wf) + (o + 0.5) / scale - 0.5
        elif ctm == "pytorch_half_pixel":
            xo = np.full(out_w, -0.5) if out_wf == 1 else (o + 0.5) / scale - 0.5
        elif ctm == "align_corners":
            xo = np.zeros(out_w) if out_wf == 1 else o * (in_w - 1) / (out_wf - 1)
        elif ctm == "asymmetric":
            xo = o / scale
        else:
            xo = (np.full(out_w, (hi - lo) * (in_w - 1) / 2) if out_wf == 1
                  else o * (hi - lo) * (in_w - 1) / (out_wf - 1)) + lo * (in_w - 1)
            extrap = (xo < 0) | (xo > in_w - 1)
        fl = np.floor(xo)
        frac = xo - fl
        whole = frac == 0
        fl = np.where(whole, fl - 1, fl).astype(np.int64)
        frac = np.where(whole, 1.0, frac)
        moved = np.moveaxis(data, axis, 0)
        if self.mode == "nearest":
            up = {"round_prefer_floor": frac > 0.5, "round_prefer_ceil": frac >= 0.5,
                  "floor": frac == 1.0, "ceil": np.ones_like(whole)}[self.nearest]
            j = np.clip(fl + up, 0, in_w - 1)
            res = moved[j]
        else:
            tap0, taps, aa = self._taps(axis)
            t = tap0 + np.arange(taps)
            j = fl[:, None] + t[None, :]
            u = np.abs((t[None, :] - frac[:, None]) * aa)
            if _MODES[self.mode] == 1:
                w = np.maximum(1 - u, 0)
            else:
                a = self.cubic_a
                w = np.where(u <= 1, ((a + 2) * u - (a + 3)) * u * u + 1,
                             np.where(u < 2, ((a * u - 5 * a) * u + 8 * a) * u - 4 * a, 0))
            if self.antialias:
                w = w / w.sum(axis=1, keepdims=True)
            if self.exclude:
                w = np.where((j < 0) | (j > in_w - 1), 0, w)
                s = w.sum(axis=1, keepdims=True)
                w = w / np.where(s == 0, 1, s)
            g = moved[np.clip(j, 0, in_w - 1)]  # [out, taps, ...]
            res = np.einsum("ot,ot...->o...", w, g)
        if extrap is not None:
            res = np.where(extrap.reshape((-1,) + (1,) * (data.ndim - 1)), self.extrapolation, res)
        return np.moveaxis(res, 0, axis)

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        roi = inputs[1] if self.opset >= 11 and len(inputs) > 1 else None
        data = x.astype(np.float64)
        for a in self.passes:
            data = self._axis_reference(data, a, roi)
        return [np.ascontiguousarray(data, dtype=np.float32).reshape(self.out_shape)]

    # -- device ---------------------------------------------------------------------------------
    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        rank = len(x.shape)
        n_out = math.prod(self.out_shape)
        if n_out == 0:
            return []
        passes = self.passes or [0]
        shapes = self._shapes() or [tuple(x.shape)]
        half = self.workspace_bytes() // 2
        has_roi = self.opset >= 11 and self.has_input(1) and self.input(1).size > 0 and self.ctm == "tf_crop_and_resize"
        roi_dtype = self.input(1).dtype if has_roi else np.dtype(np.float32)
        if roi_dtype not in (np.dtype(np.float32),):
            raise UnsupportedOp(f"{self.op_type}: roi of type {roi_dtype} has no kernel")
        out: list[Dispatch] = []
        src = Ptr(ctx.inputs[0])
        in_shape = tuple(x.shape)
        for k, (a, shape) in enumerate(zip(passes, shapes)):
            last = k == len(passes) - 1
            dst = Ptr(ctx.outputs[0]) if last else Ptr(ctx.workspace, (k % 2) * half)
            tap0, taps, aa = self._taps(a)
            check_serial(taps, ctx.caps, f"{self.op_type} with {taps} taps along axis {a}")
            lo, hi = self._roi_index(a, rank) if has_roi else (0, 0)
            n = math.prod(shape)
            identity = not self.passes
            args = [src, Ptr(ctx.inputs[1]) if has_roi else src, dst, U32(n), U32(in_shape[a]), U32(shape[a]),
                    U32(math.prod(shape[a + 1:])), F32(1.0 if identity else self.scales[a]), F32(aa), I32(tap0),
                    U32(taps), U32(lo), U32(hi), F32(self.extrapolation), F32(self.cubic_a)]
            defines = {"MODE": 0 if identity else _MODES[self.mode], "NEAREST": _NEAREST[self.nearest],
                       "CTM": 4 if identity else _CTM[self.ctm], "EXCLUDE": int(self.exclude),
                       **type_defines(roi_dtype, "ROI_")}
            out.append(Dispatch("resize", args, groups_1d(n, 64, ctx.caps), defines))
            src, in_shape = dst, shape
        return out


class Upsample(Resize):
    """Opsets 7-9: scales as an attribute (7) or a load-time input (9); asymmetric coordinates,
    nearest rounds down."""

    op_type = "Upsample"
    constant_inputs = (1,)

    def configure(self, rank: int) -> None:
        x = self.input(0)
        self.ctm, self.nearest = "asymmetric", "floor"
        self.cubic_a, self.exclude, self.extrapolation, self.antialias = -0.75, False, 0.0, False
        if self.mode not in ("nearest", "linear", "bilinear"):
            raise OpError(f"Upsample: unknown mode {self.mode!r}")
        scales = [float(s) for s in (self.attr("scales") if self.opset < 9 else self.constants[1].reshape(-1))]
        if len(scales) != rank:
            raise OpError(f"Upsample: {len(scales)} scales for rank {rank}")
        self.scales = scales
        self.roi_axes = list(range(rank))
        self.out_shape = tuple(int(n * s) for n, s in zip(x.shape, scales))
        self.passes = [a for a in range(rank) if not math.isclose(scales[a], 1.0)]

    def _roi_index(self, axis: int, rank: int) -> tuple[int, int]:
        return 0, 0


__all__ = ["Resize", "Upsample"]
