"""Load-time fusion of float16 transformer blocks and the fused float16 kernels, on the real
Vulkan device: the float32 graphs of test_fusion_transformer.py cast to float16 (every tensor and
weight), fused the same way, against the same graph unfused on onnxruntime (CPU) and against an
exact float64 evaluation of the same float16 inputs and weights.

Tolerances (errors relative to the largest output, "max|y - ref| / max|ref|"). A fused kernel
widens its float16 inputs, computes in float32 and rounds its output once: one kernel alone is
within 2^-10 of the exact values (half a float16 ulp of the largest output, 2^-11, plus the
float32 rounding of its sums). A graph of several ops rounds between them, in vkpool as in
onnxruntime, which rounds after every op of the unfused graph; vkpool's error from the exact
values must be at most twice onnxruntime's plus 2^-9 (four float16 roundings of the largest
output: a rounding of an input to a softmax or a norm moves its output by a few), and every
element within 2^-8 |ort| + 2^-9 max|ort| of onnxruntime's. A wrong mask, bias or activation is
off by far more (10^-2 to 1).

lavapipe has no cooperative matrices: the tests here run the scalar float16 GEMM there; the
cooperative-matrix kernel's fused epilogue has its own test, which runs on a GPU whose driver
offers VK_KHR_cooperative_matrix and skips elsewhere, and the kernel choice is checked without
the extension by telling the planner what a GPU's device reports.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import vkpool
from conftest import vulkan_pool
from test_fp16_gemm import coop_member
from test_fusion_transformer import (
    ATTENTION_CASES, GELU_ERF, GELU_TANH_POW, SCALARS, _attention, _linear, _model, _residual_block, _w,
)
from vkpool.kernels.base import DeviceCaps, DispatchContext, TensorInfo
from vkpool.kernels.ops.gemm import MatmulProblem, apply_activation
from vkpool.kernels.ops.gemm_f16 import COOP_TILES, SPLIT_TILE, CoopTile, HalfMatmulPlan, coop_shape
from vkpool.kernels.registry import create_op
from vkpool.model import load_model

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the unfused outputs")
RNG = np.random.default_rng(1616)
F16 = np.float16
#: the files' IR version: one the onnxruntime releases of the last two years read (1.2x reads <= 10)
IR_VERSION = 10
#: the attention tests lower the loop limit below what the row-per-invocation kernel of CPU-like
#: devices needs (it loops over every key) and above the tiled kernel's, to run the tiled kernel on
#: lavapipe; then also the shared memory below any tile, to run the one-row-per-workgroup kernel
NO_TILE = ",max_shared_memory_bytes=2048"


def half_model(model: bytes) -> bytes:
    """``model`` with every float32 tensor (inputs, outputs, weights) in float16; weights beyond
    float16's range saturate (a float32 mask fill of finfo(float32).min becomes -65504, as torch
    fills float16 scores)."""
    m = onnx.load_from_string(model)
    big = float(np.finfo(F16).max)
    for i, init in enumerate(m.graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            value = np.clip(numpy_helper.to_array(init), -big, big).astype(F16)
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, init.name))
    for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    m.ir_version = IR_VERSION
    return m.SerializeToString()


def exact(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``model`` (float16) evaluated in float64 on its own float16 weights and inputs: onnx's
    reference evaluator on the graph with every float16 and float32 tensor (and Cast) widened."""
    from onnx.reference import ReferenceEvaluator

    floats = (TensorProto.FLOAT16, TensorProto.FLOAT)
    m = onnx.load_from_string(model)
    for i, init in enumerate(m.graph.initializer):
        if init.data_type in floats:
            wide = numpy_helper.to_array(init).astype(np.float64)
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(wide, init.name))
    for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        if vi.type.tensor_type.elem_type in floats:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in m.graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i in floats:
                attr.i = TensorProto.DOUBLE
    wide_feeds = {k: v.astype(np.float64) if v.dtype == F16 else v for k, v in feeds.items()}
    return ReferenceEvaluator(m).run(None, wide_feeds)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want| / max|want|"""
    want = np.asarray(want, np.float64)
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


def assert_fp16_close(got: np.ndarray, want: np.ndarray, rtol: float, atol_scale: float, what: str) -> None:
    want = np.asarray(want, np.float64)
    err = np.abs(got.astype(np.float64) - want)
    tol = rtol * np.abs(want) + atol_scale * np.abs(want).max()
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"{what}: error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"


def check_half(pool, model: bytes, feeds: dict[str, np.ndarray], member=None) -> vkpool.Session:
    """vkpool's outputs of float16 ``model`` against the exact values and onnxruntime's."""
    feeds = {k: v.astype(F16) if v.dtype in (np.float32, np.float64) else v for k, v in feeds.items()}
    unfused = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    session = vkpool.Session(model, pool=pool, device=(member or pool.vulkan_members[0]).id)
    for got, ref, want in zip(session.run(None, feeds), unfused, exact(model, feeds)):
        assert got.dtype == F16 and ref.dtype == F16
        assert rel_err(got, want) <= 2 * rel_err(ref, want) + 2.0 ** -9, \
            f"vkpool {rel_err(got, want):.2e} from the exact values, onnxruntime {rel_err(ref, want):.2e}"
        assert_fp16_close(got, ref, 2.0 ** -8, 2.0 ** -9, "vkpool against onnxruntime")
    return session


def fused_ops(model: bytes) -> list[tuple[str, object]]:
    return [(n.op_type, n.attrs.get("activation")) for n in load_model(model, cache=False).nodes]


# -- products: bias and GELU in the epilogue -----------------------------------------------------

@pytest.mark.parametrize("chain,activation", [(GELU_ERF, "Gelu"), (GELU_TANH_POW, "GeluTanh")], ids=["erf", "tanh"])
def test_a_float16_linear_with_spelled_out_gelu_is_one_product(pool, chain, activation):
    model = half_model(_linear(chain, extra_inits=SCALARS))
    assert fused_ops(model) == [("MatMul", activation)]
    with check_half(pool, model, {"x": RNG.standard_normal((2, 5, 10)) * 3}) as session:
        # the cooperative-matrix kernel where the device has one (a GPU), the scalar one elsewhere
        kernel = "gemm_coopmat" if coop_shape(session._chunk.device.caps) else "gemm_f16"
        assert session._chunk.dispatch_labels[-1].endswith(f"[{kernel}]")


def test_a_float16_gemm_with_bias_and_gelu(pool):
    # Hugging Face's GPT-2 (Conv1D): Gemm on rows with a bias row; nn.Linear's transB=1 on a constant
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1), helper.make_node("Gelu", ["h"], ["y"])]
    model = half_model(_model(nodes, [("x", (19, 37))], [_w("w", 29, 37), _w("b", 1, 29)], ["y"], opset=20))
    assert fused_ops(model) == [("Gemm", "Gelu")]
    check_half(pool, model, {"x": RNG.standard_normal((19, 37))}).close()


def test_a_gelu_after_a_reshape_of_the_products_rows_joins_the_product(pool):
    # Hugging Face's Conv1D: Gemm on [B*S, E] rows, Reshape back to [B, S, N], then the GELU chain
    nodes = [helper.make_node("Reshape", ["x", "rows"], ["x2"]), helper.make_node("Gemm", ["x2", "w", "b"], ["p"]),
             helper.make_node("Reshape", ["p", "back"], ["h"]), *GELU_TANH_POW]
    inits = [_w("w", 24, 40), _w("b", 40), numpy_helper.from_array(np.array([-1, 24], np.int64), "rows"),
             numpy_helper.from_array(np.array([2, 7, 40], np.int64), "back"), *SCALARS]
    model = half_model(_model(nodes, [("x", (2, 7, 24))], inits, ["y"]))
    assert fused_ops(model) == [("Reshape", None), ("Gemm", "GeluTanh"), ("Reshape", None)]
    check_half(pool, model, {"x": RNG.standard_normal((2, 7, 24)) * 2}).close()


def test_a_float16_gemm_the_kernels_cannot_run_is_refused_with_the_reason():
    from vkpool.kernels.base import UnsupportedOp

    a, b = TensorInfo((4, 6), F16), TensorInfo((6, 5), F16)
    for attrs, c in (({"transA": 1}, None), ({"alpha": 2.0}, None), ({}, TensorInfo((4, 5), F16))):
        infos = [TensorInfo((6, 4), F16) if attrs.get("transA") else a, b, *([c] if c else [])]
        with pytest.raises(UnsupportedOp, match="float16"):
            create_op("Gemm", attrs, infos, opset=13)
    # transB on a B computed at run time: its transpose cannot be stored at load
    with pytest.raises(UnsupportedOp, match="constant B"):
        create_op("Gemm", {"transB": 1}, [a, TensorInfo((5, 6), F16)], opset=13)


def test_a_float16_chain_that_is_not_gelu_stays():
    other = [helper.make_node("Div", ["h", "c15"], ["d"]), *GELU_ERF[1:]]
    model = half_model(_linear(other, extra_inits=(*SCALARS, numpy_helper.from_array(np.float32(1.5), "c15"))))
    assert [op for op, _ in fused_ops(model)] == ["MatMul", "Div", "Erf", "Add", "Mul", "Mul"]


# -- attention -------------------------------------------------------------------------------------

@ATTENTION_CASES
def test_float16_attention_becomes_one_node(pool, b, s, t, h, d, mask, key, scale):
    model, feeds = _attention(b, s, t, h, d, mask=mask, key=key, scale=scale)
    model = half_model(model)
    ops = [op for op, _ in fused_ops(model)]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and "Transpose" not in ops, ops
    with check_half(pool, model, feeds) as session:
        kernel = _device_kernel(session._chunk.device.caps)
        assert any(label.endswith(f"[{kernel}]") for label in session._chunk.dispatch_labels)


def _self_attention(b: int, s: int, h: int, d: int, mask: str) -> tuple[bytes, dict[str, np.ndarray]]:
    """``_attention`` with keys and values projected from the queries' own input (self-attention)."""
    model, feeds = _attention(b, s, s, h, d, mask=mask)
    m = onnx.load_from_string(half_model(model))
    for node in m.graph.node:
        node.input[:] = ["x" if name == "kv" else name for name in node.input]
    m.graph.input.remove(next(i for i in m.graph.input if i.name == "kv"))
    feeds.pop("kv")
    return m.SerializeToString(), feeds


