"""float16 BERT and GPT-2 end to end (bench/fp16_models.py, exported small by torch), against
onnxruntime (CPU) on the same float16 file and against a float32 reference of the same model.

Each model runs the fused path (Attention nodes, products with their bias and GELU, residual
LayerNorms: the loader's rewrites are checked by the op counts) on the real Vulkan device.

Tolerances, errors relative to the largest output (max|y - ref| / max|ref|):
- against onnxruntime on the float16 file: at most 1e-2 (float16 keeps 11 significant bits;
  two float16 evaluations of a two-layer model differ by a few roundings of the largest output);
- against the float32 reference (the float16 module's own weights, widened, exported in float32
  and run by onnxruntime): at most twice onnxruntime's own float16 error against it, plus 1e-3.
  So the difference is float16 rounding, of the size every float16 runtime has, not a bug: a
  dropped bias or a wrong mask is off by 10^-1 or more.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

import vkpool
from bench import export_models as em
from bench import fp16_models
from vkpool.model import load_model

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the references")
torch = pytest.importorskip("torch", reason="torch exports the models")

MAX_REL_ERR = 1e-2
FP32_FACTOR, FP32_SLACK = 2.0, 1e-3

SMALL: dict[str, dict[str, int]] = {
    "bert": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 96, "seq": 19, "vocab": 100},
    "gpt2": {"layers": 2, "hidden": 48, "heads": 4, "seq": 21, "vocab": 101},
}


def _rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref.astype(np.float64)).max() / np.abs(ref.astype(np.float64)).max())


def _without_same_type_casts(data: bytes) -> bytes:
    """``data`` without its Casts to the type their input has (no-ops): some onnxruntime releases
    (1.2x) refuse them in float16 graphs ("InsertedPrecisionFreeCast ... does not match")."""
    m = onnx.shape_inference.infer_shapes(onnx.load_from_string(data))
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.input]}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    outputs = {o.name for o in m.graph.output}
    renamed: dict[str, str] = {}
    kept = []
    for node in m.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and to == types.get(node.input[0]) and node.output[0] not in outputs:
            renamed[node.output[0]] = node.input[0]
        else:
            kept.append(node)
    del m.graph.node[:]
    m.graph.node.extend(kept)
    return m.SerializeToString()


def _ort(data: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    data = _without_same_type_casts(data)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _check(pool, half: bytes, wide: bytes, feeds: dict[str, np.ndarray]) -> None:
    ref16, ref32 = _ort(half, feeds), _ort(wide, feeds)
    assert ref16.dtype == np.float16 and ref32.dtype == np.float32
    with vkpool.Session(half, pool=pool, device=pool.vulkan_members[0].id) as session:
        (y,) = session.run(None, feeds)
    assert y.dtype == np.float16 and y.shape == ref16.shape
    own = _rel_err(ref16, ref32)
    assert _rel_err(y, ref16) <= MAX_REL_ERR
    assert _rel_err(y, ref32) <= FP32_FACTOR * own + FP32_SLACK, (_rel_err(y, ref32), own)


def _fused(data: bytes) -> Counter:
    return Counter(n.op_type for n in load_model(data, cache=False).nodes)


@pytest.mark.parametrize("name", list(SMALL))
def test_float16_export_of_the_benchmark_transformer(pool, name: str) -> None:
    built = fp16_models.half(em.build(name, **SMALL[name]))
    half = em.to_onnx(built)
    built.module.float()  # the same float16-rounded weights, in float32
    wide = em.to_onnx(built)
    types = {t.type.tensor_type.elem_type for t in onnx.load_from_string(half).graph.output}
    assert types == {onnx.TensorProto.FLOAT16}
    ops = _fused(half)
    layers = SMALL[name]["layers"]
    # per layer: the up product (bias and GELU inside), one attention that computes the packed q, k
    # and v product, two norms that compute the out and down products they normalise
    assert ops["Attention"] == layers and ops["Softmax"] == 0 and ops["Erf"] == ops["Tanh"] == 0, ops
    assert ops["MatMul"] == layers + (name == "gpt2"), ops
    assert ops["LayerNormalization"] == 2 * layers + 1, ops
    products = Counter(n.op_type for n in load_model(half, cache=False).nodes if n.attrs.get("product"))
    assert products == {"LayerNormalization": 2 * layers, "Attention": layers}, products
    _check(pool, half, wide, built.inputs)


def _hf_pair(name: str) -> tuple[bytes, bytes, dict[str, np.ndarray]]:
    """The float16 export and a float32 export of the same (float16-rounded) weights."""
    pytest.importorskip("transformers", reason="Hugging Face transformers builds the model")
    build = fp16_models.hf_bert if name == "hf_bert" else fp16_models.hf_gpt2
    half, feeds = build()
    wide, _ = build(dtype="float32")
    return half, wide, feeds


def test_float16_hugging_face_bert_with_padding(pool) -> None:
    half, wide, feeds = _hf_pair("hf_bert")
    assert feeds["attention_mask"].min() == 0  # a padded sequence: the mask is a real input
    ops = _fused(half)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0 and ops["Erf"] == 0, ops
    _check(pool, half, wide, feeds)


def test_float16_hugging_face_gpt2(pool) -> None:
    half, wide, feeds = _hf_pair("hf_gpt2")
    ops = _fused(half)
    # Conv1D's products are Gemms (bias inside); the Cast of the probabilities to their own type goes
    # and the GELU after each Conv1D (through the Reshape back from rows) joins its product; the
    # attention reads Q, K and V from the packed projection, not from a Split's copies
    assert ops["Attention"] == 2 and ops["Softmax"] == 0 and ops["Cast"] == 0 and ops["Tanh"] == 0, ops
    assert ops["Split"] == 0, ops
    _check(pool, half, wide, feeds)
