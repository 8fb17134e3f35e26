"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (``shaders/nll_loss.comp``) on float32
scores and int32/int64 targets, every reduction, optional class weights and ignored index.

SoftmaxCrossEntropyLoss is LogSoftmax over the class axis (``shaders/softmax.comp``, into its
``log_prob`` output or the workspace) followed by the NLL loss of that."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, I32, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.ops.dtypes import element_defines
from vkpool.kernels.ops.softmax import softmax_dispatch

_F32 = np.dtype(np.float32)
_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nll_reference(logp: np.ndarray, target: np.ndarray, weight: np.ndarray | None, reduction: str,
                  ignore_index: int | None) -> np.ndarray:
    """The loss as the ONNX operator defines it, in numpy."""
    n, c = logp.shape[:2]
    x = logp.reshape(n, c, -1)
    t = target.reshape(n, -1).astype(np.int64)
    ignored = (t == ignore_index) if ignore_index is not None else np.zeros(t.shape, bool)
    safe = np.clip(t, 0, c - 1)
    w = (weight[safe] if weight is not None else np.ones(t.shape, np.float32)) * ~ignored
    picked = np.take_along_axis(x, safe[:, None, :], axis=1)[:, 0, :]
    loss = (-picked * w).astype(np.float32)
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return np.array(loss.sum(), np.float32)
    return np.array(loss.sum() / w.sum(), np.float32)


class _Loss(Op):
    """Shared checks: scores [N, C, d...] float32, targets [N, d...] integer, weights [C]."""

    def check(self) -> None:
        x, t = self.input(0), self.input(1)
        if x.dtype != _F32:
            raise UnsupportedOp(f"{self.op_type}: only float32 scores are supported, got {x.dtype}")
        element_defines(t.dtype, "T")
        if t.dtype.kind not in "iu":
            raise OpError(f"{self.op_type}: targets must be integers, got {t.dtype}")
        if len(x.shape) < 2 or t.shape != x.shape[:1] + x.shape[2:]:
            raise OpError(f"{self.op_type}: scores {x.shape} and targets {t.shape} do not match")
        if self.has_input(2) and (self.input(2).shape != x.shape[1:2] or self.input(2).dtype != _F32):
            raise OpError(f"{self.op_type}: weights must be float32 of shape {x.shape[1:2]}")
        self.reduction = _text(self.attr("reduction", "mean"))
        if self.reduction not in _REDUCTIONS:
            raise OpError(f"{self.op_type}: reduction must be none, sum or mean, got {self.reduction!r}")
        ignore = self.attr("ignore_index")
        self.ignore_index = None if ignore is None else int(ignore)
        if self.ignore_index is not None and not -2**31 <= self.ignore_index < 2**31:
            raise UnsupportedOp(f"{self.op_type}: ignore_index {self.ignore_index} beyond 32 bits")
        self.n, self.c = x.shape[0], x.shape[1]
        self.d = math.prod(x.shape[2:])

    def loss_info(self) -> TensorInfo:
        shape = self.input(1).shape if self.reduction == "none" else ()
        return TensorInfo(shape, _F32)

    def flops(self) -> int:
        return 2 * self.input(1).size

    def nll_dispatch(self, ctx: DispatchContext, scores: Any) -> Dispatch:
        mode = _REDUCTIONS[self.reduction]
        weight = ctx.inputs[2] if self.has_input(2) else scores
        args = [Ptr(scores), Ptr(ctx.inputs[1]), Ptr(weight), Ptr(ctx.outputs[0]), U32(self.n), U32(self.c),
                U32(self.d), U32(int(self.has_input(2))), U32(int(self.ignore_index is not None)),
                I32(self.ignore_index or 0)]
        defines: dict[str, Any] = {"MODE": mode, **element_defines(self.input(1).dtype, "T")}
        groups = groups_1d(self.n * self.d, 256, ctx.caps) if mode == 0 else (1, 1, 1)
        return Dispatch("nll_loss", args, groups, defines)


class NegativeLogLikelihoodLoss(_Loss):
    op_type = "NegativeLogLikelihoodLoss"

    def output_infos(self) -> list[TensorInfo]:
        return [self.loss_info()]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, t, w = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        assert x is not None and t is not None
        return [nll_reference(x, t, w, self.reduction, self.ignore_index)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return [self.nll_dispatch(ctx, ctx.inputs[0])]


class SoftmaxCrossEntropyLoss(_Loss):
    op_type = "SoftmaxCrossEntropyLoss"

    def output_infos(self) -> list[TensorInfo]:
        infos = [self.loss_info()]
        if self.num_outputs > 1:
            infos.append(self.input(0))
        return infos

    def workspace_bytes(self) -> int:
        return 0 if self.num_outputs > 1 else self.input(0).nbytes

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, t, w = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        assert x is not None and t is not None
        shifted = x - x.max(axis=1, keepdims=True)
        logp = (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)
        loss = nll_reference(logp, t, w, self.reduction, self.ignore_index)
        return [loss, logp][: self.num_outputs]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        logp = ctx.outputs[1] if self.num_outputs > 1 and ctx.outputs[1] is not None else ctx.workspace
        rows = self.n * self.d
        return [softmax_dispatch(ctx.inputs[0], logp, self.c, self.d, rows, 1, ctx.caps),
                self.nll_dispatch(ctx, logp)]
