"""Elementwise ``y = f(x)`` ops sharing ``shaders/unary.comp``: activations and math functions.

Float functions run on float32 and float16 (computed in float32); Abs/Neg/Sign/Relu/Shrink on
every numeric type; IsNaN/IsInf produce bool; Not takes bool; BitwiseNot takes integers.
"""
from __future__ import annotations

from abc import abstractmethod

import math
from typing import Any, ClassVar, Sequence

import numpy as np

from vkpool.kernels.base import (
    F32, DeviceCaps, Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, groups_1d,
)
from vkpool.kernels.ops.dtypes import BOOL, FLOAT_TYPES, INT_TYPES, NUMERIC_TYPES, element_defines, require

_SIGNED_AND_FLOAT = frozenset(d for d in NUMERIC_TYPES if d.kind in "fi")


class Unary(Op):
    """Base of ``y = f(x)``: subclasses set ``code``, ``input_types`` and ``compute``."""

    code: ClassVar[int]
    input_types: ClassVar[frozenset[np.dtype]] = FLOAT_TYPES
    #: output dtype when it is not the input's (IsNaN/IsInf: bool)
    output_type: ClassVar[np.dtype | None] = None
    #: FLOPs per element, for the cost model
    cost: ClassVar[int] = 1

    def check(self) -> None:
        require(self.op_type, self.input(0).dtype, self.input_types)

    def op_code(self) -> int:
        """The shader's OP define (an attribute may choose among variants)."""
        return self.code

    def out_dtype(self) -> np.dtype:
        return self.output_type if self.output_type is not None else self.input(0).dtype

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(self.input(0).shape, self.out_dtype())]

    def params(self) -> tuple[float, float, float]:
        """``alpha``, ``beta``, ``gamma`` of the shader."""
        return (0.0, 0.0, 0.0)

    @abstractmethod
    def compute(self, x: np.ndarray) -> np.ndarray:
        """numpy ``f``; float inputs arrive as float32 (float16 is widened, as the shader does).
        An op whose reference is one numpy function sets ``compute = staticmethod(np.f)``."""

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        wide = x.astype(np.float32) if x.dtype == np.float16 else x
        with np.errstate(all="ignore"):
            y = np.asarray(self.compute(wide))
        return [y.astype(self.out_dtype(), copy=False)]

    def flops(self) -> int:
        return self.cost * self.input(0).size

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        defines = {"OP": self.op_code(), **element_defines(self.input(0).dtype, "X"),
                   **element_defines(self.out_dtype(), "Y")}
        return [unary_dispatch(ctx.inputs[0], ctx.outputs[0], self.input(0).size, defines, ctx.caps,
                               self.params())]


def unary_dispatch(
    src: Any, dst: Any, n: int, defines: dict[str, Any], caps: DeviceCaps,
    params: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> Dispatch:
    """One ``unary.comp`` dispatch over ``n`` elements; ``defines`` choose OP and the types."""
    alpha, beta, gamma = params
    args = [Ptr(src), Ptr(dst), U32(n), F32(alpha), F32(beta), F32(gamma)]
    groups = groups_1d(n, 256, caps)
    if caps is not None and caps.cpu_like and math.prod(groups) * 256 == n:
        defines = {**defines, "EXACT": 1}  # every invocation has an element: no bounds test
    return Dispatch("unary", args, groups, defines)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, 1 / (1 + np.exp(-x)), np.exp(x) / (1 + np.exp(x)))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


#: erf over an array, in float64: the host references of Erf, Gelu and the fused GELU epilogue
erf64 = np.vectorize(math.erf, otypes=[np.float64])


class Relu(Unary):
    op_type = "Relu"
    code = 0
    input_types = _SIGNED_AND_FLOAT

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.where(x < 0, np.zeros((), x.dtype), x)


class LeakyRelu(Unary):
    op_type = "LeakyRelu"
    code = 1

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 0.01)), 0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.where(x >= 0, x, x * np.float32(self.params()[0]))


class Sigmoid(Unary):
    op_type = "Sigmoid"
    code = 2
    cost = 4

    compute = staticmethod(_sigmoid)


class Tanh(Unary):
    op_type = "Tanh"
    code = 3
    cost = 4

    compute = staticmethod(np.tanh)


class Sqrt(Unary):
    op_type = "Sqrt"
    code = 6

    compute = staticmethod(np.sqrt)


class Exp(Unary):
    op_type = "Exp"
    code = 7
    cost = 2

    compute = staticmethod(np.exp)


class Log(Unary):
    op_type = "Log"
    code = 8
    cost = 2

    compute = staticmethod(np.log)


class Abs(Unary):
    op_type = "Abs"
    code = 9
    input_types = NUMERIC_TYPES

    compute = staticmethod(np.abs)


class Neg(Unary):
    op_type = "Neg"
    code = 10
    input_types = _SIGNED_AND_FLOAT

    compute = staticmethod(np.negative)


class Reciprocal(Unary):
    op_type = "Reciprocal"
    code = 11

    compute = staticmethod(np.reciprocal)


class Floor(Unary):
    op_type = "Floor"
    code = 12

    compute = staticmethod(np.floor)


class Ceil(Unary):
    op_type = "Ceil"
    code = 13

    compute = staticmethod(np.ceil)


class Round(Unary):
    op_type = "Round"
    code = 14

    compute = staticmethod(np.round)  # numpy rounds half to even, as ONNX does


class Sign(Unary):
    op_type = "Sign"
    code = 15
    input_types = NUMERIC_TYPES

    compute = staticmethod(np.sign)


