"""Hostile and careless clients against a real daemon (``vkpool serve`` on the Vulkan device).

Every case is followed by the same checks (:meth:`Shared.check`): ``status`` answers within 1 s,
a fresh client's job is right, the daemon's resident memory and open descriptors come back to
where they were before the cases (within :data:`RSS_SLACK` and the replay window's replies, and
:data:`FD_SLACK`), and the
counters balance with nothing in flight (accepted = ok + error + client_gone). One daemon serves
the cases; the descriptor-limit case starts its own under a low ``RLIMIT_NOFILE``.
"""
from __future__ import annotations

import os
import resource
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from onnx import TensorProto, helper, numpy_helper

from test_daemon_e2e import Daemon
from test_daemon_lane import RawLane
from test_daemon_support import (add_model, big_model, external_outside_model, short_folder, spawn_daemon,
                                 unsupported_model)
from vkpool.daemon import errors as E
from vkpool.daemon import protocol as P
from vkpool.daemon.client import Client, parse_reply

pytestmark = pytest.mark.timeout(120)

#: resident memory the daemon may keep beyond its warmed-up size after a case, besides the
#: replies its replay window keeps (status's ``replay_bytes``): infer plans, allocator slack;
#: each leak the cases look for held 125 MiB or more here
RSS_SLACK = 48 << 20
#: descriptors beyond the warmed-up count (a connection the daemon is still closing)
FD_SLACK = 4
SMALL, LARGE = 1 << 15, 1 << 18  # float32 elements of the reduce models' inputs: 128 KiB, 1 MiB


def malformed_graphs() -> list[bytes]:
    """Models the ONNX checker refuses: an input nobody produces, a cycle, an output no node makes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graphs = [[helper.make_node("Add", ["x", "nowhere"], ["y"])],
              [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
               helper.make_node("Relu", ["a"], ["y"])],
              [helper.make_node("Relu", ["x"], ["z"])]]
    return [helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
            .SerializeToString() for nodes in graphs]


def reduce_model(n: int) -> bytes:
    """y = sum(x) over x: float32[1, n]: a large input, a small reply."""
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)], "reduce",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], [axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def request(action: str, rid: str, content: Any, frames: list[Any] = ()) -> list[Any]:
    return [P.DELIMITER, P.pack(P.request_header(action, rid)), msgpack.packb(content), *frames]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Raw:
    """A ZeroMQ DEALER that sends frames exactly as given."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout: float = 10.0) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            parsed = parse_reply(self.sock.recv_multipart(copy=False))
            if parsed is not None:  # not a probe
                return parsed
        raise AssertionError(f"no reply within {timeout} s")

    def ask(self, frames: list[Any]) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        self.send(frames)
        return self.reply()

    def error_of(self, frames: list[Any]) -> str:
        header, content, _ = self.ask(frames)
        assert header["status"] == "error", content
        return content["type"]

    def close(self) -> None:
        self.sock.close(0)


