"""The vkpool wire protocol: the single source of truth.

Every message is a ZeroMQ multipart message (the layout follows jupyter_client's):

    [routing frames...] DELIMITER header content [raw frame...]

- routing frames are added by ROUTER sockets (a DEALER client sends none);
- ``DELIMITER`` is the fixed frame ``b"<VKPOOL>"``;
- ``header`` is a msgpack map: ``v`` (protocol version), ``id`` (request id, chosen by the
  client, unique per client), ``type`` (``<action>_request`` / ``<action>_reply``) and, on
  replies, ``status`` (``ok`` or ``error``);
- ``content`` is a msgpack map whose fields are listed in :data:`MESSAGES`;
- raw frames carry binary data (tensor bytes, model bytes). Binary data is never put inside
  msgpack: a tensor is described in the content by ``{name, dtype, shape}`` and its bytes are
  the raw frame at the same position.

An ipc:// daemon also offers a *local lane* (``hello``'s ``local_lane``): a Unix stream socket
next to the ipc socket on which the same messages (header, content, raw frames; no routing
frames, no delimiter) travel length-prefixed (:func:`lane_send`, :class:`LaneReader`). Only the
messages marked ``transport="both"`` or ``"lane"`` may use it.

``docs/protocol.md`` embeds :func:`render_markdown`; a test keeps the two identical.
"""
from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import numpy as np
import zmq

#: pyzmq's flags and socket options as plain ints: its enum members cost a Python-level enum
#: operation at each use (``|``, ``&``, the option's lookup), about a microsecond on the request
#: path per frame
SNDMORE, NOBLOCK, EVENTS, POLLIN = (int(f) for f in (zmq.SNDMORE, zmq.NOBLOCK, zmq.EVENTS, zmq.POLLIN))

PROTOCOL_VERSION = 1
DELIMITER = b"<VKPOOL>"

#: dtypes a tensor may travel as (little-endian numpy names).
DTYPES: tuple[str, ...] = (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool",
)


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # str | int | float | number | bool | list | map | any
    required: bool
    doc: str
    nullable: bool = False


@dataclass(frozen=True)
class Message:
    action: str
    doc: str
    request: tuple[Field, ...]
    reply: tuple[Field, ...]
    request_frames: str = "none"
    reply_frames: str = "none"
    control: bool = False  # answered by the I/O thread, never queued behind compute
    transport: str = "zmq"  # zmq | both (ZeroMQ or the local lane) | lane (the local lane only)


def _f(name: str, kind: str, doc: str, *, required: bool = True, nullable: bool = False) -> Field:
    return Field(name, kind, required, doc, nullable)


_TENSOR_LIST = "list of `{name, dtype, shape}`, one per raw frame, in frame order"
_INFER_REQUEST = (
    _f("model", "str", "model id"),
    _f("inputs", "list", _TENSOR_LIST),
    _f("outputs", "list", "wanted output names; null = all", required=False, nullable=True),
    _f("priority", "int", "higher runs first within a client's queue", required=False),
    _f("timeout", "number", "seconds from acceptance; null = the config default", required=False, nullable=True))
_MODEL_INFO = (
    "`{id, name, binding, objective, batching, inputs, outputs, memory_by_member, members, refs, keep_alive, "
    "idle_s, queued, running, done}`; `binding` is `{batch, dims}` as loaded (empty when nothing was bound); "
    "`objective` is what the model's plan was made for (`latency` or `throughput`); "
    "`batching` is null, or for a model that batches requests `{max_batch, max_queue_delay, batches, "
    "requests, rows, padded_rows, failed_batches, where_read, mean_batch_size, queue_delay_p50_us, "
    "queue_delay_p99_us}` (with `queue_delays_us` as well when the request asked for `samples`: the last "
    "1000 queue delays, oldest first) "
    "(its first dim is then `\"batch\"`); `inputs`/`outputs` are lists of `{name, shape, type, dtype}`"
)

