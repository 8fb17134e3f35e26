"""The benchmark harness's own logic: the fit, the correctness gate, the child protocol, the report."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from bench import child, harness, report
from bench import workloads as wl
from bench.runners import RUNNERS, Runner, RunFn
from bench.stats import check_output, fit_dispatch, summarize


def test_fit_recovers_c_and_s() -> None:
    ns = [1, 10, 100, 1000, 10000]
    lat_ms = [(30.0 + 1.5 * n) / 1e3 for n in ns]  # C = 30 µs, S = 1.5 µs/op
    fit = fit_dispatch(ns, lat_ms)
    assert fit.c_us == pytest.approx(30.0, abs=1e-6)
    assert fit.s_us_per_op == pytest.approx(1.5, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.points == 5


def test_fit_is_least_squares_with_noise() -> None:
    ns = np.array([1, 10, 100, 1000, 10000], dtype=float)
    noise = np.array([2.0, -1.0, 0.5, -3.0, 4.0])
    lat_us = 50.0 + 2.0 * ns + noise
    fit = fit_dispatch(list(ns.astype(int)), list(lat_us / 1e3))
    s_ref, c_ref = np.polyfit(ns, lat_us, 1)
    assert (fit.c_us, fit.s_us_per_op) == pytest.approx((c_ref, s_ref))
    with pytest.raises(ValueError):
        fit_dispatch([10, 10], [0.1, 0.2])


def test_summary_percentiles() -> None:
    s = summarize(np.arange(1, 101) * 1_000_000)  # 1..100 ms
    assert s.median_ms == pytest.approx(50.5) and s.runs == 100
    assert s.p05_ms == pytest.approx(5.95) and s.p95_ms == pytest.approx(95.05)


def test_gate_tolerance() -> None:
    ref = np.array([[0.5, 0.25, 0.25]], dtype=np.float32)
    assert check_output(ref * (1 + 5e-5), ref).ok
    assert not check_output(ref * (1 + 1e-3), ref).ok
    assert not check_output(ref[:, :2], ref).ok
    assert not check_output(np.full_like(ref, np.nan), ref).ok
    assert check_output(ref.reshape(3), ref).ok  # ncnn drops the batch axis


class _WrongRunner(Runner):
    name = "wrong"

    def probe(self) -> str | None:
        return None

    def load(self, model_path: Path, workload: str) -> RunFn:
        return lambda feed: feed["x"] + 1e-2  # an add chain that adds 0.01


class _RightRunner(_WrongRunner):
    name = "right"

    def load(self, model_path: Path, workload: str) -> RunFn:
        return lambda feed: feed["x"].copy()


@pytest.mark.parametrize(("runner", "status"), [(_WrongRunner, "wrong"), (_RightRunner, "ok")])
def test_child_gate_marks_wrong_runtime_and_times_right_one(
    runner: type[Runner], status: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(RUNNERS, runner.name, runner)
    ref = tmp_path / "ref.npy"
    np.save(ref, wl.input_for("add_chain_3")["x"])
    args = argparse.Namespace(runtime=runner.name, workload="add_chain_3", model="unused", ref=str(ref),
                              warmup=2, runs=7, device=None, endpoint=None)
    result: dict[str, object] = {}
    child._latency(args, result)
    assert result["status"] == status
    if status == "ok":
        assert result["latency"]["runs"] == 7 and len(result["samples_ms"]) == 7  # type: ignore[index]
    else:
        assert "latency" not in result and "beyond rtol" in str(result["reason"])


def test_run_child_reports_a_real_measurement(tmp_path: Path) -> None:
    model = harness.ensure_model("add_chain_10", tmp_path)
    ref = harness.ensure_reference("add_chain_10", model, tmp_path)
    args = ["--workload", "add_chain_10", "--model", str(model), "--ref", str(ref), "--warmup", "2", "--runs", "5"]
    lat = harness.run_child("latency", "ort_cpu", tmp_path / "r.json", tmp_path / "l.log", 60, args)
    assert lat["status"] == "ok", lat
    assert lat["latency"]["runs"] == 5 and lat["latency"]["median_ms"] > 0
    foot = harness.run_child("footprint", "ort_cpu", tmp_path / "f.json", tmp_path / "f.log", 60, args[:6])
    assert foot["status"] == "ok" and 10 < foot["peak_rss_mib"] < 2000 and foot["wall_s"] > 0


def test_run_child_reports_unavailable_runtime(tmp_path: Path) -> None:
    res = harness.run_child("probe", "vkpool_daemon", tmp_path / "p.json", tmp_path / "p.log", 60, [])
    assert res["status"] == "unavailable" and res["reason"]


def _entry(rt: str, wl_name: str, med: float) -> dict[str, object]:
    return {"runtime": rt, "workload": wl_name, "status": "ok",
            "latency": {"median_ms": med, "p05_ms": med * 0.9, "p95_ms": med * 1.2, "mean_ms": med, "runs": 10},
            "footprint": {"peak_rss_mib": 100.0, "wall_s": 1.0}}


def _doc() -> dict[str, object]:
    results = [
        _entry("vkpool", "mlp", 0.5), _entry("ort_cpu", "mlp", 1.0), _entry("ncnn_vulkan", "mlp", 2.0),
        {"runtime": "torch_eager", "workload": "mlp", "status": "wrong", "reason": "3/10 values beyond rtol",
         "gate": {"max_abs_err": 0.1}},
        {"runtime": "ort_cuda", "workload": "mlp", "status": "unavailable", "reason": "no CUDA"},
    ]
    for n in (1, 10, 100):
        results.append(_entry("vkpool", f"add_chain_{n}", (20 + 2 * n) / 1e3))
        results.append(_entry("ort_cpu", f"add_chain_{n}", (5 + 1 * n) / 1e3))
    return {"config": {"runs": 10, "warmup": 3, "smoke": True}, "machine": {}, "results": results,
            "unavailable": {"ort_cuda": "no CUDA"}, "runtimes": {"ort_cpu": "onnxruntime x"}}


def test_markdown_table_ratios_fits_and_problems() -> None:
    md = report.render_markdown(_doc())
    row = next(line for line in md.splitlines() if line.startswith("| `mlp`"))
    assert "0.50× (ort_cpu)" in row  # the best peer, not ncnn and not the wrong torch
    assert "**wrong**" in row
    assert "ort_cuda" not in md.split("### Latency")[1].split("\n\n")[1]  # no column for it
    assert "- ort_cuda: no CUDA" in md
    fit_row = next(line for line in md.splitlines() if line.startswith("| vkpool |"))
    assert "| 20.0 | 2.000 |" in fit_row
    assert "torch_eager on `mlp`: wrong" in md


def test_plots_are_written(tmp_path: Path) -> None:
    files = report.plot(_doc(), tmp_path)
    assert [f.name for f in files] == ["bench-latency.png", "bench-add-chain.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)


def test_results_document_is_json_serialisable() -> None:
    json.dumps(_doc())


def test_append_keeps_pairs_not_rerun() -> None:
    from bench.__main__ import merge

    old = _doc()
    new = {"config": {"runs": 10, "warmup": 3, "workloads": ["mlp"], "runtimes": ["ort_cpu"]}, "machine": {},
           "results": [_entry("ort_cpu", "mlp", 0.25)], "unavailable": {}, "runtimes": {"ort_cpu": "y"}}
    merged = merge(old, new)
    by_key = report.index(merged["results"])
    assert by_key[("mlp", "ort_cpu")]["latency"]["median_ms"] == 0.25
    assert by_key[("mlp", "vkpool")]["latency"]["median_ms"] == 0.5
    assert len(merged["results"]) == len(old["results"])  # type: ignore[arg-type]
    assert merged["unavailable"] == {"ort_cuda": "no CUDA"}


@pytest.mark.parametrize("workload", ["mnist12_like", "mlp", "add_chain_10"])
def test_ncnn_runner_converts_and_matches_onnxruntime(tmp_path: Path, workload: str) -> None:
    """pnnx converts the networks, the add chain is written as BinaryOp layers (pnnx folds
    Add(x, 0) away), and ncnn's Vulkan backend (on lavapipe here) matches ORT within 1e-4."""
    import onnxruntime as ort

    from bench.ncnn_export import OUTPUT_BLOB

    onnx_path = wl.save(workload, tmp_path)
    runner = RUNNERS["ncnn_vulkan"]()
    runner.probe()
    param = runner.prepare(onnx_path, workload)
    layers = [line.split()[0] for line in param.read_text().splitlines()[2:]]
    if workload.startswith("add_chain_"):
        assert layers == ["Input"] + ["BinaryOp"] * 10
    else:
        assert "InnerProduct" in layers and OUTPUT_BLOB in param.read_text()
    assert not list(tmp_path.glob("*.pnnx*")) and not list(tmp_path.glob(".pnnx-*"))  # scratch removed
    feed = wl.input_for(workload)
    got = runner.load(param, workload)(feed)
    want = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_run_gap_probe_times_runs_after_a_spun_and_a_busy_gap(tmp_path: Path) -> None:
    """bench.run_gap_probe on lavapipe: a row per gap and way of spending it, a median per round."""
    import subprocess
    import sys

    from test_daemon_support import daemon_env, mlp_model

    path = tmp_path / "m.onnx"
    path.write_bytes(mlp_model())
    command = [sys.executable, "-m", "bench.run_gap_probe", str(path), "--gaps-us", "0", "50", "--runs", "20",
               "--rounds", "2", "--gap-work", "spin", "touch", "--touch-mib", "1"]
    done = subprocess.run(command, env=daemon_env(), capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    kinds = [[f" {gap} ", f" {spent} "] for gap in (0, 50) for spent in ("spinning", "touching 1 MiB")]
    assert [r.split("|")[1:3] for r in rows] == kinds, done.stdout
    for row in rows:
        medians = [float(v) for v in row.strip().strip("|").split("|")[2:]]
        assert len(medians) == 2 and all(m > 0 for m in medians), row
