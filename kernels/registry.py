"""The op registry: one line per op module. Adding an op = its module + one line here."""
from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from vkpool.kernels.base import Op, TensorInfo, UnsupportedOp

#: (op_type, module under vkpool.kernels.ops, class name); domain "" (ai.onnx) unless noted
OPS: list[tuple[str, str, str]] = [
    # -- elementwise: activations and arithmetic ---------------------------------------------
    ("Relu", "unary", "Relu"),
    ("LeakyRelu", "unary", "LeakyRelu"),
    ("Add", "binary", "Add"),
    ("Sub", "binary", "Sub"),
    ("Mul", "binary", "Mul"),
    ("Div", "binary", "Div"),
    ("Sigmoid", "unary", "Sigmoid"),
    ("Tanh", "unary", "Tanh"),
    ("Sqrt", "unary", "Sqrt"),
    ("Exp", "unary", "Exp"),
    ("Log", "unary", "Log"),
    ("Abs", "unary", "Abs"),
    ("Neg", "unary", "Neg"),
    ("Reciprocal", "unary", "Reciprocal"),
    ("Floor", "unary", "Floor"),
    ("Ceil", "unary", "Ceil"),
    ("Round", "unary", "Round"),
    ("Sign", "unary", "Sign"),
    ("Sin", "unary", "Sin"),
    ("Cos", "unary", "Cos"),
    ("Erf", "unary", "Erf"),
    ("Gelu", "unary", "Gelu"),
    ("Elu", "unary", "Elu"),
    ("Selu", "unary", "Selu"),
    ("Celu", "unary", "Celu"),
    ("HardSigmoid", "unary", "HardSigmoid"),
    ("HardSwish", "unary", "HardSwish"),
    ("Softplus", "unary", "Softplus"),
    ("Softsign", "unary", "Softsign"),
    ("Mish", "unary", "Mish"),
    ("Swish", "unary", "Swish"),
    ("ThresholdedRelu", "unary", "ThresholdedRelu"),
    ("Shrink", "unary", "Shrink"),
    ("IsNaN", "unary", "IsNaN"),
    ("IsInf", "unary", "IsInf"),
    ("Not", "unary", "Not"),
    ("BitwiseNot", "unary", "BitwiseNot"),
    ("Tan", "unary", "Tan"),
    ("Asin", "unary", "Asin"),
    ("Acos", "unary", "Acos"),
    ("Atan", "unary", "Atan"),
    ("Sinh", "unary", "Sinh"),
    ("Cosh", "unary", "Cosh"),
    ("Asinh", "unary", "Asinh"),
    ("Acosh", "unary", "Acosh"),
    ("Atanh", "unary", "Atanh"),
    ("Pow", "binary", "Pow"),
    ("Mod", "binary", "Mod"),
    ("PRelu", "binary", "PRelu"),
    ("And", "binary", "And"),
    ("Or", "binary", "Or"),
    ("Xor", "binary", "Xor"),
    ("BitShift", "binary", "BitShift"),
    ("BitwiseAnd", "binary", "BitwiseAnd"),
    ("BitwiseOr", "binary", "BitwiseOr"),
    ("BitwiseXor", "binary", "BitwiseXor"),
    ("Equal", "binary", "Equal"),
    ("Less", "binary", "Less"),
    ("Greater", "binary", "Greater"),
    ("LessOrEqual", "binary", "LessOrEqual"),
    ("GreaterOrEqual", "binary", "GreaterOrEqual"),
    ("Sum", "variadic", "Sum"),
    ("Mean", "variadic", "Mean"),
    ("Max", "variadic", "Max"),
    ("Min", "variadic", "Min"),
    ("Clip", "clip", "Clip"),
    ("Where", "where", "Where"),
    # -- linear algebra, convolution, pooling, normalisation -----------------------------------
    ("Gemm", "gemm", "Gemm"),
    ("MatMul", "matmul", "MatMul"),
    ("MatMulInteger", "qmatmul", "MatMulInteger"),
    ("QLinearMatMul", "qmatmul", "QLinearMatMul"),
    ("ConvInteger", "qconv", "ConvInteger"),
    ("QLinearConv", "qconv", "QLinearConv"),
    ("Conv", "conv", "Conv"),
    ("MaxPool", "pool", "MaxPool"),
    ("AveragePool", "pool", "AveragePool"),
    ("LpPool", "pool", "LpPool"),
    ("GlobalMaxPool", "pool", "GlobalMaxPool"),
    ("GlobalAveragePool", "pool", "GlobalAveragePool"),
    ("BatchNormalization", "batchnorm", "BatchNormalization"),
    ("LRN", "lrn", "LRN"),
    ("Softmax", "softmax", "Softmax"),
    ("LogSoftmax", "softmax", "LogSoftmax"),
    ("NegativeLogLikelihoodLoss", "loss", "NegativeLogLikelihoodLoss"),
    ("SoftmaxCrossEntropyLoss", "loss", "SoftmaxCrossEntropyLoss"),
    # -- shape and data movement ------------------------------------------------------------
    ("Reshape", "views", "Reshape"),
    ("Flatten", "views", "Flatten"),
    ("Squeeze", "views", "Squeeze"),
    ("Unsqueeze", "views", "Unsqueeze"),
    ("Identity", "views", "Identity"),
    ("Dropout", "dropout", "Dropout"),
    ("Transpose", "transpose", "Transpose"),
    ("Concat", "concat", "Concat"),
    ("Slice", "slice", "Slice"),
    ("Split", "split", "Split"),
    ("Expand", "expand", "Expand"),
    ("Tile", "tile", "Tile"),
    ("Gather", "gather", "Gather"),
    ("Cast", "cast", "Cast"),
    ("CastLike", "cast", "CastLike"),
    ("BitCast", "bitcast", "BitCast"),
    ("QuantizeLinear", "quantize", "QuantizeLinear"),
    ("DequantizeLinear", "quantize", "DequantizeLinear"),
    ("DynamicQuantizeLinear", "quantize", "DynamicQuantizeLinear"),
    ("Range", "range_op", "Range"),
    ("Shape", "shape_ops", "Shape"),
    ("ConstantOfShape", "shape_ops", "ConstantOfShape"),
    ("Constant", "shape_ops", "Constant"),
    ("GatherElements", "gather_scatter", "GatherElements"),
    ("GatherND", "gather_scatter", "GatherND"),
    ("ScatterElements", "gather_scatter", "ScatterElements"),
    ("Scatter", "gather_scatter", "Scatter"),
    ("ScatterND", "gather_scatter", "ScatterND"),
    ("Pad", "pad", "Pad"),
    ("CenterCropPad", "pad", "CenterCropPad"),
    ("Trilu", "trilu", "Trilu"),
    ("ReverseSequence", "reverse_sequence", "ReverseSequence"),
    ("EyeLike", "eye", "EyeLike"),
    ("OneHot", "onehot", "OneHot"),
    ("DepthToSpace", "depth_space", "DepthToSpace"),
    ("SpaceToDepth", "depth_space", "SpaceToDepth"),
    ("Compress", "compress", "Compress"),
    ("NonZero", "nonzero", "NonZero"),
    ("Size", "nonzero", "Size"),
    ("Resize", "resize", "Resize"),
    ("Upsample", "resize", "Upsample"),
    ("GridSample", "grid_sample", "GridSample"),
    ("AffineGrid", "affine_grid", "AffineGrid"),
    ("ConvTranspose", "convtranspose", "ConvTranspose"),
    ("Einsum", "einsum", "Einsum"),
    ("DFT", "dft", "DFT"),
    ("STFT", "stft", "STFT"),
    # -- more elementwise (math, logic, comparison) -------------------------------------------
    # -- reductions and normalisation layers ----------------------------------------------------
    ("ReduceSum", "reduce", "ReduceSum"),
    ("ReduceMean", "reduce", "ReduceMean"),
    ("ReduceMax", "reduce", "ReduceMax"),
    ("ReduceMin", "reduce", "ReduceMin"),
    ("ReduceProd", "reduce", "ReduceProd"),
    ("ReduceL1", "reduce", "ReduceL1"),
    ("ReduceL2", "reduce", "ReduceL2"),
    ("ReduceLogSum", "reduce", "ReduceLogSum"),
    ("ReduceLogSumExp", "reduce", "ReduceLogSumExp"),
    ("ReduceSumSquare", "reduce", "ReduceSumSquare"),
    ("ArgMax", "argmax", "ArgMax"),
    ("ArgMin", "argmax", "ArgMin"),
    ("CumSum", "cumsum", "CumSum"),
    ("CumProd", "cumsum", "CumProd"),
    ("TopK", "topk", "TopK"),
    ("Hardmax", "hardmax", "Hardmax"),
    ("LayerNormalization", "norms", "LayerNormalization"),
    ("RMSNormalization", "norms", "RMSNormalization"),
    ("GroupNormalization", "norms", "GroupNormalization"),
    ("InstanceNormalization", "norms", "InstanceNormalization"),
    ("MeanVarianceNormalization", "norms", "MeanVarianceNormalization"),
    ("LpNormalization", "norms", "LpNormalization"),
    # -- recurrent ------------------------------------------------------------------------------
    ("RNN", "recurrent", "RNN"),
    ("GRU", "recurrent", "GRU"),
    ("LSTM", "recurrent", "LSTM"),
    # -- attention ------------------------------------------------------------------------------
    ("SwiGLU", "swiglu", "SwiGLU"),
    ("Attention", "attention", "Attention"),
    ("RotaryEmbedding", "rotary", "RotaryEmbedding"),
    ("CausalConvWithState", "causal_conv", "CausalConvWithState"),
    # -- control flow and host-side selection (run where the model is cut) ------------------------
    ("If", "control_flow", "If"),
    ("Loop", "control_flow", "Loop"),
    ("Scan", "control_flow", "Scan"),
    ("NonMaxSuppression", "control_flow", "NonMaxSuppression"),
]


