"""Plans in worker processes (``vkpool.processes``) on lavapipe: one process per chunk or
replica, on the members of a two-way split of the device, each with its own logical device,
serving requests through shared memory. Outputs are compared bit for bit with a one-member
session in this process (the same shaders run on the same device)."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from bench import workloads
from conftest import vulkan_pool
from vkpool.config.loader import parse_config
from vkpool.session import Session

MEMBERS = ["vk0.0", "vk0.1"]
BUDGET = 256 << 20


@pytest.fixture(scope="module")
def pool2():
    pool = vulkan_pool(parse_config(f"devices:\n  - match: {{index: 0}}\n    split: 2\n    budget: {BUDGET}\n"
                                    "host:\n  enabled: false\n"))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def mnist(pool2) -> tuple[bytes, list[dict[str, np.ndarray]], list[np.ndarray]]:
    model = workloads.build("mnist12_like").SerializeToString()
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((1, 1, 28, 28)).astype(np.float32)} for _ in range(6)]
    with Session(model, pool=pool2, device="vk0.0") as one:
        expected = [one.run(None, f)[0] for f in feeds]
    return model, feeds, expected


@pytest.fixture(scope="module")
def replicated(pool2, mnist):
    model = mnist[0]
    used = {m: pool2.member(m).used_bytes for m in MEMBERS}
    with Session(model, pool=pool2, devices=MEMBERS, objective="throughput", processes=True) as session:
        yield session, used


def test_each_replica_runs_in_its_own_process_and_results_match_their_requests(pool2, mnist, replicated) -> None:
    _, feeds, expected = mnist
    session, _ = replicated
    assert session.plan.replicas and len(session.executor.copies) == 2
    pids = {w.proc.pid for w in session.executor.workers}
    assert len(pids) == 2 and os.getpid() not in pids
    futures = [session.submit(feeds[k % len(feeds)]) for k in range(24)]  # more than the 2 x 4 mailboxes
    for k, f in enumerate(futures):
        np.testing.assert_array_equal(f.result(timeout=120)[0], expected[k % len(feeds)])
    copies = {e.copy for e in session.trace()}
    assert copies == {0, 1}  # the least-loaded replica took the requests the other could not
    np.testing.assert_array_equal(session.run(None, feeds[0])[0], expected[0])


def test_worker_memory_is_charged_to_the_members_budgets(pool2, replicated) -> None:
    session, before = replicated
    held = session.memory_by_member()
    assert set(held) == set(MEMBERS)
    for m in MEMBERS:
        assert held[m] > 0
        assert pool2.member(m).used_bytes == before[m] + held[m]
    text = session.plan.to_text()
    assert "replica 1 on vk0.1" in text and "dispatches" in text


def test_bad_input_is_refused_before_it_reaches_a_worker(replicated) -> None:
    session, _ = replicated
    from vkpool.session import InvalidInput

    with pytest.raises(InvalidInput, match="shape"):
        session.submit({"x": np.zeros((1, 1, 27, 28), np.float32)})


def test_closing_returns_the_budget_and_ends_the_workers(pool2, mnist) -> None:
    model, feeds, expected = mnist
    before = {m: pool2.member(m).used_bytes for m in MEMBERS}
    session = Session(model, pool=pool2, devices=MEMBERS, objective="throughput", processes=True)
    procs = [w.proc for w in session.executor.workers]
    futures = [session.submit(feeds[0]) for _ in range(10)]
    session.close()  # what was accepted is served before the workers exit
    for f in futures:
        np.testing.assert_array_equal(f.result(timeout=60)[0], expected[0])
    assert all(p.returncode == 0 for p in procs)
    assert {m: pool2.member(m).used_bytes for m in MEMBERS} == before
    with pytest.raises(RuntimeError, match="closed"):
        session.run(None, feeds[0])


def test_a_dead_worker_fails_its_requests_and_the_other_replica_serves_on(pool2, mnist) -> None:
    model, feeds, expected = mnist
    with Session(model, pool=pool2, devices=MEMBERS, objective="throughput", processes=True) as session:
        victim = session.executor.workers[1]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=30)
        for _ in range(3000):  # the reader thread sees its pipe close
            if not victim.alive:
                break
            time.sleep(0.01)
        assert not victim.alive
        for k in range(6):  # every request goes to the live replica
            np.testing.assert_array_equal(session.run(None, feeds[k])[0], expected[k])
        assert "exited with status -9" in victim.why_ended()


def test_a_budget_too_small_for_a_worker_is_a_clear_error(pool2, mnist) -> None:
    from vkpool.memory import DeviceOutOfMemory
    from vkpool.partition.plan import build_plan
    from vkpool.partition.graph import build_graph
    from vkpool.session import Session as S

    model = mnist[0]
    with S(model, pool=pool2, device="vk0.0") as one:
        graph = build_graph(one.model)
        members = one._planner_members(MEMBERS)
    plan = build_plan(graph, {op: "vk0.0" for op in graph.graph["order"]}, members, objective="throughput",
                      algorithm="given", replicas=["vk0.1"])
    before = {m: pool2.member(m).used_bytes for m in MEMBERS}
    pool2.set_budget("vk0.1", pool2.member("vk0.1").used_bytes + 4096)
    try:
        with pytest.raises(DeviceOutOfMemory, match="vk0.1"):
            S(model, pool=pool2, plan=plan, processes=True)
    finally:
        pool2.set_budget("vk0.1", BUDGET)
    assert {m: pool2.member(m).used_bytes for m in MEMBERS} == before


def test_a_split_plan_runs_each_chunk_in_its_own_process_and_pipelines(pool2, mnist) -> None:
    model, feeds, expected = mnist
    before = {m: pool2.member(m).used_bytes for m in MEMBERS}
    with Session(model, pool=pool2, plan=dict(_halves(model, pool2)), processes=True) as session:
        assert [c.member for c in session.plan.chunks] == MEMBERS
        pids = {w.proc.pid for w in session.executor.workers}
        assert len(pids) == 2 and os.getpid() not in pids
        futures = [session.submit(feeds[k % len(feeds)]) for k in range(12)]  # more than the copy's 6 mailboxes
        for k, f in enumerate(futures):
            np.testing.assert_array_equal(f.result(timeout=120)[0], expected[k % len(feeds)])
        planned = [(t.tensor, t.src, t.dst) for t in session.executor.planned_transfers]
        assert planned and dict(session.executor.transfers_executed) == {key: 12 for key in planned}
        events = session.trace()
        first = {e.request: e for e in events if e.chunk == 0}
        second = {e.request: e for e in events if e.chunk == 1}
        assert len(first) == len(second) == 12
        assert all(first[r].end_ns <= second[r].start_ns for r in second)  # a request's chunks in order
        # chunk 1 ran a request while chunk 0 ran a later one
        assert any(b > a and first[b].start_ns < second[a].end_ns and second[a].start_ns < first[b].end_ns
                   for a in second for b in first), events
        held = session.memory_by_member()
        assert all(pool2.member(m).used_bytes == before[m] + held[m] for m in MEMBERS)
    assert {m: pool2.member(m).used_bytes for m in MEMBERS} == before


def test_branches_in_their_own_processes_join_in_a_third(pool2) -> None:
    from test_multi_member import _branched

    from vkpool.partition.graph import build_graph

    model = _branched()
    x = np.random.default_rng(3).standard_normal((1, 3, 24, 24)).astype(np.float32)
    with Session(model, pool=pool2, device="vk0.0") as one:
        expected = one.run(None, {"x": x})[0]
        order = build_graph(one.model).graph["order"]
    plan = {op: ("vk0.1" if op.startswith("b") else "vk0.0") for op in order}
    with Session(model, pool=pool2, plan=plan, processes=True) as session:
        assert len(session.plan.chunks) == 3 and len(session.executor.workers) == 3
        for _ in range(3):
            np.testing.assert_array_equal(session.run(None, {"x": x})[0], expected)
        for request in {e.request for e in session.trace()}:
            mine = {e.chunk: e for e in session.trace() if e.request == request}
            assert {mine[0].member, mine[1].member} == set(MEMBERS)
            assert mine[2].start_ns >= max(mine[0].end_ns, mine[1].end_ns)


def test_a_dead_chunk_worker_fails_its_copy_with_the_reason(pool2, mnist) -> None:
    model, feeds, expected = mnist
    before = {m: pool2.member(m).used_bytes for m in MEMBERS}
    with Session(model, pool=pool2, plan=dict(_halves(model, pool2)), processes=True) as session:
        np.testing.assert_array_equal(session.run(None, feeds[0])[0], expected[0])
        victim = session.executor.workers[1]
        os.kill(victim.proc.pid, signal.SIGKILL)
        for _ in range(3000):
            if not victim.alive:
                break
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="chunk 1 on vk0.1 exited with status -9"):
            session.run(None, feeds[0])
        first = session.executor.workers[0]
        assert first.proc.wait(timeout=60) == 0  # the copy's other worker was told to stop
    assert {m: pool2.member(m).used_bytes for m in MEMBERS} == before


def _halves(model: bytes, pool) -> list[tuple[str, str]]:
    from vkpool.partition.graph import build_graph

    with Session(model, pool=pool, device="vk0.0") as one:
        order = build_graph(one.model).graph["order"]
    return [(op, MEMBERS[0] if i < len(order) // 2 else MEMBERS[1]) for i, op in enumerate(order)]


def test_requests_nobody_waits_for_are_completed_by_the_reader_thread(mnist, replicated) -> None:
    import threading

    _, feeds, expected = mnist
    session, _ = replicated
    got: dict[int, np.ndarray] = {}
    done = threading.Event()

    def keep(k: int):
        def callback(f) -> None:
            got[k] = f.result()[0]  # already done: result() returns at once
            if len(got) == 8:
                done.set()
        return callback

    for k in range(8):
        session.submit(feeds[k % len(feeds)]).add_done_callback(keep(k))
    assert done.wait(timeout=120)
    for k in range(8):
        np.testing.assert_array_equal(got[k], expected[k % len(feeds)])


def test_processes_without_a_plan_is_refused_with_what_to_give(pool2, mnist) -> None:
    model = mnist[0]
    with pytest.raises(ValueError, match="give devices=.* or plan="):
        Session(model, pool=pool2, device="vk0.0", processes=True)
    with pytest.raises(ValueError, match="give devices=.* or plan="):
        Session(model, pool=pool2, processes=True)


def test_the_session_does_not_keep_the_model_bytes_once_workers_loaded_them(replicated) -> None:
    session, _ = replicated
    assert session._source is None


def test_a_chunk_reads_and_writes_imported_host_memory_in_place(pool2, mnist, monkeypatch) -> None:
    import mmap

    from vkpool.executor import build_chunk
    from vkpool.pipeline import stage_nodes
    from vkpool.memory import HostImport
    from vkpool.model import load_model

    model_bytes, feeds, expected = mnist
    member = pool2.member("vk0.0")
    if member.device.host_import_alignment is None:
        pytest.skip("no Vulkan device with VK_EXT_external_memory_host here (the extension imports host "
                    "memory; lavapipe and NVIDIA's driver have it)")
    # the slots' copies on the compute queue: a transfer queue (the H200 has one) gives each slot
    # device memory to land in (tests/test_transfer_queue.py)
    monkeypatch.setattr(member.device, "transfer_family", None)
    model = load_model(model_bytes)
    stage = stage_nodes(model, [list(range(len(model.nodes)))], [member])[0]
    (inp,), (out,) = stage.inputs, stage.outputs
    page = 4096
    region = mmap.mmap(-1, 3 * 2 * page)  # three slots: an input page and an output page each
    imports = [HostImport(member.device, np.frombuffer(region, np.uint8, page, at)) for at in range(0, 6 * page, page)]
    io = [{inp: imports[2 * k].allocation, out: imports[2 * k + 1].allocation} for k in range(3)]
    chunk = build_chunk(model, stage, io=io)
    try:
        assert chunk.slots == 3 and chunk.stats.io_bytes == 0  # no memory of its own for I/O
        x_views = [np.ndarray(feeds[0]["x"].shape, np.float32, region, 2 * k * page) for k in range(3)]
        y_views = [np.ndarray(expected[0].shape, np.float32, region, (2 * k + 1) * page) for k in range(3)]
        for k in range(3):
            x_views[k][...] = feeds[k]["x"]
            chunk.start_in_place(k)  # three runs in flight over one arena, in order
        for k in range(3):
            chunk.wait_in_place(k)
            np.testing.assert_array_equal(y_views[k], expected[k])  # the kernels wrote the mapping itself
        x_views[1][...] = feeds[4]["x"]  # a slot serves again with new inputs written in place
        chunk.start_in_place(1)
        chunk.wait_in_place(1)
        np.testing.assert_array_equal(y_views[1], expected[4])
    finally:
        chunk.close()
        for imp in imports:
            imp.allocation.free()


def test_tensors_crossing_chunks_stay_in_the_shared_mailboxes_where_the_devices_import_them(pool2, mnist) -> None:
    model, feeds, expected = mnist
    can = pool2.member("vk0.0").device.host_import_alignment is not None
    for in_place in (True, False):
        with Session(model, pool=pool2, plan=dict(_halves(model, pool2)), processes=True,
                     in_place=in_place) as session:
            crossing = sorted({t.tensor for t in session.executor.planned_transfers})
            assert crossing and session.executor.in_place == (crossing if in_place and can else [])
            futures = [session.submit(feeds[k]) for k in range(len(feeds))]
            for k, f in enumerate(futures):
                np.testing.assert_array_equal(f.result(timeout=120)[0], expected[k])
            got = {(t.tensor, t.src, t.dst) for t in session.executor.planned_transfers}
            assert dict(session.executor.transfers_executed) == {key: len(feeds) for key in got}


def test_replicas_copy_the_models_own_inputs_and_outputs(replicated) -> None:
    session, _ = replicated
    assert session.executor.in_place == []  # nothing crosses between chunks of a one-chunk copy


def test_a_plan_over_software_devices_stays_in_this_process_unless_asked(pool2, mnist) -> None:
    from vkpool.executor import PlanExecutor
    from vkpool.processes import ProcessExecutor

    model, feeds, expected = mnist
    # lavapipe is not a hardware GPU: by default its members' chunks run in threads here
    with Session(model, pool=pool2, plan=dict(_halves(model, pool2))) as session:
        assert type(session.executor) is PlanExecutor
        assert "Compiled, run by threads of this process:" in session.plan.to_text()
        np.testing.assert_array_equal(session.run(None, feeds[0])[0], expected[0])
    # the workers' shared mailboxes are what in_place= is about: threads have none, so it is refused
    with pytest.raises(ValueError, match="in_place=True is for a plan run in worker processes"):
        Session(model, pool=pool2, plan=dict(_halves(model, pool2)), in_place=True)
    with Session(model, pool=pool2, plan=dict(_halves(model, pool2)), processes=True) as session:
        assert type(session.executor) is ProcessExecutor
        text = session.plan.to_text()
        assert "Compiled, run by a worker process per chunk and per replica:" in text
        assert "chunk 0 on vk0.0" in text and "chunk 1 on vk0.1" in text
