"""Data movement and attention kernels on the real Vulkan device, against ONNX's reference.

One-node models through ``vkpool.Session``; inputs that fix output shapes (pads, k, depth,
scales/sizes) are initializers. Tolerances: float32 rtol 1e-4, atol 1e-5 (Resize: atol 1e-4,
coordinates are float32 on the device and float64 in the reference); integer, bool and
gathered values must match exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernels_reduce import assert_matches, randn, run_node

RNG = np.random.default_rng(11)


def test_gather_elements_negative_indices(pool):
    x = randn(3, 4)
    idx = RNG.integers(-4, 4, (3, 5)).astype(np.int64)
    got, want = run_node(pool, "GatherElements", [x, idx], {"axis": 1})
    assert_matches(got, want)


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd(pool, batch_dims):
    x = randn(2, 3, 4)
    idx = np.array([[[1, 2]], [[0, -1]]], np.int64) if batch_dims else np.array([[1, 2], [0, -1]], np.int64)
    got, want = run_node(pool, "GatherND", [x, idx], {"batch_dims": batch_dims})
    assert_matches(got, want)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_duplicates_apply_in_order(pool, reduction):
    x = randn(3, 4)
    idx = np.array([[1, 1, 3], [0, 0, 0], [2, 3, 2]], np.int64)
    upd = randn(3, 3)
    attrs = {"axis": 1} if reduction == "none" else {"axis": 1, "reduction": reduction}
    if reduction == "none":  # duplicates are undefined without a reduction: use distinct ones
        idx = np.array([[1, 0, 3], [0, 2, 1], [2, 3, 0]], np.int64)
    got, want = run_node(pool, "ScatterElements", [x, idx, upd], attrs, opset=18)
    assert_matches(got, want)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd(pool, reduction):
    x = RNG.integers(-9, 9, (4, 3)).astype(np.int64)
    idx = np.array([[2], [0], [2]], np.int64) if reduction != "none" else np.array([[2], [0]], np.int64)
    upd = RNG.integers(-9, 9, (len(idx), 3)).astype(np.int64)
    got, want = run_node(pool, "ScatterND", [x, idx, upd], {"reduction": reduction}, opset=18)
    assert_matches(got, want)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(pool, mode):
    x = randn(2, 3, 4)
    pads = np.array([0, 2, 1, 1, 3, 2], np.int64)
    inputs = [x, pads, np.array(1.5, np.float32) if mode == "constant" else None]
    got, want = run_node(pool, "Pad", inputs, {"mode": mode}, constants=(1,), opset=19)
    assert_matches(got, want)


def test_pad_axes_and_negative_pads(pool):
    x = randn(3, 5)
    # written out: the reference evaluator (numpy.pad) refuses negative pads, which crop
    want = [np.pad(x[:, :-1], ((0, 0), (2, 0)))]
    got, _ = run_node(pool, "Pad", [x, np.array([2, -1], np.int64), None, np.array([1], np.int64)],
                      constants=(1, 3), opset=19, expected=want)
    assert_matches(got, want)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [-1, 2])
def test_trilu_k_at_run_time(pool, upper, k):
    x = RNG.integers(-5, 5, (2, 4, 5)).astype(np.int64)
    got, want = run_node(pool, "Trilu", [x, np.array(k, np.int64)], {"upper": upper})
    assert_matches(got, want)


def test_onehot(pool):
    idx = np.array([[1, -1], [0, 4]], np.int64)
    got, want = run_node(pool, "OneHot", [idx, np.array(5, np.int64), np.array([2.0, 7.0], np.float32)],
                         {"axis": 1}, constants=(1,))
    assert_matches(got, want)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(pool, mode):
    got, want = run_node(pool, "DepthToSpace", [randn(2, 8, 2, 3)], {"blocksize": 2, "mode": mode})
    assert_matches(got, want)


def test_space_to_depth(pool):
    got, want = run_node(pool, "SpaceToDepth", [randn(1, 2, 4, 6)], {"blocksize": 2}, opset=13)
    assert_matches(got, want)


@pytest.mark.parametrize("attrs,scales", [
    ({"mode": "nearest", "nearest_mode": "round_prefer_ceil"}, [1, 1, 1.5, 2.0]),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2.0, 0.5]),
    ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, [1, 1, 1.25, 0.75]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6]),
])
def test_resize_scales(pool, attrs, scales):
    x = randn(1, 2, 4, 5)
    got, want = run_node(pool, "Resize", [x, None, np.array(scales, np.float32)], attrs, constants=(2,), opset=19)
    assert_matches(got, want, atol=1e-4)


def test_resize_crop_and_resize_with_run_time_roi(pool):
    x = randn(1, 1, 4, 4)
    roi = np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32)  # part of it out of range
    got, want = run_node(pool, "Resize", [x, roi, None, np.array([1, 1, 3, 3], np.int64)],
                         {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
                          "extrapolation_value": 5.0}, constants=(3,), opset=19)
    assert_matches(got, want, atol=1e-4)


@pytest.mark.parametrize("shape3d", [False, True])
def test_attention_gqa_causal_mask(pool, shape3d):
    b, hq, hkv, s, t, d = 2, 4, 2, 3, 5, 8
    if shape3d:
        q, k, v = randn(b, s, hq * d), randn(b, t, hkv * d), randn(b, t, hkv * d)
        attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1}
    else:
        q, k, v = randn(b, hq, s, d), randn(b, hkv, t, d), randn(b, hkv, t, d)
        attrs = {"is_causal": 1}
    mask = RNG.integers(0, 2, (s, t)).astype(np.bool_)
    mask[:, 0] = True
    got, want = run_node(pool, "Attention", [q, k, v, mask], {**attrs, "softcap": 2.0})
    assert_matches(got, want)


def test_attention_past_present_and_qk_output(pool):
    b, h, s, p, d = 1, 2, 2, 3, 4
    q, k, v = randn(b, h, s, d), randn(b, h, s, d), randn(b, h, s, d)
    pk, pv = randn(b, h, p, d), randn(b, h, p, d)
    mask = randn(s, p + s)
    got, want = run_node(pool, "Attention", [q, k, v, mask, pk, pv], {"qk_matmul_output_mode": 3, "scale": 0.3},
                         num_outputs=4)
    assert_matches(got, want)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(pool, interleaved):
    x = randn(2, 3, 4, 8)  # [B, H, S, D]
    cos, sin = randn(10, 3), randn(10, 3)  # rotary_embedding_dim 6: partial rotation
    pos = RNG.integers(0, 10, (2, 4)).astype(np.int64)
    got, want = run_node(pool, "RotaryEmbedding", [x, cos, sin, pos],
                         {"interleaved": interleaved, "rotary_embedding_dim": 6})
    assert_matches(got, want)


def test_swiglu(pool):
    got, want = run_node(pool, "SwiGLU", [randn(3, 5), randn(3, 5)], {"alpha": 1.702}, opset=28)
    assert_matches(got, want)


def test_nonzero_of_a_run_time_tensor_is_refused(pool):
    from vkpool.kernels.base import TensorInfo, UnsupportedOp
    from vkpool.kernels.registry import create_op

    with pytest.raises(UnsupportedOp, match="known at load time"):
        create_op("NonZero", {}, [TensorInfo((3,), np.float32)])


def conv_transpose_by_scatter(x: np.ndarray, w: np.ndarray, b: np.ndarray, group: int, strides: list[int],
                               begin: list[int], out: list[int]) -> np.ndarray:
    """Brute-force 2-D ConvTranspose: each input element scatters its kernel onto the output."""
    n, cin, ih, iw = x.shape
    cog, kh, kw = w.shape[1:]
    cig = cin // group
    y = np.zeros((n, cog * group, *out), np.float64) + b.reshape(1, -1, 1, 1)
    for bi, ci, i, j, a, c in np.ndindex(n, cin, ih, iw, kh, kw):
        oh, ow = i * strides[0] + a - begin[0], j * strides[1] + c - begin[1]
        if 0 <= oh < out[0] and 0 <= ow < out[1]:
            g = ci // cig
            y[bi, g * cog:(g + 1) * cog, oh, ow] += x[bi, ci, i, j] * w[ci, :, a, c]
    return y.astype(np.float32)


def test_conv_transpose_2d_pads(pool):
    x, w, b = randn(1, 2, 3, 3), randn(2, 3, 2, 3), randn(3)
    attrs = {"strides": [2, 3], "pads": [1, 0, 0, 2], "output_padding": [1, 1], "dilations": [1, 2]}
    got, want = run_node(pool, "ConvTranspose", [x, w, b], attrs)
    assert_matches(got, want)


@pytest.mark.parametrize("attrs,begin,out", [
    # ONNX's reference evaluator fails on these two, so the expected values come from a scatter
    ({"group": 2, "auto_pad": "SAME_LOWER", "strides": [2, 2]}, [0, 1], [6, 4]),
    ({"output_shape": [7, 6], "strides": [2, 2]}, [0, 0], [7, 6]),
])
def test_conv_transpose_2d_output_shape(pool, attrs, begin, out):
    group = attrs.get("group", 1)
    x, w, b = randn(1, 2 * group, 3, 2), randn(2 * group, 3, 2, 3), randn(3 * group)
    want = [conv_transpose_by_scatter(x, w, b, group, [2, 2], begin, out)]
    got, _ = run_node(pool, "ConvTranspose", [x, w, b], attrs, expected=want)
    assert_matches(got, want)


def test_conv_transpose_1d_and_3d(pool):
    got, want = run_node(pool, "ConvTranspose", [randn(1, 2, 5), randn(2, 3, 3)], {"strides": [2]})
    assert_matches(got, want)
    got, want = run_node(pool, "ConvTranspose", [randn(1, 1, 2, 3, 2), randn(1, 2, 2, 2, 2)], {})
    assert_matches(got, want)


@pytest.mark.parametrize("equation,shapes", [
    ("ij->ji", [(3, 4)]),
    ("...ii->...i", [(2, 3, 3)]),                    # batched diagonal
    ("bij, bjk -> bik", [(2, 2, 3), (2, 3, 4)]),
    ("i,i", [(5,), (5,)]),                          # implicit scalar output
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),     # a chain through the workspace
    ("...j,j", [(2, 1, 3), (3,)]),                  # implicit output with an ellipsis
])
def test_einsum(pool, equation, shapes):
    got, want = run_node(pool, "Einsum", [randn(*s) for s in shapes], {"equation": equation}, opset=12)
    assert_matches(got, want)


def test_einsum_int64(pool):
    a = RNG.integers(-5, 5, (3, 4)).astype(np.int64)
    got, want = run_node(pool, "Einsum", [a, a], {"equation": "ij,ij->i"}, opset=12)
    assert_matches(got, want)
