"""Split along one axis into parts given by the ``split`` input (opset 13+) or attribute, else
into ``num_outputs`` parts of ``ceil(dim / n)`` (the last smaller, opset 18); one strided copy
per output."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import contiguous_strides, strided_copy


class Split(Op):
    op_type = "Split"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        word_defines(x.dtype)
        rank = len(x.shape)
        axis = int(self.attr("axis", 0))
        if not -rank <= axis < rank:
            raise OpError(f"Split: axis {axis} out of range for rank {rank}")
        self.axis = axis % rank
        dim = x.shape[self.axis]
        if self.has_input(1):
            sizes = [int(v) for v in np.asarray(self.constants[1]).reshape(-1)]
        elif self.attr("split") is not None:
            sizes = [int(v) for v in self.attr("split")]
        else:
            parts = int(self.attr("num_outputs", self.num_outputs))
            if parts < 1:
                raise OpError(f"Split: num_outputs must be positive, got {parts}")
            chunk = -(-dim // parts)
            sizes = [min(chunk, max(0, dim - i * chunk)) for i in range(parts)]
        if len(sizes) != self.num_outputs:
            raise OpError(f"Split: {len(sizes)} parts for {self.num_outputs} outputs")
        if any(s < 0 for s in sizes) or sum(sizes) != dim:
            raise OpError(f"Split: parts {sizes} do not add up to dimension {dim} of axis {self.axis}")
        self.sizes = sizes

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        return [TensorInfo(x.shape[:self.axis] + (s,) + x.shape[self.axis + 1:], x.dtype) for s in self.sizes]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        bounds = np.cumsum(self.sizes)[:-1]
        return [np.ascontiguousarray(part) for part in np.split(x, bounds, axis=self.axis)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        strides = contiguous_strides(x.shape)
        out: list[Dispatch] = []
        start = 0
        for handle, info, size in zip(ctx.outputs, self.output_infos(), self.sizes):
            if handle is not None:
                out += strided_copy(ctx.inputs[0], handle, info.shape, strides, x.dtype, ctx.caps,
                                    base=start * strides[self.axis])
            start += size
        return out
