"""The float16 matrix product: float16 operands and result, float32 accumulation.

Two kernels, chosen per device when the dispatches are built:

- ``gemm_coopmat.comp`` where the device has ``VK_KHR_cooperative_matrix`` with a
  float16 x float16 -> float32 subgroup shape and ``shaderFloat16``: tensor cores on NVIDIA,
  matrix cores elsewhere. The matrix shape (LM x LN x LK) comes from the device's list;
  the workgroup tile (``CoopTile``) from ``COOP_TILES``, the first that fits the device's
  shared memory and invocations, with a smaller one when large tiles would leave the device
  short of workgroups;
- ``gemm_f16.comp`` everywhere else (lavapipe, older GPUs): the scalar tiling of
  ``gemm.comp`` over float16 storage.

Both take row-major operands (what MatMul gives: A is ``[..., M, K]``, B ``[..., K, N]``), or
B transposed (``N x K``, as a Linear stores its weight: constant weights are stored that way where
``transposed_b`` says rows of N halves would not load as 16-byte vectors), batches by strides,
and any M, N, K (edges are bounds-checked). Both take the epilogue of a fused
product (``vkpool.fusion``): a float16 bias of N values added to every row and an activation
(``epilogue.glsl``), applied to the float32 sums before the one rounding to float16. The
cooperative-matrix kernel adds the bias to its accumulators from a tile of bias rows in shared
memory and applies the activation to each accumulator element in place (the activation is the
same function at every position, so the matrix's element order does not matter).

Split-K (cooperative matrices only): a product of one matrix whose tiles leave the device short
of workgroups, with a long enough K (a transformer's products at batch 1: 128 rows), splits its
reduction over ``splits`` workgroups per tile, each writing its float32 partial sums to the
workspace; ``gemm_reduce.comp`` adds them, the bias and the activation, and rounds once. The
split is chosen from the problem alone (``HalfMatmulPlan.splits``) so that the workspace is known
before the device is; it runs with ``SPLIT_TILE``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from vkpool.kernels.base import (
    F32, DeviceCaps, Dispatch, Op, OpError, TensorInfo, U32, UnsupportedOp, ceil_div, check_grid, groups_1d,
)
from vkpool.kernels.ops.gemm import BatchDim, MatmulProblem, ptr_at

_MAX_GROUPS = 65535
#: below this many workgroups of the preferred tile, a smaller tile is taken (more workgroups)
_TARGET_GROUPS = 512
#: split-K: the workgroups a split product aims at, and the least K per split (a multiple of every
#: tile's BK). NOTE: H200, driver 580, BERT-base in float16 (bench.fp16_policies,
#: docs/gpu/h200-fp16-8acf115.txt): 1.03 ms with 64 x 64 x 64 tiles aiming at 256
#: workgroups, 1.10 with 64 x 64 x 32 at 512, 1.30 splitting only K >= 512, 1.5-2.1 unsplit:
#: at 128 rows a workgroup's run of K slices, each waiting for memory, is the time
_SPLIT_TARGET_GROUPS = 256
_SPLIT_MIN_K = 256
_HALF = 2  # bytes


@dataclass(frozen=True)
class CoopTile:
    """A workgroup tile of ``gemm_coopmat.comp``: BM x BN outputs over WM x WN subgroups,
    BK-deep slices, PREFETCH slices in flight (1 or 2), SWIZZLE tile-rows per L2 band (0: none)."""

    BM: int
    BN: int
    BK: int
    WM: int
    WN: int
    PREFETCH: int = 1
    SWIZZLE: int = 8

    @property
    def name(self) -> str:
        return f"{self.BM}x{self.BN}x{self.BK}_w{self.WM}x{self.WN}_p{self.PREFETCH}_z{self.SWIZZLE}"

    def b_halves(self, b_trans: bool = False) -> int:
        """The B slice: BK rows of BN halves, or BN rows of BK for a transposed B, rows padded by 8."""
        return self.BN * (self.BK + 8) if b_trans else self.BK * (self.BN + 8)

    def shared_bytes(self, b_trans: bool = False) -> int:
        """Shared memory: an A slice of BM rows of BK halves (padded by 8), and the B slice."""
        return (self.BM * (self.BK + 8) + self.b_halves(b_trans)) * _HALF

    def fits(self, caps: DeviceCaps, shape: tuple[int, int, int], b_trans: bool = False) -> bool:
        lm, ln, lk = shape
        threads = self.WM * self.WN * caps.subgroup_size
        return (
            # a fused bias is staged as LM copies of the tile's BN bias values in the B slice
            lm * (self.BN + 8) <= self.b_halves(b_trans) and
            self.BM % (self.WM * lm) == 0 and self.BN % (self.WN * ln) == 0 and self.BK % lk == 0
            and self.PREFETCH in (1, 2)
            and threads <= caps.max_workgroup_invocations
            and (self.BM * self.BK // 8) % threads == 0 and (self.BK * self.BN // 8) % threads == 0
            and self.shared_bytes(b_trans) <= caps.shared_memory_bytes
            # the edge-tile scratch (one LM x LN float tile per subgroup, split-K's partial sums;
            # halves otherwise) reuses the A slice
            and 2 * self.WM * self.WN * lm * ln <= self.BM * (self.BK + 8)
        )

    @classmethod
    def parse(cls, text: str) -> CoopTile:
        """``CoopTile.name``'s format back into a tile (``bench/gemm_fp16.py --variants``)."""
        dims, warps, prefetch, swizzle = text.split("_")
        bm, bn, bk = (int(v) for v in dims.split("x"))
        wm, wn = (int(v) for v in warps[1:].split("x"))
        return cls(bm, bn, bk, wm, wn, int(prefetch[1:]), int(swizzle[1:]))


