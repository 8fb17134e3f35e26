"""Dropout at inference: output 0 is a view of the input; the optional mask is all true.

Training mode with a non-zero ratio draws random numbers: not supported (a constant
``training_mode`` of true with ratio 0 is the identity and runs).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, TensorInfo, UnsupportedOp
from vkpool.kernels.ops.dtypes import BOOL
from vkpool.kernels.ops.fill import fill_repeated


class Dropout(Op):
    op_type = "Dropout"
    alias_input = 0
    constant_inputs = (2,)

    def check(self) -> None:
        self.input(0)
        if self.opset >= 12:
            training = bool(np.asarray(self.constants[2]).reshape(())) if self.has_input(2) else False
            if not training:
                return  # the ratio does not matter, nor whether it is known
            if self.has_input(1) and 1 not in self.constants:
                raise UnsupportedOp("Dropout: training mode needs a ratio known at load time")
            ratio = float(np.asarray(self.constants[1]).reshape(())) if self.has_input(1) else 0.5
        else:
            # before opset 7 ``is_test`` chose the mode; inference is what a deployed model means
            training, ratio = False, float(self.attr("ratio", 0.5))
        if training and ratio != 0.0:
            raise UnsupportedOp(f"Dropout: training mode with ratio {ratio} is random")

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        infos = [x]
        if self.num_outputs > 1:
            infos.append(TensorInfo(x.shape, BOOL))
        return infos

    def flops(self) -> int:
        return 0

    def bytes_read(self) -> int:
        return 0

    def bytes_written(self) -> int:
        return sum(o.nbytes for o in self.output_infos()[1:])

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        out = [np.array(x)]
        if self.num_outputs > 1:
            out.append(np.ones(x.shape, dtype=bool))
        return out

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        """The mask only: the engine aliases (or copies) output 0."""
        if len(ctx.outputs) < 2 or ctx.outputs[1] is None:
            return []
        return fill_repeated(ctx.outputs[1], np.ones(1, dtype=np.uint8), self.input(0).size, ctx.caps)