MESSAGES: dict[str, Message] = {m.action: m for m in (
    Message("hello", "Handshake: checks the version and returns the daemon's limits.",
            request=(_f("client", "str", "free-form client name for logs", required=False),),
            reply=(_f("server_version", "str", "vkpool version of the daemon"),
                   _f("protocol_version", "int", "the daemon's protocol version"),
                   _f("pid", "int", "daemon process id"),
                   _f("limits", "map", "`{max_message_bytes, max_frames, queue_limit}`"),
                   _f("local_lane", "map", "`{path, token}` of the local lane (see *Local lane*) on an "
                      "ipc:// daemon that offers one; null over TCP or when disabled", nullable=True),
                   _f("redirect", "str", "only from a daemon with `process_per_device`: the endpoint of the "
                      "serving process this client is given; send every request but those of *The front* "
                      "there, starting with a `hello`", required=False),
                   _f("serving", "list", "only with `redirect`: the serving processes, `{member, endpoint, pid, "
                      "state, restarts, clients}`; `state` is `serving`, `starting`, `exited`, or `not answering` "
                      "(it did not answer the front's last request for every process within 5 s; the front asks "
                      "them all at once, so `status` waits 5 s at most however many hang)", required=False)),
            control=True),
    Message("devices", "The pool members with their budgets and use.",
            request=(),
            reply=(_f("members", "list", "list of `{id, kind, name, budget_bytes, used_bytes}`; `name` is "
                      "the device's name as its driver reports it (`host CPU` for the host member)"),),
            control=True),
    Message("load_model", "Loads a model (or shares the already loaded copy with the same content) "
            "and takes a reference for this client.",
            request=(_f("path", "str", "path on the daemon's file system; omit to send bytes",
                        required=False, nullable=True),
                     _f("name", "str", "display name", required=False, nullable=True),
                     _f("keep_alive", "number", "seconds the model stays loaded once unused; "
                        "negative = forever; default from the config", required=False, nullable=True),
                     _f("batch", "int", "value of the inputs' symbolic first (batch) dims; default 1",
                        required=False, nullable=True),
                     _f("dims", "map", "`{dim name: value}` for named symbolic dims", required=False,
                        nullable=True),
                     _f("max_batch", "int", "batch requests along the model's symbolic first dim, up to this "
                        "many rows per run (1..4096); default from the config's `daemon.batching` rules, else "
                        "no batching", required=False, nullable=True),
                     _f("max_queue_delay", "number", "seconds the first request of a batch may wait for "
                        "company (0..10; default 0: only what is queued already), at most: the wait ends "
                        "once every client of the batch answered last has as many requests in it as it "
                        "had there; needs `max_batch`",
                        required=False, nullable=True),
                     _f("objective", "str", "what the plan is made for: `latency` (the default: the plan "
                        "that runs one request soonest, the model whole on one member when one holds it) or "
                        "`throughput` (the most requests per second: a whole copy on every member that holds "
                        "one, or pipeline stages); a model loaded already with the other objective is refused",
                        required=False, nullable=True)),
            reply=(_f("model", "map", _MODEL_INFO),
                   _f("shared", "bool", "true when the model was already loaded with the same binding")),
            request_frames="one frame with the ONNX bytes when `path` is absent"),
    Message("list_models", "The loaded models, where each lives and its memory per member.",
            request=(_f("samples", "bool", "also the queue delays behind each batching model's percentiles "
                        "(`queue_delays_us` in its `batching`), for merging them; the front of a daemon "
                        "with `process_per_device` asks for them", required=False),),
            reply=(_f("models", "list", "list of " + _MODEL_INFO),),
            control=True),
    Message("plan", "The plan of a loaded model, or what it would be under other budgets.",
            request=(_f("model", "str", "model id"),
                     _f("budgets", "map", "what-if budgets `{member: bytes or size string}`",
                        required=False, nullable=True)),
            reply=(_f("text", "str", "the plan rendered as text"),
                   _f("plan", "map", "the plan as JSON")),
            ),
    Message("infer", "Runs a loaded model on the given inputs.",
            request=_INFER_REQUEST,
            reply=(_f("outputs", "list", _TENSOR_LIST),
                   _f("queue_s", "float", "seconds spent queued"),
                   _f("run_s", "float", "seconds spent running")),
            request_frames="one per input tensor", reply_frames="one per output tensor", transport="both"),
    Message("bind_infer", "Lays out infers of these inputs' names, dtypes and shapes in the lane's ring, "
            "or over ZeroMQ in one frame (see *Bound infers*). Checked as `infer` is, with the inputs an "
            "infer would carry; nothing runs.",
            request=_INFER_REQUEST,
            reply=(_f("binding", "int", "the binding's number; null: send these infers framed (they do not "
                      "fit the ring's half or `max_message_bytes`, the lane has no ring, or the lane or "
                      "client has 64 bindings)", nullable=True),
                   _f("offsets", "list", "each input's byte offset in the request half (on a lane) or in a "
                      "bound infer's frame (over ZeroMQ), in the order of `inputs`")),
            request_frames="one per input tensor", reply_frames="none", transport="both"),
    Message("cancel", "Cancels a queued or running infer of this client.",
            request=(_f("request_id", "str", "id of the infer request"),),
            reply=(_f("cancelled", "bool", "true when the infer was answered `Cancelled`"),
                   _f("state", "str", "`queued`, `running` or `unknown` (finished or never seen)")),
            control=True, transport="both"),
    Message("unload_model", "Drops this client's reference; the model is freed once unused for its "
            "keep-alive.",
            request=(_f("model", "str", "model id"),
                     _f("now", "bool", "free it as soon as no reference is left, ignoring its keep-alive "
                        "(allowed without holding a reference)", required=False)),
            reply=(_f("model", "str", "model id"),
                   _f("refs", "int", "references left (all clients)"),
                   _f("unloaded", "bool", "true when the model's memory was freed now"))),
    Message("set_budget", "Changes a member's budget at run time; affected models are re-planned, "
            "or the change is refused with the reason.",
            request=(_f("member", "str", "pool member id"),
                     _f("size", "any", "bytes (int) or a size string such as `512MiB`")),
            reply=(_f("member", "str", "pool member id"),
                   _f("budget_bytes", "int", "the new budget"),
                   _f("replanned", "list", "ids of the models re-planned"))),
    Message("status", "Members, models, queue depths, counters, throughput and latency.",
            request=(_f("samples", "bool", "also the latencies behind `latency_ms` (`latency_samples_ms`) and "
                        "each batching model's queue delays (as in `list_models`), for merging them; the front "
                        "of a daemon with `process_per_device` asks for them", required=False),),
            reply=(_f("uptime_s", "float", "seconds since start"),
                   _f("members", "list", "as in `devices`"),
                   _f("models", "list", "as in `list_models`"),
                   _f("loading", "list", "models being loaded: `{name, path, elapsed_s, stage, what, done, total, "
                      "unit, fraction}`; `stage` is `hash` (identifying the file), `load` (reading), `upload` "
                      "(weights) or `compile` (pipelines), null before the first; `fraction` of the stage, "
                      "null when unknown"),
                   _f("queues", "map", "`{model id: queued jobs}`"),
                   _f("counters", "map", "`{accepted, ok, error, client_gone, in_flight, dropped, "
                      "busy, retries, connections, lanes, replay_bytes}` from before this request; accepted = "
                      "ok + error + client_gone + in_flight; `lanes`: local lane connections open; "
                      "`replay_bytes`: the replies kept for retried request ids (at most `replay_window` "
                      "replies and 64 MiB)"),
                   _f("jobs_per_s", "float", "infer replies per second over the last minute"),
                   _f("latency_ms", "map", "`{p50, p90, p99}` of infer latency over the last 1000 jobs"),
                   _f("latency_samples_ms", "list", "only when the request asked for `samples`: those 1000 "
                      "latencies (fewer before 1000 jobs), oldest first", required=False),
                   _f("draining", "bool", "true once shutdown began"),
                   _f("processes", "list", "only from the front of a daemon with `process_per_device`: its "
                      "serving processes as in `hello`'s `serving`; the counters and jobs/s are then their sums, "
                      "the latency percentiles those of all their samples together (the last 1000 jobs of "
                      "each), and so are each model's queue delays", required=False)),
            control=True),
    Message("shutdown", "Stops accepting, drains in-flight jobs within the drain deadline, exits.",
            request=(),
            reply=(_f("draining", "bool", "always true"),
                   _f("in_flight", "int", "jobs being drained")),
            control=True),
    Message("open_lane", "The first message on a local lane connection: binds it to the ZeroMQ client "
            "that was given the token. Refused with `TooManyConnections` when the daemon has "
            "`max_lane_connections` lanes open; the daemon then closes the connection.",
            request=(_f("client", "str", "the client's ZeroMQ routing id, hex"),
                     _f("token", "str", "`local_lane.token` from this client's `hello` reply"),
                     _f("ring", "bool", "ask for a shared-memory ring beside the socket (see *Ring*)",
                        required=False)),
            reply=(_f("ring", "int", "bytes of each of the ring's two halves when one was granted (its "
                      "file descriptor travels with this reply), else null", nullable=True),),
            control=True, transport="lane"),
)}

