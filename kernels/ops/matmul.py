"""MatMul with numpy semantics: batched, broadcast batch dimensions, 1-D operands."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.broadcast import broadcast_shape, collapse
from vkpool.kernels.ops.gemm import BatchDim, MatmulPlan, MatmulProblem

_F32 = np.dtype(np.float32)


class MatMul(Op):
    op_type = "MatMul"
    rereads_inputs = True

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        if a.dtype != _F32 or b.dtype != _F32:
            raise UnsupportedOp(f"MatMul: only float32 is supported, got {a.dtype} and {b.dtype}")
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
        if all(d == 1 for d in b2[:-2]):
            # B is one matrix: A's batch folds into its rows (A is contiguous), one product.
            rows = int(np.prod(a2[:-1], dtype=np.int64))
            if rows == 1 and len(b.shape) == 2 and 1 in self.constants:
                # a GEMV by constant weights reads them stored transposed (see Gemm.check)
                self.transposed_constants = frozenset({1})
                problem = MatmulProblem(M=1, N=N, K=K, sAm=K, sAk=1, sBk=1, sBn=K)
            else:
                problem = MatmulProblem(M=rows, N=N, K=K, sAm=K, sAk=1, sBk=N, sBn=1)
        else:
            dims, (sa, sb) = collapse(batch, a2[:-2], b2[:-2])
            ystrides = [int(np.prod(dims[i + 1:], dtype=np.int64)) for i in range(len(dims))]
            problem = MatmulProblem(
                M=M, N=N, K=K, sAm=K, sAk=1, sBk=N, sBn=1,
                batch=[BatchDim(d, x * M * K, w * K * N, 0, v * M * N)
                       for d, x, w, v in zip(dims, sa, sb, ystrides)],
            )
        self.plan = MatmulPlan(problem)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, _F32)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        return [np.matmul(a, b).astype(np.float32, copy=False).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return self.plan.dispatches(ctx.inputs[0], ctx.inputs[1], None, ctx.outputs[0], ctx.workspace)

    def flops(self) -> int:
        return self.plan.flops()

    def workspace_bytes(self) -> int:
        return self.plan.workspace_bytes()


__all__ = ["MatMul"]
