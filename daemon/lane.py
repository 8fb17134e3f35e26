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
import time
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


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: polling keeps a CPU busy: on a machine with fewer CPUs than this, neither side polls by
#: default (the daemon, its device's driver and the client need them all)
POLL_MIN_CPUS = 4
#: a client thread polls for its reply for up to twice the lane's usual reply time before it
#: sleeps in recv, when that time is under this (and no other thread of the client is polling);
#: 0 = never poll. ``$VKPOOL_LANE_POLL_US`` sets it in microseconds.
POLL_MAX_S = float(os.environ.get("VKPOOL_LANE_POLL_US", "200" if usable_cpus() >= POLL_MIN_CPUS else "0")) * 1e-6



def wake(sock: socket.socket) -> None:
    """Ends both directions of ``sock``, so a thread blocked in its ``recv`` returns end of file."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

class Poller:
    """Polling for a lane message (:meth:`vkpool.daemon.protocol.LaneReader.poll`) for up to twice
    the usual wait, when that is under ``max_s``, by one thread at a time: a busy CPU per process,
    and no threads taking the GIL from each other while they poll."""

    __slots__ = ("max_s", "_token")

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self._token = threading.Lock()

    def average(self, usual_s: float, seen_s: float) -> float:
        """The moving average of a wait, each sample capped at twice ``max_s``: one long pause
        (a client busy elsewhere for a while) does not stop the polling for the waits after it,
        while waits that stay long take the average over ``max_s`` within a few samples."""
        return 0.8 * usual_s + 0.2 * min(seen_s, 2.0 * self.max_s)

    def wait(self, reader: P.LaneReader, usual_s: float, since: float) -> None:
        """Poll until ``since + 2 * usual_s`` (a ``time.perf_counter`` value) when worth it."""
        if usual_s < self.max_s and not reader.rest and self._token.acquire(False):
            try:
                reader.poll(since + 2.0 * usual_s - time.perf_counter())
            finally:
                self._token.release()


def _timeval(seconds: float | None) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO/SO_SNDTIMEO; None = no limit."""
    if seconds is None:
        return struct.pack("ll", 0, 0)
    whole = int(seconds)
    return struct.pack("ll", whole, max(1 if whole == 0 else 0, int((seconds - whole) * 1e6)))


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
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
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
        wake(self.sock)

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
    """One lane connection of a client, used by one thread at a time: a request, then its reply.

    The socket stays in blocking mode (a Python-level timeout would add a ``poll`` before every
    ``recv``); a reply timeout is the kernel's SO_RCVTIMEO."""

    __slots__ = ("sock", "reader", "timeout", "sent_at", "reply_s", "poller")

    def __init__(self, offer: dict[str, Any], client: bytes, timeout: float, poller: Poller) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self.reader, self.poller = sock, P.LaneReader(sock), poller
        self.timeout: float | None = None
        self.sent_at = 0.0
        self.reply_s = poller.max_s / 2  # moving average of the time from request to reply
        try:
            sock.settimeout(timeout)
            sock.connect(str(offer["path"]))  # OSError: no lane to be had from here
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        try:
            self.send([P.packed_header("open_lane_request", "lane"),
                       P.pack({"client": client.hex(), "token": offer["token"]})])
            header, content, _ = self.receive(timeout)
        except OSError as exc:  # a daemon at its cap answers and closes at once: a refusal too
            sock.close()
            raise LaneRefused({"message": f"the daemon closed the lane before opening it ({exc})"}) from None
        except BaseException:
            sock.close()
            raise
        if header.get("status") != "ok":
            sock.close()
            try:
                refusal = P.unpack(content)
            except P.ProtocolViolation:
                refusal = None
            raise LaneRefused(refusal if isinstance(refusal, dict) else {})

    def send(self, parts: list[Any]) -> None:
        """Write one request (``OSError`` when the daemon closed the lane: nothing was accepted)."""
        P.lane_send(self.sock, parts)
        self.sent_at = time.perf_counter()

    def receive(self, timeout: float | None) -> tuple[dict[str, Any], memoryview, list[memoryview]]:
        """Read one reply: header, packed content, raw frames. ``TimeoutError`` when none came within
        ``timeout``; ``ConnectionError`` when the daemon closed the lane; other ``OSError`` for a
        failed socket. After any exception the lane must be closed."""
        if timeout != self.timeout:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            self.timeout = timeout
        reader = self.reader
        self.poller.wait(reader, self.reply_s, self.sent_at)
        try:
            frames = reader.read()
        except P.LaneError:
            frames = None
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"no reply within {timeout:g} s") from None
        if frames is None:
            raise ConnectionResetError("the daemon closed the local lane")
        self.reply_s = self.poller.average(self.reply_s, time.perf_counter() - self.sent_at)
        try:
            header = P.unpack(frames[0])
        except P.ProtocolViolation:
            header = None
        if not isinstance(header, dict):
            raise ConnectionResetError("the daemon sent something that is no reply on the local lane")
        return header, frames[1], frames[2:]

    def shutdown(self) -> None:
        """Wake a thread waiting on this lane (safe from any thread)."""
        wake(self.sock)

    def close(self) -> None:
        self.sock.close()
