"""``Relu(Add(a, b))`` of two computed float tensors (a residual block's sum) becomes one ``Add``
with a folded Relu, or where ``a`` is a convolution's, that convolution (``vkpool.fusion``):
which graphs are rewritten, and that the fused kernel gives
onnxruntime's outputs on lavapipe (rtol 1e-5 in float32, NaN and infinities kept), with the kernel
forms of a CPU-like device and of a GPU, float16 too, and on the host member, where the fused node
is written out again as Add then Relu for onnxruntime."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import vulkan_pool
from vkpool.config.loader import parse_config
from vkpool.model import load_model
from vkpool.session import Session

RNG = np.random.default_rng(23)
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes, inputs, outputs, inits=(), elem=F32) -> bytes:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, elem, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, elem, s) for n, s in outputs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def residual_block(channels: int = 5, h: int = 7, w: int = 9) -> bytes:
    """x → Conv → Add(x) → Relu: ResNet's basic block without its norms."""
    weight = numpy_helper.from_array(RNG.standard_normal((channels, channels, 3, 3)).astype(np.float32) * 0.2, "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    shape = [1, channels, h, w]
    return _model(nodes, [("x", shape)], [("y", shape)], [weight])


def add_relu(a_shape, b_shape, y_shape, elem=F32) -> bytes:
    return _model([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                  [("a", a_shape), ("b", b_shape)], [("y", y_shape)], elem=elem)


def onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def run(model: bytes, feeds: dict[str, np.ndarray], **caps) -> np.ndarray:
    """The output on the first Vulkan member, its DeviceCaps fields replaced by ``caps`` (what the
    kernels believe about the device: ``cpu_like`` picks the element-wise form)."""
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        vk.device.caps = dataclasses.replace(vk.device.caps, **caps)
        with Session(model, pool=pool, device=vk.id) as s:
            return s.run(None, feeds)[0]
    finally:
        pool.close()


def test_a_residual_block_becomes_one_convolution() -> None:
    """The block's Add and Relu go into its convolution, which adds x before the Relu."""
    model = residual_block()
    [node] = load_model(model).nodes
    assert (node.op_type, node.attrs.get("activation"), node.inputs) == ("Conv", "Relu", ["x", "w", "", "x"])
    x = RNG.standard_normal((1, 5, 7, 9)).astype(np.float32)
    got = run(model, {"x": x})
    np.testing.assert_allclose(got, onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-6)
    assert (got == 0).any() and (got > 0).any() and not (got < 0).any()  # the folded Relu cut some sums


@pytest.mark.parametrize("cpu_like", [True, False], ids=["cpu-like", "gpu"])
@pytest.mark.parametrize("shapes", [([3, 37, 11], [3, 37, 11]), ([3, 37, 11], [1, 37, 1])], ids=["same", "broadcast"])
def test_the_fused_add_keeps_nan_and_infinities(cpu_like: bool, shapes) -> None:
    a_shape, b_shape = shapes
    model = add_relu(a_shape, b_shape, a_shape)
    a = RNG.standard_normal(a_shape).astype(np.float32)
    b = RNG.standard_normal(b_shape).astype(np.float32)
    a.flat[:4] = [np.nan, -np.inf, np.inf, -0.0]
    want = onnxruntime(model, {"a": a, "b": b})
    got = run(model, {"a": a, "b": b}, cpu_like=cpu_like)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)
    assert np.isnan(got.flat[0]) and got.flat[1] == 0 and got.flat[2] == np.inf


def test_a_float16_residual_sum_fuses_too() -> None:
    model = add_relu([4, 33], [4, 33], [4, 33], elem=F16)
    assert [(n.op_type, n.attrs.get("activation")) for n in load_model(model).nodes] == [("Add", "Relu")]
    a, b = (RNG.standard_normal((4, 33)).astype(np.float16) for _ in range(2))
    got = run(model, {"a": a, "b": b})
    np.testing.assert_array_equal(got, onnxruntime(model, {"a": a, "b": b}))


def test_the_host_member_runs_the_fused_add_as_add_then_relu() -> None:
    model = residual_block(channels=3, h=5, w=6)
    x = RNG.standard_normal((1, 3, 5, 6)).astype(np.float32)
    pool = vulkan_pool(parse_config("host:\n  enabled: true\n"))
    try:
        with Session(model, pool=pool, device="cpu") as s:
            got = s.run(None, {"x": x})[0]
    finally:
        pool.close()
    np.testing.assert_allclose(got, onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-6)


def test_what_is_not_fused_into_an_add() -> None:
    def ops(model: bytes) -> list[tuple[str, object]]:
        return [(n.op_type, n.attrs.get("activation")) for n in load_model(model).nodes]

    # an Add of a constant is a bias: the product rewrites take it, or it stays
    bias = numpy_helper.from_array(RNG.standard_normal((1, 6)).astype(np.float32), "k")
    constant = _model([helper.make_node("Add", ["a", "k"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                      [("a", [2, 6])], [("y", [2, 6])], [bias])
    assert ops(constant) == [("Add", None), ("Relu", None)]
    # a sum read twice, or seen by the caller, keeps its value
    twice = _model([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
                    helper.make_node("Mul", ["r", "s"], ["y"])], [("a", [2, 6]), ("b", [2, 6])], [("y", [2, 6])])
    assert ops(twice) == [("Add", None), ("Relu", None), ("Mul", None)]
    seen = _model([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                  [("a", [2, 6]), ("b", [2, 6])], [("y", [2, 6]), ("s", [2, 6])])
    assert ops(seen) == [("Add", None), ("Relu", None)]
    # integers keep their Relu
    ints = add_relu([2, 6], [2, 6], [2, 6], elem=TensorProto.INT32)
    assert ops(ints) == [("Add", None), ("Relu", None)]