_ACTION_OF: dict[str, str] = {f"{action}_{side}": action for action in MESSAGES for side in ("request", "reply")}

#: error type -> when it is sent. The client raises the exception class of the same name.
ERROR_TYPES: dict[str, str] = {
    "ProtocolError": "the frames could not be decoded (missing delimiter, bad msgpack, bad header)",
    "VersionMismatch": "the header's protocol version is not the daemon's",
    "UnknownRequest": "the header's type names no request",
    "InvalidRequest": "a content field is missing, unknown or of the wrong type",
    "InvalidTensor": "a tensor's dtype, shape, name or byte size is wrong, or the frame count differs",
    "MessageTooLarge": "the message exceeds `max_message_bytes` or `max_frames`",
    "Busy": "the queue is full; retry later",
    "TooManyConnections": "the daemon is at `max_connections`; close idle clients",
    "Timeout": "the job did not finish within its timeout",
    "Cancelled": "the job was cancelled by its client",
    "ShuttingDown": "the daemon is stopping and no longer accepts, or could not drain, this job",
    "UnknownModel": "no loaded model has this id (or this client holds no reference to it)",
    "ModelError": "the file is not a valid ONNX model or its external data is unsafe",
    "UnsupportedOp": "the model uses an op vkpool has no kernel for",
    "InsufficientMemory": "the model does not fit the remaining budgets",
    "BudgetRefused": "a budget change was refused",
    "UnknownMember": "no pool member has this id",
    "FileNotFound": "the model path cannot be read by the daemon",
    "EngineError": "the engine failed while running the job",
    "Redirected": "this endpoint is a daemon's front (`process_per_device`): send the request to the "
                  "serving process in `hello`'s `redirect` (also in the details)",
    "ReplayUnavailable": "a retried request's reply was too large to keep; the first reply was sent",
    "InternalError": "a bug in the daemon; the message says what failed",
}