#: preferred first. NOTE: H200, driver 580, M = N = K = 8192 (bench/gemm_fp16.py --variants):
#: 128 x 256 with two slices in flight 291 TFLOP/s, 128 x 128 (two workgroups per
#: multiprocessor) 285, 64 x 64 168; 64 x 32 blocks per subgroup, deeper slices (48, 64) and
#: two shared buffers were all slower
COOP_TILES = (
    CoopTile(128, 256, 32, 2, 4, PREFETCH=2),
    CoopTile(128, 128, 32, 2, 2, PREFETCH=2),
    CoopTile(64, 64, 32, 2, 2),
)
#: the tile of split products: 32 rows, 64-deep slices, two in flight. NOTE: H200, driver 580,
#: whole float16 BERT-base in one run (bench.fp16_policies, docs/gpu/h200-fp16-fd87bbc.txt):
#: 0.946 ms against 1.016 with 64 x 64 x 64 and 1.031 with 64 x 64 x 32 tiles (GPT-2 2.217
#: against 2.308 and 2.220). Unsplit, GPT-2's 128 x 50257 x 768 logits run faster in
#: COOP_TILES[-1]'s 64 x 64 x 32 (184 against 279 µs with 64-deep slices, 566 with this tile)
SPLIT_TILE = CoopTile(32, 64, 64, 1, 2, PREFETCH=2)


def coop_shape(caps: DeviceCaps) -> tuple[int, int, int] | None:
    """The cooperative-matrix shape the kernel uses on ``caps``' device, or None where it has
    none fit for it (rows of B and of Y must be whole 16-byte vectors: LN, LK multiples of 8)."""
    if not (caps.cooperative_matrix and caps.float16):
        return None
    usable = [s for s in caps.cooperative_matrix_f16 if s[1] % 8 == 0 and s[2] % 8 == 0 and s[0] % 8 == 0]
    # the largest product per instruction; a 16 x 16 x 16 where listed
    return max(usable, key=lambda s: (s[0] * s[1] * s[2], s == (16, 16, 16)), default=None)


def transposed_b(n: int, k: int) -> bool:
    """Whether a float16 product reads constant weights stored transposed (N x K): where rows of N
    halves are not whole 16-byte vectors and rows of K are (GPT-2's 50257-word logits), so that
    the kernels load B in vectors."""
    return n % 8 != 0 and k % 8 == 0


