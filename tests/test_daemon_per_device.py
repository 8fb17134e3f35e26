"""A daemon with a serving process per Vulkan member (``daemon.process_per_device``): a real
``vkpool serve`` on lavapipe split into two members, real client processes, the real CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from test_daemon_support import (
    assert_balanced,
    big_model,
    daemon_env,
    mlp_model,
    reference_run,
    short_folder,
    spawn_daemon,
    wait_ready,
)
from test_protocol_fuzz import FUZZ, _packed, contents, frames, headers
from vkpool.daemon import errors as E
from vkpool.daemon import protocol as P
from vkpool.daemon.client import Client, parse_reply
from vkpool.daemon.main import process_running

from vkpool.percentiles import latency_percentiles

pytestmark = pytest.mark.timeout(240)

SPLIT = "devices:\n  - match: {name: 'llvmpipe*'}\n    split: 2\n    budget: 48MiB\nhost:\n  budget: 32MiB\n"


class Front:
    def __init__(self, folder: Path, daemon: dict[str, Any] | None = None) -> None:
        self.folder = folder
        self.endpoint = f"ipc://{folder}/d.sock"
        self.config = folder / "vkpool.yaml"
        self.config.write_text(SPLIT + "daemon: " + json.dumps({"process_per_device": True, **(daemon or {})}) + "\n")
        self.proc = spawn_daemon(self.endpoint, config=self.config)
        wait_ready(self.endpoint, self.proc, timeout=120)

    def client(self, **kwargs: Any) -> Client:
        return Client(self.endpoint, **kwargs)

    def pids(self) -> dict[str, int]:
        with self.client() as client:
            return {p["member"]: p["pid"] for p in client.front["serving"]}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(90)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    with short_folder("vkf") as path:
        daemon = Front(path)
        yield daemon
        assert daemon.stop() == 0


CLIENT = """
import sys, json, numpy as np
from vkpool.daemon.client import Client
endpoint, model, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(endpoint) as client:
    session = client.session(model)
    rng = np.random.default_rng(int(sys.argv[4]))
    outs = []
    for _ in range(jobs):
        x = rng.standard_normal((1, 8)).astype(np.float32)
        outs.append([x.tolist(), [o.tolist() for o in session.run(None, {"x": x})]])
    print(json.dumps({"serving": client.serving_endpoint, "pid": client.info["pid"], "lane": client.local_lane,
                      "front": client.front["pid"], "outs": outs}))
"""


def test_clients_are_spread_over_the_serving_processes_and_get_right_answers(front: Front) -> None:
    model = mlp_model(seed=5)
    path = front.folder / "mlp.onnx"
    path.write_bytes(model)
    with front.client() as watcher:
        before = assert_balanced(watcher)
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, front.endpoint, str(path), "40", str(seed)],
                              env=daemon_env(), stdout=subprocess.PIPE, text=True) for seed in range(4)]
    answers = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        answers.append(json.loads(out.strip().splitlines()[-1]))
    pids = front.pids()
    # every client was sent to a serving process (not the front), both processes got clients
    assert {a["pid"] for a in answers} == set(pids.values())
    assert all(a["front"] == front.proc.pid and a["pid"] != front.proc.pid and a["lane"] for a in answers)
    assert {a["serving"] for a in answers} == {f"{front.endpoint}.{m}" for m in pids}
    for a in answers:
        for x, outs in a["outs"]:
            want = reference_run(model, {"x": np.asarray(x, np.float32)})
            for got, ref in zip(outs, want):
                np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=1e-5, atol=1e-5)
    with front.client() as client:
        status = client.status()
        counters = assert_balanced(client)
        # the front's status adds the processes' counters: the 160 infers are all there
        assert counters["ok"] - before["ok"] >= 160
        assert {p["member"]: p["state"] for p in status["processes"]} == {"vk0.0": "serving", "vk0.1": "serving"}
        assert sorted(m["id"] for m in status["members"]) == ["vk0.0", "vk0.1"]
        assert sorted(m["id"] for m in client.devices()) == ["vk0.0", "vk0.1"]  # no host member in this mode
        loaded = next(m for m in status["models"] if m["name"].startswith("mlp"))
        assert [m["id"] for m in client.list_models()].count(loaded["id"]) == 1
        assert set(loaded["memory_by_member"]) == {"vk0.0", "vk0.1"}  # a copy in each process
        # latency percentiles over every process's latencies together, not the highest of theirs
        assert "latency_samples_ms" not in status
        merged = client.request("status", {"samples": True})[0]
    samples = []
    for member in pids:
        with Client(f"{front.endpoint}.{member}", local_lane=False) as serving:
            own = serving.request("status", {"samples": True})[0]
        assert own["latency_samples_ms"]  # its share of the 160 infers
        samples += own["latency_samples_ms"]
    assert sorted(merged["latency_samples_ms"]) == sorted(samples)
    assert merged["latency_ms"] == status["latency_ms"] == latency_percentiles([v / 1e3 for v in samples])


def test_the_front_merges_each_batching_models_queue_delays() -> None:
    """A model batching in two processes: its counts added, its queue delay percentiles those of
    both processes' delays together; the delays themselves stay only when asked for."""
    from vkpool.daemon.front import merge_models

    from vkpool.percentiles import delay_percentiles_us

    def model(member: str, delays: list[float], batches: int) -> dict[str, Any]:
        p50, p99 = delay_percentiles_us(delays)
        return {"id": "m1", "refs": 1, "queued": 0, "running": 0, "done": batches, "memory_by_member": {member: 1},
                "batching": {"batches": batches, "requests": 2 * batches, "rows": 2 * batches, "padded_rows": 0,
                             "failed_batches": 0, "where_read": batches, "mean_batch_size": 2.0,
                             "queue_delay_p50_us": p50, "queue_delay_p99_us": p99, "queue_delays_us": delays}}

    slow, quick = [900.0, 1000.0, 1100.0], [10.0 * k for k in range(1, 31)]
    (merged,) = merge_models([[model("vk0.0", slow, 3)], [model("vk0.1", quick, 30)]])
    batching = merged["batching"]
    assert (batching["queue_delay_p50_us"], batching["queue_delay_p99_us"]) == delay_percentiles_us(slow + quick)
    assert batching["batches"] == 33 and batching["mean_batch_size"] == 2.0 and "queue_delays_us" not in batching
    assert merged["memory_by_member"] == {"vk0.0": 1, "vk0.1": 1} and merged["refs"] == 2
    (kept,) = merge_models([[model("vk0.0", slow, 3)], [model("vk0.1", quick, 30)]], samples=True)
    assert sorted(kept["batching"]["queue_delays_us"]) == sorted(slow + quick)


