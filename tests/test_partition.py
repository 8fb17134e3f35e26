from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vkpool.model import load_model
from vkpool.partition import (
    Member, MemberCost, PartitionUnfeasible, build_graph, dp_partition, exhaustive_partition,
    greedy_partition, is_valid_plan, load_device_spec, plan_model,
)
from vkpool.partition.algorithms import plan_key
from vkpool.partition.cost import calibration_path, load_calibration, save_calibration, specs_dir
from vkpool.partition.graph import TensorUse
from vkpool.partition.plan import chunk_peak_bytes, plan_problems
from vkpool.partition.render import layered_svg, render, to_json_dict

# Costs where only dispatch and transfer latency matter: 1e15 FLOP/s and B/s make the rest < 1 ps.
FAST = dict(flops_per_s=1e15, bytes_per_s=1e15, h2d_bytes_per_s=1e15, d2h_bytes_per_s=1e15)


def member(mid: str, budget: int, dispatch_s: float, latency_s: float = 10e-6) -> Member:
    return Member(mid, budget, MemberCost(dispatch_s=dispatch_s, transfer_latency_s=latency_s, **FAST))


def chain(weights: list[int], outs: list[int], input_bytes: int = 10) -> nx.DiGraph:
    """x → A → B → C ...: op k reads the previous tensor and its own constant w<k>."""
    G = nx.DiGraph()
    uses = {"x": TensorUse(input_bytes)}
    order, prev = [], "x"
    for k, (w, out) in enumerate(zip(weights, outs)):
        op, t = "ABCDEFGH"[k], f"t{k}"
        uses[f"w{k}"] = TensorUse(w, consumers=[op], is_constant=True)
        uses[t] = TensorUse(out, producer=op)
        uses[prev].consumers.append(op)
        G.add_node(op, op_type="Op", index=k, weights={f"w{k}": w}, inputs=[prev], outputs=[t], flops=1,
                   bytes_read=0, bytes_written=0, workspace_bytes=0, cost_source="estimate")
        if uses[prev].producer:
            G.add_edge(uses[prev].producer, op, tensors={prev: uses[prev].nbytes}, bytes=uses[prev].nbytes)
        order.append(op)
        prev = t
    uses[prev].is_output = True
    G.graph.update(order=order, tensors=uses, inputs=["x"], outputs=[prev])
    return G


def test_chunk_peak_by_hand() -> None:
    G = chain([100, 100, 100], [20, 10, 10])
    # [A, B]: weights 200 + received x 10 + live (t0 20, then t0 + t1 = 30) = 240
    assert chunk_peak_bytes(G, ["A", "B"]) == 240
    # [B, C]: weights 200 + received t0 20 + live (t1 10, then t1 + t2 = 20) = 240
    assert chunk_peak_bytes(G, ["B", "C"]) == 240
    # whole: 300 + 10 + max(20, 30, 20 + 0 + 10 ... t0 freed after B) = 340
    assert chunk_peak_bytes(G, ["A", "B", "C"]) == 340


def test_dp_hand_solved_chain() -> None:
    G = chain([100, 100, 100], [20, 10, 10])
    members = [member("m0", 250, 1e-6), member("m1", 250, 5e-6)]
    plan = dp_partition(G, members)
    # both 2-way splits cost 2×1 + 5 µs of dispatch + 4 transfer latencies of 10 µs = 47 µs;
    # the tie goes to the cut after B, which moves t1 (10 B) instead of t0 (20 B)
    assert plan.member_of == {"A": "m0", "B": "m0", "C": "m1"}
    assert plan.latency_s == pytest.approx(47e-6, abs=1e-15)
    assert [(t.tensor, t.src, t.dst, t.nbytes) for t in plan.transfers] == [("t1", "m0", "m1", 10)]
    assert plan.memory_bytes == {"m0": 240, "m1": 100 + 10 + 10}
    assert [c.preds for c in plan.chunks] == [[], [0]]
    assert is_valid_plan(G, plan)
    assert plan_key(plan) == plan_key(exhaustive_partition(G, members))


