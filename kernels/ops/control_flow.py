"""If, Loop, Scan and NonMaxSuppression: ops that run where a model is cut, never as a kernel.

An If whose condition is known is replaced by its branch (at load, or once the condition is read
back at a cut: :mod:`vkpool.cut`). Loop, Scan and NonMaxSuppression run at a cut on the values
read back there (:mod:`vkpool.control_flow`): a Loop's or a Scan's body is compiled as a part of
its own, once per set of input shapes, and replayed on the device once per iteration; the
suppression itself is computed on the host (:func:`non_max_suppression`). The classes here tell
the registry that vkpool runs these ops; a kernel is never built from them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, TensorInfo, UnsupportedOp


class _AtCut(Op):
    def _refuse(self) -> UnsupportedOp:
        return UnsupportedOp(f"{self.op_type} runs where vkpool cuts the model (vkpool.dynamic), not as a kernel")

    def output_infos(self) -> list[TensorInfo]:
        raise self._refuse()

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        raise self._refuse()

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        raise self._refuse()


class If(_AtCut):
    op_type = "If"
    #: the condition chooses the branch inlined in its place
    constant_inputs = (0,)


class Loop(_AtCut):
    op_type = "Loop"


class Scan(_AtCut):
    op_type = "Scan"


class NonMaxSuppression(_AtCut):
    op_type = "NonMaxSuppression"


def non_max_suppression(boxes: np.ndarray, scores: np.ndarray, max_per_class: int, iou_threshold: float,
                        score_threshold: float | None, center_point_box: int) -> np.ndarray:
    """ONNX NonMaxSuppression: ``[n, 3]`` int64 rows (batch, class, box), per batch and class the
    boxes in order of decreasing score (the lower index first among equal scores) that overlap
    no box kept before by an intersection over union above ``iou_threshold``, at most
    ``max_per_class`` of them; with a ``score_threshold``, only boxes scoring above it. Arithmetic
    in float32 as onnxruntime does, so that ties at the thresholds fall the same way."""
    boxes = np.asarray(boxes, np.float32)
    scores = np.asarray(scores, np.float32)
    if center_point_box:
        half_w, half_h = boxes[..., 2] / np.float32(2), boxes[..., 3] / np.float32(2)
        x0, x1 = boxes[..., 0] - half_w, boxes[..., 0] + half_w
        y0, y1 = boxes[..., 1] - half_h, boxes[..., 1] + half_h
    else:
        y0, y1 = np.minimum(boxes[..., 0], boxes[..., 2]), np.maximum(boxes[..., 0], boxes[..., 2])
        x0, x1 = np.minimum(boxes[..., 1], boxes[..., 3]), np.maximum(boxes[..., 1], boxes[..., 3])
    area = (x1 - x0) * (y1 - y0)
    iou_threshold = np.float32(iou_threshold)
    rows: list[tuple[int, int, int]] = []
    if max_per_class <= 0:
        return np.zeros((0, 3), np.int64)
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            candidates = (np.arange(s.shape[0]) if score_threshold is None
                          else np.flatnonzero(s > np.float32(score_threshold)))
            order = candidates[np.argsort(-s[candidates], kind="stable")]
            kept = 0
            while order.size and kept < max_per_class:
                top, rest = order[0], order[1:]
                rows.append((b, c, int(top)))
                kept += 1
                ix0, ix1 = np.maximum(x0[b, top], x0[b, rest]), np.minimum(x1[b, top], x1[b, rest])
                iy0, iy1 = np.maximum(y0[b, top], y0[b, rest]), np.minimum(y1[b, top], y1[b, rest])
                inter = (ix1 - ix0) * (iy1 - iy0)
                union = area[b, top] + area[b, rest] - inter
                overlaps = ((ix1 > ix0) & (iy1 > iy0) & (inter > 0) & (area[b, top] > 0) & (area[b, rest] > 0)
                            & (union > 0))
                with np.errstate(divide="ignore", invalid="ignore"):
                    suppressed = overlaps & (inter / np.where(union > 0, union, np.float32(1)) > iou_threshold)
                order = rest[~suppressed]
    return np.array(rows, np.int64).reshape(-1, 3)


__all__ = ["If", "Loop", "NonMaxSuppression", "Scan", "non_max_suppression"]