@pytest.mark.parametrize("limits,kernel", [
    ("", None), ("max_loop_iterations=300", "attention_tiled"), ("max_loop_iterations=300" + NO_TILE, "attention"),
])
@pytest.mark.parametrize("mask", ["add", "causal"])
def test_float16_self_attention_reads_one_qkv_product(limits, kernel, mask):
    model, feeds = _self_attention(2, 19, 3, 8, mask)
    nodes = load_model(model, cache=False).nodes
    attention = next(n for n in nodes if n.op_type == "Attention")
    assert attention.attrs["packed_qkv"] == [24, 24, 24] and attention.inputs[1:3] == ["", ""]
    # the attention computes the Q/K/V product itself: A = x, the packed weights and bias at 7 and 8
    assert attention.attrs["product"] == 1 and attention.inputs[0] == "x" and len(attention.inputs) == 9
    assert [n.op_type for n in nodes].count("MatMul") == 1  # the output's
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", limits)
        p = vulkan_pool()
    try:
        with check_half(p, model, feeds) as session:
            want = kernel or _device_kernel(session._chunk.device.caps)
            assert any(label.endswith(f"[{want}]") for label in session._chunk.dispatch_labels)
    finally:
        p.close()


def test_the_packed_attention_reference_reads_the_same_columns():
    b, s, hq, d = 1, 5, 2, 3
    q, k, v = (RNG.standard_normal((b, s, hq * d)).astype(F16) for _ in range(3))
    attrs = {"q_num_heads": hq, "kv_num_heads": hq, "is_causal": 1}
    infos = [TensorInfo(q.shape, F16)] * 3
    (plain,) = create_op("Attention", attrs, infos, opset=23).reference([q, k, v])
    packed_op = create_op("Attention", {**attrs, "packed_qkv": [6, 6, 6]}, [TensorInfo((b, s, 18), F16), None, None],
                          opset=23)
    (packed,) = packed_op.reference([np.concatenate([q, k, v], axis=-1), None, None])
    np.testing.assert_array_equal(plain, packed)


