"""Normalisation layers on ``shaders/norm.comp``: statistics per row, then a rescale.

Every op here is "reduce some dimensions of x, then map each element with the row's
statistics and a per-channel (or broadcast-tail) scale and bias". Each op states its row
view (collapsed shape + reduced mask, as for Reduce*) and how scale/bias are indexed; the
shader does the rest. float32 or float16 (x, scale, bias and y of one type; float16 is widened
as it is read, every statistic is float32 and y is rounded once, as ``stash_type`` 1 asks).
float16 Layer/RMS normalisation over trailing axes (a transformer's) runs ``norm_rows.comp``
instead, where the device allows 256 invocations per workgroup: each element read once.
"""
from __future__ import annotations

from abc import abstractmethod

import math
from typing import ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.ops.gemm_f16 import HalfMatmulPlan, fused_product_plan
from vkpool.kernels.ops.reduce import MAX_VIEW_RANK, normalize_axes, reduction_view, row_geometry

_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
#: float16 rows up to this long are normalised by norm_rows.comp (a workgroup per row, every element
#: read once into registers: 16 per invocation at most)
_ROWS_MAX = 16 * 256


def tail_broadcast_size(param: tuple[int, ...], norm_shape: tuple[int, ...], what: str) -> int:
    """Size of ``param`` when it broadcasts to ``norm_shape`` as a trailing block (so element
    ``i`` of a row uses ``param[i % size]``); other broadcast patterns have no kernel."""
    if len(param) > len(norm_shape):
        raise OpError(f"{what} of shape {param} does not broadcast to {norm_shape}")
    padded = (1,) * (len(norm_shape) - len(param)) + tuple(param)
    k = 0
    while k < len(padded) and padded[k] == 1:
        k += 1
    if padded[k:] != norm_shape[k:]:
        if all(p in (1, n) for p, n in zip(padded, norm_shape)):
            raise UnsupportedOp(f"{what} of shape {param} broadcasts to {norm_shape} with inner "
                                "extent-1 dimensions: no kernel for that pattern")
        raise OpError(f"{what} of shape {param} does not broadcast to {norm_shape}")
    return math.prod(padded[k:])


