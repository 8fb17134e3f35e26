"""The command line, run as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SPLIT = "devices:\n  - match: {name: 'llvmpipe*'}\n    split: 3\n    budget: [64MiB, 128MiB, 25%]\nhost:\n  enabled: true\n  budget: 2GiB\n"


def vkpool(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vkpool", *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_help():
    assert vkpool("--version").stdout.startswith("vkpool ")
    out = vkpool("--help").stdout
    for command in ("devices", "ops", "run"):
        assert command in out


def test_devices_json_with_split_config(tmp_path):
    from vkpool.discovery import discover

    info = next(i for i in discover() if i.name.startswith("llvmpipe"))
    cfg = tmp_path / "split.yaml"
    cfg.write_text(SPLIT)
    res = vkpool("--config", str(cfg), "devices", "--json")
    assert res.returncode == 0, res.stderr
    members = {m["id"]: m for m in json.loads(res.stdout)["members"]}
    vk = f"vk{info.index}"
    assert {f"{vk}.0", f"{vk}.1", f"{vk}.2", "cpu"} <= set(members)
    heap = info.device_local_heap.size
    assert members[f"{vk}.0"]["budget_bytes"] == 64 << 20
    assert members[f"{vk}.1"]["budget_bytes"] == 128 << 20
    assert members[f"{vk}.2"]["budget_bytes"] == heap // 4
    assert members["cpu"]["budget_bytes"] == 2 << 30
    dev = members[f"{vk}.0"]["device"]
    assert dev["heaps"] and dev["subgroup_size"] >= 1 and "cooperative_matrix" in dev["capabilities"]


def test_devices_table():
    res = vkpool("devices")
    assert res.returncode == 0, res.stderr
    assert "MEMBER" in res.stdout and "capabilities:" in res.stdout


def test_run_with_check_and_repeat(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    b = numpy_helper.from_array(np.linspace(-1, 1, 8).astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
                              "g", [x], [y], [b])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    res = vkpool("run", str(path), "--check", "--repeat", "5")
    assert res.returncode == 0, res.stderr
    assert "y: shape [4, 8] float32 checksum" in res.stdout
    assert "max abs diff 0" in res.stdout
    assert "latency over 5 runs: median" in res.stdout


def test_run_reports_unsupported_ops(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Bernoulli", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    res = vkpool("run", str(path))
    assert res.returncode == 1
    assert "Bernoulli" in res.stderr and "vkpool ops" in res.stderr and "Traceback" not in res.stderr


def test_ops_lists_kernels():
    res = vkpool("ops", "--json")
    ops = json.loads(res.stdout)
    assert "Relu" in ops and "Add" in ops


def test_plan_of_a_model_cut_at_run_time_values_says_why_and_what_to_do(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["y"])],
                          "nz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [2, "n"])])
    path = tmp_path / "nz.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    res = vkpool("plan", str(path))
    assert res.returncode == 1
    assert "depend on run-time values" in res.stderr and "NonZero" in res.stderr and "vkpool run" in res.stderr
    ran = vkpool("run", str(path))
    assert ran.returncode == 0, ran.stderr
    assert "y: shape [2, " in ran.stdout
