"""Elementwise binary ops with multidirectional broadcasting (``shaders/binary.comp``).

Arithmetic (Add, Sub, Mul, Div, Pow, Mod, PRelu), logic (And, Or, Xor), bitwise ops on
integers (BitShift, BitwiseAnd, BitwiseOr, BitwiseXor) and comparisons (Equal, Less, Greater,
LessOrEqual, GreaterOrEqual: bool outputs) on every numeric type
(float32/float16 and 8- to 64-bit integers; narrow types compute in 32 bits and wrap on store,
as numpy does).
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, groups_1d,
)
from vkpool.kernels.broadcast import MAX_RANK, broadcast_shape, collapse
from vkpool.kernels.ops.dtypes import BOOL, INT_TYPES, NUMERIC_TYPES, element_defines, require


def broadcast_dispatch(
    code: int,
    a: tuple[Any, TensorInfo],
    b: tuple[Any, TensorInfo],
    y: tuple[Any, TensorInfo],
    ctx: DispatchContext,
) -> Dispatch:
    """One ``binary.comp`` dispatch: ``y = a (code) b``, each given as (handle, info).

    ``y``'s shape is the broadcast shape; ``a`` may be ``y`` itself (an in-place update: each
    invocation reads and writes the same element).
    """
    (ha, ia), (hb, ib), (hy, iy) = a, b, y
    dims, (sa, sb) = collapse(iy.shape, ia.shape, ib.shape)
    pad = [1] * (MAX_RANK - len(dims))
    zeros = [0] * (MAX_RANK - len(dims))
    args: list[Any] = [Ptr(ha), Ptr(hb), Ptr(hy), U32(iy.size), U32(len(dims))]
    args += [U32(v) for v in dims + pad] + [U32(v) for v in sa + zeros] + [U32(v) for v in sb + zeros]
    defines = {"OP": code, **element_defines(ia.dtype, "A"), **element_defines(ib.dtype, "B"),
               **element_defines(iy.dtype, "Y")}
    groups = groups_1d(iy.size, 256, ctx.caps)
    if ctx.caps is not None and ctx.caps.cpu_like:
        if len(dims) <= 1 and sa in ([], [1]) and sb in ([], [1]):
            defines["FLAT"] = 1  # a CPU divides integers one lane at a time
        defines["EXACT"] = int(math.prod(groups) * 256 == iy.size)
    return Dispatch("binary", args, groups, defines)


class Binary(Op):
    """Base of ``y = a (op) b``: subclasses set ``code``, ``numpy_op`` and the types they take."""

    code: ClassVar[int]
    numpy_op: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray]]
    input_types: ClassVar[frozenset[np.dtype]] = NUMERIC_TYPES
    #: comparisons and logic produce bool
    bool_output: ClassVar[bool] = False
    #: whether vkpool.fusion may fold a Relu after the op into it (attribute ``activation``)
    takes_relu: ClassVar[bool] = False

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        if a.dtype != b.dtype:
            raise OpError(f"{self.op_type}: input types differ ({a.dtype} and {b.dtype})")
        require(self.op_type, a.dtype, self.input_types)
        self.out_shape = broadcast_shape(a.shape, b.shape)
        activation = self.attr("activation", None)
        if activation is not None and not (self.takes_relu and activation == "Relu" and a.dtype.kind == "f"):
            raise OpError(f"{self.op_type}: no fused activation {activation!r} on {a.dtype} (only a Relu after a "
                          "float Add)")

    @property
    def relu(self) -> bool:
        """A Relu folded into the op (:mod:`vkpool.fusion`): ``y = max(a (op) b, 0)``, NaN kept."""
        return self.attr("activation", None) == "Relu"

    def op_code(self) -> int:
        """The shader's OP define (an attribute may choose among variants)."""
        return self.code

    def out_dtype(self) -> np.dtype:
        return BOOL if self.bool_output else self.input(0).dtype

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.out_shape, self.out_dtype())]

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        with np.errstate(all="ignore"):
            y = np.asarray(type(self).numpy_op(a, b))
            if self.relu:
                y = np.where(y < 0, np.zeros((), y.dtype), y)
        return [y.astype(self.out_dtype(), copy=False)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        dispatch = broadcast_dispatch(
            self.op_code(), (ctx.inputs[0], self.input(0)), (ctx.inputs[1], self.input(1)),
            (ctx.outputs[0], self.output_infos()[0]), ctx,
        )
        if self.relu:
            dispatch.defines["RELU"] = 1
        return [dispatch]


class Add(Binary):
    op_type = "Add"
    code = 0
    numpy_op = np.add
    takes_relu = True


class Sub(Binary):
    op_type = "Sub"
    code = 1
    numpy_op = np.subtract


class Mul(Binary):
    op_type = "Mul"
    code = 2
    numpy_op = np.multiply


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        # ONNX integer Div truncates toward zero; floor division corrected where signs differ
        q = np.floor_divide(a, b)
        inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
        return (q + inexact).astype(a.dtype)
    return np.divide(a, b)


class Div(Binary):
    op_type = "Div"
    code = 3
    numpy_op = staticmethod(_divide)


class Pow(Binary):
    """``a ** b``; base and exponent may have different types, the result has the base's."""

    op_type = "Pow"
    code = 6
    input_types = frozenset({np.dtype(t) for t in (np.float32, np.float16, np.int32, np.int64)})
    exponent_types = NUMERIC_TYPES

    def check(self) -> None:
        a, b = self.input(0), self.input(1)
        require(self.op_type, a.dtype, self.input_types, "base")
        require(self.op_type, b.dtype, self.exponent_types, "exponent")
        self.out_shape = broadcast_shape(a.shape, b.shape)

    def flops(self) -> int:
        return 8 * self.output_infos()[0].size

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        with np.errstate(all="ignore"):
            if a.dtype.kind in "iu" and b.dtype.kind in "iu":
                y = np.power(a.astype(np.int64), b.astype(np.int64))
            else:
                y = np.power(a.astype(np.float64), b.astype(np.float64))
        return [np.asarray(y).astype(a.dtype)]


class Mod(Binary):
    """``fmod=0``: the remainder takes the divisor's sign (numpy ``mod``); ``fmod=1``: C ``fmod``."""

    op_type = "Mod"

    def check(self) -> None:
        super().check()
        fmod = int(self.attr("fmod", 0))
        if fmod not in (0, 1):
            raise OpError(f"Mod: fmod must be 0 or 1, got {fmod}")
        self.fmod = bool(fmod)

    def op_code(self) -> int:
        return 8 if self.fmod else 7

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        with np.errstate(all="ignore"):
            y = np.fmod(a, b) if self.fmod else np.mod(a, b)
        return [np.asarray(y).astype(a.dtype)]


class PRelu(Binary):
    """``x < 0 ? x * slope : x``; the slope broadcasts to X (unidirectionally)."""

    op_type = "PRelu"
    code = 17
    input_types = frozenset(d for d in NUMERIC_TYPES if d.kind in "fi")

    def check(self) -> None:
        super().check()
        if self.out_shape != self.input(0).shape:
            raise OpError(f"PRelu: slope {self.input(1).shape} does not broadcast to X {self.input(0).shape}")

    @staticmethod
    def numpy_op(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
        return np.where(x < 0, x * slope, x)


class _Logic(Binary):
    input_types = frozenset({BOOL})
    bool_output = True


class And(_Logic):
    op_type = "And"
    code = 9
    numpy_op = np.logical_and


class Or(_Logic):
    op_type = "Or"
    code = 10
    numpy_op = np.logical_or


class Xor(_Logic):
    op_type = "Xor"
    code = 11
    numpy_op = np.logical_xor


class BitShift(Binary):
    """``direction`` LEFT or RIGHT on integers; a right shift of a signed type is arithmetic, and a
    count outside ``[0, bits)`` gives 0 (-1 for a negative value shifted right), as numpy's."""

    op_type = "BitShift"
    input_types = INT_TYPES

    def check(self) -> None:
        super().check()
        if self.attr("direction") not in (b"LEFT", b"RIGHT", "LEFT", "RIGHT"):
            raise OpError(f"BitShift: direction must be LEFT or RIGHT, got {self.attr('direction')!r}")

    def left(self) -> bool:
        direction = self.attr("direction")
        return (direction.decode() if isinstance(direction, bytes) else direction) == "LEFT"

    def op_code(self) -> int:
        return 18 if self.left() else 19

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        a, b = inputs[0], inputs[1]
        assert a is not None and b is not None
        shift = np.left_shift if self.left() else np.right_shift
        return [shift(a, b).astype(a.dtype)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        (dispatch,) = super().dispatches(ctx)
        dispatch.defines["BITS"] = self.input(0).dtype.itemsize * 8
        return [dispatch]


class _Bitwise(Binary):
    input_types = INT_TYPES


class BitwiseAnd(_Bitwise):
    op_type = "BitwiseAnd"
    code = 20
    numpy_op = np.bitwise_and


class BitwiseOr(_Bitwise):
    op_type = "BitwiseOr"
    code = 21
    numpy_op = np.bitwise_or


class BitwiseXor(_Bitwise):
    op_type = "BitwiseXor"
    code = 22
    numpy_op = np.bitwise_xor


class _Compare(Binary):
    bool_output = True


class Equal(_Compare):
    op_type = "Equal"
    code = 12
    input_types = NUMERIC_TYPES | {BOOL}
    numpy_op = np.equal


class Less(_Compare):
    op_type = "Less"
    code = 13
    numpy_op = np.less


class Greater(_Compare):
    op_type = "Greater"
    code = 14
    numpy_op = np.greater


class LessOrEqual(_Compare):
    op_type = "LessOrEqual"
    code = 15
    numpy_op = np.less_equal


class GreaterOrEqual(_Compare):
    op_type = "GreaterOrEqual"
    code = 16
    numpy_op = np.greater_equal
