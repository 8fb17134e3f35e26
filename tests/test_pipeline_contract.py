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
from vkpool.pipeline import InlineRunner, RequestStats
from vkpool.session import InvalidInput, Session

KINDS = ["inline", "threads", "processes", "cut", "batched"]
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
