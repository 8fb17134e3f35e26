"""Bound infers over ZeroMQ (``vkpool.daemon.bound``, ``FrameBinding``): an infer bound once, then
carried as one frame each way. A real ``vkpool serve`` subprocess on lavapipe, clients without
the local lane, a raw DEALER for frames no client would send."""
from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from test_daemon_bound import (
    balanced,
    batching_clients,
    framed_give_the_same,
    refusals_drop_and_remake_bindings,
    runs_match,
)
from test_daemon_e2e import Daemon, run_clients
from test_daemon_support import mlp_model, short_folder
from vkpool.daemon import protocol as P
from vkpool.daemon.bound import FRAME_HEAD, REPLY_MAGIC, REQUEST_MAGIC
from vkpool.daemon.client import Client

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with short_folder("vkfb") as path:
        d = Daemon(path, daemon={"inline_run_max": "1s"})  # every run quick enough to run where read
        yield d
        assert d.stop() == 0


def zmq_client(daemon: Daemon) -> Client:
    return daemon.client(local_lane=False)


def test_bound_infers_over_zeromq_match_in_process_runs_and_framed_ones(daemon: Daemon) -> None:
    from vkpool.session import Session

    path = daemon.folder / "mlp.onnx"
    path.write_bytes(mlp_model(8, 16, seed=21))
    rng = np.random.default_rng(3)
    sent: list[int] = []
    with zmq_client(daemon) as client, Session(str(path)) as local:
        real_send = P.send_parts

        def counting(sock, parts, **kw):
            sent.append(len(parts))
            return real_send(sock, parts, **kw)

        before = balanced(client)
        session = client.session(path)
        P.send_parts = counting
        try:
            xs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(20)]
            runs_match(session, local, xs)
        finally:
            P.send_parts = real_send
        assert not client._lanes and len(client._frame_bound) == 1 and not client._frame_unbound
        # the bind (its header, content and tensor after the delimiter), then one frame per infer
        assert sent == [4] + [1] * 20
        # one output asked for: a binding of its own
        (y,) = session.run(["y"], {"x": xs[0]})
        np.testing.assert_array_equal(y, local.run(["y"], {"x": xs[0]})[0])
        assert len(client._frame_bound) == 2
        framed_give_the_same(session, local, xs[:3], client._frame_bound, client._frame_unbound)
        after = balanced(client)
    assert after["error"] == before["error"]
    # the first status, the load, two binds, 21 bound infers, 3 framed
    assert after["ok"] - before["ok"] == 1 + 1 + 2 + 21 + 3


