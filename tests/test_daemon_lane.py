"""The local lane: a real ``vkpool serve`` subprocess (lavapipe, or the stand-in runtime where a job
must be slow on purpose), real client processes, jobs on the daemon's Unix stream socket."""
from __future__ import annotations

import ast
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from test_daemon_e2e import Daemon, run_clients
from test_daemon_support import add_model, daemon_env, mlp_model, short_folder
from vkpool.daemon import errors as E
from vkpool.daemon import protocol as P
from vkpool.daemon.client import Client
from vkpool.daemon.lane import _CLIENT_ASLEEP, _REP, LaneConnection, Ring

pytestmark = pytest.mark.timeout(180)
X = np.arange(8, dtype=np.float32).reshape(1, 8)
#: each half of the shared daemon's rings (``daemon.lane_ring_bytes``): a tensor over it stays small
RING_HALF = 256 << 10


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_folder("vkl") as path:
        yield path


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    with short_folder("vkl") as path:
        # both sides poll for messages here whatever the machine's CPUs (the default on 4 or more)
        daemon = Daemon(path, daemon={"max_frames": 16, "max_message_bytes": "1MiB", "lane_poll": "0.2ms",
                                      "zmq_poll": "0.4ms", "lane_ring_bytes": RING_HALF})
        yield daemon
        assert daemon.stop() == 0


def balanced(client: Client) -> dict[str, int]:
    c = client.status()["counters"]
    assert c["accepted"] == c["ok"] + c["error"] + c["client_gone"] + c["in_flight"], c
    return c


def settled(client: Client, timeout: float = 10.0) -> dict[str, int]:
    """Counters once nothing is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        c = balanced(client)
        if c["in_flight"] == 0 or time.monotonic() > deadline:
            return c
        time.sleep(0.05)


class RawLane:
    """A lane connection spoken to byte by byte, on behalf of ``client`` (its ZeroMQ identity)."""

    def __init__(self, client: Client, *, token: str | None = None, open_lane: bool = True) -> None:
        offer = client.info["local_lane"]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(offer["path"])
        self.reader = P.LaneReader(self.sock)
        if open_lane:
            header, content, _ = self.request("open_lane", "open", {"client": client._routing_id.hex(),
                                                                   "token": token or offer["token"]})
            self.opened = header["status"] == "ok"

    def send(self, parts: list[Any]) -> None:
        P.lane_send(self.sock, parts)

    def reply(self) -> tuple[dict[str, Any], dict[str, Any], list[memoryview]]:
        parts = self.reader.read()
        assert parts is not None, "the daemon closed the lane instead of answering"
        return P.unpack(parts[0]), P.unpack(parts[1]), parts[2:]

    def request(self, action: str, rid: str, content: dict[str, Any], frames: list[Any] = ()
                ) -> tuple[dict[str, Any], dict[str, Any], list[memoryview]]:
        self.send([P.pack(P.request_header(action, rid)), P.pack(content), *frames])
        return self.reply()

    def closed_by_daemon(self) -> bool:
        try:
            return self.reader.read() is None
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


POLLING_JOBS = """
import os, sys, threading, numpy as np
os.environ["VKPOOL_LANE_POLL_US"] = "300"
os.environ["VKPOOL_ZMQ_POLL_US"] = "400"
from vkpool.daemon import errors as E
from vkpool.daemon.client import Client
transport, endpoint, out, seed, jobs, threads, *models = sys.argv[1:]
results = {}
def work(t):
    rng = np.random.default_rng(int(seed) * 100 + t)
    sessions = [client.session(m) for m in models]
    for j in range(int(jobs)):
        s = sessions[j % len(sessions)]
        x = rng.standard_normal(s.get_inputs()[0].shape).astype(np.float32)
        results[f"x{t}_{j}"] = x
        for k, y in enumerate(s.run(None, {"x": x})):
            assert y.flags.writeable
            results[f"y{t}_{j}_{k}"] = y
        if j % 20 == 7:  # an error reply among them, raised as its class
            try:
                s.run(None, {"x": x[:, :-1]})
            except E.InvalidTensor as exc:
                assert "x" in str(exc), exc
            else:
                raise AssertionError("a mis-shaped input was run")
with Client(endpoint, local_lane=transport == "lane") as client:
    assert client.local_lane == (transport == "lane"), client.info
    assert abs(client._lane_poller.max_s - 300e-6) < 1e-12 and abs(client._spin.max_s - 400e-6) < 1e-12
    pool = [threading.Thread(target=work, args=(t,)) for t in range(int(threads))]
    for p in pool: p.start()
    for p in pool: p.join()
    if transport == "lane":
        assert len(client._lanes) >= 1, "no job went on the lane"
        assert client.status()["counters"]["lanes"] >= 1
    else:
        assert not client._lanes
