"""Both tilings of the products (``vkpool.kernel_variants``), each forced on lavapipe with
``VKPOOL_KERNEL_VARIANT``, against onnxruntime: matrix products, Gemm and implicit-GEMM
convolutions of odd sizes, with bias, fused Relu, transposes, broadcast batches, groups and a
split reduction."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import vulkan_pool
from node_cases import assert_outputs_match, conv_residual_case, dispatches_of, ort_case
from vkpool.kernel_variants import DEFAULT_REGISTER_TILE, KernelVariantError, forced, gemm_choice
from vkpool.session import Session

pytest.importorskip("onnxruntime", reason="the references are onnxruntime's")

VARIANTS = ["gemm=shared", "gemm=register", "gemm=register:3x5x8", "gemm=register:1x2x4"]


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


CASES: dict[str, tuple[str, list[np.ndarray], dict[str, Any], tuple[int, ...]]] = {
    "matmul_odd": ("MatMul", [rand(97, 131), rand(131, 67)], {}, (1,)),
    "matmul_batch_broadcast": ("MatMul", [rand(3, 1, 19, 33), rand(5, 33, 21)], {}, ()),
    "gemm_transposed_bias": ("Gemm", [rand(45, 29), rand(37, 45), rand(37)], {"transA": 1, "transB": 1}, (1, 2)),
    "gemm_alpha_beta": ("Gemm", [rand(23, 70), rand(70, 9), rand(23, 1)], {"alpha": 0.5, "beta": -2.0}, ()),
    "conv_groups_stride": ("Conv", [rand(2, 36, 13, 11), rand(34, 18, 3, 3), rand(34)],
                           {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, (1, 2)),
    "conv_split_k": ("Conv", [rand(1, 256, 7, 7), rand(40, 256, 3, 3)], {"pads": [1, 1, 1, 1]}, (1,)),
    "conv_1x1": ("Conv", [rand(1, 70, 9, 5), rand(33, 70, 1, 1), rand(33)], {}, (1, 2)),
    "conv_1x1_groups_batch": ("Conv", [rand(3, 140, 7, 5), rand(34, 70, 1, 1), rand(34)], {"group": 2}, (1, 2)),
    "conv_1x1_strided": ("Conv", [rand(1, 70, 9, 5), rand(33, 70, 1, 1)], {"strides": [2, 2]}, (1,)),
    "conv_1x1_split_k": ("Conv", [rand(1, 1030, 3, 3), rand(20, 1030, 1, 1), rand(20)], {}, (1, 2)),
    # columns a multiple of 4
    "matmul_cols_by_4": ("MatMul", [rand(45, 70), rand(70, 68)], {}, (1,)),
    "gemm_cols_by_4_bias": ("Gemm", [rand(33, 50), rand(36, 50), rand(36)], {"transB": 1}, (1, 2)),
    "conv_cols_by_4_split_k": ("Conv", [rand(2, 256, 8, 6), rand(24, 256, 3, 3), rand(24)], {"pads": [1, 1, 1, 1]},
                               (1, 2)),
    # a batch whose images are columns of one product (FOLD): 3 x 4 x 3 outputs per image, so
    # tiles straddle images
    "conv_batch_folded": ("Conv", [rand(3, 20, 9, 7), rand(40, 20, 3, 3), rand(40)],
                          {"strides": [2, 2], "pads": [1, 0, 0, 1], "dilations": [1, 2]}, (1, 2)),
}


@pytest.fixture(params=VARIANTS)
def variant_pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", request.param)
    p = vulkan_pool()
    yield p
    p.close()


def test_each_variant_matches_onnxruntime(variant_pool: Any) -> None:
    vk = variant_pool.vulkan_members[0]
    want = forced()
    assert want is not None and (vk.device.caps.gemm_variant, vk.device.caps.register_tile) == \
        (want.variant, want.register_tile)
    for name, (op, inputs, attrs, constants) in CASES.items():
        model, feeds, expected = ort_case(op, inputs, attrs, constants)
        with Session(model, pool=variant_pool, device=vk.id) as s:
            got = s.run(None, feeds)
        assert_outputs_match(got, expected, rtol=1e-4, atol=1e-4)


def run_under_limits(model: bytes, feeds: dict[str, np.ndarray], limits: str,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[list[np.ndarray], int, int]:
    """(outputs, the steps of k one invocation runs, whether the register tiling ran) under ``limits``."""
    monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", limits)
    p = vulkan_pool()
    try:
        with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
            (op,) = s._chunk.ops
            register = op.plan.tile_for(p.vulkan_members[0].device.caps).get("REGISTER_TILE", 0)
            steps = op.plan.kchunk if op.plan.splits > 1 else op.plan.p.K
            return s.run(None, feeds), steps, register
    finally:
        p.close()


def test_pointwise_convolutions_run_as_plain_products_where_the_tiling_is_register(variant_pool: Any) -> None:
    """A 1x1 convolution of stride 1 and no padding is a plain product on the register tiling
    (no window arithmetic: no CONV define), an implicit GEMM on the shared one."""
    vk = variant_pool.vulkan_members[0]
    op, inputs, attrs, constants = CASES["conv_1x1_groups_batch"]
    model, feeds, expected = ort_case(op, inputs, attrs, constants)
    with Session(model, pool=variant_pool, device=vk.id) as s:
        (conv,) = s._chunk.ops
        assert conv.pointwise is not None
        defines = [d.defines for d in dispatches_of(conv, vk.device.caps)]
        register = vk.device.caps.gemm_variant == "register"
        assert all(("CONV" in d) != register for d in defines)
        assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)


def test_a_batch_of_images_is_one_product_on_the_shared_tiling(variant_pool: Any) -> None:
    """A convolution of one group over a batch of images runs as one product whose columns span
    the images (FOLD: the outputs per image) on the shared tiling, its reduction split or not (the
    split's sums placed by gemm_reduce's FOLD), per image on the register tiling; a grouped one per
    image on either. All equal onnxruntime's."""
    import math

    vk = variant_pool.vulkan_members[0]
    shared = vk.device.caps.gemm_variant == "shared"
    for name, folds, split in (("conv_batch_folded", shared, False), ("conv_cols_by_4_split_k", shared, True),
                               ("conv_groups_stride", False, False)):
        op, inputs, attrs, constants = CASES[name]
        model, feeds, expected = ort_case(op, inputs, attrs, constants)
        with Session(model, pool=variant_pool, device=vk.id) as s:
            (conv,) = s._chunk.ops
            dispatches = dispatches_of(conv, vk.device.caps)
            per_image = math.prod(conv.out_shape[2:])
            assert {d.defines.get("FOLD", 0) for d in dispatches} == {per_image if folds else 0}, name
            if folds:
                assert (conv.folded.splits > 1) == split and any(d.shader == "gemm_reduce" for d in dispatches) == split
            assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)


