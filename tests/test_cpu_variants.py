"""The kernel variants of a CPU-like device (``DeviceCaps.cpu_like``, vkpool.kernel_variants) on
lavapipe against onnxruntime, at odd sizes, and the choice between them and the GPU kernels
following what the code believes about the device."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from conftest import vulkan_pool
from node_cases import assert_outputs_match, ort_case
from vkpool.session import Session

pytest.importorskip("onnxruntime", reason="the references are onnxruntime's")

RNG = np.random.default_rng(7)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def run_with_caps(model: bytes, feeds: dict[str, np.ndarray], **caps: Any) -> tuple[list[np.ndarray], list[str]]:
    """(outputs, shader of every dispatch) of ``model`` on the first Vulkan member, its
    DeviceCaps fields replaced by ``caps`` (what the kernels believe about the device)."""
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        vk.device.caps = dataclasses.replace(vk.device.caps, **caps)
        with Session(model, pool=pool, device=vk.id) as s:
            shaders = [label.rsplit("[", 1)[-1].rstrip("]") for label in s._chunk.dispatch_labels]
            return s.run(None, feeds), shaders
    finally:
        pool.close()


def attention_cases() -> dict[str, tuple[list[np.ndarray], dict[str, Any]]]:
    b, hq, hkv, s, t = 2, 4, 2, 19, 37
    bool_mask = RNG.integers(0, 2, (s, t)).astype(np.bool_)
    bool_mask[:, 0] = True
    bool_mask[5] = False  # a row with every key masked: zeros
    return {
        # head sizes that are no multiple of the subgroup, keys no multiple of the key block
        "gqa_4d_bool_mask_softcap": ([randn(b, hq, s, 13), randn(b, hkv, t, 13), randn(b, hkv, t, 11), bool_mask],
                                     {"softcap": 2.0}),
        "3d_causal_float_mask": ([randn(b, s, hq * 16), randn(b, s, hkv * 16), randn(b, s, hkv * 16),
                                  randn(1, hq, s, s)], {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1}),
        "kv_cache_causal": ([randn(1, 3, 5, 24), randn(1, 3, 5, 24), randn(1, 3, 5, 24), randn(5, 14),
                             randn(1, 3, 9, 24), randn(1, 3, 9, 24)], {"is_causal": 1, "scale": 0.3}),
        "bert_like": ([randn(1, 12, 33, 64), randn(1, 12, 33, 64), randn(1, 12, 33, 64)], {}),
    }


@pytest.mark.parametrize("name", list(attention_cases()))
def test_attention_rows_on_a_cpu_like_device_and_tiled_elsewhere(name: str) -> None:
    inputs, attrs = attention_cases()[name]
    outputs = 3 if len(inputs) > 4 else 1
    model, feeds, expected = ort_case("Attention", inputs, attrs, outputs=outputs, opset=23)
    # the rows kernel with and without subgroup shuffles, and the GPU kernel
    for caps, shader in (({"cpu_like": True}, "attention_rows"),
                         ({"cpu_like": True, "subgroup_shuffle": False}, "attention_rows"),
                         ({"cpu_like": False}, "attention_tiled")):
        got, shaders = run_with_caps(model, feeds, **caps)
        assert shader in shaders, (caps, shaders)
        assert_outputs_match(got, expected, rtol=1e-4, atol=1e-5)


def test_attention_rows_gives_way_past_the_loop_limit() -> None:
    """Keys whose loops would pass the device's loop limit in one invocation run the tiled
    kernel instead, still right."""
    inputs, attrs = attention_cases()["bert_like"]
    model, feeds, expected = ort_case("Attention", inputs, attrs, opset=23)
    got, shaders = run_with_caps(model, feeds, cpu_like=True, max_loop_iterations=2000)
    assert "attention_rows" not in shaders
    assert_outputs_match(got, expected, rtol=1e-4, atol=1e-5)


def test_the_device_type_decides_cpu_like() -> None:
    pool = vulkan_pool()
    try:
        for member in pool.vulkan_members:
            assert member.device.caps.cpu_like == (member.info.type == "cpu")
    finally:
        pool.close()
