"""float16 MatMul on the real Vulkan device against numpy's float32 product of the same halves.

Tolerance: the kernels accumulate in float32 and round the result to float16 once, so an
element may differ from the float32 reference by half a float16 ulp of the result (at most
2^-11 relative) plus the float32 rounding of a K-term sum taken in another order, at most
K * 2^-24 * (|A| @ |B|) (the worst-case bound, linear in the accumulation length K). Every
element must be within twice both: 2^-10 |ref| + K * 2^-23 * (|A| @ |B|). That worst case is
loose for long sums, so the long-K case also bounds the mean error by 2^-11 of the mean |ref|
(the float16 rounding alone averages at most 2^-12; a float16 accumulator gives about 2^-6).

The cooperative-matrix kernel runs where the device has VK_KHR_cooperative_matrix (NVIDIA,
AMD, Intel GPUs); elsewhere (lavapipe) the scalar float16 kernel does, and the
cooperative-matrix cases skip, naming the missing extension.
"""
from __future__ import annotations

import numpy as np
import pytest

import vkpool
from node_cases import run_node
from vkpool.kernels.base import DeviceCaps
from vkpool.kernels.ops.gemm import MatmulProblem
from vkpool.kernels.ops.gemm_f16 import COOP_TILES, CoopTile, HalfMatmulPlan, coop_shape

RNG = np.random.default_rng(16)


def halves(*shape: int) -> np.ndarray:
    return RNG.uniform(-1.0, 1.0, size=shape).astype(np.float16)


