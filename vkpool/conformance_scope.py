"""Which ONNX backend node tests are in scope: those whose every op is in the core op set."""
from __future__ import annotations

#: the core op set: what the benchmark workloads and common CNN/MLP models use
CORE_OPS = frozenset("""
Conv Gemm MatMul Add Sub Mul Div Max Min Sum Mean Relu LeakyRelu Sigmoid Tanh Clip Softmax LogSoftmax
MaxPool AveragePool GlobalAveragePool GlobalMaxPool BatchNormalization LRN Concat Reshape Flatten
Transpose Squeeze Unsqueeze Identity Dropout Shape ConstantOfShape Constant
""".split())


def node_tests() -> dict[str, set[str]]:
    """Every node test case the installed onnx generates: name → op types its model uses."""
    from onnx.backend.test.loader import load_model_tests

    out: dict[str, set[str]] = {}
    for case in load_model_tests(kind="node"):
        if case.model is not None:
            out[case.name] = {n.op_type for n in case.model.graph.node}
    return out


def in_scope(ops: frozenset[str] = CORE_OPS) -> list[str]:
    return [name for name, used in node_tests().items() if used and used <= ops]
