"""Device limits are code paths: lavapipe is made to believe smaller limits (VKPOOL_DEVICE_LIMITS)
so that the paths a device with those limits takes run here, on real shaders.

The workgroup-count cases are sized so that every dispatch of the op needs more workgroups than the
lowered limit allows in x, so its grid is folded into y (limit 1000, as on no real device) or into y
and z (61 x 7 x 1000). Each case is one node compared with onnxruntime on the CPU: float32 rtol 1e-4
(atol 1e-5); integers exactly. Before the fold was fixed, every such case left most of its output
unwritten.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

import vkpool
from conftest import vulkan_pool
from node_cases import assert_outputs_match, ort_case as _case
from vkpool.discovery import DeviceLimitsError, lower_limits, parse_limits
from vkpool.kernels.base import DeviceCaps, UnsupportedOp, groups_1d
from vkpool.shaders import SHADER_DIR, ShaderCompileError, workgroup_size_misuse

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
RNG = np.random.default_rng(7)


# -- the fold itself ------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [(65535, 65535, 65535), (1000, 1000, 1000), (61, 7, 1000), (3, 2, 5)])
@pytest.mark.parametrize("n,local", [(1, 256), (255, 256), (257, 64), (1000 * 256 + 1, 256),
                                     (61 * 7 * 64 + 5, 64), (30, 1), (4271, 1)])
def test_groups_1d_covers_every_index_once_within_the_limit(limit, n, local):
    caps = DeviceCaps(max_workgroup_count=limit)
    try:
        gx, gy, gz = groups_1d(n, local, caps)
    except UnsupportedOp:
        assert -(-n // local) > limit[0] * limit[1] * limit[2]
        return
    assert gx <= limit[0] and gy <= limit[1] and gz <= limit[2]
    # the shaders' flat_index(): x + (y + z * ny) * nx * local covers 0 .. n-1 without gaps; at most
    # one x-y layer of workgroups is spare
    needed = -(-n // local)
    assert needed <= gx * gy * gz < needed + gx * gy


def test_limits_parse_and_refuse():
    assert parse_limits("max_workgroup_count=1000") == {"max_workgroup_count": (1000, 1000, 1000)}
    assert parse_limits(" max_workgroup_count=61x7x1000 , max_shared_memory_bytes=16384") == {
        "max_workgroup_count": (61, 7, 1000), "max_shared_memory_bytes": (16384,)}
    assert parse_limits("") == {}
    for bad in ("max_workgroup_count", "maxWorkGroupCount=5", "max_workgroup_count=1x2",
                "max_shared_memory_bytes=lots", "max_workgroup_count=0"):
        with pytest.raises(DeviceLimitsError):
            parse_limits(bad)


def test_a_limit_is_lowered_never_raised():
    from vkpool.discovery import discover

    info = discover()[0]
    low = lower_limits(info, parse_limits("max_workgroup_count=1000x99999999x7, max_shared_memory_bytes=1"))
    assert low.max_workgroup_count == (min(1000, info.max_workgroup_count[0]), info.max_workgroup_count[1],
                                       min(7, info.max_workgroup_count[2]))
    assert low.max_shared_memory_bytes == 1


# -- the build-time check -------------------------------------------------------------------------

def test_no_shader_reads_the_workgroup_size_before_its_layout():
    found = [m for m in (workgroup_size_misuse(p.name) for p in sorted(SHADER_DIR.glob("*.comp"))) if m]
    assert found == []


def test_the_check_finds_a_function_that_reads_it_early():
    early = ["uint flat() { return gl_GlobalInvocationID.y * gl_WorkGroupSize.x; }",
             "layout(local_size_x = 64) in;", "void main() { flat(); }"]
    assert "reads gl_WorkGroupSize" in workgroup_size_misuse("early.comp", early)
    through_macro = ["#define WIDTH gl_WorkGroupSize.x", "#define TWICE (WIDTH * 2)",
                     "uint f() { return TWICE; }", "layout(local_size_x = 64) in;"]
    assert workgroup_size_misuse("macro.comp", through_macro)
    late = ["#define WIDTH gl_WorkGroupSize.x", "layout(local_size_x = 64) in;", "uint f() { return WIDTH; }"]
    assert workgroup_size_misuse("late.comp", late) is None


def test_a_misusing_shader_is_refused_at_compile(tmp_path, monkeypatch):
    import vkpool.shaders as shaders

    (tmp_path / "common.glsl").write_text((SHADER_DIR / "common.glsl").read_text())
    (tmp_path / "early.comp").write_text(
        '#version 450\n#extension GL_GOOGLE_include_directive : require\n#include "common.glsl"\n'
        "uint at() { return gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x; }\n"
        "layout(local_size_x = 64) in;\nvoid main() { at(); }\n")
    monkeypatch.setattr(shaders, "SHADER_DIR", tmp_path)
    with pytest.raises(ShaderCompileError, match="gl_WorkGroupSize"):
        shaders._compile("early", [])


# -- ops on the folded path, on the device --------------------------------------------------------

def _f(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _cases() -> dict[str, tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]]:
    big = (1, 4, 300, 300)  # 360,000 elements: 1,407 groups of 256, 5,625 of 64
    return {
        "Sigmoid": _case("Sigmoid", [_f(*big, scale=4)]),
        "Add": _case("Add", [_f(*big), _f(1, 4, 1, 1)]),
        "Transpose": _case("Transpose", [_f(*big)], {"perm": [0, 2, 3, 1]}),
        "Resize": _case("Resize", [_f(1, 3, 200, 200), np.array([], np.float32), np.array([1, 1, 2, 2], np.float32)],
                        {"mode": "linear"}, constants=(1, 2)),
        "Conv": _case("Conv", [_f(1, 3, 200, 200), _f(8, 3, 3, 3)], {"pads": [1, 1, 1, 1]}, constants=(1,)),
        "MaxPool": _case("MaxPool", [_f(1, 16, 300, 300)], {"kernel_shape": [2, 2], "strides": [1, 1]}),
        "GlobalAveragePool": _case("GlobalAveragePool", [_f(1, 1500, 4, 4)]),
        "Softmax": _case("Softmax", [_f(1500, 33)], {"axis": -1}),
        "ReduceMean short rows": _case("ReduceMean", [_f(70000, 8)], {"axes": [1]}),
        "ReduceSum long rows": _case("ReduceSum", [_f(1500, 100), np.array([1], np.int64)], constants=(1,)),
        "LayerNormalization": _case("LayerNormalization", [_f(1500, 100), _f(100), _f(100)], {"axis": -1},
                                    constants=(1, 2)),
        "ArgMax": _case("ArgMax", [_f(1500, 100)], {"axis": 1}),
        "MatMul row vector": _case("MatMul", [_f(1, 64), _f(64, 1500)], constants=(1,)),
        "BatchNormalization": _case("BatchNormalization", [_f(*big), _f(4), _f(4), _f(4), np.abs(_f(4)) + 0.5],
                                    constants=(1, 2, 3, 4)),
        "CumSum": _case("CumSum", [_f(4, 90000), np.array(0, np.int64)], constants=(1,)),
        "Pad": _case("Pad", [_f(*big), np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)], constants=(1,)),
        "Cast": _case("Cast", [_f(*big, scale=50)], {"to": TensorProto.INT32}),
        "GRU batch": _case("GRU", [_f(2, 1100, 4), _f(1, 24, 4), _f(1, 24, 8)], {"hidden_size": 8},
                           constants=(1, 2)),
    }


CASES: dict[str, Any] = {}


@pytest.fixture(scope="module", params=["1000", "61x7x1000"], ids=["fold-y", "fold-yz"])
def capped_pool(request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", f"max_workgroup_count={request.param}")
        p = vulkan_pool()
    yield p
    p.close()


@pytest.mark.parametrize("name", ["Sigmoid", "Add", "Transpose", "Resize", "Conv", "MaxPool", "GlobalAveragePool",
                                  "Softmax", "ReduceMean short rows", "ReduceSum long rows", "LayerNormalization",
                                  "ArgMax", "MatMul row vector", "BatchNormalization", "CumSum", "Pad", "Cast",
                                  "GRU batch"])
def test_ops_through_a_folded_grid_match_onnxruntime(capped_pool, name):
    member = capped_pool.vulkan_members[0]
    assert max(member.device.caps.max_workgroup_count) <= 1000
    if not CASES:
        CASES.update(_cases())
    model, feeds, expected = CASES[name]
    with vkpool.Session(model, pool=capped_pool, device=member.id) as session:
        assert_outputs_match(session.run(None, feeds), expected)


def test_a_grid_past_the_limit_is_refused_not_run():
    """A tiled product cannot fold its grid: past the limit it is refused at compile, naming the grid."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_workgroup_count=2x1000x1000")
        p = vulkan_pool()
    try:
        model, feeds, _ = _case("MatMul", [_f(256, 16), _f(16, 512)], constants=(1,))
        member = p.vulkan_members[0]
        with pytest.raises(Exception, match="workgroup grid .* exceeds the device's 2 x 1000 x 1000"):
            with vkpool.Session(model, pool=p, device=member.id) as session:
                session.run(None, feeds)
    finally:
        p.close()