def test_dp_prefers_one_member_when_it_fits() -> None:
    G = chain([100, 100, 100], [20, 10, 10])
    members = [member("slow", 10_000, 5e-6), member("fast", 10_000, 1e-6)]
    plan = dp_partition(G, members)
    assert set(plan.member_of.values()) == {"fast"} and plan.transfers == []
    assert plan.latency_s == pytest.approx(3e-6 + 2 * 10e-6)


def test_greedy_first_fit_ping_pongs_and_dp_does_not() -> None:
    # B's 200-byte weight only fits on m1; greedy then returns to m0 for C (VKML's Listing 2 shape)
    G = chain([10, 200, 10], [10, 10, 10])
    members = [member("m0", 100, 1e-6), member("m1", 1000, 1e-6)]
    greedy = greedy_partition(G, members)
    assert [c.member for c in greedy.chunks] == ["m0", "m1", "m0"]
    assert [c.preds for c in greedy.chunks] == [[], [0], [1]]
    assert is_valid_plan(G, greedy)
    dp = dp_partition(G, members)
    assert len(dp.chunks) <= 2 and plan_key(dp) <= plan_key(greedy)


def test_greedy_charges_whole_run() -> None:
    # three ops of 40 B weights + 10 B outputs: greedy charges 10 + 50 + 50 + 50 = 160 on one member
    G = chain([40, 40, 40], [10, 10, 10])
    with pytest.raises(PartitionUnfeasible):
        greedy_partition(G, [member("m0", 150, 1e-6)])
    assert greedy_partition(G, [member("m0", 160, 1e-6)]).memory_bytes["m0"] <= 160


def test_unfeasible_names_the_op_that_fits_nowhere() -> None:
    G = chain([10, 500, 10], [10, 10, 10])
    with pytest.raises(PartitionUnfeasible) as info:
        dp_partition(G, [member("m0", 100, 1e-6), member("m1", 200, 1e-6)])
    assert info.value.unplaceable_op == "B"
    assert info.value.shortfall_bytes == {"m0": 520 - 100, "m1": 520 - 200}  # 500 + 10 in + 10 out
    assert "B" in str(info.value)


def test_unfeasible_says_how_much_budget_per_member() -> None:
    G = chain([100, 100, 100], [20, 10, 10])
    members = [member("m0", 150, 1e-6), member("m1", 150, 1e-6)]  # every op fits, no 2-way split does
    with pytest.raises(PartitionUnfeasible) as info:
        dp_partition(G, members)
    assert info.value.unplaceable_op is None
    assert info.value.shortfall_bytes == {"m0": 340 - 150, "m1": 340 - 150}
    bigger = [m.with_budget(m.budget_bytes + info.value.shortfall_bytes[m.id]) for m in members]
    assert is_valid_plan(G, dp_partition(G, bigger[:1]))


def test_throughput_pipelines_and_replicates() -> None:
    G = chain([100, 100, 100, 100], [10, 10, 10, 10])
    members = [member("m0", 300, 1e-6, latency_s=0.0), member("m1", 300, 1e-6, latency_s=0.0)]
    plan = dp_partition(G, members, objective="throughput")
    assert len(plan.chunks) == 2 and plan.throughput_per_s == pytest.approx(1 / 2e-6)
    roomy = [m.with_budget(10_000) for m in members]
    replicated = dp_partition(G, roomy, objective="throughput")  # a tie with the pipeline: fewer bytes
    assert replicated.replicas == ["m1"] and len(replicated.chunks) == 1
    assert replicated.throughput_per_s == pytest.approx(2 / 4e-6)
    assert is_valid_plan(G, replicated)


