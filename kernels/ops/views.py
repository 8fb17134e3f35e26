"""Ops whose output is a view of input 0 with a new shape: Reshape, Flatten, Squeeze, Unsqueeze,
Identity. No dispatch: the engine aliases the bytes (``alias_input``)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo


class View(Op):
    """Base of the view ops: subclasses compute ``self.out_shape`` in ``check``."""

    alias_input = 0
    out_shape: tuple[int, ...]

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.input(0).dtype)]

    def flops(self) -> int:
        return 0

    def bytes_read(self) -> int:
        return 0

    def bytes_written(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [np.asarray(x).reshape(self.out_shape)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        return []

    def _axes(self, pos: int) -> list[int] | None:
        """Axes from the attribute (before opset 13) or the constant input ``pos`` (from 13)."""
        if self.opset < 13:
            axes = self.attr("axes")
            return None if axes is None else [int(a) for a in axes]
        if not self.has_input(pos):
            return None
        return [int(a) for a in np.asarray(self.constants[pos]).reshape(-1)]


class Reshape(View):
    op_type = "Reshape"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        if self.opset < 5:
            target = [int(d) for d in self.attr("shape", [])]
        else:
            target = [int(d) for d in np.asarray(self.constants[1]).reshape(-1)]
        allowzero = int(self.attr("allowzero", 0))
        shape: list[int] = []
        for d, v in enumerate(target):
            if v == 0 and not allowzero:
                if d >= len(x.shape):
                    raise OpError(f"Reshape: 0 at position {d} copies a dimension the input lacks")
                shape.append(x.shape[d])
            else:
                shape.append(v)
        if shape.count(-1) > 1 or any(v < -1 for v in shape):
            raise OpError(f"Reshape: invalid shape {target}")
        if -1 in shape:
            known = math.prod(v for v in shape if v != -1)
            if known == 0 or x.size % known:
                raise OpError(f"Reshape: cannot infer -1 in {target} for {x.size} elements")
            shape[shape.index(-1)] = x.size // known
        if math.prod(shape) != x.size:
            raise OpError(f"Reshape: {x.shape} has {x.size} elements, {tuple(shape)} has {math.prod(shape)}")
        self.out_shape = tuple(shape)


class Flatten(View):
    op_type = "Flatten"

    def check(self) -> None:
        shape = self.input(0).shape
        rank = len(shape)
        axis = int(self.attr("axis", 1))
        if not -rank <= axis <= rank:
            raise OpError(f"Flatten: axis {axis} out of range for rank {rank}")
        if axis < 0:
            axis += rank
        self.out_shape = (math.prod(shape[:axis]), math.prod(shape[axis:]))


class Squeeze(View):
    op_type = "Squeeze"
    constant_inputs = (1,)

    def check(self) -> None:
        shape = self.input(0).shape
        rank = len(shape)
        axes = self._axes(1)
        if axes is None:
            self.out_shape = tuple(d for d in shape if d != 1)
            return
        norm = set()
        for a in axes:
            if not -rank <= a < rank:
                raise OpError(f"Squeeze: axis {a} out of range for rank {rank}")
            if shape[a % rank] != 1:
                raise OpError(f"Squeeze: axis {a} has extent {shape[a % rank]}, not 1")
            norm.add(a % rank)
        self.out_shape = tuple(d for i, d in enumerate(shape) if i not in norm)


class Unsqueeze(View):
    op_type = "Unsqueeze"
    constant_inputs = (1,)

    def check(self) -> None:
        shape = self.input(0).shape
        axes = self._axes(1)
        if not axes:
            raise OpError("Unsqueeze: axes are required")
        rank = len(shape) + len(axes)
        norm = set()
        for a in axes:
            if not -rank <= a < rank:
                raise OpError(f"Unsqueeze: axis {a} out of range for output rank {rank}")
            norm.add(a % rank)
        if len(norm) != len(axes):
            raise OpError(f"Unsqueeze: repeated axis in {axes}")
        rest = iter(shape)
        self.out_shape = tuple(1 if i in norm else next(rest) for i in range(rank))


class Identity(View):
    op_type = "Identity"

    def check(self) -> None:
        self.out_shape = self.input(0).shape
