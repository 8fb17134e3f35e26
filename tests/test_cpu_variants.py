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


def run_with_caps(model: bytes, feeds: dict[str, np.ndarray],
                  **caps: Any) -> tuple[list[np.ndarray], list[str]]:
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
        "gqa_4d_bool_mask_softcap": ([randn(b, hq, s, 13), randn(b, hkv, t, 13), randn(b, hkv, t, 11),
                                      bool_mask], {"softcap": 2.0}),
        "3d_causal_float_mask": ([randn(b, s, hq * 16), randn(b, s, hkv * 16), randn(b, s, hkv * 16),
                                  randn(1, hq, s, s)],
                                 {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1}),
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


def defines_by_device_class(model: bytes) -> dict[bool, list[tuple[str, dict[str, Any]]]]:
    """:func:`dispatch_defines` of ``model`` compiled on the first Vulkan member, as a CPU-like
    device (True) and as any other (False) would record them."""
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        with Session(model, pool=pool, device=vk.id) as s:
            return {cpu_like: dispatch_defines(s, dataclasses.replace(vk.device.caps, cpu_like=cpu_like))
                    for cpu_like in (True, False)}
    finally:
        pool.close()


def dispatch_defines(session: Any, caps: Any) -> list[tuple[str, dict[str, Any]]]:
    """(shader, defines) of every dispatch the ops of ``session`` record on a device with ``caps``
    (placeholder handles: only the choices are looked at)."""
    from vkpool.kernels.base import DispatchContext

    out = []
    for op in session._chunk.ops:
        handles = [object() for _ in range(8)]
        ctx = DispatchContext(handles, [object() for _ in range(4)], object(), caps, {})
        out += [(d.shader, d.defines) for d in op.dispatches(ctx)]
    return out


