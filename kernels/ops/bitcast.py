"""BitCast: the input's bytes read as another type of the same width. A view: no dispatch, the
engine aliases the bytes (``alias_input``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import OpError, TensorInfo
from vkpool.kernels.ops.cast import _onnx_dtype
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.views import View


class BitCast(View):
    op_type = "BitCast"

    def check(self) -> None:
        x = self.input(0)
        to = self.attr("to")
        if to is None:
            raise OpError("BitCast: the 'to' attribute is required")
        self.to = _onnx_dtype(int(to))
        word_defines(x.dtype)
        word_defines(self.to)
        if self.to.itemsize != x.dtype.itemsize:
            raise OpError(f"BitCast: {x.dtype} and {self.to} differ in width")
        self.out_shape = x.shape

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.to)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [np.ascontiguousarray(x).view(self.to).reshape(self.out_shape)]
