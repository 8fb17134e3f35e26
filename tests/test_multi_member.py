"""Plans over several pool members on the real device: split lavapipe members plus ``cpu``.

Every workload of the benchmark table runs split over 2, 3 and 4 members and must give the
bytes the single-member run gives (the same shaders run, only the cuts differ). Where budgets
can force the split they do: each member gets about what its chunk of a k-member plan needs,
so no member, nor fewer members, can hold the model. A chain of tiny ops (``add_chain``) or
one op holding all the weights (``matmul_1layer``) cannot be forced apart by budgets; those
runs give the plan explicitly. The large workloads are scaled down to keep this file fast
on two cores (same structure, smaller widths): see ``_WORKLOADS``.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import workloads
from conftest import vulkan_pool
from vkpool.config.loader import parse_config
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import chunk_peak_bytes
from vkpool.pipeline import RequestStats
from vkpool.placement import balanced_cut
from vkpool.session import Session

MEMBERS = ["vk0.0", "vk0.1", "vk0.2", "vk0.3"]
FULL_BUDGET = 512 << 20
HOST_BUDGET = 1 << 30


def _branched() -> bytes:
    """Two conv towers on the same input, joined by Concat, then a 1x1 conv."""
    rng = np.random.default_rng(7)
    inits, nodes = [], []

    def conv(name: str, x: str, c_in: int, c_out: int, k: int) -> str:
        w = (rng.standard_normal((c_out, c_in, k, k)) / np.sqrt(c_in * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{name}_w"))
        nodes.append(helper.make_node("Conv", [x, f"{name}_w"], [f"{name}_c"], name=name,
                                      pads=[k // 2] * 4, kernel_shape=[k, k]))
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [f"{name}_r"], name=f"{name}_relu"))
        return f"{name}_r"

    a = conv("a2", conv("a1", "x", 3, 32, 3), 32, 32, 3)
    b = conv("b2", conv("b1", "x", 3, 32, 5), 32, 32, 5)
    nodes.append(helper.make_node("Concat", [a, b], ["cat"], name="concat", axis=1))
    w = (rng.standard_normal((8, 64, 1, 1)) / 8).astype(np.float32)
    inits.append(numpy_helper.from_array(w, "head_w"))
    nodes.append(helper.make_node("Conv", ["cat", "head_w"], ["y"], name="head", kernel_shape=[1, 1]))
    g = helper.make_graph(nodes, "branched", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 24, 24])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 24, 24])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _conv_many_scaled() -> bytes:
    # conv_many_255MB's structure (3 conv stages, 4 MatMuls, Softmax) at a quarter of its widths
    return workloads._conv_net("conv_many_scaled", [16, 32, 64], [2, 2, 1], [3136, 1024, 1024, 512, 10]
                               ).SerializeToString()


def _matmul(width: int, layers: int) -> bytes:
    return workloads._matmul_net(f"matmul_{width}x{layers}", width, layers).SerializeToString()


#: name → (model bytes builder, input feed, the k for which budgets alone force a k-member plan).
#: Budgets cannot force every split: a chunk of mnist12_like needs more than the whole model (its
#: conv activations dominate), one MatMul holds most of mlp's and conv_few's weights, and the
#: partitioner finds a cut over fewer members for the branched model at k = 2 and 4.
_WORKLOADS = {
    "mnist12_like": (lambda: workloads.build("mnist12_like").SerializeToString(), "mnist12_like", ()),
    "mlp": (lambda: workloads.build("mlp").SerializeToString(), "mlp", (2,)),
    "conv_few_15MB": (lambda: workloads.build("conv_few_15MB").SerializeToString(), "conv_few_15MB", (2,)),
    "conv_many_scaled": (_conv_many_scaled, "conv_many_255MB", (2, 3, 4)),
    "matmul_16layers_scaled": (lambda: _matmul(512, 16), None, (2, 3, 4)),
    "matmul_1layer_scaled": (lambda: _matmul(2048, 1), None, ()),
    "add_chain_100": (lambda: workloads.build("add_chain_100").SerializeToString(), "add_chain_100", ()),
    "branched": (_branched, None, (3,)),
}
#: matmul_1layer has three ops (Reshape, MatMul, Softmax): at most three members
_SPLITS = [(name, k) for name in _WORKLOADS for k in (2, 3, 4) if not (name == "matmul_1layer_scaled" and k == 4)]
_cache: dict[str, tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]] = {}


@pytest.fixture(scope="module")
def split_pool():
    pool = vulkan_pool(parse_config("devices:\n  - match: {index: 0}\n    split: 4\n    budget: 512MiB\n"
                                    f"host:\n  enabled: true\n  budget: {HOST_BUDGET}\n"))
    yield pool
    pool.close()


@pytest.fixture
def pool4(split_pool):
    """The split pool with every budget restored after the test."""
    yield split_pool
    for member in MEMBERS:
        split_pool.set_budget(member, FULL_BUDGET)
    split_pool.set_budget("cpu", HOST_BUDGET)


def _feeds(name: str, feed_of: str | None, model: bytes, pool) -> dict[str, np.ndarray]:
    if feed_of is not None:
        return workloads.input_for(feed_of)
    with Session(model, pool=pool, device="vk0.0") as s:
        rng = np.random.default_rng(3)
        return {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in s.get_inputs()}


def _reference(name: str, pool) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """The model, its feed and its outputs on one member (vk0.0)."""
    if name not in _cache:
        build, feed_of, _ = _WORKLOADS[name]
        model = build()
        feeds = _feeds(name, feed_of, model, pool)
        with Session(model, pool=pool, device="vk0.0") as s:
            _cache[name] = (model, feeds, s.run(None, feeds))
    return _cache[name]


def _check(session: Session, feeds: dict[str, np.ndarray], expected: list[np.ndarray], runs: int = 2) -> None:
    for _ in range(runs):  # later runs replay the same recorded chunks
        out = session.run(None, feeds)
        for got, want in zip(out, expected):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    planned = {(t.tensor, t.src, t.dst) for t in session.plan.transfers}
    assert dict(session.executor.transfers_executed) == {key: runs for key in planned}
    for member, nbytes in session.memory_by_member().items():
        assert nbytes <= session.pool.member(member).budget_bytes


@pytest.mark.parametrize(("name", "k"), _SPLITS)
def test_split_matches_single_member(pool4, name: str, k: int) -> None:
    """A k-member cut given as the plan, then (where budgets can force one) the partitioner's own
    plan under budgets that hold exactly that cut's chunks."""
    model, feeds, expected = _reference(name, pool4)
    with Session(model, pool=pool4, device="vk0.0") as probe:
        graph = build_graph(probe.model)
        whole = sum(probe.memory_by_member().values())
    if k in _WORKLOADS[name][2]:
        segments = balanced_cut(graph, k)
    else:
        order = graph.graph["order"]
        segments = [[order[i] for i in part] for part in np.array_split(np.arange(len(order)), k)]
    assignment = {op: MEMBERS[j] for j, ops in enumerate(segments) for op in ops}
    with Session(model, pool=pool4, plan=assignment) as given:
        assert [c.member for c in given.plan.chunks] == MEMBERS[:k]
        assert given.executor is not None and given.member.id == "+".join(MEMBERS[:k])
        assert "Compiled, run by threads of this process:" in str(given.plan)
        _check(given, feeds, expected)
        compiled = given.memory_by_member()
    if k not in _WORKLOADS[name][2]:
        return
    budgets = {m: 0 for m in MEMBERS} | {"cpu": 0}  # the host's kernels round differently: keep it out
    for j, ops in enumerate(segments):
        need = max(compiled[MEMBERS[j]], chunk_peak_bytes(graph, ops))
        budgets[MEMBERS[j]] = need + need // 100 + 4096
    assert max(budgets.values()) < whole  # no member holds the model alone
    with Session(model, pool=pool4, budgets=budgets) as planned:
        used = {c.member for c in planned.plan.chunks}
        assert len(used) == k, planned.plan.to_text()
        assert planned.plan.algorithm == "dp"
        _check(planned, feeds, expected)


