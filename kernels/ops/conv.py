"""Conv: 1-D, 2-D and 3-D, groups (depthwise included), strides, dilations, pads, auto_pad.

Two kernels, chosen per shape at load time: a direct convolution (``conv.comp``) for few
output channels per group or short reductions, where a GEMM tile would be mostly padding;
otherwise an implicit GEMM (``gemm.comp`` with CONV) that computes the im2col on the fly
while loading tiles (no im2col buffer): per image and group,
Y[Mg x P] = W[Mg x Cg*k] @ im2col(X)[Cg*k x P]; its only workspace holds split-K partial sums.
A fourth input (``vkpool.fusion``'s, never in a file) is a residual of Y's shape, added to each
output after the bias and before the fused activation: a residual block's sum.
On a CPU-like device (the register tiling, with shuffles) a window of up to 64 taps runs the
same product as ``conv_taps.comp``, its window arithmetic hoisted out of the reduction.
A 3x3 convolution of stride 1 over enough tiles runs by Winograd's F(2x2, 3x3) instead
(``winograd.comp``): 16 batched products of C-long sums, 2.25 times fewer multiplications.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
    serial_pieces,
)
from vkpool.kernels.ops.gemm import BatchDim, MatmulPlan, MatmulProblem, apply_activation, fused_activation
from vkpool.kernels.ops.spatial import Window, window, window_view

_F32 = np.dtype(np.float32)
#: an implicit GEMM pays off from this many output channels per group ...
_GEMM_MIN_CHANNELS = 16
#: ... and this long a reduction (input channels per group x kernel size)
_GEMM_MIN_REDUCTION = 64
#: a 3x3 convolution of stride 1 runs by Winograd's F(2x2, 3x3) from this many 2 x 2 output tiles
#: (over the images) and this many input and output channels
WINOGRAD_MIN_TILES = 256
WINOGRAD_MIN_CHANNELS = 16
#: ... and its transformed weights, input and products fit this many bytes of workspace
#: (ResNet-50 at batch 16 needs 103 MB, bench.export_models' U-Net at 256 x 256 101 MB); a
#: larger one keeps the implicit GEMM, which needs none: a large image takes no large share of
#: a device's memory
WINOGRAD_MAX_WORKSPACE = 256 << 20
#: on a CPU-like device, from this many channels each way: the implicit GEMM's register tiling
#: (conv_taps.comp) is quicker on fewer. lavapipe, 2 cores, ms of one 3x3 convolution, Winograd
#: against the implicit GEMM: 64 -> 64 channels at 128 x 128 231 / 240, at 16 x 28 x 28 176 / 193;
#: 128 -> 128 at 4 x 28 x 28 126 / 175; 32 -> 32 at 256 x 256 356 / 270
WINOGRAD_MIN_CHANNELS_CPU_LIKE = 64


class Conv(Op):
    op_type = "Conv"
    rereads_inputs = True

    def check(self) -> None:
        x, w = self.input(0), self.input(1)
        for info in (x, w, *([self.input(2)] if self.has_input(2) else [])):
            if info.dtype != _F32:
                raise UnsupportedOp(f"Conv: only float32 is supported, got {info.dtype}")
        if len(x.shape) < 3 or len(w.shape) != len(x.shape):
            raise OpError(f"Conv: X {x.shape}, W {w.shape} must be N x C x spatial, M x C/group x kernel")
        self.group = int(self.attr("group", 1))
        n, c = x.shape[:2]
        m, cg = w.shape[:2]
        if self.group < 1 or c % self.group or m % self.group or cg * self.group != c:
            raise OpError(
                f"Conv: {c} input and {m} output channels do not split in {self.group} groups of W {w.shape}"
            )
        kernel = tuple(int(k) for k in self.attr("kernel_shape", w.shape[2:]))
        if kernel != tuple(w.shape[2:]):
            raise OpError(f"Conv: kernel_shape {kernel} differs from W's {w.shape[2:]}")
        if self.has_input(2) and self.input(2).shape != (m,):
            raise OpError(f"Conv: B must have shape ({m},), got {self.input(2).shape}")
        self.win: Window = window("Conv", self.attrs, x.shape[2:], kernel)
        self.act = fused_activation(self)
        self.out_shape = (n, m, *self.win.out_shape)
        if self.has_input(3):  # a residual block's sum folded in (vkpool.fusion): vkpool's own input
            r = self.input(3)
            if r.dtype != _F32 or tuple(r.shape) != self.out_shape:
                raise OpError(f"Conv: the residual must be float32 of the output's shape "
                              f"{list(self.out_shape)}, got {r.dtype} {list(r.shape)}")
        mg, kred = m // self.group, cg * math.prod(kernel)
        self.plan: MatmulPlan | None = None
        if mg >= _GEMM_MIN_CHANNELS and kred >= _GEMM_MIN_REDUCTION:
            in_size = math.prod(self.win.in_shape)
            self.plan = MatmulPlan(MatmulProblem(
                M=mg, N=math.prod(self.win.out_shape), K=kred, sAm=kred, sAk=1, sBk=0, sBn=1,
                has_bias=self.has_input(2), sCm=1, sCn=0,
                batch=[BatchDim(n * self.group, mg * kred, cg * in_size, mg, 0)], bias_rows=m,
                act=self.act,
            ), force_gemm=True)
        self.pointwise = self._pointwise_plan() if self.plan is not None else None
        self.folded = self._folded_plan() if self.plan is not None else None
        self.winograd = self._winograd_plan()

    def _winograd_plan(self) -> MatmulPlan | None:
        """Winograd's F(2x2, 3x3) for a 2-D 3x3 convolution of stride and dilation 1, one group,
        at least ``WINOGRAD_MIN_CHANNELS`` channels each way and ``WINOGRAD_MIN_TILES`` tiles of
        2 x 2 outputs over the images, its transforms within ``WINOGRAD_MAX_WORKSPACE``: the
        product ``P[xi] = U[xi] @ V[xi]`` of each of the 16 transformed positions xi (M x T,
        summing over C), run between ``winograd.comp``'s stages; None for any other
        convolution. (A CPU-like device runs it from ``WINOGRAD_MIN_CHANNELS_CPU_LIKE``; the
        workspace is reserved for it all the same.)"""
        win = self.win
        if (win.rank != 2 or tuple(win.kernel) != (3, 3) or any(s != 1 for s in win.strides)
                or any(d != 1 for d in win.dilations) or self.group != 1):
            return None
        c, m = self.input(0).shape[1], self.input(1).shape[0]
        t = self._winograd_tiles()[2]
        if min(c, m) < WINOGRAD_MIN_CHANNELS or t < WINOGRAD_MIN_TILES:
            return None
        if sum(self._winograd_sizes()) > WINOGRAD_MAX_WORKSPACE:
            return None
        return MatmulPlan(MatmulProblem(
            M=m, N=t, K=c, sAm=c, sAk=1, sBk=t, sBn=1, batch=[BatchDim(16, m * c, c * t, 0, m * t)],
        ), force_gemm=True)

    def _winograd_tiles(self) -> tuple[int, int, int]:
        """Rows and columns of 2 x 2 output tiles per image, and the tiles of all the images."""
        (oh, ow), n = self.win.out_shape, self.input(0).shape[0]
        th, tw = -(-oh // 2), -(-ow // 2)
        return th, tw, n * th * tw

    def _winograd_sizes(self) -> tuple[int, int, int]:
        """Bytes of the transformed weights, input and product in the workspace."""
        c, m = self.input(0).shape[1], self.input(1).shape[0]
        t = self._winograd_tiles()[2]
        return 16 * m * c * 4, 16 * c * t * 4, 16 * m * t * 4

    def _winograd_dispatches(self, ctx: DispatchContext, x: object, w: object, b: object, y: object,
                             r: object) -> list[Dispatch]:
        """The three stages of ``winograd.comp`` around the batched product. The workspace holds,
        in order, the transformed weights, the transformed input, the products, and the split
        sums of a product whose reduction is split."""
        assert self.winograd is not None
        c, m = self.input(0).shape[1], self.input(1).shape[0]
        th, tw, t = self._winograd_tiles()
        u_bytes, v_bytes, p_bytes = self._winograd_sizes()
        ws = ctx.workspace
        u, v, p, rest = (Ptr(ws, 0), Ptr(ws, u_bytes), Ptr(ws, u_bytes + v_bytes),
                         Ptr(ws, u_bytes + v_bytes + p_bytes))
        (ih, iw), (oh, ow) = self.win.in_shape, self.win.out_shape
        geometry = {"C": c, "M": m, "IH": ih, "IW": iw, "OH": oh, "OW": ow, "PH": self.win.pads_begin[0],
                    "PW": self.win.pads_begin[1], "TH": th, "TW": tw, "T": t}
        out = [
            Dispatch("winograd", [Ptr(w), u, U32(m * c)], groups_1d(m * c, 256, ctx.caps),
                     {"STAGE": 1, **geometry}),
            Dispatch("winograd", [Ptr(x), v, U32(c * t)], groups_1d(c * t, 256, ctx.caps),
                     {"STAGE": 2, **geometry}),
            *self.winograd.dispatches(u, v, None, p, rest, caps=ctx.caps),
        ]
        res = [Ptr(r)] if r is not None else []
        out.append(Dispatch("winograd", [p, Ptr(b if b is not None else y), Ptr(y), U32(m * t), *res],
                            groups_1d(m * t, 256, ctx.caps),
                            {"STAGE": 3, **geometry, "HAS_BIAS": int(b is not None), "ACT": self.act,
                             **({"HAS_RES": 1} if r is not None else {})}))
        return out

    def _folded_plan(self) -> MatmulPlan | None:
        """The implicit GEMM of a batch of images as one product whose columns run over the images
        too, ``Y[M x N*P] = W[M x C*k] @ im2col(X)[C*k x N*P]`` (gemm.comp's FOLD): the tiles of a
        deep layer then span images, where per image a 7 x 7 output fills 49 of a tile's 64
        columns. For one group, on the shared tiling (a split reduction's sums are placed by
        gemm_reduce.comp's FOLD); None otherwise."""
        n = self.input(0).shape[0]
        if n <= 1 or self.group != 1:
            return None
        m, kred = self.input(1).shape[0], math.prod(self.input(1).shape[1:])
        return MatmulPlan(MatmulProblem(
            M=m, N=n * math.prod(self.win.out_shape), K=kred, sAm=kred, sAk=1, sBk=0, sBn=1,
            has_bias=self.has_input(2), sCm=1, sCn=0, bias_rows=m, act=self.act,
        ), force_gemm=True)

    def _pointwise_plan(self) -> MatmulPlan | None:
        """A 1x1 convolution of stride 1 and no padding as the plain product it is, per image and
        group ``Y[Mg x P] = W[Mg x Cg] @ X[Cg x P]``: run where the product takes the register
        tiling (a CPU-like device), whose per-element window arithmetic would otherwise cost more
        than the loads (lavapipe, 1024 x 256 x 196: 11.4 ms against 19.3 ms); None for any other
        convolution."""
        win = self.win
        if any(k != 1 for k in win.kernel) or any(s != 1 for s in win.strides) or \
                any(win.pads_begin) or any(win.pads_end):
            return None
        n, c = self.input(0).shape[:2]
        m, cg = self.input(1).shape[:2]
        mg, size = m // self.group, math.prod(win.in_shape)
        groups = BatchDim(self.group, mg * cg, cg * size, mg, mg * size)
        return MatmulPlan(MatmulProblem(
            M=mg, N=size, K=cg, sAm=cg, sAk=1, sBk=size, sBn=1, has_bias=self.has_input(2), sCm=1, sCn=0,
            batch=[BatchDim(n, 0, c * size, 0, m * size), groups] if n > 1 else [groups], bias_rows=m,
            act=self.act,
        ), force_gemm=True)

    def _with_taps(self, d: Dispatch, caps: DeviceCaps | None) -> Dispatch:
        """The implicit GEMM ``d`` as ``conv_taps.comp`` where it runs the register tiling with
        shuffles (a CPU-like device) and the window has at most 64 taps: the same products, with
        the window arithmetic per element computed once per column (lavapipe, ResNet-50's 3x3
        convolutions); else ``d``. Past 32 taps its masks take 64-bit integers."""
        taps = math.prod(self.win.kernel)
        if d.shader != "gemm" or not d.defines.get("REGISTER_TILE") or not d.defines.get("A_SHUFFLE") \
                or taps > 64 or (taps > 32 and not (caps is not None and caps.int64)):
            return d
        return Dispatch("conv_taps", d.args, d.groups, d.defines)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, _F32)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, w = inputs[0], inputs[1]
        assert x is not None and w is not None
        b = inputs[2] if len(inputs) > 2 else None
        cols = window_view(x, self.win, 0.0)  # [N, C, k..., o...]
        n, c = x.shape[:2]
        m, cg = w.shape[:2]
        g, mg = self.group, m // self.group
        kp, op = math.prod(self.win.kernel), math.prod(self.win.out_shape)
        cols = cols.reshape(n, g, cg * kp, op)
        wg = w.reshape(g, mg, cg * kp)
        y = np.einsum("gmk,ngkp->ngmp", wg, cols, optimize=True).reshape(self.out_shape)
        if b is not None:
            y = y + b.reshape(1, m, *([1] * self.win.rank))
        if len(inputs) > 3 and inputs[3] is not None:
            y = y + inputs[3]
        y = apply_activation(self.act, y)
        return [y.astype(np.float32, copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x, w, y = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
        b = ctx.inputs[2] if len(ctx.inputs) > 2 and ctx.inputs[2] is not None else None
        r = ctx.inputs[3] if len(ctx.inputs) > 3 else None  # the residual, added before the activation
        c, m = self.input(0).shape[1], self.input(1).shape[0]
        geometry = self.win.defines()
        cpu_like = ctx.caps is not None and ctx.caps.cpu_like
        if self.winograd is not None and (not cpu_like or min(c, m) >= WINOGRAD_MIN_CHANNELS_CPU_LIKE):
            try:
                return self._winograd_dispatches(ctx, x, w, b, y, r)
            except UnsupportedOp:  # its product past the device's workgroup grid: the implicit GEMM
                pass
        if self.pointwise is not None and ctx.caps is not None and ctx.caps.gemm_variant == "register":
            return self.pointwise.dispatches(w, x, b, y, ctx.workspace, caps=ctx.caps, residual=r)
        if self.plan is not None:
            extra = {"CONV": 1, "G": self.group, "CG": c // self.group,
                     **{k: v for k, v in geometry.items() if not k.startswith("Q")}}
            if self.folded is not None and not self.folded.tile_for(ctx.caps).get("REGISTER_TILE"):
                fold = {**extra, "FOLD": math.prod(self.win.out_shape)}
                try:
                    return self.folded.dispatches(w, x, b, y, ctx.workspace, fold, caps=ctx.caps, residual=r)
                except UnsupportedOp:  # the images' columns past the device's workgroup grid: per image
                    pass
            planned = self.plan.dispatches(w, x, b, y, ctx.workspace, extra, caps=ctx.caps, residual=r)
            return [self._with_taps(d, ctx.caps) for d in planned]
        total = math.prod(self.out_shape)
        args = [Ptr(x), Ptr(w), Ptr(b if b is not None else y), Ptr(y), U32(total)]
        defines = {"C": c, "M": m, "G": self.group, "HAS_BIAS": int(b is not None), "ACT": self.act,
                   **({"HAS_RES": 1} if r is not None else {}),
                   **{k: v for k, v in geometry.items() if not k.startswith("Q")}}
        # loop iterations per input channel: every level of the window's loops
        k = self.win.kernel
        per_channel = sum(math.prod(k[:level]) for level in range(1, len(k) + 1)) + 1
        pieces = serial_pieces(c // self.group, per_channel, ctx.caps, "Conv")
        res = [Ptr(r)] if r is not None else []
        last = c // self.group
        return [Dispatch("conv", [*args, U32(start), U32(count), U32(int(start + count == last)), *res],
                         groups_1d(total, 256, ctx.caps), defines) for start, count in pieces]

    def flops(self) -> int:
        w = self.input(1)
        per_output = 2 * math.prod(w.shape[1:])
        return math.prod(self.out_shape) * per_output

    def workspace_bytes(self) -> int:
        plans = [p for p in (self.plan, self.pointwise, self.folded) if p is not None]
        most = max((p.workspace_bytes() for p in plans), default=0)
        if self.winograd is not None:
            most = max(most, sum(self._winograd_sizes()) + self.winograd.workspace_bytes())
        return most


__all__ = ["Conv"]