class Shared:
    """The daemon every case runs against, with what it looked like once warmed up."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.daemon = Daemon(folder, daemon={"queue_limit": 2048, "max_frames": 16, "max_message_bytes": "4MiB",
                                             "inline_run_max": 0, "drain_deadline": "5s", "keep_alive": -1,
                                             "job_timeout": "60s"},
                             extra="devices:\n  - match: {name: 'llvmpipe*'}\n    budget: 12MiB\n"
                                   "host:\n  budget: 12MiB\n")
        self.endpoint = self.daemon.endpoint
        self.pid = self.daemon.proc.pid
        self.log: list[str] = []
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()
        self.ctx = zmq.Context()
        for name, model in (("add.onnx", add_model()), ("small.onnx", reduce_model(SMALL)),
                            ("large.onnx", reduce_model(LARGE))):
            (folder / name).write_bytes(model)
        self.watcher = Client(self.endpoint)
        self.watcher.request("status", timeout=5.0)
        self._fresh_job()  # warm up: imports, shader caches, one lane, the allocator's arenas
        self.big_jobs(self.watcher, "large.onnx", LARGE, 20)
        time.sleep(0.6)  # a housekeeping sweep gives freed pages back
        self.rss, self.fds = _rss(self.pid), _fds(self.pid)

    def _read_log(self) -> None:
        for line in self.daemon.proc.stderr:  # a full pipe would stall the daemon's logging
            self.log.append(line.decode(errors="replace"))

    def raw(self) -> Raw:
        return Raw(self.ctx, self.endpoint)

    def model(self, client: Client, name: str = "add.onnx") -> str:
        return client.load_model(self.folder / name)["id"]

    def big_jobs(self, client: Client, name: str, n: int, count: int) -> None:
        model = self.model(client, name)
        rng = np.random.default_rng(count)
        for _ in range(count):
            x = rng.standard_normal((1, n)).astype(np.float32)
            (y,) = client.infer(model, {"x": x})
            np.testing.assert_allclose(y[0, 0], x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)

    def _fresh_job(self) -> None:
        x = np.random.default_rng().standard_normal((1, 4)).astype(np.float32)
        with Client(self.endpoint) as fresh:
            (y,) = fresh.infer(self.model(fresh), {"x": x})
        np.testing.assert_array_equal(y, x + 1)

    def check(self) -> dict[str, int]:
        """The checks after a case; the counters."""
        assert self.daemon.proc.poll() is None, "".join(self.log[-40:])
        self.watcher.request("status", timeout=1.0)  # TimeoutError when the daemon cannot answer in 1 s
        self._fresh_job()
        deadline = time.monotonic() + 15
        while True:
            counters = self.watcher.request("status", timeout=1.0)[0]["counters"]
            rss, fds = _rss(self.pid), _fds(self.pid)
            kept = counters["replay_bytes"]  # the replay window's replies, kept on purpose
            settled = counters["in_flight"] == 0 and rss <= self.rss + RSS_SLACK + kept and fds <= self.fds + FD_SLACK
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert counters["in_flight"] == 0, counters
        assert counters["accepted"] == counters["ok"] + counters["error"] + counters["client_gone"], counters
        assert rss <= self.rss + RSS_SLACK + kept, (f"resident memory {rss >> 20} MiB, was {self.rss >> 20} MiB, "
                                                    f"and the replay window keeps {kept >> 20} MiB")
        assert fds <= self.fds + FD_SLACK, f"{fds} descriptors open, were {self.fds}"
        return counters

    def stop(self) -> None:
        self.watcher.close()
        self.ctx.term()
        assert self.daemon.stop() == 0
        self._drain.join(10)
        log = "".join(self.log)
        assert "unanswered" not in log and "unexpected failure" not in log, log[-3000:]


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    with short_folder("vkh") as folder:
        daemon = Shared(folder)
        try:
            yield daemon
        finally:
            daemon.stop()


# -- requests that must get one reply ---------------------------------------------------------

def test_frames_that_do_not_decode_are_answered(shared: Shared) -> None:
    raw = shared.raw()
    try:
        cases = {
            "ProtocolError": [
                [b"no delimiter"],
                [P.DELIMITER, b"\xc1\xc1", b"\x80"],                              # not msgpack
                [P.DELIMITER, msgpack.packb({"v": 1, "id": "t"})[:-3], b"\x80"],  # truncated header
                [P.DELIMITER, b"\xdd\xff\xff\xff\xff", b"\x80"],                  # an array of 4 G items
                [P.DELIMITER, b"\xdb\xff\xff\xff\xf0abc", b"\x80"],               # a string of 4 GB
                [P.DELIMITER, msgpack.packb([1, 2]), b"\x80"],                    # header not a map
                [P.DELIMITER, msgpack.packb({"v": 1, "type": "status_request"}), b"\x80"],  # no id
            ],
            "VersionMismatch": [[P.DELIMITER, msgpack.packb({"v": 99, "id": "v", "type": "status_request"}),
                                 msgpack.packb({})]],
            "UnknownRequest": [request("format_disk", "u", {})],
            "InvalidRequest": [
                request("status", "c", [1]),                                     # content not a map
                request("status", "b", {b"raw": 1}),                             # a bytes key
                request("infer", "m", {"model": "x", "inputs": [], b"inputs": 1}),  # str and bytes keys
                request("plan", "k", {"model": "x", b"budgets": {}}),
            ],
            "MessageTooLarge": [request("status", "f", {}, [b""] * 20),
                                request("status", "s", {}, [b"\0" * (3 << 20)] * 2)],  # a larger frame: dropped
        }
        for expected, frame_lists in cases.items():
            for frames in frame_lists:
                assert raw.error_of(frames) == expected, frames[:3]
    finally:
        raw.close()
    shared.check()


@pytest.mark.parametrize("shape", [[1 << 40, 1 << 40], [(1 << 63) - 1, 2], [(1 << 64) - 1] * 3])
def test_a_tensor_too_large_to_describe_is_answered_and_its_id_is_not_stuck(shared: Shared, shape: list[int]) -> None:
    raw = shared.raw()
    try:
        model = raw.ask(request("load_model", "load", {"path": str(shared.folder / "add.onnx")}))[1]["model"]["id"]
        meta = [{"name": "x", "dtype": "float32", "shape": shape}]
        first = raw.ask(request("infer", "huge", {"model": model, "inputs": meta}, [b"\0" * 16]))
        assert first[0]["status"] == "error" and first[1]["type"] == "InvalidTensor", first[1]
        again = raw.ask(request("infer", "huge", {"model": model, "inputs": meta}, [b"\0" * 16]))
        assert again[1] == first[1]  # the retried id is answered from the replay window
    finally:
        raw.close()
    counters = shared.check()
    assert counters["retries"] >= 1


def test_number_fields_must_be_finite(shared: Shared) -> None:
    raw = shared.raw()
    try:
        model = raw.ask(request("load_model", "load", {"path": str(shared.folder / "add.onnx")}))[1]["model"]["id"]
        x = np.ones((1, 4), np.float32)
        metas, frames = P.tensor_frames([("x", x)])
        for i, bad in enumerate((float("nan"), float("inf"), -float("inf"))):
            content = {"model": model, "inputs": metas, "timeout": bad}
            assert raw.error_of(request("infer", f"t{i}", content, frames)) == "InvalidRequest"
            assert raw.error_of(request("load_model", f"k{i}", {"path": str(shared.folder / "add.onnx"),
                                                                "keep_alive": bad})) == "InvalidRequest"
        # a short timeout still expires other jobs: the deadline heap is not stopped
        header, content, out = raw.ask(request("infer", "ok", {"model": model, "inputs": metas, "timeout": 30.0},
                                               frames))
        assert header["status"] == "ok"
        np.testing.assert_array_equal(np.frombuffer(out[0].buffer, np.float32), (x + 1).ravel())
    finally:
        raw.close()
    shared.check()


def test_a_retried_request_id_runs_once_and_gets_the_same_reply(shared: Shared) -> None:
    raw = shared.raw()
    try:
        model = raw.ask(request("load_model", "load", {"path": str(shared.folder / "add.onnx")}))[1]["model"]["id"]
        before = shared.watcher.status()["counters"]
        metas, frames = P.tensor_frames([("x", np.full((1, 4), 2.0, np.float32))])
        replies = [raw.ask(request("infer", "same", {"model": model, "inputs": metas}, frames)) for _ in range(3)]
        after = shared.watcher.status()["counters"]
    finally:
        raw.close()
    assert all(r[0]["status"] == "ok" for r in replies)
    assert all(bytes(r[2][0].buffer) == bytes(replies[0][2][0].buffer) for r in replies)
    assert after["ok"] - before["ok"] == 1 + 1  # the job once, and the first status
    assert after["retries"] - before["retries"] == 2
    shared.check()


# -- models a client points at ----------------------------------------------------------------

def test_files_that_are_no_models_are_refused_without_stalling_the_admin_thread(shared: Shared) -> None:
    fifo = shared.folder / "fifo.onnx"
    os.mkfifo(fifo)
    (shared.folder / "text.onnx").write_text("not a model")
    raw = shared.raw()
    try:
        for rid, path in (("fifo", fifo), ("random", Path("/dev/urandom")), ("dir", shared.folder)):
            header, content, _ = raw.ask(request("load_model", rid, {"path": str(path)}))
            assert header["status"] == "error" and content["type"] in ("ModelError", "FileNotFound"), content
            assert "regular file" in content["message"] or content["type"] == "FileNotFound", content
        # the admin thread answers the next load at once
        assert raw.ask(request("load_model", "after", {"path": str(shared.folder / "add.onnx")}))[0]["status"] == "ok"
    finally:
        raw.close()
    with Client(shared.endpoint) as client:
        with pytest.raises(E.ModelError):
            client.load_model(shared.folder / "text.onnx")
        with pytest.raises(E.ModelError):
            client.load_model(b"\x08\x07garbage\xff" * 10)
        with pytest.raises(E.UnsupportedOp, match="Det"):
            client.load_model(unsupported_model())
        for model in malformed_graphs():
            with pytest.raises(E.ModelError):
                client.load_model(model)
        with pytest.raises(E.ModelError, match="outside"):
            client.load_model(external_outside_model(shared.folder / "ext"))
        with pytest.raises(E.MessageTooLarge):  # refused before it is sent: the daemon would drop it
            client.load_model(big_model(16 << 20))
        (shared.folder / "big.onnx").write_bytes(big_model(16 << 20))
        with pytest.raises(E.InsufficientMemory) as info:
            client.load_model(shared.folder / "big.onnx")
        assert "16 MiB" in str(info.value) and "0 B" not in str(info.value), info.value
    shared.check()


# -- clients that stall ----------------------------------------------------------------------

def test_a_lane_client_that_never_reads_stalls_only_itself(shared: Shared) -> None:
    before = shared.watcher.status()["counters"]
    with Client(shared.endpoint) as hog, Client(shared.endpoint, local_lane=False) as other:
        assert hog.info["local_lane"], "this daemon offers no local lane"
        model = shared.model(hog)
        lane = RawLane(hog)
        assert lane.opened
        metas, frames = P.tensor_frames([("x", np.ones((1, 4), np.float32))])
        content = msgpack.packb({"model": model, "inputs": metas})
        lane.sock.settimeout(0.5)
        sent = 0
        try:  # until the daemon stops reading this lane (its replies are not read)
            for sent in range(1000):
                lane.send([P.pack(P.request_header("infer", f"hog{sent}")), content, *frames])
        except TimeoutError:
            pass
        other_model = shared.model(other)
        rng = np.random.default_rng(1)
        for _ in range(20):  # served meanwhile: none refused Busy, none timed out behind the hog's replies
            x = rng.standard_normal((1, 4)).astype(np.float32)
            np.testing.assert_array_equal(other.infer(other_model, {"x": x}, timeout=5.0)[0], x + 1)
        # status answers meanwhile, and the hog's lane is still open
        assert shared.watcher.request("status", timeout=1.0)[0]["counters"]["lanes"] >= 1
        lane.close()
    after = shared.check()
    assert sent > 100 and after["client_gone"] > before["client_gone"], (sent, after)  # replies never read


# -- memory that must come back ----------------------------------------------------------------

def test_answered_jobs_do_not_keep_their_inputs(shared: Shared) -> None:
    with Client(shared.endpoint, local_lane=False) as client:
        shared.big_jobs(client, "large.onnx", LARGE, 200)  # 200 MiB of inputs
    shared.check()


def test_clients_gone_with_queued_jobs_leave_no_memory_behind(shared: Shared) -> None:
    before = shared.watcher.status()["counters"]["client_gone"]
    path = str(shared.folder / "small.onnx")
    x = np.random.default_rng(2).standard_normal((1, SMALL)).astype(np.float32)
    metas, frames = P.tensor_frames([("x", x)])
    raws = [shared.raw() for _ in range(20)]
    try:
        for i, raw in enumerate(raws):
            model = raw.ask(request("load_model", f"l{i}", {"path": path}))[1]["model"]["id"]
            for j in range(50):
                raw.send(request("infer", f"j{j}", {"model": model, "inputs": metas}, frames))
        for raw in raws:
            raw.reply(30)  # the daemon has its jobs
    finally:
        for raw in raws:
            raw.close()  # gone, most replies unread
    assert shared.check()["client_gone"] > before


# -- other daemons, configs -------------------------------------------------------------------

def test_the_sockets_are_for_this_user_only(shared: Shared) -> None:
    socket_path = Path(shared.endpoint[len("ipc://"):])
    for path in (socket_path, socket_path.with_name(socket_path.name + ".lane")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_second_daemon_on_the_endpoint_is_refused(shared: Shared) -> None:
    second = spawn_daemon(shared.endpoint, config=shared.daemon.config)
    try:
        assert second.wait(60) == 1
        assert b"another vkpool daemon" in second.stderr.read()
    finally:
        second.stderr.close()
    shared.check()


@pytest.mark.parametrize("text, message", [
    ("host:\n  budget: 0\n", "host.budget: a budget of 0"),
    ("devices:\n  - match: {index: 0}\n    budget: 0MiB\n", "devices[0].budget: a budget of '0MiB'"),
    ("host:\n  budget: !!python/name:os.system\n", "f.yaml:2: host.budget: tag"),
    ("host:\n  budget: !!python/tuple [1, 2]\n", "f.yaml:2: host.budget: tag"),
    ("daemon: !!python/object/apply:os.system [true]\n", "f.yaml:1: daemon: tag"),
    ("host: !mine {budget: 1GiB}\n", "f.yaml:1: host: tag '!mine'"),
    ("host:\n  budget: !!int many\n", "f.yaml:2: host.budget:"),
])
def test_a_config_refuses_zero_budgets_and_yaml_tags_naming_file_and_line(text: str, message: str) -> None:
    from vkpool.config.loader import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(text, "f.yaml")
    assert message in str(info.value)


# -- the descriptor limit ---------------------------------------------------------------------

def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_the_connection_watch_counts_connections_and_ends_with_its_monitor() -> None:
    """The daemon's connection watch on a router of its own: connections counted as they come
    and go, the descriptors of those that went queued for probing, and its thread gone once
    stopped (it waits for the monitor's end, which must be among the events it reads)."""
    import logging

    from vkpool.daemon.endpoint import ConnectionWatch

    with short_folder("vkw") as folder:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{folder}/w.sock")
        watch = ConnectionWatch(router, 4096, folder / "w.sock", logging.getLogger("test"))
        watch.start()
        dealers = []
        try:
            for _ in range(3):
                dealer = ctx.socket(zmq.DEALER)
                dealer.linger = 0
                dealer.connect(f"ipc://{folder}/w.sock")
                dealers.append(dealer)
            end = time.monotonic() + 10
            while watch.connections < 3 and time.monotonic() < end:
                time.sleep(0.01)
            assert watch.connections == 3 and watch.listening
            dealers.pop().close(0)
            while not watch.departed and time.monotonic() < end:
                time.sleep(0.01)
            assert watch.connections == 2 and len(watch.departed) == 1
            watch.stop()
            assert not watch._thread.is_alive(), "the watch's thread outlived its monitor"
        finally:
            for dealer in dealers:
                dealer.close(0)
            router.close(0)
            ctx.term()


def test_more_clients_than_descriptors_leave_the_daemon_serving() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.fail("this test needs a hard open-file limit of at least 1024 to open 400 clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048) if hard == resource.RLIM_INFINITY
                                                else max(soft, min(hard, 2048)), hard))
    with short_folder("vkf") as folder:
        daemon = Daemon(folder, preexec=_low_fd_limit)
        ctx = zmq.Context()
        ctx.max_sockets = 512
        socks = []
        try:
            with Client(daemon.endpoint) as watcher:
                before = _fds(daemon.proc.pid)
                for i in range(400):
                    sock = ctx.socket(zmq.DEALER)
                    sock.linger = 0
                    sock.connect(daemon.endpoint)
                    sock.send_multipart(request("hello", f"h{i}", {}))
                    socks.append(sock)
                outcomes: dict[str, int] = {}
                waiting = set(socks)
                quiet_until = time.monotonic() + 10  # the replies of those let in, until none comes for 1.5 s
                while waiting and time.monotonic() < quiet_until:
                    for sock in list(waiting):
                        if sock.poll(0):
                            header, content, _ = parse_reply(sock.recv_multipart(copy=False))
                            key = "ok" if header["status"] == "ok" else content["type"]
                            outcomes[key] = outcomes.get(key, 0) + 1
                            waiting.discard(sock)
                            quiet_until = time.monotonic() + 1.5
                    time.sleep(0.05)
                if daemon.proc.poll() is not None:
                    pytest.fail("the daemon died: " + daemon.proc.stderr.read().decode()[-3000:])
                assert _fds(daemon.proc.pid) < 256
                assert outcomes.get("ok", 0) >= 32 and set(outcomes) <= {"ok", "TooManyConnections"}, outcomes
                assert waiting, "every client got in: the limit was not reached"
                for sock in socks:
                    sock.close(0)
                socks.clear()
                end = time.monotonic() + 15
                while _fds(daemon.proc.pid) > before + FD_SLACK and time.monotonic() < end:
                    time.sleep(0.1)
                assert _fds(daemon.proc.pid) <= before + FD_SLACK
            end = time.monotonic() + 10
            while True:  # the daemon listens again, and has room once it has seen those clients leave
                try:
                    fresh = Client(daemon.endpoint)
                    break
                except E.TooManyConnections:
                    assert time.monotonic() < end
                    time.sleep(0.2)
            with fresh:
                x = np.arange(4, dtype=np.float32).reshape(1, 4)
                np.testing.assert_array_equal(fresh.session(add_model()).run(None, {"x": x})[0], x + 1)
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
            code = daemon.stop()
        log = daemon.proc.stderr.read().decode()
        assert code == 0, log[-3000:]
        assert "not accepting connections" in log and "accepting connections again" in log, log[-3000:]