CONV_CASES: dict[str, tuple[list[np.ndarray], dict[str, Any]]] = {
    # odd sizes: columns and channels no multiple of the tile, pads on one side
    "3x3_pads_bias_relu": ([randn(1, 37, 13, 11), randn(35, 37, 3, 3), randn(35)], {"pads": [1, 0, 1, 2]}),
    "groups_strides_dilations": ([randn(2, 36, 15, 13), randn(34, 18, 3, 2), randn(34)],
                                 {"group": 2, "strides": [2, 3], "dilations": [2, 1], "pads": [2, 1, 0, 1]}),
    "7x7_stride_2_64bit_masks": ([randn(1, 3, 29, 31), randn(40, 3, 7, 7)],
                                 {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    "3d": ([randn(1, 6, 5, 7, 6), randn(33, 6, 3, 2, 3)], {"pads": [1, 0, 1, 1, 1, 0]}),
    "long_reduction_split": ([randn(1, 300, 5, 5), randn(40, 300, 3, 3)], {"pads": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv_taps_on_the_register_tiling_only(name: str) -> None:
    """conv_taps.comp runs a convolution where the products take the register tiling with
    shuffles; the shared tiling and a device without shuffles run gemm.comp; all equal
    onnxruntime's."""
    inputs, attrs = CONV_CASES[name]
    model, feeds, expected = ort_case("Conv", inputs, attrs, constants=tuple(range(1, len(inputs))))
    pool = vulkan_pool()
    device = pool.vulkan_members[0].device.caps
    pool.close()
    # the shuffles share A within one subgroup: the register tile's WG lanes must be one
    shares = device.subgroup_shuffle and device.subgroup_size == device.register_tile[2]
    taps = "conv_taps" if shares else "gemm"
    for caps, shader in (({"gemm_variant": "register"}, taps),
                         ({"gemm_variant": "register", "subgroup_shuffle": False}, "gemm"),
                         ({"gemm_variant": "shared"}, "gemm")):
        got, shaders = run_with_caps(model, feeds, **caps)
        assert shaders[0] == shader, (caps, shaders)
        assert_outputs_match(got, expected, rtol=1e-4, atol=1e-4)


def test_conv_taps_keeps_a_split_of_few_tiles_and_needs_int64_past_32_taps() -> None:
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        caps = dataclasses.replace(vk.device.caps, gemm_variant="register", subgroup_shuffle=True,
                                   subgroup_size=vk.device.caps.register_tile[2])
        for name, int64, want in (("long_reduction_split", True, "conv_taps"),
                                  ("7x7_stride_2_64bit_masks", True, "conv_taps"),
                                  ("7x7_stride_2_64bit_masks", False, "gemm")):
            inputs, attrs = CONV_CASES[name]
            model, _, _ = ort_case("Conv", inputs, attrs, constants=tuple(range(1, len(inputs))))
            with Session(model, pool=pool, device=vk.id) as s:
                chosen = dispatch_defines(s, dataclasses.replace(caps, int64=int64))
            assert chosen[0][0] == want
            if name == "long_reduction_split":  # 2 tiles of 32 x 64: split to fill a CPU's cores
                assert chosen[0][1]["SPLITS"] > 1 and chosen[-1][0] == "gemm_reduce"
    finally:
        pool.close()


def test_register_tiling_splits_only_few_tiles() -> None:
    """The register tiling drops the load-time split of K wherever its tiles alone are 16
    workgroups or more; the shared tiling keeps the plan's split."""
    from vkpool.kernels.base import DeviceCaps
    from vkpool.kernels.ops.gemm import MatmulPlan, MatmulProblem

    def problem(m: int, n: int, k: int) -> MatmulPlan:
        return MatmulPlan(MatmulProblem(M=m, N=n, K=k, sAm=k, sAk=1, sBk=n, sBn=1), force_gemm=True)

    register = DeviceCaps(gemm_variant="register", register_tile=(32, 8, 8))
    shared = DeviceCaps(gemm_variant="shared")
    many, few = problem(128, 768, 3072), problem(64, 64, 3000)
    assert many.splits > 1 and few.splits > 1  # the GPU plan splits both
    assert many.tile_for(shared)["SPLITS"] == many.splits and few.tile_for(shared)["SPLITS"] == few.splits
    assert many.tile_for(register)["SPLITS"] == 1  # 4 x 12 register tiles
    kept = few.tile_for(register)  # 2 register tiles: split, within the plan's workspace
    assert 1 < kept["SPLITS"] <= few.splits and kept["KCHUNK"] * kept["SPLITS"] >= 3000


@pytest.mark.parametrize("shape", [(64, 3000, 67), (128, 1100, 300)])
def test_register_products_with_and_without_split_match_onnxruntime(shape: tuple[int, int, int]) -> None:
    """2 register tiles keep a split, 20 do not."""
    m, k, n = shape
    model, feeds, expected = ort_case("MatMul", [randn(m, k), randn(k, n)], {}, constants=(1,))
    got, shaders = run_with_caps(model, feeds, gemm_variant="register")
    assert ("gemm_reduce" in shaders) == (m == 64), shaders
    assert_outputs_match(got, expected, rtol=1e-4, atol=1e-3)


def test_binary_flat_on_same_shapes_of_a_cpu_like_device() -> None:
    a, b, row = randn(3, 37, 11), randn(3, 37, 11), randn(11)
    for inputs, flat in (([a, b], True), ([a, row], False)):
        model, feeds, expected = ort_case("Add", inputs)
        for cpu_like in (True, False):
            got, _ = run_with_caps(model, feeds, cpu_like=cpu_like)
            assert_outputs_match(got, expected, rtol=0, atol=0)
        for cpu_like, ((shader, defines),) in defines_by_device_class(model).items():
            assert shader == "binary" and bool(defines.get("FLAT")) == (flat and cpu_like)


def test_gemv_t_one_subgroup_per_row_on_a_cpu_like_device() -> None:
    model, feeds, expected = ort_case("Gemm", [randn(1, 517), randn(37, 517), randn(37)], {"transB": 1},
                                      constants=(1, 2))
    for cpu_like in (True, False):
        got, shaders = run_with_caps(model, feeds, cpu_like=cpu_like)
        assert shaders[0] == "gemv_t"
        assert_outputs_match(got, expected, rtol=1e-4, atol=1e-4)
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        caps = vk.device.caps
        with Session(model, pool=pool, device=vk.id) as s:
            for cpu_like, tpr in ((True, caps.subgroup_size), (False, 256)):
                ((_, defines),) = dispatch_defines(s, dataclasses.replace(caps, cpu_like=cpu_like))
                assert defines["TPR"] == tpr
    finally:
        pool.close()


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool_one_subgroup_per_row_on_a_cpu_like_device(op: str) -> None:
    model, feeds, expected = ort_case(op, [randn(2, 5, 7, 37)])
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        with Session(model, pool=pool, device=vk.id) as s:
            for cpu_like in (True, False):
                ((_, defines),) = dispatch_defines(s, dataclasses.replace(vk.device.caps, cpu_like=cpu_like))
                assert (defines["LOCAL_SIZE"] == vk.device.caps.subgroup_size) == cpu_like
    finally:
        pool.close()
    for cpu_like in (True, False):
        got, shaders = run_with_caps(model, feeds, cpu_like=cpu_like)
        assert shaders == ["global_pool"]
        assert_outputs_match(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["Add", "Relu"])
def test_element_wise_grids_without_bounds_tests_where_exact(op: str) -> None:
    """On a CPU-like device an element-wise op whose grid holds exactly its elements runs with
    no bounds test (EXACT); any other size, and any other device, keeps it."""
    for shape, exact in (((2, 8, 32), True), ((3, 37, 11), False)):
        inputs = [randn(*shape), randn(*shape)] if op == "Add" else [randn(*shape)]
        model, feeds, expected = ort_case(op, inputs)
        for cpu_like, ((_, defines),) in defines_by_device_class(model).items():
            assert bool(defines.get("EXACT")) == (exact and cpu_like)
        for cpu_like in (True, False):
            got, _ = run_with_caps(model, feeds, cpu_like=cpu_like)
            assert_outputs_match(got, expected, rtol=0, atol=0)


def test_one_subgroup_rows_give_way_past_the_loop_limit() -> None:
    """A row longer than one subgroup's invocations can walk within the device's loop limit keeps
    the GPU's workgroup width (gemv_t, global pooling), still right."""
    pool = vulkan_pool()
    try:
        vk = pool.vulkan_members[0]
        for op, inputs, attrs, constants, key, wide in (
                ("Gemm", [randn(1, 4096), randn(5, 4096)], {"transB": 1}, (1,), "TPR", 256),
                ("GlobalAveragePool", [randn(1, 2, 64, 64)], {}, (), "LOCAL_SIZE", 256)):
            model, feeds, expected = ort_case(op, inputs, attrs, constants=constants)
            with Session(model, pool=pool, device=vk.id) as s:
                for limit, want in ((0, vk.device.caps.subgroup_size), (150, wide)):
                    caps = dataclasses.replace(vk.device.caps, cpu_like=True, max_loop_iterations=limit)
                    ((_, defines),) = dispatch_defines(s, caps)
                    assert defines[key] == want, (op, limit)
            got, _ = run_with_caps(model, feeds, cpu_like=True, max_loop_iterations=150)
            assert_outputs_match(got, expected, rtol=1e-4, atol=1e-4)
    finally:
        pool.close()
