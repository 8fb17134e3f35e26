"""CausalConvWithState (``shaders/causal_conv.comp``): depthwise causal 1-D convolution over the
input prefixed with a carried state, optional bias and SiLU; returns the output and the new state
(the last ``kernel - 1`` steps). float32 and float16 (computed in float32)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, check_serial, groups_1d,
)
from vkpool.kernels.ops.dtypes import FLOAT_TYPES, element_defines, require


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class CausalConvWithState(Op):
    op_type = "CausalConvWithState"

    def check(self) -> None:
        x, w = self.input(0), self.input(1)
        require(self.op_type, x.dtype, FLOAT_TYPES)
        if len(x.shape) != 3 or len(w.shape) != 3 or w.shape[:2] != (x.shape[1], 1) or w.dtype != x.dtype:
            raise OpError(f"CausalConvWithState: input {x.shape} and weight {w.shape} do not fit")
        self.n, self.c, self.length = x.shape
        self.k = w.shape[2]
        if self.k < 1:
            raise OpError("CausalConvWithState: the kernel is empty")
        if self.has_input(2) and self.input(2).shape != (self.c,):
            raise OpError(f"CausalConvWithState: bias must have shape ({self.c},)")
        if self.has_input(3) and self.input(3).shape != (self.n, self.c, self.k - 1):
            raise OpError(f"CausalConvWithState: past_state must have shape {(self.n, self.c, self.k - 1)}")
        activation = _text(self.attr("activation", "none"))
        if activation not in ("none", "silu", "swish"):
            raise OpError(f"CausalConvWithState: unknown activation {activation!r}")
        self.silu = activation != "none"

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        return [x, TensorInfo((self.n, self.c, self.k - 1), x.dtype)][: self.num_outputs]

    def flops(self) -> int:
        return 2 * self.input(0).size * self.k

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        bias = inputs[2] if len(inputs) > 2 else None
        past = inputs[3] if len(inputs) > 3 else None
        lead = np.zeros((self.n, self.c, self.k - 1), np.float32) if past is None else past.astype(np.float32)
        padded = np.concatenate([lead, x.astype(np.float32)], axis=2)
        windows = np.stack([padded[:, :, k:k + self.length] for k in range(self.k)], axis=-1)
        y = (windows * w[:, 0, :].astype(np.float32)[None, :, None, :]).sum(axis=-1)
        if bias is not None:
            y = y + bias.astype(np.float32)[None, :, None]
        if self.silu:
            y = y / (1 + np.exp(-y))
        state = padded[:, :, padded.shape[2] - (self.k - 1):]
        return [y.astype(x.dtype), state.astype(x.dtype)][: self.num_outputs]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        total = self.n * self.c * (self.length + self.k - 1)
        if total == 0:
            return []
        x = ctx.inputs[0]
        state = ctx.outputs[1] if self.num_outputs > 1 and ctx.outputs[1] is not None else None
        if state is None:  # no state wanted: only the output's invocations
            total = self.n * self.c * self.length
        check_serial(self.k, ctx.caps, f"causal convolution of width {self.k}")
        args = [Ptr(x), Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2] if self.has_input(2) else x),
                Ptr(ctx.inputs[3] if self.has_input(3) else x), Ptr(ctx.outputs[0]),
                Ptr(state if state is not None else ctx.outputs[0]), U32(total), U32(self.n * self.c),
                U32(self.c), U32(self.length), U32(self.k), U32(int(self.has_input(2))),
                U32(int(self.has_input(3)))]
        defines = {"ACT": int(self.silu), **element_defines(self.input(0).dtype, "X")}
        return [Dispatch("causal_conv", args, groups_1d(total, 256, ctx.caps), defines)]
