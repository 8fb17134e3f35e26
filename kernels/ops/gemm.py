"""Gemm, and the matrix-product planner that Gemm, MatMul and Conv share.

A product is described by element strides (``MatmulProblem``), so transposed operands,
broadcast batches and a broadcast bias need no copy. The planner picks a kernel per shape
once, at load time:

- one output row (M == 1, no batch) with B's columns contiguous: ``gemv.comp``, B read once
  with vec4 loads, split over K across workgroups when there are too few column strips to
  fill the device, the partial sums finished by ``gemm_reduce.comp``;
- one output row with B's rows contiguous along K (Gemm transB=1): ``gemv_t.comp``;
- anything else: the tiled shared-memory GEMM ``gemm.comp`` (64x64 tiles with 4x4 outputs
  per invocation, its shared-memory stages read as vec4, 32x32 tiles with 2x2 when 64x64 tiles
  would leave the device idle, and
  split-K over workgroups, finished by ``gemm_reduce.comp``, when even those are too few).
  On a device whose ``DeviceCaps.gemm_variant`` is "register" (a CPU-like device:
  :mod:`vkpool.kernel_variants`) the same shader runs its register tiling instead
  (:meth:`MatmulPlan.tile_for`), its reduction split only where its tiles are too few
  workgroups for a CPU's cores (:meth:`MatmulPlan.register_splits`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, LOOP_SLACK, DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp,
    ceil_div, check_grid, groups_1d,
)
from vkpool.kernels.broadcast import broadcast_strides
from vkpool.kernels.ops.unary import erf64

_F32 = np.dtype(np.float32)
_MAX_GROUPS = 65535
#: workgroups a GEMV should spread over so that every multiprocessor of a large GPU streams
_GEMV_TARGET_GROUPS = 1024
_GEMV_MIN_ROWS_PER_SPLIT = 128
#: gemv_t: output rows per workgroup and invocations sharing one row. NOTE: H200, driver 580,
#: bench/gemv_probe.py --variants --softmax: one row of 256 invocations per workgroup streamed
#: 1 GiB in 235.9 µs (4.55 TB/s) and 16 chained 64 MiB products in 325.0 µs, against 243.3 and
#: 327.2 µs for 8 rows of 32; 2, 4 and 8 rows of 64 or 128 were slower still
_GEMV_T_ROWS = 1
_GEMV_T_THREADS_PER_ROW = 256
#: workgroups below which a tiled product splits its reduction, and the least K per split
_GEMM_TARGET_GROUPS = 256
_GEMM_MIN_K_PER_SPLIT = 128
#: workgroups below which the register tiling (CPU-like devices) splits its reduction: a CPU
#: runs a few workgroups per core at once, and its cores are far fewer than a GPU's
_REGISTER_TARGET_GROUPS = 16


@dataclass(frozen=True)
class BatchDim:
    """One batch dimension of a product: its extent and the element stride of each operand."""

    count: int
    a: int
    b: int
    c: int
    y: int


@dataclass
class MatmulProblem:
    """``Y[batch] = alpha * A[batch] @ B[batch] + beta * C[batch]`` over float32, by strides.

    A is M x K (element (m, k) at ``m * sAm + k * sAk``), B is K x N, C broadcasts to M x N
    by its strides (0 on a broadcast axis), Y is contiguous M x N per batch. ``batch`` lists
    batch dimensions outermost first; the innermost runs as the workgroup z axis, the others
    as separate dispatches at byte offsets.
    """

    M: int
    N: int
    K: int
    sAm: int
    sAk: int
    sBk: int
    sBn: int
    has_bias: bool = False
    sCm: int = 0
    sCn: int = 0
    alpha: float = 1.0
    beta: float = 1.0
    batch: list[BatchDim] = field(default_factory=list)
    #: rows of C's pattern when a split-K reduction indexes it flat: M, or all output channels
    #: of a grouped convolution (whose batch runs over groups)
    bias_rows: int | None = None
    #: the activation fused into the epilogue, one of ``ACTIVATIONS``' codes (see ``fused_activation``)
    act: int = 0

    @property
    def batch_count(self) -> int:
        return int(np.prod([d.count for d in self.batch], dtype=np.int64)) if self.batch else 1


#: the tiles of gemm.comp: BM x BN outputs per workgroup, BK of K per shared-memory stage, TM x TN
#: outputs per invocation, VEC4: the stages read as vec4 (outputs per invocation in fours). NOTE:
#: H200, driver 580, bench/gpu_conv_tiles.sh (docs/gpu/h200-conv-tiles-vec4.md), GPU time with
#: vec4 reads against scalar ones: ResNet-50 at batch 16 7.40 ms against 8.17, at batch 1 1.040
#: against 1.087, U-Net 1.447 against 1.627, BERT-base 2.000 against 2.172, GPT-2 2.808 against
#: 3.044; MobileNetV2 0.519 both (its products take 32 x 32 tiles); the same outputs, bit for bit
TILES: dict[str, dict[str, int]] = {
    "64x64": {"BM": 64, "BN": 64, "BK": 16, "TM": 4, "TN": 4, "VEC4": 1},
    "32x32": {"BM": 32, "BN": 32, "BK": 16, "TM": 2, "TN": 2},
    "32x256": {"BM": 32, "BN": 256, "BK": 16, "TM": 4, "TN": 8, "VEC4": 1},
    "128x128": {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8, "VEC4": 1},
}


def choose_tile(p: MatmulProblem, workgroups: Any) -> str:
    """The name of the tile a product takes; ``workgroups(tile)`` gives a tile's workgroups
    with the reduction split over K as the plan would split it."""
    # NOTE: few large tiles leave most multiprocessors of a big GPU idle. 32x32 tiles give
    # four times the workgroups, but each does a quarter of the work per shared-memory load:
    # 64x64 tiles are taken wherever they fill half the target with the reduction split over
    # K. H200, bench/gemm_tiles.py (docs/gpu/h200-gemm-tiles-*.md), BERT-base's products at
    # 128 tokens: 128x768x3072 in 51 µs against 115, 128x3072x768 in 81 against 114;
    # ResNet-50 1.48 ms against 2.05. The 1x1 convolutions of MobileNetV2's last stages
    # (7x7 outputs, K up to 960) keep 32x32. Two shapes gain from other tiles: 32 rows or
    # fewer over 8,192 columns or more (a U-Net's full-resolution 3x3 convolutions: 356 µs
    # against 434 with 32x256 tiles of 4x8 outputs) and 128 rows or more with K of 2,048 or
    # more over at least 32 tiles of 128x128 (its deep convolutions: 160 µs against 218, 139
    # against 198 with 8x8 outputs per invocation); BERT's 128 x 768 x 3072 and GPT-2's
    # 128 x 50257 x 768 are slower in those (60 against 51, 1026 against 947).
    if p.M <= 32 and p.N >= 8192:
        return "32x256"
    if p.M >= 128 and p.K >= 2048 and ceil_div(p.M, 128) * ceil_div(p.N, 128) * p.batch_count >= 32:
        return "128x128"
    groups, _ = workgroups(TILES["64x64"])
    return "64x64" if groups * 2 >= _GEMM_TARGET_GROUPS else "32x32"


def ptr_at(t: Any, offset: int = 0) -> Ptr:
    """A pointer to ``t`` (a tensor, or a :class:`Ptr` into one) ``offset`` bytes further."""
    return Ptr(t.tensor, t.byte_offset + offset) if isinstance(t, Ptr) else Ptr(t, offset)


class MatmulPlan:
    """The kernels chosen for one ``MatmulProblem``; built once, at load time."""

    def __init__(self, p: MatmulProblem, *, force_gemm: bool = False) -> None:
        self.p = p
        if p.batch and p.batch[-1].count > _MAX_GROUPS:
            raise UnsupportedOp(f"matrix product with an inner batch of {p.batch[-1].count} > {_MAX_GROUPS}")
        self.kind = "gemm"
        self.splits = 1
        if p.M == 1 and p.batch_count == 1 and p.K > 0 and not force_gemm:
            if p.sBk == 1:
                self.kind = "gemv_t"
            elif p.sBn == 1:
                self.kind = "gemv"
                self._plan_gemv()
        if self.kind == "gemm":
            self._plan_gemm()

    # -- choices -------------------------------------------------------------------------
    def _plan_gemv(self) -> None:
        p = self.p
        self.vec = 4 if p.N % 4 == 0 and p.sBk % 4 == 0 else 1
        self.txg, self.tyg = 64, 4
        col_groups = ceil_div(p.N, self.vec * self.txg)
        splits = max(1, min(ceil_div(_GEMV_TARGET_GROUPS, col_groups), p.K // _GEMV_MIN_ROWS_PER_SPLIT))
        self.kchunk = ceil_div(p.K, splits)
        self.splits = ceil_div(p.K, self.kchunk)
        self.col_groups = col_groups

    def _plan_gemm(self) -> None:
        self.tile = dict(TILES[choose_tile(self.p, self._workgroups)])
        _, splits = self._workgroups(self.tile)
        if splits > 1:
            # a long reduction over too few tiles (deep layers of a batch-1 CNN: 256 channels of
            # 7x7) is split over workgroups, the partial tiles summed by a second pass
            bk = self.tile["BK"]
            self.kchunk = ceil_div(ceil_div(self.p.K, splits), bk) * bk
            self.splits = ceil_div(self.p.K, self.kchunk)

    def _workgroups(self, tile: dict[str, int]) -> tuple[int, int]:
        """The workgroups of a product in ``tile`` tiles, and the K splits that give them."""
        p = self.p
        tiles = ceil_div(p.M, tile["BM"]) * ceil_div(p.N, tile["BN"]) * p.batch_count
        splits = min(ceil_div(_GEMM_TARGET_GROUPS, tiles), p.K // _GEMM_MIN_K_PER_SPLIT)
        inner = p.batch[-1].count if p.batch else 1
        if len(p.batch) > 1 or splits <= 1 or inner * splits > _MAX_GROUPS:
            splits = 1
        return tiles * splits, splits

    def workspace_bytes(self) -> int:
        p = self.p
        rows = 1 if self.kind == "gemv" else p.M * p.batch_count
        return self.splits * rows * p.N * 4 if self.splits > 1 else 0

    def _reduce(self, ws: Any, c: Any, y: Any, caps: DeviceCaps | None, splits: int,
                fold: int = 0, residual: Any = None) -> Dispatch:
        """Sums the split partial products in ``ws`` into ``y``, applying alpha, the bias and
        ``residual`` (a tensor of y's layout, or None); ``fold``: the outputs per image of a
        convolution whose images are the product's columns."""
        p = self.p
        rows = 1 if self.kind == "gemv" else p.M * p.batch_count
        total = rows * p.N
        bias_rows = 1 if self.kind == "gemv" else (p.bias_rows or p.M)
        return Dispatch(
            "gemm_reduce",
            [ptr_at(ws), ptr_at(c), ptr_at(y), U32(total), U32(splits), U32(p.N), U32(bias_rows),
             U32(p.sCm), U32(p.sCn), F32(p.alpha), F32(p.beta),
             *([ptr_at(residual)] if residual is not None else [])],
            groups_1d(total, 256, caps),
            {"HAS_BIAS": int(p.has_bias), "ACT": p.act, **({"FOLD": fold} if fold else {}),
             **({"HAS_RES": 1} if residual is not None else {})},
        )

    def tile_for(self, caps: DeviceCaps | None, inner: int = 1) -> dict[str, int]:
        """The defines of gemm.comp's tiling on a device with ``caps`` for ``inner`` products per
        dispatch: the shared-memory tile chosen at load, or on a device whose ``gemm_variant``
        is "register" its register tile (``BM`` = TM rows, ``BN`` = TN x WG columns per
        workgroup of WG invocations, ``SPLITS``/``KCHUNK`` as :meth:`register_splits` gives
        them). The register tiling loops up to twice per k: past the device's loop limit
        (lavapipe ends longer loops early, silently) or with more workgroups than a grid holds,
        the shared tile runs instead. A shared tile larger than the device's shared memory
        (:meth:`shared_bytes`) gives way to the largest of the 64 x 64 and 32 x 32 ones that fits."""
        p = self.p
        tile = self.tile
        if caps is not None and self.shared_bytes(tile) > caps.shared_memory_bytes:
            # a tile larger than the device's shared memory (the 32 x 256 one, on a device of
            # 16 KiB): the largest of the others that fits
            room = caps.shared_memory_bytes
            fits = [TILES[n] for n in ("64x64", "32x32") if self.shared_bytes(TILES[n]) <= room]
            if not fits:
                raise UnsupportedOp(f"no tile of the matrix product fits {room} bytes of shared memory")
            tile = fits[0]
        shared = {**tile, "SPLITS": self.splits, **({"KCHUNK": self.kchunk} if self.splits > 1 else {})}
        if caps is None or caps.gemm_variant != "register":
            return shared
        tm, tn, wg = caps.register_tile
        splits, kchunk = self.register_splits(caps, inner)
        steps = kchunk if splits > 1 else p.K
        # every k is a step of the inner loop, and at most every k one of the outer
        if caps.max_loop_iterations and 2 * steps + LOOP_SLACK > caps.max_loop_iterations:
            return shared
        groups = (ceil_div(p.N, tn * wg), ceil_div(p.M, tm), inner * splits)
        if any(g > m for g, m in zip(groups, caps.max_workgroup_count)):
            return shared
        return {"REGISTER_TILE": 1, "BM": tm, "BN": tn * wg, "TM": tm, "TN": tn, "WG": wg, "SPLITS": splits,
                **({"KCHUNK": kchunk} if splits > 1 else {})}

    def shared_bytes(self, tile: dict[str, int]) -> int:
        """The shared memory ``gemm.comp`` declares for ``tile`` on this product: a BK-deep stage of
        each operand, the rows of one read along K padded by 32 / BK floats (see the shader)."""
        pad = 32 // tile["BK"] if tile["BK"] < 32 else 1
        rows = [tile["BM"] + (pad if self.p.sAk == 1 else 0), tile["BN"] + (0 if self.p.sBn == 1 else pad)]
        if tile.get("VEC4"):  # rows of vec4
            rows = [ceil_div(r, 4) * 4 for r in rows]
        return 4 * tile["BK"] * sum(rows)

    def register_splits(self, caps: DeviceCaps, inner: int = 1) -> tuple[int, int]:
        """(K splits, K per split) of the register tiling: a split costs a pass over a workspace
        of partial products, worth it on a CPU only where the tiles alone are too few workgroups
        to keep its cores busy; never more splits than the plan's workspace holds."""
        p = self.p
        tm, tn, wg = caps.register_tile
        tiles = ceil_div(p.N, tn * wg) * ceil_div(p.M, tm) * inner
        splits = min(self.splits, ceil_div(_REGISTER_TARGET_GROUPS, tiles),
                     max(1, p.K // _GEMM_MIN_K_PER_SPLIT))
        if splits <= 1:
            return 1, p.K
        kchunk = ceil_div(p.K, splits)
        return ceil_div(p.K, kchunk), kchunk

    # -- dispatches ----------------------------------------------------------------------
    def dispatches(
        self, a: Any, b: Any, c: Any, y: Any, ws: Any, extra_defines: dict[str, Any] | None = None,
        caps: DeviceCaps | None = None, residual: Any = None,
    ) -> list[Dispatch]:
        """Dispatches computing Y; ``c`` may be None when the problem has no bias. ``caps``: the
        device's, where kernels may use what it offers beyond the baseline. ``residual``: a
        tensor of Y's layout added to each output before the activation (a product planned as a
        GEMM only)."""
        p = self.p
        c_or_y = c if p.has_bias else y  # an unused pointer still needs a valid address
        if residual is not None and self.kind != "gemm":
            raise UnsupportedOp(f"a residual added to a {self.kind} product")
        if self.kind == "gemv_t":
            return [self._gemv_t(a, b, c_or_y, y, caps)]
        if self.kind == "gemv":
            return self._gemv(a, b, c_or_y, y, ws, caps)
        out: list[Dispatch] = []
        outer = p.batch[:-1]
        inner = p.batch[-1] if p.batch else BatchDim(1, 0, 0, 0, p.M * p.N)
        tile = self.tile_for(caps, inner.count)
        splits = tile["SPLITS"]
        split = splits > 1
        here = None if split else residual  # a split product's reduction adds it
        defines = {
            **tile, "A_KCONTIG": int(p.sAk == 1), "B_NCONTIG": int(p.sBn == 1),
            "HAS_BIAS": int(p.has_bias), "ACT": p.act, **(extra_defines or {}),
            **({"HAS_RES": 1} if here is not None else {}),
        }
        if tile.get("REGISTER_TILE"):  # a one-subgroup workgroup shares its loads of A by shuffles
            defines["A_SHUFFLE"] = int(caps is not None and caps.subgroup_shuffle
                                       and caps.subgroup_size == tile["WG"])
        groups = (ceil_div(p.N, tile["BN"]), ceil_div(p.M, tile["BM"]), inner.count * splits)
        check_grid(groups, caps, f"matrix product of {p.M} x {p.N}")
        for idx in itertools.product(*(range(d.count) for d in outer)):
            oa = sum(i * d.a for i, d in zip(idx, outer)) * 4
            ob = sum(i * d.b for i, d in zip(idx, outer)) * 4
            oc = sum(i * d.c for i, d in zip(idx, outer)) * 4
            oy = sum(i * d.y for i, d in zip(idx, outer)) * 4
            args = [
                ptr_at(a, oa), ptr_at(b, ob), ptr_at(c_or_y, oc if p.has_bias else 0),
                ptr_at(ws) if split else ptr_at(y, oy),
                U32(p.M), U32(p.N), U32(p.K),
                U32(p.sAm), U32(p.sAk), U32(p.sBk), U32(p.sBn), U32(p.sCm), U32(p.sCn),
                U32(inner.a), U32(inner.b), U32(inner.c), F32(p.alpha), F32(p.beta),
            ]
            if here is not None:
                args.append(ptr_at(here, oy))
            out.append(Dispatch("gemm", args, groups, defines))
        if split:  # only with a single batch dimension: one product
            out.append(self._reduce(ws, c_or_y, y, caps, splits, int((extra_defines or {}).get("FOLD", 0)),
                                    residual))
        return out

    def _gemv(self, a: Any, b: Any, c: Any, y: Any, ws: Any, caps: DeviceCaps | None) -> list[Dispatch]:
        p = self.p
        split = self.splits > 1
        defines = {"VEC": self.vec, "TXG": self.txg, "TYG": self.tyg, "SPLIT": int(split),
                   "HAS_BIAS": int(p.has_bias), "ACT": p.act}
        first = Dispatch(
            "gemv",
            [ptr_at(a), ptr_at(b), ptr_at(c), ptr_at(ws if split else y), U32(p.N), U32(p.K), U32(p.sAk), U32(p.sBk),
             U32(self.kchunk), U32(p.sCn), F32(p.alpha), F32(p.beta)],
            (self.col_groups, self.splits, 1), defines,
        )
        if not split:
            return [first]
        return [first, self._reduce(ws, c, y, caps, self.splits)]

    def _gemv_t(self, a: Any, b: Any, c: Any, y: Any, caps: DeviceCaps | None) -> Dispatch:
        p = self.p
        vec = 4 if p.K % 4 == 0 and p.sBn % 4 == 0 and p.sAk == 1 else 1
        if vec == 1 and p.sAk != 1:
            raise UnsupportedOp("GEMV with a strided vector operand")  # never built by the ops here
        rows = _GEMV_T_ROWS
        # a CPU-like device: one subgroup per row (its barrier then switches between no invocations),
        # where each invocation's share of the row stays within the device's loop limit
        tpr = _GEMV_T_THREADS_PER_ROW
        if caps is not None and caps.cpu_like and caps.subgroup_arithmetic:
            limit = caps.max_loop_iterations
            if not limit or ceil_div(p.K, vec * caps.subgroup_size) + LOOP_SLACK <= limit:
                tpr = caps.subgroup_size
        return Dispatch(
            "gemv_t",
            [ptr_at(a), ptr_at(b), ptr_at(c), ptr_at(y), U32(p.N), U32(p.K), U32(p.sBn), U32(p.sCn),
             F32(p.alpha), F32(p.beta)],
            groups_1d(p.N, rows, caps), {"VEC": vec, "TPR": tpr, "ROWS": rows, "HAS_BIAS": int(p.has_bias),
             "ACT": p.act, "SUBGROUP_REDUCE": int(rows == 1 and caps is not None and caps.subgroup_arithmetic)},
        )

    def flops(self) -> int:
        p = self.p
        return 2 * p.M * p.N * p.K * p.batch_count


#: activations a product applies in its epilogue (``shaders/epilogue.glsl``'s ``ACT``): the
#: load-time rewrites of ``vkpool.fusion`` set them as the internal node attribute ``activation``
ACTIVATIONS = {"Relu": 1, "Gelu": 2, "GeluTanh": 3}


def fused_activation(op: Op) -> int:
    """The code of the activation ``vkpool.fusion`` folded into ``op`` (0: none); the attribute
    ``activation`` is vkpool's own, never present in a file."""
    activation = op.attr("activation", None)
    if activation is None:
        return 0
    if activation not in ACTIVATIONS:
        raise OpError(f"{op.op_type}: unknown fused activation {activation!r}")
    return ACTIVATIONS[activation]


def apply_activation(code: int, y: np.ndarray) -> np.ndarray:
    """The host reference of ``epilogue()`` in ``shaders/epilogue.glsl``."""
    if code == 1:
        return np.maximum(y, 0)
    if code == 2:
        return 0.5 * y * (1 + erf64(y / np.sqrt(2)))
    if code == 3:
        return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
    return y


class Gemm(Op):
    """``Y = alpha * A' @ B' + beta * C`` with A' = A or A^T, B' = B or B^T, C broadcast to M x N.

    float16 (every operand): the float16 product (``gemm_f16.py``) of A (not transposed) and B
    (transposed only when constant: stored transposed at load), with C one row of N values added
    in its epilogue, alpha and beta 1: a ``Linear`` layer as exporters spell it."""

    op_type = "Gemm"
    rereads_inputs = True

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        types = {info.dtype for info in (a, b, *([self.input(2)] if self.has_input(2) else []))}
        if types == {np.dtype(np.float16)}:
            self._check_half()
            return
        for info in (a, b, *( [self.input(2)] if self.has_input(2) else [])):
            if info.dtype != _F32:
                raise UnsupportedOp(f"Gemm: only float32, or float16 for every operand, is supported, got {info.dtype}")
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise OpError(f"Gemm: A and B must be 2-D, got {a.shape} and {b.shape}")
        ta, tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        M, K = (a.shape[1], a.shape[0]) if ta else a.shape
        Kb, N = (b.shape[1], b.shape[0]) if tb else b.shape
        if K != Kb:
            raise OpError(f"Gemm: inner dimensions differ ({a.shape}, transA={ta}; {b.shape}, transB={tb})")
        self.M, self.N, self.K = M, N, K
        alpha, beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        has_bias = self.has_input(2) and beta != 0.0
        sCm = sCn = 0
        if self.has_input(2):
            cs = self.input(2).shape
            if len(cs) > 2 or any(d not in (1, t) for d, t in zip(cs[::-1], (N, M))):
                raise OpError(f"Gemm: C of shape {cs} does not broadcast to {(M, N)}")
            if self.opset < 7 and int(self.attr("broadcast", 0)) == 0 and tuple(cs) != (M, N):
                raise OpError(f"Gemm: C must be {(M, N)} without broadcast (opset {self.opset}), got {cs}")
            sCm, sCn = broadcast_strides(cs, (M, N))
        if M == 1 and not tb and 1 in self.constants:
            # a GEMV by constant weights reads them stored transposed, as if transB were set:
            # each output's weights are then contiguous, streamed by gemv_t.comp in one pass
            # (NOTE: H200, driver 580: 1 GiB of weights at 4.3 TB/s this way, 1.6 TB/s K x N)
            self.transposed_constants = frozenset({1})
            tb = 1
        self.plan = MatmulPlan(MatmulProblem(
            M=M, N=N, K=K,
            sAm=1 if ta else K, sAk=M if ta else 1,
            sBk=1 if tb else N, sBn=K if tb else 1,
            has_bias=has_bias, sCm=sCm, sCn=sCn, alpha=alpha, beta=beta, act=fused_activation(self),
        ))

    def _check_half(self) -> None:
        from vkpool.kernels.ops.gemm_f16 import HalfMatmulPlan, transposed_b  # gemm_f16 builds on this module

        a, b = self.input(0), self.input(1)
        ta, tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        alpha, beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise OpError(f"Gemm: A and B must be 2-D, got {a.shape} and {b.shape}")
        if ta or (tb and 1 not in self.constants) or alpha != 1.0 or (self.has_input(2) and beta != 1.0):
            raise UnsupportedOp("Gemm: float16 needs transA 0, transB 0 (or a constant B), alpha 1 and beta 1")
        (M, K), (Kb, N) = a.shape, (b.shape[::-1] if tb else b.shape)
        if K != Kb:
            raise OpError(f"Gemm: inner dimensions differ ({a.shape}; {b.shape}, transB={tb})")
        if self.has_input(2) and self.input(2).shape not in ((N,), (1, N)):
            raise UnsupportedOp(f"Gemm: float16 needs C of shape ({N},) or (1, {N}), got {self.input(2).shape}")
        # a constant B is read N x K where transposed_b says so, K x N otherwise: stored transposed
        # where the node's layout is the other
        read_t = 1 in self.constants and transposed_b(N, K)
        if tb != read_t:
            self.transposed_constants = frozenset({1})
        self.M, self.N, self.K = M, N, K
        self.plan = HalfMatmulPlan(MatmulProblem(M=M, N=N, K=K, sAm=K, sAk=1, sBk=1 if read_t else N,
                                                 sBn=K if read_t else 1, has_bias=self.has_input(2), sCn=1,
                                                 act=fused_activation(self)))

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((self.M, self.N), self.input(0).dtype)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        a, b = a.astype(np.float32, copy=False), b.astype(np.float32, copy=False)  # float16: one rounding
        if int(self.attr("transA", 0)):
            a = a.T
        if int(self.attr("transB", 0)):
            b = b.T
        y = np.float32(self.attr("alpha", 1.0)) * (a @ b)
        c = inputs[2] if len(inputs) > 2 else None
        if c is not None:
            y = y + np.float32(self.attr("beta", 1.0)) * c
        y = apply_activation(self.plan.p.act, y)
        return [np.asarray(y, dtype=self.input(0).dtype).reshape(self.M, self.N)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        c = ctx.inputs[2] if len(ctx.inputs) > 2 else None
        if not isinstance(self.plan, MatmulPlan):
            return self.plan.dispatches(ctx.inputs[0], ctx.inputs[1], ctx.outputs[0], ctx.caps, c=c,
                                        ws=ctx.workspace)
        return self.plan.dispatches(ctx.inputs[0], ctx.inputs[1], c, ctx.outputs[0], ctx.workspace, caps=ctx.caps)

    def flops(self) -> int:
        return self.plan.flops() + (self.M * self.N if self.plan.p.has_bias else 0)

    def workspace_bytes(self) -> int:
        return self.plan.workspace_bytes()


__all__ = ["Gemm", "MatmulPlan", "TILES", "choose_tile", "MatmulProblem", "BatchDim", "ACTIVATIONS", "fused_activation", "apply_activation"]
