"""Cast and CastLike between float32/float16 and 8- to 64-bit integers and bool (``unary.comp``'s
conversion). Float to integer truncates toward zero; anything to bool is "not zero". From float8,
float4 and 4-/2-bit integers to float32/float16 (and the narrow integers to 8-bit ones) through
``cast_narrow.comp``, and back from float32/float16 (float8 e8m0fnu excepted); the same for
bfloat16. double and strings have no kernel."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)
from vkpool.kernels.ops.dtypes import ELEMENT_TYPES, element_defines, require
from vkpool.kernels.ops.unary import unary_dispatch

_CASTABLE = frozenset(ELEMENT_TYPES)

#: types narrower than a byte's arithmetic, held one per byte (ml_dtypes), by numpy name: the
#: defines of ``shaders/cast_narrow.comp`` that decode them
_NARROW: dict[str, dict[str, int | str]] = {
    "float8_e4m3fn": {"FORMAT": 0, "EXP_BITS": 4, "MAN_BITS": 3, "BIAS": 7, "NAN_CODE": 1},
    "float8_e4m3fnuz": {"FORMAT": 0, "EXP_BITS": 4, "MAN_BITS": 3, "BIAS": 8, "NAN_CODE": 2},
    "float8_e5m2": {"FORMAT": 0, "EXP_BITS": 5, "MAN_BITS": 2, "BIAS": 15, "NAN_CODE": 0},
    "float8_e5m2fnuz": {"FORMAT": 0, "EXP_BITS": 5, "MAN_BITS": 2, "BIAS": 16, "NAN_CODE": 2},
    "float8_e8m0fnu": {"FORMAT": 0, "EXP_BITS": 8, "MAN_BITS": 0, "BIAS": 127, "NAN_CODE": 4},
    "float4_e2m1fn": {"FORMAT": 0, "EXP_BITS": 2, "MAN_BITS": 1, "BIAS": 1, "NAN_CODE": 3},
    "int4": {"FORMAT": 1, "INT_BITS": 4},
    "uint4": {"FORMAT": 2, "INT_BITS": 4},
    "int2": {"FORMAT": 1, "INT_BITS": 2},
    "uint2": {"FORMAT": 2, "INT_BITS": 2},
    "bfloat16": {"FORMAT": 3, "NBUF": "U16Buf", "NT": "uint16_t"},
}
#: what a narrow type decodes to: floats, and the 8-bit integers for the narrow integers
_DECODED = frozenset(np.dtype(t) for t in (np.float32, np.float16, np.int8, np.uint8))
#: narrow float types floats encode to: the largest finite value and its bits (sign excluded)
_ENCODED_MAX: dict[str, tuple[str, int]] = {
    "float8_e4m3fn": ("448.0", 0x7E), "float8_e4m3fnuz": ("240.0", 0x7F), "float8_e5m2": ("57344.0", 0x7B),
    "float8_e5m2fnuz": ("57344.0", 0x7F), "float4_e2m1fn": ("6.0", 0x7),
}
_FLOATS = frozenset(np.dtype(t) for t in (np.float32, np.float16))


def ml_finfo(dtype: np.dtype) -> Any:
    """ml_dtypes' finfo of a narrow float type (numpy's knows only its own types)."""
    import ml_dtypes  # installed with onnx; only the narrow types need it

    return ml_dtypes.finfo(dtype)


# TensorProto.DataType numbers of numpy's own types (fixed by the ONNX spec): a model loaded from
# the model cache runs its Casts without importing onnx; the narrow types still ask onnx
_NUMPY_TYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
                9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


def _onnx_dtype(to: int) -> np.dtype:
    if to in _NUMPY_TYPES:
        return np.dtype(_NUMPY_TYPES[to])
    from onnx import helper  # imported only for the narrow types

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
        self.to = self.target()
        self.narrow = _NARROW.get(self.input(0).dtype.name)
        self.encode: dict[str, int | str] | None = None
        if self.narrow is not None:
            require(self.op_type, self.to, _DECODED, f"{self.input(0).dtype} to")
            return
        self.encode = _NARROW.get(self.to.name)
        if self.encode is not None:
            if self.to.name not in _ENCODED_MAX and self.encode["FORMAT"] == 0:
                raise UnsupportedOp(f"{self.op_type}: target type {self.to} has no kernel")
            require(self.op_type, self.input(0).dtype, _FLOATS, f"to {self.to}, input")
            return
        require(self.op_type, self.input(0).dtype, _CASTABLE)
        require(self.op_type, self.to, _CASTABLE, "target")

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(0).shape, self.to)]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        with np.errstate(all="ignore"):
            if self.encode is not None and self.encode["FORMAT"] == 0 and self.attr("saturate", 1):
                info = ml_finfo(self.to)
                x = np.clip(np.asarray(x, np.float32), float(info.min), float(info.max))
            return [np.asarray(x).astype(self.to)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.input(0).size
        if n == 0:
            return []
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(n)]
        if self.narrow is not None:
            return [Dispatch("cast_narrow", args, groups_1d(n, 256, ctx.caps),
                             {**self.narrow, **element_defines(self.to, "Y")})]
        if self.encode is not None:
            max_value, max_code = _ENCODED_MAX.get(self.to.name, ("0.0", 0))
            defines = {**self.encode, "ENCODE": 1, "SATURATE": int(bool(self.attr("saturate", 1))),
                       "MAX_VALUE": max_value, "MAX_CODE": max_code,
                       **element_defines(self.input(0).dtype, "X")}
            return [Dispatch("cast_narrow", args, groups_1d(n, 256, ctx.caps), defines)]
        defines = {"OP": 5, **element_defines(self.input(0).dtype, "X"), **element_defines(self.to, "Y")}
        return [unary_dispatch(ctx.inputs[0], ctx.outputs[0], n, defines, ctx.caps)]


class CastLike(Cast):
    """Cast to the element type of input 1 (whose values are not read)."""

    op_type = "CastLike"

    def target(self) -> np.dtype:
        return self.input(1).dtype

    def bytes_read(self) -> int:
        return self.input(0).nbytes
