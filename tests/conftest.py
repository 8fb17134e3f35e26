"""Shared fixtures: a real Vulkan pool (lavapipe in CI) and a private cache directory."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests never touch the user's cache: SPIR-V, pipeline and model caches go to a folder of this
# checkout (kept between runs so shaders compile once; another checkout has its own).
os.environ.setdefault("VKPOOL_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".test-cache"))
os.environ.pop("VKPOOL_CONFIG", None)
# The suite runs vkpool's Vulkan kernels: a model no test places goes to the Vulkan member, not to
# the member the default policy (`placement: fastest`) finds fastest, which on lavapipe is the
# host. Tests of that policy set VKPOOL_PLACEMENT themselves (tests/test_host_member.py).
os.environ["VKPOOL_PLACEMENT"] = "vulkan"
# Budgets are machine-wide (vkpool.ledger): this run's pools account in a ledger of its own, and
# each test's in one of the test's (own_ledger), so that runs and tests side by side do not meet.
LEDGER_BASE = tempfile.mkdtemp(prefix="vkpool-ledger-")
atexit.register(shutil.rmtree, LEDGER_BASE, True)
os.environ["VKPOOL_LEDGER_DIR"] = LEDGER_BASE


@pytest.fixture(autouse=True)
def own_ledger(monkeypatch: pytest.MonkeyPatch) -> str:
    """The ledger directory of this test's pools, sessions and the processes it starts."""
    path = tempfile.mkdtemp(prefix="t", dir=LEDGER_BASE)
    monkeypatch.setenv("VKPOOL_LEDGER_DIR", path)
    return path


def vulkan_pool(config=None):
    """A DevicePool on ``config`` (None: the default), or the test skipped when this machine has
    no Vulkan device. Skips are for missing resources only, never a failing feature: this one,
    and the cooperative-matrix GEMM tests on a device without ``VK_KHR_cooperative_matrix``
    (``test_fp16_gemm.coop_member``)."""
    from vkpool.pool import DevicePool
    from vkpool.vk import VulkanUnavailable

    try:
        p = DevicePool.from_config(config)
    except VulkanUnavailable as exc:
        pytest.skip(f"no Vulkan device: {exc}")
    if not p.vulkan_members:
        p.close()
        pytest.skip("no usable Vulkan device")
    return p


def matmul_model(rows: int, k: int, n: int, seed: int) -> bytes:
    """An ONNX model of one MatMul: ``y = x @ w``, x [rows, k] its input, w a random constant."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])
    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def transfer_queue_pool(mode: str):
    """A pool whose devices take transfer-queue mode ``mode`` (the config's
    ``devices[].transfer_queue``), and its first Vulkan member made to keep its inputs in host
    memory (as on a GPU the host cannot map), so a chunk's inputs are copied in: ``(pool, member)``."""
    from vkpool.config.loader import parse_config

    p = vulkan_pool(parse_config(f"devices:\n  - match: {{index: 0}}\n    transfer_queue: {mode}\n"))
    member = p.vulkan_members[0]
    member.inputs = None
    return p, member


@pytest.fixture(scope="session")
def pool():
    """The default pool: every Vulkan device, one member each, plus the host member."""
    p = vulkan_pool()
    yield p
    p.close()


@pytest.fixture
def vk_member(pool):
    return pool.vulkan_members[0]