def test_the_front_answers_for_the_whole_daemon_and_redirects_the_rest(front: Front) -> None:
    model = mlp_model(seed=6)
    with front.client(follow=False) as raw:
        assert raw.front is None and raw.info["redirect"].startswith(front.endpoint + ".vk0.")
        # the front's replies carry every documented field, its own included
        for action, reply in (("hello", raw.info), ("status", raw.status()), ("devices", raw.request("devices")[0]),
                              ("list_models", raw.request("list_models")[0])):
            P.validate(P.MESSAGES[action].reply, reply, action)
            assert set(reply) == {f.name for f in P.MESSAGES[action].reply} - P.SAMPLE_FIELDS, action
        assert {p["member"] for p in raw.info["serving"]} == {"vk0.0", "vk0.1"}
        for action, content, frames in (("load_model", {"name": "m"}, [model]),
                                        ("infer", {"model": "0" * 64, "inputs": []}, []),
                                        ("cancel", {"request_id": "x"}, [])):
            with pytest.raises(E.Redirected) as caught:
                raw.request(action, content, frames)
            assert caught.value.details["redirect"].startswith(front.endpoint + ".vk0.")
        with pytest.raises(E.UnknownMember, match="vk0.0, vk0.1"):
            raw.set_budget("vk7", "1MiB")
        with pytest.raises(E.InvalidRequest):
            raw.request("status", {"bogus": 1})
    # bytes that are no request: one error reply each, and the front keeps serving
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(front.endpoint)
    for bad in ([P.DELIMITER, b"\xc1", b"\x80"], [P.DELIMITER], [b"no delimiter"],
                [P.DELIMITER, P.pack({"v": 1, "id": "r", "type": "nope_request"}), P.pack({})]):
        sock.send_multipart(bad)
        assert sock.poll(10_000), bad
        reply = sock.recv_multipart()
        assert reply[0] == P.DELIMITER and P.unpack(reply[1])["status"] == "error", bad
    sock.close(0)
    ctx.term()
    # the budget goes to the process that has the member, and holds there
    with front.client() as client:
        reply = client.set_budget("vk0.1", "40MiB")
        assert reply["member"] == "vk0.1" and reply["budget_bytes"] == 40 << 20
        assert {m["id"]: m["budget_bytes"] for m in client.devices()}["vk0.1"] == 40 << 20
        client.set_budget("vk0.1", "48MiB")


