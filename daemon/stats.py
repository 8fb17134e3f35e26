"""Counters that balance (accepted = ok + error + client_gone + in flight), job latency, and
error replies by type (each logged at warning level)."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Sequence

from vkpool.daemon import protocol as P

from vkpool.percentiles import latency_percentiles

log = logging.getLogger("vkpool.daemon")

#: an error type is logged at most once per this many seconds; the replies not logged are counted
ERROR_LOG_INTERVAL_S = 1.0


class Stats:
    LATENCY_WINDOW = 1000   # infer latencies kept for the percentiles
    RATE_WINDOW_S = 60.0    # jobs/s is measured over this many seconds
    RATE_STEP_S = 0.01      # infers that end within this of a step's start are counted in it

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics  # a vkpool.daemon.metrics.Metrics when daemon.metrics is set
        self.errors_by_type: Counter[str] = Counter()
        self._error_logged: dict[str, float] = {}    # error type -> when it was last logged
        self._error_unlogged: Counter[str] = Counter()  # replies of a type not logged since
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.accepted = 0
        self.ok = 0
        self.error = 0
        self.client_gone = 0
        self.dropped = 0        # frames that could not be answered (no routing frame)
        self.busy = 0
        self.retries = 0        # repeated request ids, answered from the replay window
        self.lanes = 0          # local lane connections open
        self.replay_bytes = 0   # the replies the replay window keeps, in bytes
        self._latencies: deque[float] = deque(maxlen=self.LATENCY_WINDOW)
        # infers answered ok in the last RATE_WINDOW_S: [start, count] per step, and their sum
        self._finished: deque[list[float]] = deque()
        self._finished_n = 0

    def count(self, name: str, n: int = 1) -> None:
        counters = self.__dict__  # the counters are plain attributes
        with self._lock:
            counters[name] += n

    def answered(self) -> int:
        """Requests answered or dropped for their client so far."""
        return self.ok + self.error + self.client_gone

    def infer_done(self, latency_s: float, now: float | None = None) -> None:
        """An infer answered ``ok`` after ``latency_s``; ``now``: ``time.monotonic()`` when the
        caller has read it already."""
        self.infers_done([latency_s], time.monotonic() if now is None else now)

    def infers_done(self, latencies_s: list[float], now: float) -> None:
        """Infers answered ``ok`` by ``now`` (``time.monotonic()``) after ``latencies_s``."""
        n = len(latencies_s)
        with self._lock:
            self._latencies.extend(latencies_s)
            finished = self._finished
            if finished and now - finished[-1][0] < self.RATE_STEP_S:
                finished[-1][1] += n
            else:
                finished.append([now, n])
            self._finished_n += n
            self._expire(now)

    def _expire(self, now: float) -> None:
        """Steps older than the rate's window dropped (the caller holds the lock)."""
        finished, since = self._finished, now - self.RATE_WINDOW_S
        while finished and finished[0][0] < since:
            self._finished_n -= int(finished.popleft()[1])

    def ran(self, entry: Any, status: str, run_s: float, *queued_s: float) -> None:
        """One run on ``entry`` (a registry ModelEntry) of a job, or of a batch of jobs,
        each queued for one of ``queued_s``; ``status`` is ``ok`` or the error type."""
        metrics = self.metrics
        if metrics is not None:
            metrics.ran(entry, status, run_s, queued_s)

    def error_reply(self, body: Sequence[Any]) -> None:
        """An error reply (``[delimiter, header, content, ...]``, packed) is sent: counted by its
        type and logged at warning level; a type is logged at most once per
        :data:`ERROR_LOG_INTERVAL_S`, with the count of its replies not logged since."""
        try:
            header, content = P.unpack(_bytes(body[1])), P.unpack(_bytes(body[2]))
            error_type, message = str(content["type"]), str(content["message"])
            action = str(header["type"]).removesuffix("_reply")
            request = "request" if action == "error" else action  # an error_reply answers no known action
            rid = header.get("id") or "(no id)"
        except (P.ProtocolViolation, KeyError, TypeError, IndexError, AttributeError):
            error_type, message, request, rid = "Unknown", "an error reply that does not decode", "request", ""
        now = time.monotonic()
        with self._lock:
            self.errors_by_type[error_type] += 1
            last = self._error_logged.get(error_type)
            if last is not None and now - last < ERROR_LOG_INTERVAL_S:
                self._error_unlogged[error_type] += 1
                return
            self._error_logged[error_type] = now
            unlogged = self._error_unlogged.pop(error_type, 0)
        log.warning("%s %s answered %s: %s%s", request, rid, error_type, message,
                    f" ({unlogged} more {error_type} replies since the last one logged)" if unlogged else "")

    def snapshot(self, connections: int, samples: bool = False) -> dict[str, Any]:
        """Counters, jobs/s and latency percentiles; ``samples``: the latencies too
        (``latency_samples_ms``, oldest first), for a front that merges several processes'."""
        now = time.monotonic()
        with self._lock:
            lat = list(self._latencies)
            self._expire(now)
            span = min(self.RATE_WINDOW_S, now - self.started)
            counters = {"accepted": self.accepted, "ok": self.ok, "error": self.error,
                        "client_gone": self.client_gone,
                        "in_flight": self.accepted - self.ok - self.error - self.client_gone,
                        "dropped": self.dropped, "busy": self.busy, "retries": self.retries,
                        "connections": connections, "lanes": self.lanes, "replay_bytes": self.replay_bytes}
            rate = self._finished_n / span if span > 0 else 0.0
        snap = {"uptime_s": round(now - self.started, 3), "counters": counters, "jobs_per_s": round(rate, 3),
                "latency_ms": latency_percentiles(lat)}
        if samples:
            snap["latency_samples_ms"] = [round(v * 1e3, 4) for v in lat]
        return snap


def _bytes(frame: Any) -> bytes | memoryview:
    return frame if isinstance(frame, (bytes, memoryview)) else frame.bytes
