"""The request pipeline's contract (``vkpool.pipeline``), the same test for every runner: one
member in the caller's thread, a plan over two members in threads, the same plan in worker
processes, a model cut at a data-dependent shape, and the in-process batcher (dynamic batching).
Each runner gives the outputs of the ONNX reference evaluator (rtol 1e-4, atol 1e-5: float32 on
the device), fails a failing request exactly once with that request's error and no other,
balances its counts (accepted = ok + failed + pending), and on close ends every request it
accepted (a result, or the error that says it was closed) and refuses new ones. On lavapipe
split in two members."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from bench import workloads
from conftest import vulkan_pool
from test_dynamic_shapes import nonzero_model
from vkpool.config.loader import parse_config
from vkpool.pipeline import IDLE, InlineRunner, RequestStats
from vkpool.session import InvalidInput, Session

KINDS = ["inline", "threads", "processes", "cut", "batched", "copies"]
#: more than the places of the plan's copy in threads (two run slots: its chunks share a device)
#: and in processes (six mailboxes), so requests submitted back to back wait in the backlog too
REQUESTS = 8


@pytest.fixture(scope="module")
def pool2():
    pool = vulkan_pool(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n    budget: 256MiB\n"
                                    "host:\n  enabled: false\n"))
    yield pool
    pool.close()


def _halves(session: Session) -> dict[str, str]:
    from vkpool.partition.graph import build_graph

    order = build_graph(session.model).graph["order"]
    return {op: ("vk0.0" if i < len(order) // 2 else "vk0.1") for i, op in enumerate(order)}


def _open(kind: str, pool: Any) -> tuple[Session, onnx.ModelProto, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(5)
    if kind == "cut":
        model = nonzero_model()
        feeds = [{"x": rng.standard_normal((4, 6)).astype(np.float32)} for _ in range(REQUESTS)]
        return Session(model.SerializeToString(), pool=pool, device="vk0.0"), model, feeds
    model = workloads.build("mnist12_like")
    data = model.SerializeToString()
    feeds = [{"x": rng.standard_normal((1, 1, 28, 28)).astype(np.float32)} for _ in range(REQUESTS)]
    if kind == "inline":
        return Session(data, pool=pool, device="vk0.0"), model, feeds
    if kind == "batched":
        model = workloads.symbolic_batch(model)
        return Session(model.SerializeToString(), pool=pool, device="vk0.0", max_batch=4), model, feeds
    if kind == "copies":  # a throughput plan: a whole copy on each member, in threads of this process
        return Session(data, pool=pool, objective="throughput", processes=False), model, feeds
    with Session(data, pool=pool, device="vk0.0") as probe:
        plan = _halves(probe)
    return Session(data, pool=pool, plan=plan, processes=kind == "processes"), model, feeds


def _assert_outputs(got: dict[str, np.ndarray], model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    names = [o.name for o in model.graph.output]
    want = ReferenceEvaluator(model).run(None, feeds)
    assert sorted(got) == sorted(names)
    for name, w in zip(names, want):
        assert got[name].shape == w.shape and got[name].dtype == w.dtype
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5)


def _balanced(stats: RequestStats) -> bool:
    return stats.accepted == stats.ok + stats.failed + stats.pending


@pytest.mark.parametrize("kind", KINDS)
def test_every_runner_keeps_the_contract(pool2, kind: str) -> None:
    session, model, feeds = _open(kind, pool2)
    runner = session._batcher if kind == "batched" else session.runner
    try:
        assert isinstance(runner, InlineRunner) == (kind in ("inline", "cut"))
        assert runner.stats() == RequestStats()
        # same outputs, whether waited for one at a time or submitted back to back
        _assert_outputs(runner.run(feeds[0]), model, feeds[0])
        futures = [runner.submit(f) for f in feeds]
        for f, fed in zip(futures, feeds):
            _assert_outputs(f.result(timeout=120), model, fed)
        assert runner.stats() == RequestStats(accepted=1 + REQUESTS, ok=1 + REQUESTS)

        # a failing request fails once, with its own error, between requests that do not
        class Refused(Exception):
            pass

        mine = Refused("this request's outputs are refused")
        done: list[Future] = []

        def refuse(produced: dict[str, np.ndarray]) -> Any:
            raise mine

        around = [runner.submit(feeds[0]), runner.submit(feeds[1], refuse), runner.submit(feeds[2])]
        around[1].add_done_callback(done.append)
        assert around[1].exception(timeout=120) is mine
        _assert_outputs(around[0].result(timeout=120), model, feeds[0])
        _assert_outputs(around[2].result(timeout=120), model, feeds[2])
        assert done == [around[1]]
        if kind == "batched":
            # the batcher checks a request before it joins a batch: one it cannot feed (another
            # element type) is refused by submit, never accepted, and the next one runs
            wrong = {name: value.astype(np.float64) for name, value in feeds[3].items()}
            with pytest.raises(InvalidInput, match="must be float32"):
                runner.submit(wrong)
            failed = 1
        else:
            # a request whose input cannot be fed (twice the rows) fails in the runner, and only it
            wrong = {name: np.concatenate([value, value]) for name, value in feeds[3].items()}
            bad = runner.submit(wrong)
            assert isinstance(bad.exception(timeout=120), Exception)
            failed = 2
        good = runner.submit(feeds[3])
        _assert_outputs(good.result(timeout=120), model, feeds[3])
        stats = runner.stats()
        accepted = 4 + failed + REQUESTS
        assert stats == RequestStats(accepted=accepted, ok=4 + REQUESTS, failed=failed), stats

        # closing ends every request accepted before it, and refuses the next
        last = [runner.submit(f) for f in feeds]
        session.close()
        closed = 0
        for f, fed in zip(last, feeds):
            error = f.exception(timeout=120)
            if error is None:
                _assert_outputs(f.result(), model, fed)
            else:
                assert isinstance(error, RuntimeError) and "closed" in str(error)
                closed += 1
        stats = runner.stats()
        assert _balanced(stats) and stats.pending == 0 and stats.accepted == accepted + REQUESTS
        assert stats.failed == failed + closed
        with pytest.raises(RuntimeError, match="closed"):
            runner.submit(feeds[0])
    finally:
        session.close()


@pytest.mark.parametrize("kind", [*KINDS, "inline_two_slots"])
def test_run_many_answers_each_request_alone(pool2, kind: str) -> None:
    """``Session.run_many`` gives every request its own outputs, and a request it cannot feed its
    own error, on every runner; on one member with ``run_slots=2`` the runner keeps two runs in
    flight (the second starts on the chunk's other slot while the first is on the device)."""
    if kind == "inline_two_slots":
        probe, model, feeds = _open("inline", pool2)
        probe.close()
        session = Session(model.SerializeToString(), pool=pool2, device="vk0.0", run_slots=2)
    else:
        session, model, feeds = _open(kind, pool2)
    try:
        if kind in ("inline", "cut", "inline_two_slots"):
            assert session.runner.depth == (2 if kind == "inline_two_slots" else 1)
        if kind == "copies":  # driven from this thread: each request on the next copy in turn
            assert [len(c.stages) for c in session.runner.copies] == [1, 1], session.runner.copies
            started: list[str] = []

            def noting(member: str, start: Any) -> Any:  # the chunk's own start, each call noted
                def noted(*args: Any, **kwargs: Any) -> Any:
                    started.append(member)
                    return start(*args, **kwargs)
                return noted

            for copy in session.runner.copies:
                copy.stages[0].chunk.start = noting(copy.stages[0].member.id, copy.stages[0].chunk.start)
        wrong = {name: value.astype(np.float64) for name, value in feeds[0].items()}
        given = [*feeds[:3], wrong, *feeds[3:]]
        results = session.run_many(given)
        assert len(results) == len(given)
        names = [o.name for o in model.graph.output]
        for result, fed in zip(results, given):
            if fed is wrong:
                assert isinstance(result, InvalidInput) and "float32" in str(result), result
                continue
            assert not isinstance(result, Exception), result
            _assert_outputs(dict(zip(names, result)), model, fed)
        runner = session._batcher if kind == "batched" else session.runner
        assert _balanced(runner.stats()) and runner.stats().pending == 0
        if kind == "copies":
            assert started == ["vk0.0", "vk0.1"] * (len(given) // 2), started  # the wrong one never started
        # a stream that has nothing ready says IDLE: what it gave before ends and is reported
        # before it is read again (a stream that then waits for more holds nothing back)
        reported: list[int] = []

        def stream() -> Any:
            yield from feeds[:2]
            yield IDLE
            assert sorted(reported) == [0, 1], reported
            yield from feeds[2:4]
            yield IDLE

        results = session.run_many(stream(), each=lambda index, _: reported.append(index))
        assert len(results) == 4 and sorted(reported) == [0, 1, 2, 3]
        for result, fed in zip(results, feeds):
            _assert_outputs(dict(zip(names, result)), model, fed)
    finally:
        session.close()


def test_back_to_back_keeps_depth_in_flight() -> None:
    """``back_to_back`` starts the next item before it waits for the last, up to ``depth``, in
    order, and an item whose start or finish fails fails alone."""
    from vkpool.pipeline import back_to_back

    events: list[str] = []
    in_flight = [0, 0]  # now, most

    def start(item: int) -> int:
        if item == 3:
            raise ValueError("three does not start")
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        events.append(f"start {item}")
        return item

    def finish(handle: int) -> int:
        in_flight[0] -= 1
        events.append(f"finish {handle}")
        if handle == 5:
            raise KeyError("five does not finish")
        return handle * 10

    out = back_to_back(start, finish, list(range(7)), depth=2)
    assert out[:3] == [0, 10, 20] and out[4] == 40 and out[6] == 60
    assert isinstance(out[3], ValueError) and isinstance(out[5], KeyError)
    assert in_flight == [0, 2]
    assert events[:4] == ["start 0", "start 1", "finish 0", "start 2"]
    assert back_to_back(start, finish, [0, 1, 2], depth=1) == [0, 10, 20] and in_flight[0] == 0
    events.clear()  # IDLE: the runs in flight end before the next item is read
    assert back_to_back(start, finish, [0, IDLE, 1, 2, IDLE], depth=2) == [0, 10, 20]
    assert events == ["start 0", "finish 0", "start 1", "start 2", "finish 1", "finish 2"]


def test_run_many_from_several_threads_with_two_run_slots(pool2) -> None:
    """Four threads calling ``run_many`` on one session with two run slots, beside one calling
    ``run``, all finish with their own outputs (two run_many each holding one slot while they
    wait for another would wait forever)."""
    import threading

    probe, model, feeds = _open("inline", pool2)
    probe.close()
    session = Session(model.SerializeToString(), pool=pool2, device="vk0.0", run_slots=2)
    names = [o.name for o in model.graph.output]
    got: dict[str, list[Any]] = {}

    def many(label: str) -> None:
        for _ in range(5):
            got[label] = session.run_many(feeds * 3)

    def single() -> None:
        got["run"] = [session.run(None, f) for f in feeds]

    threads = [*(threading.Thread(target=many, args=(label,), daemon=True) for label in "abcd"),
               threading.Thread(target=single, daemon=True)]
    stuck = True
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stuck = any(t.is_alive() for t in threads)
        assert not stuck, "run_many from several threads did not finish"
        for label in "abcd":
            assert len(got[label]) == 3 * len(feeds)
            for result, fed in zip(got[label], feeds * 3):
                _assert_outputs(dict(zip(names, result)), model, fed)
        for result, fed in zip(got["run"], feeds):
            _assert_outputs(dict(zip(names, result)), model, fed)
    finally:
        if not stuck:  # closing waits for the runs in progress, which a stuck thread never ends
            session.close()