# -- workgroup sizes ------------------------------------------------------------------------------

def test_a_shader_wider_than_the_device_allows_is_refused_by_name():
    """A device allowing 128 invocations per workgroup (the least Vulkan guarantees) cannot run the
    256-wide elementwise shaders: the pipeline is refused with the shader and the limit, never
    created past the limit."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_workgroup_invocations=128")
        p = vulkan_pool()
    try:
        model, feeds, _ = _case("Sigmoid", [_f(4, 1000)])
        with pytest.raises(Exception, match=r"unary: workgroups of 256 x 1 x 1 invocations exceed vk\d+'s limits "
                                            r"\(128 invocations"):
            with vkpool.Session(model, pool=p, device=p.vulkan_members[0].id) as session:
                session.run(None, feeds)
    finally:
        p.close()


def test_softmax_narrows_its_workgroups_to_the_device():
    """Softmax picks its workgroup width from the row length, capped by the device's invocations:
    with the cap lowered to 64 a row of 5,000 runs 64 wide and still matches."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_workgroup_invocations=64")
        p = vulkan_pool()
    try:
        model, feeds, expected = _case("Softmax", [_f(3, 5000, scale=3)], {"axis": -1})
        with vkpool.Session(model, pool=p, device=p.vulkan_members[0].id) as session:
            np.testing.assert_allclose(session.run(None, feeds)[0], expected[0], rtol=1e-4, atol=1e-6)
    finally:
        p.close()


