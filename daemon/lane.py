"""The local lane: ``infer`` on a plain Unix stream socket beside the ipc socket.

Over ZeroMQ a request and its reply cross four threads (the client's, libzmq's I/O thread on
each side, the daemon's I/O thread). On the lane a client thread writes its request with one
``sendmsg`` and reads the reply with one ``recv``; in the daemon one thread reads every lane
(:class:`LaneReactor`), decodes each request and runs it itself when its model is idle and
quick, else queues it like any job, the worker then writing the reply on the lane.

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
import itertools
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vkpool.daemon import protocol as P

from vkpool.cpus import usable_cpus

#: a lane connection's writer that cannot write to a client that does not read gives up after this
#: long without progress and closes the connection (its unsent replies count as ``client_gone``).
SEND_TIMEOUT_S = 10.0
#: lane connections one :class:`vkpool.daemon.client.Client` opens (one per thread running jobs
#: at once); further threads use ZeroMQ.
CLIENT_MAX_LANES = 8
_OFF = {"0", "false", "no", "off"}
_IOV_MAX = 512  # buffers per sendmsg call (the kernel takes at most 1024)
_DONTWAIT = socket.MSG_DONTWAIT | P._NOSIGNAL


#: polling keeps a CPU busy: on a machine with fewer CPUs than this, neither side polls by
#: default (the daemon, its device's driver and the client need them all)
POLL_MIN_CPUS = 4
#: a client thread polls for its reply for up to this, or twice the lane's usual reply time when
#: longer, before it sleeps in recv, when that time is under this (and no other thread of the
#: client is polling);
#: 0 = never poll. ``$VKPOOL_LANE_POLL_US`` sets it in microseconds.
POLL_MAX_S = float(os.environ.get("VKPOOL_LANE_POLL_US", "200" if usable_cpus() >= POLL_MIN_CPUS else "0")) * 1e-6
#: the same for a reply over ZeroMQ (``$VKPOOL_ZMQ_POLL_US``)
ZMQ_POLL_MAX_S = float(os.environ.get("VKPOOL_ZMQ_POLL_US", "400" if usable_cpus() >= POLL_MIN_CPUS else "0")) * 1e-6


#: every this many waits past ``max_s``, a :class:`Poller` polls for ``max_s`` all the same
PROBE = 8


def wake(sock: socket.socket) -> None:
    """Ends both directions of ``sock``, so a thread blocked in its ``recv`` returns end of file."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Poller:
    """Polling for a lane message (:meth:`vkpool.daemon.protocol.LaneReader.poll`) for up to
    ``max_s`` or twice the usual wait, whichever is longer, when the usual wait is under ``max_s``,
    by one thread at a time: a busy CPU per process, and no threads taking the GIL from each other
    while they poll.

    A side that sleeps is woken through the socket, which makes its waits longer still: waits
    that went over ``max_s`` once (a burst of slow jobs) could keep it sleeping after they are
    quick again. So every :data:`PROBE`-th wait past ``max_s`` polls for ``max_s`` anyway: a
    reply that comes within it pulls the average back under, and polling resumes."""

    __slots__ = ("max_s", "_token", "_looks")

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self._token = threading.Lock()
        self._looks = 0

    def average(self, usual_s: float, seen_s: float) -> float:
        """The moving average of a wait, each sample capped at twice ``max_s``: one long pause
        (a client busy elsewhere for a while) does not stop the polling for the waits after it,
        while waits that stay long take the average over ``max_s`` within a few samples."""
        return 0.8 * usual_s + 0.2 * min(seen_s, 2.0 * self.max_s)

    def until(self, usual_s: float, since: float) -> float | None:
        """Until when (a ``time.perf_counter`` value) to poll for a message awaited since
        ``since`` whose wait is usually ``usual_s``; None: sleep at once. While the usual wait is
        under ``max_s``, for ``max_s`` or twice the usual wait, whichever is longer: a side that
        sleeps is woken through the socket, tens of microseconds later than it would have seen
        the message polling, so a wait somewhat longer than usual is still polled through."""
        if usual_s < self.max_s:
            return since + max(2.0 * usual_s, self.max_s)
        if self.max_s > 0:
            self._looks += 1
            if self._looks % PROBE == 0:
                return since + self.max_s
        return None

    @staticmethod
    def earliest(earliest_s: float, seen_s: float) -> float:
        """The running estimate of how soon a long wait usually ends (0: none yet): down at once
        to a quicker wait, up by a tenth of the way to a slower one (an outlier barely moves it)."""
        return seen_s if seen_s < earliest_s or earliest_s <= 0 else 0.9 * earliest_s + 0.1 * seen_s

    def doze(self, earliest_s: float, since: float) -> tuple[float, float] | None:
        """For a wait too long to poll through (:meth:`until` says sleep) that usually ends no
        sooner than ``earliest_s`` after ``since``: (until when to sleep, until when to poll
        after it), ``time.perf_counter`` values; None when it is not that long. The sleep ends
        ``max_s`` before the usual end, so the timer's wake-up is over by then, and the polling
        goes on ``2 * max_s`` past it; a reply that comes during the sleep wakes it through the
        socket, as it would wake ``recv``."""
        if self.max_s <= 0 or earliest_s < 3.0 * self.max_s:
            return None
        return since + earliest_s - self.max_s, since + earliest_s + 2.0 * self.max_s

    def spin(self, ready: Any, usual_s: float, since: float) -> Any:
        """Call ``ready()`` (a look that lets the interpreter lock go, such as ``zmq_poll``
        without waiting) until it gives something true, or :meth:`until` says to stop; what it
        gave last, or None when nothing was polled."""
        until = self.until(usual_s, since)
        if until is None or not self._token.acquire(False):
            return None
        try:
            clock = time.perf_counter
            while not (got := ready()) and clock() < until:
                pass
            return got
        finally:
            self._token.release()

    def wait(self, reader: P.LaneReader, usual_s: float, since: float) -> None:
        """Poll until :meth:`until` says, when it says to."""
        until = self.until(usual_s, since)
        if until is not None and not reader.rest and self._token.acquire(False):
            try:
                reader.poll(until - time.perf_counter())
            finally:
                self._token.release()