class RowNorm(Op):
    """Base: subclasses set ``mode`` and fill ``self.view_shape``/``self.axes`` (on the real or
    a reshaped view of x), ``self.sdiv``/``self.smod``/``self.bmod`` and ``self.eps``."""

    mode: ClassVar[int]
    #: a residual input added to x before normalising (input 3) and its sum as output 3: set by
    #: LayerNormalization's internal attribute ``residual`` (vkpool.fusion), never by a file
    residual: bool = False
    scale_pos: ClassVar[int | None] = 1
    bias_pos: ClassVar[int | None] = 2
    p: int = 2

    def check(self) -> None:
        x = self.input(0)
        if x.dtype not in _TYPES:
            raise UnsupportedOp(f"{self.op_type}: element type {x.dtype} has no kernel (float32, float16)")
        for pos in (self.scale_pos, self.bias_pos):
            if pos is not None and self.has_input(pos) and self.input(pos).dtype != x.dtype:
                raise UnsupportedOp(f"{self.op_type}: input {pos} of type {self.input(pos).dtype} with X of type "
                                    f"{x.dtype} has no kernel (one type for X, scale and bias)")
        self.sdiv, self.smod, self.bmod = 1, 1, 1
        self.eps = float(self.attr("epsilon", 1e-5))
        self.setup()

    @abstractmethod
    def setup(self) -> None:
        """Sets the op's row layout and affine parameters."""

    @abstractmethod
    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        """The op's outputs from float32 inputs, in float32."""

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        # float16 as the kernel computes it: widened, float32 throughout, X-typed outputs rounded once
        dtype = self.input(0).dtype
        wide = [v.astype(np.float32) if v is not None and v.dtype == np.float16 else v for v in inputs]
        outs = self.reference_f32(wide)
        infos = self.output_infos()
        return [o.astype(info.dtype, copy=False) for o, info in zip(outs, infos)] if dtype != np.float32 else outs

    # -- checks the subclasses share
    def require_float32_stash(self) -> None:
        if int(self.attr("stash_type", 1)) != 1:
            raise UnsupportedOp(f"{self.op_type}: stash_type {self.attr('stash_type')} (only float32: 1)")

    def channels_first(self) -> tuple[int, int]:
        """N and C of an input laid out [N, C, ...]."""
        x = self.input(0)
        if len(x.shape) < 2:
            raise OpError(f"{self.op_type}: input must be [N, C, ...], got {x.shape}")
        return x.shape[0], x.shape[1]

    def require_values(self, named: tuple[tuple[int, str], ...], want: int) -> None:
        for pos, what in named:
            if self.input(pos).size != want:
                raise OpError(f"{self.op_type}: {what} has {self.input(pos).size} values, expected {want}")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def flops(self) -> int:
        return 5 * self.x_info().size

    def x_info(self) -> TensorInfo:
        """The tensor normalised (input 0, unless the norm computes it itself)."""
        return self.input(0)

    def rows_kernel(self, caps: DeviceCaps | None) -> bool:
        """Whether a float16 norm runs norm_rows.comp on ``caps``' device (else norm.comp)."""
        x = self.x_info()
        dims, mask = reduction_view(self.view_shape, self.axes)
        nred = math.prod(self.view_shape[a] for a in self.axes)
        reduced = mask.bit_count()
        tail = mask == ((1 << reduced) - 1) << (len(dims) - reduced)
        return (x.dtype == np.float16 and tail and self.mode in (0, 1) and self.sdiv == 1 and nred <= _ROWS_MAX
                and (caps is None or caps.max_workgroup_invocations >= 256))

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return self.norm_dispatches(ctx, ctx.inputs[0])

    def norm_dispatches(self, ctx: DispatchContext, x_handle: object,
                        partials: tuple[int, object | None, int] | None = None) -> list[Dispatch]:
        """The norm of the tensor at ``x_handle``; with ``partials`` (splits, bias handle or None,
        columns: only where :meth:`rows_kernel` holds) ``x_handle`` holds a split product's float32
        partial sums, which norm_rows.comp adds with that bias as it reads them."""
        x = self.x_info()
        if x.size == 0:
            return []
        dims, mask = reduction_view(self.view_shape, self.axes)
        nred = math.prod(self.view_shape[a] for a in self.axes)
        nrows = x.size // max(nred, 1)
        threads, groups = row_geometry(nrows, nred, ctx.caps)
        has_scale = self.scale_pos is not None and self.has_input(self.scale_pos)
        has_bias = self.bias_pos is not None and self.has_input(self.bias_pos)
        stats = [ctx.outputs[k] if k < len(ctx.outputs) and ctx.outputs[k] is not None else None for k in (1, 2)]
        has_stats = all(s is not None for s in stats)
        x_ptr = Ptr(x_handle)
        args = [
            x_ptr,
            Ptr(ctx.inputs[self.scale_pos]) if has_scale else x_ptr,
            Ptr(ctx.inputs[self.bias_pos]) if has_bias else x_ptr,
            Ptr(ctx.outputs[0]),
            Ptr(stats[0]) if has_stats else x_ptr,
            Ptr(stats[1]) if has_stats else x_ptr,
            U32(nrows), U32(nred), U32(len(dims)), U32(mask),
        ]
        args += [U32(v) for v in dims + [1] * (MAX_VIEW_RANK - len(dims))]
        residual = self.residual and ctx.inputs[3] is not None
        sum_out = ctx.outputs[3] if len(ctx.outputs) > 3 else None
        args += [F32(self.eps), U32(self.sdiv), U32(self.smod), U32(self.bmod),
                 Ptr(ctx.inputs[3]) if residual else x_ptr, Ptr(sum_out) if sum_out is not None else x_ptr]
        reduced = mask.bit_count()
        tail = mask == ((1 << reduced) - 1) << (len(dims) - reduced)
        defines = {"MODE": self.mode, "ROW_THREADS": threads, "HAS_SCALE": int(has_scale),
                   "HAS_BIAS": int(has_bias), "HAS_STATS": int(has_stats), "P": self.p, "TAIL": int(tail),
                   "RESIDUAL": int(residual), "SUM_OUT": int(sum_out is not None)}
        if x.dtype == np.float16:
            defines["HALF"] = 1  # float32 keeps its defines (and its cached pipelines) as they were
            if self.rows_kernel(ctx.caps):
                del defines["ROW_THREADS"], defines["TAIL"], defines["P"], defines["HALF"]
                args = [*args[:6], U32(nrows), F32(self.eps), U32(self.smod), U32(self.bmod), *args[-2:]]
                subgroups = ctx.caps is not None and ctx.caps.subgroup_arithmetic
                defines.update({"NRED": nred, "SUBGROUP_REDUCE": int(subgroups)})
                if partials is not None:
                    splits, pbias, cols = partials
                    args += [Ptr(pbias) if pbias is not None else x_ptr, U32(cols)]
                    defines.update({"NSPLITS": splits, "PBIAS": int(pbias is not None)})
                return [Dispatch("norm_rows", args, groups_1d(nrows, 1, ctx.caps), defines)]
        if partials is not None:
            raise ValueError(f"{self.op_type}: only norm_rows.comp reads a product's partial sums")
        return [Dispatch("norm", args, groups, defines)]


