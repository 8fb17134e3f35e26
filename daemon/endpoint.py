"""Where the daemon listens, and the guards around binding there.

- The default endpoint is an ``ipc://`` socket in ``$XDG_RUNTIME_DIR/vkpool/`` (else
  ``~/.cache/vkpool/``): the directory is 0700 and the socket 0600, so only this user connects.
- A second ``bind`` on an ipc path silently steals it from the first daemon, so a lock file
  next to the socket refuses a second daemon; a socket left by a crashed daemon (lock free,
  file present) is removed.
- libzmq's ipc listener aborts the whole process when ``accept`` fails with EMFILE, so the
  daemon raises its open-file limit at start, caps connections below it and, when its open
  descriptors come within :func:`fd_margin` of the limit whatever holds them, takes no more
  connections (the socket file is moved aside, :func:`paused_path`, until descriptors are free
  again; clients meanwhile retry to connect). :class:`ConnectionWatch` watches on a thread of
  its own, connection by connection, so that a burst is stopped while it is accepted.
- The local lane's Unix socket is ``<socket>.lane`` in the same directory, created 0600 under
  the same lock, and removed with the ipc socket (at stop, or at start when a crashed daemon
  left it).
"""
from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import resource
import threading
from pathlib import Path
from typing import IO

import zmq
from zmq.utils.monitor import parse_monitor_message

# Unix socket paths longer than this do not fit in sockaddr_un.sun_path.
_MAX_IPC_PATH = 107
# File descriptors kept free beyond the connection cap: pipes, log files, models, zmq internals.
FD_RESERVE = 256


class EndpointError(RuntimeError):
    """The endpoint cannot be used; the message says why and what to do."""


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return (Path(base) if base else Path.home() / ".cache") / "vkpool"


def default_endpoint() -> str:
    return f"ipc://{runtime_dir() / 'daemon.sock'}"


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def lane_path(socket_path: Path) -> Path:
    """The local lane's socket beside the daemon's ipc socket."""
    return socket_path.with_name(socket_path.name + ".lane")


def paused_path(socket_path: Path) -> Path:
    """Where the ipc socket file is moved while the daemon takes no connections (near its
    descriptor limit), so that clients find none and retry."""
    return socket_path.with_name(socket_path.name + ".paused")


def lane_fits(socket_path: Path) -> bool:
    """False when the lane's path is too long for a Unix socket address."""
    return len(str(lane_path(socket_path))) <= _MAX_IPC_PATH


