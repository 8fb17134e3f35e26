"""Spatial geometry shared by Conv and the pools: kernel, strides, dilations, pads, auto_pad."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import OpError, UnsupportedOp

MAX_SPATIAL = 3


@dataclass(frozen=True)
class Window:
    """A sliding window over the spatial dimensions of an N x C x D1 x ... tensor."""

    in_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.in_shape)

    def defines(self) -> dict[str, int]:
        """The window as shader defines, spatial dimensions padded to 3 (leading extent 1)."""
        pad = MAX_SPATIAL - self.rank

        def three(v: Sequence[int], fill: int) -> list[int]:
            return [fill] * pad + list(v)

        out: dict[str, int] = {}
        for prefix, vals, fill in (
            ("I", self.in_shape, 1), ("O", self.out_shape, 1), ("K", self.kernel, 1),
            ("S", self.strides, 1), ("D", self.dilations, 1), ("P", self.pads_begin, 0),
            ("Q", self.pads_end, 0),
        ):
            for axis, v in zip("DHW", three(vals, fill)):
                out[prefix + axis] = int(v)
        return out


def window(
    op_type: str,
    attrs: dict[str, Any],
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    *,
    ceil_mode: bool = False,
) -> Window:
    """Resolves strides, dilations and (auto_)pads for a window; output size per ONNX."""
    rank = len(in_spatial)
    if rank == 0 or rank > MAX_SPATIAL:
        raise UnsupportedOp(f"{op_type}: {rank} spatial dimensions (1 to {MAX_SPATIAL} are supported)")
    if len(kernel) != rank:
        raise OpError(f"{op_type}: kernel_shape {tuple(kernel)} does not match {rank} spatial dimensions")
    strides = tuple(int(s) for s in attrs.get("strides", [1] * rank))
    dilations = tuple(int(d) for d in attrs.get("dilations", [1] * rank))
    if len(strides) != rank or len(dilations) != rank:
        raise OpError(f"{op_type}: strides/dilations must have {rank} values")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise OpError(f"{op_type}: kernel, strides and dilations must be positive")
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(in_spatial, strides)]
        total = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides, extent, in_spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad in ("VALID", "NOTSET"):
        if auto_pad == "VALID":
            begin, end = [0] * rank, [0] * rank
        else:
            pads = [int(p) for p in attrs.get("pads", [0] * (2 * rank))]
            if len(pads) != 2 * rank:
                raise OpError(f"{op_type}: pads must have {2 * rank} values, got {pads}")
            if min(pads) < 0:
                raise UnsupportedOp(f"{op_type}: negative pads {pads}")
            begin, end = pads[:rank], pads[rank:]
        out = []
        for i, b, e, k, s in zip(in_spatial, begin, end, extent, strides):
            span = i + b + e - k
            if span < 0:
                raise OpError(f"{op_type}: window of extent {k} larger than padded input {i + b + e}")
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= i + b:
                o -= 1  # the last window must start inside the input or its leading pad
            out.append(o)
    else:
        raise OpError(f"{op_type}: unknown auto_pad {auto_pad!r}")
    return Window(
        tuple(int(v) for v in in_spatial), tuple(int(k) for k in kernel), strides, dilations,
        tuple(begin), tuple(end), tuple(out),
    )


def window_view(x: np.ndarray, w: Window, fill: float) -> np.ndarray:
    """[N, C, K1..Kr, O1..Or] view of every window position over ``x`` padded with ``fill``.

    Windows reaching past the padded input (ceil_mode) read ``fill`` there as well.
    """
    widths = [(0, 0), (0, 0)]
    for i, b, e, k, d, s, o in zip(w.in_shape, w.pads_begin, w.pads_end, w.kernel, w.dilations, w.strides,
                                   w.out_shape):
        need = (o - 1) * s + (k - 1) * d + 1
        widths.append((b, max(e, need - i - b)))
    xp = np.pad(x, widths, constant_values=fill)
    n, c = x.shape[:2]
    out = np.empty((n, c, *w.kernel, *w.out_shape), dtype=x.dtype)
    for kidx in np.ndindex(*w.kernel):
        sl = tuple(slice(k * d, k * d + (o - 1) * s + 1, s)
                   for k, d, s, o in zip(kidx, w.dilations, w.strides, w.out_shape))
        out[(slice(None), slice(None), *kidx)] = xp[(slice(None), slice(None), *sl)]
    return out
