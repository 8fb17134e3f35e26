"""Large outputs handed out in host memory imported into the device (``VK_EXT_external_memory_host``),
on the real Vulkan device (lavapipe imports host memory).

The threshold ``IMPORTED_OUTPUT_BYTES`` is lowered to the product's 160 KiB output (over
``STAGED_OUTPUT_BYTES``: computed in device memory). Results must equal the ONNX reference
evaluator (rtol 1e-4, atol 1e-5) and, bit for bit, the same model on the copy path; a buffer must
never be written while an array or view over it lives, and must come back when none does."""
from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
from conftest import matmul_model, transfer_queue_pool
from onnx.reference import ReferenceEvaluator

from vkpool import engine
from vkpool.engine import STAGED_OUTPUT_BYTES, VulkanChunk
from vkpool.model import load_model
from vkpool.session import Session

ROWS, K, N = 64, 96, 640  # output 160 KiB
CAP = engine.IMPORTED_OUTPUT_BUFFERS


def _model(seed: int = 3) -> bytes:
    return matmul_model(ROWS, K, N, seed=seed)


def _two_outputs() -> bytes:
    """y1 = x @ w1 and y2 = x @ w2: two large outputs of one chunk."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    ws = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), f"w{i}") for i in (1, 2)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])
    ys = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [ROWS, N]) for i in (1, 2)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in (1, 2)]
    g = helper.make_graph(nodes, "g", [x], ys, ws)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def _inputs(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((ROWS, K)).astype(np.float32) for _ in range(count)]


def _reference(data: bytes, x: np.ndarray) -> list[np.ndarray]:
    return ReferenceEvaluator(onnx.load_from_string(data)).run(None, {"x": x})


@pytest.fixture
def importing(pool, monkeypatch):
    """The pool, with outputs from 160 KiB handed out in imported memory; skipped on a device
    without the extension."""
    device = pool.vulkan_members[0].device
    if not device.host_import_alignment:
        # a missing device capability (lavapipe and the NVIDIA driver have it): such a device copies
        # its outputs as before, which test_small_outputs_and_devices_without_the_extension_copy runs
        pytest.skip(f"needs a Vulkan device with VK_EXT_external_memory_host; {device.name} has none")
    assert ROWS * N * 4 >= STAGED_OUTPUT_BYTES
    monkeypatch.setattr(engine, "IMPORTED_OUTPUT_BYTES", ROWS * N * 4)
    return pool


def _copying(pool, data: bytes, monkeypatch) -> Session:
    """A session of ``data`` on today's copy path (the threshold above every output)."""
    with monkeypatch.context() as m:
        m.setattr(engine, "IMPORTED_OUTPUT_BYTES", 1 << 62)
        sess = Session(data, pool=pool)
    assert sess._chunk.imported == {}
    return sess


def test_outputs_come_from_recycled_imports_and_equal_the_copy_path(importing, monkeypatch):
    data = _model()
    xs = _inputs(40)
    with Session(data, pool=importing) as sess, _copying(importing, data, monkeypatch) as old:
        buffers = sess._chunk.imported["y"]
        for x in xs:
            (y,) = sess.run(None, {"x": x})
            assert not y.flags.owndata and y.ctypes.data % 4096 == 0
            np.testing.assert_array_equal(y, old.run(None, {"x": x})[0])
            np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        # the previous result is alive while the next run takes a buffer: two buffers take turns
        assert buffers.imports == 2
        assert buffers.reuses == len(xs) - 2 and buffers.copies == 0


