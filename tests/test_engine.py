"""Record-once execution on the real Vulkan device: nothing is recorded, written or allocated per run."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from vkpool.engine import ArenaPlanner
from vkpool.session import InvalidInput, Session


def _model(n_layers: int = 6) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 16])
    inits, nodes, prev = [], [], "x"
    rng = np.random.default_rng(0)
    for i in range(n_layers):
        inits.append(numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [prev, f"b{i}"], [f"a{i}"]))
        nodes.append(helper.make_node("Relu", [f"a{i}"], [f"r{i}"] if i < n_layers - 1 else ["y"]))
        prev = f"r{i}"
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def _reference(x: np.ndarray, n_layers: int = 6) -> np.ndarray:
    rng = np.random.default_rng(0)
    for _ in range(n_layers):
        x = np.maximum(x + rng.standard_normal(16).astype(np.float32), 0)
    return x


def test_thousand_runs_record_write_and_allocate_nothing(pool):
    with Session(_model(), pool=pool) as sess:
        device = sess.member.device
        x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
        sess.run(None, {"x": x})
        recordings = device.counters.recordings
        descriptor_writes = device.counters.descriptor_writes
        allocations = sess.member.allocations
        pipelines = device.counters.pipelines_created
        for i in range(1000):
            xi = x + np.float32(i % 7)
            (out,) = sess.run(None, {"x": xi})
            if i % 100 == 0:
                np.testing.assert_allclose(out, _reference(xi), rtol=1e-6, atol=1e-6)
        assert device.counters.recordings == recordings
        assert device.counters.descriptor_writes == descriptor_writes == 0
        assert sess.member.allocations == allocations
        assert device.counters.pipelines_created == pipelines


def test_eight_threads_never_mix_results(pool):
    with Session(_model(), pool=pool) as sess:
        errors: list[str] = []

        def worker(k: int) -> None:
            rng = np.random.default_rng(100 + k)
            for _ in range(40):
                x = rng.standard_normal((3, 16)).astype(np.float32)
                (out,) = sess.run(["y"], {"x": x})
                if not np.allclose(out, _reference(x), rtol=1e-6, atol=1e-6):
                    errors.append(f"thread {k} got another request's result")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


def test_activation_memory_is_the_largest_live_set(pool):
    with Session(_model(12), pool=pool) as sess:
        stats = sess.stats
        # a chain keeps at most two activations alive (an op's input and its output)
        assert stats.arena_bytes == 2 * ArenaPlanner.ALIGN
        assert stats.peak_live_bytes == 2 * 3 * 16 * 4
        assert stats.barriers == stats.levels - 1 == 2 * 12 - 1


def test_independent_branches_share_a_level(pool):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [8]) for i in range(4)]
    nodes = [helper.make_node("Relu", ["x"], [f"y{i}"]) for i in range(4)]
    g = helper.make_graph(nodes, "g", [x], outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    with Session(m, pool=pool) as sess:
        assert sess.stats.levels == 1 and sess.stats.barriers == 0 and sess.stats.dispatches == 4
        x_val = np.linspace(-2, 2, 8, dtype=np.float32)
        for out in sess.run(None, {"x": x_val}):
            np.testing.assert_array_equal(out, np.maximum(x_val, 0))


def test_bad_feeds_say_what_is_wrong(pool):
    with Session(_model(), pool=pool) as sess:
        with pytest.raises(InvalidInput, match="missing"):
            sess.run(None, {})
        with pytest.raises(InvalidInput, match="float32"):
            sess.run(None, {"x": np.zeros((3, 16), np.float64)})
        with pytest.raises(InvalidInput, match=r"shape \[3, 16\]"):
            sess.run(None, {"x": np.zeros((2, 16), np.float32)})
        with pytest.raises(InvalidInput, match="unknown input"):
            sess.run(None, {"x": np.zeros((3, 16), np.float32), "z": np.zeros(1)})


def test_session_frees_its_memory(pool):
    member = pool.vulkan_members[0]
    before = member.used_bytes
    sess = Session(_model(), pool=pool)
    assert member.used_bytes > before
    sess.close()
    assert member.used_bytes == before


def test_arena_planner_reuses_freed_ranges_and_remembers_levels():
    p = ArenaPlanner()
    a, _ = p.alloc(1000)
    b, _ = p.alloc(1000)
    p.release(a, 1000, level=3)
    c, level = p.alloc(500)
    assert c == a and level == 3
    p.release(b, 1000, level=5)
    p.release(c, 500, level=4)
    d, level = p.alloc(2048)
    assert d == 0 and level == 5


def test_a_wait_learns_how_long_its_runs_take(pool):
    import time

    with Session(_model(), pool=pool) as sess:
        sub = sess._chunk.submission
        assert sub.typical_s == 0.0
        x = np.ones((3, 16), np.float32)
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        first = time.perf_counter() - t0
        # from submission to the host seeing the fence: inside the run's own wall time
        assert 0.0 < sub.typical_s <= first
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            (out,) = sess.run(None, {"x": x})
            times.append(time.perf_counter() - t0)
        # a blend of runs seen (a faster one replaces it outright): within their wall times
        assert 0.0 < sub.typical_s <= max(*times, first)
        np.testing.assert_allclose(out, _reference(x), rtol=1e-6, atol=1e-6)


def _matmul_weight() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((32, 24)).astype(np.float32)


def _matmul_model() -> bytes:
    """y = Relu(x @ W): the product reads its input many times."""
    w = _matmul_weight()
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 24])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def test_inputs_in_mapped_device_memory_need_no_copy_in(pool, monkeypatch):
    """Where the member has device memory the host maps (lavapipe's is all of it), a product reads
    its input there; without it the input is copied into device memory first. Both give the
    same result, exactly."""
    x = np.random.default_rng(4).standard_normal((5, 32)).astype(np.float32)
    w = _matmul_weight()
    results, labels = {}, {}
    for mapped in (True, False):
        with Session(_matmul_model(), pool=pool) as probe:
            member = probe.member
        assert member.device_local_inputs  # lavapipe: device memory is host-visible
        if not mapped:
            monkeypatch.setattr(member, "inputs", None)
        with Session(_matmul_model(), pool=pool) as sess:
            (results[mapped],) = sess.run(None, {"x": x})
            labels[mapped] = sess._chunk.dispatch_labels
        monkeypatch.undo()
    assert not any(label.startswith("copy-in") for label in labels[True])
    assert any(label.startswith("copy-in x") for label in labels[False])
    np.testing.assert_array_equal(results[True], results[False])
    np.testing.assert_allclose(results[True], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mapped", [True, False], ids=["inputs-mapped", "inputs-copied-in"])
def test_two_run_slots_hold_two_runs_on_the_device_at_once(vk_member, monkeypatch, mapped):
    """A chunk with two run slots has two runs submitted before either is waited for: the
    second is the recording that starts with a barrier behind the first (they share the
    arena), each reads and writes its own mapped inputs and outputs, and waiting for them in
    either order gives each its own result, equal to a one-slot chunk's bit for bit."""
    from vkpool.engine import VulkanChunk

    if not mapped:
        monkeypatch.setattr(vk_member, "inputs", None)
    # the slots' copies on the compute queue: a transfer queue (the H200 has one) gives each slot
    # device memory to land in too (tests/test_transfer_queue.py)
    monkeypatch.setattr(vk_member.device, "transfer_family", None)
    args = _matmul_chunk_args(vk_member)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((5, 32)).astype(np.float32) for _ in range(6)]
    one = VulkanChunk(*args)
    two = VulkanChunk(*args, slots=2)
    try:
        assert (one.slots, two.slots) == (1, 2)
        assert two.stats.io_bytes == 2 * one.stats.io_bytes
        assert two.stats.dispatches == one.stats.dispatches
        assert one._slots[0].chained is None
        assert two._slots[0].chained.cmd != two._slots[1].chained.cmd
        assert any(label.startswith("copy-in") for label in two.dispatch_labels) == (not mapped)
        want = [one.run({"x": x})["y"] for x in xs]
        for x, w in zip(xs, want):  # tolerance: float32 sums of 32 products
            np.testing.assert_allclose(w, np.maximum(x @ _matmul_weight(), 0), rtol=1e-5, atol=1e-5)
        for a, b in [(0, 1), (2, 3), (4, 5)]:
            first = two.start({"x": xs[a]})
            second = two.start({"x": xs[b]})
            assert first != second
            assert two._slots[first].submitted is two._slots[first].alone
            assert two._slots[second].submitted is two._slots[second].chained
            got_b = two.finish(second, spin=False)["y"]  # the later run first
            got_a = two.finish(first)["y"]
            np.testing.assert_array_equal(got_a, want[a])
            np.testing.assert_array_equal(got_b, want[b])
    finally:
        one.close()
        two.close()