def raw_dealer(daemon: Daemon, ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    return sock


def reply_to(sock: zmq.Socket) -> tuple[dict, dict]:
    assert sock.poll(10_000), "no reply within 10 s"
    frames = sock.recv_multipart()
    assert frames[0] == P.DELIMITER, frames[:1]
    return P.unpack(frames[1]), P.unpack(frames[2])


def test_bad_bound_frames_are_answered_by_their_sequence_number_and_the_daemon_keeps_serving(
        daemon: Daemon) -> None:
    """Frames no vkpool client sends, from a raw DEALER: a binding never made, a frame of the wrong
    length, one cut inside its head; each answered ``InvalidRequest`` by the id ``frame-`` + its
    sequence number (what can be read of it), and the daemon goes on answering bound infers."""
    from vkpool.session import Session

    path = daemon.folder / "raw.onnx"
    path.write_bytes(mlp_model(8, 16, seed=22))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    ctx = zmq.Context()
    sock = raw_dealer(daemon, ctx)
    try:
        with zmq_client(daemon) as client, Session(str(path)) as local:
            before = balanced(client)
            # the raw socket binds through the protocol as a client would
            sock.send_multipart([P.DELIMITER, P.packed_header("hello_request", "h"), P.pack({"client": "raw"})])
            assert reply_to(sock)[0]["status"] == "ok"
            sock.send_multipart([P.DELIMITER, P.packed_header("load_model_request", "l"),
                                 P.pack({"path": str(path)})])
            header, content = reply_to(sock)
            assert header["status"] == "ok", content
            model = content["model"]["id"] if isinstance(content["model"], dict) else content["model"]
            sock.send_multipart([P.DELIMITER, P.packed_header("bind_infer_request", "b"), P.pack(
                {"model": model, "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 8]}]}), x.tobytes()])
            header, content = reply_to(sock)
            assert header["status"] == "ok" and content == {"binding": 0, "offsets": [64]}, content
            frame = bytearray(64 + 32)
            frame[64:] = x.tobytes()
            # a model not yet timed runs queued, answered framed by the id; once timed, a record
            for seq in range(3):
                FRAME_HEAD.pack_into(frame, 0, REQUEST_MAGIC, 0, seq)
                sock.send(bytes(frame))
                assert sock.poll(10_000)
                reply = sock.recv_multipart()
                if len(reply) > 1:
                    assert P.unpack(reply[1])["id"] == f"frame-{seq}" and P.unpack(reply[1])["status"] == "ok", \
                        P.unpack(reply[2])
            assert len(reply) == 1 and reply[0][:4] == REPLY_MAGIC and FRAME_HEAD.unpack_from(reply[0])[2] == 2
            (count,) = struct.unpack_from("<I", reply[0], 64)
            assert count == 2  # the model's two outputs, in a record
            for bad, seq, what in ((struct.pack("<4sIQ", REQUEST_MAGIC, 5, 8) + bytes(32), 8, "no binding 5"),
                                   (bytes(frame[:80]), 2, "is 96 bytes, got 80")):
                sock.send(bad)
                header, content = reply_to(sock)
                assert header["id"] == f"frame-{seq}" and header["status"] == "error", header
                assert content["type"] == "InvalidRequest" and what in content["message"], content
            # the client's own bound infers go on
            session = client.session(path)
            for g, w in zip(session.run(None, {"x": x}), local.run(None, {"x": x}), strict=True):
                np.testing.assert_array_equal(g, w)
            after = balanced(client)
    finally:
        sock.close()
        ctx.term()
    # the two bad frames; the first status, the raw socket's hello, load, bind and three bound infers,
    # the client's load, bind and infer
    assert after["error"] - before["error"] == 2
    assert after["ok"] - before["ok"] == 1 + 6 + 3


def test_bad_inputs_unloaded_models_and_lost_bindings_over_zeromq(daemon: Daemon) -> None:
    """An input of the wrong dtype is refused at binding, as the infer would be; a model unloaded
    under a binding answers ``UnknownModel`` and drops the binding (loaded again, bound again); a
    binding the daemon does not know (as after a restart) is made again and the infer answered."""
    from vkpool.session import Session

    path = daemon.folder / "bad.onnx"
    path.write_bytes(mlp_model(8, 16, seed=23))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with zmq_client(daemon) as client, Session(str(path)) as local:
        want = local.run(None, {"x": x})
        before = balanced(client)
        session = client.session(path, keep_alive=0)
        session.run(None, {"x": x})
        session = refusals_drop_and_remake_bindings(client, session, path, x, want, lambda: client._frame_bound)
        [bound] = client._frame_bound.values()
        bound.index = 40  # a number the daemon never gave this client
        for g, w in zip(session.run(None, {"x": x}), want, strict=True):
            np.testing.assert_array_equal(g, w)
        [bound] = client._frame_bound.values()
        assert bound.index == 2  # bound again: the third binding the daemon made for this client
        after = balanced(client)
    # the dtype, the unloaded model, the lost binding
    assert after["error"] - before["error"] == 3


def test_a_batching_model_batches_bound_infers_of_several_processes_over_zeromq(daemon: Daemon) -> None:
    """Bound infers of a batching model are queued with the framed ones and run as batches, answered
    framed by their ids; every output equals the reference."""
    code = batching_clients(", local_lane=False", "pass", 30,
                            "len(client._frame_bound) == 3, client._frame_bound  # one per batch size sent")
    from pathlib import Path

    tests = str(Path(__file__).parent)
    with zmq_client(daemon) as watcher:
        before = balanced(watcher)
        run_clients(code, [[daemon.endpoint, str(i), tests] for i in range(3)])
        after = balanced(watcher)
        [info] = [m for m in watcher.list_models() if m["batching"] and m["batching"]["max_batch"] == 8]
    assert after["error"] == before["error"]
    assert after["ok"] - before["ok"] >= 3 * 2 * 30
    stats = info["batching"]
    assert stats["requests"] >= 3 * 2 * 30 and stats["rows"] >= stats["requests"]



def test_a_quick_infer_reply_brings_a_sleeping_zeromq_client_back_to_polling(daemon: Daemon) -> None:
    """The client's usual infer wait (whether it polls for a reply or sleeps) counts infers only,
    and one quick reply while it says sleep sets it: a client kept asleep by slow replies, or by
    the wake-ups of sleeping, polls again from its first quick reply."""
    path = daemon.folder / "usual.onnx"
    path.write_bytes(mlp_model(8, 16, seed=25))
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with zmq_client(daemon) as client:
        session = client.session(path)
        for _ in range(3):
            session.run(None, {"x": x})
        client._spin.max_s = 5.0  # every reply on this machine is "quick"
        client._reply_s = 10.0    # asleep
        client.status()
        assert client._reply_s == 10.0  # not an infer
        session.run(None, {"x": x})
        assert client._reply_s < client._spin.max_s