def test_throughput_counts_a_chunks_link_once_and_not_the_network_latency() -> None:
    """A stage keeps its link busy for one transfer latency per chunk plus its bytes; the network's
    latency (a cluster's, MemberCost.network_latency_s) adds to the plan's latency only. With a
    network far slower to answer than the ops take, the throughput plan still cuts where the
    stages' compute is even (2 | 2), not where the fewest bytes cross (1 | 3)."""
    import dataclasses

    G = chain([100, 100, 100, 100], [10, 1000, 10, 10])
    slow = [dataclasses.replace(m, cost=dataclasses.replace(m.cost, network_latency_s=1e-3))
            for m in (member("m0", 1500, 10e-6, latency_s=1e-6), member("m1", 1500, 10e-6, latency_s=1e-6))]
    plan = dp_partition(G, slow, objective="throughput", replicate=False)
    assert [len(c.ops) for c in plan.chunks] == [2, 2]
    assert plan.throughput_per_s == pytest.approx(1 / 20e-6, rel=1e-6)  # compute: two ops of 10 µs
    assert plan.latency_s > 2e-3  # the network's latency on the crossing tensor's download and upload
    assert plan_key(plan) == plan_key(exhaustive_partition(G, slow, objective="throughput"))
    # one latency per chunk that moves anything, whichever way
    assert slow[0].cost.link_busy_ps(0, 0) == 0 and slow[0].cost.link_busy_ps(1, 1) == 1_000_000
    assert slow[0].cost.upload_ps(1) == 1_001_000_000  # latency: the host's and the network's
    old = MemberCost.from_dict({k: v for k, v in slow[0].cost.to_dict().items() if k != "network_latency_s"})
    assert old.network_latency_s == 0.0  # calibration records without the field still load


def test_validator_catches_broken_plans() -> None:
    G = chain([100, 100, 100], [20, 10, 10])
    members = [member("m0", 250, 1e-6), member("m1", 250, 5e-6)]
    plan = dp_partition(G, members)
    plan.transfers = []
    assert any("no transfer" in p for p in plan_problems(G, plan))
    plan = dp_partition(G, members)
    plan.memory_bytes["m1"] = 10**9
    assert not is_valid_plan(G, plan)
    plan = dp_partition(G, members)
    plan.chunks[0].preds.append(1)
    plan.chunks[1].preds.append(0)
    assert any("cycle" in p for p in plan_problems(G, plan))


# -- from a real ONNX model -----------------------------------------------------------------------


def _onnx_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in [("w1", (64, 128)), ("b1", (128,)), ("w2", (128, 32)), ("w3", (1, 3, 8, 8))]]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["a"], name="add1"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
             helper.make_node("Conv", ["img", "w3"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    inits[3] = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w3")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64]),
                                           helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32]),
                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_build_graph_costs() -> None:
    G = build_graph(load_model(_onnx_mlp(), fuse=False))
    assert G.graph["order"] == ["mm1", "add1", "relu", "mm2", "conv"]
    assert G.nodes["mm1"]["flops"] == 2 * 4 * 64 * 128
    assert G.nodes["mm1"]["weights"] == {"w1": 64 * 128 * 4}
    assert G.nodes["conv"]["flops"] == 2 * 3 * 9 * 8 * 16 * 16
    assert G.nodes["add1"]["bytes_written"] == 4 * 128 * 4
    assert G.edges["mm1", "add1"]["tensors"] == {"h": 4 * 128 * 4}
    assert G.graph["tensors"]["y"].is_output and G.graph["inputs"] == ["x", "img"]
    assert {G.nodes[n]["cost_source"] for n in G} <= {"registry", "estimate"}


