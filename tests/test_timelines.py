"""Timeline semaphores between chunks on one device, on the real Vulkan device.

A chunk built with ``waits`` runs only once each timeline reaches the value its start gives;
a chunk built with ``signal`` signals one more value per run. Here the host signals the value a
chunk waits for, from another thread, so the test sees the run end only after that, with no
second chunk to finish first. Both submission shapes are covered: the run alone (``transfer_queue: off``),
and the run between copies on the transfer queue (``"main"``), where the first copy waits and
the last one signals. Results must equal the ONNX reference evaluator (rtol 1e-4, atol 1e-5).
Last, a large tensor between two members of one device is written straight into the memory
they share.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from conftest import matmul_model, transfer_queue_pool, vulkan_pool
from vkpool import vk
from vkpool.engine import VulkanChunk
from vkpool.model import load_model

ROWS, K, N = 64, 96, 640  # an output over STAGED_OUTPUT_BYTES: with a transfer queue, copied after the run


def _model() -> bytes:
    return matmul_model(ROWS, K, N, seed=21)


@pytest.fixture(params=["off", "main"])
def member(request):
    pool, member = transfer_queue_pool(request.param)  # with "main" the input is copied in first
    yield member
    pool.close()


def _chunk(member, data: bytes, **kwargs) -> VulkanChunk:
    model = load_model(data)
    return VulkanChunk(member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y"], model.opset,
                       slots=2, **kwargs)


def _counter(device, timeline) -> int:
    value = device._ffi.new("uint64_t*")
    vk.check("vkGetSemaphoreCounterValue",
             device._lib.vkGetSemaphoreCounterValue(device.handle, timeline.handle, value), device.name)
    return int(value[0])


def _reaches(device, timeline, value: int) -> bool:
    """Whether the timeline reaches ``value`` within five seconds (a driver may signal a
    batch's fence a moment before its semaphores, so the counter is awaited, not read)."""
    b, ffi = device._b, device._ffi
    handles, values = ffi.new("VkSemaphore[]", [timeline.handle]), ffi.new("uint64_t[]", [value])
    info = ffi.new("VkSemaphoreWaitInfo*", {"sType": b.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO, "semaphoreCount": 1,
                                            "pSemaphores": handles, "pValues": values})
    return device._lib.vkWaitSemaphores(device.handle, info, 5_000_000_000) == vk.VK_SUCCESS


def _host_signal(device, timeline, value: int) -> None:
    b, ffi = device._b, device._ffi
    info = ffi.new("VkSemaphoreSignalInfo*", {"sType": b.VK_STRUCTURE_TYPE_SEMAPHORE_SIGNAL_INFO,
                                              "semaphore": timeline.handle, "value": value})
    vk.check("vkSignalSemaphore", device._lib.vkSignalSemaphore(device.handle, info), device.name)


def test_a_run_waits_on_the_device_for_the_value_it_is_given(member) -> None:
    device = member.device
    data = _model()
    x = np.random.default_rng(4).standard_normal((ROWS, K)).astype(np.float32)
    (want,) = ReferenceEvaluator(data).run(None, {"x": x})
    timeline = device.create_timeline()
    chunk = _chunk(member, data, waits=[timeline])
    signaled_at: dict[int, float] = {}

    def signal_later() -> None:  # another thread: a driver may hold the submission until the wait is met
        for value in (2, 3):  # 2 is not yet the value the run waits for
            time.sleep(0.3)
            signaled_at[value] = time.perf_counter()
            _host_signal(device, timeline, value)

    signaller = threading.Thread(target=signal_later)
    try:
        signaller.start()
        slot = chunk.start({"x": x}, waits=[3])
        got = chunk.finish(slot)["y"]
        done = time.perf_counter()
        signaller.join()
        assert done > signaled_at[3]  # the run, milliseconds long, ended only after the value came
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    finally:
        signaller.join()
        chunk.close()
        device.destroy_semaphore(timeline.handle)


def test_each_run_signals_the_next_value(member) -> None:
    device = member.device
    data = _model()
    rng = np.random.default_rng(6)
    feeds = [{"x": rng.standard_normal((ROWS, K)).astype(np.float32)} for _ in range(3)]
    chunk = _chunk(member, data, signal=True)
    try:
        assert chunk.timeline is not None and _counter(device, chunk.timeline) == 0
        first = chunk.start(feeds[0])
        second = chunk.start(feeds[1])  # both slots in flight
        assert (chunk.signaled(first), chunk.signaled(second)) == (1, 2)
        outs = [chunk.finish(first)["y"], chunk.finish(second)["y"]]
        assert _reaches(device, chunk.timeline, 2) and _counter(device, chunk.timeline) == 2
        third = chunk.start(feeds[2])
        assert chunk.signaled(third) == 3
        outs.append(chunk.finish(third)["y"])
        assert _reaches(device, chunk.timeline, 3) and _counter(device, chunk.timeline) == 3
        for f, got in zip(feeds, outs):
            np.testing.assert_allclose(got, ReferenceEvaluator(data).run(None, f)[0], rtol=1e-4, atol=1e-5)
    finally:
        chunk.close()


def test_a_large_tensor_between_chunks_on_one_device(member, monkeypatch) -> None:
    """Two products on two members of one device, the 160 KiB tensor between them over
    ``STAGED_OUTPUT_BYTES``: the producer writes it straight into the memory both share (no
    copy out of its arena, no transfer-queue copy), and the results equal one member's,
    bit for bit, and the reference evaluator's (rtol 1e-4, atol 1e-5 of the largest output:
    two chained products of random weights reach a few hundred and cancel)."""
    from onnx import TensorProto, helper, numpy_helper

    from vkpool.config.loader import parse_config
    from vkpool.engine import STAGED_OUTPUT_BYTES
    from vkpool.executor import RUN_SLOTS
    from vkpool.pool import VulkanMember
    from vkpool.session import Session

    rng = np.random.default_rng(8)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [ROWS, 16])
    w1 = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((N, 16)).astype(np.float32), "w2")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["y"], name="first"),
                           helper.make_node("MatMul", ["y", "w2"], ["z"], name="second")], "g", [x], [z], [w1, w2])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    assert ROWS * N * 4 >= STAGED_OUTPUT_BYTES
    feeds = {"x": rng.standard_normal((ROWS, K)).astype(np.float32)}
    pool = vulkan_pool(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n"))
    # the memory the two share is asked for as the device's own, never mapped by the host (on a
    # GPU, host-visible memory is either host memory or the small window the host maps)
    asked: list[dict] = []
    alloc = VulkanMember.alloc

    def recording(self, nbytes, **kw):
        if nbytes == ROWS * N * 4:  # the tensor y, only ever allocated as the memory both share
            asked.append(kw)
        return alloc(self, nbytes, **kw)

    monkeypatch.setattr(VulkanMember, "alloc", recording)
    try:
        with Session(data, pool=pool, device="vk0.0") as one:
            want = one.run(None, feeds)[0]
        with Session(data, pool=pool, plan={"first": "vk0.0", "second": "vk0.1"}, processes=False) as split:
            producer, consumer = (s.chunk for s in split.executor.copies[0].stages)
            assert producer.tensors["y"].kind == "output" and "y" not in consumer._staged_inputs
            assert not producer._links  # nothing for a transfer queue to copy
            shared = producer._io[0]["y"]  # the device's own memory, not what the host writes inputs to
            assert shared is consumer._io[0]["y"] and shared.allocator is producer.member.local
            assert asked == [{"host_visible": False}] * RUN_SLOTS
            for _ in range(3):
                got = split.run(None, feeds)[0]
                np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(want, ReferenceEvaluator(data).run(None, feeds)[0], rtol=1e-4,
                                   atol=1e-5 * float(np.abs(want).max()))
    finally:
        pool.close()