def test_plan_falls_back_to_cpu_when_vulkan_members_cannot_hold_it(pool4) -> None:
    model, feeds, expected = _reference("conv_few_15MB", pool4)
    # the big MatMul's weights fit no Vulkan member: the partitioner puts them on the host
    budgets = {m: 0 for m in MEMBERS}
    budgets["vk0.0"] = 4 << 20
    with Session(model, pool=pool4, budgets=budgets) as session:
        members = {c.member for c in session.plan.chunks}
        assert members == {"vk0.0", "cpu"}, session.plan.to_text()
        (out,) = session.run(None, feeds)
        np.testing.assert_allclose(out, expected[0], rtol=1e-4, atol=1e-6)
        planned = {(t.tensor, t.src, t.dst) for t in session.plan.transfers}
        assert planned and dict(session.executor.transfers_executed) == {key: 1 for key in planned}
        chunks = {op: c.member for c in session.plan.chunks for op in c.ops}
    # worker processes open Vulkan devices: a plan with a chunk on the host is refused, saying so
    with pytest.raises(ValueError, match="worker processes run chunks on Vulkan members; .* cpu"):
        Session(model, pool=pool4, plan=chunks, processes=True)


@pytest.fixture(params=[True, False], ids=["on-device", "through-host"])
def link_on_device(request) -> bool:
    """Both ways a tensor goes between chunks on one device (``Session(link_on_device=...)``):
    kept on the device with a timeline semaphore ordering the chunks, or staged through host
    memory as between two devices (which split members of one lavapipe device then stand for)."""
    return request.param


