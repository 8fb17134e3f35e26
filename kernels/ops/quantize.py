"""QuantizeLinear and DequantizeLinear (``shaders/quantize.comp``): per-tensor, per-axis and
blocked scales and zero points; quantized types: 8-/16-/32-bit integers, and float8, float4 and
4-/2-bit integers (held one per byte, ``shaders/narrow.glsl``); float side float32/float16.
DynamicQuantizeLinear (``shaders/dynamic_quantize.comp``): float32 to uint8 on its own range."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.ops.cast import _ENCODED_MAX, _NARROW, _onnx_dtype, ml_finfo
from vkpool.kernels.ops.dtypes import element_defines

_FLOATS = frozenset(np.dtype(t) for t in (np.float32, np.float16))
_INTEGERS = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.int32))
_NARROW_INT_RANGE = {"int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3)}


def _quantized_defines(dtype: np.dtype) -> dict[str, Any]:
    """The Q* defines: a standard integer type, or a narrow type with narrow.glsl's defines."""
    narrow = _NARROW.get(dtype.name)
    if narrow is not None:
        if dtype.name in ("float8_e8m0fnu", "bfloat16"):
            raise UnsupportedOp(f"quantized type {dtype} has no kernel")
        max_value, max_code = _ENCODED_MAX.get(dtype.name, ("0.0", 0))
        low, high = _NARROW_INT_RANGE.get(dtype.name, (0, 0))
        return {"NARROW": 1, **narrow, "MAX_VALUE": max_value, "MAX_CODE": max_code, "QBUF": "U8Buf",
                "QT": "uint8_t", "QMIN": f"{low}.0", "QMAX": f"{high}.0"}
    if dtype not in _INTEGERS:
        raise UnsupportedOp(f"quantized type {dtype} has no kernel")
    info = np.iinfo(dtype)
    return {"NARROW": 0, **element_defines(dtype, "Q"), "QMIN": f"{float(info.min)}",
            "QMAX": f"{float(info.max)}"}