np.savez(out, **results)
"""


@pytest.mark.parametrize("transport", ["lane", "zmq"])
def test_jobs_from_several_processes_and_threads_match_in_process_runs_with_both_sides_polling(
        shared: Daemon, transport: str) -> None:
    """On either transport, with the client and the daemon polling for messages instead of
    sleeping (the default on machines of 4 CPUs or more)."""
    from vkpool.session import Session

    models = [shared.folder / "a.onnx", shared.folder / "b.onnx"]
    models[0].write_bytes(mlp_model(8, 16, seed=1))
    models[1].write_bytes(mlp_model(16, 32, seed=2))
    jobs, threads = 60, [1, 3, 2]
    with shared.client() as watcher:
        before = watcher.status()["counters"]
        run_clients(POLLING_JOBS, [[transport, shared.endpoint, str(shared.folder / f"{transport}{i}.npz"), str(i),
                                    str(jobs), str(n), *map(str, models)] for i, n in enumerate(threads)])
        after = settled(watcher)
    assert after["ok"] - before["ok"] >= sum(threads) * jobs
    assert after["lanes"] == 0  # the clients' lanes closed with them
    sessions = [Session(str(m)) for m in models]
    try:
        for i, n in enumerate(threads):
            data = np.load(shared.folder / f"{transport}{i}.npz")
            for t in range(n):
                for j in range(jobs):
                    want = sessions[j % 2].run(None, {"x": data[f"x{t}_{j}"]})
                    for k, w in enumerate(want):
                        np.testing.assert_array_equal(data[f"y{t}_{j}_{k}"], w)
    finally:
        for s in sessions:
            s.close()


def test_the_ring_carries_small_jobs_the_socket_large_ones_and_wakes_a_sleeping_side(shared: Daemon) -> None:
    """A client that polls gets a ring (the shared daemon polls too): small requests and replies
    travel in shared memory, one over the ring's half on the socket; pauses between jobs let the
    daemon's lane thread fall asleep, so the wake-up on the socket is needed, and a job slower
    than the client's polling makes the client sleep and be woken."""
    small, large = shared.folder / "ring_small.onnx", shared.folder / "ring_large.onnx"
    small.write_bytes(mlp_model(8, 16, seed=3))
    n = RING_HALF // 4 + 1000  # float32 input and output each over the ring's half
    large.write_bytes(add_model(n, 2.0))
    with shared.client() as client:
        before = settled(client)
        client._lane_poller.max_s = 300e-6  # this process's default on 2 CPUs: no polling, so no ring
        s_small, s_large = client.session(small), client.session(large)
        x = np.arange(8, dtype=np.float32).reshape(1, 8)
        want = s_small.run(None, {"x": x})
        [lane] = client._lanes
        assert lane.ring is not None, "the daemon granted no ring"
        ring_before = lane.ring.words[0]
        rng = np.random.default_rng(0)
        for j in range(60):
            if j % 10 == 9:
                time.sleep(0.02)  # the daemon's lane thread sleeps in recv: the next request wakes it
            xs = rng.standard_normal((1, 8)).astype(np.float32)
            got = s_small.run(None, {"x": xs})
            ref = s_small.run(None, {"x": x})
            for a, b in zip(ref, want):
                np.testing.assert_array_equal(a, b)
            assert all(g.flags.writeable for g in got)
            if j % 20 == 0:
                big = rng.standard_normal((1, n)).astype(np.float32)
                (y,) = s_large.run(None, {"x": big})
                np.testing.assert_array_equal(y, big + 2.0)
        assert lane.ring.words[0] - ring_before == 120  # every small request went in the ring
        assert [lane] == list(client._lanes)  # one lane throughout
        after = settled(client)
        assert after["error"] == before["error"] and after["ok"] - before["ok"] >= 123


def _infer_parts(rid: str, model: str, metas: list[dict[str, Any]], frames: list[Any]) -> list[Any]:
    return [P.pack(P.request_header("infer", rid)), P.pack({"model": model, "inputs": metas}), *frames]


