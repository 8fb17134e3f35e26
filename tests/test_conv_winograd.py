"""3x3 convolutions of stride 1 by Winograd's F(2x2, 3x3) (``winograd.comp`` around a batched
product), on lavapipe, against onnxruntime: each tiling of the product, every padding, a batch,
a bias, a residual sum and its Relu, tiles past the image's edge, and a workgroup grid the
device bounds lower than lavapipe does."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import vulkan_pool
from node_cases import assert_outputs_match, ort_case
from vkpool.kernels.base import DispatchContext
from vkpool.kernels.ops import conv as conv_op

from vkpool.session import Session

ort = pytest.importorskip("onnxruntime", reason="the references are onnxruntime's")


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def conv_model(x: np.ndarray, w: np.ndarray, bias: bool, pads: list[int], residual: bool = False,
               relu: bool = False) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """``[Relu]([Add](Conv(x, w[, b]), r))``, w (and b) initializers; the model, its feeds and
    onnxruntime's outputs."""
    from onnx import TensorProto, helper, numpy_helper

    m = w.shape[0]
    oh, ow = x.shape[2] + pads[0] + pads[2] - 2, x.shape[3] + pads[1] + pads[3] - 2
    out_shape = (x.shape[0], m, oh, ow)
    inits = [numpy_helper.from_array(w, "w")]
    if bias:
        inits.append(numpy_helper.from_array(rand(m, seed=5), "b"))
    feeds = {"x": x}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)]
    last = "h"
    nodes = [helper.make_node("Conv", ["x", "w", *(["b"] if bias else [])], [last], pads=pads)]
    if residual:
        feeds["r"] = rand(*out_shape, seed=7)
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, out_shape))
        nodes.append(helper.make_node("Add", [last, "r"], ["s"]))
        last = "s"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["y"]))
        last = "y"
    outputs = [helper.make_tensor_value_info(last, TensorProto.FLOAT, out_shape)]
    graph = helper.make_graph(nodes, "winograd", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    model = model.SerializeToString()
    return model, feeds, ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


#: (x, w, bias, pads, residual, relu): odd output sizes leave a tile's last row or column past
#: the edge; pads of 0 to 2 on any side
CASES: dict[str, tuple[Any, ...]] = {
    "same, odd sizes, bias": (rand(2, 16, 33, 31), rand(20, 16, 3, 3), True, [1, 1, 1, 1], False, False),
    "pads 0 to 2, no bias": (rand(1, 24, 36, 35), rand(17, 24, 3, 3), False, [0, 1, 2, 0], False, False),
    "residual and Relu": (rand(3, 18, 22, 21), rand(32, 18, 3, 3), True, [1, 1, 1, 1], True, True),
    "a long reduction": (rand(1, 512, 32, 32), rand(24, 512, 3, 3) / 16, True, [1, 1, 1, 1], False, False),
}


def stand_ins(caps: Any) -> DispatchContext:
    """A dispatch context of stand-in buffers: only the shaders and defines are looked at."""
    return DispatchContext([object(), object(), object()], [object()], object(), caps, {})


def runs_winograd(session: Session) -> bool:
    """Whether the session's convolution dispatches ``winograd.comp`` on its device."""
    conv = next(op for op in session._chunk.ops if op.op_type == "Conv")
    caps = session._chunk.member.device.caps
    dispatches = conv.dispatches(stand_ins(caps))
    return any(d.shader == "winograd" for d in dispatches)


@pytest.fixture
def cpu_like_from_16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Winograd from 16 channels on lavapipe too, as on a GPU (64 on a CPU-like device)."""
    monkeypatch.setattr(conv_op, "WINOGRAD_MIN_CHANNELS_CPU_LIKE", 16)


@pytest.mark.parametrize("variant", ["gemm=shared", "gemm=register", "gemm=register:3x5x8"])
def test_winograd_convolutions_match_onnxruntime(variant: str, monkeypatch: pytest.MonkeyPatch,
                                                 cpu_like_from_16: None) -> None:
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", variant)
    p = vulkan_pool()
    try:
        for name, (x, w, bias, pads, residual, relu) in CASES.items():
            model, feeds, expected = conv_model(x, w, bias, pads, residual, relu)
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                assert runs_winograd(s), name
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()


def test_which_convolutions_run_by_winograd(monkeypatch: pytest.MonkeyPatch, cpu_like_from_16: None) -> None:
    """Only 2-D 3x3 convolutions of stride and dilation 1 in one group, with enough channels and
    tiles, whose transforms fit the workspace bound; the others keep their kernels, and every
    one equals onnxruntime's outputs."""
    from vkpool.kernels.ops.conv import WINOGRAD_MIN_CHANNELS, WINOGRAD_MIN_TILES

    assert WINOGRAD_MIN_TILES > 2 and WINOGRAD_MIN_CHANNELS > 2
    monkeypatch.setattr(conv_op, "WINOGRAD_MIN_TILES", 64)

    def case(x: np.ndarray, w: np.ndarray, **attrs: Any) -> Any:
        return ort_case("Conv", [x, w], {"pads": [1, 1] * (x.ndim - 2), **attrs}, constants=(1,))

    x = rand(1, 16, 16, 16)
    # 16 x 16 x 4 bytes of weights, 16 x 16 x 64 x 4 of each transformed input and products
    monkeypatch.setattr(conv_op, "WINOGRAD_MAX_WORKSPACE", 16 * 4 * (16 * 16 + 2 * 16 * 64))
    cases = {  # name: (model case, runs by Winograd)
        "64 tiles": (case(x, rand(16, 16, 3, 3)), True),  # 16 x 16 outputs
        "63 tiles": (case(rand(1, 16, 14, 18), rand(16, 16, 3, 3)), False),
        "strided": (case(x, rand(16, 16, 3, 3), strides=[2, 2]), False),
        "dilated": (case(x, rand(16, 16, 3, 3), dilations=[2, 2], pads=[2, 2, 2, 2]), False),
        "grouped": (case(x, rand(16, 8, 3, 3), group=2), False),
        "5x5": (case(x, rand(16, 16, 5, 5), pads=[2, 2, 2, 2]), False),
        "no padding": (case(rand(1, 16, 18, 18), rand(16, 16, 3, 3), pads=[0, 0, 0, 0]), True),
        "few outputs": (case(x, rand(WINOGRAD_MIN_CHANNELS - 1, 16, 3, 3)), False),
        "1-D": (case(rand(1, 16, 200), rand(16, 16, 3)), False),
        "past the workspace": (case(rand(1, 17, 16, 16), rand(16, 17, 3, 3)), False),
    }
    p = vulkan_pool()
    try:
        for name, ((model, feeds, expected), runs) in cases.items():
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                assert runs_winograd(s) == runs, name
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()


def test_winograd_through_a_folded_grid(monkeypatch: pytest.MonkeyPatch, cpu_like_from_16: None) -> None:
    """The transforms' grids fold into y where the device bounds x lower than they need (lavapipe
    made to believe 16 workgroups in x, 64 in y), and the outputs stay onnxruntime's."""
    x, w, bias, pads, residual, relu = CASES["same, odd sizes, bias"]
    model, feeds, expected = conv_model(x, w, bias, pads, residual, relu)
    monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", "max_workgroup_count=16x64x65535")
    p = vulkan_pool()
    try:
        caps = p.vulkan_members[0].device.caps
        with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
            conv = next(op for op in s._chunk.ops if op.op_type == "Conv")
            dispatches = conv.dispatches(stand_ins(caps))
            stages = [d for d in dispatches if d.shader == "winograd"]
            assert [d.defines["STAGE"] for d in stages] == [1, 2, 3]
            assert all(d.groups[0] <= 16 for d in dispatches) and stages[1].groups[1] > 1  # folded into y
            assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()


def test_a_cpu_like_device_takes_winograd_from_64_channels() -> None:
    """lavapipe's own choice: 63 channels keep the implicit GEMM, 64 take Winograd; both equal
    onnxruntime's outputs."""
    p = vulkan_pool()
    try:
        assert p.vulkan_members[0].device.caps.cpu_like
        for channels, runs in ((63, False), (64, True)):
            x, w = rand(1, channels, 32, 32), rand(channels, channels, 3, 3)
            model, feeds, expected = conv_model(x, w, True, [1, 1, 1, 1])
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                assert runs_winograd(s) == runs, channels
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()
