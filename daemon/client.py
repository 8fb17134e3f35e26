"""Client library: talk to a running ``vkpool serve`` the way you would use ``vkpool.Session``.

    with Client() as client:
        session = client.session("model.onnx")
        (y,) = session.run(None, {"x": x})

A :class:`Client` owns one DEALER socket, driven by a background thread so that any number of
threads can have requests in flight at once (zmq sockets are not thread-safe). Error replies
raise the exception class named by their type (:mod:`vkpool.daemon.errors`).

When the daemon offers a local lane (an ipc:// daemon on this host), ``infer`` and
``RemoteSession.run`` travel on it instead (:mod:`vkpool.daemon.lane`): one lane connection per
thread running jobs at once, up to :data:`~vkpool.daemon.lane.CLIENT_MAX_LANES`, others over
ZeroMQ. ``Client(local_lane=False)`` or ``VKPOOL_LOCAL_LANE=0`` keeps everything on ZeroMQ; a
lane that cannot be opened falls back to ZeroMQ.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NoReturn, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from vkpool.daemon import protocol as P
from vkpool.daemon.bound import FRAME_HEAD, REPLY_MAGIC, ClientBinding, ClientFrameBinding, views
from vkpool.daemon.endpoint import default_endpoint, ipc_path, paused_path
from vkpool.daemon.errors import CONNECTION_LOST, DaemonUnavailable, TooManyConnections, from_reply
from vkpool.daemon.lane import (CLIENT_MAX_LANES, POLL_MAX_S, ZMQ_POLL_MAX_S, ClientLane, LaneRefused, Poller,
                                lane_wanted)

HELLO_TIMEOUT_S = 5.0
_INFER_REQUEST = P.header_parts("infer_request")  # around the packed request id
_INFER_OK = P.header_parts("infer_reply", "ok")
#: the header a bound infer's record reply is delivered with (its content: the reply frame)
_RECORD: dict[str, Any] = {"status": "ok"}
_POLL_SLICE_MS = 100  # how often a waiting thread looks at the clock and at close()


@dataclass(frozen=True)
class ValueInfo:
    """An input or output of a remote model, shaped like the in-process session's."""

    name: str
    shape: list[int | str]
    type: str
    dtype: np.dtype


def resolve_endpoint(endpoint: str | None) -> str:
    return endpoint or os.environ.get("VKPOOL_ENDPOINT") or default_endpoint()


def _not_running(endpoint: str, why: str) -> DaemonUnavailable:
    return DaemonUnavailable(f"no vkpool daemon answers at {endpoint} ({why}); start it with `vkpool serve`")