class LayerNormalization(RowNorm):
    """ONNX LayerNormalization; :mod:`vkpool.fusion` may give it a residual (the attribute
    ``residual``: input 3 added to X as it is read, the sum as output 3) and, in float16 graphs,
    the product that computes X (the attribute ``product``: input 0 is then A, input 4 the
    constant 2-D weights W and input 5 the product's bias, and X = A @ W + bias is computed in the
    norm's own dispatches). A product split over K on a device with cooperative matrices leaves
    its float32 partial sums in the workspace, and norm_rows.comp adds them (with the bias) as it
    reads X: no pass of its own to finish the product. Elsewhere the product writes X into Y,
    which the norm then normalises in place (each element is read before it is written, by the
    invocation that writes it)."""

    op_type = "LayerNormalization"
    mode = 0
    product: HalfMatmulPlan | None = None

    def x_info(self) -> TensorInfo:
        if not self.attr("product", 0):
            return self.input(0)
        a, w = self.input(0), self.input(4)
        return TensorInfo((*a.shape[:-1], w.shape[-1]), a.dtype)

    def setup(self) -> None:
        if self.attr("product", 0):
            self._setup_product()
        x = self.x_info()
        rank = len(x.shape)
        self.axis = normalize_axes([self.attr("axis", -1)], rank, self.op_type)[0]
        self.require_float32_stash()
        self.view_shape = x.shape
        self.axes = list(range(self.axis, rank))
        self.residual = bool(self.attr("residual", 0))
        if self.residual and (not self.has_input(3) or self.input(3) != x):
            raise OpError(f"LayerNormalization: a fused residual must be a tensor of X's shape {x.shape} and type")
        if self.num_outputs > 3 and not self.residual:
            raise OpError("LayerNormalization: an output of the residual sum needs a fused residual")
        norm_shape = x.shape[self.axis:]
        self.smod = tail_broadcast_size(self.input(1).shape, norm_shape, "scale")
        if self.has_input(2):
            self.bmod = tail_broadcast_size(self.input(2).shape, norm_shape, "bias")
        self.stats_shape = x.shape[:self.axis] + (1,) * (rank - self.axis)

    def _setup_product(self) -> None:
        self.product = fused_product_plan(self, 0, 4, 5)

    def output_infos(self) -> list[TensorInfo]:
        x = self.x_info()
        stats = TensorInfo(self.stats_shape, np.float32)
        return [x, stats, stats, x][: max(1, self.num_outputs)]

    def flops(self) -> int:
        return super().flops() + (self.product.flops() if self.product is not None else 0)

    def workspace_bytes(self) -> int:
        return self.product.workspace_bytes() if self.product is not None else 0

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        if self.product is None:
            return super().dispatches(ctx)
        c = ctx.inputs[5] if len(ctx.inputs) > 5 else None
        y = ctx.outputs[0]
        work = self.product.dispatches(ctx.inputs[0], ctx.inputs[4], y, ctx.caps, c=c, ws=ctx.workspace)
        if work and work[-1].shader == "gemm_reduce" and self.rows_kernel(ctx.caps):
            partials = (work[-1].defines["NSPLITS"], c, self.product.p.N)
            return [*work[:-1], *self.norm_dispatches(ctx, ctx.workspace, partials)]
        return [*work, *self.norm_dispatches(ctx, y)]

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        assert x is not None and scale is not None
        if self.product is not None:
            w = inputs[4]
            assert w is not None
            x = np.matmul(x, w)
            if len(inputs) > 5 and inputs[5] is not None:
                x = x + inputs[5]
        if self.residual:
            x = (x + inputs[3]).astype(np.float32)
        axes = tuple(self.axes)
        mean = x.mean(axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + np.float32(self.eps))
        y = (x - mean) * inv * scale
        if bias is not None:
            y = y + bias
        out = [y.astype(np.float32), mean.astype(np.float32), inv.astype(np.float32), x]
        return out[: max(1, self.num_outputs)]


class RMSNormalization(RowNorm):
    op_type = "RMSNormalization"
    mode = 1
    bias_pos = None

    def setup(self) -> None:
        x = self.input(0)
        rank = len(x.shape)
        self.axis = normalize_axes([self.attr("axis", -1)], rank, self.op_type)[0]
        self.require_float32_stash()
        self.view_shape = x.shape
        self.axes = list(range(self.axis, rank))
        self.smod = tail_broadcast_size(self.input(1).shape, x.shape[self.axis:], "scale")

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale = inputs[0], inputs[1]
        assert x is not None and scale is not None
        ms = np.mean(np.square(x), axis=tuple(self.axes), keepdims=True)
        return [(x / np.sqrt(ms + np.float32(self.eps)) * scale).astype(np.float32)]