def test_the_asyncio_client_follows_the_redirect(front: Front) -> None:
    import asyncio

    from vkpool.daemon.aclient import AsyncClient

    model = mlp_model(seed=11)
    x = np.random.default_rng(11).standard_normal((1, 8)).astype(np.float32)

    async def main() -> tuple[Any, ...]:
        client = await AsyncClient.connect(front.endpoint)
        try:
            session = await client.session(model)
            outs = await session.run(None, {"x": x})
            status = await client.status()
            return client.front, client.info, client.serving_endpoint, outs, status
        finally:
            await client.close()

    front_info, info, serving, outs, status = asyncio.run(main())
    assert front_info["pid"] == front.proc.pid and info["pid"] in front.pids().values()
    assert serving == front_info["redirect"]
    for got, want in zip(outs, reference_run(model, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(status["processes"]) == 2  # status went to the front


def test_a_model_larger_than_one_member_is_refused_and_the_daemon_keeps_serving(front: Front) -> None:
    with front.client() as client:
        with pytest.raises(E.InsufficientMemory):
            client.load_model(big_model(56 << 20), name="big")  # over one member's 48 MiB
        session = client.session(mlp_model(seed=7))
        x = np.ones((1, 8), np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference_run(mlp_model(seed=7), {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)


def test_cli_load_status_and_unload_cover_every_serving_process(front: Front) -> None:
    path = front.folder / "cli.onnx"
    path.write_bytes(mlp_model(seed=8))

    def vkpool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vkpool", *args, "--endpoint", front.endpoint],
                              env=daemon_env(), capture_output=True, text=True, timeout=120)

    done = vkpool("load", str(path), "--keep-alive", "-1")
    assert done.returncode == 0, done.stderr
    assert "vk0.0" in done.stdout and "vk0.1" in done.stdout  # loaded in both processes
    status = vkpool("status")
    assert status.returncode == 0, status.stderr
    assert "serving process for vk0.0" in status.stdout and "serving process for vk0.1" in status.stdout
    gone = vkpool("unload", "cli.onnx")
    assert gone.returncode == 0 and "unloaded" in gone.stdout, gone.stdout + gone.stderr
    with front.client() as client:
        assert not any(m["name"] == "cli.onnx" for m in client.list_models())


def test_a_serving_process_that_dies_is_started_again(front: Front) -> None:
    old = front.pids()
    os.kill(old["vk0.1"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with front.client() as client:
            processes = {p["member"]: p for p in client.status()["processes"]}
        if processes["vk0.1"]["state"] == "serving" and processes["vk0.1"]["pid"] != old["vk0.1"]:
            break
        time.sleep(0.2)
    assert processes["vk0.1"]["restarts"] >= 1 and processes["vk0.1"]["state"] == "serving", processes
    assert processes["vk0.0"]["pid"] == old["vk0.0"]
    # both take clients again
    seen = set()
    for _ in range(4):
        with front.client() as client:
            session = client.session(mlp_model(seed=9))
            assert session.run(None, {"x": np.zeros((1, 8), np.float32)})[0].shape == (1, 8)
            seen.add(client.serving_endpoint)
            session.close()
    assert len(seen) == 2


def test_serving_processes_that_hang_hold_status_once_not_once_each(front: Front) -> None:
    """Two serving processes stopped (SIGSTOP): the front asks them at once, so ``status`` waits
    its 5 s once, not once per process, shows both ``not answering``, and serves again once they
    go on."""
    pids = front.pids()
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        with front.client(timeout=30.0, follow=False) as client:  # the front's own answer
            started = time.monotonic()
            status = client.status()
            took = time.monotonic() - started
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    from vkpool.daemon.front import FORWARD_S

    assert FORWARD_S - 0.5 < took < 2 * FORWARD_S - 1.0, took
    assert {p["member"]: p["state"] for p in status["processes"]} == {m: "not answering" for m in pids}
    with front.client(follow=False) as client:
        again = client.status()
    assert {p["member"]: p["state"] for p in again["processes"]} == {m: "serving" for m in pids}
    assert {p["member"]: p["pid"] for p in again["processes"]} == pids


def test_vkpool_stop_stops_every_serving_process() -> None:
    with short_folder("vkf") as folder:
        daemon = Front(folder)
        pids = daemon.pids()
        done = subprocess.run([sys.executable, "-m", "vkpool", "stop", "--endpoint", daemon.endpoint],
                              env=daemon_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"pid {daemon.proc.pid}" in done.stdout
        assert daemon.proc.wait(30) == 0
        assert not any(process_running(pid) for pid in pids.values())
        assert not (folder / "d.sock").exists()


def _process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as exc:
        return f"pid {pid}: {exc}"
    return f"pid {pid}: state {stat[0]}, parent {stat[1]}, waiting in {wchan or '-'}"


def test_serving_processes_do_not_outlive_a_killed_front() -> None:
    """They stop by themselves, each within its drain deadline and the grace after it."""
    with short_folder("vkf") as folder:
        daemon = Front(folder, {"drain_deadline": "2s"})
        pids = daemon.pids()
        daemon.proc.kill()
        daemon.proc.wait(10)
        deadline = time.monotonic() + 2 + 10 + 15 + 10  # drain, reply grace, the backstop, spare
        while time.monotonic() < deadline and any(process_running(pid) for pid in pids.values()):
            time.sleep(0.1)
        left = [pid for pid in pids.values() if process_running(pid)]
        if left:  # what they were doing, and what they wrote (the pipe stays open while they run)
            assert daemon.proc.stderr is not None
            os.set_blocking(daemon.proc.stderr.fileno(), False)
            logs = (daemon.proc.stderr.read() or b"").decode(errors="replace")[-4000:]
            states = [_process_state(pid) for pid in left]
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"serving processes outlived their front: {states}\n{logs}")
        assert daemon.proc.stderr is not None
        logs = daemon.proc.stderr.read().decode()  # the processes have exited: the pipe is at its end
        for member in pids:
            assert f"vkpool.daemon[{member}]: the daemon's front (pid {daemon.proc.pid}) is gone: stopping" in logs
        assert logs.count("stopped:") == len(pids), logs[-3000:]


def test_a_tcp_endpoint_is_refused_with_the_reason() -> None:
    with short_folder("vkf") as folder:
        config = folder / "vkpool.yaml"
        config.write_text(SPLIT + "daemon: " + json.dumps({"process_per_device": True}) + "\n")
        proc = spawn_daemon("tcp://127.0.0.1:5999", config=config)
        assert proc.wait(60) == 2
        assert "needs an ipc:// endpoint" in proc.stderr.read().decode()


def test_the_front_serves_the_metrics_of_every_serving_process() -> None:
    from test_metrics import _free_port, _scrape, _value

    port = _free_port()
    with short_folder("vkf") as folder:
        daemon = Front(folder, {"metrics": f"127.0.0.1:{port}"})
        try:
            clients = [daemon.client(), daemon.client()]
            assert {c.serving_endpoint for c in clients} == {f"{daemon.endpoint}.vk0.0", f"{daemon.endpoint}.vk0.1"}
            x = np.ones((1, 8), np.float32)
            for n, client in zip((3, 5), clients):
                session = client.session(mlp_model(seed=12))
                for _ in range(n):
                    session.run(None, {"x": x})
            samples = _scrape(port)
            jobs = {c.serving_endpoint.split("d.sock.")[-1]: n
                    for n, c in zip((3, 5), clients)}
            for member, n in jobs.items():
                assert _value(samples, "vkpool_jobs_total", serving=member, status="ok") == n
                assert _value(samples, "vkpool_serving_process_up", serving=member) == 1
                assert _value(samples, "vkpool_serving_process_restarts_total", serving=member) == 0
                assert _value(samples, "vkpool_member_budget_bytes", serving=member, member=member) == 48 << 20
            for c in clients:
                c.close()
        finally:
            assert daemon.stop() == 0


def test_a_serving_process_that_keeps_failing_is_started_again_less_and_less_often() -> None:
    from vkpool.daemon import front as F
    from vkpool.daemon.settings import DaemonSettings

    with short_folder("vkf") as folder:
        front = F.Front(DaemonSettings(), f"ipc://{folder}/d.sock", None, ["vk0"])
        child = front.children[0]
        starts: list[float] = []
        clock = [100.0]

        def spawn(c: F.Serving) -> None:  # a process that exits at once, before answering
            c.proc = subprocess.Popen(["true"])
            c.proc.wait()
            c.started, c.ready = clock[0], False
            starts.append(clock[0])

        front._spawn = spawn  # type: ignore[method-assign]
        spawn(child)
        for _ in range(1000):  # 250 s of the front's clock
            clock[0] += 0.25
            front._look_after(child, clock[0])
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert gaps[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] and set(gaps[6:]) == {60.0}, gaps
        assert child.restarts == len(starts) - 1


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Any]:
    with short_folder("vkf") as path:
        daemon = Front(path)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(daemon.endpoint)
        yield daemon, sock
        sock.close(0)
        ctx.term()
        with daemon.client() as client:  # still serving, every request answered
            assert_balanced(client)
            assert {p["state"] for p in client.status()["processes"]} == {"serving"}
        assert daemon.stop() == 0


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_the_front_answers_every_message_once(fuzzed: Any, data: st.DataObject) -> None:
    daemon, sock = fuzzed
    header = data.draw(headers())
    body = [P.DELIMITER, _packed(header), _packed(data.draw(contents())), *data.draw(frames)]
    sock.send_multipart(body)
    assert sock.poll(10_000), f"no reply to {body[:3]}"
    reply = parse_reply(sock.recv_multipart(copy=False))
    assert reply is not None and not sock.poll(50)  # one reply, and only one
    rid = header.get("id")
    if isinstance(rid, str) and reply[0]["id"] is not None:
        assert reply[0]["id"] == rid