# ---------------------------------------------------------------------------------------------
# The ring: shared memory beside the socket.

_RING_HEAD = 4096
#: ring words, 8-byte aligned, each on a cache line of its own: 0 request sequence (written by the
#: client), 8 reply sequence (the daemon), 16 "the daemon sleeps in recv" (the daemon), 24 "the
#: client sleeps in recv" (the client), 32 what the request half holds (the client: 0 a framed
#: message, k + 1 a bound infer of binding k, :mod:`vkpool.daemon.bound`), 40 what the reply half
#: holds (the daemon: 0 a framed message, 1 a bound infer's outputs)
_REQ, _REP, _DAEMON_ASLEEP, _CLIENT_ASLEEP, _REQ_KIND, _REP_KIND = 0, 8, 16, 24, 32, 40
#: the reply-kind word of a bound infer's outputs
RECORD = 1
_FENCE = threading.Lock()
#: ring checks between two ``poll(0)`` of the socket while spinning (each poll lets the process's
#: other threads take the GIL, and sees a message or end of file on the socket)
_SPINS = 64


def fence() -> None:
    """A full memory barrier: taking and releasing an uncontended lock is a locked read-modify-
    write instruction (CPython's locks are futexes or semaphores), which x86-64 orders against
    every load and store. A store followed by a load of another word may otherwise be reordered,
    and the "sleeping" handshake of :class:`Ring` relies on that order."""
    _FENCE.acquire()
    _FENCE.release()


def ring_supported() -> bool:
    """Whether this side may use a ring: x86-64 Linux, and ``$VKPOOL_LANE_RING`` not 0/false/no/off."""
    if os.environ.get("VKPOOL_LANE_RING", "1").strip().lower() in _OFF:
        return False
    return hasattr(os, "memfd_create") and hasattr(socket, "SCM_RIGHTS") and os.uname().machine in (
        "x86_64", "AMD64")


class Ring:
    """A lane's shared memory: a request half written by the client, a reply half written by
    the daemon, each followed by a sequence number that says a new message is there. A lane's
    client sends one request at a time and reads its reply before the next one, so each half has
    one message in flight at most. Messages are framed as on the socket
    (:func:`vkpool.daemon.protocol.lane_pack_into`).

    Ordering: the writer stores the message, then its sequence number; the reader loads the
    sequence number, then the message. x86-64 keeps stores in program order and loads in program
    order, so a reader that sees the new sequence number sees the whole message (the stores are
    separate Python operations, which the compiler cannot reorder either): no barrier needed.
    The only barrier is in the wake-up handshake: a side about to sleep in ``recv`` stores its
    "asleep" word, :func:`fence`, loads the other side's sequence number; a writer stores its
    sequence number, :func:`fence`, loads the other side's "asleep" word and, when set, sends
    :data:`~vkpool.daemon.protocol.LANE_WAKE` on the socket. Without the fences each side could
    load before its own store is visible, and both miss each other.

    Only offered on x86-64 Linux (memfd, SCM_RIGHTS, that ordering)."""

    __slots__ = ("mm", "words", "request", "reply", "half")

    def __init__(self, fd: int, half: int) -> None:
        import mmap

        self.half = half
        self.mm = mmap.mmap(fd, _RING_HEAD + 2 * half)
        view = memoryview(self.mm)
        self.words = view[:_RING_HEAD].cast("Q")
        self.request = view[_RING_HEAD:_RING_HEAD + half]
        self.reply = view[_RING_HEAD + half:_RING_HEAD + 2 * half]

    @classmethod
    def create(cls, half: int) -> tuple["Ring", int]:
        """A new ring of two ``half``-byte halves (``daemon.lane_ring_bytes``; a message larger
        than its half travels on the socket) and its file descriptor (the caller passes it on and
        closes it). The memory is a memfd's: a page takes memory once a message has touched it."""
        fd = os.memfd_create("vkpool-lane", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _RING_HEAD + 2 * half)
            return cls(fd, half), fd
        except BaseException:
            os.close(fd)
            raise

    def post(self, parts: list[Any], which: int, start: int = 0) -> int | None:
        """Write a message (``parts[start:]``) into the request (``_REQ``) or reply (``_REP``) half
        and publish it: the bytes of its frames, or None when it does not fit (nothing written)."""
        size = P.lane_pack_into(self.request if which == _REQ else self.reply, parts, start)
        if size is not None:
            self.words[_REQ_KIND if which == _REQ else _REP_KIND] = 0  # a framed message
            self.words[which] += 1  # after the message: see the class's doc
        return size

    def close(self) -> None:
        """Unmap now when nothing uses the memory any more, else when the last view goes."""
        try:
            for view in (self.words, self.request, self.reply):
                view.release()
            self.mm.close()
        except BufferError:  # frames of a request still in use (a queued job): freed with them
            pass


