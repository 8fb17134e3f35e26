"""ConvTranspose through the tiled GEMM and a col2im gather (16 or more input channels per group),
on the real Vulkan device against onnxruntime (CPU), rtol 1e-4, atol 1e-5: strides equal to and
smaller than the kernel (overlapping taps), pads, dilations, output_padding, groups with several
images, 1-D and 3-D; and the direct gather it replaces still taken below 16 channels."""
from __future__ import annotations

import numpy as np
import pytest

import vkpool
from node_cases import assert_outputs_match, ort_case

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
RNG = np.random.default_rng(5)


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("x,w,attrs,bias", [
    ((1, 32, 5, 7), (32, 12, 2, 2), {"strides": [2, 2]}, True),                        # U-Net's up-convolution
    ((2, 20, 6, 5), (20, 7, 3, 3), {"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 0]}, False),
    ((3, 32, 4, 6), (32, 5, 3, 2), {"group": 2, "dilations": [2, 1], "strides": [1, 3]}, True),
    ((1, 48, 9), (48, 4, 5), {"strides": [3], "pads": [2, 1]}, True),                  # 1-D
    ((1, 16, 3, 4, 2), (16, 3, 2, 3, 2), {"strides": [2, 1, 2]}, False),               # 3-D
    ((2, 8, 5, 5), (8, 6, 3, 3), {"strides": [2, 2]}, True),                           # 8 channels: direct
], ids=["unet-up", "pads-output-padding", "groups-dilations", "1d", "3d", "direct"])
def test_convtranspose_matches_onnxruntime(pool, x, w, attrs, bias):
    inputs = [_f(*x), _f(*w) * 0.3] + ([_f(w[1] * attrs.get("group", 1))] if bias else [])
    model, feeds, expected = ort_case("ConvTranspose", inputs, attrs, constants=tuple(range(1, len(inputs))))
    with vkpool.Session(model, pool=pool, device=pool.vulkan_members[0].id) as session:
        labels = " ".join(session._chunk.dispatch_labels)
        assert ("[gemm]" in labels) == (x[1] // attrs.get("group", 1) >= 16), labels
        assert_outputs_match(session.run(None, feeds), expected)