def test_local_size_is_read_from_spirv():
    from vkpool.shaders import local_size, spirv

    assert local_size(spirv("unary", {"OP": 1})) == (256, 1, 1)
    assert local_size(spirv("gemv", {"VEC": 4, "TXG": 64, "TYG": 4, "SPLIT": 0, "HAS_BIAS": 0, "RELU": 0})) == (64, 4, 1)


# -- allocation size ------------------------------------------------------------------------------

def test_blocks_and_tensors_respect_the_largest_allocation():
    """With maxMemoryAllocationSize lowered to 1 MiB, small tensors share 1 MiB blocks and run; a
    4 MiB weight is refused with the limit named, not handed to the driver."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_memory_allocation_bytes=1048576")
        p = vulkan_pool()
    try:
        member = p.vulkan_members[0].id
        small, feeds, expected = _case("MatMul", [_f(8, 256), _f(256, 256)], constants=(1,))  # 256 KiB weight
        with vkpool.Session(small, pool=p, device=member) as session:
            np.testing.assert_allclose(session.run(None, feeds)[0], expected[0], rtol=1e-4, atol=1e-5)
        big, feeds, _ = _case("MatMul", [_f(8, 1024), _f(1024, 1024)], constants=(1,))  # 4 MiB weight
        with pytest.raises(MemoryError, match="maxMemoryAllocationSize 1 MiB"):
            with vkpool.Session(big, pool=p, device=member) as session:
                session.run(None, feeds)
    finally:
        p.close()