def test_float16_causal_fill_is_the_lowest_half():
    # torch fills float16 scores with finfo(float16).min (-65504), not -inf: still the causal flag
    model, _ = _attention(1, 6, 6, 2, 4, mask="causal")
    m = onnx.load_from_string(half_model(model))
    fill = next(i for i in m.graph.initializer if i.name == "fill")
    assert numpy_helper.to_array(fill) == np.finfo(F16).min
    nodes = load_model(m.SerializeToString(), cache=False).nodes
    assert next(n for n in nodes if n.op_type == "Attention").attrs["is_causal"] == 1
    # a fill float16 scores can reach is no mask
    fill.CopyFrom(numpy_helper.from_array(np.array(-3e4, F16), "fill"))
    assert "Attention" not in [n.op_type for n in load_model(m.SerializeToString(), cache=False).nodes]


def attention64(q, k, v, mask, hq: int, hkv: int, scale: float) -> np.ndarray:
    """Causal attention of 3-D float16 Q/K/V with an additive mask, in float64."""
    b, s, e = q.shape
    t, d = k.shape[1], e // hq

    def heads(x, h, n):
        return np.repeat(x.astype(np.float64).reshape(b, n, h, d).transpose(0, 2, 1, 3), hq // h, axis=1)

    scores = heads(q, hq, s) @ heads(k, hkv, t).transpose(0, 1, 3, 2) * scale + mask.astype(np.float64)
    scores = np.where(np.tril(np.ones((s, t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    y = (p / p.sum(axis=-1, keepdims=True)) @ heads(v, hkv, t)
    return y.transpose(0, 2, 1, 3).reshape(b, s, e)


def _device_kernel(caps: DeviceCaps) -> str:
    """The attention kernel a device takes without lowered limits (lavapipe: its CPU-like one)."""
    return "attention_rows" if caps.cpu_like else "attention_tiled"


@pytest.mark.parametrize("limits,kernel", [
    ("", None),                                                     # the device's own choice
    ("max_loop_iterations=600,max_shared_memory_bytes=4096", "attention_tiled"),  # tiles of 16 keys
    ("max_loop_iterations=600" + NO_TILE, "attention"),                            # a row per workgroup
])
def test_float16_attention_follows_the_device_limits(limits, kernel):
    from node_cases import run_node

    b, hq, hkv, s, t, d = 1, 4, 2, 20, 70, 5
    q, k, v = (RNG.standard_normal(shape).astype(F16) for shape in ((b, s, hq * d), (b, t, hkv * d), (b, t, hkv * d)))
    mask = (RNG.standard_normal((b, 1, s, t)) * 2).astype(F16)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1, "scale": 0.7}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", limits)
        p = vulkan_pool()
    try:
        got, _ = run_node(p, "Attention", [q, k, v, mask], attrs, opset=23,
                          expected=[np.zeros((b, s, hq * d), F16)])
        caps = p.vulkan_members[0].device.caps
        op = create_op("Attention", attrs, [TensorInfo(x.shape, F16) for x in (q, k, v, mask)], opset=23)
        (d0,) = op.dispatches(DispatchContext(["q", "k", "v", "mask"], ["y"], "ws", caps, {}))
        assert d0.shader == (kernel or _device_kernel(caps))
        assert got[0].dtype == F16
        assert rel_err(got[0], attention64(q, k, v, mask, hq, hkv, 0.7)) <= 2.0 ** -10, d0.shader
    finally:
        p.close()


@pytest.mark.parametrize("b,hq,hkv,s,t,d,mask,causal,layout", [
    (1, 12, 12, 128, 128, 64, "padding", 0, "V_APART,ROW_SHUFFLE"),   # BERT-base's heads, a padding mask
    # the same where the values must share the keys' memory (47,680 bytes apart, 31,296 shared),
    # and with the softmax rows combined through shared memory
    (1, 12, 12, 128, 128, 64, "padding", 0, "ROW_SHUFFLE"),
    (1, 12, 12, 128, 128, 64, "padding", 0, "V_APART"),
    (1, 12, 12, 128, 128, 64, "padding", 0, ""),
    (2, 4, 2, 37, 37, 32, None, 1, "V_APART,ROW_SHUFFLE"),   # grouped heads, a length no tile fills, causal
    (1, 3, 3, 20, 70, 16, "add", 1, "V_APART,ROW_SHUFFLE"),  # cross-attention: more keys than queries
    (2, 2, 2, 33, 40, 48, "bool", 0, "V_APART,ROW_SHUFFLE"),  # a boolean mask with a row masked whole
], ids=["bert", "bert-v-shared", "bert-rows-in-memory", "bert-neither", "grouped-causal", "cross-add",
        "bool-masked-row"])
def test_attention_on_cooperative_matrices_on_a_gpu(pool, monkeypatch, request, b, hq, hkv, s, t, d, mask, causal,
                                                   layout):
    """attention_coop.comp (float16, whole rows of scores in shared memory) against the float64
    reference: within 2^-10 of the largest output (its probabilities are rounded to float16). Its
    layouts: the values in shared memory of their own where it fits (lowered to 40 KiB here, they
    share the keys'), a softmax row's invocations combining by subgroup shuffles where the device
    has them (taken away here, through shared memory)."""
    from node_cases import run_node

    member = coop_member(pool)  # skips on a device without cooperative matrices
    if "V_APART" not in layout:
        monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", "max_shared_memory_bytes=40960")
        pool = vulkan_pool()
        request.addfinalizer(pool.close)
        member = coop_member(pool)
    if "ROW_SHUFFLE" not in layout:
        monkeypatch.setattr(member.device, "caps", dataclasses.replace(member.device.caps, subgroup_shuffle=False))
    q, k, v = (RNG.standard_normal(shape).astype(F16) for shape in ((b, s, hq * d), (b, t, hkv * d), (b, t, hkv * d)))
    m = None
    if mask == "padding":
        m = np.where(np.arange(t) < t - 9, 0.0, -65504.0).reshape(1, 1, 1, t).astype(F16)
    elif mask == "add":
        m = (RNG.standard_normal((b, 1, s, t)) * 2).astype(F16)
    elif mask == "bool":
        m = RNG.random((b, 1, s, t)) > 0.3
        m[0, 0, 3, :] = False
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": causal}
    inputs = [q, k, v] + ([m] if m is not None else [])
    op = create_op("Attention", attrs, [TensorInfo(x.shape, x.dtype) for x in inputs], opset=23)
    (d0,) = op.dispatches(DispatchContext(["q", "k", "v", "m"][:len(inputs)], ["y"], "ws", member.device.caps, {}))
    assert d0.shader == "attention_coop"
    assert {k for k in ("V_APART", "ROW_SHUFFLE") if d0.defines[k]} == set(filter(None, layout.split(","))), d0.defines
    got, _ = run_node(pool, "Attention", inputs, attrs, opset=23, expected=[np.zeros((b, s, hq * d), F16)],
                      device=member.id)
    wide = [x.astype(np.float64) if x.dtype == F16 else x for x in inputs]
    op64 = create_op("Attention", attrs, [TensorInfo(x.shape, np.float32 if x.dtype == F16 else x.dtype)
                                          for x in inputs], opset=23)
    want = op64.reference([x.astype(np.float32) if x.dtype == np.float64 else x for x in wide])[0]
    if mask == "bool":
        assert not got[0][0, 3].any(), "a row masked whole is zeros"
    assert rel_err(got[0], want) <= 2.0 ** -10


@pytest.mark.parametrize("b,s,h,d,mask,bias,split", [
    (2, 19, 3, 16, "causal", False, False),
    (1, 128, 12, 64, "add", True, True),    # BERT-base's Q/K/V product: split over K
    (1, 128, 12, 64, "causal", False, True),
], ids=["small", "bert-split-bias", "split-causal"])
def test_float16_self_attention_on_cooperative_matrices_computes_its_product_on_a_gpu(pool, b, s, h, d, mask, bias,
                                                                                      split):
    """The attention computes the packed Q/K/V product; split over K, attention_coop.comp adds its
    partial sums (and the bias) as it stages Q, K and V: two dispatches."""
    member = coop_member(pool)
    model, feeds = _self_attention(b, s, h, d, mask)
    if bias:  # a bias on each projection
        m = onnx.load_from_string(model)
        for node in list(m.graph.node):
            if node.op_type == "MatMul" and node.output[0] in ("q", "k", "v"):
                out = node.output[0]
                node.output[0] = f"{out}_unbiased"
                m.graph.node.append(helper.make_node("Add", [f"{out}_unbiased", f"b{out}"], [out]))
                m.graph.initializer.append(numpy_helper.from_array((RNG.standard_normal(h * d) * 0.3).astype(F16), f"b{out}"))
        model = _sorted(m).SerializeToString()  # the Adds were appended: put them after their products
    with check_half(pool, model, feeds, member) as session:
        shaders = [label.split("[")[1].rstrip("]") for label in session._chunk.dispatch_labels
                   if label.startswith("Attention")]
        assert shaders == ["gemm_coopmat", "attention_coop"], shaders  # no pass of the split's own
        (node,) = [n for n in session.model.nodes if n.op_type == "Attention"]
        infos = [session.model.tensors.get(t) if t else None for t in node.inputs]
        op = create_op("Attention", node.attrs, infos, {7: session.model.constants[node.inputs[7]]}, opset=23)
        assert node.attrs["product"] == 1 and (op.product.splits > 1) == split


def _sorted(m: onnx.ModelProto) -> onnx.ModelProto:
    """``m`` with its nodes in an order where each reads only what earlier ones made."""
    known = {i.name for i in m.graph.input} | {i.name for i in m.graph.initializer} | {""}
    pending, ordered = list(m.graph.node), []
    while pending:
        node = next(n for n in pending if all(i in known for i in n.input))
        pending.remove(node)
        ordered.append(node)
        known.update(node.output)
    del m.graph.node[:]
    m.graph.node.extend(ordered)
    return m


# -- residual Add into LayerNormalization, and the Casts around norms and softmaxes ------------------

@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("rows_max,kernel", [(None, "norm_rows"), (8, "norm")])
def test_a_float16_residual_add_and_its_product_join_the_layernorm(pool, monkeypatch, pre_norm, rows_max, kernel):
    """The residual block's product (the residual's other operand here) is computed by the norm:
    on lavapipe, unsplit, into Y, then normalised in place by either norm kernel (norm.comp where
    rows are longer than norm_rows.comp takes: that limit lowered)."""
    from vkpool.kernels.ops import norms

    if rows_max is not None:
        monkeypatch.setattr(norms, "_ROWS_MAX", rows_max)
    model = half_model(_residual_block(pre_norm))
    nodes = load_model(model, cache=False).nodes
    norm = next(n for n in nodes if n.op_type == "LayerNormalization")
    assert norm.attrs["residual"] == 1 and norm.attrs["product"] == 1
    assert norm.inputs == ["x", "g", "bn", "x", "w"]  # A, scale, bias, residual, W
    assert [n.op_type for n in nodes] == ["LayerNormalization"] + (["Add"] if pre_norm else [])
    with check_half(pool, model, {"x": RNG.standard_normal((2, 9, 13))}) as session:
        norm_shaders = [label.split("[")[1].rstrip("]") for label in session._chunk.dispatch_labels
                        if label.startswith("LayerNormalization")]
        assert norm_shaders in (["gemm_f16", kernel], ["gemm_coopmat", kernel])  # a GPU: unsplit (K 13)


def _linear_norm(act: str | None = None, read_twice: bool = False, dtype_half: bool = True) -> bytes:
    """LayerNorm(x + Linear(x)) with a bias, Linear's output optionally through an activation or
    also a graph output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["h"])]
    if act:
        nodes.append(helper.make_node(act, ["h"], ["ha"]))
    h = "ha" if act else "h"
    nodes += [helper.make_node("Add", [h, "x"], ["s"]),
              helper.make_node("LayerNormalization", ["s", "g", "bn"], ["n"], axis=-1, epsilon=1e-5)]
    outputs = ["n", h] if read_twice else ["n"]
    model = _model(nodes, [("x", (3, 5, 24))], [_w("w", 24, 24), _w("b", 24), _w("g", 24), _w("bn", 24)], outputs)
    return half_model(model) if dtype_half else model


@pytest.mark.parametrize("case,folded", [
    ({}, True), ({"act": "Relu"}, False), ({"read_twice": True}, False), ({"dtype_half": False}, False),
], ids=["linear", "activation", "product-read-elsewhere", "float32"])
def test_which_products_a_layernorm_takes_in(case, folded):
    model = _linear_norm(**case)
    nodes = load_model(model, cache=False).nodes
    norm = next(n for n in nodes if n.op_type == "LayerNormalization")
    assert ("product" in norm.attrs) == folded
    assert ("MatMul" in [n.op_type for n in nodes]) != folded
    if folded:
        assert norm.inputs == ["x", "g", "bn", "x", "w", "b"]


def test_a_layernorm_with_its_product_runs_on_the_host_in_onnxruntime(pool):
    """The host member's onnxruntime model spells the norm's product (and its bias) out again."""
    model = _linear_norm()
    x = RNG.standard_normal((3, 5, 24)).astype(F16)
    want = exact(model, {"x": x})[0]
    with vkpool.Session(model, pool=pool, device="cpu") as s:
        assert any(n.attrs.get("product") for n in s.model.nodes)
        if pool.member("cpu").engine != "numpy":
            assert s.plan.engine.startswith("onnxruntime"), s.plan.engine_note
        got = s.run(None, {"x": x})[0]
    assert rel_err(got, want) <= 2.0 ** -9


@pytest.mark.parametrize("bias,residual,sum_out", [(True, True, True), (False, True, False)])
def test_norm_rows_adds_a_split_products_partial_sums(pool, bias, residual, sum_out):
    """norm_rows.comp reading a split product's float32 partial sums (NSPLITS) and its bias, run
    alone on partials the test writes (lavapipe splits no product: a split needs cooperative
    matrices): the same as the norm of their float32 sum."""
    from vkpool.kernels.base import pack_push_constants

    member = pool.vulkan_members[0]
    device = member.device
    rows, k, n, splits = 5, 96, 300, 3
    infos = [TensorInfo((rows, k), F16), TensorInfo((n,), F16), TensorInfo((n,), F16), TensorInfo((rows, n), F16),
             TensorInfo((k, n), F16)] + ([TensorInfo((n,), F16)] if bias else [])
    w = RNG.standard_normal((k, n)).astype(F16)
    node = create_op("LayerNormalization", {"residual": 1, "product": 1}, infos, {4: w}, opset=17,
                     num_outputs=4 if sum_out else 1)
    parts = RNG.standard_normal((splits, rows, n)).astype(np.float32)
    res = RNG.standard_normal((rows, n)).astype(F16)
    scale, beta, pbias = (1 + RNG.standard_normal(n) * 0.1).astype(F16), *(RNG.standard_normal((2, n)) * 0.3).astype(F16)
    bufs = [member.alloc(a.nbytes) for a in (parts, scale, beta, res, pbias, res, res)]
    try:
        for buf, a in zip(bufs, (parts, scale, beta, res, pbias)):
            member.upload(buf, a)
        ctx = DispatchContext(["a", bufs[1], bufs[2], bufs[3] if residual else None, "w", bufs[4] if bias else None],
                              [bufs[5], None, None, bufs[6] if sum_out else None], None, device.caps, {})
        (d,) = node.norm_dispatches(ctx, bufs[0], (splits, bufs[4] if bias else None, n))
        assert d.shader == "norm_rows" and d.defines["NSPLITS"] == splits and d.defines["PBIAS"] == int(bias)
        device.run_once([("dispatch", device.pipeline(d.shader, d.defines),
                          pack_push_constants(d.args, lambda alloc: alloc.address), d.groups)])
        y, total = (member.download(buf, (rows, n), F16) for buf in bufs[5:])
    finally:
        for buf in bufs:
            buf.free()
    x = parts.sum(axis=0, dtype=np.float64) + (pbias if bias else 0) + res
    if sum_out:
        assert_fp16_close(total, x, 2.0 ** -11, 2.0 ** -20, "the residual sum")
    assert rel_err(y, _norm64(x, scale, beta, -1, False)) <= 2.0 ** -10


@pytest.mark.parametrize("m,k,n", [(128, 3072, 768), (37, 1000, 53)])
def test_a_layernorm_adds_its_split_products_partials_on_a_gpu(pool, m, k, n):
    """On a device with cooperative matrices, the norm's product is split over K and the norm reads
    its partial sums: two dispatches, against the float64 norm of the float16 inputs (N 53: the
    weights stored transposed, edges in every dimension)."""
    member = coop_member(pool)
    w, b = (RNG.uniform(-1, 1, (k, n)) / 8).astype(F16), RNG.standard_normal(n).astype(F16)
    scale, beta = (1 + RNG.standard_normal(n) * 0.1).astype(F16), (RNG.standard_normal(n) * 0.1).astype(F16)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["h"]),
             helper.make_node("Add", ["h", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "bn"], ["y"], axis=-1, epsilon=1e-5)]
    ins = [helper.make_tensor_value_info(name, TensorProto.FLOAT16, shape) for name, shape in (("a", (m, k)), ("r", (m, n)))]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT16, (m, n))],
                              [numpy_helper.from_array(v, name) for name, v in (("w", w), ("b", b), ("g", scale), ("bn", beta))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION).SerializeToString()
    a, r = RNG.uniform(-1, 1, (m, k)).astype(F16), RNG.standard_normal((m, n)).astype(F16)
    with vkpool.Session(model, pool=pool, device=member.id) as session:
        assert [n.op_type for n in session.model.nodes if n.attrs.get("product")] == ["LayerNormalization"]
        assert [label.split("[")[1].rstrip("]") for label in session._chunk.dispatch_labels
                if label.startswith("LayerNormalization")] == ["gemm_coopmat", "norm_rows"]
        got = session.run(None, {"a": a, "r": r})[0]
    x = a.astype(np.float64) @ w.astype(np.float64) + b + r
    assert rel_err(got, _norm64(x, scale, beta, -1, False)) <= 2.0 ** -9


def _norm64(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, axis: int, rms: bool) -> np.ndarray:
    v = x.astype(np.float64)
    axes = tuple(range(axis % v.ndim, v.ndim))
    mean = 0.0 if rms else v.mean(axis=axes, keepdims=True)
    y = (v - mean) / np.sqrt(((v - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5) * scale
    return y + bias if bias is not None else y


@pytest.mark.parametrize("limits,kernel", [("", "norm_rows"), ("max_workgroup_invocations=128", "norm")])
@pytest.mark.parametrize("op,shape,axis", [
    ("LayerNormalization", (3, 7, 45), -1), ("LayerNormalization", (2, 5, 3, 7), -2),
    ("LayerNormalization", (2, 1100), -1),  # more than one element per invocation
    ("RMSNormalization", (4, 33), -1),
])
def test_float16_norms_on_both_kernels(limits, kernel, op, shape, axis):
    """A float16 norm over trailing axes takes norm_rows.comp, or norm.comp on a device with fewer than
    256 invocations per workgroup: both within a float16 rounding of the exact values."""
    from node_cases import run_node

    x = (RNG.standard_normal(shape) * 3 + 1).astype(F16)
    scale = (1 + RNG.standard_normal(shape[axis:]) * 0.2).astype(F16)
    bias = (RNG.standard_normal(shape[axis:]) * 0.2).astype(F16) if op == "LayerNormalization" else None
    inputs = [x, scale] + ([bias] if bias is not None else [])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", limits)
        p = vulkan_pool()
    try:
        got, _ = run_node(p, op, inputs, {"axis": axis, "epsilon": 1e-5}, constants=(1, 2), opset=23,
                          expected=[np.zeros(shape, F16)])
        node = create_op(op, {"axis": axis}, [TensorInfo(t.shape, t.dtype) for t in inputs], opset=23)
        context = DispatchContext(["x", "scale", "bias"][:len(inputs)], ["y"], None, p.vulkan_members[0].device.caps, {})
        assert [d.shader for d in node.dispatches(context)] == [kernel]
    finally:
        p.close()
    assert got[0].dtype == F16
    assert rel_err(got[0], _norm64(x, scale, bias, axis, op == "RMSNormalization")) <= 2.0 ** -10, kernel


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup-sums", "shared-memory-sums"])
def test_norm_rows_sums_with_and_without_subgroup_arithmetic(pool, subgroups):
    """norm_rows.comp's two ways of summing a row (the device's subgroup arithmetic decides), run
    alone with a residual and the sum written out."""
    from vkpool.kernels.base import pack_push_constants

    member = pool.vulkan_members[0]
    device = member.device
    rows, n = 6, 777
    x, res = ((RNG.standard_normal((rows, n)) * 2).astype(F16) for _ in range(2))
    scale, bias = (1 + RNG.standard_normal(n) * 0.1).astype(F16), (RNG.standard_normal(n) * 0.1).astype(F16)
    infos = [TensorInfo(x.shape, F16), TensorInfo(scale.shape, F16), TensorInfo(bias.shape, F16),
             TensorInfo(x.shape, F16)]
    node = create_op("LayerNormalization", {"residual": 1}, infos, opset=17, num_outputs=4)
    bufs = [member.alloc(a.nbytes) for a in (x, scale, bias, res, x, x)]
    caps = dataclasses.replace(device.caps, subgroup_arithmetic=subgroups)
    try:
        for buf, a in zip(bufs, (x, scale, bias, res)):
            member.upload(buf, a)
        (d,) = node.dispatches(DispatchContext(bufs[:4], [bufs[4], None, None, bufs[5]], None, caps, {}))
        assert d.shader == "norm_rows" and d.defines["SUBGROUP_REDUCE"] == int(subgroups)
        device.run_once([("dispatch", device.pipeline(d.shader, d.defines),
                          pack_push_constants(d.args, lambda alloc: alloc.address), d.groups)])
        y, total = (member.download(buf, x.shape, F16) for buf in bufs[4:])
    finally:
        for buf in bufs:
            buf.free()
    wide = x.astype(np.float64) + res
    np.testing.assert_array_equal(total, wide.astype(F16))
    assert rel_err(y, _norm64(wide, scale, bias, -1, False)) <= 2.0 ** -10


def _cast(x: str, y: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [x], [y], to=to)


def test_precision_casts_around_a_layernorm_and_a_softmax_go(pool):
    # a converter's "keep in float32" list: float16 tensors cast up for the op and back down after
    F, H = TensorProto.FLOAT, TensorProto.FLOAT16
    nodes = [_cast("x", "x32", F), helper.make_node("LayerNormalization", ["x32", "g", "bn"], ["n32"], epsilon=1e-5),
             _cast("n32", "n", H), _cast("n", "n16", H),  # and a Cast to the type it has already
             helper.make_node("MatMul", ["n16", "w"], ["s"]), _cast("s", "s32", F),
             helper.make_node("Softmax", ["s32"], ["p32"], axis=-1), _cast("p32", "y", H)]
    inits = [numpy_helper.from_array((1 + RNG.standard_normal(23) * 0.1).astype(np.float32), "g"),
             numpy_helper.from_array((RNG.standard_normal(23) * 0.1).astype(F16).astype(np.float32), "bn"),
             numpy_helper.from_array((RNG.standard_normal((23, 31)) * 0.3).astype(F16), "w")]
    ins = [helper.make_tensor_value_info("x", H, [3, 5, 23])]
    outs = [helper.make_tensor_value_info("y", H, None)]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs, inits), ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    # g is not exact in float16: its LayerNorm keeps float32 and its Casts
    assert [op for op, _ in fused_ops(model)] == ["Cast", "LayerNormalization", "Cast", "MatMul", "Softmax"]
    m = onnx.load_from_string(model)
    g = next(i for i in m.graph.initializer if i.name == "g")
    g.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(g).astype(F16).astype(np.float32), "g"))
    model = m.SerializeToString()
    loaded = load_model(model, cache=False)
    assert [n.op_type for n in loaded.nodes] == ["LayerNormalization", "MatMul", "Softmax"]
    assert all(loaded.tensors[t].dtype == F16 for n in loaded.nodes for t in (*n.inputs, *n.outputs) if t)
    check_half(pool, model, {"x": RNG.standard_normal((3, 5, 23))}).close()


# -- the cooperative-matrix kernel: its choice, and its fused epilogue where a GPU has it -------------

GPU_CAPS = DeviceCaps(float16=True, cooperative_matrix=True, cooperative_matrix_f16=((16, 8, 8), (16, 16, 16)),
                      shared_memory_bytes=48 * 1024, subgroup_size=32, max_workgroup_invocations=1024)


def test_a_fused_product_takes_the_cooperative_matrix_kernel_where_the_device_has_one():
    """The planner's choice for a device reporting cooperative matrices (an H200's report), made
    without the extension: lavapipe can build the dispatches, not run them."""
    p = MatmulProblem(M=1024, N=3072, K=768, sAm=768, sAk=1, sBk=3072, sBn=1, has_bias=True, sCn=1, act=2)
    (d,) = HalfMatmulPlan(p).dispatches("a", "b", "y", GPU_CAPS, c="bias")
    assert d.shader == "gemm_coopmat" and d.defines["HAS_BIAS"] == 1 and d.defines["ACT"] == 2
    assert d.args[-1].tensor == "bias"
    (plain,) = HalfMatmulPlan(MatmulProblem(M=1024, N=3072, K=768, sAm=768, sAk=1, sBk=3072, sBn=1)).dispatches(
        "a", "b", "y", GPU_CAPS)
    assert "HAS_BIAS" not in plain.defines and "ACT" not in plain.defines
    # without shaderFloat16 the scalar kernel runs (it needs 16-bit storage only)
    (scalar,) = HalfMatmulPlan(p).dispatches("a", "b", "y", DeviceCaps(float16=False, cooperative_matrix=True,
                                                                       cooperative_matrix_f16=((16, 16, 16),)), c="bias")
    assert scalar.shader == "gemm_f16" and scalar.defines["HAS_BIAS"] == 1


def test_every_cooperative_matrix_tile_has_room_for_the_bias_rows():
    for tile in (*COOP_TILES, SPLIT_TILE):
        for b_trans in (False, True):
            assert tile.fits(GPU_CAPS, (16, 16, 16), b_trans), (tile.name, b_trans)
    # a tile whose B slice holds 16 rows of bias but not 32 (BK 16): it fits 16-row matrices and is
    # refused 32-row ones, in either layout of B, for that alone (the other conditions hold for both)
    narrow = CoopTile(256, 64, 16, 2, 2)
    for b_trans in (False, True):
        assert narrow.fits(GPU_CAPS, (16, 16, 16), b_trans)
        assert not narrow.fits(GPU_CAPS, (32, 16, 16), b_trans)


@pytest.mark.parametrize("m,k,n,act", [(128, 768, 3072, "Gelu"), (37, 72, 53, "GeluTanh"), (300, 264, 136, "Relu")])
def test_coopmat_fused_epilogue_on_a_gpu(pool, m, k, n, act):
    member = coop_member(pool)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["h"]),
             helper.make_node(act.replace("Tanh", ""), ["h"], ["y"], **({"approximate": "tanh"} if "Tanh" in act else {}))]
    model = half_model(_model(nodes, [("x", (m, k))], [_w("w", k, n), _w("bias", n)], ["y"], opset=20))
    assert fused_ops(model) == [("MatMul", act)]
    with check_half(pool, model, {"x": RNG.standard_normal((m, k))}, member) as session:
        assert any(label.endswith("[gemm_coopmat]") for label in session._chunk.dispatch_labels)


def test_the_fused_references_round_once():
    # the host member's numbers for a fused float16 product: float32 sum, bias, activation, one rounding.
    # Inputs of its own seed: the float32 and float64 sums round to the same halves for these, whatever
    # the tests before it drew (other draws can put a float32 sum across a rounding boundary)
    rng = np.random.default_rng(2024)
    a, w, bias = (rng.standard_normal(s).astype(F16) for s in ((5, 40), (40, 9), (9,)))
    op = create_op("MatMul", {"activation": "Gelu"}, [TensorInfo(a.shape, F16), TensorInfo(w.shape, F16),
                                                       TensorInfo(bias.shape, F16)], opset=17)
    (y,) = op.reference([a, w, bias])
    want = apply_activation(2, a.astype(np.float64) @ w.astype(np.float64) + bias).astype(F16)
    assert y.dtype == F16
    np.testing.assert_array_equal(y, want)


# -- split-K: the partial sums' reduction runs everywhere, the split product on a GPU ------------------

def test_a_short_wide_product_splits_its_reduction_on_a_cooperative_matrix_device():
    # BERT-base's FFN down-projection at 128 tokens: 24 tiles of 64 x 64 alone would leave an
    # H200's 132 multiprocessors idle
    p = MatmulProblem(M=128, N=768, K=3072, sAm=3072, sAk=1, sBk=768, sBn=1, has_bias=True, sCn=1, act=2)
    plan = HalfMatmulPlan(p)
    # 48 tiles of 32 x 64, 256 workgroups wanted: 6 splits of K (512 each, eight 64-deep slices)
    assert plan.splits == 6 and plan.workspace_bytes() == 4 * 6 * 128 * 768
    gemm, reduce = plan.dispatches("a", "b", "y", GPU_CAPS, c="bias", ws="ws")
    assert gemm.shader == "gemm_coopmat" and gemm.defines["SPLITK"] == 1 and gemm.defines["KCHUNK"] == 512
    assert (gemm.defines["BM"], gemm.defines["BN"], gemm.defines["BK"]) == (32, 64, 64)
    assert "HAS_BIAS" not in gemm.defines and gemm.groups == (12, 4, 6) and gemm.args[2].tensor == "ws"
    assert reduce.shader == "gemm_reduce" and reduce.defines == {"HAS_BIAS": 1, "ACT": 2, "HALF": 1, "NSPLITS": 6}
    # a device whose shared memory holds no cooperative-matrix tile runs the scalar kernel, unsplit
    (small,) = plan.dispatches("a", "b", "y", dataclasses.replace(GPU_CAPS, shared_memory_bytes=2048), c="bias", ws="ws")
    assert small.shader == "gemm_f16"
    # a device without cooperative matrices runs the scalar kernel, unsplit
    (scalar,) = plan.dispatches("a", "b", "y", DeviceCaps(), c="bias", ws="ws")
    assert scalar.shader == "gemm_f16" and scalar.defines["HAS_BIAS"] == 1
    # enough tiles, a short K, or a batch: no split
    for q in (MatmulProblem(M=4096, N=4096, K=4096, sAm=4096, sAk=1, sBk=4096, sBn=1),
              MatmulProblem(M=128, N=768, K=255, sAm=255, sAk=1, sBk=768, sBn=1)):
        assert HalfMatmulPlan(q).splits == 1 and HalfMatmulPlan(q).workspace_bytes() == 0


@pytest.mark.parametrize("act", [0, 3])
def test_the_float16_split_reduction_rounds_once(pool, act):
    """gemm_reduce.comp in float16 (HALF), run alone on partial sums the test writes: the sum of the
    splits, the bias and the activation in float32, then one rounding."""
    from vkpool.kernels.base import pack_push_constants

    member = pool.vulkan_members[0]
    device = member.device
    m, n, splits = 7, 45, 5
    p = MatmulProblem(M=m, N=n, K=splits * 256, sAm=splits * 256, sAk=1, sBk=n, sBn=1, has_bias=True, sCn=1, act=act)
    ws = RNG.standard_normal((splits, m, n)).astype(np.float32)
    bias = RNG.standard_normal(n).astype(F16)
    bufs = [member.alloc(ws.nbytes), member.alloc(bias.nbytes), member.alloc(2 * m * n)]
    try:
        member.upload(bufs[0], ws)
        member.upload(bufs[1], bias)
        member.upload(bufs[2], np.full((m, n), np.nan, F16))
        d = HalfMatmulPlan(p)._reduce(bufs[0], bufs[1], bufs[2], splits, device.caps)
        device.run_once([("dispatch", device.pipeline(d.shader, d.defines),
                          pack_push_constants(d.args, lambda alloc: alloc.address), d.groups)])
        got = member.download(bufs[2], (m, n), F16)
    finally:
        for buf in bufs:
            buf.free()
    want = apply_activation(act, ws.astype(np.float64).sum(axis=0) + bias)
    assert np.isfinite(got).all(), "every element of the output is written"
    assert_fp16_close(got, want, 2.0 ** -10, 2.0 ** -14, "split reduction")


@pytest.mark.parametrize("m,k,n,splits", [(128, 3072, 768, None), (37, 1000, 53, 4), (64, 512, 96, 7)])
def test_coopmat_split_k_on_a_gpu(pool, m, k, n, splits):
    """Split products on a GPU with cooperative matrices: the planner's split, and forced ones with
    edges in every dimension and splits left with nothing to add (K 512 over 7 splits of 128)."""
    from vkpool.kernels.base import pack_push_constants

    member = coop_member(pool)
    device = member.device
    a, b = (RNG.uniform(-1, 1, s).astype(F16) for s in ((m, k), (k, n)))
    bias = RNG.standard_normal(n).astype(F16)
    plan = HalfMatmulPlan(MatmulProblem(M=m, N=n, K=k, sAm=k, sAk=1, sBk=n, sBn=1, has_bias=True, sCn=1, act=2))
    count = splits or plan.splits
    assert count > 1
    bufs = [member.alloc(x) for x in (a.nbytes, b.nbytes, 2 * m * n, bias.nbytes, 4 * count * m * n)]
    try:
        for buf, x in zip(bufs, (a, b, None, bias)):
            if x is not None:
                member.upload(buf, x)
        ds = plan.dispatches(bufs[0], bufs[1], bufs[2], device.caps, c=bufs[3], ws=bufs[4], splits=splits)
        assert [d.shader for d in ds] == ["gemm_coopmat", "gemm_reduce"]
        commands = []
        for d in ds:
            commands += [("barrier",)] if commands else []
            commands.append(("dispatch", device.pipeline(d.shader, d.defines),
                             pack_push_constants(d.args, lambda alloc: alloc.address), d.groups))
        device.run_once(commands)
        got = member.download(bufs[2], (m, n), F16)
    finally:
        for buf in bufs:
            buf.free()
    want = apply_activation(2, a.astype(np.float64) @ b.astype(np.float64) + bias)
    assert_fp16_close(got, want, 2.0 ** -10, k * 2.0 ** -22, "split-K product")