def test_a_kept_view_keeps_its_values_across_later_runs(importing):
    data = _model()
    xs = _inputs(3 * CAP, seed=1)
    with Session(data, pool=importing) as sess:
        (y,) = sess.run(None, {"x": xs[0]})
        row, strided = y[0], y.reshape(-1)[::2]  # a view, and a view of a view
        expected_row, expected_strided = row.copy(), strided.copy()
        del y
        for x in xs[1:]:
            (z,) = sess.run(None, {"x": x})
            np.testing.assert_allclose(z, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(row, expected_row)
            np.testing.assert_array_equal(strided, expected_strided)
        buffers = sess._chunk.imported["y"]
        assert buffers.imports == 3  # the views' buffer, and two taking turns
        del row
        gc.collect()
        sess.run(None, {"x": xs[0]})
        np.testing.assert_array_equal(strided, expected_strided)  # the other view holds the buffer still
        del strided, z
        reused = buffers.reuses
        for x in xs[:2 * CAP]:
            sess.run(None, {"x": x})
        assert buffers.imports == 3 and buffers.reuses == reused + 2 * CAP


def test_arrays_held_beyond_the_cap_are_copies_and_all_correct(importing):
    data = _model()
    xs = _inputs(CAP + 3, seed=2)
    with Session(data, pool=importing) as sess:
        held = [sess.run(None, {"x": x})[0] for x in xs]
        buffers = sess._chunk.imported["y"]
        assert buffers.imports == CAP and buffers.copies == 3
        assert [y.flags.owndata for y in held] == [False] * CAP + [True] * 3
        assert len({y.ctypes.data for y in held}) == len(held)
        for x, y in zip(xs, held):
            np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        del held[:2]
        (y,) = sess.run(None, {"x": xs[0]})
        assert not y.flags.owndata and buffers.reuses == 1 and buffers.imports == CAP
        np.testing.assert_allclose(y, _reference(data, xs[0])[0], rtol=1e-4, atol=1e-5)
        for x, y in zip(xs[2:], held):  # none of the arrays still held was written
            np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)


def test_arrays_outlive_a_closed_or_deleted_session(importing):
    data = _model()
    xs = _inputs(6, seed=3)
    sess = Session(data, pool=importing)
    closed = [sess.run(None, {"x": x})[0] for x in xs[:3]]
    row = closed.pop()[1]
    buffers = sess._chunk.imported["y"]
    imports = [buf.allocation for buf in buffers.buffers]
    assert len(imports) == 3
    sess.close()
    assert all(alloc.freed for alloc in imports) and buffers.buffers == []
    sess = Session(data, pool=importing)
    deleted = [sess.run(None, {"x": x})[0] for x in xs[3:]]
    del sess
    gc.collect()
    for x, y in zip(xs[:2] + xs[3:], closed + deleted):
        np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        y += 1.0  # still the caller's memory, writable
    np.testing.assert_allclose(row, _reference(data, xs[2])[0][1], rtol=1e-4, atol=1e-5)
    del closed, deleted, row
    gc.collect()


def test_two_outputs_one_held_past_the_cap_and_one_not_asked_for(importing):
    data = _two_outputs()
    model = load_model(data)
    member = importing.vulkan_members[0]
    chunk = VulkanChunk(member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y1", "y2"],
                        model.opset)
    try:
        y1s = chunk.imported["y1"]
        y2s = chunk.imported["y2"]
        xs = _inputs(CAP + 2, seed=5)
        held = []
        for x in xs:  # y1 held, y2 dropped: past the cap, y1 goes to the slot while y2 is imported
            got = chunk.run({"x": x})
            held.append(got["y1"])
            y1, y2 = _reference(data, x)
            np.testing.assert_allclose(got["y1"], y1, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got["y2"], y2, rtol=1e-4, atol=1e-5)
        assert (y1s.imports, y1s.copies) == (CAP, 2)
        assert (y2s.imports, y2s.copies) == (2, 0)
        for x, y in zip(xs, held):
            np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        del held
        got = chunk.finish(chunk.start({"x": xs[0]}), outputs=["y1"])
        assert list(got) == ["y1"]
        np.testing.assert_allclose(got["y1"], _reference(data, xs[0])[0], rtol=1e-4, atol=1e-5)
        reused = y2s.reuses
        both = [chunk.run({"x": x})["y2"] for x in xs[:2]]  # the y2 buffer not asked for came back
        assert y2s.reuses == reused + 2 and y2s.imports == 2
        for x, y in zip(xs, both):
            np.testing.assert_allclose(y, _reference(data, x)[1], rtol=1e-4, atol=1e-5)
    finally:
        chunk.close()