def test_plan_model_renders_every_format(tmp_path: Path) -> None:
    model = load_model(_onnx_mlp(), fuse=False)
    G = build_graph(model)
    members = [member("gpu0", 40_000, 1e-6), member("gpu1", 40_000, 1e-6)]
    plan = plan_model(model, members)
    assert is_valid_plan(G, plan) and len(plan.chunks) == 2
    text = render(G, plan, "text")
    assert "Chunk 0: device=" in text and "TransferToDevice" in text and "gpu1" in text
    data = json.loads(render(G, plan, "json"))
    assert data["schema"] == "vkpool.plan" and data["version"] == 1
    assert data == to_json_dict(plan)
    assert {o["name"] for o in data["ops"]} == set(G) and data["transfer_bytes"] == plan.transfer_bytes
    dot = render(G, plan, "dot")
    assert dot.startswith("digraph") and "cluster_1" in dot
    svg = layered_svg(G, plan)
    assert svg.startswith("<svg") and svg.count("<rect") >= len(G) and "stroke-dasharray" in svg


def test_plan_model_rejects_bad_arguments() -> None:
    model = load_model(_onnx_mlp(), fuse=False)
    with pytest.raises(ValueError, match="objective"):
        plan_model(model, [member("m", 10**9, 1e-6)], objective="fastest")
    with pytest.raises(ValueError, match="algorithm"):
        plan_model(model, [member("m", 10**9, 1e-6)], algorithm="magic")


# -- spec files, calibration cache, CLI ------------------------------------------------------------


def test_shipped_specs_load() -> None:
    specs = sorted(specs_dir().glob("*.yaml"))
    assert len(specs) >= 3
    for path in specs:
        members = load_device_spec(path)
        assert members and all(m.budget_bytes > 0 for m in members)


def test_spec_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmembers:\n  - {id: a, budget: 1GiB, flops_per_s: -1}\n")
    with pytest.raises(ValueError, match="flops_per_s"):
        load_device_spec(bad)
    bad.write_text("version: 1\nmembers:\n  - {id: a, budget: 1GiB, warp_speed: 9}\n")
    with pytest.raises(ValueError, match="unknown cost fields"):
        load_device_spec(bad)
    bad.write_text("members: []\n")
    with pytest.raises(ValueError, match="not a device spec"):
        load_device_spec(bad)


def test_calibration_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    cost = MemberCost(1e12, 1e11, 2e-6, 1e10, 9e9, 3e-5)
    path = save_calibration("1234-abcd", cost, device_name="gpu", driver="580")
    assert path == tmp_path / "calibration" / "1234-abcd.json" == calibration_path("1234-abcd")
    assert load_calibration("1234-abcd") == cost
    assert load_calibration("1234-abcd", driver="581") is None
    assert load_calibration("missing") is None
    path.write_text("{broken")
    assert load_calibration("1234-abcd") is None


