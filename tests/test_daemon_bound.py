"""Bound infers (``vkpool.daemon.bound``): infers laid out once in a lane's ring, then carried as the
inputs' bytes and one word. A real ``vkpool serve`` subprocess on lavapipe, real client processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_daemon_batching import batch_model, reference
from test_daemon_e2e import Daemon, run_clients
from test_daemon_support import add_model, daemon_env, mlp_model, short_folder
from vkpool.daemon import errors as E
from vkpool.daemon.bound import Binding, ClientBinding, record_layout
from vkpool.daemon.client import Client
from vkpool.daemon.lane import _REQ
from vkpool.daemon.settings import DaemonSettings

from vkpool.batching import BatchRunner

pytestmark = pytest.mark.timeout(240)

#: each half of the rings of this module's daemon (``daemon.lane_ring_bytes``), small enough that
#: tensors over it stay small
RING_HALF = 256 << 10


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with short_folder("vkbd") as path:
        # both sides poll (the default on 4 CPUs or more), so lanes get rings and infers are bound
        d = Daemon(path, daemon={"lane_poll": "0.2ms", "lane_ring_bytes": RING_HALF})
        yield d
        assert d.stop() == 0


def polling(client: Client) -> Client:
    client._lane_poller.max_s = 300e-6  # this process's default on 2 CPUs: no polling, so no ring
    return client


def balanced(client: Client) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while True:
        c = client.status()["counters"]
        assert c["accepted"] == c["ok"] + c["error"] + c["client_gone"] + c["in_flight"], c
        if c["in_flight"] == 0 or time.monotonic() > deadline:
            return c
        time.sleep(0.05)


def tile_model(n: int, times: int) -> bytes:
    """y = tile(x, [1, times]), x float32 [1, n]: a small input, an output ``times`` as large."""
    reps = numpy_helper.from_array(np.array([1, times], np.int64), "reps")
    graph = helper.make_graph([helper.make_node("Tile", ["x", "reps"], ["y"])], "tile",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n * times])], [reps])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def runs_match(session: Any, local: Any, xs: list[np.ndarray]) -> None:
    """A remote session's outputs for each of ``xs`` are writable and the in-process session's bytes."""
    for x in xs:
        for g, want in zip(session.run(None, {"x": x}), local.run(None, {"x": x}), strict=True):
            assert g.flags.writeable
            np.testing.assert_array_equal(g, want)


def framed_give_the_same(session: Any, local: Any, xs: list[np.ndarray], bindings: dict, unbound: set) -> None:
    """The client's bindings set aside (``bindings`` emptied into ``unbound``): the same requests,
    framed, give the in-process session's bytes."""
    unbound.update(bindings)
    bindings.clear()
    runs_match(session, local, xs)


def test_bound_infers_match_in_process_runs_and_framed_ones(daemon: Daemon) -> None:
    from vkpool.session import Session

    path = daemon.folder / "mlp.onnx"
    path.write_bytes(mlp_model(8, 16, seed=11))
    rng = np.random.default_rng(1)
    with polling(daemon.client()) as client, Session(str(path)) as local:
        before = balanced(client)
        session = client.session(path)
        xs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(20)]
        runs_match(session, local, xs)
        [lane] = client._lanes
        assert lane.ring is not None and len(lane.bindings) == 1 and not lane.unbound
        # one output asked for: a binding of its own
        sent = lane.ring.words[_REQ]
        (y,) = session.run(["y"], {"x": xs[0]})
        np.testing.assert_array_equal(y, local.run(["y"], {"x": xs[0]})[0])
        assert len(lane.bindings) == 2 and lane.ring.words[_REQ] == sent + 2  # the bind and the infer
        framed_give_the_same(session, local, xs[:3], lane.bindings, lane.unbound)
        after = balanced(client)
    assert after["error"] == before["error"]
    # the first status, the load, open_lane, two binds, 21 bound infers, 3 framed
    assert after["ok"] - before["ok"] == 1 + 1 + 1 + 2 + 21 + 3


