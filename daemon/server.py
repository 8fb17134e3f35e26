"""The daemon's I/O thread: one ROUTER socket, every reply sent from here.

Only this thread touches the ROUTER socket. Workers and the admin thread hand their replies
over an inproc PUSH/PULL pair. Control requests are answered inline, so they never queue
behind compute.

Clients that leave are found through the socket monitor: a disconnect names a file
descriptor; each message's source descriptor maps it to the clients that used it, and those
are probed (a send with ROUTER_MANDATORY fails for a departed peer). What a departed client
held is released and its queued jobs are dropped, counted as ``client_gone``.

An ipc:// daemon also listens on a local lane (:mod:`vkpool.daemon.lane`): one thread, the
lanes' reactor, accepts its connections and reads them all, answers the bad requests and hands
the rest to :meth:`Service.handle` as the I/O thread does (a quick job on an idle model runs
right there); replies to a lane request are written on the lane by whichever thread produces
them. The bookkeeping shared with the ZeroMQ side (requests in progress, the replay window) is
guarded by one lock.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from vkpool.daemon import protocol as P
from vkpool.daemon.bound import (BINDINGS_MAX, FRAME_HEAD, REQUEST_MAGIC, Binding, FrameBinding, places,
                                 record_frame, views)
from vkpool.daemon.endpoint import (LISTEN_BACKLOG, ConnectionWatch, EndpointError, EndpointLock,
                                    connection_cap, fd_reserve, ipc_path, lane_fits, lane_path, raise_fd_limit)
from vkpool.daemon.lane import LaneConnection, LaneListener, LaneReactor, Poller, Ring, ring_supported, wake_sleepers
from vkpool.daemon.protocol import ProtocolViolation
from vkpool.daemon.runtime import classify
from vkpool.daemon.scheduler import Job
from vkpool.daemon.service import Service, _error, _in_time
from vkpool.daemon.settings import DaemonSettings
from vkpool.daemon.stats import Stats

log = logging.getLogger("vkpool.daemon")
_INFER_REQUEST = P.header_parts("infer_request")  # around the packed request id (P.packed_id)

_PROBE_DELAY_S = 0.3     # a disconnect is seen before the ROUTER drops the peer's pipe
_TICK_S = 0.05
_REPLY_GRACE_S = 10.0      # after the drain deadline: time for the replies of running jobs to go out
_REPLAY_BYTES = 64 << 20  # replies kept for retried request ids
#: replies a ZeroMQ client may leave in the daemon's socket unread (SNDHWM). A reply that finds
#: them all there waits in the daemon, in order, for up to REPLY_WAIT_S and REPLY_WAIT_BYTES per
#: client: a burst (thousands of Busy replies answered at once) reaches a client that reads, while
#: one that reads nothing has the replies past that dropped and counted client_gone, so it costs
#: only itself (vkpool's own client takes every reply off the wire as it comes)
REPLY_HWM = 256
REPLY_WAIT_S = 5.0
REPLY_WAIT_BYTES = 16 << 20
_COMPACT_MIN = 4096       # deadline entries before finished jobs are swept out


def _libc_function(name: str) -> Any:
    """A function of the C library the process runs on (glibc's ``malloc_trim``), or None."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")


class Server:
    def __init__(self, runtime: Any, settings: DaemonSettings, endpoint: str,
                 context: zmq.Context | None = None, metrics: Any = None) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self.ctx = context or zmq.Context.instance()
        self.stats = Stats(metrics)
        self.service = Service(runtime, settings, self._reply_from_thread, self.stats)
        self.service.watch = self._watch  # type: ignore[method-assign]
        self.service.inline_allowed = self._nothing_waiting  # type: ignore[method-assign]
        self.service.lane_offer = self._lane_offer  # type: ignore[method-assign]
        self._push_lock = threading.Lock()
        self._inbox_addr = f"inproc://vkpool-replies-{id(self)}"
        self._inbox = self.ctx.socket(zmq.PULL)
        self._inbox.bind(self._inbox_addr)
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.connect(self._inbox_addr)
        self._deadlines: list[tuple[float, int, Job]] = []
        self._deadline_lock = threading.Lock()
        self._compact_at = _COMPACT_MIN
        self._peers: dict[bytes, int] = {}              # client -> source fd of its last message
        self._unread_warned: set[bytes] = set()          # clients logged once for leaving replies unread
        # replies waiting for room in a client's socket: client -> [(since, frames, status, bytes)]
        self._waiting: dict[bytes, deque[tuple[float, list[Any], str | None, int]]] = {}
        self._waiting_bytes: dict[bytes, int] = {}
        self._probes: list[tuple[float, int]] = []      # (when, fd) of disconnects
        self._in_progress: set[tuple[bytes, str]] = set()
        self._replay: OrderedDict[tuple[bytes, str], tuple[list[Any], int]] = OrderedDict()  # reply, bytes
        self._replay_bytes = 0
        self._book = threading.Lock()  # _in_progress, _replay and _lanes_closed: the I/O and lanes' threads
        self._lane_routes: dict[tuple[bytes, str], LaneConnection] = {}  # lane requests in progress
        self._lanes: set[LaneConnection] = set()
        self._lanes_closed = False
        self._bound: list[tuple[LaneConnection, int]] = []  # bound infers read in the lanes' pass
        # bound infers of batching models waiting for company, by model (the entry's identity):
        # (entry, [(connection, binding, accepted at)]), and when the first of them must run
        self._bound_waiting: dict[int, tuple[Any, list[tuple[LaneConnection, Binding, float]]]] = {}
        self._bound_deadline = 0.0
        self._bound_ids = itertools.count()  # request ids of bound infers queued as jobs
        self._frame_bindings: dict[bytes, list[FrameBinding]] = {}  # bound infers over ZeroMQ, by client
        self._flights: dict[int, Any] = {}  # by model (the entry's identity): its batch left running
        self._latencies: list[float] = []  # of the bound infers answered ok in the lanes' pass
        self._lane_listener: LaneListener | None = None
        self._reactor: LaneReactor | None = None  # reads the lanes, from serve_forever on
        self._io_ident: int | None = None
        self._lock: EndpointLock | None = None
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self._drain_answered = False
        self._trimmed_at = 0
        self.fd_limit = raise_fd_limit()
        # lane connections hold a descriptor each: what they may use is kept from the ZeroMQ cap
        self.max_lanes = min(settings.max_lane_connections, max(0, (self.fd_limit - fd_reserve(self.fd_limit)) // 2))
        self.max_connections = connection_cap(settings.max_connections, self.fd_limit - self.max_lanes)
        self._router = self._bind()
        self._bind_lane()

    # -- sockets ------------------------------------------------------------------------------
    def _bind(self) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        router.setsockopt(zmq.SNDHWM, REPLY_HWM)  # every send is non-blocking: see _router_send
        router.setsockopt(zmq.LINGER, 2000)
        router.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if self.endpoint.startswith("tcp://"):
            self._setup_curve(router)
        path = ipc_path(self.endpoint)
        if path is not None:
            self._lock = EndpointLock(path)
            self._lock.acquire()
        self._connections = ConnectionWatch(router, self.fd_limit, path, log)
        try:
            old = os.umask(0o177)  # the socket file is created 0600: no window where others connect
            try:
                router.bind(self.endpoint)
            finally:
                os.umask(old)
        except zmq.ZMQError as exc:
            self.close_sockets(router)
            raise EndpointError(f"cannot bind {self.endpoint}: {exc}") from None
        log.info("listening on %s (fd limit %d, max connections %d)", self.endpoint, self.fd_limit,
                 self.max_connections)
        return router

    def _bind_lane(self) -> None:
        path = ipc_path(self.endpoint)
        if path is None or self.max_lanes == 0:
            return
        if not lane_fits(path):
            log.warning("no local lane: %s is too long for a Unix socket", lane_path(path))
            return
        try:
            self._lane_listener = LaneListener(lane_path(path))
        except OSError as exc:
            log.warning("no local lane: cannot bind %s: %s", lane_path(path), exc)
            return
        log.info("local lane on %s (max %d connections)", self._lane_listener.path, self.max_lanes)

    def _lane_offer(self, client: bytes) -> dict[str, Any] | None:
        return None if self._lane_listener is None else self._lane_listener.offer(client)

    def _setup_curve(self, router: zmq.Socket) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        curve = self.settings.curve
        if curve is None:
            raise EndpointError(f"refusing plain TCP on {self.endpoint}: anyone who reaches the port could "
                                "load files and run jobs as this user. Configure daemon.curve (server_secret_key, "
                                "authorized_keys_dir) or use the default ipc:// endpoint")
        public, secret = zmq.auth.load_certificate(str(curve.server_secret_key))
        if secret is None:
            raise EndpointError(f"{curve.server_secret_key} holds no secret key")
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(curve.authorized_keys_dir))
        router.curve_secretkey = secret
        router.curve_publickey = public
        router.curve_server = True

    # -- replies ------------------------------------------------------------------------------
    def _reply_from_thread(self, client: bytes, rid: str, action: str | None, status: str,
                           content: dict[str, Any] | bytes, frames: list[Any]) -> None:
        if self._lane_routes:
            lane = self._lane_routes.pop((client, rid), None)
            if lane is not None:
                self._lane_reply(lane, (client, rid), action, status, content, frames)
                return
        status, body = _reply_body(action, rid, status, content, frames)
        if threading.get_ident() == self._io_ident:
            self._send_reply(client, rid, status, body)
            return
        with self._push_lock:
            self._push.send_multipart([client, rid.encode(), status.encode(), *body], copy=False)

    def _send_handed_over(self, message: list[zmq.Frame]) -> None:
        client, rid, status, *body = message
        self._send_reply(client.bytes, rid.bytes.decode(), status.bytes.decode(), body)

    def _send_reply(self, client: bytes, rid: str, status: str, body: list[Any]) -> None:
        key = (client, rid)
        with self._book:
            self._in_progress.discard(key)
        if not self._router_send(client, body, status):
            self.stats.count("client_gone")
            return
        with self._book:
            self._remember(key, body)

    def _sent(self, status: str | None, body: list[Any]) -> None:
        if status is not None:
            self.stats.count(status)
            if status == "error":
                self.stats.error_reply(body)

    def _router_send(self, client: bytes, body: list[Any], status: str | None = None) -> bool:
        """Send to a ZeroMQ client without waiting; a reply that finds its socket full waits in the
        daemon (REPLY_WAIT_S, REPLY_WAIT_BYTES) after the ones already waiting. False when the
        client is gone, or leaves so much unread that this one is dropped (logged once per client).
        ``status``: the outcome counted once the reply is out (None: not counted)."""
        if client not in self._waiting:
            try:
                P.send_parts(self._router, [client, *body], dontwait=True)
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                return False
            else:
                self._sent(status, body)
                return True
        size = sum(memoryview(f.buffer if isinstance(f, zmq.Frame) else f).nbytes for f in body)
        if self._waiting_bytes.get(client, 0) + size > REPLY_WAIT_BYTES:
            self._unread(client)
            return False
        self._waiting.setdefault(client, deque()).append((time.monotonic(), body, status, size))
        self._waiting_bytes[client] = self._waiting_bytes.get(client, 0) + size
        return True

    def _unread(self, client: bytes) -> None:
        if client not in self._unread_warned:
            self._unread_warned.add(client)
            log.warning("client %s leaves replies unread (%d in its socket, more waiting %.0f s); its further "
                        "replies are dropped while it does", client.hex()[:12], REPLY_HWM, REPLY_WAIT_S)

    def _send_waiting(self, now: float) -> None:
        """Sends the replies waiting for room, in order; a client whose oldest has waited past
        REPLY_WAIT_S reads nothing: what waits for it is dropped, each counted client_gone."""
        for client in list(self._waiting):
            queue = self._waiting[client]
            while queue:
                since, body, status, size = queue[0]
                try:
                    P.send_parts(self._router, [client, *body], dontwait=True)
                except zmq.Again:
                    if now - since <= REPLY_WAIT_S:
                        break
                    self._unread(client)
                    self.stats.count("client_gone", len(queue))
                    queue.clear()
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    self.stats.count("client_gone", len(queue))
                    queue.clear()
                    break
                queue.popleft()
                self._waiting_bytes[client] -= size
                self._sent(status, body)
            if not queue:
                del self._waiting[client]
                self._waiting_bytes.pop(client, None)

    def _remember(self, key: tuple[bytes, str], frames: list[Any], size: int | None = None) -> None:
        """Keep the reply for a retry of the same request id, within a count and a byte bound
        (call with ``_book`` held). ``size``: the frames' bytes, when the caller has counted them."""
        if size is None:
            size = sum(map(len, frames))
        if size > _REPLAY_BYTES // 16:
            header = {**P.unpack(_b(frames[1])), "status": "error"}
            frames = P.encode(header, {
                "type": "ReplayUnavailable", "message": "the reply was sent once and is too large to replay",
                "details": {"bytes": size}})
            size = sum(map(len, frames))
        replay = self._replay
        replay[key] = (frames, size)
        self._replay_bytes += size
        while len(replay) > self.settings.replay_window or self._replay_bytes > _REPLAY_BYTES:
            self._replay_bytes -= replay.popitem(last=False)[1][1]
        self.stats.replay_bytes = self._replay_bytes

    def _error_now(self, client: bytes, rid: str | None, action: str | None, violation: ProtocolViolation) -> None:
        self._send_reply(client, rid or "", *_reply_body(action, rid, "error", _error(violation), []))

    # -- requests -----------------------------------------------------------------------------
    def _recv_request(self) -> tuple[list[Any], int]:
        """One request's frames (routing id, delimiter, header and content as bytes; raw frames
        zero-copy) and the file descriptor it came from."""
        router = self._router
        first = frame = router.recv(copy=False)
        parts: list[Any] = [first.bytes]
        while frame.more:  # see protocol.recv_parts
            frame = router.recv(copy=False)
            if len(parts) == 1 and not frame.more and frame.buffer[:4] == REQUEST_MAGIC:
                parts.append(frame)  # a bound infer's one frame (vkpool.daemon.bound), read in place
                break
            parts.append(frame.bytes if len(parts) < 4 else frame)
        return parts, _source_fd(first)

    def _on_request(self, raw: list[Any], fd: int = -1) -> None:
        if len(raw) < 2:
            self.stats.count("dropped")  # nothing after the routing frame: nowhere to reply
            return
        client = _b(raw[0])
        if len(raw) == 2 and type(raw[1]) is zmq.Frame:
            self._on_frame_bound(client, raw[1].buffer)
            return
        header: dict[str, Any] = {}
        try:
            # a DEALER client sends no routing frames: the delimiter follows the client's id
            body = raw[2:] if len(raw) > 2 and _b(raw[1]) == P.DELIMITER else P.split_routing(raw[1:])[1]
            if client not in self._peers and len(self._peers) >= self.max_connections:
                header = _peek_header(body)
                raise ProtocolViolation(
                    "TooManyConnections", f"the daemon serves {len(self._peers)} clients (max_connections "
                    f"{self.max_connections}); close idle clients or raise daemon.max_connections")
            self._peers[client] = fd
            size = sum(len(f) for f in raw)
            if len(raw) > self.settings.max_frames or size > self.settings.max_message_bytes:
                header = _peek_header(body)
                raise ProtocolViolation("MessageTooLarge", f"request of {len(raw)} frames and {size} bytes "
                                        f"exceeds max_frames {self.settings.max_frames} or max_message_bytes "
                                        f"{self.settings.max_message_bytes}",
                                        {"frames": len(raw), "bytes": size})
            header = _peek_header(body)
            rid = header.get("id")
            if isinstance(rid, str) and (replay := self._retried((client, rid))) is not None:
                if replay:  # answered before: send the same reply again, run nothing
                    self._router_send(client, replay)
                return
            raw_content = _infer_content(header, body)
            plan = None if raw_content is None else self.service.cached_plan(raw_content, client)
            if plan is None:
                header, content, frames = P.decode_request(body, header)
                if P.action_of(header) in P.LANE_ONLY:
                    raise ProtocolViolation("InvalidRequest", f"{header['type']} travels on the local lane only")
        except Exception as exc:  # a request that cannot be taken is answered, whatever went wrong
            rid = header.get("id") if isinstance(header.get("id"), str) else None
            self.stats.count("accepted")
            self._error_now(client, rid, P.action_of(header), _violation(exc))
            return
        self.stats.count("accepted")
        action = P.action_of(header)
        with self._book:
            self._in_progress.add((client, rid))
        try:
            if plan is not None:
                self.service.infer_planned(client, rid, plan, body[2:], None)
            elif action == "bind_infer":
                self._frame_bind(client, rid, content, frames)
            elif action == "shutdown":
                self._reply_from_thread(client, rid, action, "ok",
                                        {"draining": True, "in_flight": self.service.scheduler.in_flight()}, [])
                self.request_stop()
            else:
                self.service.handle(client, header, content, frames, self._connections.connections,
                                    raw_content=raw_content)
        except Exception as exc:
            self._error_now(client, rid, action, _violation(exc))

    def _retried(self, key: tuple[bytes, str]) -> list[Any] | None:
        """For a request id in progress or answered: the reply to send again ([] when none is to be
        sent now, the request being still in progress); None for a new request id."""
        with self._book:
            if key in self._in_progress:
                replay: list[Any] | None = []
            else:
                kept = self._replay.get(key)
                replay = None if kept is None else kept[0]
            if replay is not None:
                self.stats.count("retries")
            return replay

    # -- bound infers over ZeroMQ (vkpool.daemon.bound) ---------------------------------------
    def _frame_bind(self, client: bytes, rid: str, content: dict[str, Any], frames: list[Any]) -> None:
        """A ``bind_infer`` over ZeroMQ: checked as its infer, then its inputs' places in the frame
        of a bound infer (:class:`FrameBinding`); ``binding: null`` past ``BINDINGS_MAX``."""
        try:
            plan, feeds, _ = self.service.check_bound(client, content, frames)
            names = [meta["name"] for meta in content["inputs"]]
            bindings = self._frame_bindings.setdefault(client, [])
            reply: dict[str, Any] = {"binding": None, "offsets": []}
            if len(bindings) < BINDINGS_MAX:
                item = FrameBinding(plan, names, [feeds[n] for n in names])
                if item.size <= self.settings.max_message_bytes:
                    bindings.append(item)
                    reply = {"binding": len(bindings) - 1, "offsets": item.offsets}
            status = "ok"
        except Exception as exc:
            status, reply = "error", _error(_violation(exc))
        self._send_reply(client, rid, *_reply_body("bind_infer", rid, status, reply, []))

    def _on_frame_bound(self, client: bytes, frame: memoryview) -> None:
        """A bound infer over ZeroMQ: run here and answered with a record frame when its model is
        quick, idle and does not batch (as :meth:`Service._run_inline` runs a framed infer), else
        queued as a job and answered framed, by the id ``frame-`` + its sequence number. Every
        error is answered framed, by that id."""
        _, index, seq = FRAME_HEAD.unpack_from(frame)
        rid = f"frame-{seq}"
        accepted = time.monotonic()
        self.stats.count("accepted")
        service = self.service
        try:
            bindings = self._frame_bindings.get(client)
            item = bindings[index] if bindings is not None and index < len(bindings) else None
            if item is None:
                raise ProtocolViolation("InvalidRequest", f"this client has no binding {index}; send "
                                        "bind_infer_request first")
            if len(frame) != item.size:
                raise ProtocolViolation("InvalidRequest", f"a bound infer of binding {index} is {item.size} "
                                        f"bytes, got {len(frame)}")
            if service.draining:
                raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
            plan = item.plan
            entry = plan.entry
            if not service.registry.current(entry, client):
                raise ProtocolViolation("UnknownModel", f"model {entry.id[:12]} is not loaded by this client "
                                        "any more; load it and bind again", {"model": entry.id})
            feeds = item.feeds(frame)
            quick = entry.batching is None and service.inline_allowed()
            queue = service.claim_where_read(entry, 1) if quick else None
            if queue is None:
                with self._book:
                    self._in_progress.add((client, rid))
                service.queue_bound(client, rid, plan, feeds, accepted, inline=None)
                return
            try:
                result, queued_s, run_s = service.run_one(entry, plan.outputs, feeds, accepted)
            finally:
                service.scheduler.release_claim(queue, entry.gate, 1)
            now = time.monotonic()
            result = _in_time(plan, result, accepted, now)
            if isinstance(result, ProtocolViolation):
                raise result
            record = record_frame(seq, result)
            if record is None:  # outputs a record cannot name: framed
                names = plan.outputs or entry.output_names
                content, frames = service._replies.pack(names, result, queued_s, run_s)
        except Exception as exc:
            self._error_now(client, rid, "infer", _violation(exc))
            return
        # the one reply, sent after everything that could fail
        if record is None:
            self._send_reply(client, rid, *_reply_body("infer", rid, "ok", content, frames))
        elif not self._router_send(client, [record], "ok"):
            self.stats.count("client_gone")
            return
        self.stats.infer_done(now - accepted, now)

    # -- the local lane -----------------------------------------------------------------------
    def _lane_accept(self, sock: Any) -> LaneConnection | None:
        """A new lane connection (the reactor's thread): kept, or refused at once beyond
        ``max_lanes``."""
        conn = LaneConnection(sock, self._reply_lost)
        if len(self._lanes) >= self.max_lanes:
            self._lane_error(conn, b"", {}, ProtocolViolation(
                "TooManyConnections", f"the daemon has {len(self._lanes)} local lane connections "
                f"(max_lane_connections {self.max_lanes}); use ZeroMQ"))
            conn.close()
            return None
        self._lanes.add(conn)
        self.stats.lanes = len(self._lanes)
        self._connections.check()
        return conn

    def _lane_request(self, conn: LaneConnection, parts: list[Any] | int) -> None:
        if type(parts) is int:  # a bound infer: run with the others of this pass, at its end
            self._bound.append((conn, parts))
            return
        try:
            self._on_lane_request(conn, parts)
        except Exception:  # never let one message take the lane down
            log.exception("unexpected failure handling a lane message; dropped")
            self.stats.count("dropped")

    def _lane_ended(self, conn: LaneConnection, failed: bool) -> None:
        if failed:
            self.stats.count("dropped")
        self._lane_closed(conn)

    def _open_lane(self, conn: LaneConnection, parts: list[Any]) -> bool:
        """Bind the connection to its ZeroMQ client; False (answered, to be closed) when refused."""
        header: dict[str, Any] = {}
        try:
            header = _peek_header(parts)
            header, content, _ = P.decode_request(parts, header)
            if P.action_of(header) != "open_lane":
                raise ProtocolViolation("InvalidRequest", f"the first message on a local lane must be "
                                        f"open_lane_request, not {header['type']}")
            try:
                client = bytes.fromhex(content["client"])
            except ValueError:
                client = b""
            assert self._lane_listener is not None
            if not client or not self._lane_listener.check(client, content["token"]):
                raise ProtocolViolation("InvalidRequest", "open_lane: the token is not the one this daemon "
                                        "gave this client in its hello reply")
        except Exception as exc:
            self._lane_error(conn, b"", header, _violation(exc))
            return False
        conn.client = client
        ring, fd = None, -1
        if content.get("ring") and self.settings.lane_poll > 0 and ring_supported():
            try:
                ring, fd = Ring.create(self.settings.lane_ring_bytes)
            except OSError as exc:
                log.info("no ring for a local lane: %s", exc)
        self.stats.count("accepted")
        try:
            self._lane_reply(conn, None, "open_lane", "ok", {"ring": None if ring is None else ring.half}, [],
                             () if ring is None else (fd,))
        finally:
            if ring is not None:
                os.close(fd)
        conn.ring = ring
        return True

    def _on_lane_request(self, conn: LaneConnection, parts: list[Any]) -> None:
        """One request on a lane (the reactor's thread). A short job runs right here when its
        model is idle: the reactor takes the next request after it, and no thread hands it on."""
        client = conn.client
        assert client is not None
        header: dict[str, Any] = {}
        try:
            header = _peek_header(parts)
            rid = header.get("id")
            raw_content = _infer_content(header, parts)
            plan = None if raw_content is None else self.service.cached_plan(raw_content, client)
            if plan is None:
                if isinstance(rid, str) and (replay := self._retried((client, rid))) is not None:
                    if replay:
                        conn.send(replay)
                    return
                header, content, frames = P.decode_request(parts, header)
                action = P.action_of(header)
                if action == "bind_infer":
                    self._bind_infer(conn, client, rid, content, frames)
                    return
                if action not in P.LANE_ACTIONS or action in P.LANE_ONLY:
                    raise ProtocolViolation("InvalidRequest", f"{header['type']} does not travel on the local "
                                            "lane; send it over ZeroMQ")
        except Exception as exc:
            self._lane_error(conn, client, header, _violation(exc))
            return
        key = (client, rid)
        replay = None
        with self._book:
            retried = plan is not None and (key in self._in_progress or key in self._replay)
            accepted = not retried and not self._lanes_closed
            if retried:  # on the fast path the retry check is made here, with the acceptance
                self.stats.count("retries")
                kept = self._replay.get(key)
                replay = None if kept is None else kept[0]
            elif accepted:
                self._in_progress.add(key)
                self._lane_routes[key] = conn
                self.stats.count("accepted")
        if not accepted:
            if replay:
                conn.send(replay)
            elif not retried:  # the daemon is stopping: not accepted, and the lane closes
                conn.shutdown()
            return
        try:
            if plan is not None:
                self.service.infer_planned(client, rid, plan, parts[2:], True)
            else:
                self.service.handle(client, header, content, frames, inline=True, raw_content=raw_content)
        except Exception as exc:
            self._reply_from_thread(client, rid, action if plan is None else "infer", "error",
                                    _error(_violation(exc)), [])

    # -- bound infers (vkpool.daemon.bound) ---------------------------------------------------
    def _bind_infer(self, conn: LaneConnection, client: bytes, rid: str, content: dict[str, Any],
                    frames: list[Any]) -> None:
        """Check a ``bind_infer`` as its infer, and lay its inputs out in the lane's ring."""
        with self._book:
            if self._lanes_closed:
                conn.shutdown()
                return
            self.stats.count("accepted")
        try:
            plan, feeds, rows = self.service.check_bound(client, content, frames)
            arrays = [feeds[meta["name"]] for meta in content["inputs"]]
            offsets, size = places([a.nbytes for a in arrays])
            ring = conn.ring
            reply: dict[str, Any] = {"binding": None, "offsets": []}
            if ring is not None and size <= ring.half and len(conn.bindings) < BINDINGS_MAX:
                placed = views(ring.request, [(a.dtype, a.shape) for a in arrays], offsets)
                conn.bindings.append(Binding(plan, {m["name"]: v for m, v in zip(content["inputs"], placed)}, rows))
                reply = {"binding": len(conn.bindings) - 1, "offsets": offsets}
            status: str = "ok"
        except Exception as exc:
            status, reply = "error", _error(_violation(exc))
        self._lane_reply(conn, (client, rid), "bind_infer", status, reply, [])

    def _lanes_passed(self) -> None:
        """The end of the lanes' pass over what they held: the batches left running that have
        ended are answered (:meth:`Service.land`), the bound infers it read run, by model, with
        those that waited for company (a model's batch still running goes back to
        :meth:`Service.run_bound` with them), then the batches it held (:meth:`Service.run_held`),
        every batch still running landed first."""
        if self._flights:  # batches left running that have ended: answered now
            self._land(only_done=True)
        if self._bound or self._bound_waiting:
            bound, self._bound = self._bound, []
            self._run_bound(bound)
        if self._flights and self.service.holds():  # its batches take run slots as they come
            self._land()
        self.service.run_held()
        if self._latencies:  # the same list: a flight answered in a later pass appends to it
            self.stats.infers_done(self._latencies, time.monotonic())
            self._latencies.clear()

    def _land(self, only_done: bool = False) -> None:
        """The batches left running (:meth:`Service.run_bound`) answered: those that have ended,
        or all."""
        for key, flight in list(self._flights.items()):
            if not only_done or flight.done():
                del self._flights[key]
                self.service.land(flight)

    def _bound_due(self) -> float | None:
        """When the first bound infer waiting for company must run (a ``time.monotonic()``
        value; the lanes' thread passes again by then), or None; at once while a batch is left
        running (:meth:`Service.run_bound`): the thread polls until it can answer it."""
        if self._flights:
            return 0.0
        return self._bound_deadline if self._bound_waiting else None

    def _run_bound(self, items: list[tuple[LaneConnection, int]]) -> None:
        """Bound infers read in this pass, and those waiting for company from earlier passes: run
        by model, a batching model's by :meth:`Service.run_bound`, any other's by
        :meth:`_run_plain`. A batching model with a queue delay whose batches run
        here keeps its requests waiting while they wait for company (:meth:`BatchRunner.awaits`)
        and the first of them has waited less than ``max_queue_delay``: the lanes' thread reads on
        meanwhile and runs them with what comes, as the scheduler's queue would for framed
        requests. Each request is checked against its client's models once, when it runs."""
        now = time.monotonic()
        with self._book:
            closed = self._lanes_closed
            if not closed:
                self.stats.count("accepted", len(items))
        groups, self._bound_waiting = self._bound_waiting, {}
        if closed:  # the daemon is stopping: not accepted, and the lanes close
            for conn, _ in items:
                conn.shutdown()
            for _, members in groups.values():
                for conn, _, _ in members:
                    conn.shutdown()
            return
        for conn, index in items:
            bindings = conn.bindings
            item = bindings[index] if index < len(bindings) else None
            if item is None:
                self._bound_error(conn, ProtocolViolation(
                    "InvalidRequest", f"this lane has no binding {index}; send bind_infer_request first"))
                continue
            entry = item.plan.entry  # by identity: a model loaded again is another entry of the same id
            group = groups.get(id(entry))
            if group is None:
                groups[id(entry)] = (entry, [(conn, item, now)])
            else:
                group[1].append((conn, item, now))
        done = self._latencies  # the latencies of the infers answered ok
        current = self.service.registry.current
        for key, (entry, members) in groups.items():
            runner = entry.batching  # a model whose batches run elsewhere waits in its queue instead
            if (runner is not None and runner.max_queue_delay > 0 and not self.service.draining
                    and self.service.runs_where_read(entry)):
                due = members[0][2] + runner.max_queue_delay
                senders = [conn.client for conn, _, _ in members]
                if now < due and runner.awaits(senders, sum(item.rows for _, item, _ in members)):
                    if not self._bound_waiting or due < self._bound_deadline:
                        self._bound_deadline = due
                    self._bound_waiting[key] = (entry, members)
                    continue
            for conn, _, _ in members:
                if not current(entry, conn.client):  # some are not: each answered UnknownModel
                    members = [m for m in members if self._bound_current(m[0], entry)]
                    break
            if not members:
                continue
            if runner is None:
                self._run_plain(entry, members, done)
            else:
                self._run_bound_group(entry, members, done)

    def _bound_current(self, conn: LaneConnection, entry: Any) -> bool:
        """Whether a bound infer's model is still loaded by its client; if not, it is answered
        ``UnknownModel`` (the client binds again after loading)."""
        if self.service.registry.current(entry, conn.client):
            return True
        self._bound_error(conn, ProtocolViolation(
            "UnknownModel", f"model {entry.id[:12]} is not loaded by this client any more; load it and bind again",
            {"model": entry.id}))
        return False

    def _run_plain(self, entry: Any, members: list[tuple[LaneConnection, Binding, float]], done: list[float]) -> None:
        """The bound infers of a model that does not batch (each with when it was accepted): run
        on this thread when the model is idle and quick (:meth:`Service.claim_where_read`), a lone
        one by :meth:`Service.run_one`, several by :meth:`Service.run_many`; else queued as jobs.
        Each is answered once, whatever fails."""
        service = self.service
        queue = service.claim_where_read(entry, len(members))
        if queue is None:
            for member in members:
                self._bound_queued(*member)
            return
        answered: set[int] = set()
        try:
            if len(members) == 1 and entry.session.executor is None:
                conn, item, accepted = members[0]
                result, queued_s, run_s = service.run_one(entry, item.plan.outputs, item.feeds, accepted)
                answered = {0}
                self._answer_bound([(conn, item, accepted, result, queued_s)], run_s, done)
            else:
                def answer(k: int, result: Any, queued_s: float, run_s: float) -> None:
                    answered.add(k)
                    self._answer_bound([(*members[k], result, queued_s)], run_s, done)

                service.run_many(entry, [item for _, item, _ in members], [a for _, _, a in members], answer)
        except Exception as exc:
            self._bound_failed(members, answered, exc)
        finally:
            service.scheduler.release_claim(queue, entry.gate, len(members))

    def _bound_failed(self, members: list[tuple[LaneConnection, Binding, float]], answered: set[int],
                      exc: BaseException) -> None:
        """Never a request without its reply: the members not in ``answered`` get ``exc``'s error."""
        violation = _violation(exc)
        for k, (conn, _, _) in enumerate(members):
            if k not in answered:
                answered.add(k)
                self._bound_error(conn, violation)

    def _run_bound_group(self, entry: Any, members: list[tuple[LaneConnection, Binding, float]],
                         done: list[float]) -> None:
        """A batching model's bound infers (each with when it was accepted) run now as batches
        (:meth:`Service.run_bound`), each answered once."""
        answered: set[int] = set()

        def answer_batch(at: int, count: int, results: Any, started: float, finished: float) -> None:
            answered.update(range(at, at + count))
            group = members[at:at + count]
            if entry.batching is not None:
                entry.batching.answered([conn.client for conn, _, _ in group])
            if isinstance(results, ProtocolViolation):
                results = [results] * count
            self._answer_bound([(*m, r, started - m[2]) for m, r in zip(group, results)], finished - started, done)

        def fallback(k: int) -> None:
            answered.add(k)
            self._bound_queued(*members[k])

        def failed(exc: BaseException) -> None:
            self._bound_failed(members, answered, exc)

        key = id(entry)
        # a batch is left running only where the lanes' thread polls (lane_poll): it polls until
        # it can answer it, which a machine of fewer than 4 CPUs cannot spare
        keep = failed if self.settings.lane_poll > 0 else None
        try:  # the model's batch left running by the pass before goes back to run_bound
            kept = self.service.run_bound(entry, [item for _, item, _ in members], [a for _, _, a in members],
                                          answer_batch, fallback, keep, self._flights.pop(key, None))
        except Exception as exc:
            failed(exc)
        else:
            if kept is not None:
                self._flights[key] = kept

    def _answer_bound(self, answers: list[tuple[LaneConnection, Binding, float, Any, float]], run_s: float,
                      done: list[float]) -> None:
        """Bound infers answered, each ``(connection, binding, accepted at, outputs or
        ProtocolViolation, queued_s)``: outputs are posted in the ring as a record, then one fence
        for them all and the wake-ups of the clients asleep (:func:`~vkpool.daemon.lane.wake_sleepers`);
        an error, a request past its timeout, or outputs a record cannot hold are answered framed
        (outputs then copied: the reply may wait to be written while the next batch runs)."""
        now = time.monotonic()
        self.stats.count("ok", len(answers))  # counted before they are written, as every reply
        posted: list[LaneConnection] = []
        accepted_at: list[float] = []
        unsent = 0
        for conn, item, accepted, result, queued_s in answers:
            try:
                result = _in_time(item.plan, result, accepted, now)
                sent = conn.post_record(item.fill, result) if type(result) is list else -1
            except Exception as exc:  # outputs the record cannot hold: answered framed
                sent, result = -1, _violation(exc)
            if sent > 0:
                posted.append(conn)
                accepted_at.append(accepted)
                continue
            unsent += 1
            if sent == 0:
                self.stats.count("client_gone")
            else:
                self._bound_framed(conn, item, [a.copy() for a in result] if type(result) is list else result,
                                   queued_s, run_s, accepted, done)
        gone = wake_sleepers(posted)
        if gone:
            self.stats.count("client_gone", len(gone))
            accepted_at = [a for conn, a in zip(posted, accepted_at) if conn not in gone]
        if unsent or gone:
            self.stats.count("ok", -unsent - len(gone))
        done += [now - a for a in accepted_at]

    def _bound_framed(self, conn: LaneConnection, item: Binding, result: Any, queued_s: float, run_s: float,
                      accepted: float, done: list[float]) -> None:
        """A bound infer answered with a framed reply: its error, or outputs too large for the ring."""
        if isinstance(result, ProtocolViolation):
            self._bound_error(conn, result)
            return
        plan = item.plan
        try:
            content, frames = self.service._replies.pack(plan.outputs or plan.entry.output_names, result,
                                                        queued_s, run_s)
        except Exception as exc:
            self._bound_error(conn, classify(exc))
            return
        conn.ring_reply = True
        self._lane_reply(conn, None, "infer", "ok", content, frames)
        done.append(time.monotonic() - accepted)

    def _bound_error(self, conn: LaneConnection, violation: ProtocolViolation) -> None:
        conn.ring_reply = True
        self._lane_reply(conn, None, "infer", "error", _error(violation), [])

    def _bound_queued(self, conn: LaneConnection, item: Binding, accepted: float) -> None:
        """A bound infer queued as a job (its model is busy, or slow): answered framed, by id."""
        client = conn.client
        assert client is not None
        rid = f"bound-{next(self._bound_ids)}"
        key = (client, rid)
        with self._book:
            self._in_progress.add(key)
            self._lane_routes[key] = conn
        conn.ring_reply = True
        try:
            self.service.queue_bound(client, rid, item.plan, item.feeds, accepted)
        except Exception as exc:
            self._reply_from_thread(client, rid, "infer", "error", _error(_violation(exc)), [])

    def _lane_error(self, conn: LaneConnection, client: bytes, header: dict[str, Any],
                    violation: ProtocolViolation) -> None:
        """Answer a request refused before it was accepted."""
        rid = header.get("id") if isinstance(header.get("id"), str) else None
        with self._book:
            if self._lanes_closed:
                conn.shutdown()
                return
            self.stats.count("accepted")
        self._lane_reply(conn, None if rid is None else (client, rid), P.action_of(header), "error",
                         _error(violation), [])

    def _lane_broken(self, conn: LaneConnection, exc: P.LaneError) -> None:
        """The stream cannot be read on: answer when the error can be, then the lane closes."""
        if exc.violation is None:
            log.info("a local lane closed in the middle of a message")
            self.stats.count("dropped")
            return
        header: dict[str, Any] = {}
        if exc.header is not None:
            try:
                header = _peek_header([exc.header])
            except ProtocolViolation:
                pass
        log.info("closing a local lane: %s", exc.violation.message)
        self._lane_error(conn, conn.client or b"", header, exc.violation)

    def _lane_reply(self, conn: LaneConnection, key: tuple[bytes, str] | None, action: str | None, status: str,
                    content: dict[str, Any] | bytes, frames: list[Any], fds: tuple[int, ...] = ()) -> None:
        """Write a reply on a lane. Counted before it is written (a client reading its reply sees
        the counters balance); the request stays in progress until it is written, so a stop waits
        for it. ``key`` None: not remembered for retries (``open_lane``, a request without an id)."""
        rid = None if key is None else key[1]
        status, body = _reply_body(action, rid, status, content, frames)
        self.stats.count(status)
        if status == "error":
            self.stats.error_reply(body)
        sent = conn.send(body, 1, fds, status)
        if not sent:
            self.stats.count(status, -1)
            self.stats.count("client_gone")
        if key is not None:
            with self._book:
                self._in_progress.discard(key)
                if sent:
                    self._remember(key, body, sent + len(P.DELIMITER))

    def _reply_lost(self, status: str) -> None:
        """A lane reply counted as ``status`` was never written: the client left."""
        self.stats.count(status, -1)
        self.stats.count("client_gone")

    def _lane_closed(self, conn: LaneConnection) -> None:
        """A lane connection ended: its queued jobs are dropped (``client_gone``); the replies of
        its running jobs will find it closed."""
        conn.close()
        self._lanes.discard(conn)
        self.stats.lanes = len(self._lanes)
        mine = {key for key, lane in self._lane_routes.copy().items() if lane is conn}
        if mine:
            for job in self.service.scheduler.drop_queued(lambda j: (j.client, j.request_id) in mine):
                job.fail("Cancelled", "client left")  # the write fails and counts client_gone

    def _nothing_waiting(self) -> bool:
        """True when no further request is waiting on the socket (a short job may then run here)."""
        return not self._router.get(P.EVENTS) & P.POLLIN

    def _watch(self, job: Job) -> None:
        if job.deadline is not None:
            with self._deadline_lock:
                heapq.heappush(self._deadlines, (job.deadline, job.seq, job))
                if len(self._deadlines) > self._compact_at:
                    # finished jobs stay in the heap until their deadline: drop them so it does not
                    # grow with the job rate times the timeout
                    self._deadlines = [d for d in self._deadlines if d[2].state != "done"]
                    heapq.heapify(self._deadlines)
                    self._compact_at = max(_COMPACT_MIN, 2 * len(self._deadlines))

    # -- housekeeping -------------------------------------------------------------------------
    def _expire_jobs(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            with self._deadline_lock:
                _, _, job = heapq.heappop(self._deadlines)
            if job.state != "done":
                self.service.scheduler.drop_queued(lambda j: j is job)
                job.fail("Timeout", f"job did not finish within its timeout ({job.deadline - job.accepted_at:.3g} s)",
                         {"state": job.state})

    def _run_probes(self, now: float) -> None:
        due = [fd for when, fd in self._probes if when <= now]
        if not due:
            return
        self._probes = [(when, fd) for when, fd in self._probes if when > now]
        probe = P.encode({"v": P.PROTOCOL_VERSION, "id": None, "type": "probe"}, {})
        for client in [c for c, fd in self._peers.items() if fd in due]:
            try:
                self._router.send_multipart([client, *probe], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # alive, with replies unread
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._client_gone(client)

    def _client_gone(self, client: bytes) -> None:
        del self._peers[client]
        self._frame_bindings.pop(client, None)
        self._unread_warned.discard(client)
        waiting = self._waiting.pop(client, None)
        self._waiting_bytes.pop(client, None)
        if waiting:
            self.stats.count("client_gone", len(waiting))
        dropped = self.service.client_gone(client)
        for job in dropped:
            job.fail("Cancelled", "client left")  # the send fails and counts client_gone
        log.log(logging.INFO if dropped else logging.DEBUG, "client %s left; %d queued job(s) dropped",
                client.hex()[:8], len(dropped))

    def _trim_memory(self) -> None:
        """Give freed heap pages back to the system once requests have been answered since the
        last call: glibc keeps the pages of freed request frames in its arenas (one per thread
        that allocated them), so the daemon's resident memory would stay at its peak."""
        answered = self.stats.answered()
        if answered != self._trimmed_at and _MALLOC_TRIM is not None:
            self._trimmed_at = answered
            _MALLOC_TRIM(0)

    # -- life cycle ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        stop_on_signals(self.request_stop)

    def serve_forever(self) -> int:
        self._io_ident = threading.get_ident()
        router, inbox, watch = self._router, self._inbox, self._connections
        poller = zmq.Poller()
        for sock in (router, inbox):
            poller.register(sock, zmq.POLLIN)
        watch.start()
        if self._lane_listener is not None:
            settings = self.settings
            self._reactor = LaneReactor(
                self._lane_listener, settings.max_frames, settings.max_message_bytes, settings.lane_poll,
                accept=self._lane_accept, opened=self._open_lane, request=self._lane_request,
                broken=self._lane_broken, closed=self._lane_ended, listening=lambda: watch.listening,
                passed=self._lanes_passed, log=log, due=self._bound_due)
            self._reactor.start()
        last_sweep = 0.0
        clock, poll_s = time.perf_counter, self.settings.zmq_poll
        gaps = Poller(poll_s)  # the moving average of the gap between requests
        gap, done = poll_s, clock()
        try:
            while True:
                events = gaps.spin(lambda: poller.poll(0), gap, done)  # while the next request comes soon
                ready = [sock for sock, _ in events or poller.poll(1 if self._waiting else _TICK_S * 1000)]
                if inbox in ready:  # worker replies first: they free room in the queues
                    for _ in range(256):
                        if not inbox.get(P.EVENTS) & P.POLLIN:
                            break
                        self._send_handed_over(inbox.recv_multipart(copy=False))
                if router in ready:
                    if poll_s > 0:
                        gap = gaps.average(gap, clock() - done)
                    for _ in range(256):
                        if not router.get(P.EVENTS) & P.POLLIN:
                            break
                        raw, fd = self._recv_request()
                        try:
                            self._on_request(raw, fd)
                        except Exception:  # never let one message take the daemon down
                            log.exception("unexpected failure handling a message; dropped")
                            self.stats.count("dropped")
                    try:  # the batches of what was read together
                        self.service.run_held()
                    except Exception:
                        log.exception("unexpected failure running the batches of the messages read")
                    done = clock()
                now = time.monotonic()
                if self._waiting:
                    self._send_waiting(now)
                if self._deadlines:
                    self._expire_jobs(now)
                while watch.departed:
                    self._probes.append((now + _PROBE_DELAY_S, watch.departed.popleft()))
                if self._probes:
                    self._run_probes(now)
                if not watch.listening:
                    watch.check()
                if now - last_sweep > 0.5:
                    last_sweep = now
                    self.service.expire_idle()
                    self._trim_memory()
                if self._stop.is_set() and self._drain_step(now):
                    return 0
        finally:
            self._shutdown()

    def _drain_step(self, now: float) -> bool:
        """One step of a graceful stop; True once nothing is left to answer."""
        if self._drain_until is None:
            self._drain_until = now + self.settings.drain_deadline
            self.service.draining = True
            log.info("stopping: draining %d job(s) within %.1f s", self.service.scheduler.in_flight(),
                     self.settings.drain_deadline)
        pending = self.service.scheduler.pending(lambda j: True)
        # a worker takes its job out of the scheduler just before handing its reply over, so
        # only an empty set of unanswered requests says that every reply has been sent
        with self._book:  # and from here on, a lane accepts nothing more
            if (not self._in_progress and not pending and self.service.admin_idle() and not self._inbox.poll(0)
                    and not self._waiting and not self._bound_waiting and not self._flights
                    and not any(conn.backlogged() for conn in list(self._lanes))):
                self._lanes_closed = True
                return True
        if now >= self._drain_until:
            if self._drain_answered:
                with self._book:
                    self._lanes_closed = True
                    log.warning("stopping with %d request(s) unanswered %.0f s after the drain deadline",
                                len(self._in_progress), _REPLY_GRACE_S)
                return True
            self.service.scheduler.drop_queued(lambda j: True)
            for job in pending:
                job.fail("ShuttingDown", "the daemon stopped before this job could run")
            self._drain_answered = True
            self._drain_until = now + _REPLY_GRACE_S  # answered; the next steps flush the replies
        return False

    def _shutdown(self) -> None:
        while self._inbox.get(P.EVENTS) & P.POLLIN:  # flush replies handed over by workers
            self._send_handed_over(self._inbox.recv_multipart(copy=False))
        with self._book:
            self._lanes_closed = True
        if self._reactor is not None:
            conns = self._reactor.stop()
            self._land()  # the lanes' thread has ended: what it left running is answered here
            for conn in conns:
                self._lane_closed(conn)
        if self._lane_listener is not None:
            self._lane_listener.close()
        self.service.close()
        self.close_sockets(self._router)
        if self._lock is not None:
            self._lock.release()
        log.info("stopped: %s", self.stats.snapshot(self._connections.connections)["counters"])

    def close_sockets(self, router: zmq.Socket) -> None:
        self._connections.stop()
        for sock in (self._push, self._inbox):
            sock.close(0)
        router.close(linger=2000)
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()


def stop_on_signals(request_stop: Any) -> None:
    """SIGTERM and SIGINT call ``request_stop`` (a graceful stop), in the main thread."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: request_stop())


def _violation(exc: Exception) -> ProtocolViolation:
    """The error to answer a request with: a ProtocolViolation as it is, anything else (a bug)
    as ``InternalError``, logged."""
    if isinstance(exc, ProtocolViolation):
        return exc
    log.error("a request failed", exc_info=exc)
    return ProtocolViolation("InternalError", f"{type(exc).__name__}: {exc}"[:500])


def _reply_body(action: str | None, rid: str | None, status: str, content: dict[str, Any] | bytes,
                frames: list[Any]) -> tuple[str, list[Any]]:
    """The status and frames of a reply (after the routing frames): every reply is built here,
    and building one never fails (see :func:`~vkpool.daemon.protocol.pack_content`)."""
    packed_status, packed = P.pack_content(status, content)
    if packed_status != status:
        log.error("a %s reply could not be packed; sent as an error", action or "error")
        status, frames = packed_status, []
    return status, [P.DELIMITER, P.packed_header(f"{action}_reply" if action else "error_reply", rid, status),
                    packed, *frames]


def _source_fd(frame: zmq.Frame) -> int:
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:  # inproc:// messages have no file descriptor
        return -1


def _b(frame: Any) -> bytes | memoryview:
    return frame if isinstance(frame, (bytes, memoryview)) else frame.bytes


def _infer_content(header: dict[str, Any], body: list[Any]) -> bytes | None:
    """The packed content of what looks like a well-formed infer request (the key of its cached
    plan); None for anything else."""
    if (header.get("type") == "infer_request" and header.get("v") == P.PROTOCOL_VERSION
            and type(header.get("id")) is str and header["id"] and len(body) >= 2):
        content = body[1]
        return content if type(content) is bytes else bytes(_b(content))
    return None


def _peek_header(body: list[Any]) -> dict[str, Any]:
    """The header as far as it decodes: enough to address an error reply. An infer request's
    header packed as :func:`~vkpool.daemon.protocol.packed_header` packs one (what vkpool's
    clients send) is recognised by its bytes, which can only unpack to that map, instead of
    being unpacked."""
    if not body:
        raise ProtocolViolation("ProtocolError", "no header frame after the delimiter")
    raw = _b(body[0])
    packed = P.packed_id(raw if type(raw) is bytes else bytes(raw), *_INFER_REQUEST)
    if packed is not None:
        try:
            return {"v": P.PROTOCOL_VERSION, "id": packed[1:].decode(), "type": "infer_request"}
        except UnicodeDecodeError:
            pass  # unpacking says what is wrong with it
    header = P.unpack(raw)
    if not isinstance(header, dict):
        raise ProtocolViolation("ProtocolError", "header is not a map")
    return header