def test_a_zeromq_client_that_never_reads_costs_only_itself(shared: Shared) -> None:
    """1,200 jobs with 32 KiB replies, none read (the client's socket takes 8): the daemon keeps at
    most REPLY_HWM of them, drops the rest (counted client_gone), serves others meanwhile, and its
    memory comes back. The first such client leaves libzmq a few descriptors of its own, once; a
    second leaves nothing more."""
    from vkpool.daemon.server import REPLY_HWM

    n = 8 * 1024  # float32[1, 8192]: 32 KiB out (the replay window keeps up to 1,024 replies sent)
    echo = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "echo",
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])])
    path = shared.folder / "echo.onnx"
    path.write_bytes(helper.make_model(echo, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    metas, frames = P.tensor_frames([("x", np.ones((1, n), np.float32))])
    jobs = 1200
    for attempt in range(2):
        before = shared.watcher.status()["counters"]["client_gone"]
        hog = shared.raw()
        hog.sock.setsockopt(zmq.RCVHWM, 8)
        hog.sock.setsockopt(zmq.RCVBUF, 1 << 16)
        try:
            model = hog.ask(request("load_model", "l", {"path": str(path)}))[1]["model"]["id"]
            for j in range(jobs):
                hog.send(request("infer", f"j{j}", {"model": model, "inputs": metas}, frames))
            with Client(shared.endpoint, local_lane=False) as other:
                other_model = shared.model(other)
                x = np.ones((1, 4), np.float32)
                for _ in range(5):
                    np.testing.assert_array_equal(other.infer(other_model, {"x": x}, timeout=10.0)[0], x + 1)
            deadline = time.monotonic() + 60
            while shared.watcher.status()["counters"]["client_gone"] - before < jobs - REPLY_HWM - 64:
                assert time.monotonic() < deadline, shared.watcher.status()["counters"]
                time.sleep(0.2)
            assert any("replies unread" in line for line in shared.log)
        finally:
            hog.close()
        deadline = time.monotonic() + 30
        while not shared.watcher.request("unload_model", {"model": model, "now": True})[0]["unloaded"]:
            assert time.monotonic() < deadline, "the echo model stays loaded"
            time.sleep(0.2)
        if attempt == 0:
            time.sleep(1.0)
            shared.fds = max(shared.fds, _fds(shared.pid))
        shared.check()
