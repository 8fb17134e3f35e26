"""Property tests of the decoder and of the daemon's answer to anything: whatever msgpack
structures and frame lists a client sends, decoding either succeeds or raises
:class:`ProtocolViolation`, a reply always packs, and the daemon answers every message exactly
once (an in-process daemon on the stand-in runtime, see ``test_daemon_support``)."""
from __future__ import annotations

from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_daemon_support import InprocDaemon, add_model
from vkpool.daemon import protocol as P
from vkpool.daemon.client import parse_reply

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
           | st.floats() | st.text(max_size=12) | st.binary(max_size=12))
keys = st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=12)
shapes = st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1) | st.integers(min_value=0, max_value=8),
                  max_size=4)
metas = st.lists(st.fixed_dictionaries({"name": st.text(max_size=3) | values, "dtype": st.sampled_from(P.DTYPES)
                                        | values, "shape": shapes | values}) | values, max_size=3)
#: every request a client may send but the two that change the daemon's life (shutdown) or read
#: files by path (load_model): their handling is the same code as the others' up to the action
ACTIONS = [a for a in P.MESSAGES if a not in ("shutdown", "load_model")]
FIELDS = sorted({f.name for m in P.MESSAGES.values() for f in m.request})


def headers(model: str = "m") -> Any:
    return st.fixed_dictionaries(
        {"v": st.sampled_from([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION, 0]) | values,
         "id": st.text(min_size=1, max_size=6) | values,
         "type": st.sampled_from([f"{a}_request" for a in ACTIONS]) | values},
        optional={"extra": values, b"id": values})


def contents(model: str = "m") -> Any:
    return st.dictionaries(st.sampled_from(FIELDS) | keys,
                           st.just(model) | metas | values, max_size=5) | values


frames = st.lists(st.binary(max_size=48), max_size=4)


def _packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@FUZZ
@given(header=headers(), content=contents(), raw=frames)
def test_decoding_any_structure_succeeds_or_raises_a_protocol_violation(header: Any, content: Any,
                                                                         raw: list[bytes]) -> None:
    try:
        decoded, fields, rest = P.decode_request([_packed(header), _packed(content), *raw])
    except P.ProtocolViolation as exc:
        assert exc.type in P.ERROR_TYPES
        return
    assert decoded["id"] == header["id"] and rest == raw
    P.validate(P.MESSAGES[P.action_of(decoded)].request, fields, "again")  # what passed once passes again


@FUZZ
@given(described=metas, raw=frames)
def test_decoding_any_tensor_description_succeeds_or_raises_a_protocol_violation(described: Any,
                                                                                 raw: list[bytes]) -> None:
    try:
        arrays = P.decode_tensors(described, raw, "inputs")
    except P.ProtocolViolation as exc:
        assert exc.type in ("InvalidRequest", "InvalidTensor")
        _, packed = P.pack_content("error", {"type": exc.type, "message": exc.message, "details": exc.details})
        assert P.unpack(packed)["type"] == exc.type  # the error it raises always travels
        return
    assert [a.nbytes for a in arrays.values()] == [len(f) for f in raw]


@FUZZ
@given(raw=st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_decoding_any_bytes_succeeds_or_raises_a_protocol_violation(raw: list[bytes]) -> None:
    try:
        P.decode_request(raw)
    except P.ProtocolViolation:
        pass


@FUZZ
@given(status=st.sampled_from(["ok", "error"]), content=st.dictionaries(keys, values, max_size=4)
       | st.fixed_dictionaries({"type": values, "message": values, "details": values}))
def test_every_reply_content_packs(status: str, content: dict[Any, Any]) -> None:
    sent, packed = P.pack_content(status, content)
    reply = P.unpack(packed)
    assert isinstance(reply, dict)
    assert sent == status or (sent == "error" and reply["type"] in ("InternalError", str(content.get("type"))))


class Sender:
    """A DEALER on an in-process daemon holding one model."""

    def __init__(self, daemon: InprocDaemon) -> None:
        self.sock = daemon.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(daemon.endpoint)
        self.sock.send_multipart([P.DELIMITER, _packed(P.request_header("load_model", "load")),
                                  _packed({}), add_model()])
        header, content, _ = self.replies(1)[0]
        assert header["status"] == "ok", content
        self.model = content["model"]["id"]

    def replies(self, n: int, timeout_ms: int = 5000) -> list[Any]:
        out = []
        while len(out) < n and self.sock.poll(timeout_ms):
            reply = parse_reply(self.sock.recv_multipart(copy=False))
            if reply is not None:
                out.append(reply)
        return out


@pytest.fixture(scope="module")
def sender() -> Iterator[Sender]:
    daemon = InprocDaemon(max_frames=8, max_message_bytes=1 << 16)
    try:
        client = Sender(daemon)
        yield client
        client.sock.close(0)
        with daemon.client() as watcher:
            c = watcher.status()["counters"]
        assert c["in_flight"] == 0 and c["accepted"] == c["ok"] + c["error"] + c["client_gone"], c
    finally:
        daemon.stop()


@FUZZ
@given(data=st.data())
def test_the_daemon_answers_every_message_once(sender: Sender, data: st.DataObject) -> None:
    header = data.draw(headers())
    content = data.draw(contents(sender.model))
    raw = data.draw(frames)
    body = [P.DELIMITER, _packed(header), _packed(content), *raw]
    if data.draw(st.booleans()):  # infer with real tensors now and then, to reach the runtime
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        tensor_metas, tensor_frames = P.tensor_frames([("x", x)])
        body = [P.DELIMITER, _packed({**header, "type": "infer_request"}),
                _packed({"model": sender.model, "inputs": tensor_metas, **(content if isinstance(content, dict) else {})}),
                *tensor_frames]
    sender.sock.send_multipart(body)
    replies = sender.replies(1)
    assert len(replies) == 1, f"no reply to {body[:3]}"
    assert sender.replies(1, timeout_ms=0) == []  # and only one
    header_back = replies[0][0]
    rid = header.get("id")
    if isinstance(rid, str) and header_back["id"] is not None:
        assert header_back["id"] == rid
