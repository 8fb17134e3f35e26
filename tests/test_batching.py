"""Dynamic batching in-process (``Session(max_batch=...)``, :mod:`vkpool.batching`) on the real
Vulkan device: batched outputs equal unbatched ones (rtol 1e-5), queue delays stay within
``max_queue_delay`` plus one run, bad requests are refused before they join a batch, a failed batch
fails only its own requests, cancelled and timed-out requests leave before their batch runs."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import vulkan_pool
from onnx import TensorProto, helper, numpy_helper
from vkpool.config.loader import parse_config

import vkpool
from vkpool.batching import Batcher, BatchingError, BatchRunner, variant_sizes
from vkpool.pipeline import RequestStats
from vkpool.session import InvalidInput

RNG = np.random.default_rng(11)
W = RNG.standard_normal((16, 8)).astype(np.float32)
B = RNG.standard_normal(8).astype(np.float32)


def mlp_model(batch_dim: str | int = "N") -> bytes:
    """y = relu(x @ W + B), softmax over the row: x [batch_dim, 16]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 8])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "mlp", [x], [y], [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def reference(x: np.ndarray) -> np.ndarray:
    r = np.maximum(x.astype(np.float64) @ W + B, 0)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def batched(pool):
    member = pool.vulkan_members[0].id
    with vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=8, max_queue_delay=0.2) as s:
        yield s


def test_variant_sizes():
    assert variant_sizes(1) == (1,)
    assert variant_sizes(8) == (1, 2, 4, 8)
    assert variant_sizes(12) == (1, 2, 4, 8, 12)
    with pytest.raises(BatchingError):
        variant_sizes(0)


def test_requests_sent_together_run_together_and_match_unbatched_runs(pool, batched):
    member = pool.vulkan_members[0].id
    xs = [RNG.standard_normal((rows, 16)).astype(np.float32) for rows in (1, 2, 1, 3, 1)]  # 8 rows
    before = batched.batching["batches"]
    futures = [batched.submit({"x": x}) for x in xs]
    outs = [f.result(timeout=30)[0] for f in futures]
    assert batched.batching["batches"] - before == 1  # all eight rows in one run of the batch-8 variant
    with vkpool.Session(mlp_model(), pool=pool, device=member) as single:
        for x, got in zip(xs, outs):
            assert got.shape == (x.shape[0], 8)
            for row in range(x.shape[0]):
                np.testing.assert_allclose(got[row:row + 1], single.run(None, {"x": x[row:row + 1]})[0], rtol=1e-5)
            np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-6)


def test_requests_from_many_threads(batched):
    xs = [RNG.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(24)]
    results: dict[int, np.ndarray] = {}

    def client(i: int) -> None:
        results[i] = batched.submit({"x": xs[i]}).result(timeout=60)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(len(xs)))
    for i, x in enumerate(xs):
        np.testing.assert_allclose(results[i], reference(x), rtol=1e-4, atol=1e-6)
    stats = batched.batching
    assert stats["mean_batch_size"] > 1  # some requests shared a run


def test_a_lone_client_waits_for_company_once(pool):
    member = pool.vulkan_members[0].id
    with vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=4, max_queue_delay=0.05) as s:
        x = RNG.standard_normal((1, 16)).astype(np.float32)
        runs_s = []
        for _ in range(4):
            t0 = time.perf_counter()
            s.submit({"x": x}).result(timeout=30)
            runs_s.append(time.perf_counter() - t0)
        stats = s.batching
        assert stats["batches"] == 4 and stats["mean_batch_size"] == 1
        delays = s.batch_runner.stats.snapshot(samples=True)["queue_delays_us"]
        # the first request knows of no company yet: it waits the delay out, and no longer than
        # the delay and its run; the batch before the others held only their sender's one
        # request, which they are, so they wait for no one
        assert 50_000 <= delays[0] <= (0.05 + runs_s[0]) * 1e6
        assert all(d < 50_000 for d in delays[1:]), delays
        assert min(runs_s[1:]) < 0.05