def test_branches_on_two_members_run_at_once(pool4, link_on_device: bool) -> None:
    model, feeds, expected = _reference("branched", pool4)
    with Session(model, pool=pool4, device="vk0.0") as probe:
        graph = build_graph(probe.model)
    order = graph.graph["order"]
    tower_b = {op for op in order if op.startswith("b")}
    assignment = {op: ("vk0.1" if op in tower_b else "vk0.0") for op in order}
    with Session(model, pool=pool4, plan=assignment, link_on_device=link_on_device) as session:
        chunks = session.plan.chunks
        assert len(chunks) == 3 and chunks[0].succs == [2] and chunks[1].succs == [2]  # two independent towers
        for _ in range(3):
            np.testing.assert_array_equal(session.run(None, feeds)[0], expected[0])
        events = session.trace()
        assert len(events) == 9
        early = 0  # runs of the head submitted before both towers were seen done
        for request in {e.request for e in events}:
            mine = {e.chunk: e for e in events if e.request == request}
            assert {mine[0].member, mine[1].member} == {"vk0.0", "vk0.1"}
            assert mine[2].start_ns >= max(mine[0].start_ns, mine[1].start_ns)
            early += mine[2].start_ns < max(mine[0].end_ns, mine[1].end_ns)
        stages = session.executor.copies[0].stages
        if link_on_device:
            # the head is submitted right after the towers and waits for them on the device
            # (lavapipe runs each tower for milliseconds, the submissions follow in microseconds)
            assert [s.linked_preds for s in stages] == [[], [], [0, 1]]
            assert [s.host_outputs for s in stages] == [[], [], stages[2].outputs]
            assert early >= 1, events
        else:
            # the head starts only once both towers, queued together on their members, have ended
            assert [s.linked_preds for s in stages] == [[], [], []]
            assert early == 0, events


def test_four_requests_in_flight_pipeline_over_two_stages(pool4, link_on_device: bool) -> None:
    model, _, _ = _reference("conv_few_15MB", pool4)
    with Session(model, pool=pool4, device="vk0.0") as single:
        order = build_graph(single.model).graph["order"]
        rng = np.random.default_rng(11)
        inputs = [{"x": rng.standard_normal((1, 1, 28, 28)).astype(np.float32)} for _ in range(4)]
        expected = [single.run(None, f)[0] for f in inputs]
    cut = order.index(next(op for op in order if op.startswith("Reshape")))
    assignment = {op: ("vk0.0" if i < cut else "vk0.1") for i, op in enumerate(order)}
    with Session(model, pool=pool4, plan=assignment, link_on_device=link_on_device) as session:
        assert [c.member for c in session.plan.chunks] == ["vk0.0", "vk0.1"]
        futures = [session.submit(f) for f in inputs]
        results = [f.result(timeout=60)[0] for f in futures]
        for got, want in zip(results, expected):
            np.testing.assert_array_equal(got, want)
        events = session.trace()
        assert len(events) == 8
        stage1 = {e.request: e for e in events if e.chunk == 0}
        stage2 = {e.request: e for e in events if e.chunk == 1}
        overlaps = [(a, b) for a in stage2 for b in stage1
                    if b > a and stage1[b].start_ns < stage2[a].end_ns and stage2[a].start_ns < stage1[b].end_ns]
        assert overlaps, events  # stage 2 of request k was in flight while stage 1 of a later request was
        # each stage holds two runs: a later request's stage 1 was on the device before an
        # earlier one's was seen done (its inputs in the chunk's second slot)
        assert [s.chunk.slots for s in session.executor.copies[0].stages] == [2, 2]
        assert any(stage1[b].start_ns < stage1[a].end_ns for a in stage1 for b in stage1 if b > a), events
        if link_on_device:
            # stage 2 is submitted with stage 1 and waits for it on the device: its submission
            # comes before stage 1's end is seen, for some request at least
            assert all(stage1[r].start_ns <= stage2[r].start_ns for r in stage2)
            assert any(stage2[r].start_ns < stage1[r].end_ns for r in stage2), events
        else:
            assert all(stage1[r].end_ns <= stage2[r].start_ns for r in stage2)  # a request's stages in order
        # several threads calling run() at once also pipeline, each getting its own result
        got: dict[int, np.ndarray] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, session.run(None, inputs[i])[0]))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(4):
            np.testing.assert_array_equal(got[i], expected[i])


