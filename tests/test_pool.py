"""Pool, memory and budgets on the real Vulkan device (lavapipe in CI)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from vkpool.config.loader import parse_config
from vkpool.discovery import discover
from vkpool.memory import DEFAULT_BLOCK_BYTES, DeviceOutOfMemory
from vkpool.pool import DevicePool, resolve_members


def _random(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind == "f":
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int8, np.bool_])
@pytest.mark.parametrize("nbytes", [1, 3, 255, 4096, 1 << 20, DEFAULT_BLOCK_BYTES + 4096])
def test_upload_download_round_trip_is_bit_exact(vk_member, dtype, nbytes):
    dtype = np.dtype(dtype)
    n = max(1, nbytes // dtype.itemsize)
    data = _random(np.random.default_rng(nbytes), dtype, n)
    for host_visible in (False, True):
        alloc = vk_member.alloc(data.nbytes, host_visible=host_visible)
        try:
            vk_member.upload(alloc, data)
            back = vk_member.download(alloc, data.shape, dtype)
            assert back.tobytes() == data.tobytes()
        finally:
            alloc.free()


def _split_pool(budgets: str) -> DevicePool:
    cfg = parse_config(f"devices:\n  - match: {{index: 0}}\n    split: 2\n    budget: {budgets}\nhost:\n  enabled: false\n")
    return DevicePool.from_config(cfg)


def test_budget_is_a_hard_cap_and_free_gives_bytes_back():
    pool = _split_pool("[1MiB, 2MiB]")
    try:
        m = pool.member("vk0.0")
        assert m.budget_bytes == 1 << 20
        a = m.alloc(700_000)
        b = m.alloc((1 << 20) - 700_000)  # exactly up to the cap
        assert m.used_bytes == m.budget_bytes
        with pytest.raises(DeviceOutOfMemory) as err:
            m.alloc(1)
        assert isinstance(err.value, MemoryError)
        text = str(err.value)
        assert "vk0.0" in text and "1 bytes" in text and "1048576 of 1048576 bytes" in text
        b.free()
        c = m.alloc(1)  # succeeds again after a free
        assert m.used_bytes == 700_001
        a.free()
        c.free()
        assert m.used_bytes == 0
        # the other split member has its own budget
        assert pool.member("vk0.1").used_bytes == 0
        big = pool.member("vk0.1").alloc(2 << 20)
        big.free()
    finally:
        pool.close()


def test_accounting_does_not_drift_over_random_operations():
    pool = _split_pool("[8MiB, 1MiB]")
    try:
        m = pool.member("vk0.0")
        rng = random.Random(1234)
        live = []
        for _ in range(10_000):
            if live and (rng.random() < 0.45 or m.budget.free_bytes < 300_000):
                live.pop(rng.randrange(len(live))).free()
            else:
                size = rng.choice([1, 7, 256, 1000, 4096, 65_536, 250_000])
                try:
                    live.append(m.alloc(size))
                except DeviceOutOfMemory:
                    pass
            assert m.used_bytes == sum(a.nbytes for a in live)
            assert m.used_bytes <= m.budget_bytes
        for a in live:
            a.free()
        assert m.used_bytes == 0
        assert m.local.reserved_bytes <= DEFAULT_BLOCK_BYTES  # at most one cached empty block
    finally:
        pool.close()


def test_data_survives_neighbouring_allocations(vk_member):
    allocs, arrays = [], []
    rng = np.random.default_rng(7)
    for i in range(20):
        data = rng.standard_normal(rng.integers(1, 5000)).astype(np.float32)
        alloc = vk_member.alloc(data.nbytes)
        vk_member.upload(alloc, data)
        allocs.append(alloc)
        arrays.append(data)
    for alloc, data in zip(allocs, arrays):
        np.testing.assert_array_equal(vk_member.download(alloc, data.shape, data.dtype), data)
        alloc.free()


def test_discovery_reports_the_device():
    infos = discover()
    assert infos, "no Vulkan device discovered"
    info = infos[0]
    assert info.name and info.vendor and info.type in ("discrete", "integrated", "virtual", "cpu", "other")
    assert len(info.uuid) == 36 and info.heaps and info.device_local_heap.size > 0
    assert info.subgroup_size >= 1 and info.max_workgroup_invocations >= 128
    assert info.capabilities["buffer_device_address"] and info.capabilities["timeline_semaphores"]
    assert len({i.uuid for i in infos}) == len(infos), "a device appears twice"


def test_split_members_and_percent_budget():
    infos = discover()
    cfg = parse_config("devices:\n  - match: {index: 0}\n    split: 3\n    budget: [64MiB, 128MiB, 25%]\n")
    plan = resolve_members(cfg, infos)
    heap = infos[0].device_local_heap.size
    assert [(mid, b) for mid, _, b, _ in plan] == [("vk0.0", 64 << 20), ("vk0.1", 128 << 20), ("vk0.2", heap // 4)]


def test_set_budget_below_use_is_refused():
    pool = _split_pool("[1MiB, 1MiB]")
    try:
        m = pool.member("vk0.0")
        a = m.alloc(600_000)
        with pytest.raises(ValueError, match="below"):
            pool.set_budget("vk0.0", "512KiB")
        pool.set_budget("vk0.0", "2MiB")
        assert m.budget_bytes == 2 << 20
        a.free()
    finally:
        pool.close()