def ring_wait(words: memoryview, which: int, seen: int, reader: P.LaneReader, until: float) -> bool:
    """Spin until ``words[which]`` differs from ``seen`` (True), or until ``until`` (a
    ``time.perf_counter`` value) or a message on the socket (False)."""
    if reader._poll is None:
        reader._poll = select.poll()
        reader._poll.register(reader.sock.fileno(), select.POLLIN)
    ready, clock = reader._poll.poll, time.perf_counter
    spins = range(_SPINS)
    while True:
        for _ in spins:
            if words[which] != seen:
                return True
        if ready(0) or clock() > until:
            return words[which] != seen


def ring_sleep(words: memoryview, which: int, seen: int, asleep: int, reader: P.LaneReader
               ) -> list[memoryview] | None:
    """Sleep in ``recv`` until the other side publishes (``words[which]`` differs from ``seen``:
    returns []), a message comes on the socket (returned) or the socket ends (None)."""
    while True:
        words[asleep] = 1
        fence()
        if words[which] != seen:
            words[asleep] = 0
            return []
        try:
            parts = reader.read()
        finally:
            words[asleep] = 0
        if parts is None or parts or words[which] != seen:
            return parts


def ring_doze(words: memoryview, which: int, seen: int, asleep: int, sock: socket.socket,
              until: float) -> None:
    """Sleep until ``until`` (a ``time.perf_counter`` value), or less when the other side
    publishes meanwhile: marked asleep, so that it sends a wake-up on the socket, which ends the
    sleep (and is read with the socket's next message). The sleep is ``select``'s, to the
    microsecond (``poll``'s is to the millisecond); a socket beyond ``select``'s range sleeps
    ``time.sleep``'s, which a reply does not end."""
    words[asleep] = 1
    fence()
    try:
        left = until - time.perf_counter()
        if words[which] == seen and left > 0:
            try:
                select.select((sock,), (), (), left)
            except ValueError:  # a descriptor past FD_SETSIZE
                time.sleep(left)
    finally:
        words[asleep] = 0


