"""DFT (``shaders/dft.comp``) of float32 real or complex signals along one axis: forward (full or
one-sided), inverse, and the inverse of a one-sided spectrum (real output); ``dft_length`` and
opset 20's ``axis`` input must be known at load time."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
)

_F32 = np.dtype(np.float32)


class DFT(Op):
    op_type = "DFT"
    constant_inputs = (1, 2)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != _F32:
            raise UnsupportedOp(f"DFT: element type {x.dtype} has no kernel")
        rank = len(x.shape)
        if rank < 2 or x.shape[-1] not in (1, 2):
            raise OpError(f"DFT: the last dimension must be 1 (real) or 2 (complex), got {x.shape}")
        if self.opset >= 20:
            axis = int(np.asarray(self.constants[2]).reshape(-1)[0]) if self.has_input(2) else -2
        else:
            axis = int(self.attr("axis", 1))
        axis %= rank
        if axis == rank - 1:
            raise OpError("DFT: the axis must not be the real/imaginary dimension")
        self.axis = axis
        self.inverse = bool(self.attr("inverse", 0))
        self.onesided = bool(self.attr("onesided", 0))
        n = x.shape[axis]
        if self.has_input(1):
            self.length = int(np.asarray(self.constants[1]).reshape(-1)[0])
        else:
            self.length = 2 * (n - 1) if self.inverse and self.onesided else n
        if self.length < 1:
            raise OpError(f"DFT: dft_length must be positive, got {self.length}")
        self.mode = 2 if self.inverse and self.onesided else int(self.inverse)
        self.out_len = self.length // 2 + 1 if self.onesided and not self.inverse else self.length

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        shape = list(x.shape)
        shape[self.axis] = self.out_len
        shape[-1] = 1 if self.mode == 2 else 2
        return [TensorInfo(tuple(shape), _F32)]

    def flops(self) -> int:
        return 8 * self.output_infos()[0].size * self.input(0).shape[self.axis]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        signal = x[..., 0] + (1j * x[..., 1] if x.shape[-1] == 2 else 0)
        if self.mode == 2:
            return [np.fft.irfft(signal, n=self.length, axis=self.axis)[..., None].astype(np.float32)]
        spectrum = (np.fft.ifft if self.inverse else np.fft.fft)(signal, n=self.length, axis=self.axis)
        spectrum = np.take(spectrum, np.arange(self.out_len), axis=self.axis)
        return [np.stack([spectrum.real, spectrum.imag], axis=-1).astype(np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        out = self.output_infos()[0]
        total = out.size // out.shape[-1]
        if total == 0:
            return []
        inner = math.prod(x.shape[self.axis + 1:-1])
        check_serial(min(x.shape[self.axis], self.length), ctx.caps, f"DFT of length {self.length}")
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(total), U32(x.shape[self.axis]),
                U32(self.out_len), U32(self.length), U32(inner)]
        defines = {"MODE": self.mode, "CIN": x.shape[-1], "COUT": out.shape[-1]}
        return [Dispatch("dft", args, groups_1d(total, 256, ctx.caps), defines)]