def test_replicas_take_requests_by_load(pool4) -> None:
    model, feeds, expected = _reference("mnist12_like", pool4)
    with Session(model, pool=pool4, devices=["vk0.0", "vk0.1"], objective="throughput") as session:
        assert session.plan.replicas, session.plan.to_text()
        assert len(session.executor.copies) == 2
        futures = [session.submit(feeds) for _ in range(8)]
        for f in futures:
            np.testing.assert_array_equal(f.result(timeout=60)[0], expected[0])
        copies = {e.copy for e in session.trace()}
        assert copies == {0, 1}  # with requests queued on one copy, the next went to the other
        assert set(session.memory_by_member()) == {"vk0.0", "vk0.1"}


def test_given_plan_for_another_model_is_refused(pool4) -> None:
    model, _, _ = _reference("mlp", pool4)
    with pytest.raises(ValueError, match="places no member"):
        Session(model, pool=pool4, plan={"nope": "vk0.0"})


def test_failed_requests_give_their_run_slots_back(pool4) -> None:
    """On a plan whose chunks hand tensors over on the device, each request holds one of the
    plan's two run slots: requests that fail (a feed of the wrong shape, caught when its chunk
    starts) must give theirs back, or the requests after them would wait forever."""
    model, feeds, expected = _reference("conv_few_15MB", pool4)
    with Session(model, pool=pool4, device="vk0.0") as single:
        order = build_graph(single.model).graph["order"]
    cut = order.index(next(op for op in order if op.startswith("Reshape")))
    assignment = {op: ("vk0.0" if i < cut else "vk0.1") for i, op in enumerate(order)}
    with Session(model, pool=pool4, plan=assignment) as session:
        executor = session.executor
        assert executor.copies[0].free == [0, 1]
        bad = {name: np.zeros((2, *value.shape), value.dtype) for name, value in feeds.items()}
        futures = [executor.submit(bad) for _ in range(3)] + [executor.submit(feeds) for _ in range(3)]
        for f in futures[:3]:
            with pytest.raises(ValueError):
                f.result(timeout=60)
        output = session.get_outputs()[0].name
        for f in futures[3:]:
            np.testing.assert_array_equal(f.result(timeout=60)[output], expected[0])
        assert sorted(executor.copies[0].free) == [0, 1] and not executor._backlog
        assert executor.stats() == RequestStats(accepted=6, ok=3, failed=3, pending=0)


def test_closing_ends_the_requests_waiting_for_a_run_slot(pool4) -> None:
    """Requests beyond the plan's two run slots wait for one; closing the session while they
    wait ends each of them (a result, or the error that says the session was closed), none hangs."""
    model, feeds, expected = _reference("conv_few_15MB", pool4)
    with Session(model, pool=pool4, device="vk0.0") as single:
        order = build_graph(single.model).graph["order"]
    cut = order.index(next(op for op in order if op.startswith("Reshape")))
    assignment = {op: ("vk0.0" if i < cut else "vk0.1") for i, op in enumerate(order)}
    session = Session(model, pool=pool4, plan=assignment)
    executor = session.executor
    futures = [executor.submit(feeds) for _ in range(8)]
    assert len(executor._backlog) == 6  # six of them wait for a slot
    session.close()
    output = session.get_outputs()[0].name
    closed = 0
    for f in futures:
        try:
            np.testing.assert_array_equal(f.result(timeout=60)[output], expected[0])
        except RuntimeError as exc:
            assert "closed before this request finished" in str(exc)
            closed += 1
    assert closed >= 1 and not executor._backlog
    counts = executor.stats()
    assert counts.accepted == 8 and counts.failed == closed and counts.ok == 8 - closed and counts.pending == 0