class Sin(Unary):
    op_type = "Sin"
    code = 16
    cost = 4

    compute = staticmethod(np.sin)


class Cos(Unary):
    op_type = "Cos"
    code = 17
    cost = 4

    compute = staticmethod(np.cos)


class Erf(Unary):
    op_type = "Erf"
    code = 18
    cost = 12

    compute = staticmethod(erf64)


class Gelu(Unary):
    op_type = "Gelu"
    cost = 14

    def check(self) -> None:
        super().check()
        approximate = self.attr("approximate", "none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else str(approximate)
        if approximate not in ("none", "tanh"):
            raise OpError(f"Gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.tanh = approximate == "tanh"

    def op_code(self) -> int:
        return 20 if self.tanh else 19

    def compute(self, x: np.ndarray) -> np.ndarray:
        if self.tanh:
            return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        return 0.5 * x * (1 + erf64(x / math.sqrt(2)))


class Elu(Unary):
    op_type = "Elu"
    code = 21
    cost = 3

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 1.0)), 0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.where(x < 0, self.params()[0] * (np.exp(x) - 1), x)


class Selu(Unary):
    op_type = "Selu"
    code = 22
    cost = 3

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 1.67326319217681884765625)), 0.0,
                float(self.attr("gamma", 1.05070102062301025390625)))

    def compute(self, x: np.ndarray) -> np.ndarray:
        alpha, _, gamma = self.params()
        return np.where(x > 0, gamma * x, gamma * (alpha * np.exp(x) - alpha))


class Celu(Unary):
    op_type = "Celu"
    code = 23
    cost = 4

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 1.0)), 0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        alpha = self.params()[0]
        return np.maximum(x, 0) + np.minimum(0, alpha * (np.exp(x / alpha) - 1))


class HardSigmoid(Unary):
    op_type = "HardSigmoid"
    code = 24
    cost = 3

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 0.2)), float(self.attr("beta", 0.5)), 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        alpha, beta, _ = self.params()
        return np.clip(np.float32(alpha) * x + np.float32(beta), 0, 1)


class HardSwish(Unary):
    op_type = "HardSwish"
    code = 25
    cost = 4

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x * np.clip(x / np.float32(6) + np.float32(0.5), 0, 1)


class Softplus(Unary):
    op_type = "Softplus"
    code = 26
    cost = 4

    compute = staticmethod(_softplus)


class Softsign(Unary):
    op_type = "Softsign"
    code = 27
    cost = 3

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x / (1 + np.abs(x))


class Mish(Unary):
    op_type = "Mish"
    code = 28
    cost = 10

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x * np.tanh(_softplus(x))


class Swish(Unary):
    op_type = "Swish"
    code = 29
    cost = 5

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 1.0)), 0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x * _sigmoid(np.float32(self.params()[0]) * x)


class ThresholdedRelu(Unary):
    op_type = "ThresholdedRelu"
    code = 30

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("alpha", 1.0)), 0.0, 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        return np.where(x > self.params()[0], x, 0)


class Shrink(Unary):
    op_type = "Shrink"
    code = 31
    input_types = NUMERIC_TYPES
    cost = 2

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("lambd", 0.5)), float(self.attr("bias", 0.0)), 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        lambd, bias, _ = self.params()
        f = x.astype(np.float32)
        return np.where(f < -lambd, f + bias, np.where(f > lambd, f - bias, 0)).astype(x.dtype)


class IsNaN(Unary):
    op_type = "IsNaN"
    code = 32
    output_type = BOOL

    compute = staticmethod(np.isnan)


class IsInf(Unary):
    op_type = "IsInf"
    code = 33
    output_type = BOOL

    def params(self) -> tuple[float, float, float]:
        return (float(self.attr("detect_negative", 1)), float(self.attr("detect_positive", 1)), 0.0)

    def compute(self, x: np.ndarray) -> np.ndarray:
        neg, pos, _ = self.params()
        return np.isinf(x) & (((x < 0) & bool(neg)) | ((x > 0) & bool(pos)))


class Not(Unary):
    op_type = "Not"
    code = 34
    input_types = frozenset({BOOL})

    compute = staticmethod(np.logical_not)


class BitwiseNot(Unary):
    op_type = "BitwiseNot"
    code = 35
    input_types = INT_TYPES

    compute = staticmethod(np.invert)


class _Trig(Unary):
    """Trigonometric and hyperbolic functions and their inverses."""

    cost = 8


class Tan(_Trig):
    op_type = "Tan"
    code = 36
    compute = staticmethod(np.tan)


class Asin(_Trig):
    op_type = "Asin"
    code = 37
    compute = staticmethod(np.arcsin)


class Acos(_Trig):
    op_type = "Acos"
    code = 38
    compute = staticmethod(np.arccos)


class Atan(_Trig):
    op_type = "Atan"
    code = 39
    compute = staticmethod(np.arctan)


class Sinh(_Trig):
    op_type = "Sinh"
    code = 40
    compute = staticmethod(np.sinh)


class Cosh(_Trig):
    op_type = "Cosh"
    code = 41
    compute = staticmethod(np.cosh)


class Asinh(_Trig):
    op_type = "Asinh"
    code = 42
    compute = staticmethod(np.arcsinh)


class Acosh(_Trig):
    op_type = "Acosh"
    code = 43
    compute = staticmethod(np.arccosh)


class Atanh(_Trig):
    op_type = "Atanh"
    code = 44
    compute = staticmethod(np.arctanh)
