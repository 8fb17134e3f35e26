"""BatchNormalization in inference mode (training_mode=1 has no kernel)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)

_F32 = np.dtype(np.float32)


class BatchNormalization(Op):
    op_type = "BatchNormalization"

    def check(self) -> None:
        if int(self.attr("training_mode", 0)):
            raise UnsupportedOp("BatchNormalization: training_mode=1 (batch statistics): no kernel")
        if self.opset < 14 and self.num_outputs > 1:
            raise UnsupportedOp("BatchNormalization: training outputs (mean, var, saved stats): no kernel")
        if self.num_outputs > 1:
            raise OpError("BatchNormalization: running mean/var outputs require training_mode=1")
        x = self.input(0)
        params = [self.input(i) for i in range(1, 5)]
        for info in (x, *params):
            if info.dtype != _F32:
                raise UnsupportedOp(f"BatchNormalization: only float32 is supported, got {info.dtype}")
        if len(x.shape) < 2:
            raise OpError(f"BatchNormalization: X must be N x C x ..., got {x.shape}")
        c = x.shape[1]
        spatial = math.prod(x.shape[2:])
        if self.opset < 9 and int(self.attr("spatial", 1)) == 0:
            # per-element statistics: parameters of shape C x D1 x ... (or broadcastable to it)
            self.param_shape: tuple[int, ...] = tuple(x.shape[1:])
            self.period, self.count = 1, c * spatial
        else:
            self.param_shape = (c,)
            self.period, self.count = spatial, c
        for i, p in enumerate(params, start=1):
            if math.prod(p.shape) != math.prod(self.param_shape):
                raise OpError(f"BatchNormalization: input {i} has shape {p.shape}, not {self.param_shape}")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, scale, bias, mean, var = inputs[:5]
        assert all(v is not None for v in (x, scale, bias, mean, var))
        shape = (1, *self.param_shape, *([1] * (x.ndim - 1 - len(self.param_shape))))
        eps = np.float32(self.attr("epsilon", 1e-5))
        r = [a.reshape(shape) for a in (scale, bias, mean, var)]
        y = (x - r[2]) / np.sqrt(r[3] + eps) * r[0] + r[1]
        return [y.astype(np.float32, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        x, scale, bias, mean, var = ctx.inputs[:5]
        return [Dispatch(
            "batchnorm",
            [Ptr(x), Ptr(scale), Ptr(bias), Ptr(mean), Ptr(var), Ptr(ctx.outputs[0]),
             U32(n), U32(self.period), U32(self.count), F32(float(self.attr("epsilon", 1e-5)))],
            groups_1d(n, 256, ctx.caps),
        )]

    def flops(self) -> int:
        return 4 * self.input(0).size


__all__ = ["BatchNormalization"]