def test_a_second_run_slot_is_left_out_where_the_budget_has_no_room(pool):
    """Slots beyond the first are an overlap, not a need: a budget with room for one run's
    inputs and outputs gets a one-slot chunk, not a refusal."""
    from vkpool.engine import VulkanChunk

    member = pool.vulkan_members[0]
    args = _matmul_chunk_args(member)
    before = member.used_bytes
    probe = VulkanChunk(*args)
    need = member.used_bytes - before
    probe.close()
    saved = member.budget_bytes
    pool.set_budget(member.id, before + need)
    try:
        chunk = VulkanChunk(*args, slots=2)
        try:
            assert chunk.slots == 1
            assert chunk._slots[0].chained is None  # runs submit without the lock, as a one-slot chunk's do
            assert member.used_bytes == before + need
            x = np.ones((5, 32), np.float32)
            np.testing.assert_allclose(chunk.run({"x": x})["y"], np.maximum(x @ _matmul_weight(), 0),
                                       rtol=1e-5, atol=1e-5)
        finally:
            chunk.close()
    finally:
        pool.set_budget(member.id, saved)


def _matmul_chunk_args(member) -> tuple:
    from vkpool.model import load_model

    model = load_model(_matmul_model())
    return member, model.nodes, dict(model.tensors), model.constants, ["x"], ["y"], model.opset