class _Linear(Op):
    """Shared: the layout of the scale (and zero point) against input 0."""

    quantized_input: bool

    def layout(self) -> None:
        x, scale = self.input(0), self.input(1)
        rank = len(x.shape)
        axis = int(self.attr("axis", 1))
        block = int(self.attr("block_size", 0))
        if self.has_input(2) and self.input(2).size != scale.size:
            raise OpError(f"{self.op_type}: zero point {self.input(2).shape} and scale {scale.shape} differ")
        if scale.size == 1 and len(scale.shape) <= 1 and block == 0:
            self.A, self.inner, self.block, self.strides = 1, 1, 1, (0, 0, 0)
            return
        if not -rank <= axis < rank:
            raise OpError(f"{self.op_type}: axis {axis} out of range for rank {rank}")
        axis %= rank
        self.A, self.inner = x.shape[axis], math.prod(x.shape[axis + 1:])
        if block == 0:
            if scale.shape != (self.A,):
                raise OpError(f"{self.op_type}: a per-axis scale must have shape ({self.A},), "
                              f"got {scale.shape}")
            self.block, self.strides = 1, (0, 1, 0)
            return
        blocks = -(-self.A // block)
        if scale.shape != x.shape[:axis] + (blocks,) + x.shape[axis + 1:]:
            raise OpError(f"{self.op_type}: a blocked scale must have {blocks} blocks on axis {axis}, "
                          f"got {scale.shape}")
        self.block, self.strides = block, (blocks * self.inner, self.inner, 1)

    def parameter_index(self) -> np.ndarray:
        """Each element's index into the scale and zero point (for the numpy reference)."""
        x = self.input(0)
        i = np.arange(x.size)
        k, a, o = i % self.inner, (i // self.inner) % self.A, i // (self.inner * self.A)
        so, sa, sk = self.strides
        return (o * so + (a // self.block) * sa + k * sk).reshape(x.shape)

    def reference_operands(self, inputs: Sequence[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray, Any]:
        """x, each element's scale and its zero point (0.0 when absent), as float32."""
        x, scale, zero = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        assert x is not None and scale is not None
        p = self.parameter_index()
        z = zero.astype(np.float32).reshape(-1)[p] if zero is not None else 0.0
        return x.astype(np.float32), scale.astype(np.float32).reshape(-1)[p], z

    def dispatch(self, ctx: DispatchContext, mode: int, quantized: np.dtype,
                 float_side: np.dtype) -> Dispatch:
        n = self.input(0).size
        zero = ctx.inputs[2] if self.has_input(2) else ctx.inputs[0]
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(zero), Ptr(ctx.outputs[0]), U32(n), U32(self.A),
                U32(self.inner), U32(self.block), *(U32(s) for s in self.strides),
                U32(int(self.has_input(2)))]
        defines = {"MODE": mode, "SATURATE": int(bool(self.attr("saturate", 1))),
                   **_quantized_defines(quantized), **element_defines(float_side, "F"),
                   **element_defines(self.input(1).dtype, "S")}
        return Dispatch("quantize", args, groups_1d(n, 256, ctx.caps), defines)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(0).shape, self.out_dtype)]


class DequantizeLinear(_Linear):
    op_type = "DequantizeLinear"

    def check(self) -> None:
        x, scale = self.input(0), self.input(1)
        _quantized_defines(x.dtype)
        if scale.dtype not in _FLOATS:
            raise UnsupportedOp(f"DequantizeLinear: scale type {scale.dtype} has no kernel")
        out = int(self.attr("output_dtype", 0))
        self.out_dtype = _onnx_dtype(out) if out else scale.dtype
        if self.out_dtype not in _FLOATS:
            raise UnsupportedOp(f"DequantizeLinear: output type {self.out_dtype} has no kernel")
        self.layout()

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, z = self.reference_operands(inputs)
        return [((x - z) * scale).astype(self.out_dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        if self.input(0).size == 0:
            return []
        return [self.dispatch(ctx, 0, self.input(0).dtype, self.out_dtype)]


class QuantizeLinear(_Linear):
    op_type = "QuantizeLinear"

    def check(self) -> None:
        x, scale = self.input(0), self.input(1)
        if x.dtype not in _FLOATS or scale.dtype not in _FLOATS:
            raise UnsupportedOp(f"QuantizeLinear: input {x.dtype} and scale {scale.dtype}: only float32 "
                                "and float16 have a kernel")
        out = int(self.attr("output_dtype", 0))
        if self.has_input(2):
            self.out_dtype = self.input(2).dtype
        else:
            self.out_dtype = _onnx_dtype(out) if out else np.dtype(np.uint8)
        _quantized_defines(self.out_dtype)
        self.layout()

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, z = self.reference_operands(inputs)
        v = x / scale
        name = self.out_dtype.name
        if name in _ENCODED_MAX:
            if self.attr("saturate", 1):
                info = ml_finfo(self.out_dtype)
                v = np.clip(v + z, float(info.min), float(info.max))
            return [np.asarray(v).astype(self.out_dtype)]
        if name in _NARROW_INT_RANGE:
            low, high = _NARROW_INT_RANGE[name]
        else:
            low, high = np.iinfo(self.out_dtype).min, np.iinfo(self.out_dtype).max
        return [np.clip(np.round(v) + z, low, high).astype(self.out_dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        if self.input(0).size == 0:
            return []
        return [self.dispatch(ctx, 1, self.out_dtype, self.input(0).dtype)]


class DynamicQuantizeLinear(Op):
    """float32 to uint8 with the scale and zero point of the input's own range (0 included):
    one reduction dispatch for them, one elementwise dispatch for the values."""

    op_type = "DynamicQuantizeLinear"

    def check(self) -> None:
        if self.input(0).dtype != np.dtype(np.float32):
            raise UnsupportedOp(f"DynamicQuantizeLinear: input type {self.input(0).dtype} has no kernel")

    def output_infos(self) -> list[TensorInfo]:
        u8 = np.dtype(np.uint8)
        return [TensorInfo(self.input(0).shape, u8), TensorInfo((), np.dtype(np.float32)), TensorInfo((), u8)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        low, high = min(0.0, float(x.min(initial=0.0))), max(0.0, float(x.max(initial=0.0)))
        scale = np.float32((high - low) / 255)
        if scale == 0:
            return [np.zeros(x.shape, np.uint8), np.array(scale), np.array(0, np.uint8)]
        zero = np.clip(np.round(-low / scale), 0, 255)
        y = np.clip(np.round(x / scale) + zero, 0, 255).astype(np.uint8)
        return [y, np.array(scale, np.float32), np.array(zero, np.uint8)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), Ptr(ctx.outputs[1]), Ptr(ctx.outputs[2]), U32(n)]
        stats = Dispatch("dynamic_quantize", args, (1, 1, 1), {"MODE": 0})
        if n == 0:
            return [stats]
        return [stats, Dispatch("dynamic_quantize", args, groups_1d(n, 256, ctx.caps), {"MODE": 1})]
