"""``vkpool calibrate`` on the real Vulkan device (lavapipe in CI), in its quick mode."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from vkpool.partition.calibrate import (_graph_sums, add_chain_model, download_model, matmul_chain_model,
                                        upload_model)
from vkpool.partition.cost import load_calibration


def test_calibration_models_compute_what_they_claim(pool) -> None:
    from vkpool.session import Session

    member = pool.vulkan_members[0].id
    x = np.arange(1000, dtype=np.float32)
    runs = [
        (add_chain_model(1000, 3), {"x": x}, x + 3e-3),
        (upload_model(1000), {"x": x}, x[:1]),
        (download_model(500, read_back=True), {"x": np.array([2.5], np.float32)}, np.full(500, 2.5, np.float32)),
        (download_model(500, read_back=False), {"x": np.array([2.5], np.float32)}, np.array([2.5], np.float32)),
    ]
    for model, feeds, want in runs:
        session = Session(model, pool=pool, device=member)
        try:
            np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-6)
        finally:
            session.close()
    # what the figures are divided by: the planner's own counts
    assert _graph_sums(add_chain_model(1000, 1))[1] == 3 * 1000 * 4
    assert _graph_sums(matmul_chain_model(32, 1))[0] == 2 * 32 ** 3


def test_calibrate_quick_prints_every_figure_and_writes_nothing(
    pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vkpool.cli import main

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--quick", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    for label in ("dispatch overhead", "transfer latency", "memory bandwidth", "GEMM", "host → device",
                  "device → host", "not written: --quick"):
        assert out.count(label) >= 2, label  # the Vulkan member and the host member
    assert "wrote" not in out and not (tmp_path / "calibration").exists()


def test_measured_figures_are_what_the_planner_reads(pool, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from vkpool.partition.calibrate import QUICK, measure
    from vkpool.partition.cli import pool_members
    from vkpool.partition.cost import calibration_driver, save_calibration

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    vk = pool.vulkan_members[0]
    cost = measure(pool, vk.id, dataclasses.replace(QUICK, repeat=3), out=io.StringIO())
    for f in dataclasses.fields(cost):
        if f.name == "network_latency_s":  # a cluster's figure, not this machine's
            assert cost.network_latency_s == 0
        else:
            assert math.isfinite(getattr(cost, f.name)) and getattr(cost, f.name) > 0
    save_calibration(vk.info.uuid, cost, driver=calibration_driver(vk))  # a record of another driver is not read
    assert load_calibration(vk.info.uuid) == cost
    assert {m.id: m.cost for m in pool_members()}[vk.id] == cost


def test_calibrate_refuses_an_unknown_member(pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.cli import main

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--member", "nope"]) == 1
    assert "unknown member(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "calibration").exists() or not any((tmp_path / "calibration").iterdir())
