"""The protocol module round-trips every message, and docs/protocol.md matches it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from vkpool.daemon import protocol as P

REPO = Path(__file__).resolve().parents[1]

SAMPLES: dict[str, Any] = {
    "str": "vk0.1 ünïcode", "int": -7, "float": 0.125, "number": 2.5, "bool": True,
    "list": [1, "two", {"three": 3.0}, None], "map": {"a": [1, 2], "b": {"c": None}}, "any": "512MiB",
}


def sample_content(fields: tuple[P.Field, ...]) -> dict[str, Any]:
    return {f.name: SAMPLES[f.kind] for f in fields}


@pytest.fixture(scope="module")
def pair() -> Any:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://protocol-test")
    dealer.connect("inproc://protocol-test")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


@pytest.mark.parametrize("action", list(P.MESSAGES))
def test_every_request_and_reply_round_trips_over_inproc(pair: Any, action: str) -> None:
    router, dealer = pair
    message = P.MESSAGES[action]
    content = sample_content(message.request)
    blob = np.arange(6, dtype=np.int16).reshape(2, 3)
    dealer.send_multipart(P.encode(P.request_header(action, "r-1"), content, [memoryview(blob)]))
    routing, body = P.split_routing(router.recv_multipart(copy=False))
    assert len(routing) == 1
    header, got, frames = P.decode_request(body)
    assert header == {"v": P.PROTOCOL_VERSION, "id": "r-1", "type": f"{action}_request"}
    assert got == content
    assert bytes(frames[0].buffer) == blob.tobytes()

    reply = sample_content(message.reply)
    router.send_multipart([*routing, *P.encode(P.reply_header(action, "r-1", "ok"), reply)])
    _, body = P.split_routing(dealer.recv_multipart())
    assert P.unpack(body[0]) == {"v": P.PROTOCOL_VERSION, "id": "r-1", "type": f"{action}_reply",
                                 "status": "ok"}
    assert P.unpack(body[1]) == reply
    P.validate(message.reply, reply, action)


@pytest.mark.parametrize("dtype", P.DTYPES)
def test_tensors_of_every_dtype_round_trip_zero_copy(pair: Any, dtype: str) -> None:
    router, dealer = pair
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((3, 5)) * 50).astype(dtype)
    b = np.asfortranarray(rng.standard_normal((4, 2)) * 9).astype(dtype)  # made contiguous once
    empty = np.zeros((0, 3), dtype)
    metas, frames = P.tensor_frames([("a", a), ("b", b), ("empty", empty)])
    dealer.send_multipart(P.encode(P.request_header("infer", "t"), {"model": "m", "inputs": metas}, frames),
                          copy=False)
    _, body = P.split_routing(router.recv_multipart(copy=False))
    _, content, raw = P.decode_request(body)
    got = P.decode_tensors(content["inputs"], raw, "inputs")
    assert list(got) == ["a", "b", "empty"]
    for want, have in zip((a, b, empty), got.values()):
        assert have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(have, want)


def test_big_endian_arrays_travel_little_endian() -> None:
    a = np.arange(4, dtype=">i4")
    metas, frames = P.tensor_frames([("a", a)])
    got = P.decode_tensors(metas, frames, "x")["a"]
    assert got.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got, a)


@pytest.mark.parametrize("frames, error", [
    ([], "ProtocolError"),
    ([b"\xc1garbage", b"\x80"], "ProtocolError"),
    ([msgpack.packb([1, 2]), b"\x80"], "ProtocolError"),
    ([msgpack.packb({"v": 99, "id": "x", "type": "hello_request"}), b"\x80"], "VersionMismatch"),
    ([msgpack.packb({"v": 1, "id": "x", "type": "explode_request"}), b"\x80"], "UnknownRequest"),
    ([msgpack.packb({"v": 1, "id": "", "type": "hello_request"}), b"\x80"], "ProtocolError"),
    ([msgpack.packb({"v": 1, "id": "x", "type": "infer_request"}), msgpack.packb({"model": "m"})],
     "InvalidRequest"),
    ([msgpack.packb({"v": 1, "id": "x", "type": "cancel_request"}), msgpack.packb({"request_id": 5})],
     "InvalidRequest"),
    ([msgpack.packb({"v": 1, "id": "x", "type": "hello_request"}), msgpack.packb({"evil": 1})],
     "InvalidRequest"),
    ([msgpack.packb({"v": 1, "id": "x", "type": "hello_request"}), b"\xc1"], "ProtocolError"),
])
def test_bad_requests_raise_the_named_error(frames: list[bytes], error: str) -> None:
    with pytest.raises(P.ProtocolViolation) as info:
        P.decode_request(frames)
    assert info.value.type == error


@pytest.mark.parametrize("meta, data, fragment", [
    ({"name": "x", "dtype": "complex64", "shape": [1]}, b"\0" * 8, "unknown dtype"),
    ({"name": "x", "dtype": "float32", "shape": [2, 2]}, b"\0" * 12, "needs 16 bytes"),
    ({"name": "x", "dtype": "float32", "shape": [-1]}, b"", "non-negative"),
    ({"name": "x", "dtype": "float32", "shape": "4"}, b"\0" * 16, "non-negative"),
    ({"name": "x", "dtype": "float32"}, b"", "exactly name, dtype, shape"),
    ({"name": 3, "dtype": "float32", "shape": [0]}, b"", "unique string"),
])
def test_bad_tensors_are_invalid_tensor(meta: dict[str, Any], data: bytes, fragment: str) -> None:
    with pytest.raises(P.ProtocolViolation) as info:
        P.decode_tensors([meta], [data], "inputs")
    assert info.value.type == "InvalidTensor" and fragment in info.value.message


def test_frame_count_mismatch_is_invalid_tensor() -> None:
    meta = {"name": "x", "dtype": "uint8", "shape": [1]}
    with pytest.raises(P.ProtocolViolation, match="2 tensor\\(s\\) described"):
        P.decode_tensors([meta, {**meta, "name": "y"}], [b"\0"], "inputs")


def test_docs_embed_the_generated_reference() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    begin, end = "<!-- BEGIN GENERATED REFERENCE -->\n", "<!-- END GENERATED REFERENCE -->"
    assert begin in doc and end in doc, "docs/protocol.md lost its generated-reference markers"
    embedded = doc.split(begin, 1)[1].split(end, 1)[0]
    assert embedded == P.render_markdown(), (
        "docs/protocol.md is out of date: paste `python -m vkpool.daemon.protocol` between the markers")
    for name in P.ERROR_TYPES:
        assert f"`{name}`" in doc


@pytest.mark.parametrize("rid", ["a", "abcdef12-123456", "x" * 31, "é" * 15, "x" * 32, "é" * 16, "", None])
@pytest.mark.parametrize("kind, status", [("infer_request", None), ("infer_reply", "ok"), ("error_reply", "error")])
def test_packed_headers_equal_msgpack_and_their_id_is_found_only_where_it_is_short(
        rid: str | None, kind: str, status: str | None) -> None:
    header = {"v": P.PROTOCOL_VERSION, "id": rid, "type": kind}
    if status is not None:
        header["status"] = status
    packed = P.packed_header(kind, rid, status)
    assert packed == P.pack(header) and P.pack_id(rid) == P.pack(rid)
    found = P.packed_id(packed, *P.header_parts(kind, status))
    short = isinstance(rid, str) and 0 < len(rid.encode()) < 32
    assert (found is not None) == short
    if short:
        assert P.unpack(found) == rid
    # another kind, status or key order is not taken for this one
    assert P.packed_id(packed, *P.header_parts("cancel_request")) is None
    assert P.packed_id(P.pack(dict(reversed(header.items()))), *P.header_parts(kind, status)) is None


@pytest.mark.parametrize("rid", ["a", "x" * 31, "é" * 15, "x" * 32, "", None])
@pytest.mark.parametrize("kind", ["infer_request", "cancel_request"])
def test_the_daemon_reads_a_packed_header_as_unpacking_it_would(rid: str | None, kind: str) -> None:
    from vkpool.daemon.server import _peek_header

    packed = P.packed_header(kind, rid)
    for frame in (packed, memoryview(packed)):
        read = _peek_header([frame])
        assert read == P.unpack(packed) and list(read) == list(P.unpack(packed))
    prefix, suffix = P.header_parts("infer_request")
    with pytest.raises(P.ProtocolViolation, match="not valid msgpack"):  # an id that is not UTF-8
        _peek_header([prefix + bytes([0xA0 | 2]) + b"\xff\xfe" + suffix])


def test_infer_reply_contents_unpack_and_are_read_back_by_layout() -> None:
    small, large = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((64, 64), np.float32)
    strided = np.arange(16, dtype=np.int32).reshape(4, 4)[:, ::2]
    replies, outputs = P.InferReplies(), P.InferOutputs()
    for _ in range(2):  # the second time from the remembered heads and layouts
        content, frames = replies.pack(["s", "l", "t"], [small, large, strided], 0.25, 0.5)
        assert P.unpack(content) == {"outputs": [P.tensor_meta("s", small), P.tensor_meta("l", large),
                                                 P.tensor_meta("t", strided)], "queue_s": 0.25, "run_s": 0.5}
        for got, want in zip(outputs.read(content, frames), [small, large, strided]):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(P.ProtocolViolation, match="do not match"):
            outputs.read(content, [frames[0], frames[1], b"\0" * 4])


def test_lane_pack_into_writes_what_lane_parse_reads_or_nothing_when_it_does_not_fit() -> None:
    slot = memoryview(bytearray(1 << 16))
    big = np.arange(8192, dtype=np.float32)
    for parts in ([b"h", b"", b"raw"], [b"h", b"c", memoryview(big).cast("B")]):
        assert P.lane_pack_into(slot, [b"skipped", *parts], 1) == sum(map(len, parts))
        assert [bytes(f) for f in P.lane_parse(slot)] == [bytes(p) for p in parts]
    before = bytes(slot)
    assert P.lane_pack_into(slot, [b"h", b"c", bytes(1 << 16)]) is None and bytes(slot) == before