def assert_close_fp16(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    ref = np.matmul(a32, b32)
    bound = np.matmul(np.abs(a32), np.abs(b32))
    k = a.shape[-1]
    assert got.dtype == np.float16 and got.shape == ref.shape
    err = np.abs(got.astype(np.float32) - ref)
    tol = 2.0 ** -10 * np.abs(ref) + k * 2.0 ** -23 * bound
    worst = np.unravel_index(np.argmax(err - tol), err.shape) if err.size else ()
    assert np.all(err <= tol), f"error {err[worst]} > tolerance {tol[worst]} at {worst} (K={k})"


def matmul_model(a_shape: tuple[int, ...], b_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "fp16_matmul",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT16, a_shape),
         helper.make_tensor_value_info("b", TensorProto.FLOAT16, b_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, y_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def run_matmul(pool, member, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    y_shape = np.matmul(np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)).shape
    with vkpool.Session(matmul_model(a.shape, b.shape, y_shape), pool=pool, device=member.id) as sess:
        (y,) = sess.run(None, {"a": a, "b": b})
    return y


SHAPES = [
    ((64, 64), (64, 64)),             # whole tiles
    ((37, 53), (53, 29)),             # nothing a multiple of 8
    ((130, 72), (72, 136)),           # edges past one 128 x 128 tile, vector loads
    ((1, 100), (100, 7)),             # a single row
    ((3, 5, 40), (3, 40, 24)),        # batched
    ((2, 3, 17, 24), (24, 9)),        # batch folded into the rows
    ((2, 1, 8, 16), (1, 4, 16, 8)),   # broadcast batches
    ((48,), (48, 5)),                 # 1-D operands
    ((6, 48), (48,)),
]


@pytest.mark.parametrize("a_shape,b_shape", SHAPES)
def test_fp16_matmul(pool, vk_member, a_shape, b_shape):
    a, b = halves(*a_shape), halves(*b_shape)
    assert_close_fp16(run_matmul(pool, vk_member, a, b), a, b)


def assert_mean_error_fp16(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    ref = np.matmul(a.astype(np.float32), b.astype(np.float32))
    mean_err = float(np.mean(np.abs(got.astype(np.float32) - ref)))
    assert mean_err <= 2.0 ** -11 * float(np.mean(np.abs(ref))), f"mean error {mean_err}"


def test_fp16_matmul_long_reduction(pool, vk_member):
    # a long K, where the accumulator's precision shows in the mean error
    a, b = halves(24, 4096), halves(4096, 40)
    got = run_matmul(pool, vk_member, a, b)
    assert_close_fp16(got, a, b)
    assert_mean_error_fp16(got, a, b)


def test_fp16_matmul_node_reference(pool):
    # the op's own numpy reference (the host member's kernel) agrees with the device
    a, b = halves(9, 33), halves(33, 17)
    got, _ = run_node(pool, "MatMul", [a, b], opset=17, expected=[np.zeros((9, 17), np.float16)])
    assert_close_fp16(got[0], a, b)


def coop_member(pool):
    for member in pool.vulkan_members:
        caps = member.device.caps
        if coop_shape(caps) is not None:
            return member
    names = ", ".join(m.device.info.name for m in pool.vulkan_members)
    # a missing device capability (Mesa's lavapipe has no cooperative matrices); the scalar
    # float16 kernel above runs everywhere, and this path ran on an H200 (docs/benchmarks.md)
    pytest.skip(f"needs a GPU whose driver offers VK_KHR_cooperative_matrix (float16 x float16 -> "
                f"float32) and shaderFloat16; this machine has: {names}")


@pytest.mark.parametrize("a_shape,b_shape", [
    ((256, 256), (256, 256)), ((200, 96), (96, 264)), ((33, 40), (40, 19)), ((4, 70, 64), (4, 64, 72)),
    ((96, 4096), (4096, 128)),
])
def test_coopmat_kernel(pool, a_shape, b_shape):
    member = coop_member(pool)
    a, b = halves(*a_shape), halves(*b_shape)
    got = run_matmul(pool, member, a, b)
    assert_close_fp16(got, a, b)
    assert_mean_error_fp16(got, a, b)


#: beside the planner's tiles, each pipelining mode of the kernel
MODES = (CoopTile(64, 64, 32, 2, 2, PREFETCH=2), CoopTile(64, 64, 32, 2, 2, SWIZZLE=0),
         CoopTile(128, 128, 48, 2, 4, PREFETCH=2, SWIZZLE=4))


def test_coopmat_every_tile(pool):
    # every tile of the list and every pipelining mode, on a product with edges in M, N and K
    # and an odd number of K slices
    member = coop_member(pool)
    caps = member.device.caps
    shape = coop_shape(caps)
    assert shape is not None
    a, b = halves(300, 264), halves(264, 136)
    for tile in [t for t in (*COOP_TILES, *MODES) if t.fits(caps, shape)]:
        y = _run_tile(member, a, b, tile)
        assert_close_fp16(y, a, b)


def _run_tile(member, a: np.ndarray, b: np.ndarray, tile: CoopTile) -> np.ndarray:
    """One product with ``tile`` forced, on buffers of the member's own."""
    from vkpool.kernels.base import pack_push_constants

    device = member.device
    (M, K), (_, N) = a.shape, b.shape
    plan = HalfMatmulPlan(MatmulProblem(M=M, N=N, K=K, sAm=K, sAk=1, sBk=N, sBn=1))
    bufs = [member.alloc(nbytes) for nbytes in (a.nbytes, b.nbytes, M * N * 2)]
    try:
        member.upload(bufs[0], a)
        member.upload(bufs[1], b)
        device.run_once([("dispatch", device.pipeline(d.shader, d.defines),
                          pack_push_constants(d.args, lambda alloc: alloc.address), d.groups)
                         for d in plan.dispatches(*bufs, device.caps, tile)])
        return member.download(bufs[2], (M, N), np.float16)
    finally:
        for buf in bufs:
            buf.free()


def test_coop_shape_choice():
    caps = DeviceCaps(float16=True, cooperative_matrix=True,
                      cooperative_matrix_f16=((16, 8, 8), (16, 8, 16), (16, 16, 16)))
    assert coop_shape(caps) == (16, 16, 16)
    only_small = DeviceCaps(float16=True, cooperative_matrix=True, cooperative_matrix_f16=((16, 8, 8),))
    assert coop_shape(only_small) == (16, 8, 8)
    no_fp16 = DeviceCaps(float16=False, cooperative_matrix=True, cooperative_matrix_f16=((16, 16, 16),))
    assert coop_shape(no_fp16) is None
    assert coop_shape(DeviceCaps(float16=True, cooperative_matrix=False)) is None
    tile = COOP_TILES[0]
    assert CoopTile.parse(tile.name) == tile
    # 48 KiB of shared memory (NVIDIA's limit) holds the preferred tile
    assert tile.fits(DeviceCaps(shared_memory_bytes=48 * 1024, subgroup_size=32), (16, 16, 16))


# -- constant weights whose rows along N are not whole 16-byte vectors: read transposed (N x K) --------

def weights_model(op: str, a: np.ndarray, w: np.ndarray, attrs: dict) -> bytes:
    """``op`` (MatMul or Gemm) of input a by the initializer w."""
    from onnx import TensorProto, helper, numpy_helper

    n = w.shape[0] if attrs.get("transB") else w.shape[1]
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "w"], ["y"], **attrs)], "fp16_weights",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT16, a.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, (*a.shape[:-1], n))],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("op,a_shape,w_shape,attrs,transposed", [
    ("MatMul", (37, 48), (48, 29), {}, True),          # N odd, K a multiple of 8: read N x K
    ("MatMul", (2, 65, 72), (72, 1001), {}, True),     # rows folded, edges past several tiles
    ("MatMul", (1, 40), (40, 7), {}, True),            # one row
    ("MatMul", (9, 36), (36, 29), {}, False),          # K not a multiple of 8 either: as given
    ("Gemm", (33, 64), (21, 64), {"transB": 1}, True),  # a Linear's weight, read as stored
    ("Gemm", (33, 64), (64, 21), {}, True),
    ("Gemm", (33, 64), (24, 64), {"transB": 1}, False),  # N a multiple of 8: K x N
])
def test_fp16_constant_weights_with_odd_columns(pool, op, a_shape, w_shape, attrs, transposed):
    from vkpool.kernels.base import TensorInfo
    from vkpool.kernels.registry import create_op

    a, w = halves(*a_shape), halves(*w_shape)
    node = create_op(op, attrs, [TensorInfo(a.shape, np.float16), TensorInfo(w.shape, np.float16)], {1: w}, opset=17)
    assert node.plan.b_trans is transposed
    b = w.T if attrs.get("transB") else w
    members = [pool.vulkan_members[0]]
    try:
        members.append(coop_member(pool))  # the cooperative-matrix kernel too, where the device has it
    except pytest.skip.Exception:
        pass
    for member in members:
        with vkpool.Session(weights_model(op, a, w, attrs), pool=pool, device=member.id) as sess:
            (y,) = sess.run(None, {"a": a})
        assert_close_fp16(y, a, b)
