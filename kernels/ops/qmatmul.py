"""MatMulInteger and QLinearMatMul (``shaders/qmatmul.comp``) on 8-bit integers with per-tensor
scales and zero points; batched when both operands share the batch or one is 2-D."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
)
from vkpool.kernels.ops.dtypes import element_defines

_BYTES = frozenset(np.dtype(t) for t in (np.uint8, np.int8))
_SCALES = frozenset(np.dtype(t) for t in (np.float32, np.float16))


class _QuantizedMatMul(Op):
    """Shared: operand positions (a, b) and the batching of ``a [.., M, K] @ b [.., K, N]``."""

    a_pos, b_pos = 0, 1

    def operands(self) -> None:
        a, b = self.input(self.a_pos), self.input(self.b_pos)
        if a.dtype not in _BYTES or b.dtype not in _BYTES:
            raise UnsupportedOp(f"{self.op_type}: only 8-bit integer operands, got {a.dtype} and {b.dtype}")
        if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
            raise OpError(f"{self.op_type}: shapes {a.shape} and {b.shape} do not multiply")
        batch_a, batch_b = a.shape[:-2], b.shape[:-2]
        if batch_a and batch_b and batch_a != batch_b:
            raise UnsupportedOp(f"{self.op_type}: broadcast batches {batch_a} and {batch_b}")
        self.batch = batch_a or batch_b
        self.m, self.k, self.n = a.shape[-2], a.shape[-1], b.shape[-1]
        self.a_batch, self.b_batch = int(bool(batch_a)), int(bool(batch_b))

    def per_tensor(self, *positions: int) -> None:
        for pos in positions:
            if self.has_input(pos) and self.input(pos).size != 1:
                raise UnsupportedOp(f"{self.op_type}: input {pos} must be per-tensor (one value)")

    def output_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.m, self.n)

    def flops(self) -> int:
        return 2 * int(np.prod(self.output_shape())) * self.k

    def product(self, inputs: Sequence[np.ndarray | None], zero_a: int, zero_b: int) -> np.ndarray:
        a, b = inputs[self.a_pos], inputs[self.b_pos]
        assert a is not None and b is not None
        za = inputs[zero_a] if len(inputs) > zero_a else None
        zb = inputs[zero_b] if len(inputs) > zero_b else None
        a32 = a.astype(np.int32) - (za.astype(np.int32).reshape(()) if za is not None else 0)
        b32 = b.astype(np.int32) - (zb.astype(np.int32).reshape(()) if zb is not None else 0)
        return np.matmul(a32, b32)

    def dispatch(self, ctx: DispatchContext, mode: int, pos: dict[str, int], y_dtype: np.dtype,
                 extra: dict[str, Any]) -> list[Dispatch]:
        total = int(np.prod(self.output_shape()))
        if total == 0:
            return []
        a = ctx.inputs[self.a_pos]

        def opt(name: str, fallback: Any) -> Any:
            p = pos.get(name)
            return ctx.inputs[p] if p is not None and self.has_input(p) else fallback

        check_serial(self.k, ctx.caps, f"{self.op_type} over K = {self.k}")
        b = ctx.inputs[self.b_pos]
        y = ctx.outputs[0]
        args = [Ptr(a), Ptr(b), Ptr(opt("a_zero", a)), Ptr(opt("b_zero", b)), Ptr(opt("a_scale", a)),
                Ptr(opt("b_scale", a)), Ptr(opt("y_scale", a)), Ptr(opt("y_zero", y)), Ptr(y), U32(total),
                U32(self.m), U32(self.k), U32(self.n)]
        args += [U32(int(p in pos and self.has_input(pos[p]))) for p in ("a_zero", "b_zero", "y_zero")]
        defines = {"MODE": mode, "A_BATCH": self.a_batch, "B_BATCH": self.b_batch,
                   **element_defines(self.input(self.a_pos).dtype, "A"),
                   **element_defines(self.input(self.b_pos).dtype, "B"), **element_defines(y_dtype, "Y"),
                   **extra}
        return [Dispatch("qmatmul", args, groups_1d(total, 256, ctx.caps), defines)]


class MatMulInteger(_QuantizedMatMul):
    op_type = "MatMulInteger"

    def check(self) -> None:
        self.operands()
        self.per_tensor(2, 3)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.output_shape(), np.dtype(np.int32))]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        return [self.product(inputs, 2, 3)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        f32 = element_defines(np.dtype(np.float32), "S")
        return self.dispatch(ctx, 0, {"a_zero": 2, "b_zero": 3}, np.dtype(np.int32),
                             {**f32, "HALF_SCALES": 0, "QMIN": "0.0", "QMAX": "0.0"})


class QLinearMatMul(_QuantizedMatMul):
    op_type = "QLinearMatMul"
    a_pos, b_pos = 0, 3

    def check(self) -> None:
        self.operands()
        self.per_tensor(1, 2, 4, 5, 6, 7)
        scales = {self.input(p).dtype for p in (1, 4, 6)}
        if len(scales) != 1 or not scales <= _SCALES:
            raise UnsupportedOp(f"QLinearMatMul: scales of types {sorted(map(str, scales))} have no kernel")
        self.scale_dtype = scales.pop()
        self.out_dtype = self.input(7).dtype if self.has_input(7) else self.input(0).dtype

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.output_shape(), self.out_dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        c = self.product(inputs, 2, 5)
        sa, sb, sy = (np.asarray(inputs[p]).reshape(()) for p in (1, 4, 6))
        d = c * (sa * sb / sy)  # in the scales' type, as the operator's definition reads
        if self.has_input(7):
            d = d + np.asarray(inputs[7]).reshape(()).astype(np.float64)
        info = np.iinfo(self.out_dtype)
        return [np.clip(np.rint(d), info.min, info.max).astype(self.out_dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        info = np.iinfo(self.out_dtype)
        extra = {**element_defines(self.scale_dtype, "S"), "HALF_SCALES": int(self.scale_dtype == np.float16),
                 "QMIN": f"{float(info.min)}", "QMAX": f"{float(info.max)}"}
        pos = {"a_scale": 1, "a_zero": 2, "b_scale": 4, "b_zero": 5, "y_scale": 6, "y_zero": 7}
        return self.dispatch(ctx, 1, pos, self.out_dtype, extra)
