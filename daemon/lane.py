"""The local lane: ``infer`` on a plain Unix stream socket beside the ipc socket.

Over ZeroMQ a request and its reply cross four threads (the client's, libzmq's I/O thread on
each side, the daemon's I/O thread). On the lane a client thread writes its request with one
``sendmsg`` and reads the reply with one ``recv``; in the daemon one thread per lane connection
blocks in ``recv`` (without the GIL), decodes the request and runs it itself when its model is
idle, else queues it like any job, the worker then writing the reply on the lane.

A lane belongs to one ZeroMQ client: the daemon's ``hello`` reply gives that client a token (an
HMAC of its routing id under a key made at start), and the lane's first message,
``open_lane``, presents it. Jobs on the lane are that client's jobs: its model references,
request ids, ``cancel`` and accounting are shared with its ZeroMQ socket.

This module holds the sockets; the server (:mod:`vkpool.daemon.server`) does the bookkeeping and
the client (:mod:`vkpool.daemon.client`) chooses the transport.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from vkpool.daemon import protocol as P

#: a worker writing a reply to a lane client that does not read gives up after this long and
#: closes the connection (the job counts as ``client_gone``).
SEND_TIMEOUT_S = 10.0
#: lane connections one :class:`vkpool.daemon.client.Client` opens (one per thread running jobs
#: at once); further threads use ZeroMQ.
CLIENT_MAX_LANES = 8
_OFF = {"0", "false", "no", "off"}


def lane_wanted(flag: bool | None) -> bool:
    """The client's choice: ``flag`` when given, else ``$VKPOOL_LOCAL_LANE`` (on unless 0/false/no/off)."""
    if flag is not None:
        return flag
    return os.environ.get("VKPOOL_LOCAL_LANE", "1").strip().lower() not in _OFF


def token_for(key: bytes, client: bytes) -> str:
    return hmac.new(key, client, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------------------------
# Daemon side.

class LaneListener:
    """The listening socket, created 0600 (the directory is 0700), accepted from the I/O thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key = os.urandom(32)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def offer(self, client: bytes) -> dict[str, Any]:
        """``hello``'s ``local_lane`` for this client."""
        return {"path": str(self.path), "token": token_for(self.key, client)}

    def check(self, client: bytes, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, token_for(self.key, client))

    def accept(self) -> socket.socket | None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        conn.setblocking(True)
        seconds = int(SEND_TIMEOUT_S)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", seconds, int((SEND_TIMEOUT_S - seconds) * 1e6)))
        return conn

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class LaneConnection:
    """One accepted lane connection; ``client`` is set by ``open_lane``. Replies are written from
    whichever thread finishes the job, one at a time; the connection's own thread closes it."""

    __slots__ = ("sock", "client", "send_lock", "open", "thread")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.client: bytes | None = None
        self.send_lock = threading.Lock()
        self.open = True
        self.thread: threading.Thread | None = None

    def send(self, body: list[Any], start: int = 1) -> bool:
        """Write ``body[start:]`` (body as the server builds it: delimiter first); False when the
        connection is closed or the write fails, which then shuts the connection down."""
        with self.send_lock:
            if not self.open:
                return False
            try:
                P.lane_send(self.sock, body, start)
                return True
            except OSError:
                self.open = False
        self.shutdown()
        return False

    def shutdown(self) -> None:
        """Wake the connection's thread (its ``recv`` returns end of file); safe from any thread."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self.send_lock:
            self.open = False
            self.sock.close()


# ---------------------------------------------------------------------------------------------
# Client side.

class LaneRefused(Exception):
    """The daemon answered ``open_lane`` with an error (``content`` is the error reply)."""

    def __init__(self, content: dict[str, Any]) -> None:
        super().__init__(str(content.get("message", "")))
        self.content = content


class ClientLane:
    """One lane connection of a client, used by one thread at a time: a request, then its reply."""

    __slots__ = ("sock", "reader", "timeout")

    def __init__(self, offer: dict[str, Any], client: bytes, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self.reader = sock, P.LaneReader(sock)
        self.timeout: float | None = timeout
        try:
            sock.settimeout(timeout)
            sock.connect(str(offer["path"]))
            self.send([P.packed_header("open_lane_request", "lane"),
                       P.pack({"client": client.hex(), "token": offer["token"]})])
            header, content, _ = self.receive(timeout)
        except BaseException:
            sock.close()
            raise
        if header.get("status") != "ok":
            sock.close()
            raise LaneRefused(content)

    def send(self, parts: list[Any]) -> None:
        """Write one request (``OSError`` when the daemon closed the lane: nothing was accepted)."""
        P.lane_send(self.sock, parts)

    def receive(self, timeout: float | None) -> tuple[dict[str, Any], dict[str, Any], list[memoryview]]:
        """Read one reply: header, content, raw frames. ``TimeoutError`` when none came within
        ``timeout``; ``ConnectionError`` when the daemon closed the lane; other ``OSError`` for a
        failed socket. After any exception the lane must be closed."""
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout
        try:
            frames = self.reader.read()
        except P.LaneError:
            frames = None
        if frames is None:
            raise ConnectionResetError("the daemon closed the local lane")
        try:
            header, content = P.unpack(frames[0]), P.unpack(frames[1])
        except P.ProtocolViolation:
            header = content = None
        if not isinstance(header, dict) or not isinstance(content, dict):
            raise ConnectionResetError("the daemon sent something that is no reply on the local lane")
        return header, content, frames[2:]

    def shutdown(self) -> None:
        """Wake a thread waiting on this lane (safe from any thread)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