def make_socket(ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None
                ) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER with a random routing id (the daemon keys references and retries by it), and the
    monitor of its connection (:data:`WATCHED_EVENTS`), set up before it connects so that no
    event of the connection is missed."""
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id = b"\x01" + uuid.uuid4().bytes  # a leading zero byte is reserved by libzmq
    sock.linger = 0
    # replies are taken off the wire as they come, however many requests are in flight: the daemon
    # keeps only a few unread replies per client (daemon.server.REPLY_HWM) before dropping the rest
    sock.rcvhwm = 0
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    monitor = sock.get_monitor_socket(WATCHED_EVENTS)
    sock.connect(endpoint)
    return sock, monitor


def check_endpoint(endpoint: str) -> None:
    """Refuse at once an ipc endpoint whose socket file is missing: ``DaemonUnavailable``, or
    ``TooManyConnections`` where a daemon moved it aside because its open files reached their
    limit (:func:`vkpool.daemon.endpoint.paused_path`; it takes connections again once some
    close)."""
    path = ipc_path(endpoint)
    if path is not None and not path.exists():
        if paused_path(path).exists():
            raise TooManyConnections(f"the daemon at {endpoint} is at its open-file limit and takes no "
                                     "connections until some of its clients close; retry in a moment")
        raise _not_running(endpoint, f"{path} does not exist")


#: what a client's socket monitor reports (see :class:`Connection`)
WATCHED_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class Connection:
    """What a client knows of its socket's connection, from its monitor's events."""

    down: str | None = None     # why requests cannot go (None: they may)
    refused: str | None = None  # why the last handshake failed, until one succeeds
    live: bool = False          # a handshake succeeded and the connection has not dropped since

    def event(self, event: Mapping[str, Any], endpoint: str) -> bool:
        """Takes a monitor ``event`` in; whether the requests waiting on the connection fail now: when
        the daemon refused this client's key, or when a connection that was serving drops (the
        daemon exited). A connection that drops or fails before its handshake is done is tried
        again by libzmq (a daemon starting or restarting): its requests keep waiting."""
        kind = event["event"]
        if kind == zmq.EVENT_CONNECTED:
            self.down = None
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.down, self.refused, self.live = None, None, True
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused = self.down = (f"the daemon at {endpoint} refused this client's CURVE key: put its public "
                                        f"key in the directory the daemon's daemon.curve.authorized_keys_dir names")
            return True
        elif kind & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            self.refused = (f"the handshake with {endpoint} failed: check the server's public key given to the "
                            f"client (curve=), and that a vkpool daemon listens there")
        elif kind == zmq.EVENT_DISCONNECTED and self.live:
            self.live = False
            self.down = (f"the connection to the daemon at {endpoint} closed (the daemon stopped or crashed); "
                         f"requests it had not answered are lost: load the models again once it runs")
            return True
        return False


def build_request(action: str, rid: str, content: Mapping[str, Any], frames: Sequence[Any]) -> list[Any]:
    return [P.DELIMITER, P.packed_header(f"{action}_request", rid), P.pack(dict(content)), *frames]


def parse_reply(frames: list[zmq.Frame]) -> tuple[dict[str, Any], dict[str, Any], list[zmq.Frame]] | None:
    """Header, content and raw frames of a reply; None for anything that is not one (probes)."""
    try:
        _, body = P.split_routing(frames)
        header, content = P.unpack(P._buffer(body[0])), P.unpack(P._buffer(body[1]))
    except (P.ProtocolViolation, IndexError):
        return None
    if not isinstance(header, dict) or "status" not in header or not isinstance(content, dict):
        return None
    return header, content, body[2:]


def result_of(reply: tuple[dict[str, Any], dict[str, Any], list[zmq.Frame]]) -> tuple[dict[str, Any], list[Any]]:
    header, content, frames = reply
    if header["status"] != "ok":
        raise from_reply(content)
    return content, frames


def infer_content(model: str, feeds: Mapping[str, Any], outputs: Iterable[str] | None,
                  priority: int, timeout: float | None) -> tuple[dict[str, Any], list[Any]]:
    metas, frames = P.tensor_frames(feeds.items())
    content: dict[str, Any] = {"model": model, "inputs": metas, "priority": priority, "timeout": timeout,
                               "outputs": None if outputs is None else list(outputs)}
    return content, frames


def outputs_of(content: dict[str, Any], frames: list[Any]) -> list[np.ndarray]:
    arrays = P.decode_tensors(content["outputs"], frames, "outputs")
    return [a.copy() for a in arrays.values()]  # writable, like the in-process session's results


def load_content(model: str | os.PathLike[str] | bytes, name: str | None, keep_alive: float | None,
                 batch: int | None = None, dims: Mapping[str, int] | None = None, max_batch: int | None = None,
                 max_queue_delay: float | None = None, objective: str | None = None
                 ) -> tuple[dict[str, Any], list[Any]]:
    content: dict[str, Any] = {"name": name, "keep_alive": keep_alive}
    if objective is not None:
        content["objective"] = objective
    if batch is not None:
        content["batch"] = int(batch)
    if max_batch is not None:
        content["max_batch"] = int(max_batch)
    if max_queue_delay is not None:
        content["max_queue_delay"] = float(max_queue_delay)
    if dims:
        content["dims"] = {str(k): int(v) for k, v in dims.items()}
    if isinstance(model, (bytes, bytearray, memoryview)):
        return content, [bytes(model)]
    content["path"] = str(Path(model).expanduser().resolve())
    return content, []


class _Waiter:
    """One request in flight: where its reply lands and how its thread is woken."""

    __slots__ = ("reply", "wake", "future", "packed")

    def __init__(self, wake: threading.Event | None = None,
                 future: concurrent.futures.Future[Any] | None = None, packed: bool = False) -> None:
        self.reply: tuple[dict[str, Any], Any, list[zmq.Frame]] | None = None
        self.wake = wake
        self.future = future
        self.packed = packed  # the reply's content is kept packed (an infer's, read by InferOutputs)


class Client:
    """A connection to the daemon. Thread-safe; close it (or use ``with``) when done.

    The DEALER socket is used by one thread at a time, the *leader*: a thread waiting for a reply
    takes the lead when it is free, sends on the socket itself and receives until its reply
    arrives, handing other threads' replies to them on the way. A thread that finds another
    leading queues its request on an inproc socket that the leader forwards, and waits to be
    handed its reply or the lead. With one thread, a request is a send and a receive on the
    caller's thread: no hop between threads. Futures from :meth:`submit` are driven by a
    background thread while any is unanswered.

    ``infer`` (and ``RemoteSession.run``) use the daemon's local lane when it offers one and
    ``local_lane`` (default: ``$VKPOOL_LOCAL_LANE``, on unless 0) allows it; see the module's doc.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = None,
                 hello_timeout: float = HELLO_TIMEOUT_S, curve: tuple[bytes, bytes, bytes] | None = None,
                 name: str | None = None, context: zmq.Context | None = None,
                 local_lane: bool | None = None, follow: bool = True) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        #: ``hello``'s reply from the front of a daemon with ``process_per_device`` (its ``pid`` and
        #: ``serving``), None from any other daemon; ``serving_endpoint`` is where this client's
        #: models and jobs go (``endpoint`` itself, or the ``redirect`` it was given)
        self.front: dict[str, Any] | None = None
        self.serving_endpoint = self.endpoint
        self._front_client: Client | None = None
        self._front_lock = threading.Lock()
        self.timeout = timeout
        check_endpoint(self.endpoint)
        self._own_ctx = context is None  # inproc:// endpoints need the daemon's context
        self._ctx = context or zmq.Context()
        self._sock, self._monitor = make_socket(self._ctx, self.endpoint, curve)
        self._routing_id: bytes = self._sock.routing_id
        self._lane_offer: dict[str, Any] | None = None
        self._lanes_idle: list[ClientLane] = []
        self._lanes: set[ClientLane] = set()
        self._lanes_max = CLIENT_MAX_LANES
        self._lane_lock = threading.Lock()
        self._lane_poller = Poller(POLL_MAX_S)
        self._packed: dict[tuple[Any, ...], bytes] = {}  # infer contents for the lane, see _lane_infer
        self._frame_bound: dict[tuple[Any, ...], ClientFrameBinding] = {}  # bound infers over ZeroMQ, by key
        self._frame_unbound: set[tuple[Any, ...]] = set()  # keys the daemon does not bind: framed
        self._outputs = P.InferOutputs()
        self._outbox_addr = f"inproc://vkpool-client-{id(self)}-{uuid.uuid4().hex[:8]}"
        self._outbox_pull = self._ctx.socket(zmq.PULL)
        self._outbox_pull.bind(self._outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(self._outbox_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._outbox_pull, zmq.POLLIN)
        self._watch_connection()
        self._spin = Poller(ZMQ_POLL_MAX_S)
        self._reply_s = ZMQ_POLL_MAX_S / 2  # moving average of an infer reply's wait over ZeroMQ
        self._lead = threading.Lock()        # held by the thread using the DEALER socket
        self._send_lock = threading.Lock()   # guards the PUSH end of the outbox
        self._pending: dict[str, _Waiter] = {}
        self._followers: set[_Waiter] = set()
        self._unanswered: set[str] = set()   # submit() ids still waiting for their reply
        self._driver: threading.Thread | None = None
        self._driver_wake = threading.Event()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = threading.Event()
        self._max_bytes = 1 << 62  # until hello's reply gives the daemon's limit
        try:
            self.info = self.request("hello", {"client": name or f"pid {os.getpid()}"}, timeout=hello_timeout)[0]
            redirect = self.info.get("redirect") if follow else None
            if isinstance(redirect, str):
                self._follow(redirect, curve)
                self.info = self.request("hello", {"client": name or f"pid {os.getpid()}"}, timeout=hello_timeout)[0]
        except TimeoutError:
            refused = self._connection.refused
            self.close()
            if refused is not None:
                raise DaemonUnavailable(refused) from None
            raise _not_running(self.endpoint, f"no reply to hello within {hello_timeout:g} s") from None
        except BaseException:
            self.close()
            raise
        offer = self.info.get("local_lane")
        if isinstance(offer, dict) and lane_wanted(local_lane):
            self._lane_offer = offer
        self._lane_timeout = hello_timeout
        limits = self.info.get("limits") or {}
        self._max_frames = int(limits.get("max_frames") or 1 << 30)
        self._max_bytes = int(limits.get("max_message_bytes") or 1 << 62)

    def _follow(self, redirect: str, curve: tuple[bytes, bytes, bytes] | None) -> None:
        """Send everything from here on to ``redirect`` (the serving process the front gave this
        client), but the requests the front answers (:data:`protocol.FRONT_ACTIONS`)."""
        self.front = self.info
        check_endpoint(redirect)
        self._unwatch_connection()
        self._poller.unregister(self._sock)
        self._sock.close(0)
        self._sock, self._monitor = make_socket(self._ctx, redirect, curve)
        self._routing_id = self._sock.routing_id
        self._poller.register(self._sock, zmq.POLLIN)
        self.serving_endpoint = redirect
        self._watch_connection()

    def _watch_connection(self) -> None:
        """Watch the DEALER's connection (its monitor, read where replies are): when it drops
        (the daemon, or this client's serving process, exited), the requests that wait on it
        fail with DaemonUnavailable at once instead of waiting for replies that cannot come, and
        so do new ones until it is back (libzmq reconnects by itself)."""
        self._poller.register(self._monitor, zmq.POLLIN)
        self._connection = Connection()

    def _unwatch_connection(self) -> None:
        self._poller.unregister(self._monitor)
        self._sock.disable_monitor()
        self._monitor.close(0)

    def _connection_event(self) -> None:
        connection = self._connection
        if connection.event(recv_monitor_message(self._monitor), self.serving_endpoint):
            # replies the daemon sent before it went (a drain's last answers) are read first: only
            # the requests still without one are lost
            while self._sock.poll(0):
                self._deliver(P.recv_parts(self._sock, 3))
            for rid in list(self._pending):
                waiter = self._pending.pop(rid, None)
                if waiter is not None:
                    self._answer(rid, waiter, {"type": CONNECTION_LOST, "message": connection.down})

    def _to_front(self, action: str) -> "Client | None":
        """The client of the daemon's front (made on first use) when ``action`` goes there."""
        if self.front is None or action not in P.FRONT_ACTIONS or action == "hello":
            return None
        with self._front_lock:
            if self._front_client is None:
                self._front_client = Client(self.endpoint, timeout=self.timeout, local_lane=False, follow=False)
            return self._front_client

    @property
    def local_lane(self) -> bool:
        """Whether ``infer`` travels on the local lane (offered, allowed, and not given up)."""
        return self._lane_offer is not None

    # -- transport ----------------------------------------------------------------------------
    def _pump(self, done: Any, deadline: float | None, sent: float | None = None) -> None:
        """As the leader: forward queued requests and hand out replies until ``done()``, the
        deadline or close. ``sent``: when the leader's own request went (``time.perf_counter``),
        to poll for its reply instead of sleeping when replies come soon (:class:`Poller`)."""
        sock, outbox, poll = self._sock, self._outbox_pull, self._poller.poll
        if sent is not None:
            self._spin.spin(lambda: poll(0), self._reply_s, sent)
        while not done() and not self._closed.is_set():
            wait_ms = _POLL_SLICE_MS
            if deadline is not None:
                wait_ms = min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1)
                if wait_ms <= 0:
                    return
            # a message at a time from each ready socket (zmq_poll sees the next one at once;
            # it costs less than pyzmq's ``EVENTS``, read through an enum lookup)
            for ready, _ in poll(wait_ms):
                if ready is sock:
                    self._deliver(P.recv_parts(sock, 3))
                elif ready is self._monitor:
                    self._connection_event()
                else:  # a request queued by another thread
                    message = outbox.recv_multipart(copy=False)
                    if self._connection.down is None:
                        sock.send_multipart(message, copy=False)
                    elif len(message) == 1:  # a bound infer's frame, answered here: the daemon is gone
                        self._lost({"id": f"frame-{FRAME_HEAD.unpack_from(message[0].buffer)[2]}"})
                    else:  # answered here: the daemon is gone
                        self._lost(P.unpack(P._buffer(message[1])))

    def _deliver(self, frames: list[Any]) -> None:
        if len(frames) == 1 and len(frames[0]) >= FRAME_HEAD.size and frames[0].startswith(REPLY_MAGIC):
            rid = f"frame-{FRAME_HEAD.unpack_from(frames[0])[2]}"  # a bound infer's record
            waiter = self._pending.pop(rid, None)
            if waiter is not None:
                self._settle(rid, waiter, (_RECORD, frames[0], []))
            return
        try:
            _, body = P.split_routing(frames)
            header = P.unpack(P._buffer(body[0]))
            rid = str(header.get("id")) if isinstance(header, dict) else None
            waiter = self._pending.pop(rid, None) if rid is not None else None
        except (P.ProtocolViolation, IndexError):
            return  # a probe, or something that is no reply
        if waiter is None:
            return  # timed out meanwhile, or a retried id answered twice
        # an infer's content stays packed (InferOutputs reads it); any other is unpacked here
        try:
            content = body[1] if waiter.packed else P.unpack(P._buffer(body[1]))
        except (P.ProtocolViolation, IndexError):
            content = None
        if "status" not in header or not (waiter.packed or isinstance(content, dict)):
            self._pending[rid] = waiter  # not a reply after all: still waiting
            return
        self._settle(rid, waiter, (header, content, body[2:]))

    def _settle(self, rid: str, waiter: _Waiter, reply: tuple[dict[str, Any], Any, list[Any]]) -> None:
        waiter.reply = reply
        if waiter.future is not None:
            self._unanswered.discard(rid)
            if not waiter.future.done():
                waiter.future.set_result(reply)
        if waiter.wake is not None:
            waiter.wake.set()

    def _answer(self, rid: str, waiter: _Waiter, error: dict[str, Any]) -> None:
        """``waiter`` answered here with ``error``, as the daemon's error reply would be."""
        self._settle(rid, waiter, ({"status": "error", "id": rid}, P.pack(error) if waiter.packed else error, []))

    def _lost(self, header: Any) -> None:
        """A request taken from the outbox while the connection is down: answered DaemonUnavailable."""
        rid = str(header.get("id")) if isinstance(header, dict) else None
        waiter = self._pending.pop(rid, None) if rid is not None else None
        if waiter is not None:
            self._answer(rid, waiter, {"type": CONNECTION_LOST, "message": self._connection.down})

    def _hand_over_lead(self) -> None:
        """After releasing the lead: wake one thread still waiting, so that it takes the lead."""
        for waiter in list(self._followers):
            if waiter.reply is None and waiter.wake is not None:
                waiter.wake.set()
                return
        if self._unanswered:
            self._driver_wake.set()

    def _usual_reply(self, seen_s: float) -> float:
        """The usual wait of an infer's reply after one of ``seen_s`` (infers only: a model's load
        would take it past polling, and the infers after it would sleep). A wait that sleeps ends
        late by the wake-up, which keeps the average past polling once it is there; so a reply
        within the polling limit while the average says sleep (one the periodic probe polled for)
        sets it, and polling resumes at once. Replies that stay slow take it back within a few."""
        if seen_s < self._spin.max_s <= self._reply_s:
            return seen_s
        return self._spin.average(self._reply_s, seen_s)

    def _send_queued(self, message: list[Any]) -> None:
        with self._send_lock:
            self._outbox.send_multipart(message, copy=False)

    def _exchange(self, rid: str, message: list[Any], timeout: float | None, packed: bool = False
                  ) -> tuple[dict[str, Any], Any, list[zmq.Frame]] | None:
        """Send one request and wait for its reply; None at the timeout. ``packed``: the reply's
        content stays packed (:class:`_Waiter`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._lead.acquire(blocking=False):
            waiter = _Waiter(packed=packed)
            self._pending[rid] = waiter
            try:
                if self._connection.down is not None:  # a drop not yet read fails it in _pump
                    self._pending.pop(rid, None)
                    raise DaemonUnavailable(self._connection.down)
                P.send_parts(self._sock, message)
                sent = time.perf_counter()
                self._pump(lambda: waiter.reply is not None, deadline, sent)
                if waiter.reply is not None and packed:
                    self._reply_s = self._usual_reply(time.perf_counter() - sent)
            finally:
                self._lead.release()
                self._hand_over_lead()
        else:
            waiter = _Waiter(wake=threading.Event(), packed=packed)
            self._pending[rid] = waiter
            self._followers.add(waiter)
            try:
                self._send_queued(message)
                while waiter.reply is None and not self._closed.is_set():
                    if self._lead.acquire(blocking=False):
                        try:
                            self._pump(lambda: waiter.reply is not None, deadline)
                        finally:
                            self._lead.release()
                            self._followers.discard(waiter)
                            self._hand_over_lead()
                        break
                    remaining = _POLL_SLICE_MS / 1000 if deadline is None else deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    waiter.wake.wait(min(remaining, _POLL_SLICE_MS / 1000))
                    waiter.wake.clear()
            finally:
                self._followers.discard(waiter)
        if waiter.reply is None:
            self._pending.pop(rid, None)
        return waiter.reply

    def _drive(self) -> None:
        """Background leader for futures from :meth:`submit` that nobody is waiting on."""
        while not self._closed.is_set():
            if not self._unanswered:
                self._driver_wake.wait(_POLL_SLICE_MS / 1000)
                self._driver_wake.clear()
                continue
            if not self._lead.acquire(timeout=_POLL_SLICE_MS / 1000):
                continue
            try:
                self._pump(lambda: not self._unanswered, None)
            finally:
                self._lead.release()
                self._hand_over_lead()

    def request(self, action: str, content: Mapping[str, Any] | None = None, frames: Sequence[Any] = (),
                *, timeout: float | None = None, request_id: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and wait for its reply: ``(content, raw frames)``; raises on error replies.
        On a daemon with ``process_per_device``, the front answers those of :data:`protocol.FRONT_ACTIONS`
        (for the whole daemon), this client's serving process the others."""
        if self._closed.is_set():
            raise DaemonUnavailable("this client is closed")
        if (front := self._to_front(action)) is not None:
            return front.request(action, content, frames, timeout=timeout, request_id=request_id)
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        wait = timeout if timeout is not None else self.timeout
        reply = self._exchange(rid, self._checked(action, build_request(action, rid, content or {}, frames)), wait)
        if reply is None:
            self._timed_out(action, wait)
        return result_of(reply)

    def _checked(self, action: str, message: list[Any]) -> list[Any]:
        """``message``, unless it is over the daemon's ``max_message_bytes`` (which would drop the
        connection, not answer): MessageTooLarge is raised here instead."""
        size = sum(map(len, message))
        if size > self._max_bytes:
            raise from_reply({"type": "MessageTooLarge", "message": f"{action}_request of {size} bytes exceeds the "
                              f"daemon's max_message_bytes {self._max_bytes}; load large models by path",
                              "details": {"bytes": size}})
        return message

    def _timed_out(self, action: str, wait: float | None) -> NoReturn:
        if self._closed.is_set():
            raise DaemonUnavailable("this client was closed while waiting for a reply")
        raise TimeoutError(f"no {action}_reply from {self.endpoint} within {wait:g} s")

    def submit(self, action: str, content: Mapping[str, Any] | None = None, frames: Sequence[Any] = (),
               *, request_id: str | None = None) -> concurrent.futures.Future[Any]:
        """Send without waiting; the future's result is the raw reply (see :func:`result_of`)."""
        if self._closed.is_set():
            raise DaemonUnavailable("this client is closed")
        if (front := self._to_front(action)) is not None:
            return front.submit(action, content, frames, request_id=request_id)
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.request_id = rid  # type: ignore[attr-defined]
        self._pending[rid] = _Waiter(future=future)
        self._unanswered.add(rid)
        self._send_queued(build_request(action, rid, content or {}, frames))
        if self._driver is None:
            self._driver = threading.Thread(target=self._drive, name="vkpool-client", daemon=True)
            self._driver.start()
        self._driver_wake.set()
        return future

    # -- the local lane -----------------------------------------------------------------------
    def _take_lane(self) -> ClientLane | None:
        """An idle lane connection of this client, a new one, or None (use ZeroMQ)."""
        try:
            return self._lanes_idle.pop()
        except IndexError:
            pass
        with self._lane_lock:
            offer = self._lane_offer
            if offer is None or len(self._lanes) >= self._lanes_max or self._closed.is_set():
                return None
            try:
                lane = ClientLane(offer, self._routing_id, self._lane_timeout, self._lane_poller)
            except LaneRefused:
                self._lanes_max = len(self._lanes)  # the daemon is at its cap: no more from this client
                return None
            except OSError:
                self._lane_offer = None  # the lane cannot be connected from here: ZeroMQ only
                return None
            self._lanes.add(lane)
            return lane

    def _drop_lane(self, lane: ClientLane) -> None:
        with self._lane_lock:
            self._lanes.discard(lane)
        lane.close()

    def _lane_infer(self, model_id: str, feeds: Mapping[str, Any], outputs: list[str] | None,
                    priority: int, timeout: float | None, wait: float | None) -> list[np.ndarray] | None:
        """``infer`` on the local lane; None when it must go over ZeroMQ instead.

        It travels framed as over ZeroMQ (:meth:`_framed`), or, on a lane with a ring, is bound once (:mod:`vkpool.daemon.bound`): after
        that only its inputs' bytes are written, and its outputs read, in the ring."""
        key, arrays = self._infer_key(model_id, feeds, outputs, priority, timeout)
        lane = self._take_lane()
        if lane is None:
            return None
        bindable = key is not None and lane.ring is not None and key not in lane.unbound
        if bindable:
            bound = lane.bindings.get(key)
            if bound is not None:  # the usual case: neither frames nor content are made
                return self._bound_infer(lane, key, bound, arrays, wait)
        key, arrays, packed, frames = self._framed(model_id, feeds, outputs, priority, timeout, (key, arrays))
        if len(frames) + 2 > self._max_frames:
            self._lane_done(lane)
            return None
        if bindable:
            bound = self._bind(lane, key, packed, frames, arrays, wait)
            if bound is not None:
                return self._bound_infer(lane, key, bound, arrays, wait)
        reply = self._lane_infer_request(lane, packed, frames, wait)
        if reply is None:
            return None
        return self._infer_result(*reply)

    @staticmethod
    def _infer_key(model_id: str, feeds: Mapping[str, Any], outputs: list[str] | None, priority: int,
                   timeout: float | None) -> tuple[Any, list[np.ndarray]]:
        """What an infer's packed content depends on (the model, output names, options and input
        names/dtypes/shapes) and its inputs as arrays; the key is None for inputs to be converted
        (an unknown dtype, a large array not in C order)."""
        arrays: list[np.ndarray] = []
        key: Any = [model_id, priority, timeout, outputs if outputs is None else tuple(outputs)]
        for name, value in feeds.items():
            array = value if type(value) is np.ndarray else np.asarray(value)
            dtype = P._NAME_OF.get(array.dtype)
            if dtype is None or not (array.nbytes < P.SMALL_FRAME or array.flags.c_contiguous):
                return None, arrays
            arrays.append(array)
            key += (name, dtype, array.shape)
        return tuple(key), arrays

    def _framed(self, model_id: str, feeds: Mapping[str, Any], outputs: list[str] | None, priority: int,
                timeout: float | None, keyed: tuple[Any, list[np.ndarray]] | None = None
                ) -> tuple[Any, list[np.ndarray], bytes, list[Any]]:
        """An infer as it travels framed, on a lane or over ZeroMQ: its key and arrays
        (:meth:`_infer_key`, or ``keyed``), its packed content and its tensor frames. The packed
        content is remembered per key, so running one model on same-shaped inputs packs nothing
        but the request's header; the daemon, for its part, checks a content it has seen before
        only against the frames. Small tensors travel as copies of their bytes (see
        :data:`~vkpool.daemon.protocol.SMALL_FRAME`)."""
        key, arrays = keyed or self._infer_key(model_id, feeds, outputs, priority, timeout)
        if key is None:
            content, frames = infer_content(model_id, feeds, outputs, priority, timeout)
            return key, arrays, P.pack(content), frames
        # small tensors as copies of their bytes (C order, whatever the array's strides)
        frames = [a.tobytes() if a.nbytes < P.SMALL_FRAME else memoryview(a).cast("B") for a in arrays]
        packed = self._packed.get(key)
        if packed is None:
            packed = P.pack(infer_content(model_id, feeds, outputs, priority, timeout)[0])
            if len(self._packed) >= 64:
                self._packed.clear()
            self._packed[key] = packed
        return key, arrays, packed, frames

    def _bind(self, lane: ClientLane, key: Any, packed: bytes, frames: list[Any], arrays: list[np.ndarray],
              wait: float | None) -> ClientBinding | None:
        """Bind an infer on ``lane`` (``bind_infer``: the infer's own content and frames); None when
        the daemon does not (it is then sent framed on this lane from now on). The lane stays the
        caller's, unless the error the infer itself would get is raised (the lane is then idle
        again, or dropped when it failed)."""
        rid = f"{self._prefix}-{next(self._ids)}"
        parts = [P.packed_header("bind_infer_request", rid), packed, *frames]
        if sum(map(len, parts)) > self._max_bytes:
            lane.unbound.add(key)
            return None
        reply = self._lane_exchange(lane, parts, rid, wait)
        try:
            if type(reply) is memoryview:
                raise P.ProtocolViolation("ProtocolError", "a record")
            header, content = P.unpack(reply[0]), P.unpack(reply[1])
        except P.ProtocolViolation:
            header = content = None
        if not isinstance(header, dict) or header.get("id") != rid or "status" not in header:
            self._drop_lane(lane)
            raise DaemonUnavailable(f"the local lane of {self.endpoint} answered {rid} with something that is "
                                    "no bind_infer_reply")
        if header["status"] != "ok" and isinstance(content, dict) and content.get("type") == "UnknownRequest":
            lane.unbound.add(key)  # a daemon from before bound infers: infers go framed on this lane
            return None
        if header["status"] != "ok" or not isinstance(content, dict):
            self._lane_done(lane)
            raise from_reply(content if isinstance(content, dict) else {"message": "an error reply without content"})
        index, offsets = content.get("binding"), content.get("offsets")
        ring = lane.ring
        if (type(index) is not int or ring is None or not isinstance(offsets, list) or len(offsets) != len(arrays)
                or not all(type(o) is int and 0 <= o for o in offsets)
                or any(o + a.nbytes > ring.half for o, a in zip(offsets, arrays))):
            lane.unbound.add(key)
            return None
        bound = lane.bindings[key] = ClientBinding(index, views(ring.request, [(a.dtype, a.shape) for a in arrays],
                                                                offsets))
        return bound

    def _bound_infer(self, lane: ClientLane, key: Any, bound: ClientBinding, arrays: list[np.ndarray],
                     wait: float | None) -> list[np.ndarray]:
        """A bound infer: its inputs written in the ring, its outputs read from a record there (or
        from a framed reply: an error, outputs too large for the ring)."""
        bound.write(arrays)
        reply = self._lane_exchange(lane, bound.index, None, wait)
        if type(reply) is memoryview:
            try:
                results = bound.read(reply)
            except ConnectionResetError as exc:
                self._drop_lane(lane)
                raise DaemonUnavailable(f"the local lane of {self.endpoint}: {exc}") from None
            self._lane_done(lane)
            return results
        try:
            header = P.unpack(reply[0])
        except P.ProtocolViolation:
            header = None
        if not isinstance(header, dict) or "status" not in header:
            self._drop_lane(lane)
            raise DaemonUnavailable(f"the local lane of {self.endpoint} answered with something that is no reply")
        self._lane_done(lane)
        if header["status"] == "ok":
            return self._infer_result(True, reply[1], reply[2:])
        error = _reply_error(reply[1])
        if error.get("type") in ("UnknownModel", "InvalidRequest"):  # the binding is gone: bind again next time
            lane.bindings.pop(key, None)
        raise from_reply(error)

    def _lane_exchange(self, lane: ClientLane, parts: list[Any] | int, rid: str | None, wait: float | None
                       ) -> list[Any] | memoryview:
        """Send a request on ``lane`` (its frames, or the number of a bound infer whose inputs are
        written) and read its reply (:meth:`ClientLane.receive_frames`). On failure the lane is
        dropped and the error raised."""
        try:
            if type(parts) is int:
                lane.send_bound(parts)
            else:
                lane.send(parts)
        except OSError as exc:
            # the daemon closed the lane, as it does when it stops: nothing was accepted. Later
            # requests go over ZeroMQ (a daemon started again offers a lane to new clients).
            self._drop_lane(lane)
            self._lane_offer = None
            raise DaemonUnavailable(f"the daemon at {self.endpoint} closed the local lane ({exc}); it is "
                                    "stopping or was restarted") from None
        wait = wait if wait is not None else self.timeout
        what = "a bound infer" if rid is None else f"request {rid}"
        try:
            return lane.receive_frames(wait)
        except TimeoutError:
            self._drop_lane(lane)
            raise TimeoutError(f"no reply to {what} from {self.endpoint} within {wait:g} s") from None
        except OSError as exc:
            self._drop_lane(lane)
            if self._closed.is_set():
                raise DaemonUnavailable("this client was closed while waiting for a reply") from None
            raise DaemonUnavailable(f"the daemon at {self.endpoint} closed the local lane before answering "
                                    f"{what} ({exc})") from None

    def _lane_done(self, lane: ClientLane) -> None:
        """The lane's exchange is over: idle again, or closed with the client."""
        if self._closed.is_set():
            self._drop_lane(lane)
        else:
            self._lanes_idle.append(lane)

    def _lane_infer_request(self, lane: ClientLane, packed_content: bytes, frames: Sequence[Any],
                            timeout: float | None) -> tuple[bool, memoryview, list[Any]] | None:
        """One framed infer request on ``lane``: whether the reply is ``ok``, its packed content
        and raw frames; or None when it must go over ZeroMQ instead (the request is over the
        daemon's limits). An ``ok`` reply's header is known in advance (see
        :func:`~vkpool.daemon.protocol.packed_header`): one that matches it is not unpacked."""
        rid = f"{self._prefix}-{next(self._ids)}"
        packed_rid = P.pack_id(rid)
        prefix, suffix = _INFER_REQUEST
        parts = [prefix + packed_rid + suffix, packed_content, *frames]
        if sum(map(len, parts)) > self._max_bytes:
            self._lane_done(lane)
            return None
        reply = self._lane_exchange(lane, parts, rid, timeout)
        if type(reply) is memoryview:  # a record where no bound infer was sent
            self._drop_lane(lane)
            raise DaemonUnavailable(f"the local lane of {self.endpoint} answered request {rid} with a record")
        prefix, suffix = _INFER_OK
        ok = reply[0] == prefix + packed_rid + suffix
        if not ok:
            try:
                header = P.unpack(reply[0])
            except P.ProtocolViolation:
                header = None
            if not isinstance(header, dict) or header.get("id") != rid or "status" not in header:
                self._drop_lane(lane)
                raise DaemonUnavailable(f"the local lane of {self.endpoint} answered "
                                        + (f"request {header.get('id')!r} instead of {rid}"
                                           if isinstance(header, dict) else "with something that is no reply"))
            ok = header["status"] == "ok"
        self._lane_done(lane)
        return ok, reply[1], reply[2:]

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._front_client is not None:
            self._front_client.close()
        with self._lane_lock:
            for lane in self._lanes:
                lane.shutdown()  # a thread waiting on one wakes up and closes it
            while self._lanes_idle:
                lane = self._lanes_idle.pop()
                self._lanes.discard(lane)
                lane.close()
        self._driver_wake.set()
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join()
        # the leader, if any, leaves within one poll slice
        held = self._lead.acquire(timeout=2 * _POLL_SLICE_MS / 1000 + 1)
        self._unwatch_connection()
        for sock in (self._sock, self._outbox, self._outbox_pull):
            sock.close(0)
        if held:
            self._lead.release()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def devices(self) -> list[dict[str, Any]]:
        return self.request("devices")[0]["members"]

    def load_model(self, model: str | os.PathLike[str] | bytes, *, name: str | None = None,
                   keep_alive: float | None = None, batch: int | None = None,
                   dims: Mapping[str, int] | None = None, max_batch: int | None = None,
                   max_queue_delay: float | None = None, objective: str | None = None) -> dict[str, Any]:
        """Load (or share) a model; ``batch``/``dims`` bind its symbolic dims as ``vkpool.Session``
        does (the same file with another binding is another model). ``max_batch``/``max_queue_delay``:
        the daemon batches the requests of every client of the model along its first dim
        (``docs/daemon.md``, "Dynamic batching"). ``objective``: ``latency`` (default) or
        ``throughput``, what the model's plan is made for (a copy per member that holds one, with
        ``throughput``)."""
        return self.request("load_model", *load_content(model, name, keep_alive, batch, dims, max_batch,
                                                        max_queue_delay, objective))[0]["model"]

    def list_models(self) -> list[dict[str, Any]]:
        return self.request("list_models")[0]["models"]

    def plan(self, model_id: str, budgets: Mapping[str, int | str] | None = None) -> dict[str, Any]:
        return self.request("plan", {"model": model_id, "budgets": dict(budgets) if budgets else None})[0]

    def infer(self, model_id: str, feeds: Mapping[str, Any], outputs: Iterable[str] | None = None, *,
              priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        wait = None if timeout is None else timeout + 5.0  # the daemon answers Timeout itself
        outputs = None if outputs is None else list(outputs)
        if self._lane_offer is not None:
            if self._closed.is_set():
                raise DaemonUnavailable("this client is closed")
            results = self._lane_infer(model_id, feeds, outputs, priority, timeout, wait)
            if results is not None:
                return results
        keyed = self._infer_key(model_id, feeds, outputs, priority, timeout)
        key, arrays = keyed
        for _ in range(2):  # a binding the daemon no longer knows (it was restarted) is made again once
            if key is None or key in self._frame_unbound:
                break
            bound = self._frame_bound.get(key)
            if bound is None:
                framed = self._framed(model_id, feeds, outputs, priority, timeout, keyed)
                bound = self._frame_bind(key, *framed[1:], wait)
                if bound is None:
                    break
            results = self._frame_infer(key, bound, arrays, wait)
            if results is not None:
                return results
        packed, frames = self._framed(model_id, feeds, outputs, priority, timeout, keyed)[2:]
        rid = f"{self._prefix}-{next(self._ids)}"
        prefix, suffix = _INFER_REQUEST
        reply = self._exchange(rid, self._checked("infer", [P.DELIMITER, prefix + P.pack_id(rid) + suffix, packed,
                                                            *frames]), wait, packed=True)
        if reply is None:
            self._timed_out("infer", wait)
        header, content, raw = reply
        return self._infer_result(header["status"] == "ok", content, raw)

    def _frame_bind(self, key: Any, arrays: list[np.ndarray], packed: bytes, frames: list[Any],
                    wait: float | None) -> ClientFrameBinding | None:
        """Bind an infer over ZeroMQ (``bind_infer``: the infer's own content and frames); None when
        the daemon does not (a daemon from before such bindings, or one that answers ``binding:
        null``): it then travels framed from now on. The error the infer itself would get is raised."""
        rid = f"{self._prefix}-{next(self._ids)}"
        message = [P.DELIMITER, P.packed_header("bind_infer_request", rid), packed, *frames]
        if sum(map(len, message)) > self._max_bytes:
            self._frame_unbound.add(key)
            return None
        reply = self._exchange(rid, message, wait)
        if reply is None:
            self._timed_out("bind_infer", wait)
        header, content, _ = reply
        if header["status"] != "ok":
            # a daemon without such bindings: framed, the infer itself says what else is wrong
            if content.get("type") in ("UnknownRequest", "InvalidRequest"):
                self._frame_unbound.add(key)
                return None
            raise from_reply(content)
        index, offsets = content.get("binding"), content.get("offsets")
        bound = ClientFrameBinding(index, arrays) if type(index) is int else None
        if bound is None or offsets != bound.offsets:
            self._frame_unbound.add(key)
            return None
        if len(self._frame_bound) >= 64:
            self._frame_bound.clear()
        self._frame_bound[key] = bound
        return bound

    def _frame_infer(self, key: Any, bound: ClientFrameBinding, arrays: list[np.ndarray], wait: float | None
                     ) -> list[np.ndarray] | None:
        """A bound infer over ZeroMQ: one frame each way (:mod:`vkpool.daemon.bound`). None when the
        daemon no longer knows the binding (the caller binds again)."""
        seq = next(self._ids)
        rid = f"frame-{seq}"
        reply = self._exchange(rid, self._checked("infer", [bound.frame(seq, arrays)]), wait, packed=True)
        if reply is None:
            self._timed_out("infer", wait)
        header, content, raw = reply
        if header is _RECORD:
            try:
                return bound.read(content)
            except ConnectionResetError as exc:
                raise DaemonUnavailable(f"{self.endpoint} answered a bound infer: {exc}") from None
        if header["status"] == "ok":
            return self._infer_result(True, content, raw)
        error = _reply_error(content)
        if error.get("type") in ("UnknownModel", "InvalidRequest"):  # the binding is gone
            self._frame_bound.pop(key, None)
            if error.get("type") == "InvalidRequest":
                return None
        raise from_reply(error)

    def _infer_result(self, ok: bool, content: Any, raw: list[Any]) -> list[np.ndarray]:
        """A framed infer reply's outputs, writable like the in-process session's results (a reply
        read from the ring, or a large one, is already); or its error, raised."""
        if not ok:
            raise from_reply(_reply_error(content))
        return [a if a.flags.writeable else a.copy() for a in self._outputs.read(content, raw)]

    def cancel(self, request_id: str) -> dict[str, Any]:
        return self.request("cancel", {"request_id": request_id})[0]

    def unload_model(self, model_id: str) -> dict[str, Any]:
        return self.request("unload_model", {"model": model_id})[0]

    def set_budget(self, member: str, size: int | str) -> dict[str, Any]:
        return self.request("set_budget", {"member": member, "size": size})[0]

    def status(self) -> dict[str, Any]:
        return self.request("status")[0]

    def shutdown(self) -> dict[str, Any]:
        return self.request("shutdown")[0]

    def session(self, model: str | os.PathLike[str] | bytes, *, name: str | None = None,
                keep_alive: float | None = None, batch: int | None = None,
                dims: Mapping[str, int] | None = None, max_batch: int | None = None,
                max_queue_delay: float | None = None, objective: str | None = None) -> "RemoteSession":
        return RemoteSession(self, self.load_model(model, name=name, keep_alive=keep_alive, batch=batch, dims=dims,
                                                   max_batch=max_batch, max_queue_delay=max_queue_delay,
                                                   objective=objective))


def _reply_error(packed: Any) -> dict[str, Any]:
    """An error reply's packed content as :func:`from_reply` takes it."""
    error = P.unpack(packed)
    return error if isinstance(error, dict) else {"message": "an error reply without content"}


def value_infos(described: list[dict[str, Any]]) -> list[ValueInfo]:
    return [ValueInfo(d["name"], d["shape"], d["type"], np.dtype(d["dtype"])) for d in described]


class RemoteSession:
    """A model loaded in the daemon, used like ``vkpool.Session``."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.model_id: str = info["id"]
        self._inputs = value_infos(info["inputs"])
        self._outputs = value_infos(info["outputs"])

    def get_inputs(self) -> list[ValueInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[ValueInfo]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], *,
            priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        return self.client.infer(self.model_id, input_feed, output_names, priority=priority, timeout=timeout)

    def memory_by_member(self) -> dict[str, int]:
        for model in self.client.list_models():
            if model["id"] == self.model_id:
                return dict(model["memory_by_member"])
        return {}

    def close(self) -> None:
        self.client.unload_model(self.model_id)

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


from vkpool.daemon.aclient import AsyncClient, AsyncRemoteSession  # noqa: E402  (re-export)

__all__ = ["AsyncClient", "AsyncRemoteSession", "Client", "RemoteSession", "ValueInfo"]