def test_cli_plan_with_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.cli import main

    model = tmp_path / "m.onnx"
    onnx.save(_onnx_mlp(), model)
    spec = specs_dir() / "2xh200.yaml"
    out = tmp_path / "plan.json"
    assert main(["plan", str(model), "--devices", str(spec), "--budget", "gpu0=40KB", "--budget", "gpu1=40KB",
                 "--format", "json", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {m["id"] for m in data["members"]} == {"gpu0", "gpu1"} and len(data["chunks"]) == 2
    assert main(["plan", str(model), "--devices", str(spec), "--algorithm", "greedy"]) == 0
    assert "algorithm=greedy" in capsys.readouterr().out
    assert main(["plan", str(model), "--devices", str(spec), "--budget", "gpu0=1KB", "--budget", "gpu1=1KB"]) == 1
    assert "more budget" in capsys.readouterr().err


def test_cli_plan_remote_asks_the_running_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil
    import signal
    import tempfile

    from test_daemon_support import mlp_model, spawn_daemon, wait_ready
    from vkpool.cli import main

    model = tmp_path / "m.onnx"
    model.write_bytes(mlp_model())
    folder = Path(tempfile.mkdtemp(prefix="vkp", dir="/tmp"))  # ipc paths are limited to 107 bytes
    endpoint = f"ipc://{folder}/d.sock"
    config = folder / "vkpool.yaml"
    config.write_text("devices:\n  - match: {name: 'llvmpipe*'}\n    budget: 32MiB\nhost:\n  budget: 32MiB\n")
    proc = spawn_daemon(endpoint, config=config)
    try:
        wait_ready(endpoint, proc)
        assert main(["plan", str(model), "--remote", endpoint]) == 0
        ops = len(load_model(model).nodes)  # the daemon plans the graph it runs: biases and Relus fused
        text = capsys.readouterr().out  # the format of a local `vkpool plan`
        assert text.startswith("Plan: algorithm=whole objective=latency chunks=1 ")
        assert f"Chunk 0: device=vk0 ops={ops} " in text
        out = tmp_path / "remote.json"
        assert main(["plan", str(model), "--remote", endpoint, "--format", "json", "-o", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["schema"] == "vkpool.plan" and [c["member"] for c in data["chunks"]] == ["vk0"]
        assert len(data["ops"]) == ops
        # what-if: with no room on vk0 the daemon plans on its host member
        assert main(["plan", str(model), "--remote", endpoint, "--budget", "vk0=1KiB", "--format", "json",
                     "-o", str(out)]) == 0
        what_if = json.loads(out.read_text())
        assert what_if["schema"] == "vkpool.plan" and {op["member"] for op in what_if["ops"]} == {"cpu"}
        # the daemon's settings rule: a local-only flag is refused, not ignored
        assert main(["plan", str(model), "--remote", endpoint, "--objective", "throughput"]) == 1
        assert "--objective" in capsys.readouterr().err
        assert main(["plan", str(model), "--remote", endpoint, "--format", "svg"]) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("name, params_m", [
    # published parameter counts, less the position rows past 128 (BERT 384, GPT-2 896) and
    # BERT's pooler, which these graphs leave out; U-Net: the original's 31 M at half its widths
    ("bert_base_seq128", 108.9 - 384 * 768 / 1e6), ("gpt2_small_seq128", 124.44 - 896 * 768 / 1e6),
    ("resnet50", 25.557), ("mobilenetv2", 3.505), ("unet_small", 7.76),
])
def test_model_shapes_have_the_published_sizes(name: str, params_m: float) -> None:
    from vkpool.partition import model_shapes

    model = model_shapes.build(name)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                 and len(t.dims) > 0)
    assert params / 1e6 == pytest.approx(params_m, rel=0.02)
    if name in ("resnet50", "mobilenetv2", "unet_small"):
        G = build_graph(load_model(model, fuse=False))
        assert {G.nodes[op]["cost_source"] for op in G} == {"registry"}
        assert plan_model(G, [member("a", 1 << 40, 1e-6)]).chunks[0].ops == G.graph["order"]


def test_compare_flags_a_row_where_greedy_wins_and_summarises_ratios() -> None:
    from vkpool.partition.compare import dp_never_worse, summary, table

    G = chain([10, 200, 10], [10, 10, 10])
    members = [member("m0", 1000, 1e-6), member("m1", 1000, 1e-6)]
    greedy = greedy_partition(G, [member("m0", 100, 1e-6), member("m1", 1000, 1e-6)])  # ping-pongs
    dp_lat = dp_partition(G, members)
    dp_thr = dp_partition(G, members, objective="throughput", replicate=False)
    row = {"workload": "chain", "k": 2, "needs": 1, "dp_budget": 300, "greedy_budget": 1000, "budget": 1000,
           "ops": 3, "greedy": greedy, "dp_latency": dp_lat, "dp_throughput": dp_thr}
    assert dp_never_worse([row]) == []
    assert "| chain | 3 | 2 |" in table([row]) and "latency greedy / DP: geometric mean" in summary([row])
    swapped = dict(row, greedy=dp_lat, dp_latency=greedy, dp_throughput=greedy)
    assert [bad.split(":")[1].strip() for bad in dp_never_worse([swapped])] == [
        "greedy latency better", "greedy throughput better"]