def ring_wake(sock: socket.socket, words: memoryview, asleep: int) -> bool:
    """After publishing: wake the other side when it sleeps in ``recv``. False when the wake-up
    could not be written: the other side is gone, and will not read the ring either."""
    _FENCE.acquire()  # fence(), inline
    _FENCE.release()
    if words[asleep]:
        try:
            sock.send(P.LANE_WAKE, P._NOSIGNAL)
        except OSError:
            return False
    return True


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
        except OSError:  # none waiting, or no descriptor left for it (it waits in the backlog)
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
    """One accepted lane connection; ``client`` is set by ``open_lane``. The daemon's
    :class:`LaneReactor` reads it and closes it; replies are written from whichever thread
    finishes the job.

    A reply is written without blocking: what the socket does not take at once waits in the
    connection's backlog, which a writer thread of its own sends on (blocking, for at most
    :data:`SEND_TIMEOUT_S` without progress: then the client is taken as gone, the connection
    is shut down and the replies left unsent are reported to ``on_lost``). A client that does
    not read its replies so stalls only its own connection, never a model's workers, and no
    further request of it is taken until the backlog is sent (:meth:`backlogged`).
    ``ring``: its :class:`Ring` when one was granted; ``ring_reply``: the request being
    answered came in the ring, so its reply goes there too."""

    __slots__ = ("sock", "fd", "client", "send_lock", "open", "ring", "ring_reply", "ring_seen",
                 "on_lost", "bindings", "_backlog", "_writer")

    def __init__(self, sock: socket.socket, on_lost: Any = None) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # kept: the socket's own turns -1 once it is closed
        self.client: bytes | None = None
        self.send_lock = threading.Lock()
        self.open = True
        self.ring: Ring | None = None
        self.ring_reply = False
        self.ring_seen = 0
        #: called with the status of each reply that was taken but could not be written
        self.on_lost = on_lost
        #: this lane's bound infers (:class:`vkpool.daemon.bound.Binding`), by number
        self.bindings: list[Any] = []
        # (bytes still to send, status of the reply they end or None), in order
        self._backlog: deque[tuple[memoryview, str | None]] = deque()
        self._writer: threading.Thread | None = None

    def send(self, body: list[Any], start: int = 1, fds: tuple[int, ...] = (), status: str | None = None) -> int:
        """Write ``body[start:]`` (body as the server builds it: delimiter first), or queue what the
        socket does not take now: the bytes of its frames, or 0 when the connection is closed or
        the write fails, which then shuts the connection down. ``status``: the reply's, for
        ``on_lost`` should it be queued and never written."""
        return self._guarded(lambda: self._send(body, start, fds, status))

    def _send(self, body: list[Any], start: int, fds: tuple[int, ...], status: str | None) -> int:
        ring = self.ring
        if ring is not None and self.ring_reply:
            self.ring_reply = False
            size = ring.post(body, _REP, start)
            if size is None:
                # too large for the ring: on the socket, and in the ring a pointer to it
                buffers, size = P.lane_buffers(body, start)
                self._write(buffers, 4 + 8 * (len(buffers) - 1) + size, status)
                ring.post([], _REP)
            fence()  # ring_wake, with the wake-up written as a reply is
            if ring.words[_CLIENT_ASLEEP]:
                self._write([P.LANE_WAKE], len(P.LANE_WAKE), None)
        elif fds:  # the open_lane reply, the first bytes on the connection: sent at once
            size = P.lane_send(self.sock, body, start, fds)
        else:
            buffers, size = P.lane_buffers(body, start)
            self._write(buffers, 4 + 8 * (len(buffers) - 1) + size, status)
        return size

    def _guarded(self, write: Any) -> int:
        """``write()`` under ``send_lock`` (what it returns), or 0 when the connection is closed; a
        write that fails shuts the connection down and reports the replies left unsent."""
        with self.send_lock:
            if not self.open:
                return 0
            try:
                return write()
            except OSError:
                self.open = False
                lost = self._drop_backlog()
        self.shutdown()
        self._report(lost)
        return 0

    def post_record(self, fill: Any, arrays: Any) -> int:
        """Answer a bound infer in the ring: ``fill(reply half, arrays)`` writes its outputs there
        and says whether they fitted; then the reply-kind word and the sequence number. The caller
        then wakes the client if it sleeps (:func:`wake_sleepers`). 1 when posted, -1 when the
        outputs do not fit (nothing posted: the caller sends a framed reply instead), 0 when the
        connection is closed. Only the lanes' thread answers bound infers, and a lane has one
        request in flight: the ring needs no lock."""
        ring = self.ring
        if not self.open or ring is None:
            return 0
        if not fill(ring.reply, arrays):
            return -1
        self.ring_reply = False
        words = ring.words
        words[_REP_KIND] = RECORD
        words[_REP] += 1
        return 1

    def _wake(self) -> int:
        self._write([P.LANE_WAKE], len(P.LANE_WAKE), None)
        return 1

    def _write(self, buffers: list[Any], total: int, status: str | None) -> None:
        """Send without blocking what the socket takes now of ``buffers`` (``total`` bytes); queue
        the rest (``send_lock`` held)."""
        sent = 0
        if not self._backlog:
            try:
                sent = self.sock.sendmsg(buffers if len(buffers) <= _IOV_MAX else buffers[:_IOV_MAX], (), _DONTWAIT)
            except BlockingIOError:
                pass
            if sent == total:
                return
        views = [memoryview(b).cast("B") for b in buffers]
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if not views:
            return
        views[0] = views[0][sent:]
        last = len(views) - 1
        self._backlog.extend((view, status if i == last else None) for i, view in enumerate(views))
        if self._writer is None:
            self._writer = threading.Thread(target=self._flush, daemon=True, name="vkpool-lane-writer")
            self._writer.start()

    def _flush(self) -> None:
        """The writer thread: send the backlog, blocking, until it is empty or the client is gone."""
        backlog = self._backlog
        while True:
            with self.send_lock:
                if not backlog or not self.open:
                    self._writer = None
                    return
                views = [view for view, _ in itertools.islice(backlog, _IOV_MAX)]
            try:  # without the lock: others append to the backlog meanwhile
                sent = self.sock.sendmsg(views, (), P._NOSIGNAL)  # SO_SNDTIMEO bounds the wait
            except OSError:
                with self.send_lock:
                    self.open = False
                    self._writer = None
                    lost = self._drop_backlog()
                self.shutdown()
                self._report(lost)
                return
            with self.send_lock:
                while sent:
                    view, status = backlog[0]
                    if sent < view.nbytes:
                        backlog[0] = (view[sent:], status)
                        break
                    sent -= view.nbytes
                    backlog.popleft()

    def _drop_backlog(self) -> list[str]:
        """Empty the backlog (``send_lock`` held): the statuses of the replies it held."""
        lost = [status for _, status in self._backlog if status is not None]
        self._backlog.clear()
        return lost

    def _report(self, lost: list[str]) -> None:
        if self.on_lost is not None:
            for status in lost:
                self.on_lost(status)

    def backlogged(self) -> bool:
        """True while replies taken wait to be written."""
        return bool(self._backlog) and self.open

    def shutdown(self) -> None:
        """End the connection's stream (its reader sees end of file); safe from any thread."""
        wake(self.sock)

    def close(self) -> None:
        with self.send_lock:
            self.open = False
            lost = self._drop_backlog()
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            wake(self.sock)  # its sendmsg fails at once; the descriptor is closed after it returns
            writer.join(SEND_TIMEOUT_S)
        with self.send_lock:
            self.sock.close()
            ring, self.ring = self.ring, None
        self._report(lost)
        if ring is not None:
            ring.close()


def wake_sleepers(conns: Sequence[LaneConnection]) -> list[LaneConnection]:
    """After posting replies in the rings of ``conns`` (:meth:`LaneConnection.post_record`): one
    :func:`fence` for them all, then a wake-up for each client that sleeps in ``recv``. The
    connections whose wake-up could not be written (their clients are gone)."""
    _FENCE.acquire()  # fence(), inline
    _FENCE.release()
    gone = []
    for conn in conns:
        ring = conn.ring
        if ring is not None and ring.words[_CLIENT_ASLEEP] and not conn._guarded(conn._wake):
            gone.append(conn)
    return gone


