"""RotaryEmbedding (opset 23) on ``shaders/rotary.comp``: 3-D or 4-D input, interleaved or
half-split pairs, partial rotation (rotary_embedding_dim), optional position_ids."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, UnsupportedOp, groups_1d,
)


class RotaryEmbedding(Op):
    op_type = "RotaryEmbedding"

    def check(self) -> None:
        x, cos, sin = self.input(0), self.input(1), self.input(2)
        for t in (x, cos, sin):
            if t.dtype != np.float32:
                raise UnsupportedOp(f"RotaryEmbedding: element type {t.dtype} has no kernel")
        if len(x.shape) == 4:
            self.nb, self.nh, self.ns, self.nd = x.shape
        elif len(x.shape) == 3:
            heads = int(self.attr("num_heads", 0) or 0)
            if heads <= 0 or x.shape[2] % heads:
                raise OpError("RotaryEmbedding: 3-D input needs num_heads dividing the hidden size")
            self.nb, self.ns, self.nh, self.nd = x.shape[0], x.shape[1], heads, x.shape[2] // heads
        else:
            raise OpError(f"RotaryEmbedding: input must be 3-D or 4-D, got {x.shape}")
        self.rd = int(self.attr("rotary_embedding_dim", 0) or 0) or self.nd
        if self.rd % 2 or self.rd > self.nd:
            raise OpError(f"RotaryEmbedding: rotary_embedding_dim {self.rd} for head size {self.nd}")
        self.interleaved = bool(self.attr("interleaved", 0))
        self.has_pos = self.has_input(3)
        if cos.shape[-1] != self.rd // 2 or sin.shape != cos.shape:
            raise OpError(f"RotaryEmbedding: caches {cos.shape}/{sin.shape} do not hold rotary_dim/2 = {self.rd // 2}")
        if self.has_pos:
            if self.input(3).dtype != np.int64:
                raise OpError("RotaryEmbedding: position_ids must be int64")
        elif cos.shape[:2] != (self.nb, self.ns):
            raise OpError(f"RotaryEmbedding: without position_ids the caches must be [B, S, ...], got {cos.shape}")

    def output_infos(self) -> list[TensorInfo]:
        return [self.input(0)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, cos, sin = inputs[0], inputs[1], inputs[2]
        pos = inputs[3] if len(inputs) > 3 else None
        assert x is not None and cos is not None and sin is not None
        if x.ndim == 4:
            v = x.transpose(0, 2, 1, 3)
        else:
            v = x.reshape(self.nb, self.ns, self.nh, self.nd)
        if pos is not None:
            cos, sin = cos[pos], sin[pos]
        cos = cos.reshape(self.nb, self.ns, 1, -1)
        sin = sin.reshape(self.nb, self.ns, 1, -1)
        rot, rest = v[..., : self.rd], v[..., self.rd:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : self.rd // 2], rot[..., self.rd // 2:]
        real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
        if self.interleaved:
            rot = np.stack([real, imag], axis=-1).reshape(rot.shape)
        else:
            rot = np.concatenate([real, imag], axis=-1)
        out = np.concatenate([rot, rest], axis=-1)
        out = out.transpose(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)
        return [np.ascontiguousarray(out, dtype=np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        if n == 0:
            return []
        x = Ptr(ctx.inputs[0])
        args = [x, Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]), Ptr(ctx.inputs[3]) if self.has_pos else x,
                Ptr(ctx.outputs[0])]
        defines = {"NB": self.nb, "NS": self.ns, "NH": self.nh, "ND": self.nd, "RD": self.rd,
                   "X3D": int(len(self.input(0).shape) == 3), "INTERLEAVED": int(self.interleaved),
                   "POS": int(self.has_pos)}
        return [Dispatch("rotary", args, groups_1d(n, 64, ctx.caps), defines)]


__all__ = ["RotaryEmbedding"]