def test_large_outputs_are_copied_in_parallel_slices_into_arrays_of_their_own(pool, monkeypatch):
    """Outputs of PARALLEL_COPY_BYTES and more are copied out in slices by several threads: every
    run's values are its own and whole (an odd element count leaves a short last slice), and a
    smaller output beside them takes the plain copy. (Copied: not handed out in imported host
    memory, tests/test_output_import.py.)"""
    from vkpool import engine
    from vkpool.engine import PARALLEL_COPY_BYTES

    monkeypatch.setattr(engine, "IMPORTED_OUTPUT_BYTES", 1 << 62)

    n = PARALLEL_COPY_BYTES // 4 + 4099  # float32 elements: past the threshold, slices of unequal size
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "big"], ["y"]), helper.make_node("Mul", ["x", "x"], ["small"])], "large",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]),
         helper.make_tensor_value_info("small", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.arange(n, dtype=np.float32) % 1000, "big")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    base = np.arange(n, dtype=np.float32) % 1000
    with Session(model.SerializeToString(), pool=pool) as sess:
        runs = [sess.run(None, {"x": np.array([v], np.float32)}) for v in (1.0, 2.0, 3.0)]
        (only,) = sess.run(["y"], {"x": np.array([4.0], np.float32)})
    for v, (y, small) in zip((1.0, 2.0, 3.0), runs):
        assert y.flags.owndata and y.flags.c_contiguous and y.shape == (n,)
        np.testing.assert_array_equal(y, base + v)
        np.testing.assert_array_equal(small, [v * v])
    np.testing.assert_array_equal(only, base + 4.0)