def test_a_batch_waits_for_every_client_of_the_batch_before(pool):
    """Three threads each send one request, then another once answered: the second batch waits
    for all three, well within the delay."""
    member = pool.vulkan_members[0].id
    with vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=8, max_queue_delay=0.6) as s:
        xs = [RNG.standard_normal((1, 16)).astype(np.float32) for _ in range(3)]
        start = threading.Barrier(3)

        def client(k: int, rounds: int) -> None:
            start.wait()
            for r in range(rounds):
                time.sleep(0.03 * k * (r > 0))  # the second round's requests come apart
                s.submit({"x": xs[k]}).result(timeout=30)

        threads = [threading.Thread(target=client, args=(k, 2)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = s.batching
        # round one: the first waits (no batch before) and all three run together within 0.6 s;
        # round two: 0, 30 and 60 ms apart, they wait for one another, not for the delay
        assert stats["batches"] == 2 and stats["requests"] == 6, stats
        delays = s.batch_runner.stats.snapshot(samples=True)["queue_delays_us"]
        assert min(delays[:3]) >= 500_000, delays  # no batch before: the delay, less the gaps
        assert 40_000 <= max(delays[3:]) < 450_000, delays  # the first waited for the third


def test_invalid_requests_are_refused_before_joining(batched):
    good = RNG.standard_normal((2, 16)).astype(np.float32)
    for bad, match in [({"x": good.astype(np.float64)}, "must be float32"),
                       ({"x": good[:, :5]}, "must have shape"),
                       ({"x": np.zeros((9, 16), np.float32)}, "1 to 8 rows"),
                       ({"x": good, "z": good}, "unknown input"),
                       ({}, "missing input")]:
        with pytest.raises(InvalidInput, match=match):
            batched.submit(bad)
    with pytest.raises(InvalidInput, match="unknown output"):
        batched.submit({"x": good}, ["nope"])
    np.testing.assert_allclose(batched.submit({"x": good}).result(timeout=30)[0], reference(good), rtol=1e-4, atol=1e-6)


def test_a_failing_batch_fails_only_its_own_requests(pool):
    """The batch-4 variant cannot be built (as when its compile runs out of budget): the requests
    of that batch get the error; the requests before and after it are answered."""
    member = pool.vulkan_members[0].id
    sessions: list = []

    def make_variant(size: int):
        if size == 4:
            raise MemoryError("no room for the batch-4 variant")
        sessions.append(vkpool.Session(mlp_model(), pool=pool, device=member, batch=size))
        return sessions[-1]

    runner = BatchRunner(make_variant, [("x", (1, 16), np.float32)], ["y"], max_batch=4, max_queue_delay=0.3)
    b = Batcher(runner)
    try:
        one = RNG.standard_normal((1, 16)).astype(np.float32)
        three = RNG.standard_normal((3, 16)).astype(np.float32)
        first = b.submit({"x": one})  # alone: batch-1 variant
        first.result(timeout=30)
        failing = [b.submit({"x": one}), b.submit({"x": three})]  # 4 rows: the variant that fails
        for f in failing:
            with pytest.raises(MemoryError, match="batch-4"):
                f.result(timeout=30)
        after = b.submit({"x": three[:2]})
        np.testing.assert_allclose(after.result(timeout=30)["y"], reference(three[:2]), rtol=1e-4, atol=1e-6)
        s = b.batch_stats.snapshot()
        assert (s["batches"], s["failed_batches"], s["requests"]) == (3, 1, 4)
        assert b.stats() == RequestStats(accepted=4, ok=2, failed=2)
    finally:
        b.close()
        runner.close()
        assert sessions and all(x._closed for x in sessions)


def test_cancelled_and_timed_out_requests_leave_their_batch(pool):
    member = pool.vulkan_members[0].id
    with vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=8, max_queue_delay=0.3) as s:
        x = RNG.standard_normal((1, 16)).astype(np.float32)
        keep = s.submit({"x": x})
        cancelled = s.submit({"x": x})
        assert cancelled.cancel()
        late = s._batcher.submit({"x": x}, timeout=0.01)  # its batch starts after 0.3 s of waiting
        np.testing.assert_allclose(keep.result(timeout=30)[0], reference(x), rtol=1e-4, atol=1e-6)
        with pytest.raises(TimeoutError):
            late.result(timeout=30)
        stats = s.batching
        assert (stats["requests"], stats["cancelled"], stats["timed_out"]) == (1, 1, 1)


def test_a_model_without_a_batch_dimension_is_refused(pool):
    member = pool.vulkan_members[0].id
    with pytest.raises(BatchingError, match="no batch dimension"):
        vkpool.Session(mlp_model(batch_dim=1), pool=pool, device=member, max_batch=4)
    with pytest.raises(ValueError, match="give one of them"):
        vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=4, batch=2)


