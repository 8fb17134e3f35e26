"""The ``cpu`` member: its chunks as onnxruntime sessions (numpy where onnxruntime refuses one),
and the ``fastest`` placement policy that sends a model to it when it is the faster member."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import vulkan_pool
from vkpool.config.loader import parse_config
from vkpool.partition.api import WHOLE, place_model
from vkpool.partition.cost import DEFAULT_COSTS, Member, calibration_driver, save_calibration
from vkpool.session import Session

ort = pytest.importorskip("onnxruntime", reason="the onnxruntime engine of the host member needs onnxruntime")


def conv_model(seed: int = 0) -> bytes:
    """Conv (odd sizes, bias) → Relu → Gemm → Relu: vkpool fuses both activations into the
    products (:mod:`vkpool.fusion`); the host's onnxruntime model must spell them out again."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((5, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b")
    g = numpy_helper.from_array(rng.standard_normal((5 * 7 * 9, 11)).astype(np.float32), "g")
    c = numpy_helper.from_array(rng.standard_normal(11).astype(np.float32), "c")
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("Gemm", ["f", "g", "c"], ["p"]),
             helper.make_node("Relu", ["p"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 11])], [w, b, g, c, shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def block_model() -> bytes:
    """A transformer block's ops as exporters spell them: Linear (MatMul + Add), erf GELU,
    Linear, residual Add + LayerNormalization. vkpool fuses the bias and the GELU into the first
    product and the residual into the norm; the host's onnxruntime model spells them out again."""
    rng = np.random.default_rng(2)
    init = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) / 4, name)
            for name, shape in (("w1", (24, 40)), ("b1", (40,)), ("w2", (40, 24)), ("g", (24,)), ("beta", (24,)))]
    init += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("r2", 2 ** 0.5), ("one", 1.0),
                                                                              ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["h"]),
             helper.make_node("Div", ["h", "r2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["he"]),
             helper.make_node("Mul", ["he", "half"], ["gelu"]), helper.make_node("MatMul", ["gelu", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "x"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 7, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 7, 24])], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def relu_int16_model() -> bytes:
    """Relu of int16: valid ONNX that vkpool runs and onnxruntime has no CPU kernel for."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu16",
                              [helper.make_tensor_value_info("x", TensorProto.INT16, [6])],
                              [helper.make_tensor_value_info("y", TensorProto.INT16, [6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8).SerializeToString()


def reference(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture
def engine_pool(request: pytest.FixtureRequest) -> Any:
    """A pool whose host member runs with ``host.engine: <param>``."""
    p = vulkan_pool(parse_config(f"host:\n  engine: {request.param}\n", "engine.yaml"))
    yield p
    p.close()


@pytest.mark.parametrize("engine_pool", ["auto", "numpy"], indirect=True)
def test_host_chunks_match_onnxruntime_and_the_vulkan_member(engine_pool: Any) -> None:
    x = np.random.default_rng(1).standard_normal((1, 3, 7, 9)).astype(np.float32)
    want = reference(conv_model(), {"x": x})[0]
    with Session(conv_model(), pool=engine_pool, device="cpu") as host, \
            Session(conv_model(), pool=engine_pool, device=engine_pool.vulkan_members[0].id) as vk:
        assert host.plan.engine == ("numpy" if engine_pool.member("cpu").engine == "numpy"
                                    else f"onnxruntime {ort.__version__}")
        np.testing.assert_allclose(host.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(vk.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
        assert "activation" in {k for n in host.model.nodes for k in n.attrs}  # the fused model was what ran


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_fused_transformer_ops_run_in_onnxruntime_written_out(pool: Any, half: bool) -> None:
    """The block's fused ops spelled out again for onnxruntime, in the tensors' own type (float16
    GELU constants included: onnxruntime refuses a float32 constant beside float16 tensors)."""
    from test_fp16_fusion import half_model

    model = half_model(block_model()) if half else block_model()
    x = np.random.default_rng(3).standard_normal((1, 7, 24)).astype(np.float16 if half else np.float32)
    want = reference(model, {"x": x})[0]
    with Session(model, pool=pool, device="cpu") as s:
        fused = {k for n in s.model.nodes for k in n.attrs if k in ("activation", "residual")}
        assert fused == {"activation", "residual"} and len(s.model.nodes) < 10  # vkpool fused the block
        assert s.plan.engine.startswith("onnxruntime"), s.plan.engine_note
        tol = 2e-2 if half else 1e-5
        np.testing.assert_allclose(s.run(None, {"x": x})[0].astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_a_chunk_onnxruntime_refuses_runs_with_numpy_and_says_so(pool: Any) -> None:
    x = np.array([-3, -1, 0, 1, 2, 32767], np.int16)
    with Session(relu_int16_model(), pool=pool, device="cpu") as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.maximum(x, 0))
        assert s.plan.engine == "numpy" and "Relu" in s.plan.engine_note
        assert "(numpy; onnxruntime refused it: " in s.plan.to_text()
        assert s.plan.to_dict()["chunks"][0]["engine"] == "numpy"


@pytest.mark.parametrize("engine_pool", ["onnxruntime"], indirect=True)
def test_host_engine_onnxruntime_refuses_what_onnxruntime_cannot_run(engine_pool: Any) -> None:
    with pytest.raises(RuntimeError, match="host.engine: auto"):
        Session(relu_int16_model(), pool=engine_pool, device="cpu")
    assert engine_pool.member("cpu").used_bytes == 0  # the refused chunk gave its memory back


def test_the_engine_is_shown_by_devices_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.cli import main

    path = tmp_path / "conv.onnx"
    path.write_bytes(conv_model())
    assert main(["devices", "--json"]) == 0
    members = json.loads(capsys.readouterr().out)["members"]
    assert [m["engine"] for m in members if m["id"] == "cpu"] == [f"onnxruntime {ort.__version__}"]
    assert main(["run", str(path), "--device", "cpu", "--check"]) == 0
    assert f"on cpu (onnxruntime {ort.__version__})" in capsys.readouterr().out


# -- the placement policy --------------------------------------------------------------------------


def planner(member_id: str, kind: str, flops: float, budget: int = 1 << 30) -> Member:
    """A member whose speeds differ from the others' in FLOP/s only."""
    return Member(member_id, budget, dataclasses.replace(DEFAULT_COSTS["vulkan"], flops_per_s=flops), kind,
                  measured=True)


def test_fastest_puts_the_whole_model_on_the_member_predicted_fastest() -> None:
    from vkpool.model import load_model

    model = load_model(conv_model())
    slow_vk, fast_host = planner("vk0", "vulkan", 1e6), planner("cpu", "host", 1e12)
    assert place_model(model, [slow_vk, fast_host])[1].member_of["Conv_0"] == "cpu"
    assert place_model(model, [slow_vk, fast_host], policy="vulkan")[1].member_of["Conv_0"] == "vk0"
    fast_vk = planner("vk1", "vulkan", 1e12)
    placed = place_model(model, [slow_vk, fast_vk, fast_host])[1]
    assert placed.algorithm == WHOLE and set(placed.member_of.values()) == {"vk1"}  # the earlier of equals
    cramped = dataclasses.replace(fast_host, budget_bytes=100)  # the fastest cannot hold it: the next
    assert set(place_model(model, [slow_vk, cramped])[1].member_of.values()) == {"vk0"}
    guessed = dataclasses.replace(fast_host, measured=False)  # a default cost ranks nothing: Vulkan first
    assert set(place_model(model, [slow_vk, guessed])[1].member_of.values()) == {"vk0"}
    with pytest.raises(ValueError, match="placement policy"):
        place_model(model, [slow_vk], policy="first")


@pytest.mark.parametrize("faster", ["cpu", "vk0"])
def test_calibrated_speeds_choose_the_default_member_and_plan_shows_it(
        faster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.cli import main
    from vkpool.partition.cost import calibration_key

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VKPOOL_PLACEMENT", "fastest")
    path = tmp_path / "conv.onnx"
    path.write_bytes(conv_model())
    p = vulkan_pool()
    try:
        for member in (p.member("vk0"), p.member("cpu")):
            flops = 1e12 if member.id == faster else 1e6
            cost = dataclasses.replace(DEFAULT_COSTS[member.kind], flops_per_s=flops)
            save_calibration(calibration_key(member), cost, driver=calibration_driver(member))
    finally:
        p.close()
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--format", "json", "-o", str(out)]) == 0
    assert [c["member"] for c in json.loads(out.read_text())["chunks"]] == [faster]
    with Session(path) as s:
        assert s.member.id == faster and set(s.placement.member_of.values()) == {faster}
    assert main(["devices"]) == 0
    assert "Placement (fastest)" in capsys.readouterr().out
    monkeypatch.setenv("VKPOOL_PLACEMENT", "vulkan")  # the policy that ignores the speeds
    with Session(path) as s:
        assert s.member.id == "vk0"


def test_without_measured_speeds_the_first_vulkan_member_takes_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.cli import main

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))  # no calibration
    monkeypatch.setenv("VKPOOL_PLACEMENT", "fastest")
    with Session(conv_model()) as s:
        assert s.member.id == "vk0"
    assert main(["devices"]) == 0
    assert "speeds not measured for vk0, cpu: `vkpool calibrate`" in capsys.readouterr().out


