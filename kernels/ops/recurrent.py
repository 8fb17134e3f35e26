"""RNN, GRU and LSTM (``shaders/recurrent.comp``) with their default activations (Tanh; Sigmoid
and Tanh; Sigmoid, Tanh and Tanh): forward, reverse and bidirectional, sequence lengths, initial
states, GRU's linear_before_reset, LSTM's peepholes, clipping, both layouts; float32.

Up to 256 hidden units, the steps run serially in one workgroup per direction and batch row, the
state in shared memory. A larger hidden size, or a sequence whose steps would run more loop
iterations in one invocation than the device completes (``DeviceCaps.max_loop_iterations``),
runs one dispatch per step instead (two for GRU), the state in the workspace."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    LOOP_SLACK, Dispatch, DispatchContext, F32, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, check_serial,
    groups_1d,
)

_F32 = np.dtype(np.float32)
#: the largest hidden size one workgroup holds (one invocation per unit, the state in shared memory)
_WORKGROUP_HIDDEN = 256


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-v))


class Recurrent(Op):
    """Shared checks and dispatch; subclasses set the cell (shader CELL), gate count and defaults."""

    cell: ClassVar[int]
    gates: ClassVar[int]
    default_activations: ClassVar[tuple[str, ...]]

    def check(self) -> None:
        x, w, r = self.input(0), self.input(1), self.input(2)
        if any(t.dtype != _F32 for t in (x, w, r)):
            raise UnsupportedOp(f"{self.op_type}: only float32 is supported")
        self.layout = int(self.attr("layout", 0))
        direction = _text(self.attr("direction", "forward"))
        if direction not in ("forward", "reverse", "bidirectional"):
            raise OpError(f"{self.op_type}: unknown direction {direction!r}")
        self.dirs = 2 if direction == "bidirectional" else 1
        self.reverse_first = int(direction == "reverse")
        activations = tuple(_text(a).lower() for a in self.attr("activations", []))
        defaults = tuple(a.lower() for a in self.default_activations) * self.dirs
        if activations and activations != defaults:
            raise UnsupportedOp(f"{self.op_type}: activations {list(activations)} have no kernel")
        if len(x.shape) != 3:
            raise OpError(f"{self.op_type}: X must be rank 3, got {x.shape}")
        self.s, self.n = (x.shape[1], x.shape[0]) if self.layout else (x.shape[0], x.shape[1])
        self.i = x.shape[2]
        self.h = int(self.attr("hidden_size", r.shape[-1]))
        rows = self.gates * self.h
        if w.shape != (self.dirs, rows, self.i) or r.shape != (self.dirs, rows, self.h):
            raise OpError(f"{self.op_type}: W {w.shape} / R {r.shape} do not fit")
        self.clip = float(self.attr("clip", 0.0))
        if self.has_input(4) and self.input(4).dtype != np.dtype(np.int32):
            raise OpError(f"{self.op_type}: sequence_lens must be int32")

    def output_infos(self) -> list[TensorInfo]:
        if self.layout:
            y, state = (self.n, self.s, self.dirs, self.h), (self.n, self.dirs, self.h)
        else:
            y, state = (self.s, self.dirs, self.n, self.h), (self.dirs, self.n, self.h)
        infos = [TensorInfo(y, _F32), TensorInfo(state, _F32), TensorInfo(state, _F32)]
        return infos[: self.num_outputs]

    def flops(self) -> int:
        return 2 * self.s * self.n * self.dirs * self.gates * self.h * (self.i + self.h)

    def extra_defines(self) -> dict[str, int]:
        return {}

    def step_iterations(self) -> int:
        """Loop iterations one unit runs in a step: every gate's products over the input and the
        state (GRU computes its reset gate twice in the one-workgroup kernel)."""
        return (self.gates + int(self.gates == 3)) * (self.i + self.h) + 1

    def workspace_bytes(self) -> int:
        # the stepwise state (two h, c, GRU's reset values); the one-workgroup kernel needs none,
        # but which kernel runs is known only with the device, so the size is always reserved
        # where the hidden size leaves the choice
        return 4 * 4 * self.dirs * self.n * self.h

    def stepwise(self, caps: Any) -> bool:
        limit = caps.max_loop_iterations
        return self.h > _WORKGROUP_HIDDEN or bool(limit) and self.s * self.step_iterations() + LOOP_SLACK > limit

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = ctx.inputs[0]

        def opt_in(pos: int) -> Any:
            return ctx.inputs[pos] if self.has_input(pos) else x

        def opt_out(pos: int) -> Any:
            return ctx.outputs[pos] if pos < len(ctx.outputs) and ctx.outputs[pos] is not None else None

        outs = [opt_out(k) for k in range(3)]
        stepwise = self.stepwise(ctx.caps)
        args = [Ptr(x), Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]), *(Ptr(opt_in(k)) for k in range(3, 8)),
                *(Ptr(o if o is not None else x) for o in outs), Ptr(ctx.workspace if stepwise else x),
                U32(self.s), U32(self.n), U32(self.i), U32(self.h), U32(self.dirs), F32(self.clip)]
        local = 64 if stepwise else max(32, 1 << max(0, self.h - 1).bit_length())
        defines = {"CELL": self.cell, "LAYOUT": self.layout, "REVERSE_FIRST": self.reverse_first,
                   "STEPWISE": int(stepwise), "LOCAL_SIZE": local,
                   **{f"HAS_{name}": int(self.has_input(pos)) for name, pos in
                                             (("B", 3), ("LENS", 4), ("H0", 5), ("C0", 6), ("P", 7))},
                   "HAS_Y": int(outs[0] is not None), "HAS_YH": int(outs[1] is not None),
                   "HAS_YC": int(outs[2] is not None), "LINEAR_BEFORE_RESET": 0, **self.extra_defines()}
        if not stepwise:
            return [Dispatch("recurrent", [*args, U32(0), U32(0)], groups_1d(self.dirs * self.n, 1, ctx.caps),
                             defines)]
        check_serial(self.step_iterations(), ctx.caps, f"{self.op_type} step of {self.h} hidden units")
        groups = groups_1d(self.dirs * self.n * self.h, local, ctx.caps)

        def run(step: int, phase: int) -> Dispatch:
            return Dispatch("recurrent", [*args, U32(step), U32(phase)], groups, defines)

        steps = [run(0, 0)]
        for step in range(self.s):
            steps += [run(step, 2), run(step, 1)] if self.cell == 1 else [run(step, 1)]
        return steps + [run(self.s, 3)] if outs[1] is not None or outs[2] is not None else steps

    # -- numpy reference ----------------------------------------------------------------------
    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, w, r = (np.asarray(inputs[k], np.float64) for k in range(3))
        opt = [inputs[k] if k < len(inputs) else None for k in range(8)]
        if self.layout:  # batch first: to [seq, batch, ...] and [dirs, batch, ...]
            x = x.transpose(1, 0, 2)
            opt[5:7] = [s.transpose(1, 0, 2) if s is not None else None for s in opt[5:7]]
        g, hs = self.gates, self.h
        b = np.asarray(opt[3], np.float64) if opt[3] is not None else np.zeros((self.dirs, 2 * g * hs))
        lens = opt[4] if opt[4] is not None else np.full(self.n, self.s)
        y = np.zeros((self.s, self.dirs, self.n, hs))
        yh = np.zeros((self.dirs, self.n, hs))
        yc = np.zeros((self.dirs, self.n, hs))
        for d in range(self.dirs):
            backwards = (d == 1) != bool(self.reverse_first)
            for n in range(self.n):
                h = np.asarray(opt[5][d, n], np.float64) if opt[5] is not None else np.zeros(hs)
                c = np.asarray(opt[6][d, n], np.float64) if opt[6] is not None else np.zeros(hs)
                p = np.asarray(opt[7][d], np.float64) if opt[7] is not None else np.zeros(3 * hs)
                length = min(int(lens[n]), self.s)
                for step in range(length):
                    t = length - 1 - step if backwards else step
                    h, c = self.cell_step(x[t, n], h, c, w[d], r[d], b[d], p)
                    y[t, d, n] = h
                yh[d, n], yc[d, n] = h, c
        if self.layout:
            y, yh, yc = y.transpose(2, 0, 1, 3), yh.transpose(1, 0, 2), yc.transpose(1, 0, 2)
        return [a.astype(np.float32) for a in (y, yh, yc)][: self.num_outputs]

    def clipped(self, v: np.ndarray) -> np.ndarray:
        return np.clip(v, -self.clip, self.clip) if self.clip > 0 else v

    @abstractmethod
    def cell_step(self, x: np.ndarray, h: np.ndarray, c: np.ndarray, w: np.ndarray, r: np.ndarray,
                  b: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step of one row: the new hidden state and cell state (W, R, B, P of its direction)."""