def test_in_place_runs_leave_every_output_in_the_slot(importing):
    data = _model()
    model = load_model(data)
    member = importing.vulkan_members[0]
    chunk = VulkanChunk(member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y"], model.opset)
    try:
        assert list(chunk.imported) == ["y"]
        xs = _inputs(3, seed=6)
        imported = chunk.run({"x": xs[0]})["y"]
        assert not imported.flags.owndata
        for x in xs[1:]:
            inputs, outputs = chunk.slot_views(0)
            np.copyto(inputs["x"], x)
            chunk.start_in_place(0)
            chunk.wait_in_place(0)
            np.testing.assert_allclose(outputs["y"], _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(imported, _reference(data, xs[0])[0], rtol=1e-4, atol=1e-5)
        assert chunk.imported["y"].imports == 1
    finally:
        chunk.close()


def test_a_run_that_fails_on_the_device_gives_its_buffer_back(importing, monkeypatch):
    data = _model()
    x = _inputs(1, seed=11)[0]
    with Session(data, pool=importing) as sess:
        chunk = sess._chunk
        buffers = chunk.imported["y"]
        wait = chunk.device.wait

        def lost(*args, **kwargs):
            wait(*args, **kwargs)  # the run ends; the wait reports a failure
            raise RuntimeError("device lost")

        monkeypatch.setattr(chunk.device, "wait", lost)
        with pytest.raises(RuntimeError, match="device lost"):
            sess.run(None, {"x": x})
        monkeypatch.setattr(chunk.device, "wait", wait)
        assert buffers.imports == 1 and len(buffers._free) == 1  # taken by the run, back in the pool
        (y,) = sess.run(None, {"x": x})
        assert buffers.reuses == 1
        np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)


def test_two_slots_back_to_back_and_threads(importing, monkeypatch):
    data = _model()
    xs = _inputs(24, seed=7)
    # a device with a transfer queue copies two slots' outputs there instead (tested below)
    monkeypatch.setattr(importing.vulkan_members[0].device, "transfer_family", None)
    with Session(data, pool=importing, run_slots=2) as sess:
        first = sess._chunk._slots[0]
        assert sess._chunk.slots == 2 and first.chained is not None and len(first.to_slot) == 1
        got = sess.run_many([{"x": x} for x in xs])
        for x, (y,) in zip(xs, got):
            np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        del got
        errors: list[str] = []

        def worker(k: int) -> None:
            for x in _inputs(10, seed=100 + k):
                (y,) = sess.run(None, {"x": x})
                if not np.allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5):
                    errors.append(f"thread {k} got another request's result")

        with ThreadPoolExecutor(6) as threads:
            list(threads.map(worker, range(6)))
        assert not errors
        assert sess._chunk.imported["y"].imports <= CAP


def test_small_outputs_and_devices_without_the_extension_copy(pool, monkeypatch):
    data = _model()
    x = _inputs(1, seed=8)[0]
    with monkeypatch.context() as m:
        m.setattr(engine, "IMPORTED_OUTPUT_BYTES", ROWS * N * 4 + 1)
        with Session(data, pool=pool) as sess:
            assert sess._chunk.imported == {}
            (y,) = sess.run(None, {"x": x})
            assert y.flags.owndata
    device = pool.vulkan_members[0].device
    monkeypatch.setattr(device, "host_import_alignment", None)
    with Session(data, pool=pool) as sess:
        assert sess._chunk.imported == {}
        assert all(not s.to_slot for s in sess._chunk._slots)  # the outputs' copies in the recording
        (y,) = sess.run(None, {"x": x})
        assert y.flags.owndata
        np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)


def test_the_transfer_queue_keeps_its_landing_copies(monkeypatch):
    monkeypatch.setattr(engine, "IMPORTED_OUTPUT_BYTES", ROWS * N * 4)
    data = _model()
    model = load_model(data)
    pool, member = transfer_queue_pool("main")
    try:
        chunk = VulkanChunk(member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y"], model.opset,
                            slots=2)
        try:
            assert chunk.imported == {}
            for x in _inputs(3, seed=9):
                y = chunk.run({"x": x})["y"]
                assert y.flags.owndata
                np.testing.assert_allclose(y, _reference(data, x)[0], rtol=1e-4, atol=1e-5)
        finally:
            chunk.close()
    finally:
        pool.close()