def batching_clients(client_args: str, setup: str, runs: int, bound: str) -> str:
    """A client process's code for :func:`test_daemon_e2e.run_clients` (argv: endpoint, seed, the
    tests' folder): ``Client(endpoint{client_args})``, ``setup`` run on it, then two threads each
    send ``runs`` infers of 1-3 rows to a batching model and check every output; at the end it
    asserts ``bound`` (an expression and its message)."""
    return f"""
import sys, threading, numpy as np
sys.path.insert(0, sys.argv[3])
from test_daemon_batching import batch_model, reference
from vkpool.daemon.client import Client
endpoint, seed = sys.argv[1], int(sys.argv[2])
with Client(endpoint{client_args}) as client:
    {setup}
    session = client.session(batch_model(), max_batch=8)
    def work(t):
        rng = np.random.default_rng(seed * 10 + t)
        for j in range({runs}):
            x = rng.standard_normal((1 + (j + t) % 3, 16)).astype(np.float32)
            (y,) = session.run(None, {{"x": x}})
            np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-6)
    pool = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for p in pool: p.start()
    for p in pool: p.join()
    assert {bound}
"""


def test_a_batching_model_runs_bound_infers_of_several_processes_as_batches(inline_daemon: Daemon) -> None:
    daemon = inline_daemon  # every batch quick enough to run where it was read, however loaded the machine
    code = batching_clients("", "client._lane_poller.max_s = 300e-6", 40,
                            'any(lane.bindings for lane in client._lanes), "no infer was bound"')
    tests = str(Path(__file__).parent)
    with polling(daemon.client()) as watcher:
        warm = watcher.session(batch_model(), max_batch=8)  # timed, and idle when the clients start
        for _ in range(3):
            warm.run(None, {"x": np.ones((1, 16), np.float32)})
        before = balanced(watcher)
        run_clients(code, [[daemon.endpoint, str(i), tests] for i in range(4)])
        after = balanced(watcher)
        [info] = [m for m in watcher.list_models() if m["batching"] and m["batching"]["max_batch"] == 8]
        status = watcher.status()
    stats = info["batching"]
    assert after["error"] == before["error"]
    assert after["ok"] - before["ok"] >= 4 * 2 * 40
    # every infer answered is counted finished, those of batches answered a pass after they
    # started too (the lanes' thread leaves a pass's last batch running): all within the window
    if status["uptime_s"] < 55:
        window = min(60.0, status["uptime_s"])
        assert status["jobs_per_s"] * window >= 4 * 2 * 40 - 0.5, status
    assert stats["requests"] >= 4 * 2 * 40 and stats["where_read"] >= 1
    assert stats["rows"] >= stats["requests"]