@lru_cache(maxsize=None)
def _classes() -> dict[str, type[Op]]:
    found: dict[str, type[Op]] = {}
    for op_type, module, cls_name in OPS:
        mod = importlib.import_module(f"vkpool.kernels.ops.{module}")
        found[op_type] = getattr(mod, cls_name)
    return found


def supported_ops() -> list[str]:
    """Sorted op types that have a kernel."""
    return sorted(_classes())


def op_class(op_type: str, domain: str = "") -> type[Op]:
    if domain not in ("", "ai.onnx"):
        raise UnsupportedOp(f"op {domain}::{op_type} is not supported (only the ai.onnx domain is)")
    cls = _classes().get(op_type)
    if cls is None:
        raise UnsupportedOp(
            f"op {op_type} is not supported; `vkpool ops` lists the {len(_classes())} supported ops"
        )
    return cls


def create_op(
    op_type: str,
    attrs: dict[str, Any],
    inputs: Sequence[TensorInfo | None],
    constants: dict[int, np.ndarray] | None = None,
    *,
    domain: str = "",
    opset: int = 17,
    num_outputs: int = 1,
) -> Op:
    return op_class(op_type, domain)(attrs, inputs, constants, opset=opset, num_outputs=num_outputs)


def unsupported_in(op_types: Sequence[tuple[str, str]]) -> list[str]:
    """The op types (with domain) in ``op_types`` that have no kernel, sorted, once each."""
    known = _classes()
    missing = {
        (f"{d}::{t}" if d not in ("", "ai.onnx") else t)
        for t, d in op_types
        if d not in ("", "ai.onnx") or t not in known
    }
    return sorted(missing)