class GroupNormalization(RowNorm):
    """Opset 18: scale/bias have one value per group; opset 21: one per channel."""

    op_type = "GroupNormalization"
    mode = 0

    def setup(self) -> None:
        x = self.input(0)
        n, c = self.channels_first()
        self.require_float32_stash()
        g = int(self.attr("num_groups"))
        if g <= 0 or c % g:
            raise OpError(f"{self.op_type}: {c} channels do not split into {g} groups")
        spatial = math.prod(x.shape[2:])
        self.groups = g
        self.per_group = self.opset < 21
        want = g if self.per_group else c
        self.require_values(((1, "scale"), (2, "bias")), want)
        self.view_shape = (n * g, (c // g) * spatial)
        self.axes = [1]
        self.sdiv = spatial * (c // g) if self.per_group else spatial
        self.smod = self.bmod = want

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, bias = inputs[0], inputs[1], inputs[2]
        assert x is not None and scale is not None and bias is not None
        n, c = x.shape[:2]
        v = x.reshape(n, self.groups, -1)
        mean = v.mean(axis=2, keepdims=True)
        var = ((v - mean) ** 2).mean(axis=2, keepdims=True)
        y = ((v - mean) / np.sqrt(var + np.float32(self.eps))).reshape(x.shape)
        if self.per_group:
            scale = np.repeat(scale.reshape(-1), c // self.groups)
            bias = np.repeat(bias.reshape(-1), c // self.groups)
        bshape = (1, c) + (1,) * (len(x.shape) - 2)
        return [(y * scale.reshape(bshape) + bias.reshape(bshape)).astype(np.float32)]


class InstanceNormalization(RowNorm):
    op_type = "InstanceNormalization"
    mode = 0

    def setup(self) -> None:
        x = self.input(0)
        n, c = self.channels_first()
        self.require_values(((1, "scale"), (2, "B")), c)
        spatial = math.prod(x.shape[2:])
        self.view_shape = (n * c, spatial)
        self.axes = [1]
        self.sdiv, self.smod, self.bmod = spatial, c, c

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, bias = inputs[0], inputs[1], inputs[2]
        assert x is not None and scale is not None and bias is not None
        axes = tuple(range(2, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
        bshape = (1, -1) + (1,) * (x.ndim - 2)
        y = (x - mean) / np.sqrt(var + np.float32(self.eps)) * scale.reshape(bshape) + bias.reshape(bshape)
        return [y.astype(np.float32)]


class MeanVarianceNormalization(RowNorm):
    op_type = "MeanVarianceNormalization"
    mode = 2
    scale_pos = None
    bias_pos = None

    def setup(self) -> None:
        x = self.input(0)
        self.view_shape = x.shape
        self.axes = normalize_axes(self.attr("axes", [0, 2, 3]), len(x.shape), self.op_type)
        self.eps = 1e-9  # the epsilon of the op's function body

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        axes = tuple(self.axes)
        mean = x.mean(axis=axes, keepdims=True)
        std = np.sqrt(np.maximum((x * x).mean(axis=axes, keepdims=True) - mean * mean, 0))
        return [((x - mean) / (std + np.float32(self.eps))).astype(np.float32)]


class LpNormalization(RowNorm):
    op_type = "LpNormalization"
    mode = 3
    scale_pos = None
    bias_pos = None

    def setup(self) -> None:
        x = self.input(0)
        self.p = int(self.attr("p", 2))
        if self.p not in (1, 2):
            raise OpError(f"{self.op_type}: p must be 1 or 2, got {self.p}")
        self.view_shape = x.shape
        self.axes = normalize_axes([self.attr("axis", -1)], len(x.shape), self.op_type)

    def reference_f32(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        axis = self.axes[0]
        if self.p == 1:
            norm = np.sum(np.abs(x), axis=axis, keepdims=True)
        else:
            norm = np.sqrt(np.sum(x * x, axis=axis, keepdims=True))
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(norm == 0, np.float32(0), x / norm)
        return [y.astype(np.float32)]


__all__ = [
    "LayerNormalization", "RMSNormalization", "GroupNormalization", "InstanceNormalization",
    "MeanVarianceNormalization", "LpNormalization", "tail_broadcast_size",
]