def test_a_calibration_of_another_driver_or_engine_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vkpool.partition.cost import calibration_key, pool_member_cost

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    p = vulkan_pool(parse_config("host:\n  engine: numpy\n", "numpy.yaml"))
    try:
        host = p.member("cpu")
        assert calibration_driver(host) == "numpy"
        measured = dataclasses.replace(DEFAULT_COSTS["host"], flops_per_s=123e9)
        save_calibration(calibration_key(host), measured, driver=f"onnxruntime {ort.__version__}")
        assert pool_member_cost(host) == DEFAULT_COSTS["host"]  # measured with the other engine
        save_calibration(calibration_key(host), measured, driver="numpy")
        assert pool_member_cost(host) == measured
    finally:
        p.close()


def test_an_unknown_placement_policy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vkpool.config.loader import ConfigError

    with pytest.raises(ConfigError, match="placement: must be one of fastest, vulkan"):
        parse_config("placement: first\n", "p.yaml")
    monkeypatch.setenv("VKPOOL_PLACEMENT", "first")
    with pytest.raises(ConfigError, match="VKPOOL_PLACEMENT must be one of"):
        Session(conv_model(), pool=None)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_fused_attention_runs_in_onnxruntime_written_out(name: str, pool: Any) -> None:
    """BERT and GPT-2 (causal) exported small: vkpool fuses their attention into Attention nodes
    of opset 23, which the host's onnxruntime model of opset 17 spells out again."""
    pytest.importorskip("torch", reason="the models are exported from torch")
    from bench import export_models as em
    from test_real_models import SMALL

    built = em.build(name, **SMALL[name])
    data = em.to_onnx(built)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, built.inputs)[0]
    with Session(data, pool=pool, device="cpu") as s:
        assert "Attention" in {n.op_type for n in s.model.nodes}
        assert s.plan.engine.startswith("onnxruntime"), s.plan.engine_note
        got = s.run(None, built.inputs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