class ProtocolViolation(Exception):
    """A message that breaks the protocol; ``type`` is one of :data:`ERROR_TYPES`."""

    def __init__(self, type_: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        assert type_ in ERROR_TYPES, type_
        super().__init__(message)
        self.type = type_
        self.message = message
        self.details = dict(details or {})


# ---------------------------------------------------------------------------------------------
# Packing.

_packers = threading.local()  # msgpack.packb builds a Packer per call; each thread keeps one


def pack(obj: Any) -> bytes:
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


def pack_content(status: str, content: Mapping[str, Any] | bytes) -> tuple[str, bytes]:
    """The status and packed content of a reply, whatever the content holds: a reply is always
    sent. A content that msgpack refuses (an int beyond 64 bits in an error's details, a value
    of no msgpack type) is sent as an error whose details are the values' text, or, when even
    that fails, as ``InternalError``."""
    if isinstance(content, bytes):
        return status, content
    try:
        return status, pack(dict(content))
    except Exception as exc:  # msgpack raises several unrelated classes
        reason = f"{type(exc).__name__}: {exc}"
    if status == "error" and isinstance(content, Mapping):
        details = content.get("details")
        try:
            return status, pack({"type": str(content.get("type")), "message": str(content.get("message")),
                                 "details": {str(k): v if type(v) in (str, bool) else repr(v)[:200]
                                             for k, v in details.items()} if isinstance(details, Mapping) else {}})
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    return "error", pack({"type": "InternalError", "message": f"the reply could not be packed ({reason})"[:500],
                          "details": {}})


def unpack(data: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated classes
        raise ProtocolViolation("ProtocolError", f"frame is not valid msgpack: {exc}") from None


def request_header(action: str, request_id: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": f"{action}_request"}


def reply_header(action: str | None, request_id: str | None, status: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id,
            "type": f"{action}_reply" if action else "error_reply", "status": status}


def encode(header: Mapping[str, Any], content: Mapping[str, Any],
           frames: Sequence[Any] = ()) -> list[Any]:
    """The frames of one message after the routing frames."""
    return [DELIMITER, pack(dict(header)), pack(dict(content)), *frames]


_HEADER_PARTS: dict[tuple[str, str | None], tuple[bytes, bytes]] = {}
_FIXSTR = [bytes((0xA0 | n,)) for n in range(32)]  # msgpack's marker of a string of n < 32 bytes


def header_parts(kind: str, status: str | None = None) -> tuple[bytes, bytes]:
    """What comes before and after the packed request id in :func:`packed_header`'s bytes."""
    parts = _HEADER_PARTS.get((kind, status))
    if parts is None:
        head = {"v": PROTOCOL_VERSION, "id": None, "type": kind}
        if status is not None:
            head["status"] = status
        whole = pack(head)
        prefix = pack({"v": PROTOCOL_VERSION, "id": None})[:-1]  # the map length is patched below
        prefix = bytes([0x80 | len(head)]) + prefix[1:]
        parts = _HEADER_PARTS[(kind, status)] = (prefix, whole[len(prefix) + 1:])
    return parts


def packed_header(kind: str, request_id: str | None, status: str | None = None) -> bytes:
    """``pack(header)`` for a request (``status`` None) or a reply, from cached packed parts.

    The bytes equal ``pack`` of :func:`request_header` / :func:`reply_header` (same keys, same
    order); only the request id is packed per message.
    """
    prefix, suffix = _HEADER_PARTS.get((kind, status)) or header_parts(kind, status)
    return prefix + pack_id(request_id) + suffix


def pack_id(request_id: str | None) -> bytes:
    """``pack(request_id)``, without a call to msgpack for a string of fewer than 32 bytes."""
    if type(request_id) is str:
        raw = request_id.encode()
        if len(raw) < 32:
            return _FIXSTR[len(raw)] + raw
    return pack(request_id)


def packed_id(header: bytes, prefix: bytes, suffix: bytes) -> bytes | None:
    """The packed request id of a header packed as :func:`packed_header` packs one from
    ``prefix`` and ``suffix`` (see :func:`header_parts`), when that id is a string of 1 to 31
    bytes: a header with these bytes unpacks to the map they were packed from. None for any
    other header (which may still be valid: it is then unpacked)."""
    start = len(prefix)
    n = len(header) - start - len(suffix) - 1
    if 0 < n < 32 and header[start] == 0xA0 | n and header.startswith(prefix) and header.endswith(suffix):
        return header[start:start + 1 + n]
    return None


#: frames at least this large travel zero-copy; smaller ones are copied, which pyzmq does faster
#: than it builds the Frame object a zero-copy send or receive needs.
ZERO_COPY_MIN = 1 << 16


#: a tensor smaller than this travels as a copy of its bytes (``tobytes``), which costs less than
#: the byte view of the array (:func:`tensor_frames`) that larger ones travel as.
SMALL_FRAME = 1 << 12


def send_parts(sock: Any, parts: Sequence[Any], *, dontwait: bool = False) -> None:
    """Send a multipart message, copying only the small frames. ``dontwait``: raise ``zmq.Again``
    instead of waiting when the peer's queue is full (decided at the first frame: a multipart
    message goes whole or not at all)."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        flags = (SNDMORE if i < last else 0) | (NOBLOCK if dontwait and i == 0 else 0)
        sock.send(part, flags, copy=len(part) < ZERO_COPY_MIN)


def recv_parts(sock: Any, copied: int) -> list[Any]:
    """Receive a multipart message: the first ``copied`` frames as bytes, the rest (tensor and
    model bytes) as zero-copy frames. (A frame's ``more`` costs less than the socket's
    ``RCVMORE``, which pyzmq reads through an enum lookup.)"""
    frame = sock.recv(copy=False)
    parts: list[Any] = [frame.bytes]
    while frame.more:
        frame = sock.recv(copy=False)
        parts.append(frame.bytes if len(parts) < copied else frame)
    return parts


def split_routing(frames: Sequence[Any]) -> tuple[list[bytes], list[Any]]:
    """Split ``[routing..., DELIMITER, rest...]``; frames may be bytes or zmq.Frame."""
    for i, frame in enumerate(frames):
        if _bytes(frame) == DELIMITER:
            return [_bytes(f) for f in frames[:i]], list(frames[i + 1:])
    raise ProtocolViolation("ProtocolError", "no <VKPOOL> delimiter frame")


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame) if isinstance(frame, (bytes, bytearray, memoryview)) else frame.buffer


def decode_request(frames: Sequence[Any], header: dict[str, Any] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Header, validated content and raw frames of a request (frames after the delimiter).

    ``header``: the first frame already unpacked by the caller (it is then not unpacked again).
    """
    if len(frames) < 2:
        raise ProtocolViolation("ProtocolError", f"expected header and content frames, got {len(frames)} frame(s)")
    if header is None:
        header = unpack(_buffer(frames[0]))
    if not isinstance(header, dict):
        raise ProtocolViolation("ProtocolError", "header is not a map")
    request_id = header.get("id")
    if not isinstance(request_id, str) or not request_id:
        raise ProtocolViolation("ProtocolError", "header field `id` must be a non-empty string")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolViolation("VersionMismatch", f"protocol version {version!r} is not supported; "
                                f"this daemon speaks version {PROTOCOL_VERSION}",
                                {"expected": PROTOCOL_VERSION, "got": version})
    kind = header.get("type")
    action = kind[: -len("_request")] if isinstance(kind, str) and kind.endswith("_request") else None
    if action not in MESSAGES:
        raise ProtocolViolation("UnknownRequest", f"unknown request type {kind!r}",
                                {"known": sorted(f"{a}_request" for a in MESSAGES)})
    content = unpack(_buffer(frames[1]))
    if not isinstance(content, dict):
        raise ProtocolViolation("InvalidRequest", "content is not a map")
    validate(MESSAGES[action].request, content, f"{action}_request")
    return header, content, list(frames[2:])


def action_of(header: Mapping[str, Any]) -> str | None:
    kind = header.get("type")
    return _ACTION_OF.get(kind) if isinstance(kind, str) else None


def _finite(v: Any) -> bool:
    """An int, or a float that is neither NaN nor infinite (a NaN deadline never expires)."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


_KIND_CHECKS: dict[str, Any] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": _finite,
    "number": _finite,
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "map": lambda v: isinstance(v, dict),
    "any": lambda v: True,
}


def validate(fields: Iterable[Field], content: Mapping[str, Any], where: str) -> None:
    """Check required fields, types and that no unknown field is present."""
    fields = tuple(fields)
    known = {f.name for f in fields}
    # keys may be bytes as well as str (msgpack maps allow both): named by their text
    unknown = sorted(k if isinstance(k, str) else repr(k)[:100] for k in set(content) - known)
    if unknown:
        raise ProtocolViolation("InvalidRequest", f"{where}: unknown field(s) {unknown}",
                                {"unknown": unknown, "allowed": sorted(known)})
    for f in fields:
        if f.name not in content:
            if f.required:
                raise ProtocolViolation("InvalidRequest", f"{where}: missing field `{f.name}`",
                                        {"field": f.name})
            continue
        value = content[f.name]
        if value is None and (f.nullable or not f.required):
            continue
        if not _KIND_CHECKS[f.kind](value):
            got = repr(value) if isinstance(value, float) else type(value).__name__  # nan, inf
            raise ProtocolViolation("InvalidRequest", f"{where}: field `{f.name}` must be {f.kind}"
                                    f"{' (finite)' if f.kind in ('float', 'number') else ''}, got {got}",
                                    {"field": f.name, "expected": f.kind})


# ---------------------------------------------------------------------------------------------
# Tensors.

_DTYPE_OF: dict[str, np.dtype] = {name: np.dtype(name) for name in DTYPES}
_NAME_OF: dict[np.dtype, str] = {dtype: name for name, dtype in _DTYPE_OF.items()}


def tensor_meta(name: str, array: np.ndarray) -> dict[str, Any]:
    return {"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}


def tensor_frames(named: Iterable[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Metadata and zero-copy frames; non-contiguous arrays are made contiguous once, here."""
    metas, frames = [], []
    for name, array in named:
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        dtype = _NAME_OF.get(array.dtype)
        if dtype is None:
            native = array.dtype.newbyteorder("<")
            if array.dtype.byteorder != ">" or native not in _NAME_OF:
                raise ProtocolViolation("InvalidTensor", f"tensor {name!r}: dtype {array.dtype} cannot travel; "
                                        f"allowed: {', '.join(DTYPES)}", {"tensor": name, "dtype": str(array.dtype)})
            array, dtype = array.astype(native), _NAME_OF[native]
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        metas.append({"name": name, "dtype": dtype, "shape": list(array.shape)})
        frames.append(memoryview(array).cast("B") if array.size else b"")
    return metas, frames


# An infer_reply content, ``{"outputs": metas, "queue_s": q, "run_s": r}``, packed: everything up
# to q's 8 bytes depends only on the outputs' names, dtypes and shapes, so it is packed once per
# such layout (on both sides: the daemon to write it, the client to read it).
_QUEUE_S = b"\xa7queue_s\xcb"    # the packed key "queue_s" and the float64 marker
_RUN_S = b"\xa5run_s\xcb"        # the same for "run_s"
_TAIL = struct.Struct(f">d{len(_RUN_S)}sd")  # queue_s's value, "run_s" and its marker, run_s's value
_LAYOUTS_MAX = 64


class InferReplies:
    """Packs infer_reply contents, keeping the packed head of each outputs layout seen."""

    def __init__(self) -> None:
        self._heads: dict[tuple[Any, ...], bytes] = {}

    def pack(self, names: Sequence[str], results: Sequence[Any], queue_s: float, run_s: float
             ) -> tuple[bytes, list[Any]]:
        """The packed content and the raw frames of an ok reply (see :func:`tensor_frames`)."""
        frames: list[Any] = []
        layout = []
        for name, array in zip(names, results):
            dtype = _NAME_OF.get(array.dtype) if type(array) is np.ndarray else None
            if dtype is not None and array.nbytes < SMALL_FRAME:
                frames.append(array.tobytes())
            elif dtype is not None and array.flags.c_contiguous:
                frames.append(memoryview(array).cast("B"))
            else:
                metas, frames = tensor_frames(zip(names, results))
                return pack({"outputs": metas, "queue_s": queue_s, "run_s": run_s}), frames
            layout.append((name, dtype, array.shape))
        key = tuple(layout)
        head = self._heads.get(key)
        if head is None:
            metas = [{"name": n, "dtype": d, "shape": list(shape)} for n, d, shape in layout]
            head = b"\x83" + pack("outputs") + pack(metas) + _QUEUE_S
            if len(self._heads) >= _LAYOUTS_MAX:
                self._heads.clear()
            self._heads[key] = head
        return head + _TAIL.pack(queue_s, _RUN_S, run_s), frames


class InferOutputs:
    """Reads the outputs of ok infer replies: a content whose head was read before (same outputs
    layout) is not unpacked again; its frames are still checked against it."""

    def __init__(self) -> None:
        self._layouts: dict[bytes, list[tuple[np.dtype, tuple[int, ...], int]]] = {}

    def read(self, content: Any, frames: Sequence[Any]) -> list[np.ndarray]:
        """Arrays over the frames (read-only where the frames are); raises ProtocolViolation for a
        reply whose frames do not match its description."""
        n = len(content)
        head = bytes(content[:n - 23]) if n > 23 and content[n - 15:n - 8] == _RUN_S else None
        layout = None if head is None else self._layouts.get(head)
        if layout is None:
            reply = unpack(content)
            arrays = decode_tensors(reply.get("outputs") if isinstance(reply, dict) else None, frames, "outputs")
            if head is not None and head.endswith(_QUEUE_S):
                if len(self._layouts) >= _LAYOUTS_MAX:
                    self._layouts.clear()
                self._layouts[head] = [(a.dtype, a.shape, a.nbytes) for a in arrays.values()]
            return list(arrays.values())
        if len(layout) == len(frames):
            out = []
            for (dtype, shape, nbytes), frame in zip(layout, frames):
                if len(frame) != nbytes:
                    break
                out.append(np.ndarray(shape, dtype, frame))
            else:
                return out
        raise ProtocolViolation("InvalidTensor", "the reply's frames do not match its output descriptions")


def decode_tensors(metas: Any, frames: Sequence[Any], what: str) -> dict[str, np.ndarray]:
    """Zero-copy (read-only) arrays over the raw frames, checked against their metadata."""
    if not isinstance(metas, list):
        raise ProtocolViolation("InvalidRequest", f"`{what}` must be a list of tensor descriptions")
    if len(metas) != len(frames):
        raise ProtocolViolation("InvalidTensor", f"{len(metas)} tensor(s) described in `{what}` but "
                                f"{len(frames)} raw frame(s) sent", {"described": len(metas), "frames": len(frames)})
    out: dict[str, np.ndarray] = {}
    for i, (meta, frame) in enumerate(zip(metas, frames)):
        if not isinstance(meta, dict) or len(meta) != 3 or meta.keys() != {"name", "dtype", "shape"}:
            raise ProtocolViolation("InvalidTensor", f"`{what}[{i}]` must be a map with exactly name, dtype, shape",
                                    {"index": i})
        name, dtype_name, shape = meta["name"], meta["dtype"], meta["shape"]
        if not isinstance(name, str) or name in out:
            raise ProtocolViolation("InvalidTensor", f"`{what}[{i}]`: name must be a unique string", {"index": i})
        dtype = _DTYPE_OF.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ProtocolViolation("InvalidTensor", f"tensor {name!r}: unknown dtype {dtype_name!r}",
                                    {"tensor": name, "dtype": repr(dtype_name)[:100], "allowed": list(DTYPES)})
        if (not isinstance(shape, list) or len(shape) > 32
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise ProtocolViolation("InvalidTensor", f"tensor {name!r}: shape must be a list of "
                                    f"non-negative ints", {"tensor": name, "shape": repr(shape)[:200]})
        buffer = _buffer(frame)
        expected = math.prod(shape) * dtype.itemsize
        if buffer.nbytes != expected:
            raise ProtocolViolation("InvalidTensor", f"tensor {name!r}: {dtype_name}{shape} needs {expected} bytes, "
                                    f"frame has {buffer.nbytes}",
                                    {"tensor": name, "expected_bytes": expected, "got_bytes": buffer.nbytes})
        out[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return out


# ---------------------------------------------------------------------------------------------
# The local lane: the same messages on a Unix stream socket, length-prefixed.
#
#     u32 n | u64 length[0] ... u64 length[n-1] | frame[0] ... frame[n-1]      (little-endian)
#
# frame[0] is the header, frame[1] the content, the rest the raw frames of the message.

#: requests that may travel on the local lane; everything else goes over ZeroMQ.
LANE_ACTIONS = frozenset(a for a, m in MESSAGES.items() if m.transport != "zmq")
#: actions that never travel over ZeroMQ.
LANE_ONLY = frozenset(a for a, m in MESSAGES.items() if m.transport == "lane")
#: what the front of a daemon with ``process_per_device`` answers itself, for the whole daemon
#: (``daemon/front.py``); a client given a ``redirect`` sends these to the front, the rest to its
#: serving process
FRONT_ACTIONS = frozenset({"hello", "devices", "list_models", "status", "set_budget", "shutdown"})
#: reply fields that only a front sends (``hello``'s ``redirect`` and ``serving``, ``status``'s ``processes``)
FRONT_FIELDS = frozenset({"redirect", "serving", "processes"})
#: reply fields present only when the request asks for ``samples`` (``status``, ``list_models``)
SAMPLE_FIELDS = frozenset({"latency_samples_ms"})
LANE_CHUNK = 1 << 16       # bytes asked of one recv; a larger message is read straight into its buffer
_IOV_MAX = 512             # buffers per sendmsg call (the kernel takes at most 1024)
_LANE_COUNT = struct.Struct("<I")
_LANE_HEADS: dict[int, struct.Struct] = {}
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def _lane_head(n: int) -> struct.Struct:
    head = _LANE_HEADS.get(n)
    if head is None:
        head = _LANE_HEADS[n] = struct.Struct(f"<I{n}Q")
    return head


class LaneError(Exception):
    """The lane's byte stream is broken (or a message is over the limits): the connection must
    be closed. ``violation`` is the error to answer with when it can be; ``header`` the message's
    packed header when it could be read (to answer with the request id)."""

    def __init__(self, violation: ProtocolViolation | None, header: bytes | None = None) -> None:
        super().__init__(violation.message if violation else "connection closed in the middle of a message")
        self.violation = violation
        self.header = header


#: a message of no frames: on a lane with a ring (see :class:`vkpool.daemon.lane.Ring`), a
#: wake-up for a side asleep in ``recv``; in a ring's half, "this reply travels on the socket".
LANE_WAKE = _LANE_COUNT.pack(0)


def lane_send(sock: socket.socket, parts: Sequence[Any], start: int = 0, fds: Sequence[int] = ()) -> int:
    """Send ``parts[start:]`` as one message: 1-D byte buffers (bytes, or memoryviews of uint8 as
    :func:`tensor_frames` makes them), gathered by the kernel without copying; the bytes of its
    frames. ``fds``: file descriptors passed with the message's first byte (SCM_RIGHTS)."""
    buffers, body = lane_buffers(parts, start)
    n = len(buffers) - 1
    sent = 0
    if fds:
        import array

        sent = sock.sendmsg(buffers, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], _NOSIGNAL)
    elif n < _IOV_MAX:
        sent = sock.sendmsg(buffers, (), _NOSIGNAL)
        if sent == 4 + 8 * n + body:
            return body
    _send_rest(sock, buffers, sent)
    return body


def lane_buffers(parts: Sequence[Any], start: int = 0) -> tuple[list[Any], int]:
    """The buffers that carry ``parts[start:]`` as one lane message (its length head, then the
    frames) and the bytes of its frames."""
    if start:
        parts = parts[start:]
    n = len(parts)
    sizes = list(map(len, parts))
    return [(_LANE_HEADS.get(n) or _lane_head(n)).pack(n, *sizes), *parts], sum(sizes)


def _send_rest(sock: socket.socket, buffers: list[Any], sent: int) -> None:
    """Finish a message after a partial (or no) ``sendmsg``."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if not views:
            return
        views[0] = views[0][sent:]
        sent = sock.sendmsg(views[:_IOV_MAX], (), _NOSIGNAL)


#: a message up to this size is joined into one bytes object and copied into a ring's half at once
_JOIN_MAX = 1 << 14


def lane_pack_into(half: Any, parts: Sequence[Any], start: int = 0) -> int | None:
    """Write ``parts[start:]`` framed as on the socket into ``half`` (a writable byte buffer: a
    memoryview, or the mmap itself); the bytes of its frames, or None, having written nothing,
    when they do not fit."""
    if start:
        parts = parts[start:]
    n = len(parts)
    sizes = list(map(len, parts))
    body = sum(sizes)
    head = 4 + 8 * n
    if head + body > len(half):
        return None
    if body <= _JOIN_MAX:  # small: one copy into the half
        half[:head + body] = (_LANE_HEADS.get(n) or _lane_head(n)).pack(n, *sizes) + b"".join(parts)
        return body
    (_LANE_HEADS.get(n) or _lane_head(n)).pack_into(half, 0, n, *sizes)
    at = head
    for part, size in zip(parts, sizes):
        half[at:at + size] = part
        at += size
    return body


def lane_parse(half: memoryview, max_frames: int = 1 << 20, max_bytes: int = 1 << 62,
               copy: bool = False) -> list[memoryview]:
    """The frames of a message framed in ``half`` by :func:`lane_pack_into`: views into it, or
    with ``copy`` into a writable copy of the message; [] for :data:`LANE_WAKE`. Raises
    :class:`LaneError` when the framing does not hold."""
    size = len(half)
    (n,) = _LANE_COUNT.unpack_from(half) if size >= 4 else (1,)
    if n == 0:
        return []
    head = 4 + 8 * n
    if n < 2 or n > max_frames or head > size:
        raise LaneError(ProtocolViolation("ProtocolError", f"a ring message of {n} frame(s) does not fit its "
                                          f"half of the ring or the limits (max_frames {max_frames})", {"frames": n}))
    sizes = (_LANE_HEADS.get(n) or _lane_head(n)).unpack_from(half)[1:]
    body = sum(sizes)
    if body > max_bytes or head + body > size:
        raise LaneError(ProtocolViolation("MessageTooLarge", f"a ring message of {body} bytes exceeds its half of the ring "
                                          f"({size - head} bytes) or max_message_bytes {max_bytes}",
                                          {"frames": n, "bytes": body}))
    if copy:
        half = memoryview(bytearray(half[:head + body]))
    return _split(half, head, sizes)


def _split(view: memoryview, at: int, sizes: Sequence[int]) -> list[memoryview]:
    """The frames of a lane message: ``sizes`` bytes each, one after another from ``at``."""
    frames = []
    for size in sizes:
        frames.append(view[at:at + size])
        at += size
    return frames


class LaneReader:
    """Reads lane messages from a stream socket: each as a list of memoryviews (header,
    content, raw frames). A small message costs one ``recv``; bytes of the next message that
    came with it are kept for the next read. A message larger than :data:`LANE_CHUNK` is read
    into a ``bytearray`` of its own, so its frames are writable."""

    __slots__ = ("sock", "rest", "max_frames", "max_bytes", "wakes", "_poll")

    def __init__(self, sock: socket.socket, max_frames: int = 1 << 20, max_bytes: int = 1 << 62) -> None:
        self.sock = sock
        self.rest: bytes = b""
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.wakes = False  # a lane with a ring: a message of no frames is a wake-up, read as []
        self._poll: Any = None

    def read(self) -> list[memoryview] | None:
        """The next message; None when the peer closed the connection between messages; [] for
        a wake-up (:data:`LANE_WAKE`, when ``wakes``). Raises :class:`LaneError` for a broken
        stream, ``OSError`` for a failed socket."""
        data = self.rest
        if len(data) < 4:
            data = self._more(data, 4)
            if data is None:
                return None
        (n,) = _LANE_COUNT.unpack_from(data)
        if n == 0 and self.wakes:
            self.rest = data[4:]
            return []
        if n < 2:
            raise LaneError(ProtocolViolation("ProtocolError", f"a lane message has {n} frame(s); it needs "
                                              "at least a header and a content frame"))
        if n > self.max_frames:
            raise LaneError(ProtocolViolation("MessageTooLarge", f"request of {n} frames exceeds max_frames "
                                              f"{self.max_frames}", {"frames": n}))
        head = 4 + 8 * n
        if len(data) < head:
            data = self._more(data, head)
        sizes = (_LANE_HEADS.get(n) or _lane_head(n)).unpack_from(data)[1:]
        body = sum(sizes)
        if body > self.max_bytes:
            header = None
            if sizes[0] <= LANE_CHUNK:
                data = self._more(data, head + sizes[0])
                header = bytes(data[head:head + sizes[0]])
            raise LaneError(ProtocolViolation("MessageTooLarge", f"request of {n} frames and {body} bytes "
                                              f"exceeds max_message_bytes {self.max_bytes}",
                                              {"frames": n, "bytes": body}), header)
        total = head + body
        if len(data) < total:
            data = self._fill(data, total)
        if len(data) > total:
            self.rest = data[total:]
        else:
            self.rest = b""
        return _split(memoryview(data), head, sizes)

    def needed(self) -> int | None:
        """The bytes :meth:`read` must hold before it returns (or refuses) the message that
        :attr:`rest` begins, by the checks it makes in their order: 0 when it answers at once (a
        wake-up, or a count of frames it refuses); None while the frame sizes are not all there."""
        data = self.rest
        if len(data) < 4:
            return None
        (n,) = _LANE_COUNT.unpack_from(data)
        if n < 2 or n > self.max_frames:
            return 0
        head = 4 + 8 * n
        if len(data) < head:
            return None
        sizes = (_LANE_HEADS.get(n) or _lane_head(n)).unpack_from(data)[1:]
        body = sum(sizes)
        if body > self.max_bytes:  # refused once the header frame is read, to answer with its id
            return 0 if sizes[0] > LANE_CHUNK else head + sizes[0]
        return head + body

    def poll(self, seconds: float) -> None:
        """Poll the socket for up to ``seconds`` when nothing is buffered; what arrives is kept
        for :meth:`read`. A thread asleep in ``recv`` is woken by the kernel's scheduler, which
        takes tens of microseconds on an idle machine (more in a virtual machine, where the
        sleeping CPU must be woken by the host); polling for a message known to come soon skips
        that wake-up, at the price of a busy CPU meanwhile."""
        if self.rest:
            return
        if self._poll is None:
            self._poll = select.poll()  # poll(0) costs a quarter of a failing non-blocking recv
            self._poll.register(self.sock.fileno(), select.POLLIN)
        ready, clock = self._poll.poll, time.perf_counter
        end = clock() + seconds
        while not ready(0):
            if clock() > end:
                return
        self.rest = self.sock.recv(LANE_CHUNK)  # b"" at end of file: read() reports it

    def _more(self, data: Any, need: int) -> Any:
        while len(data) < need:
            chunk = self.sock.recv(max(LANE_CHUNK, need - len(data)))
            if not chunk:
                if not data:
                    return None
                raise LaneError(None)
            data = data + chunk if data else chunk
        return data

    def _fill(self, data: Any, total: int) -> Any:
        if total - len(data) <= LANE_CHUNK:
            return self._more(data, total)
        buf = bytearray(total)
        at = len(data)
        buf[:at] = data
        view = memoryview(buf)
        while at < total:
            got = self.sock.recv_into(view[at:])
            if not got:
                raise LaneError(None)
            at += got
        return buf


# ---------------------------------------------------------------------------------------------
# Documentation.

_TRANSPORT_NOTE = {"zmq": "", "both": " Travels over ZeroMQ or on the local lane.",
                   "lane": " Travels on the local lane only."}


def render_markdown() -> str:
    """The reference part of ``docs/protocol.md``: every message, its fields, every error type."""
    lines = [f"Protocol version: **{PROTOCOL_VERSION}**. Delimiter frame: `{DELIMITER.decode()}`.", "",
             "Tensor dtypes: " + ", ".join(f"`{d}`" for d in DTYPES) + ".", ""]
    for m in MESSAGES.values():
        lines += [f"### `{m.action}`", "", m.doc + (" Control: answered while compute is busy."
                                                   if m.control else "")
                  + _TRANSPORT_NOTE[m.transport], ""]
        for side, fields, frames in (("request", m.request, m.request_frames),
                                     ("reply", m.reply, m.reply_frames)):
            lines.append(f"`{m.action}_{side}` content:")
            lines.append("")
            if fields:
                lines += ["| field | type | required | meaning |", "|---|---|---|---|"]
                for f in fields:
                    kind = f.kind + (" or null" if f.nullable else "")
                    lines.append(f"| `{f.name}` | {kind} | {'yes' if f.required else 'no'} | {f.doc} |")
            else:
                lines.append("(empty map)")
            lines += ["", f"Raw frames: {frames}.", ""]
    lines += ["### Error types", "", "| type | sent when |", "|---|---|"]
    lines += [f"| `{name}` | {doc} |" for name, doc in ERROR_TYPES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