def test_a_batch_whose_columns_pass_the_workgroup_grid_runs_per_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of images whose folded product would need more workgroups across than the device
    dispatches (lowered here below it) runs per image, as it would without the fold, and equals
    onnxruntime's."""
    from vkpool.kernels.ops.gemm import ceil_div

    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=shared")
    model, feeds, expected = ort_case("Conv", [rand(3, 8, 20, 20), rand(24, 8, 3, 3), rand(24)],
                                      {"pads": [1, 1, 1, 1]}, (1, 2))
    p = vulkan_pool()
    try:
        with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
            (conv,) = s._chunk.ops
            across = [ceil_div(plan.p.N, plan.tile["BN"]) for plan in (conv.plan, conv.folded)]
    finally:
        p.close()
    assert across[0] < across[1]  # per image 400 columns, folded 1200
    monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", f"max_workgroup_count={across[0]}x65535x65535")
    p = vulkan_pool()
    try:
        vk = p.vulkan_members[0]
        with Session(model, pool=p, device=vk.id) as s:
            (conv,) = s._chunk.ops
            assert {d.defines.get("FOLD", 0) for d in dispatches_of(conv, vk.device.caps)} == {0}
            assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()


def test_a_long_reduction_and_the_loop_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product whose reduction runs 600 steps or more in one invocation; and one of 300 steps
    under a loop limit lowered below twice its steps (the register tiling's loop steps per k),
    where the shared tiling, 16 steps of k per loop step, runs instead: all equal onnxruntime's."""
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=register")
    model, feeds, expected = ort_case("MatMul", [rand(768, 1200), rand(1200, 768)], {}, (1,))
    got, steps, register = run_under_limits(model, feeds, "", monkeypatch)
    assert steps >= 600 and register == 1
    assert_outputs_match(got, expected, rtol=1e-4, atol=1e-3)
    model, feeds, expected = ort_case("MatMul", [rand(64, 300), rand(300, 64)], {}, (1,))
    _, steps, _ = run_under_limits(model, feeds, "", monkeypatch)
    for limits, tiling in (("", 1), (f"max_loop_iterations={2 * steps}", 0)):
        got, _, register = run_under_limits(model, feeds, limits, monkeypatch)
        assert register == tiling
        assert_outputs_match(got, expected, rtol=1e-4, atol=1e-4)


def test_a_tile_larger_than_the_shared_memory_gives_way_to_one_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A product of few rows and many columns takes the 32 x 256 tile (18.6 KB of shared memory
    here); on a device of 16 KiB, the least Vulkan allows, it runs in a tile that fits, with the
    same result, and with less still in the smallest."""
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=shared")
    model, feeds, expected = ort_case("MatMul", [rand(20, 40), rand(40, 8200)], {}, (1,))
    for limits, width in (("", 256), ("max_shared_memory_bytes=16384", 64),
                          ("max_shared_memory_bytes=6000", 32)):
        monkeypatch.setenv("VKPOOL_DEVICE_LIMITS", limits)
        p = vulkan_pool()
        try:
            caps = p.vulkan_members[0].device.caps
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                (op,) = s._chunk.ops
                tile = op.plan.tile_for(caps)
                fits = op.plan.shared_bytes(tile) <= caps.shared_memory_bytes
                assert tile["BN"] == width and fits, (limits, tile)
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
        finally:
            p.close()


@pytest.mark.parametrize("tile", ["64x64", "32x32", "32x256", "128x128", "64x64s", "128x128s"])
def test_every_shared_tile_matches_onnxruntime(tile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tile of the shared tiling (most read their stages as vec4), and two read as scalars
    (``...s``), forced on
    products of odd sizes and of columns in fours, with either operand read along K or across it
    (its stage's rows padded or not), a split reduction, grouped and strided convolutions, a batch
    of images as one product: all equal onnxruntime's."""
    from vkpool.kernels.ops import gemm

    if tile.endswith("s"):
        monkeypatch.setitem(gemm.TILES, tile, {**gemm.TILES[tile[:-1]], "VEC4": 0})
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=shared")
    monkeypatch.setattr(gemm, "choose_tile", lambda p, workgroups: tile)
    p = vulkan_pool()
    try:
        vk = p.vulkan_members[0]
        for name in ("matmul_odd", "gemm_transposed_bias", "gemm_alpha_beta", "conv_groups_stride",
                     "conv_split_k", "conv_1x1_groups_batch", "matmul_cols_by_4", "gemm_cols_by_4_bias",
                     "conv_cols_by_4_split_k", "conv_batch_folded"):
            op, inputs, attrs, constants = CASES[name]
            model, feeds, expected = ort_case(op, inputs, attrs, constants)
            with Session(model, pool=p, device=vk.id) as s:
                plans = [o.plan for o in s._chunk.ops if getattr(o, "plan", None) is not None]
                assert plans and all(pl.tile_for(vk.device.caps)["BM"] == gemm.TILES[tile]["BM"] for pl in plans)
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()


def test_relu_fused_into_the_register_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnx import TensorProto, helper, numpy_helper
    import onnxruntime as ort

    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=register:3x5x8")
    w = numpy_helper.from_array(rand(24, 3, 3, 3), "w")
    b = numpy_helper.from_array(rand(24), "b")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]),
                               helper.make_node("Add", ["h", "b3"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                              "conv_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 17, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 17, 10])],
                              [w, numpy_helper.from_array(rand(24).reshape(24, 1, 1), "b3"), b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    x = rand(1, 3, 17, 10, seed=3)
    p = vulkan_pool()
    try:
        with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
            assert [n.attrs.get("activation") for n in s.model.nodes] == ["Relu"]  # fused: the epilogue runs it
            got = s.run(None, {"x": x})
    finally:
        p.close()
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_outputs_match(got, want, rtol=1e-4, atol=1e-4)


def test_the_device_type_chooses_and_a_bad_override_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    from vkpool.discovery import discover

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))  # no tuning
    monkeypatch.delenv("VKPOOL_KERNEL_VARIANT", raising=False)
    for info in discover():
        choice = gemm_choice(info)
        assert choice.variant == ("register" if info.type == "cpu" else "shared")
        if info.type == "cpu":
            assert choice.register_tile == DEFAULT_REGISTER_TILE
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=fast")
    with pytest.raises(KernelVariantError, match="gemm=register:TMxTNxWG"):
        forced()


def test_the_tuning_pass_keeps_the_fastest_tile_per_device_and_driver(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Any) -> None:
    import dataclasses
    import io

    from vkpool.kernel_variants import load_tuned, save_tuned, tune_register_tile

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKPOOL_KERNEL_VARIANT", raising=False)
    p = vulkan_pool()
    try:
        vk = p.vulkan_members[0]
        out = io.StringIO()
        best, seconds = tune_register_tile(p, vk, 1, out, tiles=((2, 4, 8), (4, 2, 8)))
        assert set(seconds) == {"2x4x8", "4x2x8"} and seconds["x".join(map(str, best))] == min(seconds.values())
        assert vk.device.caps.register_tile == best and "register tile 2x4x8" in out.getvalue()
        save_tuned(vk.info, best, seconds)
        assert load_tuned(vk.info) is not None and load_tuned(vk.info).register_tile == best
        if vk.info.type == "cpu":  # a CPU-like device starts with the tile measured on it
            assert gemm_choice(vk.info).register_tile == best
        other = dataclasses.replace(vk.info, driver_info=vk.info.driver_info + " (another build)")
        assert load_tuned(other) is None  # measured with another driver
        monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=shared")  # forcing wins over tuning
        assert gemm_choice(vk.info).variant == "shared"
    finally:
        p.close()


def residual_case(name: str, relu: bool, swap: bool) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """:func:`node_cases.conv_residual_case` of the convolution of ``CASES[name]``."""
    _, inputs, attrs, _ = CASES[name]
    return conv_residual_case(inputs, attrs, lambda shape: rand(*shape, seed=11), relu, swap)


#: convolutions whose residual sum each kernel path adds: a grouped strided one per image, a split
#: reduction (gemm_reduce.comp), a pointwise one over a batch, a batch of images as one product
#: split over K (gemm_reduce.comp's FOLD) and not, and one of few channels (conv.comp)
RESIDUAL_CASES = ["conv_groups_stride", "conv_split_k", "conv_1x1_groups_batch", "conv_cols_by_4_split_k",
                  "conv_batch_folded", "conv_direct"]
CASES["conv_direct"] = ("Conv", [rand(2, 3, 9, 8), rand(8, 3, 3, 3), rand(8)], {"pads": [1, 1, 1, 1]}, (1, 2))


@pytest.mark.parametrize("variant, names", [
    ("gemm=shared", ["conv_groups_stride", "conv_split_k", "conv_cols_by_4_split_k", "conv_batch_folded"]),
    ("gemm=register", ["conv_groups_stride", "conv_1x1_groups_batch", "conv_direct"]),  # taps, pointwise
    ("gemm=register:3x5x8", ["conv_split_k", "conv_batch_folded"]),
])
def test_a_residual_sum_runs_in_its_convolution(variant: str, names: list[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``[Relu](Add(Conv(...), r))`` loads as one Conv that adds ``r`` before the activation, on
    every kernel path (the shared and register tilings, the window-taps kernel, the split
    reduction, a folded batch, the direct convolution), equal to onnxruntime's outputs; the host
    member runs it spelled out again."""
    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", variant)
    p = vulkan_pool()
    try:
        for name in names:
            k = RESIDUAL_CASES.index(name)
            model, feeds, expected = residual_case(name, relu=k % 2 == 0, swap=k % 3 == 1)
            with Session(model, pool=p, device=p.vulkan_members[0].id) as s:
                [node] = s.model.nodes
                assert node.op_type == "Conv" and node.inputs[3] == "r", node
                assert node.attrs.get("activation") == ("Relu" if k % 2 == 0 else None)
                assert_outputs_match(s.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
            if variant == "gemm=shared" and name == "conv_batch_folded":
                with Session(model, pool=p, device="cpu") as host:
                    assert_outputs_match(host.run(None, feeds), expected, rtol=1e-4, atol=1e-4)
    finally:
        p.close()
