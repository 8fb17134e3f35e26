"""Recorded commands on the real Vulkan device: GPU timestamp profiles, the barrier choice, where
inputs, outputs and weights live (copied in, copied out, stored transposed)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from vkpool.device import _barriers_near_copies
from vkpool.session import Session


def _chain(n: int) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])
    one = numpy_helper.from_array(np.ones(256, np.float32), "one")
    nodes = [helper.make_node("Add", ["x" if i == 0 else f"t{i}", "one"], [f"t{i + 1}" if i < n - 1 else "y"])
             for i in range(n)]
    g = helper.make_graph(nodes, "chain", [x], [y], [one])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def test_profile_times_every_dispatch_and_leaves_the_model_intact(pool):
    with Session(_chain(5), pool=pool) as sess:
        chunk = sess._chunk
        device = chunk.device
        recordings = device.counters.recordings
        times = device.profile(chunk.commands)
        assert len(times) == len(chunk.dispatch_labels) == 5
        assert all(t > 0 for t in times)
        assert all("Add" in label and "[binary]" in label for label in chunk.dispatch_labels)
        assert device.counters.recordings == recordings  # a profile is not a recording of the model
        x = np.arange(256, dtype=np.float32)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + 5)


def test_barriers_next_to_copies_keep_the_transfer_stage():
    d, b, c, h = ("dispatch",), ("barrier",), ("copy",), ("host_barrier",)
    # indices:              0  1  2  3  4  5  6  7  8
    assert _barriers_near_copies([d, b, d, b, c, b, d, b, d]) == {3, 5}
    assert _barriers_near_copies([d, b, d, b, d, h]) == set()
    assert _barriers_near_copies([c, b, d, b, d, b, c, h]) == {1, 5, 7}


def _add_one(n: int) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])
    one = numpy_helper.from_array(np.ones(1, np.float32), "one")
    g = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "add", [x], [y], [one])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def test_large_outputs_are_copied_out_and_small_ones_written_in_place(pool):
    from vkpool.engine import STAGED_OUTPUT_BYTES

    for n, staged in ((STAGED_OUTPUT_BYTES // 4, True), (STAGED_OUTPUT_BYTES // 4 - 1, False)):
        with Session(_add_one(n), pool=pool) as sess:
            # word-aligned copies run as a copy shader, keeping every barrier compute-only
            copies = [label for label in sess._chunk.dispatch_labels if label.startswith("copy-out y")]
            assert len(copies) == (1 if staged else 0)
            assert not [c for c in sess._chunk.commands if c[0] == "copy"]
            x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
            for _ in range(3):
                np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + 1)


def test_gemv_weights_are_stored_transposed_and_a_second_reader_keeps_the_original(pool):
    k, n = 24, 40
    w = np.random.default_rng(5).standard_normal((k, n)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [k, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [k, n])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["z", "w"], ["s"])]
    g = helper.make_graph(nodes, "g", [x, z], [y, s], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    with Session(model, pool=pool) as sess:
        chunk = sess._chunk
        assert any("MatMul" in label and "[gemv_t]" in label for label in chunk.dispatch_labels)
        assert list(chunk._transposed) == ["w"]
        assert chunk.stats.weight_bytes == 2 * w.nbytes  # the GEMV's copy and the Add's
        rng = np.random.default_rng(6)
        xv = rng.standard_normal((1, k)).astype(np.float32)
        zv = rng.standard_normal((k, n)).astype(np.float32)
        got_y, got_s = sess.run(None, {"x": xv, "z": zv})
    np.testing.assert_allclose(got_y, xv @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_s, zv + w)


class _DeviceOnly:
    """An allocation presented as memory the host cannot map, so that uploads take the staging
    path (vkCmdCopyBuffer on the real device) even where all device memory is mapped."""

    def __init__(self, alloc) -> None:
        self.alloc = alloc
        self.buffer, self.offset, self.nbytes = alloc.buffer, alloc.offset, alloc.nbytes
        self.host_visible = False


@pytest.mark.parametrize("transpose", [False, True])
def test_staged_upload_copies_blocks_of_rows(pool, vk_member, monkeypatch, transpose):
    import vkpool.pool as pool_module

    monkeypatch.setattr(pool_module, "STAGING_CHUNK_BYTES", 4096)  # several blocks, and a short last one
    array = np.random.default_rng(9).standard_normal((37, 50)).astype(np.float32)
    alloc = vk_member.alloc(array.nbytes)
    try:
        vk_member.upload(_DeviceOnly(alloc), array, transpose=transpose)
        expected = array.T if transpose else array
        np.testing.assert_array_equal(alloc.view()[: array.nbytes].view(np.float32).reshape(expected.shape), expected)
    finally:
        alloc.free()


def test_an_output_of_odd_byte_size_is_copied_out_by_a_transfer_command(pool):
    from vkpool.engine import STAGED_OUTPUT_BYTES

    n = STAGED_OUTPUT_BYTES + 1  # uint8: not a whole number of 32-bit words
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [n])
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.UINT8)], "cast", [x], [y])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    with Session(model, pool=pool) as sess:
        assert len([c for c in sess._chunk.commands if c[0] == "copy"]) == 1
        v = np.arange(n, dtype=np.float32) % 200
        np.testing.assert_array_equal(sess.run(None, {"x": v})[0], v.astype(np.uint8))
