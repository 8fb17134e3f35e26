"""STFT (``shaders/stft.comp``) of float32 real or complex signals [batch, length, 1 or 2]: frames
of ``frame_length`` every ``frame_step`` samples (both known at load time), an optional window,
one-sided by default; directly summed per frame."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial, groups_1d,
)

_F32 = np.dtype(np.float32)


class STFT(Op):
    op_type = "STFT"
    constant_inputs = (1, 3)

    def check(self) -> None:
        x = self.input(0)
        if x.dtype != _F32:
            raise UnsupportedOp(f"STFT: element type {x.dtype} has no kernel")
        if len(x.shape) != 3 or x.shape[2] not in (1, 2):
            raise OpError(f"STFT: the signal must be [batch, length, 1 or 2], got {x.shape}")
        self.step = int(np.asarray(self.constants[1]).reshape(-1)[0])
        if self.has_input(3):
            self.frame = int(np.asarray(self.constants[3]).reshape(-1)[0])
        elif self.has_input(2):
            self.frame = self.input(2).shape[0]
        else:
            self.frame = x.shape[1]
        if self.has_input(2) and self.input(2).shape != (self.frame,):
            raise OpError(f"STFT: the window must have shape ({self.frame},)")
        if self.step < 1 or not 1 <= self.frame <= x.shape[1]:
            raise OpError(f"STFT: frame_step {self.step} / frame_length {self.frame} do not fit {x.shape}")
        self.onesided = bool(self.attr("onesided", 1))
        if self.onesided and x.shape[2] == 2:
            raise OpError("STFT: a one-sided transform needs a real signal")
        self.frames = 1 + (x.shape[1] - self.frame) // self.step
        self.bins = self.frame // 2 + 1 if self.onesided else self.frame

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((self.input(0).shape[0], self.frames, self.bins, 2), _F32)]

    def flops(self) -> int:
        return 8 * self.output_infos()[0].size * self.frame

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        window = inputs[2] if len(inputs) > 2 and inputs[2] is not None else np.ones(self.frame, np.float32)
        signal = x[..., 0] + (1j * x[..., 1] if x.shape[2] == 2 else 0)
        starts = np.arange(self.frames) * self.step
        frames = np.stack([signal[:, s:s + self.frame] for s in starts], axis=1) * window
        spectrum = np.fft.fft(frames, axis=-1)[..., :self.bins]
        return [np.stack([spectrum.real, spectrum.imag], axis=-1).astype(np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        total = x.shape[0] * self.frames * self.bins
        if total == 0:
            return []
        check_serial(self.frame, ctx.caps, f"STFT frames of {self.frame} samples")
        window = ctx.inputs[2] if self.has_input(2) else ctx.inputs[0]
        args = [Ptr(ctx.inputs[0]), Ptr(window), Ptr(ctx.outputs[0]), U32(total), U32(x.shape[1]),
                U32(self.frames), U32(self.bins), U32(self.step), U32(self.frame)]
        defines = {"CIN": x.shape[2], "HAS_WINDOW": int(self.has_input(2))}
        return [Dispatch("stft", args, groups_1d(total, 256, ctx.caps), defines)]