def take_waiting(reader: P.LaneReader) -> int:
    """Moves what the socket holds now into the reader's buffer, without waiting (one ``recv`` of
    up to :data:`~vkpool.daemon.protocol.LANE_CHUNK`): the bytes taken, 0 when none waited, -1 at
    end of file."""
    try:
        chunk = reader.sock.recv(P.LANE_CHUNK, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    if not chunk:
        return -1
    reader.rest = reader.rest + chunk if reader.rest else chunk
    return len(chunk)


def message_whole(reader: P.LaneReader) -> bool:
    """Whether :meth:`~vkpool.daemon.protocol.LaneReader.read` can return from what the reader
    holds, without reading the socket: a whole message, or a framing it refuses at once."""
    need = reader.needed()
    return need is not None and len(reader.rest) >= need


#: chunks the lanes' thread takes from one connection in one pass at most (a client that writes
#: without pause is read on in the next pass, after the others)
_TAKES = 16


#: how long the reactor sleeps at most: it then looks whether the daemon takes connections again,
#: and whether connections whose replies waited may be read again
_REACTOR_TICK_S = 0.02
#: a wait for requests kept waiting shorter than this is polled through, not slept (``epoll``'s
#: timeout is in whole milliseconds, so a shorter sleep would last a millisecond)
_DUE_SLEEP_MIN_S = 2e-3
#: while polling, the rings are looked at this many times between two looks at the sockets
#: (``epoll`` without waiting: a system call), so that a request in a ring is taken sooner; a
#: message on a socket (a framed request, a new connection) waits at most that many looks
_RING_LOOKS = 16


class LaneReactor:
    """One thread that reads every lane connection of the daemon, and accepts them.

    A lane thread per connection costs the daemon a thread wake-up (and a hand-over of the
    interpreter lock) for each request of each client; with several clients those wake-ups, not
    the requests' work, are what a core spends its time on. Here one thread waits on all the
    sockets at once (``epoll``) and on the rings, and hands each request to the server in turn,
    which runs a short job right there when its model is idle (no thread hop either), so a burst
    of requests from many clients costs one wake-up. While the usual gap between requests is
    under ``poll_s``, it polls for ``poll_s`` (or twice that gap, when longer) after each pass
    instead of sleeping, looking at the rings ``_RING_LOOKS`` times for each look at the
    sockets; before it sleeps it marks every ring "asleep", so that a client that posts in a
    ring wakes it through the socket.

    The reactor never waits on one client: what has come of a message waits in its lane's
    buffer for the rest, and a message larger than a chunk (a large tensor) is read by a thread
    of its own once it has begun to arrive, rather than gathered chunk by chunk. A connection whose
    replies wait to be written (its client does not read them) is not read until they are, and
    a request read from it meanwhile waits with it.

    The server's callbacks: ``accept(sock) -> LaneConnection | None`` for a new connection,
    ``opened(conn, parts) -> bool`` for its first message (False: close it), ``request(conn,
    parts)`` for the others (``parts``: the frames, or the binding number of a bound infer),
    ``broken(conn, exc)`` for a
    :class:`~vkpool.daemon.protocol.LaneError`, ``closed(conn, failed)`` when it ends
    (``failed``: by an unexpected error); ``listening()`` says whether new connections are taken
    now; ``passed()`` ends each pass over the requests read together (the server runs the
    batches they make)."""

    def __init__(self, listener: LaneListener, max_frames: int, max_bytes: int, poll_s: float, *,
                 accept: Any, opened: Any, request: Any, broken: Any, closed: Any, listening: Any,
                 passed: Any, log: Any, due: Any = lambda: None) -> None:
        self.listener = listener
        self.max_frames, self.max_bytes, self.poll_s = max_frames, max_bytes, poll_s
        self._gaps = Poller(poll_s)  # the moving average of the gap between requests
        self._accept, self._opened, self._request = accept, opened, request
        self._broken, self._closed, self._listening, self._log = broken, closed, listening, log
        self._passed, self._due = passed, due
        self.conns: dict[int, tuple[LaneConnection, P.LaneReader]] = {}  # by descriptor
        self._open: set[int] = set()      # descriptors whose open_lane was taken
        self._rings: dict[int, LaneConnection] = {}
        self._away: set[int] = set()      # descriptors a reading thread has (a message in pieces)
        self._stalled: dict[int, list[tuple[Any, bool]]] = {}  # not read while replies wait; held messages
        self._done: deque[tuple[LaneConnection, Any]] = deque()  # (connection, parts or exception) from those
        self._epoll = select.epoll()
        self._wake_lock = threading.Lock()  # the wake-up pipe, written by those threads, closed at stop
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._listener_polled = False
        self._ring_looks = 0  # looks at the rings since the sockets' last
        self._running = True
        self.thread = threading.Thread(target=self._run, name="vkpool-lanes", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> list[LaneConnection]:
        """Ends the thread; returns the connections still open, their streams ended (the server
        closes them)."""
        self._running = False
        self._wake()
        self.thread.join(5.0)
        with self._wake_lock:
            self._epoll.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_w = -1
        conns = [conn for conn, _ in self.conns.values()]
        for conn in conns:
            conn.shutdown()  # a thread reading a message of it returns
        return conns

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass  # a wake-up is pending already

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        clock = time.perf_counter
        gap, done = self.poll_s, clock()  # the usual time from one pass's work to the next's
        while self._running:
            try:
                work = self._wait(gap, done)
            except Exception:  # a failure of the loop itself: logged, and the lanes go on
                self._log.exception("unexpected failure waiting on the local lanes")
                time.sleep(_REACTOR_TICK_S)
                continue
            if not work:
                due = self._due()  # requests waiting for company: run once it comes
                if due is None or time.monotonic() < due:
                    continue
            start = clock()
            if self.poll_s > 0 and work:
                gap = self._gaps.average(gap, start - done)
            for conn, parts, ringed in work:
                try:
                    self._handle(conn, parts, ringed)
                except Exception:  # one connection's trouble closes it alone
                    self._log.exception("unexpected failure on a local lane; closing it")
                    if conn.fd in self.conns:
                        self._close(conn.fd, failed=True)
            try:
                self._passed()
            except Exception:
                self._log.exception("unexpected failure running what the local lanes' pass gathered")
            done = clock()

    def _wait(self, gap: float, done: float) -> list[tuple[LaneConnection, Any, bool]]:
        """The messages that come next: at once while polling (see the class), else after
        sleeping until something comes."""
        if self._listening() != self._listener_polled:
            self._arm_listener()
        rings = self._rings
        ready = self._ready_rings() if rings else []
        asleep = False
        if ready or (gap < self.poll_s and time.perf_counter() < done + max(2.0 * gap, self.poll_s)):
            timeout = 0.0
            if rings:  # the rings first, the sockets every _RING_LOOKS looks
                looks = self._ring_looks
                if not ready and self._due() is None:  # nothing else to look after meanwhile
                    while not ready and looks < _RING_LOOKS:
                        looks += 1
                        ready = self._ready_rings()
                if looks < _RING_LOOKS:
                    self._ring_looks = looks + 1
                    work = self._collect([], ready)
                    return work + self._unstall() if self._stalled else work
                self._ring_looks = 0
        else:
            if rings:
                asleep = self._mark_rings(True)
                ready = self._ready_rings()
            timeout = 0.0 if ready else _REACTOR_TICK_S if self._stalled or self._done else 0.05
            due = self._due()  # requests waiting for company run by then
            if due is not None:  # epoll counts whole milliseconds: a shorter wait is polled through
                left = due - time.monotonic()
                timeout = min(timeout, left) if left > _DUE_SLEEP_MIN_S else 0.0
        try:
            events = self._epoll.poll(timeout)
        finally:
            if asleep:
                self._mark_rings(False)
        work = self._collect(events, ready)
        if self._stalled:
            work += self._unstall()
        return work

    def _arm_listener(self) -> None:
        want = self._listening()
        if want != self._listener_polled:
            fd = self.listener.fileno()
            if want:
                self._epoll.register(fd, select.EPOLLIN)
            else:
                self._epoll.unregister(fd)
            self._listener_polled = want

    def _ready_rings(self) -> list[LaneConnection]:
        return [conn for fd, conn in self._rings.items()
                if conn.ring is not None and conn.ring.words[_REQ] != conn.ring_seen
                and fd not in self._stalled and fd not in self._away]

    def _mark_rings(self, asleep: bool) -> bool:
        """Marks every ring asleep (then :func:`fence`, so that a client that posts after the
        next look sees the mark and writes a wake-up) or awake again; returns ``asleep``."""
        for conn in self._rings.values():
            if conn.ring is not None:
                conn.ring.words[_DAEMON_ASLEEP] = int(asleep)
        if asleep:
            fence()
        return asleep

    def _collect(self, events: list[tuple[int, int]], rings: list[LaneConnection]
                 ) -> list[tuple[LaneConnection, Any, bool]]:
        """The messages ready now, in the order they were seen: (connection, frames, or the
        exception reading raised, or None at end of file; whether it came in the ring)."""
        work: list[tuple[LaneConnection, Any, bool]] = []
        for conn in rings:
            ring = conn.ring
            assert ring is not None
            conn.ring_seen = ring.words[_REQ]
            kind = ring.words[_REQ_KIND]
            if kind:  # a bound infer: the number of its binding, read no further here
                work.append((conn, kind - 1, True))
                continue
            try:
                parts: Any = P.lane_parse(ring.request, self.max_frames, self.max_bytes)
                if not parts:
                    raise P.LaneError(P.ProtocolViolation("ProtocolError", "a ring message of no frames"))
            except P.LaneError as exc:
                parts = exc
            work.append((conn, parts, True))
        listener = self.listener.fileno()
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            elif fd == listener:
                self._accept_all()
            elif fd in self.conns and fd not in self._away and fd not in self._stalled:
                conn, reader = self.conns[fd]
                work.extend((conn, parts, False) for parts in self._read(conn, reader))
        while self._done:
            conn, parts = self._done.popleft()
            entry = self.conns.get(conn.fd)
            if entry is None or entry[0] is not conn:
                continue  # closed meanwhile (and its descriptor perhaps another connection's now)
            self._away.discard(conn.fd)
            if isinstance(parts, list):
                self._epoll.register(conn.fd, select.EPOLLIN)
            work.append((conn, parts, False))
        return work

    def _read(self, conn: LaneConnection, reader: P.LaneReader) -> list[Any]:
        """The messages the socket holds whole (a wake-up, read as [], is dropped), None at end
        of file, or the exception reading raised. What remains of a message begun waits for the
        socket's next bytes; a large one is read by a thread of its own instead."""
        out: list[Any] = []
        try:
            for _ in range(_TAKES):
                took = take_waiting(reader)
                while message_whole(reader):
                    parts = reader.read()
                    if parts:
                        out.append(parts)
                if took < 0:  # end of file: read() says whether between messages or inside one
                    out.append(reader.read())
                    return out
                if reader.rest and (reader.needed() or 0) > P.LANE_CHUNK:
                    self._read_apart(conn, reader)  # not gathered here chunk by chunk
                    return out
                if took < P.LANE_CHUNK:  # the socket held less than a chunk: nothing more waits
                    return out
        except (P.LaneError, OSError) as exc:
            out.append(exc)
        return out

    def _read_apart(self, conn: LaneConnection, reader: P.LaneReader) -> None:
        """A message that has not arrived whole: a thread reads it (blocking) and hands it back;
        the connection is read here again after it."""
        self._epoll.unregister(conn.fd)
        self._away.add(conn.fd)

        def read() -> None:
            try:
                while (parts := reader.read()) == []:
                    pass
            except Exception as exc:  # handed back, answered there
                parts = exc
            self._done.append((conn, parts))
            self._wake()

        threading.Thread(target=read, name=f"vkpool-lane-read-{conn.fd}", daemon=True).start()

    def _accept_all(self) -> None:
        while self._listening() and (sock := self.listener.accept()) is not None:
            conn = self._accept(sock)
            if conn is not None:
                self.conns[conn.fd] = (conn, P.LaneReader(sock, self.max_frames, self.max_bytes))
                self._epoll.register(conn.fd, select.EPOLLIN)

    # -- one message -------------------------------------------------------------------------
    def _handle(self, conn: LaneConnection, parts: Any, ringed: bool) -> None:
        fd = conn.fd
        if fd not in self.conns:
            return  # closed by an earlier message of this pass
        if (type(parts) is list or type(parts) is int) and fd in self._open:  # a request (int: bound)
            if conn.backlogged():  # its client does not read its replies: this one waits with them
                if fd not in self._stalled:
                    if fd not in self._away:
                        self._epoll.unregister(fd)
                    self._stalled[fd] = []
                self._stalled[fd].append((parts, ringed))
            else:
                conn.ring_reply = ringed
                self._request(conn, parts)
        elif parts is None or isinstance(parts, OSError):
            self._close(fd)
        elif isinstance(parts, P.LaneError):
            conn.ring_reply = ringed
            self._broken(conn, parts)
            self._close(fd)
        elif isinstance(parts, BaseException):
            self._log.error("unexpected failure reading a local lane; closing it", exc_info=parts)
            self._close(fd, failed=True)
        elif self._opened(conn, parts):  # the first message: open_lane
            self._open.add(fd)
            if conn.ring is not None:
                self.conns[fd][1].wakes = True
                self._rings[fd] = conn
        else:
            self._close(fd)

    def _unstall(self) -> list[tuple[LaneConnection, Any, bool]]:
        """The messages held for connections whose replies have all been written; those are read
        again."""
        out: list[tuple[LaneConnection, Any, bool]] = []
        for fd in list(self._stalled):
            entry = self.conns.get(fd)
            if entry is None:
                del self._stalled[fd]
            elif not entry[0].backlogged():
                out.extend((entry[0], parts, ringed) for parts, ringed in self._stalled.pop(fd))
                self._epoll.register(fd, select.EPOLLIN)
        return out

    def _close(self, fd: int, failed: bool = False) -> None:
        conn, _ = self.conns.pop(fd)
        if fd in self._away:
            conn.shutdown()  # the thread reading a message of it returns
        elif fd not in self._stalled:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass
        self._away.discard(fd)
        self._stalled.pop(fd, None)
        self._open.discard(fd)
        self._rings.pop(fd, None)
        self._closed(conn, failed)


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
    ``recv``); a reply timeout is the kernel's SO_RCVTIMEO. When the client polls (``poller.max_s``
    above 0) it asks for a :class:`Ring`: requests and replies that fit then travel in shared
    memory, and the socket only wakes a side that sleeps."""

    __slots__ = ("sock", "reader", "timeout", "sent_at", "reply_s", "earliest_s", "poller", "ring", "on_ring",
                 "rep_seen", "bindings", "unbound")

    def __init__(self, offer: dict[str, Any], client: bytes, timeout: float, poller: Poller) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self.reader, self.poller = sock, P.LaneReader(sock), poller
        self.timeout: float | None = None
        self.sent_at = 0.0
        self.reply_s = poller.max_s / 2  # moving average of the time from request to reply
        self.earliest_s = 0.0  # how soon a reply usually comes (Poller.earliest), for dozing on a ring
        self.ring: Ring | None = None
        self.on_ring = False  # the request in flight went in the ring
        self.rep_seen = 0
        #: bound infers of this lane (:class:`vkpool.daemon.bound.ClientBinding`) by request key, and
        #: the keys the daemon would not bind (sent as framed infers)
        self.bindings: dict[Any, Any] = {}
        self.unbound: set[Any] = set()
        try:
            sock.settimeout(timeout)
            sock.connect(str(offer["path"]))  # OSError: no lane to be had from here
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        fds: list[int] = []
        try:
            opening = {"client": client.hex(), "token": offer["token"]}
            if poller.max_s > 0 and ring_supported():
                opening["ring"] = True
            self.send([P.packed_header("open_lane_request", "lane"), P.pack(opening)])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            self.timeout = timeout
            first, fds, _, _ = socket.recv_fds(sock, P.LANE_CHUNK, 1)  # the ring's descriptor comes with it
            if not first:
                raise ConnectionResetError("end of file")
            self.reader.rest = first
            header, content, _ = self.receive(timeout)
        except OSError as exc:  # a daemon at its cap answers and closes at once: a refusal too
            sock.close()
            for fd in fds:
                os.close(fd)
            raise LaneRefused({"message": f"the daemon closed the lane before opening it ({exc})"}) from None
        except BaseException:
            sock.close()
            for fd in fds:
                os.close(fd)
            raise
        try:
            reply = P.unpack(content)
        except P.ProtocolViolation:
            reply = None
        try:
            if header.get("status") != "ok":
                sock.close()
                raise LaneRefused(reply if isinstance(reply, dict) else {})
            half = reply.get("ring") if isinstance(reply, dict) else None
            if fds and type(half) is int and half > 0:
                self.ring = Ring(fds[0], half)
                self.reader.wakes = True
        finally:
            for fd in fds:
                os.close(fd)

    def send(self, parts: list[Any]) -> None:
        """Write one request (``OSError`` when the daemon closed the lane: nothing was accepted)."""
        ring = self.ring
        if ring is not None and ring.post(parts, _REQ) is not None:
            self.on_ring = True
            ring_wake(self.sock, ring.words, _DAEMON_ASLEEP)
        else:
            self.on_ring = False
            P.lane_send(self.sock, parts)
        self.sent_at = time.perf_counter()

    def receive(self, timeout: float | None) -> tuple[dict[str, Any], memoryview, list[memoryview]]:
        """Read one reply: header, packed content, raw frames. ``TimeoutError`` when none came within
        ``timeout``; ``ConnectionError`` when the daemon closed the lane; other ``OSError`` for a
        failed socket. After any exception the lane must be closed."""
        frames = self.receive_frames(timeout)
        try:
            header = P.unpack(frames[0])
        except P.ProtocolViolation:
            header = None
        if not isinstance(header, dict):
            raise ConnectionResetError("the daemon sent something that is no reply on the local lane")
        return header, frames[1], frames[2:]

    def send_bound(self, index: int) -> None:
        """Publish the bound infer whose inputs were written in the request half (binding
        ``index``); its reply is read with :meth:`receive_frames`."""
        ring = self.ring
        assert ring is not None
        words = ring.words
        words[_REQ_KIND] = index + 1
        words[_REQ] += 1
        self.on_ring = True
        ring_wake(self.sock, words, _DAEMON_ASLEEP)
        self.sent_at = time.perf_counter()

    def receive_frames(self, timeout: float | None) -> list[memoryview] | memoryview:
        """:meth:`receive`, the header left packed: the reply's frames (at least two), or the ring's
        reply half when it holds a bound infer's outputs (read them before the next request)."""
        if timeout != self.timeout:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            self.timeout = timeout
        reader = self.reader
        try:
            if self.on_ring:
                frames = self._from_ring()
            else:
                self.poller.wait(reader, self.reply_s, self.sent_at)
                frames = reader.read()
                while frames == []:  # a wake-up left over from the ring
                    frames = reader.read()
        except P.LaneError:
            frames = None
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"no reply within {timeout:g} s") from None
        if frames is None:
            raise ConnectionResetError("the daemon closed the local lane")
        seen_s = time.perf_counter() - self.sent_at
        self.reply_s = self.poller.average(self.reply_s, seen_s)
        self.earliest_s = self.poller.earliest(self.earliest_s, seen_s)
        return frames

    def _from_ring(self) -> list[memoryview] | memoryview | None:
        """The reply to a request sent in the ring: copied out of the ring (the lane may carry the
        next request before the caller is done with this reply), or read from the socket."""
        ring = self.ring
        assert ring is not None
        words, seen, poller = ring.words, self.rep_seen, self.poller
        if words[_REP] == seen:
            until = poller.until(self.reply_s, self.sent_at)
            if until is None and (doze := poller.doze(self.earliest_s, self.sent_at)) is not None:
                # a reply that takes long (a slow model): sleep through most of it, then poll
                ring_doze(words, _REP, seen, _CLIENT_ASLEEP, self.sock, doze[0])
                until = doze[1]
            if until is not None and poller._token.acquire(False):
                try:
                    ring_wait(words, _REP, seen, self.reader, until)
                finally:
                    poller._token.release()
            if words[_REP] == seen:
                parts = ring_sleep(words, _REP, seen, _CLIENT_ASLEEP, self.reader)
                if parts is None or parts:  # end of file, or a reply on the socket
                    return parts
        self.rep_seen = words[_REP]
        if words[_REP_KIND] == RECORD:
            return ring.reply
        frames = P.lane_parse(ring.reply, copy=True)
        if not frames:  # the reply was too large for the ring: it is on the socket
            frames = self.reader.read()
            while frames == []:
                frames = self.reader.read()
        return frames

    def shutdown(self) -> None:
        """Wake a thread waiting on this lane (safe from any thread)."""
        wake(self.sock)

    def close(self) -> None:
        self.sock.close()
        if self.ring is not None:
            self.ring.close()