def test_bad_input_on_the_lane_is_answered_or_closes_the_lane_and_the_daemon_keeps_serving(shared: Daemon) -> None:
    from vkpool.session import Session

    path = shared.folder / "bad.onnx"
    path.write_bytes(mlp_model(8, 16, seed=3))
    with shared.client() as client:
        model = client.load_model(path)["id"]
        before = settled(client)
        metas, frames = P.tensor_frames([("x", X)])

        # open_lane must come first, with this client's token
        stranger = RawLane(client, token="0" * 64)
        assert not stranger.opened and stranger.closed_by_daemon()
        first = RawLane(client, open_lane=False)
        header, content, _ = first.request("infer", "early", {"model": model, "inputs": metas}, frames)
        assert content["type"] == "InvalidRequest" and "open_lane" in content["message"]
        assert first.closed_by_daemon()

        lane = RawLane(client)
        assert lane.opened
        cases = [
            ([P.pack({"v": 1, "id": "d", "type": "infer_request"}),
              P.pack({"model": model, "inputs": [{"name": "x", "dtype": "float64", "shape": [1, 8]}]}), b"\0" * 64],
             "InvalidTensor"),
            ([P.pack({"v": 1, "id": "s", "type": "infer_request"}),
              P.pack({"model": model, "inputs": [{"name": "x", "dtype": "float32", "shape": [8, 1]}]}), b"\0" * 32],
             "InvalidTensor"),
            (_infer_parts("f", model, metas, [*frames, b"\0" * 32]), "InvalidTensor"),  # frame count
            (_infer_parts("b", model, metas, [b"\0" * 31]), "InvalidTensor"),           # byte count
            ([b"\xc1\xc1", P.pack({})], "ProtocolError"),                               # not msgpack
            ([P.pack({"v": 9, "id": "v", "type": "infer_request"}), P.pack({})], "VersionMismatch"),
            ([P.pack({"v": 1, "id": "u", "type": "format_disk_request"}), P.pack({})], "UnknownRequest"),
            ([P.pack({"v": 1, "id": "m", "type": "infer_request"}), P.pack({"inputs": []})], "InvalidRequest"),
            ([P.pack({"v": 1, "id": "t", "type": "status_request"}), P.pack({})], "InvalidRequest"),  # zmq only
            ([P.pack({"v": 1, "id": "o", "type": "open_lane_request"}),
              P.pack({"client": "00", "token": "00"})], "InvalidRequest"),                 # opened already
            (_infer_parts("k", "f" * 64, metas, frames), "UnknownModel"),
        ]
        for parts, error in cases:
            lane.send(parts)
            header, content, _ = lane.reply()
            assert header["status"] == "error" and content["type"] == error, (parts[:2], content)

        # after all that, the same lane runs jobs; the second is checked only against its frames
        with Session(str(path)) as local:
            for i in range(3):
                x = X * (i + 1)
                m, f = P.tensor_frames([("x", x)])
                header, content, out = lane.request("infer", f"good-{i}", {"model": model, "inputs": m}, f)
                assert header == {"v": 1, "id": f"good-{i}", "type": "infer_reply", "status": "ok"}, content
                got = P.decode_tensors(content["outputs"], out, "outputs")
                for name, want in zip(("y", "z"), local.run(None, {"x": x})):
                    np.testing.assert_array_equal(got[name], want)
            # a cached plan still checks the frames: a short frame is refused, not read past
            lane.send(_infer_parts("short", model, m, [bytes(f[0])[:-4]]))
            assert lane.reply()[1]["type"] == "InvalidTensor"

        # a retried id is answered from the replay window, not run again
        done = next(m["done"] for m in client.list_models() if m["id"] == model)
        header, content, again = lane.request("infer", "good-2", {"model": model, "inputs": m}, f)
        assert header["status"] == "ok" and bytes(again[0]) == bytes(out[0])
        assert next(m["done"] for m in client.list_models() if m["id"] == model) == done
        # a job run at once is counted (accepted and ok) before its reply is written: in flight,
        # only the status request itself
        assert client.status()["counters"]["in_flight"] == 0
        # a header packed with its keys in another order takes the general path: the same answer
        lane.send([P.pack({"type": "infer_request", "id": "odd", "v": 1}), P.pack({"model": model, "inputs": m}), *f])
        header, content, again = lane.reply()
        assert header["id"] == "odd" and header["status"] == "ok" and bytes(again[0]) == bytes(out[0])

        # broken framing: answered when the request id can be read, then the lane is closed
        lane.send([P.pack(P.request_header("infer", "many")), P.pack({}), *[b""] * 20])  # max_frames 16
        header, content, _ = lane.reply()
        assert content["type"] == "MessageTooLarge" and header["id"] is None
        assert lane.closed_by_daemon()
        big = RawLane(client)
        try:  # the daemon reads the header, answers and closes: the rest may not go out
            big.send(_infer_parts("big", model, metas, [b"\0" * (2 << 20)]))  # max_message_bytes 1MiB
        except OSError:
            pass
        header, content, _ = big.reply()
        assert content["type"] == "MessageTooLarge" and header["id"] == "big"
        assert big.closed_by_daemon()
        one = RawLane(client)
        one.sock.sendall(P._lane_head(1).pack(1, 3) + b"abc")
        assert one.reply()[1]["type"] == "ProtocolError" and one.closed_by_daemon()
        cut = RawLane(client)
        cut.sock.sendall(P._lane_head(2).pack(2, 100, 100) + b"x" * 50)  # then the client leaves
        cut.close()
        for raw in (stranger, first, lane, big, one):
            raw.close()

        deadline = time.monotonic() + 10
        while client.status()["counters"]["dropped"] <= before["dropped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = settled(client)
        assert after["dropped"] == before["dropped"] + 1  # the message cut short
        assert after["retries"] == before["retries"] + 1
        assert after["lanes"] == 0
        # the cases, and: a stranger's open_lane, an infer before open_lane, the short frame, 3 framings
        assert after["error"] - before["error"] == len(cases) + 6
        np.testing.assert_array_equal(client.session(path).run(None, {"x": X})[0],
                                      Session(str(path)).run(None, {"x": X})[0])
        assert client.local_lane


KILLED_ON_THE_LANE = """
import sys, threading, numpy as np
from vkpool.daemon.client import Client
client = Client(sys.argv[1])
assert client.local_lane
session = client.session(sys.argv[2], keep_alive=0)
def work():
    while True:
        session.run(None, {"x": np.ones((1, 8), np.float32)})
for _ in range(int(sys.argv[3])):
    threading.Thread(target=work, daemon=True).start()
threading.Event().wait()
"""


@pytest.mark.parametrize("stand_in, threads", [("delay_s=1", 3), (None, 6)])
def test_a_client_killed_mid_job_on_the_lane_leaves_the_daemon_serving(folder: Path, stand_in: str | None,
                                                                       threads: int) -> None:
    """Stand-in: each job takes 1 s on one worker, so the kill finds one running and the others
    queued behind it, all on lanes. Lavapipe: six threads running jobs back to back."""
    daemon = Daemon(folder, stand_in=stand_in, daemon={"workers_per_model": 1})
    path = folder / "m.onnx"
    path.write_bytes(mlp_model(8, 24, seed=5))
    try:
        with daemon.client() as watcher:
            used = {m["id"]: m["used_bytes"] for m in watcher.devices()}
            before = settled(watcher)
            proc = subprocess.Popen([sys.executable, "-c", KILLED_ON_THE_LANE, daemon.endpoint, str(path),
                                     str(threads)], env=daemon_env())
            deadline = time.monotonic() + 60
            while True:  # wait until jobs are in flight on lanes: then kill
                c = watcher.status()["counters"]
                if c["lanes"] >= 1 and c["in_flight"] >= threads:
                    break
                assert time.monotonic() < deadline and proc.poll() is None, c
                time.sleep(0.02)
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # its jobs answered (undeliverable), its model freed
                status = watcher.status()
                if (status["counters"]["in_flight"] == 0 and not status["models"]
                        and {m["id"]: m["used_bytes"] for m in watcher.devices()} == used):
                    break
                time.sleep(0.05)
            c = balanced(watcher)
            assert c["in_flight"] == 0 and c["lanes"] == 0, c
            # the running job may end, and its reply be read, between the status reply above and the
            # kill; a second cannot (1 s each): every other job in flight is a reply nobody reads
            assert c["client_gone"] - before["client_gone"] >= (threads - 1 if stand_in else 0), c
            assert not watcher.list_models()
            assert {m["id"]: m["used_bytes"] for m in watcher.devices()} == used
            session = watcher.session(path)
            assert session.run(None, {"x": X})[0].shape == (1, 8)
            assert watcher.local_lane and len(watcher._lanes) == 1
    finally:
        assert daemon.stop() == 0


FALLBACK = """
import sys, numpy as np
from vkpool.daemon.client import Client
with Client(sys.argv[1]) as client:
    session = client.session(sys.argv[2])
    y = session.run(None, {"x": np.ones((1, 8), np.float32)})[0]
    print(client.local_lane, len(client._lanes), float(y.sum()), flush=True)
"""


def test_zmq_carries_the_jobs_when_the_lane_is_off_refused_or_not_offered(folder: Path) -> None:
    from vkpool.session import Session

    path = folder / "m.onnx"
    path.write_bytes(mlp_model())
    with Session(str(path)) as local:
        want = float(local.run(None, {"x": np.ones((1, 8), np.float32)})[0].sum())
        expected = local.run(None, {"x": X})
    daemon = Daemon(folder, daemon={"max_lane_connections": 1})
    try:
        with daemon.client(local_lane=False) as off, daemon.client() as first, daemon.client() as second:
            assert not off.local_lane and off.info["local_lane"] is not None
            for client in (off, first, second):
                # one lane is the daemon's cap: the second client is refused and stays on ZeroMQ
                for got, w in zip(client.session(path).run(None, {"x": X}), expected):
                    np.testing.assert_array_equal(got, w)
            assert len(off._lanes) == 0 and len(first._lanes) == 1
            assert len(second._lanes) == 0 and second.local_lane
            c = settled(second)
            assert c["lanes"] == 1
        env = dict(daemon_env(), VKPOOL_LOCAL_LANE="0")
        done = subprocess.run([sys.executable, "-c", FALLBACK, daemon.endpoint, str(path)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lane, lanes, total = done.stdout.split()
        assert (lane, lanes) == ("False", "0") and float(total) == pytest.approx(want)
    finally:
        assert daemon.stop() == 0
    daemon = Daemon(folder, daemon={"max_lane_connections": 0})
    try:
        assert not (folder / "d.sock.lane").exists()
        done = subprocess.run([sys.executable, "-c", FALLBACK, daemon.endpoint, str(path)], env=daemon_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lane, lanes, total = done.stdout.split()
        assert (lane, lanes) == ("False", "0") and float(total) == pytest.approx(want)
        with daemon.client() as client:
            assert client.info["local_lane"] is None
    finally:
        assert daemon.stop() == 0


def test_the_lane_socket_is_0600_beside_the_ipc_socket_and_removed_at_stop_or_when_stale(folder: Path) -> None:
    lane = folder / "d.sock.lane"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(lane))  # left by a crashed daemon: nobody listens
    stale.close()
    daemon = Daemon(folder, stand_in="")
    try:
        assert stat.S_ISSOCK(lane.stat().st_mode) and stat.S_IMODE(lane.stat().st_mode) == 0o600
        with daemon.client() as client:
            assert client.info["local_lane"]["path"] == str(lane)
            session = client.session(add_model())
            assert session.run(None, {"x": np.ones((1, 4), np.float32)})[0].sum() == 8
            assert len(client._lanes) == 1
    finally:
        assert daemon.stop() == 0
    assert not lane.exists() and not (folder / "d.sock").exists()


def test_cancel_and_timeout_reach_jobs_on_the_lane(folder: Path) -> None:
    """A lane job queued behind a slow one is cancelled over ZeroMQ by its request id, another
    one times out: each is answered on its lane."""
    daemon = Daemon(folder, stand_in="delay_s=1.0", daemon={"workers_per_model": 1})
    try:
        with daemon.client() as client, daemon.client() as watcher:
            session = client.session(add_model())
            taken: list[int] = []
            counter = client._ids

            class Spy:  # notes the request ids the client hands out
                def __next__(self) -> int:
                    taken.append(next(counter))
                    return taken[-1]
            client._ids = Spy()  # type: ignore[assignment]
            outcomes: dict[str, Any] = {}
            threads: list[threading.Thread] = []

            def run(name: str, **kwargs: Any) -> None:
                try:
                    outcomes[name] = float(session.run(None, {"x": np.ones((1, 4), np.float32)}, **kwargs)[0].sum())
                except E.DaemonError as exc:
                    outcomes[name] = exc.type

            def start(name: str, **kwargs: Any) -> str:
                seen, busy = len(taken), watcher.status()["counters"]["in_flight"]
                threads.append(threading.Thread(target=run, args=(name,), kwargs=kwargs))
                threads[-1].start()
                deadline = time.monotonic() + 10
                while watcher.status()["counters"]["in_flight"] <= busy:  # accepted
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                return f"{client._prefix}-{taken[seen]}"
            start("first")
            queued = start("cancelled")
            assert client.cancel(queued) == {"cancelled": True, "state": "queued"}
            threads[-1].join(10)  # its reply came on its lane, which went back to the client
            assert outcomes.get("cancelled") == "Cancelled", outcomes
            start("timed", timeout=0.2)
            for t in threads:
                t.join(30)
            assert outcomes == {"first": 8.0, "cancelled": "Cancelled", "timed": "Timeout"}, outcomes
            assert len(client._lanes) == 2  # the cancelled job's lane was free again for the timed one
            c = settled(watcher)
            assert c["client_gone"] == 0
    finally:
        assert daemon.stop() == 0


DRAIN_ON_THE_LANE = """
import sys, threading, time, numpy as np
from vkpool.daemon.client import Client
from vkpool.daemon.errors import DaemonError, DaemonUnavailable
client = Client(sys.argv[1])
session = client.session(sys.argv[2])
outcomes, lock, stop = {}, threading.Lock(), threading.Event()
def work():
    while not stop.is_set():
        try:
            session.run(None, {"x": np.ones((1, 8), np.float32)}); key = "ok"
        except DaemonError as exc:
            key = exc.type
        except DaemonUnavailable:
            key = "unavailable"  # the lane closed before the job was accepted
        with lock:
            outcomes[key] = outcomes.get(key, 0) + 1
        if key != "ok":
            return
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
time.sleep(1.0)
print("running", flush=True)
for t in threads: t.join(60)
print(outcomes, flush=True)
"""


def test_sigterm_answers_every_accepted_lane_job_before_exit(folder: Path) -> None:
    path = folder / "m.onnx"
    path.write_bytes(mlp_model())
    daemon = Daemon(folder, stand_in="delay_s=0.05", daemon={"workers_per_model": 1, "drain_deadline": 30})
    proc = subprocess.Popen([sys.executable, "-c", DRAIN_ON_THE_LANE, daemon.endpoint, str(path)],
                            env=daemon_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "running"
    daemon.proc.send_signal(signal.SIGTERM)
    outcomes = ast.literal_eval(proc.stdout.readline())
    assert proc.wait(60) == 0
    assert daemon.proc.wait(60) == 0
    log = daemon.proc.stderr.read().decode()
    final = ast.literal_eval(log.split("stopped: ", 1)[1].splitlines()[0])
    # every request the daemon accepted was answered before it exited, lane jobs included
    assert final["accepted"] == final["ok"] + final["error"] + final["client_gone"], final
    assert final["in_flight"] == 0 and final["client_gone"] == 0, final
    assert outcomes.get("ok", 0) > 6 and set(outcomes) <= {"ok", "ShuttingDown", "unavailable"}, outcomes
    assert not (folder / "d.sock.lane").exists()


def test_the_bench_reports_both_transports(folder: Path) -> None:
    path = folder / "m.onnx"
    path.write_bytes(mlp_model())
    out = folder / "bench.json"
    done = subprocess.run([sys.executable, "-m", "vkpool.daemon.bench", str(path), "--runs", "60", "--seconds",
                           "0.3", "--clients", "1", "--out", str(out)], env=daemon_env(), capture_output=True,
                          text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    entry = report["models"]["m"]
    assert report["transports"] == ["zmq", "lane"]
    for transport in ("zmq", "lane"):
        assert entry[transport]["runs"] == 60 and entry[transport]["median_us"] > 0
        assert entry["added_us"][transport] == pytest.approx(
            entry[transport]["median_us"] - entry["in_process"]["median_us"], abs=0.2)
        assert entry["jobs_per_s"][transport]["1"] > 0
        figures = entry["throughput"][transport]["1"]
        assert figures["daemon_cpu"] > 0 and figures["clients_cpu"] > 0  # cores busy while the clients ran
    assert "| local lane |" in done.stdout and "added, ZeroMQ" in done.stdout


def test_the_round_trip_benches_split_a_bound_infer(folder: Path) -> None:
    """bench.round_trip_split and bench.daemon_own_time on lavapipe, polling on so that the lane
    has a ring: every part of the round trip is measured, over the lane and ZeroMQ."""
    path = folder / "m.onnx"
    path.write_bytes(mlp_model())
    config = folder / "poll.yaml"
    config.write_text("daemon: {lane_poll: 0.0001}\n")
    env = {**daemon_env(), "VKPOOL_LANE_POLL_US": "200"}
    split = subprocess.run([sys.executable, "-m", "bench.round_trip_split", str(path), "--runs", "100", "--config",
                            str(config)], env=env, capture_output=True, text=True, timeout=170)
    assert split.returncode == 0, split.stderr[-3000:]
    rows = {line.split("|")[2].strip(): line for line in split.stdout.splitlines() if line.startswith("| m |")}
    assert set(rows) == {"lane", "zmq"}, split.stdout
    for row in rows.values():
        figures = [float(v) for v in row.strip().strip("|").split("|")[2:]]
        assert len(figures) == 8 and all(v > 0 for v in figures[:4]), row  # run, before, waiting, after
    own = subprocess.run([sys.executable, "-m", "bench.daemon_own_time", str(path), "--runs", "100", "--config",
                          str(config), "--stub-run"], env=env, capture_output=True, text=True, timeout=170)
    assert own.returncode == 0, own.stderr[-3000:]
    row = next(line for line in own.stdout.splitlines() if line.startswith("| m (run stubbed) |"))
    figures = [float(v) for v in row.strip().strip("|").split("|")[1:]]
    assert len(figures) == 9 and figures[2] > 0 and figures[8] > 0, row  # the pass, the client's round trip
    assert "went to sleep" in own.stdout and "threads of the daemon's process" in own.stdout


def test_the_zmq_timeline_bench_measures_every_leg(folder: Path) -> None:
    """bench.zmq_timeline on lavapipe, the run stubbed: each leg of a ZeroMQ round trip is
    measured from both processes' clocks, and the legs add up to the round trip."""
    path = folder / "m.onnx"
    path.write_bytes(mlp_model())
    env = {**daemon_env(), "VKPOOL_ZMQ_POLL_US": "400"}
    command = [sys.executable, "-m", "bench.zmq_timeline", str(path), "--runs", "150", "--stub-run"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    matched = next(line for line in done.stdout.splitlines() if "infers matched" in line)
    assert int(matched.split(":")[1].split()[0]) > 0, done.stdout
    cells = done.stdout.strip().splitlines()[-1].strip("|").split("|")
    assert len(cells) == 12 and cells[2].strip() == "-", done.stdout  # stubbed: no added time
    figures = [float(v) if v.strip() != "-" else 0.0 for v in cells]
    legs = figures[3:11]
    assert all(v >= 0 for v in legs) and legs[2] > 0 and legs[6] > 0, done.stdout  # the two crossings
    assert sum(legs) == pytest.approx(figures[1], rel=0.5), done.stdout  # medians: roughly the whole


def test_lane_framing_carries_big_tensors_many_frames_and_pipelined_messages() -> None:
    """The framing alone, over a socket pair: a message larger than one read arrives whole (and
    writable), more frames than one sendmsg takes, two messages in one read, polling."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        reader = P.LaneReader(b)
        big = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
        many = [bytes([i % 256]) * (i % 7) for i in range(700)]
        sender = threading.Thread(target=lambda: (P.lane_send(a, [b"h", b"c", *P.tensor_frames([("x", big)])[1]]),
                                                  P.lane_send(a, [b"h2", b"c2", *many]),
                                                  P.lane_send(a, [b"x", b"y"]), P.lane_send(a, [b"z", b"w"])))
        sender.start()
        first = reader.read()
        assert [bytes(f) for f in first[:2]] == [b"h", b"c"]
        got = np.frombuffer(first[2], np.float32).reshape(big.shape)
        np.testing.assert_array_equal(got, big)
        assert got.flags.writeable  # read into a buffer of its own
        second = reader.read()
        assert [bytes(f) for f in second] == [b"h2", b"c2", *many]
        sender.join()
        reader.poll(1.0)  # both small messages are there: one read holds them
        assert [bytes(f) for f in reader.read()] == [b"x", b"y"] and reader.rest
        assert [bytes(f) for f in reader.read()] == [b"z", b"w"] and not reader.rest
        started = time.perf_counter()
        reader.poll(0.002)  # nothing comes: gives up after its time
        assert not reader.rest and 0.002 <= time.perf_counter() - started < 1.0
        a.sendall(P._lane_head(2).pack(2, 1, 1) + b"pq")
        reader.poll(1.0)
        assert [bytes(f) for f in reader.read()] == [b"p", b"q"]
        a.close()
        reader.poll(1.0)  # end of file
        assert reader.read() is None
    finally:
        a.close()
        b.close()


def test_the_reactor_reads_a_message_only_once_it_is_whole() -> None:
    """How the daemon's lanes' thread reads a connection without blocking: what waits is taken
    into the reader's buffer (``take_waiting``), and read only once a message is whole there
    (``message_whole``); over a socket pair, cut where it matters."""
    from vkpool.daemon.lane import message_whole, take_waiting

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        reader = P.LaneReader(b, max_frames=8, max_bytes=1 << 10)
        assert take_waiting(reader) == 0 and not message_whole(reader)  # nothing yet
        message = P._lane_head(3).pack(3, 2, 3, 4) + b"hhcccdddd"
        for cut in (1, 4, 20, len(message) - 1):  # count, sizes, frames: each cut short
            a.sendall(message[:cut])
            assert take_waiting(reader) == cut and not message_whole(reader), cut
            a.sendall(message[cut:])
            assert take_waiting(reader) > 0 and message_whole(reader), cut
            assert [bytes(f) for f in reader.read()] == [b"hh", b"ccc", b"dddd"]
            assert not reader.rest
        a.sendall(message + message[:5])  # one whole and the next begun: the begun one is kept
        assert take_waiting(reader) > 0 and message_whole(reader) and len(reader.read()) == 3
        assert reader.rest and not message_whole(reader)
        a.sendall(message[5:])
        assert take_waiting(reader) > 0 and message_whole(reader) and len(reader.read()) == 3
        a.sendall(P._lane_head(9).pack(9, *[1] * 9)[:4])  # more frames than allowed: refused at once
        assert take_waiting(reader) > 0 and message_whole(reader)
        with pytest.raises(P.LaneError):
            reader.read()
        reader.rest = b""
        # more bytes than allowed: refused once its header frame is there, which it answers with
        a.sendall(P._lane_head(2).pack(2, 6, 1 << 20) + b"hea")
        assert take_waiting(reader) > 0 and not message_whole(reader)
        a.sendall(b"der")
        assert take_waiting(reader) > 0 and message_whole(reader)
        with pytest.raises(P.LaneError) as refused:
            reader.read()
        assert refused.value.header == b"header"
        reader.rest = b""
        a.close()
        assert take_waiting(reader) == -1  # end of file
    finally:
        a.close()
        b.close()


def test_lanes_are_read_by_one_thread_however_many_are_open(shared: Daemon) -> None:
    """Sixteen lanes open and each used: the daemon has no more threads than with none (a thread
    per lane would add sixteen)."""
    def threads() -> int:
        return len(os.listdir(f"/proc/{shared.proc.pid}/task"))

    path = shared.folder / "threads.onnx"
    path.write_bytes(mlp_model(8, 16, seed=6))
    with shared.client() as client:
        model = client.load_model(path)["id"]
        metas, frames = P.tensor_frames([("x", X)])
        lanes = [RawLane(client) for _ in range(2)]
        try:
            for i, lane in enumerate(lanes):
                header, content, _ = lane.request("infer", f"warm-{i}", {"model": model, "inputs": metas}, frames)
                assert header["status"] == "ok", content
            before = threads()
            lanes += [RawLane(client) for _ in range(16)]
            for i, lane in enumerate(lanes):
                header, content, _ = lane.request("infer", f"t-{i}", {"model": model, "inputs": metas}, frames)
                assert header["status"] == "ok", content
            assert threads() <= before, (before, threads())
        finally:
            for lane in lanes:
                lane.close()


def test_a_lane_client_stuck_mid_message_costs_only_itself(shared: Daemon) -> None:
    """One thread reads every lane: a client that sends half a request and stops must not stop the
    others, and its request is answered once the rest comes."""
    path = shared.folder / "stuck.onnx"
    path.write_bytes(mlp_model(8, 16, seed=4))
    with shared.client() as client:
        model = client.load_model(path)["id"]
        metas, frames = P.tensor_frames([("x", X)])
        parts = _infer_parts("stuck", model, metas, frames)
        data = P._lane_head(len(parts)).pack(len(parts), *map(len, parts)) + b"".join(map(bytes, parts))
        stuck, other = RawLane(client), RawLane(client)
        try:
            stuck.sock.sendall(data[:-10])
            for i in range(5):  # meanwhile, another lane is served
                header, content, out = other.request("infer", f"other-{i}", {"model": model, "inputs": metas},
                                                     frames)
                assert header["status"] == "ok", content
            stuck.sock.sendall(data[-10:])
            header, content, got = stuck.reply()
            assert header["id"] == "stuck" and header["status"] == "ok", content
            assert bytes(got[0]) == bytes(out[0])
            header, content, _ = stuck.request("infer", "after", {"model": model, "inputs": metas}, frames)
            assert header["status"] == "ok", content  # and the lane is read as before
        finally:
            stuck.close()
            other.close()


def test_a_reply_in_the_ring_to_a_client_gone_asleep_counts_as_undelivered() -> None:
    """The daemon's side of a ring, over a socket pair: a reply to a sleeping client is published in
    the ring and woken on the socket; when the client is gone the wake-up fails, and the write
    reports nothing sent (so the server counts the job ``client_gone``, not ``ok``)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ring, fd = Ring.create(4096)
    os.close(fd)
    conn = LaneConnection(a)
    conn.ring = ring
    try:
        body = [P.DELIMITER, b"header", b"content"]
        ring.words[_CLIENT_ASLEEP] = 1
        conn.ring_reply = True
        assert conn.send(body) > 0 and conn.open
        assert ring.words[_REP] == 1 and b.recv(64) == P.LANE_WAKE  # published, and woken
        b.close()
        conn.ring_reply = True
        assert conn.send(body) == 0 and not conn.open
    finally:
        conn.close()
        b.close()
