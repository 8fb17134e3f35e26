"""Copies between a run slot's host memory and the device on a queue of their own
(the config's ``devices[].transfer_queue``), on the real Vulkan device.

Lavapipe has one queue family, so "auto" (the default) gives it no transfer queue; ``"main"`` submits
the same transfer command buffers, semaphores and landing buffers on the compute queue itself,
which checks the mechanism (correct results, the copies where they belong) without the
overlap a separate copy engine gives. The member is made to keep its inputs in host memory
(as on a GPU the host cannot map), so the product's input is copied in, and the output is over
``STAGED_OUTPUT_BYTES``, so it is copied out: both directions run. Results must equal the
ONNX reference evaluator (rtol 1e-4, atol 1e-5) and, bit for bit, the same chunk without a
transfer queue."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import vkpool.device
from conftest import matmul_model, transfer_queue_pool
from vkpool.engine import STAGED_OUTPUT_BYTES, VulkanChunk
from vkpool.model import load_model

ROWS, K, N = 64, 96, 640  # output 160 KiB


def _model() -> bytes:
    return matmul_model(ROWS, K, N, seed=5)


def _runs(member, model, feeds: list[dict[str, np.ndarray]], slots: int) -> tuple[VulkanChunk, list[np.ndarray]]:
    chunk = VulkanChunk(member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y"], model.opset,
                        slots=slots)
    started = [chunk.start(f) for f in feeds[:slots]]  # every slot in flight at once
    out = [chunk.finish(s)["y"] for s in started]
    out += [chunk.run(f)["y"] for f in feeds[slots:]]
    return chunk, out


@pytest.mark.parametrize("mode", ["main", "off"])
def test_copies_on_their_own_queue_give_the_same_results(mode: str) -> None:
    data = _model()
    model = load_model(data)
    assert ROWS * N * 4 >= STAGED_OUTPUT_BYTES
    rng = np.random.default_rng(9)
    feeds = [{"x": rng.standard_normal((ROWS, K)).astype(np.float32)} for _ in range(6)]
    reference = ReferenceEvaluator(onnx.load_from_string(data))
    pool, member = transfer_queue_pool(mode)
    try:
        device = member.device
        chunk, got = _runs(member, model, feeds, slots=2)
        if mode == "main":
            assert device.transfer_family == device.queue_family
            # per slot: one command buffer copying the input in, one copying the output out
            assert len(chunk._links) == 4
            subs = [s for slot in chunk._slots for s in (slot.alone, slot.chained)]
            assert all(s.before is not None and s.after is not None for s in subs)
        else:
            assert device.transfer_family is None and chunk._links == []
        for f, y in zip(feeds, got):
            np.testing.assert_allclose(y, reference.run(None, f)[0], rtol=1e-4, atol=1e-5)
        # one slot never overlaps runs: no transfer queue, the copies stay in the run
        single, alone = _runs(member, model, feeds, slots=1)
        assert single._links == []
        for a, b in zip(got, alone):
            np.testing.assert_array_equal(a, b)
        chunk.close()
        single.close()
    finally:
        pool.close()


def test_auto_takes_a_transfer_only_family_or_none() -> None:
    from vkpool import vk
    from vkpool.device import choose_transfer_family

    b = vk.binding()
    main = b.VK_QUEUE_GRAPHICS_BIT | b.VK_QUEUE_COMPUTE_BIT | b.VK_QUEUE_TRANSFER_BIT
    assert choose_transfer_family([main]) is None  # lavapipe's one family
    assert choose_transfer_family([main, b.VK_QUEUE_TRANSFER_BIT, b.VK_QUEUE_COMPUTE_BIT]) == 1  # NVIDIA's order
    assert choose_transfer_family([main, b.VK_QUEUE_COMPUTE_BIT | b.VK_QUEUE_TRANSFER_BIT]) is None
    pool, member = transfer_queue_pool("auto")
    try:
        device = member.device
        assert device.transfer_family == choose_transfer_family(device.queue_flags)
        assert device.transfer_family != device.queue_family
    finally:
        pool.close()


def test_an_unknown_mode_is_refused_naming_the_key(pool) -> None:
    from vkpool.config.loader import ConfigError, parse_config

    text = "devices:\n  - match: {index: 0}\n    transfer_queue: sometimes\n"
    with pytest.raises(ConfigError, match="devices\\[0\\].transfer_queue: must be one of auto, off, main "
                                          "\\(got 'sometimes'\\)"):
        parse_config(text, "vkpool.yaml")
    with pytest.raises(ValueError, match="transfer queue mode 'sometimes': use one of auto, off, main"):
        vkpool.device.LogicalDevice(pool.vulkan_members[0].info, "sometimes")