class EndpointLock:
    """An exclusive ``flock`` on ``<socket>.lock``, held for the daemon's lifetime."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        if len(str(self.socket_path)) > _MAX_IPC_PATH:
            raise EndpointError(f"ipc path {self.socket_path} is longer than {_MAX_IPC_PATH} "
                                "characters; choose a shorter endpoint")
        directory = self.socket_path.parent
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if directory == runtime_dir():
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask and ignored if present
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise EndpointError(f"another vkpool daemon (pid {owner}) already serves "
                                    f"ipc://{self.socket_path}; stop it with `vkpool stop` or choose "
                                    "another --endpoint") from None
            raise
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        for stale in (self.socket_path, lane_path(self.socket_path), paused_path(self.socket_path)):
            if stale.exists() or stale.is_symlink():
                # The lock was free, so whoever made this socket is gone: a crashed daemon.
                stale.unlink()

    def release(self) -> None:
        if self._file is None:
            return
        for path in (self.socket_path, lane_path(self.socket_path), paused_path(self.socket_path), self.path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self._file.close()
        self._file = None


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the old limit; the connection cap below adapts to it
    return soft


def fd_reserve(fd_limit: int) -> int:
    """Descriptors kept free beyond the connection caps: :data:`FD_RESERVE`, or a quarter of a
    limit lower than four times that."""
    return min(FD_RESERVE, fd_limit // 4)


def connection_cap(configured: int, fd_limit: int) -> int:
    """The connection cap actually used: the configured one, lowered to fit the fd limit."""
    return max(1, min(configured, fd_limit - fd_reserve(fd_limit)))


#: connections a listener holds accepted but not yet handed to the daemon (``ZMQ_BACKLOG``)
LISTEN_BACKLOG = 32


def fd_margin(fd_limit: int) -> int:
    """Open descriptors at which the daemon stops listening are ``fd_limit`` less this: room for
    the connections libzmq accepts after the descriptors reach that mark (those accepted before
    :class:`ConnectionWatch` hears of them, more while other processes hold the CPU, and a
    listener's backlog once the socket file is moved: half a low limit), and for the daemon's
    own files."""
    return max(fd_reserve(fd_limit), LISTEN_BACKLOG + 16, min(fd_limit // 2, FD_RESERVE))


def open_fds() -> int | None:
    """Descriptors this process has open, where the system says (Linux ``/proc``)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing the folder
    except OSError:
        return None


class ConnectionWatch:
    """The ZeroMQ socket monitor, read on a thread of its own so that a burst of connections is
    answered while libzmq accepts it, not when the I/O thread next looks (it may be busy with
    requests, or with the burst's own messages).

    Every accepted connection raises an estimate of the open descriptors (the last listing plus
    the connections accepted since); only once the estimate reaches the pause mark are they
    listed, and the ipc socket file is moved aside (:func:`paused_path`) if the listing agrees.
    :meth:`check`, called by the I/O thread while paused and after it accepts a lane connection,
    lists them again and puts the file back once they are a margin below. Disconnects are queued
    for the I/O thread (``departed``), which probes the clients that used those descriptors."""

    #: the events read: a connection accepted, one ended, and the monitor's end (the thread's)
    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED

    def __init__(self, router: zmq.Socket, fd_limit: int, socket_path: Path | None,
                 log: logging.Logger) -> None:
        self.router = router
        self.monitor = router.get_monitor_socket(self.EVENTS)
        self.fd_limit = fd_limit
        self.pause_at = fd_limit - fd_margin(fd_limit)
        self.resume_below = self.pause_at - min(fd_margin(fd_limit), self.pause_at // 3)
        self.path = socket_path
        self.paused = None if socket_path is None else paused_path(socket_path)
        self.listening = True
        self.connections = 0
        self.departed: collections.deque[int] = collections.deque()  # descriptors of disconnects
        self._log = log
        self._lock = threading.Lock()
        self._estimate = 0
        self._thread = threading.Thread(target=self._run, name="vkpool-connections", daemon=True)

    def start(self) -> None:
        self._estimate = open_fds() or 0
        self._thread.start()

    def stop(self) -> None:
        """Stops the router's monitor; the thread sees it stop and closes it (or, if the thread
        never started, it is closed here)."""
        self.router.disable_monitor()
        if self._thread.ident is not None:
            self._thread.join(5.0)
        else:
            self.monitor.close(0)

    def _run(self) -> None:
        try:
            while True:
                event = parse_monitor_message(self.monitor.recv_multipart())
                kind = event["event"]
                if kind == zmq.EVENT_ACCEPTED:
                    self.connections += 1
                    self._estimate += 1
                    if self._estimate >= self.pause_at:
                        self.check()
                elif kind == zmq.EVENT_DISCONNECTED:
                    self.connections = max(0, self.connections - 1)
                    self.departed.append(int(event["value"]))
                elif kind == zmq.EVENT_MONITOR_STOPPED:
                    break
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self.monitor.close(0)

    def check(self) -> None:
        """List the open descriptors; stop or resume taking ipc connections by that count."""
        count = open_fds()
        if count is None or self.path is None:
            return
        with self._lock:
            self._estimate = count
            if self.listening and count >= self.pause_at:
                os.replace(self.path, self.paused)
                self.listening = False
                self._log.warning("%d of %d file descriptors open: not accepting connections until some "
                                  "close", count, self.fd_limit)
            elif not self.listening and count < self.resume_below:
                os.replace(self.paused, self.path)
                self.listening = True
                self._log.info("%d of %d file descriptors open: accepting connections again", count,
                               self.fd_limit)
