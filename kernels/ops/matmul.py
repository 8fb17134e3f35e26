"""MatMul with numpy semantics: batched, broadcast batch dimensions, 1-D operands.

float32 through ``MatmulPlan`` (``gemm.py``); float16 through ``HalfMatmulPlan`` (``gemm_f16.py``:
cooperative matrices where the device has them), accumulated in float32 and rounded once.

The load-time rewrites of ``vkpool.fusion`` may give a MatMul whose B is one matrix a third
input, a bias of shape [N] and of the operands' type added to every output row, and the attribute
``activation`` applied after it; neither exists in ONNX's MatMul."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.broadcast import broadcast_shape, collapse
from vkpool.kernels.ops.gemm import BatchDim, MatmulPlan, MatmulProblem, apply_activation, fused_activation
from vkpool.kernels.ops.gemm_f16 import HalfMatmulPlan, transposed_b

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)


class MatMul(Op):
    op_type = "MatMul"
    rereads_inputs = True

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        if a.dtype != b.dtype or a.dtype not in (_F32, _F16):
            raise UnsupportedOp(
                f"MatMul: only float32 and float16 are supported, got {a.dtype} and {b.dtype}")
        self.dtype = a.dtype
        half = a.dtype == _F16
        if not a.shape or not b.shape:
            raise OpError("MatMul: operands must have at least one dimension")
        # numpy: a 1-D A is a row (1 x K), a 1-D B a column (K x 1); the added axis is dropped
        a2 = (1, *a.shape) if len(a.shape) == 1 else a.shape
        b2 = (*b.shape, 1) if len(b.shape) == 1 else b.shape
        M, K = a2[-2], a2[-1]
        Kb, N = b2[-2], b2[-1]
        if K != Kb:
            raise OpError(f"MatMul: inner dimensions differ ({a.shape} @ {b.shape})")
        batch = broadcast_shape(a2[:-2], b2[:-2])
        out = list(batch)
        if len(a.shape) > 1:
            out.append(M)
        if len(b.shape) > 1:
            out.append(N)
        self.out_shape = tuple(out)
        self.act = fused_activation(self)
        fused = self.has_input(2) or self.act
        if fused and (len(b.shape) != 2 or (self.has_input(2) and self.input(2) != TensorInfo((N,), a.dtype))):
            raise OpError(f"MatMul: a fused bias or activation needs a 2-D B and a bias of shape ({N},) and "
                          f"type {a.dtype}, got B {b.shape}")
        if all(d == 1 for d in b2[:-2]):
            # B is one matrix: A's batch folds into its rows (A is contiguous), one product.
            rows = int(np.prod(a2[:-1], dtype=np.int64))
            if rows == 1 and len(b.shape) == 2 and 1 in self.constants and not half:
                # a GEMV by constant weights reads them stored transposed (see Gemm.check)
                self.transposed_constants = frozenset({1})
                problem = MatmulProblem(M=1, N=N, K=K, sAm=K, sAk=1, sBk=1, sBn=K)
            elif half and len(b.shape) == 2 and 1 in self.constants and transposed_b(N, K):
                self.transposed_constants = frozenset({1})  # stored N x K: see transposed_b
                problem = MatmulProblem(M=rows, N=N, K=K, sAm=K, sAk=1, sBk=1, sBn=K)
            else:
                problem = MatmulProblem(M=rows, N=N, K=K, sAm=K, sAk=1, sBk=N, sBn=1)
            problem.has_bias, problem.sCn, problem.act = self.has_input(2), 1, self.act
        else:
            dims, (sa, sb) = collapse(batch, a2[:-2], b2[:-2])
            ystrides = [int(np.prod(dims[i + 1:], dtype=np.int64)) for i in range(len(dims))]
            problem = MatmulProblem(
                M=M, N=N, K=K, sAm=K, sAk=1, sBk=N, sBn=1,
                batch=[BatchDim(d, x * M * K, w * K * N, 0, v * M * N)
                       for d, x, w, v in zip(dims, sa, sb, ystrides)],
            )
        self.plan: MatmulPlan | HalfMatmulPlan = HalfMatmulPlan(problem) if half else MatmulPlan(problem)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        # float16 as the kernels do it: a float32 product of the halves, rounded once
        y = np.matmul(a.astype(np.float32, copy=False), b.astype(np.float32, copy=False))
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + inputs[2]
        y = apply_activation(self.act, y)
        return [y.astype(self.dtype, copy=False).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        a, b, y = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
        c = ctx.inputs[2] if len(ctx.inputs) > 2 else None
        if isinstance(self.plan, HalfMatmulPlan):
            return self.plan.dispatches(a, b, y, ctx.caps, c=c, ws=ctx.workspace)
        return self.plan.dispatches(a, b, c, y, ctx.workspace, caps=ctx.caps)

    def flops(self) -> int:
        return self.plan.flops() + (int(np.prod(self.out_shape)) if self.has_input(2) else 0)

    def workspace_bytes(self) -> int:
        return self.plan.workspace_bytes()


__all__ = ["MatMul"]
