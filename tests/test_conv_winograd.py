"""3x3 convolutions of stride 1 by Winograd's F(2x2, 3x3) (``winograd.comp`` around a batched
product), on lavapipe, against onnxruntime: each tiling of the product, every padding, a batch,
a bias, a residual sum and its Relu, tiles past the image's edge, and a workgroup grid the
device bounds lower than lavapipe does."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import vulkan_pool
from node_cases import assert_outputs_match, conv_residual_case, dispatches_of, ort_case
from vkpool.kernels.ops import conv as conv_op

from vkpool.session import Session

pytest.importorskip("onnxruntime", reason="the references are onnxruntime's")


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def conv_case(inputs: list[np.ndarray], attrs: dict[str, Any], residual_relu: bool = False
              ) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """The convolution of ``inputs`` (x, w[, b]; w and b initializers), or its residual block's sum
    with a Relu; the model, its feeds and onnxruntime's outputs."""
    if residual_relu:
        return conv_residual_case(inputs, attrs, lambda shape: rand(*shape, seed=7), relu=True)
    return ort_case("Conv", inputs, attrs, constants=tuple(range(1, len(inputs))))


SAME = {"pads": [1, 1, 1, 1]}
#: (inputs, attributes, as a residual block's sum with its Relu): odd output sizes leave a
#: tile's last row or column past the edge; pads of 0 to 2 on any side
CASES: dict[str, tuple[list[np.ndarray], dict[str, Any], bool]] = {
    "same, odd sizes, bias": ([rand(2, 16, 33, 31), rand(20, 16, 3, 3), rand(20, seed=5)], SAME, False),
    "pads 0 to 2, no bias": ([rand(1, 24, 36, 35), rand(17, 24, 3, 3)], {"pads": [0, 1, 2, 0]}, False),
    "residual and Relu": ([rand(3, 18, 22, 21), rand(32, 18, 3, 3), rand(32, seed=5)], SAME, True),
    "a long reduction": ([rand(1, 512, 32, 32), rand(24, 512, 3, 3) / 16, rand(24, seed=5)], SAME, False),
}


def runs_winograd(session: Session) -> bool:
    """Whether the session's convolution dispatches ``winograd.comp`` on its device."""
    conv = next(op for op in session._chunk.ops if op.op_type == "Conv")
    dispatches = dispatches_of(conv, session._chunk.member.device.caps)
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
        for name, (inputs, attrs, residual_relu) in CASES.items():
            model, feeds, expected = conv_case(inputs, attrs, residual_relu)
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
    model, feeds, expected = conv_case(*CASES["same, odd sizes, bias"])
    monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", "max_workgroup_count=16x64x65535")
    p = vulkan_pool()
    try:
        caps = p.vulkan_members[0].device.caps
        with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
            conv = next(op for op in s._chunk.ops if op.op_type == "Conv")
            dispatches = dispatches_of(conv, caps)
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
            inputs = [rand(1, channels, 32, 32), rand(channels, channels, 3, 3), rand(channels, seed=5)]
            model, feeds, expected = conv_case(inputs, SAME)
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                assert runs_winograd(s) == runs, channels
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()
