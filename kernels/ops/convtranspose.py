"""ConvTranspose (1-D to 3-D) on ``shaders/convtranspose.comp``: group, strides, pads,
dilations, output_padding, output_shape and auto_pad, float32.

With 16 or more input channels per group the products run as one tiled GEMM per image and
group (``gemm.comp``: every output channel and kernel tap against every input position, into
the workspace) and ``convtranspose.comp`` only gathers them onto the outputs (col2im, one read
per tap); with fewer, or where those products would take more than ``COLS_MAX_BYTES``, it
gathers straight from the inputs. NOTE: H200, a U-Net's 2x2 stride-2 up-convolutions (256 to
128 channels at 16x16, ...): 80-98 µs each gathering from the inputs."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, UnsupportedOp, check_serial, groups_1d,
)
from vkpool.kernels.ops.attrs import str_attr
from vkpool.kernels.ops.gemm import BatchDim, MatmulPlan, MatmulProblem

#: input channels per group from which the products go through the tiled GEMM
GEMM_MIN_CHANNELS = 16
#: the most workspace the GEMM's products may take; beyond it, the direct gather
COLS_MAX_BYTES = 256 << 20


class ConvTranspose(Op):
    op_type = "ConvTranspose"
    rereads_inputs = True

    def check(self) -> None:
        x, w = self.input(0), self.input(1)
        if x.dtype != np.float32 or w.dtype != np.float32:
            raise UnsupportedOp(f"ConvTranspose: element type {x.dtype} has no kernel")
        nd = len(x.shape) - 2
        if not 1 <= nd <= 3 or len(w.shape) != nd + 2:
            raise UnsupportedOp(f"ConvTranspose: {nd}-D spatial input (1 to 3 supported)")
        self.group = int(self.attr("group", 1))
        cin = x.shape[1]
        if w.shape[0] != cin or cin % self.group:
            raise OpError(f"ConvTranspose: weight {w.shape} does not match {cin} input channels, group {self.group}")
        self.cout = w.shape[1] * self.group
        if self.has_input(2) and self.input(2).size != self.cout:
            raise OpError(f"ConvTranspose: bias has {self.input(2).size} values for {self.cout} channels")
        ks = list(self.attr("kernel_shape", w.shape[2:]))
        if tuple(ks) != tuple(w.shape[2:]):
            raise OpError(f"ConvTranspose: kernel_shape {ks} differs from the weight's {w.shape[2:]}")
        strides = list(self.attr("strides", [1] * nd))
        dil = list(self.attr("dilations", [1] * nd))
        opad = list(self.attr("output_padding", [0] * nd))
        auto_pad = str_attr(self, "auto_pad", "NOTSET")
        pads = self.attr("pads")
        out_shape = self.attr("output_shape")
        ins = list(x.shape[2:])
        full = [(k - 1) * d + 1 for k, d in zip(ks, dil)]
        if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = list(out_shape) if out_shape is not None else [i * s for i, s in zip(ins, strides)]
            total = [s * (i - 1) + op + f - o for s, i, op, f, o in zip(strides, ins, opad, full, out)]
            if auto_pad == "SAME_UPPER":
                begin = [t // 2 for t in total]
            else:
                begin = [t - t // 2 for t in total]
        else:
            p = list(pads) if pads is not None else [0] * (2 * nd)
            begin = p[:nd]
            if out_shape is not None:
                out = list(out_shape)[-nd:]
            else:
                out = [s * (i - 1) + op + f - p[d] - p[nd + d]
                       for d, (s, i, op, f) in enumerate(zip(strides, ins, opad, full))]
        if min(out) <= 0:
            raise OpError(f"ConvTranspose: output spatial shape {out} is empty")
        self.ks, self.strides, self.dil, self.begin, self.out_sp = ks, strides, dil, begin, out
        self.out_shape = (x.shape[0], self.cout, *out)
        self.plan: MatmulPlan | None = None
        n, cig, cog, ksize, isize = x.shape[0], cin // self.group, w.shape[1], math.prod(ks), math.prod(ins)
        self.cols_bytes = 4 * n * self.cout * ksize * isize
        if cig >= GEMM_MIN_CHANNELS and self.cols_bytes <= COLS_MAX_BYTES and isize > 0:
            m, g = cog * ksize, self.group
            per_group = BatchDim(g, cig * m, cig * isize, 0, m * isize)
            per_image = BatchDim(n, 0, cin * isize, 0, g * m * isize)
            batch = [per_image] if g == 1 else [per_group] if n == 1 else [per_image, per_group]
            if batch[-1].count <= 65535:
                self.plan = MatmulPlan(MatmulProblem(M=m, N=isize, K=cig, sAm=1, sAk=m, sBk=isize, sBn=1,
                                                     batch=batch), force_gemm=True)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, np.float32)]

    def workspace_bytes(self) -> int:
        return self.cols_bytes + self.plan.workspace_bytes() if self.plan is not None else 0

    def flops(self) -> int:
        # every input element meets every kernel tap of every output channel of its group
        return 2 * self.input(0).size * self.input(1).shape[1] * math.prod(self.ks)

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, w = inputs[0], inputs[1]
        b = inputs[2] if len(inputs) > 2 else None
        assert x is not None and w is not None
        n, cin = x.shape[:2]
        nd = x.ndim - 2
        g, cig, cog = self.group, cin // self.group, w.shape[1]
        # scatter each input position into a padded canvas, then crop by the begin pads
        canvas_sp = [max(o + p, s * (i - 1) + (k - 1) * d + 1)
                     for o, p, s, i, k, d in zip(self.out_sp, self.begin, self.strides, x.shape[2:], self.ks, self.dil)]
        canvas = np.zeros((n, self.cout, *canvas_sp), np.float64)
        for kk in np.ndindex(*self.ks):
            sl = tuple(slice(k * d, k * d + s * (i - 1) + 1, s)
                       for k, d, s, i in zip(kk, self.dil, self.strides, x.shape[2:]))
            for gi in range(g):
                xs = x[:, gi * cig:(gi + 1) * cig].astype(np.float64)
                ws = w[(slice(gi * cig, (gi + 1) * cig), slice(None), *kk)].astype(np.float64)  # [cig, cog]
                canvas[(slice(None), slice(gi * cog, (gi + 1) * cog), *sl)] += np.einsum("nc...,co->no...", xs, ws)
        crop = tuple(slice(p, p + o) for p, o in zip(self.begin, self.out_sp))
        y = canvas[(slice(None), slice(None), *crop)]
        if b is not None:
            y = y + b.reshape((1, -1) + (1,) * nd)
        return [np.ascontiguousarray(y, dtype=np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        nd = len(x.shape) - 2
        pad3 = lambda v, fill: [fill] * (3 - nd) + list(v)  # noqa: E731  (leading dims of extent 1)
        ins, outs = pad3(x.shape[2:], 1), pad3(self.out_sp, 1)
        ks, ss, ps, ds = pad3(self.ks, 1), pad3(self.strides, 1), pad3(self.begin, 0), pad3(self.dil, 1)
        defines: dict[str, object] = {"N": x.shape[0], "CIN": x.shape[1], "COUT": self.cout, "G": self.group,
                                      "HAS_BIAS": int(self.has_input(2)), "COLS": int(self.plan is not None)}
        for d in range(3):
            defines.update({f"IN{d}": ins[d], f"OUT{d}": outs[d], f"K{d}": ks[d], f"S{d}": ss[d],
                            f"P{d}": ps[d], f"D{d}": ds[d]})
        n = math.prod(self.out_shape)
        xp = Ptr(ctx.inputs[0])
        products: list[Dispatch] = []
        cols = xp
        if self.plan is not None:
            cols = Ptr(ctx.workspace)
            products = self.plan.dispatches(ctx.inputs[1], ctx.inputs[0], None, cols,
                                            Ptr(ctx.workspace, self.cols_bytes), caps=ctx.caps)
            check_serial(math.prod(self.ks) * (1 + 3 + 1), ctx.caps,
                         f"ConvTranspose over {math.prod(self.ks)} kernel positions")
        else:
            # every kernel position, and every input channel of the group at each
            check_serial(math.prod(self.ks) * (1 + 3 + x.shape[1] // self.group), ctx.caps,
                         f"ConvTranspose over {x.shape[1] // self.group} channels and {math.prod(self.ks)} kernel positions")
        args = [xp, Ptr(ctx.inputs[1]), Ptr(ctx.inputs[2]) if self.has_input(2) else xp, Ptr(ctx.outputs[0]), cols]
        return [*products, Dispatch("convtranspose", args, groups_1d(n, 64, ctx.caps), defines)]


__all__ = ["ConvTranspose"]
