"""The server over inproc:// with the stand-in runtime: every request, every bad input."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from test_daemon_support import (InprocDaemon, StandInRuntime, add_model, assert_balanced, batched_model, big_model,
                                 external_outside_model, inproc, mlp_model, reference_run, unsupported_model)
from vkpool.daemon import errors as E
from vkpool.daemon import protocol as P
from vkpool.daemon.client import build_request, parse_reply

__all__ = ["inproc"]  # the fixture, imported for pytest
X = np.arange(8, dtype=np.float32).reshape(1, 8)


def raw_request(sock: zmq.Socket, frames: list[Any], timeout_ms: int = 5000) -> tuple[dict, dict, list]:
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "no reply"
    _, body = P.split_routing(sock.recv_multipart())
    return P.unpack(body[0]), P.unpack(body[1]), body[2:]


def test_every_request_gets_a_reply_with_every_documented_field(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        replies: dict[str, dict[str, Any]] = {"hello": client.info}
        model = client.load_model(mlp_model(), name="mlp", keep_alive=0)
        replies["load_model"] = client.request("load_model", *_load(mlp_model()))[0]
        replies["devices"] = client.request("devices")[0]
        replies["list_models"] = client.request("list_models")[0]
        replies["plan"] = client.request("plan", {"model": model["id"], "budgets": {"cpu": "1MiB"}})[0]
        content, frames = client.request("infer", {"model": model["id"], "inputs": P.tensor_frames([("x", X)])[0]},
                                         P.tensor_frames([("x", X)])[1])
        replies["infer"] = content
        replies["bind_infer"] = client.request("bind_infer", {"model": model["id"], "inputs": P.tensor_frames(
            [("x", X)])[0]}, P.tensor_frames([("x", X)])[1])[0]
        replies["cancel"] = client.request("cancel", {"request_id": "nothing"})[0]
        replies["set_budget"] = client.request("set_budget", {"member": "cpu", "size": "2MiB"})[0]
        replies["status"] = client.request("status")[0]
        sampled = client.request("status", {"samples": True})[0]
        replies["unload_model"] = client.request("unload_model", {"model": model["id"]})[0]
        replies["shutdown"] = client.request("shutdown")[0]
    assert set(replies) == set(P.MESSAGES) - P.LANE_ONLY  # open_lane: tests/test_daemon_lane.py
    for action, reply in replies.items():
        P.validate(P.MESSAGES[action].reply, reply, action)
        # a front's own fields: tests/test_daemon_per_device.py; the samples only when asked for
        assert set(reply) == {f.name for f in P.MESSAGES[action].reply} - P.FRONT_FIELDS - P.SAMPLE_FIELDS, action
    P.validate(P.MESSAGES["status"].reply, sampled, "status")
    assert set(sampled) == {f.name for f in P.MESSAGES["status"].reply} - P.FRONT_FIELDS
    assert len(sampled["latency_samples_ms"]) == 1  # the one infer
    assert replies["load_model"]["shared"] is True
    assert replies["set_budget"]["budget_bytes"] == 2 << 20
    assert replies["plan"]["plan"] == {"memory_by_member": {"cpu": 1 << 20}}
    assert replies["cancel"] == {"cancelled": False, "state": "unknown"}
    assert replies["bind_infer"] == {"binding": 0, "offsets": [64]}
    np.testing.assert_array_equal(P.decode_tensors(content["outputs"], frames, "o")["y"],
                                  reference_run(mlp_model(), {"x": X})[0])


def _load(model: bytes) -> tuple[dict[str, Any], list[bytes]]:
    return {"name": "again"}, [model]


def test_remote_session_matches_in_process_and_shares_models(inproc: InprocDaemon) -> None:
    with inproc.client() as a, inproc.client() as b:
        sa, sb = a.session(mlp_model()), b.session(mlp_model())
        assert sa.model_id == sb.model_id and inproc.runtime.opened == 1
        assert [i.name for i in sa.get_inputs()] == ["x"] and sa.get_inputs()[0].dtype == np.float32
        assert [o.name for o in sa.get_outputs()] == ["y", "z"]
        y, z = sa.run(None, {"x": X})
        want = reference_run(mlp_model(), {"x": X})
        np.testing.assert_array_equal(y, want[0])
        np.testing.assert_array_equal(z, want[1])
        (z_only,) = sb.run(["z"], {"x": X})
        np.testing.assert_array_equal(z_only, want[1])
        y += 1  # results are ordinary writable arrays
        [model] = a.list_models()
        assert model["refs"] == 2 and model["memory_by_member"]["cpu"] > 0


@pytest.mark.parametrize("frames, error", [
    ([b"garbage"], "ProtocolError"),
    ([P.DELIMITER, b"\xc1\xc1", b"\x80"], "ProtocolError"),
    ([P.DELIMITER, msgpack.packb({"v": 0, "id": "a", "type": "hello_request"}), msgpack.packb({})],
     "VersionMismatch"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "b", "type": "format_disk_request"}), msgpack.packb({})],
     "UnknownRequest"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "c", "type": "infer_request"}), msgpack.packb({})],
     "InvalidRequest"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "d", "type": "status_request"})], "ProtocolError"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "e", "type": "status_request"}), msgpack.packb({}), b"x"],
     "InvalidRequest"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "f", "type": "infer_request"}),
      msgpack.packb({"model": "0" * 64, "inputs": []})], "UnknownModel"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "g", "type": "load_model_request"}), msgpack.packb({})],
     "InvalidRequest"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "h", "type": "load_model_request"}),
      msgpack.packb({"path": "relative.onnx"})], "InvalidRequest"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "i", "type": "set_budget_request"}),
      msgpack.packb({"member": "vk9", "size": 1})], "UnknownMember"),
    ([P.DELIMITER, msgpack.packb({"v": 1, "id": "j", "type": "set_budget_request"}),
      msgpack.packb({"member": "cpu", "size": "lots"})], "InvalidRequest"),
])
def test_bad_frames_get_an_error_reply_and_the_daemon_keeps_serving(inproc: InprocDaemon,
                                                                    frames: list[bytes], error: str) -> None:
    sock = inproc.raw()
    header, content, _ = raw_request(sock, frames)
    assert header["status"] == "error" and content["type"] == error, content
    assert content["message"]
    sock.close(0)
    with inproc.client() as client:
        assert client.status()["counters"]["error"] >= 1
        assert_balanced(client)


def test_bad_tensors_are_refused_naming_the_problem(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        model = client.load_model(mlp_model())["id"]
        cases = [
            ({"x": X.astype(np.float64)}, "must be float32"),
            ({"x": np.zeros((2, 8), np.float32)}, "must have shape [1, 8]"),
            ({"x": X, "extra": X}, "unknown ['extra']"),
            ({}, "missing ['x']"),
        ]
        for feeds, fragment in cases:
            with pytest.raises(E.InvalidTensor, match=fragment.replace("[", r"\[").replace("]", r"\]")):
                client.infer(model, feeds)
        metas, frames = P.tensor_frames([("x", X)])
        with pytest.raises(E.InvalidTensor, match="1 tensor\\(s\\) described .* but 2 raw frame"):
            client.request("infer", {"model": model, "inputs": metas}, [*frames, b"extra"])
        with pytest.raises(E.InvalidTensor, match="needs 32 bytes"):
            client.request("infer", {"model": model, "inputs": metas}, [b"\0" * 31])
        with pytest.raises(E.InvalidTensor, match="unknown output"):
            client.infer(model, {"x": X}, ["nope"])
        np.testing.assert_array_equal(client.infer(model, {"x": X}, ["y"])[0],
                                      reference_run(mlp_model(), {"x": X})[0])


def test_bad_models_are_refused_with_their_reason(inproc: InprocDaemon, tmp_path: Path) -> None:
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("this is not a model")
    with inproc.client() as client:
        with pytest.raises(E.ModelError):
            client.load_model(not_onnx)
        with pytest.raises(E.ModelError):
            client.load_model(b"\x08\x07garbage")
        with pytest.raises(E.UnsupportedOp, match="Det"):
            client.load_model(unsupported_model())
        with pytest.raises(E.InsufficientMemory) as info:
            client.load_model(big_model(4 << 20))
        assert info.value.details["free_bytes"] == {"cpu": 1 << 20}
        with pytest.raises(E.ModelError, match="outside the model's folder"):
            client.load_model(external_outside_model(tmp_path / "ext"))
        with pytest.raises(E.FileNotFound):
            client.load_model(tmp_path / "missing.onnx")
        assert client.list_models() == []
        assert client.session(add_model()).run(None, {"x": np.zeros((1, 4), np.float32)})[0].sum() == 4


def test_unload_then_infer_is_unknown_model_and_keep_alive_frees(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        model = client.load_model(add_model(), keep_alive=0)["id"]
        used = inproc.runtime.members()[0]["used_bytes"]
        assert used > 0
        reply = client.unload_model(model)
        assert reply == {"model": model, "refs": 0, "unloaded": True}
        assert inproc.runtime.members()[0]["used_bytes"] == 0
        with pytest.raises(E.UnknownModel):
            client.infer(model, {"x": np.zeros((1, 4), np.float32)})
        with pytest.raises(E.UnknownModel):
            client.unload_model(model)
        kept = client.load_model(add_model(), keep_alive=0.3)["id"]
        assert client.unload_model(kept)["unloaded"] is False
        assert len(client.list_models()) == 1
        deadline = time.monotonic() + 5
        # the entry leaves the list first (no new job finds it), then its memory is freed
        while (client.list_models() or inproc.runtime.members()[0]["used_bytes"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.list_models() == [] and inproc.runtime.members()[0]["used_bytes"] == 0


def test_an_idle_model_is_evicted_to_admit_a_load_when_configured() -> None:
    daemon = InprocDaemon(StandInRuntime(budget_bytes=3 << 20), evict_idle=True)
    try:
        with daemon.client() as client:
            idle = client.load_model(big_model(2 << 20), keep_alive=-1)["id"]
            client.unload_model(idle)
            assert [m["id"] for m in client.list_models()] == [idle]  # kept alive, unreferenced
            fresh = client.load_model(big_model(2 << 20) + b"")  # same bytes: shared, not loaded twice
            assert fresh["id"] == idle
            other = client.load_model(mlp_model(n=8, hidden=16 + 1))  # fits beside it
            assert {m["id"] for m in client.list_models()} == {idle, other["id"]}
            client.unload_model(idle)
            client.load_model(big_model((2 << 20) + 4096))  # does not fit: the idle one is evicted
            assert idle not in {m["id"] for m in client.list_models()}
    finally:
        daemon.stop()


def test_ten_thousand_jobs_against_a_small_queue_get_busy_not_growth() -> None:
    daemon = InprocDaemon(StandInRuntime(delay_s=0.002), queue_limit=16, workers_per_model=1)
    try:
        with daemon.client() as client:
            model = client.load_model(add_model())["id"]
            content, frames = _infer_request(model)
            futures = [client.submit("infer", content, frames) for _ in range(10_000)]
            depth = 0
            outcomes = {"ok": 0, "Busy": 0}
            for future in futures:
                header, reply, _ = future.result(60)
                outcomes["ok" if header["status"] == "ok" else reply["type"]] += 1
            depth = max(depth, max(client.status()["queues"].values()))
            assert outcomes["ok"] + outcomes["Busy"] == 10_000
            assert outcomes["Busy"] > 5_000 and outcomes["ok"] >= 16
            assert depth <= 16
            counters = assert_balanced(client)
            assert counters["busy"] == outcomes["Busy"] and counters["in_flight"] == 0
    finally:
        daemon.stop()


def _infer_request(model: str, n: int = 4, **extra: Any) -> tuple[dict[str, Any], list[Any]]:
    metas, frames = P.tensor_frames([("x", np.ones((1, n), np.float32))])
    return {"model": model, "inputs": metas, **extra}, frames


def test_one_flooding_client_does_not_starve_another() -> None:
    daemon = InprocDaemon(StandInRuntime(delay_s=0.005), queue_limit=512, workers_per_model=1)
    try:
        with daemon.client() as flood, daemon.client() as polite:
            model = flood.load_model(add_model())["id"]
            polite.load_model(add_model())
            content, frames = _infer_request(model)
            flooded = [flood.submit("infer", content, frames) for _ in range(300)]
            time.sleep(0.05)
            started = time.monotonic()
            for _ in range(5):
                polite.request("infer", content, frames)
            polite_s = time.monotonic() - started
            remaining = sum(not f.done() for f in flooded)
            # Round-robin: each polite job waits for at most one flood job, not the whole backlog.
            assert polite_s < 0.5 and remaining > 150, (polite_s, remaining)
            for f in flooded:
                f.result(60)
    finally:
        daemon.stop()


def test_priority_orders_a_clients_own_jobs() -> None:
    daemon = InprocDaemon(StandInRuntime(delay_s=0.02), workers_per_model=1)
    try:
        with daemon.client() as client:
            model = client.load_model(add_model())["id"]
            low = [client.submit("infer", *_infer_request(model, priority=0)) for _ in range(5)]
            high = client.submit("infer", *_infer_request(model, priority=5))
            high.result(30)
            assert sum(f.done() for f in low) <= 2  # at most the one already running, plus slack
            for f in low:
                f.result(30)
    finally:
        daemon.stop()


def test_cancel_and_timeout_answer_once_while_compute_is_busy() -> None:
    daemon = InprocDaemon(StandInRuntime(delay_s=0.5), workers_per_model=1)
    try:
        with daemon.client() as client:
            model = client.load_model(add_model())["id"]
            running = client.submit("infer", *_infer_request(model), request_id="run-1")
            queued = client.submit("infer", *_infer_request(model), request_id="queued-1")
            timed = client.submit("infer", *_infer_request(model, timeout=0.1))
            time.sleep(0.05)
            started = time.monotonic()
            assert client.cancel("queued-1") == {"cancelled": True, "state": "queued"}
            client.status()
            assert time.monotonic() - started < 0.3  # control never waits behind the 0.5 s job
            with pytest.raises(E.Cancelled):
                from vkpool.daemon.client import result_of
                result_of(queued.result(5))
            header, content, _ = timed.result(5)
            assert content["type"] == "Timeout"
            assert client.cancel("run-1") == {"cancelled": True, "state": "running"}
            assert running.result(5)[1]["type"] == "Cancelled"
            time.sleep(0.6)  # the running job finishes; its result is discarded, not sent twice
            counters = assert_balanced(client)
            assert counters["ok"] + counters["error"] == counters["accepted"]
    finally:
        daemon.stop()


def test_a_retried_request_id_is_answered_without_running_again(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        model = client.load_model(add_model())["id"]
        content, frames = _infer_request(model)
        first = client.request("infer", content, frames, request_id="same")
        runs = client.status()["models"][0]["done"]
        again = client.request("infer", content, frames, request_id="same")
        np.testing.assert_array_equal(P.decode_tensors(first[0]["outputs"], first[1], "o")["y"],
                                      P.decode_tensors(again[0]["outputs"], again[1], "o")["y"])
        status = client.status()
        assert status["models"][0]["done"] == runs and status["counters"]["retries"] == 1


def test_oversized_and_too_many_frames_are_refused() -> None:
    daemon = InprocDaemon(max_message_bytes=64 << 10, max_frames=8)
    try:
        with daemon.client() as client:
            with pytest.raises(E.MessageTooLarge):  # refused by the client, which knows the limit
                client.request("status", {}, [b"x" * (40 << 10), b"y" * (40 << 10)])
            raw = daemon.raw()  # and by the daemon
            raw.send_multipart([*build_request("status", "big", {}, [b"x" * (40 << 10), b"y" * (40 << 10)])])
            assert raw.poll(10_000) and parse_reply(raw.recv_multipart(copy=False))[1]["type"] == "MessageTooLarge"
            raw.close(0)
            with pytest.raises(E.MessageTooLarge):
                client.request("status", {}, [b""] * 20)
            assert client.status()["counters"]["error"] == 2
    finally:
        daemon.stop()


def test_budget_change_at_run_time_replans_or_is_refused(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        model = client.load_model(mlp_model())["id"]
        used = inproc.runtime.members()[0]["used_bytes"]
        assert client.set_budget("cpu", used + 100) == {"member": "cpu", "budget_bytes": used + 100,
                                                         "replanned": []}
        with pytest.raises(E.BudgetRefused, match="would not fit") as info:
            client.set_budget("cpu", used - 1)
        assert info.value.details["model"] == model
        assert inproc.runtime.budget_of("cpu") == used + 100
        np.testing.assert_array_equal(client.infer(model, {"x": X})[0], reference_run(mlp_model(), {"x": X})[0])


def test_concurrent_threads_share_one_client(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        session = client.session(mlp_model())
        want = reference_run(mlp_model(), {"x": X})[1]
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(50):
                    np.testing.assert_array_equal(session.run(["z"], {"x": X})[0], want)
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert assert_balanced(client)["ok"] >= 200


def test_async_client_runs_many_requests_at_once(inproc: InprocDaemon) -> None:
    import asyncio

    from vkpool.daemon.aclient import AsyncClient

    # inproc needs the daemon's context: the async client is built on it
    async def real() -> None:
        import zmq.asyncio

        client = AsyncClient(inproc.endpoint, context=zmq.asyncio.Context.shadow(inproc.ctx.underlying))
        try:
            session = await client.session(mlp_model())
            results = await asyncio.gather(*(session.run(None, {"x": X * i}) for i in range(20)))
            for i, (y, z) in enumerate(results):
                np.testing.assert_array_equal(z, reference_run(mlp_model(), {"x": X * i})[1])
            await session.close()
        finally:
            await client.close()

    asyncio.run(real())


def test_load_binds_batch_and_named_dims_and_each_binding_is_its_own_model(inproc: InprocDaemon) -> None:
    with inproc.client() as client:
        plain = client.load_model(batched_model(), dims={"T": 5})
        assert plain["binding"] == {"dims": {"T": 5}} and plain["inputs"][0]["shape"] == [1, 4, 5]
        same = client.request("load_model", {"batch": 1, "dims": {"T": 5}}, [batched_model()])[0]
        assert same["shared"] is True and same["model"]["id"] == plain["id"]  # batch 1 is the default
        session = client.session(batched_model(), batch=3, dims={"T": 2})
        assert session.model_id != plain["id"] and session.info["binding"] == {"batch": 3, "dims": {"T": 2}}
        assert session.get_inputs()[0].shape == [3, 4, 2]
        x = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 1)
        with pytest.raises(E.InvalidTensor, match="must have shape"):
            session.run(None, {"x": np.zeros((1, 4, 2), np.float32)})
        for content in ({"batch": 0}, {"batch": "2"}, {"dims": {"T": 0}}, {"dims": {"T": 1.5}}, {"dims": [1]}):
            with pytest.raises(E.InvalidRequest):
                client.request("load_model", content, [batched_model()])
        assert len(client.list_models()) == 2
        members = client.devices()
        assert members[0]["name"] == "host CPU"


def test_a_stop_waits_for_the_reply_of_a_job_its_worker_just_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker takes its job out of the scheduler just before handing the reply over; a stop
    in between must still send that reply (here the gap is widened to 0.3 s)."""
    from vkpool.daemon.scheduler import Scheduler

    settle = Scheduler.settle
    settled = threading.Event()

    def slow_settle(self: Scheduler, job: Any) -> None:
        settle(self, job)
        settled.set()
        time.sleep(0.3)

    monkeypatch.setattr(Scheduler, "settle", slow_settle)
    daemon = InprocDaemon(inline_run_max=0)
    try:
        with daemon.client() as client:
            model = client.load_model(add_model(8), keep_alive=-1)["id"]
            metas, frames = P.tensor_frames([("x", X)])
            future = client.submit("infer", {"model": model, "inputs": metas}, frames)
            assert settled.wait(10)
            daemon.server.request_stop()
            header, content, out = future.result(10)
            assert header["status"] == "ok", content
    finally:
        daemon.server.request_stop()
        daemon.thread.join(30)
        assert not daemon.thread.is_alive()
        daemon.ctx.term()