def refusals_drop_and_remake_bindings(client: Client, session: Any, path: Path, x: np.ndarray,
                                      want: list[np.ndarray], bindings: Any) -> Any:
    """With one binding made (``bindings()``: the client's): an input of the wrong dtype is refused
    at binding, as the infer would be; the model unloaded under its binding answers UnknownModel
    and the binding is dropped; loaded again, it is bound again and answers ``want``. Returns the
    new session."""
    with pytest.raises(E.InvalidTensor):
        session.run(None, {"x": x.astype(np.float64)})
    assert len(bindings()) == 1
    client.unload_model(next(m["id"] for m in client.list_models() if m["name"] == path.name))
    with pytest.raises(E.UnknownModel):
        session.run(None, {"x": x})
    assert not bindings()
    session = client.session(path)
    for g, w in zip(session.run(None, {"x": x}), want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert len(bindings()) == 1
    return session


def test_bad_bound_infers_are_answered_and_the_daemon_keeps_serving(daemon: Daemon) -> None:
    from vkpool.session import Session

    path = daemon.folder / "bad.onnx"
    path.write_bytes(mlp_model(8, 16, seed=12))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with polling(daemon.client()) as client, Session(str(path)) as local:
        before = balanced(client)
        session = client.session(path, keep_alive=0)
        want = local.run(None, {"x": x})
        session.run(None, {"x": x})
        [lane] = client._lanes
        client._lanes_idle.remove(lane)
        # a binding number the lane never made: a framed error, and the lane goes on
        lane.send_bound(999)
        frames = lane.receive_frames(10)
        from vkpool.daemon import protocol as P
        assert P.unpack(frames[0])["status"] == "error" and P.unpack(frames[1])["type"] == "InvalidRequest"
        client._lanes_idle.append(lane)
        for g, w in zip(session.run(None, {"x": x}), want, strict=True):
            np.testing.assert_array_equal(g, w)
        refusals_drop_and_remake_bindings(client, session, path, x, want, lambda: lane.bindings)
        after = balanced(client)
    # the unknown binding, the dtype, the unloaded model
    assert after["error"] - before["error"] == 3


def test_tensors_too_large_for_the_ring_travel_framed(daemon: Daemon) -> None:
    small_in, big_in = daemon.folder / "tile.onnx", daemon.folder / "add.onnx"
    times = RING_HALF // 32 + 100  # 8 float32 in, over the ring's half out
    small_in.write_bytes(tile_model(8, times))
    n = RING_HALF // 4 + 100
    big_in.write_bytes(add_model(n, 3.0))
    rng = np.random.default_rng(2)
    with polling(daemon.client()) as client:
        before = balanced(client)
        tile, add = client.session(small_in), client.session(big_in)
        for _ in range(3):
            x = rng.standard_normal((1, 8)).astype(np.float32)
            (y,) = tile.run(None, {"x": x})
            np.testing.assert_array_equal(y, np.tile(x, (1, times)))
            big = rng.standard_normal((1, n)).astype(np.float32)
            (z,) = add.run(None, {"x": big})
            np.testing.assert_array_equal(z, big + 3.0)
        [lane] = client._lanes
        assert lane.ring is not None and lane.ring.half == RING_HALF  # the daemon's lane_ring_bytes
        assert len(lane.bindings) == 1 and len(lane.unbound) == 1  # the tile bound; the add's input does not fit
        after = balanced(client)
    # the first status, two loads, open_lane, two binds (one answered "null"), 6 infers
    assert after["error"] == before["error"] and after["ok"] - before["ok"] == 1 + 2 + 1 + 2 + 6


def test_an_image_sized_input_travels_bound_in_a_ring_of_the_default_size() -> None:
    """The default ``lane_ring_bytes`` holds an image model's input (ResNet's 1 x 3 x 224 x 224
    float32, 588 KiB): it is bound and travels in the ring, not framed on the socket."""
    half = DaemonSettings().lane_ring_bytes
    n = 3 * 224 * 224
    assert 4 * n < half
    with short_folder("vkbr") as path:
        d = Daemon(path, daemon={"lane_poll": "0.2ms"})
        try:
            rng = np.random.default_rng(4)
            with polling(d.client()) as client:
                add = client.session(add_model(n, 1.5))
                for _ in range(3):
                    x = rng.standard_normal((1, n)).astype(np.float32)
                    (y,) = add.run(None, {"x": x})
                    np.testing.assert_array_equal(y, x + 1.5)
                [lane] = client._lanes
                assert lane.ring is not None and lane.ring.half == half
                assert len(lane.bindings) == 1 and not lane.unbound
                balanced(client)
        finally:
            assert d.stop() == 0


def test_bound_infers_are_queued_as_jobs_where_they_cannot_run_where_read() -> None:
    """``inline_run_max: 0``: no request runs on the lanes' thread, so every bound infer is queued
    as a job and answered framed by the model's workers."""
    with short_folder("vkbq") as path:
        d = Daemon(path, daemon={"lane_poll": "0.2ms", "inline_run_max": 0})
        try:
            rng = np.random.default_rng(3)
            with polling(d.client()) as client:
                fixed = client.session(mlp_model(8, 16, seed=13))
                batched = client.session(batch_model(graph="q"), max_batch=4)
                from vkpool.session import Session
                with Session(mlp_model(8, 16, seed=13)) as local:
                    for _ in range(10):
                        x = rng.standard_normal((1, 8)).astype(np.float32)
                        for g, w in zip(fixed.run(None, {"x": x}), local.run(None, {"x": x}), strict=True):
                            np.testing.assert_array_equal(g, w)
                        b = rng.standard_normal((2, 16)).astype(np.float32)
                        np.testing.assert_allclose(batched.run(None, {"x": b})[0], reference(b), rtol=1e-5, atol=1e-6)
                [lane] = client._lanes
                assert len(lane.bindings) == 2
                counters = balanced(client)
                [info] = [m for m in client.list_models() if m["batching"]]
                assert counters["error"] == 0 and info["batching"]["where_read"] == 0
                assert info["batching"]["requests"] == 10
                # with a queue delay, the first request (no batch answered before it) waits it out,
                # in the model's queue: the lanes' thread does not hold requests that it will not
                # run itself; after it, a lone client waits for no one
                delayed = client.session(batch_model(graph="qd"), max_batch=4, max_queue_delay=0.4)
                b = rng.standard_normal((1, 16)).astype(np.float32)
                started = time.monotonic()
                delayed.run(None, {"x": b})  # binds
                assert 0.35 <= time.monotonic() - started < 0.75
                for _ in range(2):
                    started = time.monotonic()
                    np.testing.assert_allclose(delayed.run(None, {"x": b})[0], reference(b), rtol=1e-5, atol=1e-6)
                    assert time.monotonic() - started < 0.35
        finally:
            assert d.stop() == 0


KILLED = """
import os, sys, threading, numpy as np
sys.path.insert(0, sys.argv[2])
from test_daemon_batching import batch_model
from vkpool.daemon.client import Client
client = Client(sys.argv[1])
client._lane_poller.max_s = 300e-6
session = client.session(batch_model(graph="k"), max_batch=4, keep_alive=0)
def work():
    while True:
        session.run(None, {"x": np.ones((2, 16), np.float32)})
for _ in range(3):
    threading.Thread(target=work, daemon=True).start()
print("running", flush=True)
threading.Event().wait()
"""


def test_a_client_killed_mid_bound_infer_leaves_the_daemon_serving(daemon: Daemon) -> None:
    with polling(daemon.client()) as watcher:
        proc = subprocess.Popen([sys.executable, "-c", KILLED, daemon.endpoint, str(Path(__file__).parent)],
                                env=daemon_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"running", proc.stderr.read()
            time.sleep(1.0)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        counters = balanced(watcher)
        assert counters["in_flight"] == 0
        session = watcher.session(batch_model(graph="k"), max_batch=4)
        x = np.ones((3, 16), np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-6)
        assert watcher._lanes and any(lane.bindings for lane in watcher._lanes)


@pytest.mark.parametrize("arrays", [
    [np.arange(6, dtype=np.float32).reshape(2, 3)],
    [np.array(1.5, np.float16), np.array([True, False]), np.arange(5, dtype=np.int64)],
    [np.zeros((0, 4), np.float32), np.arange(24, dtype=np.uint8).reshape(2, 3, 4)],
], ids=["one", "scalar-bool-int64", "empty"])
def test_a_record_reads_back_what_was_written(arrays: list[np.ndarray]) -> None:
    half = memoryview(bytearray(4096))
    daemon_side, client_side = Binding(None, {}, 1), ClientBinding(0, [])
    for k in range(2):  # the second time through the layouts both sides kept
        shifted = [np.asarray(a + k, a.dtype) if a.dtype != bool else a for a in arrays]
        assert daemon_side.fill(half, shifted)
        got = client_side.read(half)
        assert [g.dtype for g in got] == [a.dtype for a in shifted]
        for g, a in zip(got, shifted, strict=True):
            np.testing.assert_array_equal(g, a)
            assert g.flags.writeable and g.shape == a.shape
    _, _, size = record_layout(arrays)
    assert not Binding(None, {}, 1).fill(memoryview(bytearray(size - 1)), arrays)


def test_records_of_two_layouts_read_in_turn_and_a_broken_one_leaves_nothing_behind() -> None:
    """One client binding reads records of two layouts in turn (as threads sharing a binding over
    ZeroMQ may); a record that runs past its end is refused, and the next record of a layout
    read before is read right, not through the broken one's head."""
    a = [np.arange(6, dtype=np.float32).reshape(2, 3)]
    b = [np.arange(4, dtype=np.int64), np.ones(3, np.float16)]
    halves = {}
    for name, arrays in (("a", a), ("b", b)):
        halves[name] = memoryview(bytearray(4096))
        assert Binding(None, {}, 1).fill(halves[name], arrays)
    client_side = ClientBinding(0, [])
    for name in "abba":
        for got, want in zip(client_side.read(halves[name]), a if name == "a" else b, strict=True):
            np.testing.assert_array_equal(got, want)
    cut = halves["b"][:record_layout(b)[2] - 1]
    with pytest.raises(ConnectionResetError, match="runs past"):
        client_side.read(cut)
    for got, want in zip(client_side.read(halves["b"]), b, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_a_record_too_large_or_of_an_unnamed_dtype_is_not_written() -> None:
    half = memoryview(bytearray(256))
    binding = Binding(None, {}, 1)
    assert not binding.fill(half, [np.zeros(100, np.float32)])
    assert not binding.fill(half, [np.zeros(2, np.complex64)])
    assert bytes(half) == bytes(256)


@pytest.mark.parametrize("rows, want", [
    ([1] * 10, [8, 2]),
    ([3, 3, 3], [2, 1]),        # 6 rows in a variant of 8 wastes a quarter: runs; the third opens the next
    ([5, 4], [1, 1]),           # 9 rows: 5 alone, padded to 8 (no prefix fills a variant); then 4
    ([4, 1], [1, 1]),           # 5 rows in 8 would waste over a quarter: the 4 that fill a variant run first
    ([8, 8], [1, 1]),
    ([2, 2, 4, 1], [3, 1]),
])
def test_requests_read_together_split_into_batches_as_a_queue_would(rows: list[int], want: list[int]) -> None:
    runner = BatchRunner(lambda size: None, [("x", (1, 4), np.float32)], ["y"], max_batch=8)
    got = runner.batches(rows)
    assert got == want and sum(got) == len(rows)


SLOTS_CLIENT = """
import sys, threading, numpy as np
from vkpool.daemon.client import Client
endpoint, model, out, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
results = {}
with Client(endpoint) as client:
    client._lane_poller.max_s = 300e-6
    session = client.session(model)
    rng = np.random.default_rng(seed)
    for j in range(40):
        x = rng.standard_normal((1, 8)).astype(np.float32)
        results[f"x{j}"] = x
        for k, y in enumerate(session.run(None, {"x": x})):
            results[f"y{j}_{k}"] = y
    assert any(lane.bindings for lane in client._lanes), "no infer was bound"
np.savez(out, **results)
"""


def test_two_run_slots_answer_the_bound_infers_of_several_clients() -> None:
    """``run_slots: 2``: the lanes' thread runs a pass's infers of one model back to back on two
    run slots (the device runs one while the next one's inputs are written); every client gets its
    own outputs."""
    from vkpool.session import Session

    with short_folder("vkbs") as path:
        d = Daemon(path, daemon={"lane_poll": "0.2ms", "run_slots": 2})
        try:
            model = path / "m.onnx"
            model.write_bytes(mlp_model(8, 32, seed=14))
            run_clients(SLOTS_CLIENT, [[d.endpoint, str(model), str(path / f"c{i}.npz"), str(i)] for i in range(4)])
            with Session(str(model)) as local:
                for i in range(4):
                    data = np.load(path / f"c{i}.npz")
                    for j in range(40):
                        for k, want in enumerate(local.run(None, {"x": data[f"x{j}"]})):
                            np.testing.assert_array_equal(data[f"y{j}_{k}"], want)
            with polling(d.client()) as client:
                counters = balanced(client)
                assert counters["error"] == 0
        finally:
            assert d.stop() == 0


def test_a_poller_past_its_limit_still_polls_now_and_then() -> None:
    """A wait under the limit is polled for the limit, or twice the usual wait when longer. Waits
    that went long (the side slept, and each wake-up made them longer) would otherwise keep it
    asleep for good: every PROBE-th wait past the limit polls for the limit."""
    from vkpool.daemon.lane import PROBE, Poller

    poller = Poller(200e-6)
    # under the limit: for the limit, or twice the usual wait when that is longer
    assert poller.until(50e-6, 10.0) == pytest.approx(10.0 + 200e-6)
    assert poller.until(150e-6, 10.0) == pytest.approx(10.0 + 300e-6)
    looks = [poller.until(300e-6, 10.0) for _ in range(3 * PROBE)]
    assert [k for k, u in enumerate(looks) if u is not None] == [PROBE - 1, 2 * PROBE - 1, 3 * PROBE - 1]
    assert looks[PROBE - 1] == pytest.approx(10.0 + 200e-6)
    usual = 300e-6  # replies that come within the limit again bring the average back under it
    while usual >= poller.max_s:
        usual = poller.average(usual, 90e-6)
    assert poller.until(usual, 0.0) is not None
    assert all(Poller(0.0).until(u, 0.0) is None for u in (0.0, 1e-6, 1.0) for _ in range(PROBE))


def test_a_poller_dozes_through_long_waits_and_polls_at_their_end() -> None:
    """Waits of three times the limit or more are slept through until the limit before the usual
    earliest end, then polled for twice the limit past it; the estimate drops at once to a
    quicker wait and rises slowly to a slower one."""
    from vkpool.daemon.lane import Poller

    poller = Poller(200e-6)
    assert poller.doze(0.0, 10.0) is None and poller.doze(500e-6, 10.0) is None  # no estimate; short
    sleep_to, poll_to = poller.doze(1.5e-3, 10.0)
    assert sleep_to == pytest.approx(10.0 + 1.3e-3) and poll_to == pytest.approx(10.0 + 1.9e-3)
    assert Poller(0.0).doze(1.0, 0.0) is None  # a side that does not poll sleeps in recv
    earliest = poller.earliest(0.0, 2e-3)
    assert earliest == 2e-3 and poller.earliest(earliest, 1e-3) == 1e-3
    assert poller.earliest(1e-3, 11e-3) == pytest.approx(2e-3)  # an outlier moves it a tenth of the way


def test_a_client_dozing_on_a_ring_is_woken_by_a_reply_that_comes_early(daemon: Daemon, monkeypatch) -> None:
    """A client expecting a long wait sleeps through most of it marked asleep; a reply that comes
    sooner wakes it through the socket, as it would wake ``recv``, instead of waiting out the doze."""
    from vkpool.daemon import lane as lanes

    dozes: list[float] = []
    real = lanes.ring_doze

    def counted(words, which, seen, asleep, sock, until):  # noqa: ANN001 - the function's own types
        dozes.append(until - time.perf_counter())
        real(words, which, seen, asleep, sock, until)

    monkeypatch.setattr(lanes, "ring_doze", counted)
    path = daemon.folder / "doze.onnx"
    path.write_bytes(add_model(8, 0.5))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with polling(daemon.client()) as client:
        session = client.session(path)
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 0.5)
        [lane] = client._lanes
        assert lane.ring is not None
        # a reply already there when the client looks (this process was slow to look) needs no
        # doze: go on until three requests have dozed
        for k in range(30):
            # as if replies took 30 s: too long to poll through (the usual wait over the limit, and
            # not a PROBE-th look, which polls anyway), so the client dozes for nearly that long
            lane.reply_s, lane.earliest_s = 1.0, 30.0
            lane.poller._looks = 1
            started = time.perf_counter()
            (y,) = session.run(None, {"x": x + k})
            took = time.perf_counter() - started
            np.testing.assert_array_equal(y, x + k + 0.5)
            assert took < 10.0, f"the reply came after {took:.1f} s: it did not end the doze"
            if sum(d > 20.0 for d in dozes) == 3:
                break
        assert sum(d > 20.0 for d in dozes) == 3, dozes  # (the warm-up run may have dozed briefly)
        balanced(client)


def test_bound_infers_on_a_model_loaded_for_throughput_run_on_every_copy() -> None:
    """Loaded for throughput on lavapipe split in two members: a whole copy on each, in threads of
    the daemon, and the lanes' thread drives both (each infer of a pass on the next copy)."""
    from vkpool.session import Session

    split = "devices:\n  - match: {index: 0}\n    split: 2\n    budget: 128MiB\nhost:\n  enabled: false\n"
    with short_folder("vkbt") as path:
        d = Daemon(path, daemon={"lane_poll": "0.2ms"}, extra=split)
        try:
            model = path / "m.onnx"
            model.write_bytes(mlp_model(8, 32, seed=15))
            with polling(d.client()) as client:
                info = client.load_model(model, objective="throughput")
                assert sorted(info["members"]) == ["vk0.0", "vk0.1"], info
                run_clients(SLOTS_CLIENT, [[d.endpoint, str(model), str(path / f"t{i}.npz"), str(i)] for i in range(4)])
                counters = balanced(client)
                assert counters["error"] == 0
            with Session(str(model)) as local:
                for i in range(4):
                    data = np.load(path / f"t{i}.npz")
                    for j in range(40):
                        for k, want in enumerate(local.run(None, {"x": data[f"x{j}"]})):
                            np.testing.assert_allclose(data[f"y{j}_{k}"], want, rtol=1e-5, atol=1e-6)
        finally:
            assert d.stop() == 0


@pytest.mark.parametrize("transport", ["lane", "zmq"])
def test_a_daemon_that_does_not_know_bind_infer_gets_framed_infers(daemon: Daemon, monkeypatch,
                                                                    transport: str) -> None:
    """A client newer than its daemon: the daemon answers the bind ``UnknownRequest`` (here, by
    the request's type being one this daemon does not know), and the client sends those infers
    framed instead of failing them, on its lane or over ZeroMQ."""
    from vkpool.daemon import client as C

    from vkpool.session import Session

    packed_header = C.P.packed_header
    monkeypatch.setattr(C.P, "packed_header", lambda kind, rid, status=None: packed_header(
        "bind_infer_v9_request" if kind == "bind_infer_request" else kind, rid, status))
    path = daemon.folder / f"old-{transport}.onnx"
    path.write_bytes(mlp_model(8, 16, seed=16))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    client = polling(daemon.client()) if transport == "lane" else daemon.client(local_lane=False)
    with client, Session(str(path)) as local:
        runs_match(client.session(path), local, [x] * 3)
        if transport == "lane":
            [lane] = client._lanes
            assert lane.ring is not None and not lane.bindings and len(lane.unbound) == 1
        else:
            assert not client._lanes and not client._frame_bound and len(client._frame_unbound) == 1


def test_serve_on_a_cluster_refuses_run_slots_its_nodes_do_not_keep(tmp_path: Path, capsys) -> None:
    """The nodes of a cluster open their copies with their own run slots: a daemon configured with
    other run slots would not run what it says, so it does not start."""
    from vkpool.daemon.main import serve
    from vkpool.daemon.settings import DaemonSettings

    from vkpool.cluster.runtime import ClusterRuntime
    from vkpool.executor import RUN_SLOTS

    config = tmp_path / "vkpool.yaml"
    config.write_text(f"daemon: {{run_slots: {RUN_SLOTS + 1}}}\n")
    assert serve(config, f"ipc://{tmp_path}/d.sock", ClusterRuntime(None)) == 2
    assert f"daemon.run_slots is {RUN_SLOTS + 1}" in capsys.readouterr().err
    assert ClusterRuntime.refuses(DaemonSettings(run_slots=RUN_SLOTS)) is None  # the default


@pytest.fixture(scope="module")
def inline_daemon() -> Iterator[Daemon]:
    with short_folder("vkbi") as path:
        # every run quick enough to run where it was read, however loaded the machine
        d = Daemon(path, daemon={"lane_poll": "0.2ms", "inline_run_max": "1s"})
        yield d
        assert d.stop() == 0


def test_bound_infers_of_a_model_with_a_queue_delay_wait_for_company(inline_daemon: Daemon) -> None:
    """A batching model loaded with a queue delay: bound infers wait on the lanes' thread (which
    reads on meanwhile) for the clients of the batch answered last, at most the delay. Two
    clients that sent together run as one batch where they were read, each with its own rows; a
    lone client waits for no one; one whose company stopped sending waits the delay out."""
    import threading

    daemon = inline_daemon
    with polling(daemon.client()) as client, daemon.client() as other:
        polling(other)
        sessions = [c.session(batch_model(graph="company"), max_batch=4, max_queue_delay=0.3) for c in (client, other)]
        xs = [np.random.default_rng(3 + k).standard_normal((1 + k, 16)).astype(np.float32) for k in range(2)]

        def info() -> dict:
            [m] = [m for m in client.list_models() if m["batching"] and m["batching"]["max_batch"] == 4]
            return m["batching"]

        def together() -> dict:
            gate = threading.Barrier(2)
            got: dict[int, np.ndarray] = {}

            def send(k: int) -> None:
                gate.wait()
                got[k] = sessions[k].run(None, {"x": xs[k]})[0]

            threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for k in range(2):
                np.testing.assert_allclose(got[k], reference(xs[k]), rtol=1e-5, atol=1e-6)
            return info()

        first = together()  # binds; no batch was answered before: 3 rows wait the delay, together
        assert (first["batches"], first["requests"], first["rows"]) == (1, 2, 3), first
        after = together()  # each waits for the other, on the lanes' thread
        assert (after["batches"] - first["batches"], after["requests"] - first["requests"],
                after["rows"] - first["rows"], after["where_read"] - first["where_read"]) == (1, 2, 3, 1), after

        def timed() -> float:
            started = time.monotonic()
            np.testing.assert_allclose(sessions[0].run(None, {"x": xs[0]})[0], reference(xs[0]), rtol=1e-5, atol=1e-6)
            return time.monotonic() - started

        assert 0.25 <= timed() < 10.0  # the other client does not come: the delay bounds the wait
        before = info()
        assert timed() < 0.25  # the batch answered last was this client's alone: no one to wait for
        lone = info()
        assert (lone["batches"] - before["batches"], lone["where_read"] - before["where_read"]) == (1, 1)
        balanced(client)


def test_a_bound_infer_past_its_timeout_is_answered_timeout(inline_daemon: Daemon) -> None:
    """A bound infer whose run ends after its timeout is answered ``Timeout``, on a batching model
    (its batch answered together) and on a fixed one (answered as it ends); the same infer with
    room to run is answered with its outputs, and the counters balance."""
    from vkpool.session import Session

    fixed_model = mlp_model(8, 16, seed=21)
    with polling(inline_daemon.client()) as client, Session(fixed_model) as local:
        fixed = client.session(fixed_model)
        batched = client.session(batch_model(graph="late"), max_batch=4)
        x = np.random.default_rng(5).standard_normal((1, 8)).astype(np.float32)
        b = np.random.default_rng(6).standard_normal((2, 16)).astype(np.float32)
        for _ in range(3):  # timed, so that they run where read
            fixed.run(None, {"x": x})
            batched.run(None, {"x": b})
        before = balanced(client)
        for _ in range(2):  # bound on the first, then bound already
            with pytest.raises(E.Timeout):
                fixed.run(None, {"x": x}, timeout=1e-7)
            with pytest.raises(E.Timeout):
                batched.run(None, {"x": b}, timeout=1e-7)
        for g, w in zip(fixed.run(None, {"x": x}, timeout=30.0), local.run(None, {"x": x}), strict=True):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(batched.run(None, {"x": b}, timeout=30.0)[0], reference(b), rtol=1e-5, atol=1e-6)
        after = balanced(client)
        assert after["error"] - before["error"] == 4
        [lane] = client._lanes
        assert sum(key[2] == 1e-7 for key in lane.bindings) == 2, "the late infers were not bound"
