"""Dynamic batching in the daemon, on the real Vulkan device: requests of every client of a model
that arrive together run as one batch through the scheduler, with the same answers as unbatched
runs (rtol 1e-5), bad requests refused before they join, counters that balance, and a flood on a
batching model that does not starve another model."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import vkpool
from test_daemon_support import (InprocDaemon, assert_balanced, daemon_env, mlp_model, short_folder, spawn_daemon,
                                 wait_ready)
from vkpool.daemon import errors as E

pytestmark = pytest.mark.timeout(180)
RNG = np.random.default_rng(5)
W = RNG.standard_normal((16, 8)).astype(np.float32)


def batch_model(first: str | int = "N", graph: str = "b") -> bytes:
    """y = softmax(relu(x @ W)), x [first, 16]; ``graph`` names the graph (another name: another model)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, graph, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [first, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first, 8])],
                          [numpy_helper.from_array(W, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def reference(x: np.ndarray) -> np.ndarray:
    r = np.maximum(x.astype(np.float64) @ W, 0)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def in_threads(client: Any, count: int, timeout: float) -> None:
    """``client(i)`` for i in 0..count-1, each in a thread of its own, all at once."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


@pytest.fixture(scope="module")
def daemon() -> Iterator[InprocDaemon]:
    from vkpool.daemon.runtime import Runtime

    d = InprocDaemon(Runtime.from_config(None), batching=({"match": "auto-*", "max_batch": 4,
                                                          "max_queue_delay": 0.05},))
    yield d
    d.stop()


def test_clients_requests_run_together_and_match_unbatched_runs(daemon: InprocDaemon) -> None:
    with daemon.client() as admin:
        model = admin.load_model(batch_model(), name="together", max_batch=8, max_queue_delay=0.3, keep_alive=0)
        assert model["batching"]["max_batch"] == 8 and model["inputs"][0]["shape"] == ["batch", 16]
        xs = [RNG.standard_normal((rows, 16)).astype(np.float32) for rows in (1, 3, 1, 2, 1)]  # 8 rows
        results: dict[int, np.ndarray] = {}

        def client(i: int) -> None:
            with daemon.client() as c:
                s = c.session(batch_model(), max_batch=8, max_queue_delay=0.3)
                results[i] = s.run(None, {"x": xs[i]})[0]

        in_threads(client, len(xs), 60)
        assert sorted(results) == list(range(len(xs)))
        with vkpool.Session(batch_model(1), pool=daemon.runtime.pool) as single:
            for i, x in enumerate(xs):
                assert results[i].shape == (x.shape[0], 8)
                unbatched = np.concatenate([single.run(None, {"x": x[r:r + 1]})[0] for r in range(x.shape[0])])
                np.testing.assert_allclose(results[i], unbatched, rtol=1e-5)
                np.testing.assert_allclose(results[i], reference(x), rtol=1e-4, atol=1e-6)
        info = next(m for m in admin.status()["models"] if m["id"] == model["id"])["batching"]
        assert info["requests"] == 5 and info["batches"] < 5 and info["mean_batch_size"] > 1
        assert info["queue_delay_p99_us"] <= 0.3e6 + 5e6  # the delay plus, at most, a run
        assert_balanced(admin)
        admin.unload_model(model["id"])


def test_bad_requests_are_refused_before_they_join(daemon: InprocDaemon) -> None:
    with daemon.client() as c:
        s = c.session(batch_model(graph="bad"), name="bad", max_batch=4, max_queue_delay=0.2, keep_alive=0)
        good = RNG.standard_normal((2, 16)).astype(np.float32)
        with pytest.raises(E.InvalidTensor, match="1 to 4 rows"):
            s.run(None, {"x": np.zeros((5, 16), np.float32)})
        with pytest.raises(E.InvalidTensor):
            s.run(None, {"x": good.astype(np.float64)})
        with pytest.raises(E.InvalidTensor):
            s.run(None, {"x": good[:, :3]})
        np.testing.assert_allclose(s.run(None, {"x": good})[0], reference(good), rtol=1e-4, atol=1e-6)
        assert_balanced(c)
        s.close()


def test_load_options_are_checked_and_shared(daemon: InprocDaemon) -> None:
    with daemon.client() as c:
        with pytest.raises(E.DaemonError, match="no batch dimension"):
            c.load_model(batch_model(1), name="fixed", max_batch=4)
        with pytest.raises(E.DaemonError, match="max_batch must be an integer"):
            c.load_model(batch_model(graph="shared"), max_batch=0)
        with pytest.raises(E.DaemonError, match="needs max_batch"):
            c.request("load_model", {"max_queue_delay": 0.1}, [batch_model(graph="shared")])
        first = c.load_model(batch_model(graph="shared"), name="shared", max_batch=4, keep_alive=0)
        again = c.load_model(batch_model(graph="shared"), max_batch=4)  # the same settings: shared
        assert again["id"] == first["id"]
        with pytest.raises(E.DaemonError, match="share its batching"):
            c.load_model(batch_model(graph="shared"), max_batch=16)
        plain = c.load_model(batch_model(graph="shared"))  # no batching asked: shares the batching copy
        assert plain["id"] == first["id"] and plain["batching"]["max_batch"] == 4
        for _ in range(3):
            c.unload_model(first["id"])


def test_a_config_rule_batches_a_model_by_name(daemon: InprocDaemon) -> None:
    with daemon.client() as c:
        model = c.load_model(batch_model(graph="auto"), name="auto-classifier", keep_alive=0)
        assert model["batching"]["max_batch"] == 4 and model["batching"]["max_queue_delay"] == 0.05
        x = RNG.standard_normal((3, 16)).astype(np.float32)
        np.testing.assert_allclose(c.infer(model["id"], {"x": x})[0], reference(x), rtol=1e-4, atol=1e-6)
        c.unload_model(model["id"])


def test_a_flood_on_a_batching_model_does_not_starve_another(daemon: InprocDaemon) -> None:
    stop = threading.Event()
    flooded = [0]

    def flood() -> None:
        with daemon.client() as c:
            s = c.session(batch_model(graph="flood"), name="flooded", max_batch=4, max_queue_delay=0.01)
            x = RNG.standard_normal((1, 16)).astype(np.float32)
            while not stop.is_set():
                s.run(None, {"x": x})
                flooded[0] += 1

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with daemon.client() as c:
            other = c.session(mlp_model(), name="other", keep_alive=0)
            x = np.arange(8, dtype=np.float32).reshape(1, 8)
            for _ in range(5):
                y, _ = other.run(None, {"x": x})
                assert y.shape == (1, 8)
            other.close()
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert flooded[0] > 0


KILLED_CLIENT = """
import os, sys, time, numpy as np
from vkpool.daemon.client import Client, infer_content
c = Client(sys.argv[1])
model = c.load_model(bytes.fromhex(sys.argv[2]), name="k", max_batch=8, max_queue_delay=2.0)
futures = [c.submit("infer", *infer_content(model["id"], {"x": np.zeros((1, 16), np.float32)}, None, 0, None))
           for _ in range(3)]
time.sleep(0.5)
print("sent", sum(f.done() for f in futures), flush=True)
os._exit(0)
"""


def test_a_client_killed_while_its_requests_wait_in_a_batch() -> None:
    with short_folder("vkb") as folder:
        endpoint = f"ipc://{folder}/d.sock"
        proc = spawn_daemon(endpoint)
        try:
            wait_ready(endpoint, proc)
            out = subprocess.run([sys.executable, "-c", KILLED_CLIENT, endpoint, batch_model().hex()],
                                 env=daemon_env(), capture_output=True, timeout=60)
            assert out.returncode == 0 and b"sent 0" in out.stdout, out.stderr.decode()[-2000:]
            from vkpool.daemon.client import Client

            with Client(endpoint) as c:
                deadline = time.monotonic() + 20
                while True:  # the three jobs end: run and answered to nobody, or dropped with their client
                    model = c.status()["models"][0]
                    if model["queued"] + model["running"] == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert model["queued"] + model["running"] == 0, model
                counters = assert_balanced(c)
                assert counters["client_gone"] + counters["error"] >= 3, counters
                s = c.session(batch_model(), max_batch=8, max_queue_delay=2.0)
                x = RNG.standard_normal((2, 16)).astype(np.float32)
                t0 = time.monotonic()
                np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-4, atol=1e-6)
                assert time.monotonic() - t0 < 10
            # the same through the command line: load with batching, and status shows it
            path = folder / "cli.onnx"
            path.write_bytes(batch_model(graph="cli"))
            vkpool_cli = [sys.executable, "-m", "vkpool"]
            load = subprocess.run([*vkpool_cli, "load", str(path), "--max-batch", "4", "--max-delay", "200us",
                                   "--endpoint", endpoint], env=daemon_env(), capture_output=True, text=True, timeout=60)
            assert load.returncode == 0 and "batching up to 4 rows, delay 200 us" in load.stdout, load.stderr
            status = subprocess.run([*vkpool_cli, "status", "--endpoint", endpoint], env=daemon_env(),
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0 and "batching: max 4, delay 200 us" in status.stdout, status.stdout
            refused = subprocess.run([*vkpool_cli, "load", str(path), "--max-delay", "1ms", "--endpoint", endpoint],
                                     env=daemon_env(), capture_output=True, text=True, timeout=60)
            assert refused.returncode != 0 and "--max-delay needs --max-batch" in refused.stderr
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0


@pytest.mark.parametrize("inline_run_max,lane", [("1s", True), ("1s", False), ("0s", True)])
def test_batches_run_where_their_requests_were_read(inline_run_max: str, lane: bool) -> None:
    """Requests read together from several clients, over local lanes or ZeroMQ, form a batch that
    the thread that read them (the lanes', the I/O thread) runs itself, for a batching model whose
    batches take at most ``inline_run_max``, with the same answers as unbatched runs; with
    ``inline_run_max`` 0 every batch goes to the model's workers."""
    from test_daemon_e2e import Daemon

    with short_folder("vkb") as folder:
        daemon = Daemon(folder, daemon={"inline_run_max": inline_run_max})
        try:
            xs = [[RNG.standard_normal((1 + (i + k) % 2, 16)).astype(np.float32) for k in range(12)]
                  for i in range(4)]
            results: dict[int, list[np.ndarray]] = {}
            with daemon.client(local_lane=lane) as admin:
                assert admin.local_lane == lane
                model = admin.load_model(batch_model(graph="read"), name="read", max_batch=8, keep_alive=0)
                start = threading.Barrier(len(xs))

                def client(i: int) -> None:
                    with daemon.client(local_lane=lane) as c:
                        s = c.session(batch_model(graph="read"))
                        s.run(None, {"x": xs[i][0]})
                        start.wait(30)
                        results[i] = [s.run(None, {"x": x})[0] for x in xs[i]]

                in_threads(client, len(xs), 120)
                assert sorted(results) == list(range(len(xs)))
                with vkpool.Session(batch_model(1, graph="read")) as single:
                    for i, got_i in results.items():
                        for x, got in zip(xs[i], got_i):
                            unbatched = np.concatenate([single.run(None, {"x": x[r:r + 1]})[0]
                                                        for r in range(x.shape[0])])
                            np.testing.assert_allclose(got, unbatched, rtol=1e-5)
                info = next(m for m in admin.status()["models"] if m["id"] == model["id"])["batching"]
                assert info["requests"] == 4 * 13
                if inline_run_max == "0s":
                    assert info["where_read"] == 0, info
                else:  # most: not the first ones, whose run time was not known yet, nor those a worker
                    # took as it came back from one of them
                    assert 2 * info["where_read"] >= info["batches"] and info["mean_batch_size"] > 1, info

                # clients that each send again once answered: a batch waits for all of them, not
                # for its whole delay (0.5 s), after the first, which knows of no company yet
                company = admin.load_model(batch_model(graph="company"), name="company", max_batch=8,
                                           max_queue_delay=0.5, keep_alive=0)
                start = threading.Barrier(len(xs))
                took: dict[int, float] = {}

                def sender(i: int) -> None:
                    with daemon.client(local_lane=lane) as c:
                        s = c.session(batch_model(graph="company"))
                        start.wait(30)
                        s.run(None, {"x": xs[i][0]})
                        t0 = time.monotonic()
                        for x in xs[i][1:3]:
                            s.run(None, {"x": x})
                        took[i] = time.monotonic() - t0

                in_threads(sender, len(xs), 120)
                info = next(m for m in admin.status()["models"] if m["id"] == company["id"])["batching"]
                assert info["batches"] == 3 and info["requests"] == 3 * len(xs), info
                assert max(took.values()) < 0.45, took
                assert_balanced(admin)
        finally:
            assert daemon.stop() == 0