def test_closing_fails_what_is_still_queued(pool):
    member = pool.vulkan_members[0].id
    s = vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=8, max_queue_delay=5.0)
    x = RNG.standard_normal((1, 16)).astype(np.float32)
    futures = [s.submit({"x": x}) for _ in range(3)]
    t0 = time.perf_counter()
    s.close()
    assert time.perf_counter() - t0 < 5.0  # close does not wait out the queue delay
    for f in futures:
        try:
            np.testing.assert_allclose(f.result(timeout=10)[0], reference(x), rtol=1e-4, atol=1e-6)
        except RuntimeError as exc:  # closed before its batch started
            assert "closed" in str(exc)


def test_rows_that_would_waste_most_of_a_variant_run_as_an_exact_batch_first(batched):
    """Five single-row requests: padding them to the batch-8 variant would waste 3/8 of the run, so
    four run on the batch-4 variant and the fifth opens the next batch; nothing is padded."""
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    before = batched.batching
    futures = [batched.submit({"x": x[i:i + 1]}) for i in range(5)]
    got = np.concatenate([f.result(timeout=30)[0] for f in futures])
    after = batched.batching
    assert (after["batches"] - before["batches"], after["padded_rows"] - before["padded_rows"]) == (2, 0)
    np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-6)


def _run_whole(runner: BatchRunner, xs: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """A batch of ``xs`` through ``run_whole``: its whole output (padding rows too) and the rows."""
    return runner.run_whole([{"x": x} for x in xs], lambda outputs, rows: (outputs["y"].copy(), rows))


def test_a_batch_fills_a_run_slot_of_its_variant_in_place_padding_zeroed(batched):
    """On a Vulkan member the batch's rows go straight into a run slot of the variant
    (``Session.staged``): each slot is first filled with garbage, then a batch of five rows runs on
    the batch-8 variant; its rows match the reference and its three padding rows are the model's
    output for zero rows, so nothing of an earlier run's inputs is read."""
    runner = batched.batch_runner
    variant = runner._variant(8)
    slots = []
    for _ in range(variant._chunk.slots):
        slot = variant.staged()
        assert slot is not None and slot.inputs["x"].shape == (8, 16)
        slot.inputs["x"][...] = 1e3
        slots.append(slot)
    for slot in slots:
        slot.release()
    before = variant.runner.stats()
    xs = [RNG.standard_normal((r, 16)).astype(np.float32) for r in (2, 3)]
    y, rows = _run_whole(runner, xs)
    assert rows == [2, 3] and y.shape == (8, 8)
    np.testing.assert_allclose(y[:5], reference(np.concatenate(xs)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(y[5:], reference(np.zeros((3, 16), np.float32)), rtol=1e-4, atol=1e-6)
    after = variant.runner.stats()
    assert (after.accepted - before.accepted, after.ok - before.ok, after.pending) == (1, 1, 0)


def test_a_failing_use_gives_the_slot_back(batched):
    """What ``use`` raises passes through ``run_whole`` as it is (not as a failed batch), and the
    run slot goes back: the next batches still run on every slot."""
    runner = batched.batch_runner
    variant = runner._variant(2)
    failed = runner.stats.failed_batches
    x = RNG.standard_normal((2, 16)).astype(np.float32)

    def use(outputs, rows):
        raise KeyError("the caller's own error")

    with pytest.raises(KeyError):
        runner.run_whole([{"x": x}], use)
    assert runner.stats.failed_batches == failed
    for _ in range(variant._chunk.slots + 1):
        y, _ = _run_whole(runner, [x])
        np.testing.assert_allclose(y, reference(x), rtol=1e-4, atol=1e-6)
    assert variant.runner.stats().pending == 0


def test_batches_started_one_behind_another_each_get_their_own_outputs(pool):
    """``start_whole``: a batch written into a run slot and submitted, finished later (the daemon's
    lanes' thread starts the next batch of a model before answering the last). With two run
    slots, two batches of one variant are in flight at once and a third, not blocking, gets None
    (nothing counted); each batch finished gets its own rows, and the slots come back."""
    member = pool.vulkan_members[0].id
    with vkpool.Session(mlp_model(), pool=pool, device=member, max_batch=4, run_slots=2) as s:
        runner = s.batch_runner
        variant = runner._variant(4)
        assert variant._chunk.slots == 2
        xs = [RNG.standard_normal((4, 16)).astype(np.float32) for _ in range(3)]
        before = runner.stats.batches
        first = runner.start_whole([{"x": xs[0]}], block=False)
        second = runner.start_whole([{"x": xs[1][:2]}, {"x": xs[1][2:]}], block=False)
        assert first is not None and second is not None
        assert runner.start_whole([{"x": xs[2]}], block=False) is None
        assert runner.stats.batches - before == 2

        def copy(outputs, rows):
            return outputs["y"].copy(), rows

        got_second = second.finish(copy)  # finished out of order: each slot keeps its own outputs
        got_first = first.finish(copy)
        assert first.done() and second.done()
        np.testing.assert_allclose(got_first[0], reference(xs[0]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got_second[0], reference(xs[1]), rtol=1e-4, atol=1e-6)
        assert got_second[1] == [2, 2]
        third = runner.start_whole([{"x": xs[2]}], block=False)
        assert third is not None
        np.testing.assert_allclose(third.finish(copy)[0], reference(xs[2]), rtol=1e-4, atol=1e-6)
        stats = variant.runner.stats()
        assert (stats.accepted, stats.ok, stats.pending) == (3, 3, 0)


def test_a_member_without_run_slots_batches_through_stacked_feeds(pool):
    """The host member has no run slots to fill (``Session.staged`` is None there): a batch is
    stacked into arrays and given to the variant's ``run``, with the same results."""
    with vkpool.Session(mlp_model(), pool=pool, device="cpu", max_batch=4) as s:
        variant = s.batch_runner._variant(4)
        assert variant.staged() is None
        xs = [RNG.standard_normal((r, 16)).astype(np.float32) for r in (1, 2)]
        y, rows = _run_whole(s.batch_runner, xs)
        assert rows == [1, 2] and y.shape == (4, 8)
        np.testing.assert_allclose(y[:3], reference(np.concatenate(xs)), rtol=1e-4, atol=1e-6)


def test_a_replicated_variant_fills_the_first_copy_with_a_free_slot():
    """A throughput plan in threads (a whole copy of the model on each of two members): a batch
    fills a run slot of the first copy that has one free, else of the copy with the fewest runs
    in flight (``PlanExecutor.staged``): one after another they keep to the first copy, held
    together beyond its slots they spread; the copies' executor counts every batch as a
    request, none left pending."""
    pool = vulkan_pool(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n    budget: 256MiB\n"
                                    "host:\n  enabled: false\n"))
    try:
        with vkpool.Session(mlp_model(), pool=pool, objective="throughput", processes=False, max_batch=4) as s:
            runner = s.batch_runner
            variant = runner._variant(4)
            executor = variant.executor
            assert executor is not None and [len(c.stages) for c in executor.copies] == [1, 1]
            chunks = [c.stages[0].chunk for c in executor.copies]
            def copy_of(slot) -> int:
                return next(k for k, c in enumerate(chunks) if slot._chunk is c)

            one_by_one = []
            for _ in range(3):
                slot = variant.staged()
                one_by_one.append(copy_of(slot))
                slot.release()
            slots = [c.slots for c in chunks]
            held = [variant.staged() for _ in range(slots[0] + 1)]
            together = [copy_of(slot) for slot in held]
            for slot in held:
                slot.release()
            assert (one_by_one, together) == ([0, 0, 0], [0] * slots[0] + [1])
            assert [c.in_flight for c in executor.copies] == [0, 0]
            before = executor.stats()
            for rows in ((1, 3), (3,), (4,), (2, 2)):  # each on the batch-4 variant
                xs = [RNG.standard_normal((r, 16)).astype(np.float32) for r in rows]
                y, got_rows = _run_whole(runner, xs)
                total = sum(rows)
                assert got_rows == list(rows)
                np.testing.assert_allclose(y[:total], reference(np.concatenate(xs)), rtol=1e-4, atol=1e-6)
            after = executor.stats()
            assert (after.accepted - before.accepted, after.ok - before.ok, after.pending) == (4, 4, 0)
    finally:
        pool.close()