class HalfMatmulPlan:
    """The float16 product of one ``MatmulProblem`` with row-major A, and B row-major (K x N) or
    transposed (N x K: ``sBk`` 1, ``sBn`` K); a bias (of N values, ``sCn`` 1, ``sCm`` 0, no batch)
    and an activation where the problem has them."""

    def __init__(self, p: MatmulProblem) -> None:
        row_major_b = p.sBn == 1 and p.sBk == p.N
        self.b_trans = not row_major_b and p.sBk == 1 and p.sBn == p.K
        if p.sAk != 1 or p.sAm != p.K or not (row_major_b or self.b_trans):
            raise UnsupportedOp("float16 product: only a row-major A, and a B row-major or transposed")
        if p.has_bias and (p.sCn != 1 or p.sCm != 0 or p.batch or p.alpha != 1.0 or p.beta != 1.0):
            raise UnsupportedOp("float16 product: a bias must be one row of N values, alpha and beta 1")
        if p.batch and p.batch[-1].count > _MAX_GROUPS:
            raise UnsupportedOp(f"matrix product with an inner batch of {p.batch[-1].count} > {_MAX_GROUPS}")
        self.p = p
        self.splits = self.split_k(p)

    @staticmethod
    def split_k(p: MatmulProblem) -> int:
        """The K splits of ``p`` on a device with cooperative matrices (1: none): enough for
        ``_SPLIT_TARGET_GROUPS`` workgroups of ``SPLIT_TILE``, each split at least
        ``_SPLIT_MIN_K`` deep."""
        if p.batch:
            return 1
        tiles = ceil_div(p.M, SPLIT_TILE.BM) * ceil_div(p.N, SPLIT_TILE.BN)
        splits = min(ceil_div(_SPLIT_TARGET_GROUPS, tiles), p.K // _SPLIT_MIN_K, _MAX_GROUPS)
        if splits <= 1:
            return 1
        return ceil_div(p.K, HalfMatmulPlan.chunk(p.K, splits))  # no split left without K

    @staticmethod
    def chunk(k: int, splits: int) -> int:
        """K per split, rounded up to a multiple of 64 (every tile's BK divides it)."""
        return ceil_div(ceil_div(k, splits), 64) * 64

    def kchunk(self, splits: int) -> int:
        """K per split of this product (a forced split may leave its last splits nothing to add:
        they write zeros)."""
        return self.chunk(self.p.K, splits)

    def workspace_bytes(self) -> int:
        return 4 * self.splits * self.p.M * self.p.N if self.splits > 1 else 0

    def choose_tile(self, caps: DeviceCaps) -> CoopTile:
        shape = coop_shape(caps)
        assert shape is not None
        fitting = [t for t in COOP_TILES if t.fits(caps, shape, self.b_trans)]
        if not fitting:
            raise UnsupportedOp(
                f"no cooperative-matrix tile fits {caps.shared_memory_bytes} B of shared memory")
        p = self.p
        for tile in fitting:
            if ceil_div(p.M, tile.BM) * ceil_div(p.N, tile.BN) * p.batch_count >= _TARGET_GROUPS:
                return tile
        return fitting[-1]

    def _reduce(self, ws: Any, c: Any, y: Any, splits: int, caps: DeviceCaps) -> Dispatch:
        """Sums split-K's partial products in ``ws``, adds the bias, applies the activation and
        rounds to float16 into ``y``."""
        p = self.p
        total = p.M * p.N
        return Dispatch(
            "gemm_reduce",
            [ptr_at(ws), ptr_at(c) if p.has_bias else ptr_at(y), ptr_at(y), U32(total), U32(splits), U32(p.N), U32(1), U32(0),
             U32(1), F32(1.0), F32(1.0)],
            groups_1d(total, 256, caps),
            {"HAS_BIAS": int(p.has_bias), "ACT": p.act, "HALF": 1, "NSPLITS": splits},
        )

    def dispatches(
        self, a: Any, b: Any, y: Any, caps: DeviceCaps, tile: CoopTile | None = None, c: Any = None,
        ws: Any = None, splits: int | None = None,
    ) -> list[Dispatch]:
        """The dispatches computing Y on a device with ``caps``; ``c`` is the bias where the
        problem has one, ``ws`` the workspace (``workspace_bytes``); ``tile`` and ``splits``
        override the cooperative-matrix tile and the K splits (benchmarks compare them; a
        forced split needs a workspace of ``4 * splits * M * N`` bytes). Each tensor may be given as
        a :class:`Ptr` into a larger one."""
        p = self.p
        if p.M == 0 or p.N == 0 or p.batch_count == 0:
            return []
        shape = coop_shape(caps)
        if shape is not None and tile is None and not any(t.fits(caps, shape, self.b_trans) for t in COOP_TILES):
            shape = None  # no tile fits the device's shared memory: the scalar kernel
        split = 1
        if shape is not None:
            split = self.splits if splits is None else splits
            if split > 1 and tile is None:
                tile = next((t for t in (SPLIT_TILE, *reversed(COOP_TILES)) if t.fits(caps, shape, self.b_trans)),
                            None)
            tile = tile or self.choose_tile(caps)
            if not tile.fits(caps, shape, self.b_trans):
                raise UnsupportedOp(f"cooperative-matrix tile {tile.name} does not fit this device")
            if split > 1 and (p.batch or ws is None or self.kchunk(split) % tile.BK):
                raise UnsupportedOp(f"float16 product: {split} K splits need one matrix, a workspace and "
                                    f"a tile whose BK divides {self.kchunk(split)}")
            lm, ln, lk = shape
            # NOTE: the shader lays its WM x WN subgroups out by gl_SubgroupID, so it relies on the
            # driver running it with the subgroup size the device reports (32 on NVIDIA, seen on
            # the H200 with driver 580); a driver that picks another size per pipeline would need
            # VK_EXT_subgroup_size_control's required size.
            # vectors along each operand's rows (B's are K long when it is transposed)
            vec_a, vec_b = p.K % 8 == 0, (p.K if self.b_trans else p.N) % 8 == 0
            full = p.M % tile.BM == 0 and p.N % tile.BN == 0 and p.K % tile.BK == 0 and p.K > 0
            shader = "gemm_coopmat"
            defines: dict[str, Any] = {
                "LM": lm, "LN": ln, "LK": lk, "BM": tile.BM, "BN": tile.BN, "BK": tile.BK,
                "WM": tile.WM, "WN": tile.WN, "SG": caps.subgroup_size, "PREFETCH": tile.PREFETCH,
                "SWIZZLE": tile.SWIZZLE, "A_VEC": int(vec_a), "B_VEC": int(vec_b),
                "EDGES": int(not (full and vec_a and vec_b)), "STORE_DIRECT": int(p.N % 8 == 0),
            }
            if split > 1:  # float32 partial sums, whose rows start on 16 bytes when N % 4 == 0
                defines.update({"SPLITK": 1, "KCHUNK": self.kchunk(split), "STORE_DIRECT": int(p.N % 4 == 0)})
            bm, bn = tile.BM, tile.BN
        else:
            small = ceil_div(p.M, 64) * ceil_div(p.N, 64) * p.batch_count < 128
            bm = bn = 32 if small else 64
            shader = "gemm_f16"
            defines = {"BM": bm, "BN": bn, "BK": 16, "TM": bm // 16, "TN": bn // 16}
        if (p.has_bias or p.act) and split == 1:
            # only fused products carry these: the plain product's pipelines stay as they were
            defines.update({"HAS_BIAS": int(p.has_bias), "ACT": p.act})
        if self.b_trans:
            defines["B_TRANS"] = 1
        outer = p.batch[:-1]
        inner = p.batch[-1] if p.batch else BatchDim(1, 0, 0, 0, p.M * p.N)
        groups = (ceil_div(p.N, bn), ceil_div(p.M, bm), inner.count * split)
        check_grid(groups, caps, f"matrix product of {p.M} x {p.N}")
        out: list[Dispatch] = []
        for idx in itertools.product(*(range(d.count) for d in outer)):
            oa = sum(i * d.a for i, d in zip(idx, outer)) * _HALF
            ob = sum(i * d.b for i, d in zip(idx, outer)) * _HALF
            oy = sum(i * d.y for i, d in zip(idx, outer)) * _HALF
            bias = ptr_at(c) if p.has_bias else ptr_at(y, oy)
            args = [ptr_at(a, oa), ptr_at(b, ob), ptr_at(ws) if split > 1 else ptr_at(y, oy), U32(p.M), U32(p.N), U32(p.K),
                    U32(inner.a), U32(inner.b), bias]
            out.append(Dispatch(shader, args, groups, defines))
        if split > 1:
            out.append(self._reduce(ws, c, y, split, caps))
        return out

    def flops(self) -> int:
        return 2 * self.p.M * self.p.N * self.p.K * self.p.batch_count


def fused_product_plan(op: Op, a: int, w: int, bias: int) -> HalfMatmulPlan:
    """The float16 product a node of :mod:`vkpool.fusion` computes itself (vkpool's attribute
    ``product``): input ``a`` (rows of K) @ input ``w`` (constant K x N weights) + input ``bias``
    (N values, optional). The weights are stored transposed where :func:`transposed_b` says so;
    A is read by every column tile, so a model input there is copied to device memory first."""
    ai, wi = op.input(a), op.input(w)
    half = np.dtype(np.float16)
    if ai.dtype != half or wi.dtype != half or len(wi.shape) != 2 or len(ai.shape) < 2:
        raise UnsupportedOp(f"{op.op_type}: a fused product needs float16 A (2-D or more) and 2-D W")
    if w not in op.constants:
        raise UnsupportedOp(f"{op.op_type}: a fused product's weights must be constant")
    (k, n), rows = wi.shape, math.prod(ai.shape[:-1])
    if ai.shape[-1] != k:
        raise OpError(f"{op.op_type}: the fused product's inner dimensions differ ({ai.shape} @ {wi.shape})")
    has_bias = op.has_input(bias)
    if has_bias and op.input(bias) != TensorInfo((n,), half):
        raise OpError(f"{op.op_type}: the fused product's bias must be float16 of shape ({n},)")
    if transposed_b(n, k):
        op.transposed_constants = op.transposed_constants | {w}
        problem = MatmulProblem(M=rows, N=n, K=k, sAm=k, sAk=1, sBk=1, sBn=k, has_bias=has_bias, sCn=1)
    else:
        problem = MatmulProblem(M=rows, N=n, K=k, sAm=k, sAk=1, sBk=n, sBn=1, has_bias=has_bias, sCn=1)
    op.rereads_inputs = True
    return HalfMatmulPlan(problem)


__all__ = ["COOP_TILES", "SPLIT_TILE", "CoopTile", "HalfMatmulPlan", "coop_shape", "fused_product_plan"]