class RNN(Recurrent):
    op_type = "RNN"
    cell, gates, default_activations = 0, 1, ("Tanh",)

    def cell_step(self, x: np.ndarray, h: np.ndarray, c: np.ndarray, w: np.ndarray, r: np.ndarray,
                  b: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hs = self.h
        return np.tanh(self.clipped(w @ x + r @ h + b[:hs] + b[hs:])), c


class GRU(Recurrent):
    op_type = "GRU"
    cell, gates, default_activations = 1, 3, ("Sigmoid", "Tanh")

    def extra_defines(self) -> dict[str, int]:
        return {"LINEAR_BEFORE_RESET": int(bool(self.attr("linear_before_reset", 0)))}

    def cell_step(self, x: np.ndarray, h: np.ndarray, c: np.ndarray, w: np.ndarray, r: np.ndarray,
                  b: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hs = self.h
        gx, wb, rb = w @ x, b[: 3 * hs], b[3 * hs:]
        z = _sigmoid(self.clipped(gx[:hs] + r[:hs] @ h + wb[:hs] + rb[:hs]))
        rg = _sigmoid(self.clipped(gx[hs:2 * hs] + r[hs:2 * hs] @ h + wb[hs:2 * hs] + rb[hs:2 * hs]))
        if self.attr("linear_before_reset", 0):
            hh = np.tanh(self.clipped(gx[2 * hs:] + wb[2 * hs:] + rg * (r[2 * hs:] @ h + rb[2 * hs:])))
        else:
            hh = np.tanh(self.clipped(gx[2 * hs:] + wb[2 * hs:] + r[2 * hs:] @ (rg * h) + rb[2 * hs:]))
        return (1 - z) * hh + z * h, c


class LSTM(Recurrent):
    op_type = "LSTM"
    cell, gates, default_activations = 2, 4, ("Sigmoid", "Tanh", "Tanh")

    def check(self) -> None:
        super().check()
        if self.attr("input_forget", 0):
            raise UnsupportedOp("LSTM: input_forget has no kernel")

    def cell_step(self, x: np.ndarray, h: np.ndarray, c: np.ndarray, w: np.ndarray, r: np.ndarray,
                  b: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hs = self.h
        gates = w @ x + r @ h + b[: 4 * hs] + b[4 * hs:]
        i = _sigmoid(self.clipped(gates[:hs] + p[:hs] * c))
        f = _sigmoid(self.clipped(gates[2 * hs:3 * hs] + p[2 * hs:] * c))
        cc = np.tanh(self.clipped(gates[3 * hs:]))
        c = f * c + i * cc
        o = _sigmoid(self.clipped(gates[hs:2 * hs] + p[hs:2 * hs] * c))
        return o * np.tanh(c), c
