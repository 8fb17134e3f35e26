"""Cast and CastLike between float32/float16 and 8- to 64-bit integers and bool (``unary.comp``'s
conversion). Float to integer truncates toward zero; anything to bool is "not zero". double,
bfloat16, float8/4 and strings have no kernel."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.ops.dtypes import ELEMENT_TYPES, element_defines, require
from vkpool.kernels.ops.unary import unary_dispatch

_CASTABLE = frozenset(ELEMENT_TYPES)


def _onnx_dtype(to: int) -> np.dtype:
    from onnx import helper  # the loader has imported onnx already; keep it off this module's import

    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(to)))
    except (KeyError, TypeError, ValueError):
        raise OpError(f"Cast: unknown target type {to}") from None


class Cast(Op):
    op_type = "Cast"

    def target(self) -> np.dtype:
        to = self.attr("to")
        if to is None:
            raise OpError("Cast: the 'to' attribute is required")
        if isinstance(to, (bytes, str)):  # opset 1 named the type
            name = to.decode() if isinstance(to, bytes) else to
            from onnx import TensorProto

            to = getattr(TensorProto, name.upper(), None)
            if to is None:
                raise OpError(f"Cast: unknown target type {name!r}")
        return _onnx_dtype(int(to))

    def check(self) -> None:
        require(self.op_type, self.input(0).dtype, _CASTABLE)
        self.to = self.target()
        require(self.op_type, self.to, _CASTABLE, "target")

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(0).shape, self.to)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        with np.errstate(all="ignore"):
            return [np.asarray(x).astype(self.to)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        if n == 0:
            return []
        defines = {"OP": 5, **element_defines(self.input(0).dtype, "X"), **element_defines(self.to, "Y")}
        return [unary_dispatch(ctx.inputs[0], ctx.outputs[0], n, defines, ctx.caps)]


class CastLike(Cast):
    """Cast to the element type of input 1 (whose values are not read)."""

    op_type = "CastLike"

    def target(self) -> np.dtype:
        return self.input(1).dtype

    def bytes_read(self) -> int:
        return self.input(0).nbytes
