"""A daemon that serves each Vulkan pool member from a process of its own (``daemon.process_per_device``).

One Python process reads, batches and answers every request of a daemon, and it is busy most of
the time with many clients: a second GPU adds little. With ``process_per_device`` the daemon
(the *front*) starts one serving process per Vulkan member of its pool, each a whole daemon over
that member alone (its own ipc socket and local lane, its budget and ledger key as in the whole
pool), and keeps none of the work itself:

- ``hello`` answers with ``redirect``, the endpoint of the serving process with the fewest
  clients, and ``serving``, the list of them; vkpool's clients follow it at once, and send their
  model and ``infer`` requests there;
- ``status``, ``devices`` and ``list_models`` gather what every serving process reports;
  ``set_budget`` goes to the process that has the member; ``shutdown`` (and SIGTERM) stops them
  all, each draining its jobs, then the front;
- any other request is answered ``Redirected``, naming where to send it.

A serving process that exits is started again (a second after its last start; while it keeps
exiting before it answers, after 2, 4, … up to 60 seconds), and the front leaves it out of
``hello`` until it answers. A model is loaded in each process whose clients ask for it, so
a model with clients in several processes runs as replicas, one per device. A model that fits no
single member is refused there: plans that span devices need ``process_per_device`` off.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq
from vkpool.daemon import protocol as P
from vkpool.daemon.endpoint import EndpointError, EndpointLock, ipc_path, lane_fits, lane_path
from vkpool.daemon.protocol import ProtocolViolation
from vkpool.daemon.settings import DaemonSettings

from vkpool.percentiles import delay_percentiles_us, latency_percentiles

log = logging.getLogger("vkpool.daemon")

#: how long the front waits for every serving process to answer before it listens
READY_S = 120.0
#: how often, at most, the front asks each serving process for its status (its clients, for ``hello``)
LOAD_EVERY_S = 1.0
#: how long a ``hello`` waits for a serving process's count of its clients (a hung process is
#: then counted as it was)
LOAD_WAIT_S = 0.5
#: a serving process that exits is started again no sooner than this after its last start, doubled
#: for each start in a row after which it never answered (at most RESTART_MAX_S)
RESTART_MIN_S = 1.0
RESTART_MAX_S = 60.0
#: how long a request the front passes on (status, set_budget, shutdown) waits for its answer
FORWARD_S = 5.0
#: a serving process whose front has gone and that still runs this long after its drain deadline
#: (its own stop ends within 10 s of it) exits at once
ORPHAN_GRACE_S = 15.0
_TICK_MS = 100


@dataclass
class Serving:
    """One serving process: the member it serves and where it listens."""

    member: str
    endpoint: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    failed: int = 0       # starts in a row after which it exited without answering
    noted: int = 0        # the pid whose exit was logged
    ready: bool = False
    clients: int = 0      # connections it reported last
    given: int = 0        # hellos sent to it since then
    control: Any = None   # a Client of the front's, for status and set_budget
    answered: bool = True  # whether it answered the front's last request for every process

    def noted_clients(self, status: dict[str, Any]) -> None:
        """Its clients as its ``status`` counts them (less the front's own connection)."""
        self.clients, self.given = max(0, int(status["counters"]["connections"]) - 1), 0

    def describe(self) -> dict[str, Any]:
        running = self.proc is not None and self.proc.poll() is None
        return {"member": self.member, "endpoint": self.endpoint, "pid": self.proc.pid if running else None,
                "state": "exited" if not running else "starting" if not self.ready
                else "serving" if self.answered else "not answering",
                "restarts": self.restarts, "clients": self.clients}


def serving_endpoint(endpoint: str, member: str) -> str:
    """The ipc endpoint of ``member``'s serving process, beside the front's socket."""
    path = ipc_path(endpoint)
    assert path is not None
    return f"ipc://{path.with_name(f'{path.name}.{member}')}"


def metrics_file(endpoint: str) -> Path:
    """Where a serving process at ``endpoint`` writes the address of its metrics, for the front."""
    path = ipc_path(endpoint)
    assert path is not None
    return path.with_name(f"{path.name}.metrics")


def refusal(settings: DaemonSettings, endpoint: str, cluster: bool) -> str | None:
    """Why ``process_per_device`` cannot be honoured with these settings, or None."""
    if cluster:
        return ("daemon.process_per_device serves this machine's devices; a cluster's daemon (--cluster) "
                "runs in one process: set process_per_device to false")
    if not endpoint.startswith("ipc://"):
        return (f"daemon.process_per_device needs an ipc:// endpoint (its serving processes listen beside "
                f"it), not {endpoint}")
    return None


class Front:
    """The front of a daemon with a serving process per Vulkan member; see the module's doc."""

    def __init__(self, settings: DaemonSettings, endpoint: str, config: str | None, members: list[str],
                 context: zmq.Context | None = None) -> None:
        if not members:
            raise EndpointError("daemon.process_per_device: the pool has no Vulkan member to serve")
        self.settings = settings
        self.endpoint = endpoint
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.started = time.monotonic()
        self.children = [Serving(m, serving_endpoint(endpoint, m)) for m in members]
        for child in self.children:
            path = ipc_path(child.endpoint)
            assert path is not None
            if not lane_fits(path):
                raise EndpointError(f"{lane_path(path)} is too long for a Unix socket: choose a shorter endpoint "
                                    "for daemon.process_per_device")
        self._stop = threading.Event()
        self._lock: EndpointLock | None = None
        self._router: zmq.Socket | None = None
        self._next_load = 0.0
        self.accepted = 0
        self.errors = 0

    # -- serving processes ---------------------------------------------------------------------
    def _spawn(self, child: Serving) -> None:
        command = [sys.executable, "-m", "vkpool.daemon.front", "--member", child.member, "--endpoint",
                   child.endpoint, "--front", str(os.getpid()), *(["--config", self.config] if self.config else []),
                   *(["--metrics"] if self.settings.metrics is not None else [])]
        metrics_file(child.endpoint).unlink(missing_ok=True)
        child.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        child.started = time.monotonic()
        child.ready, child.answered = False, True
        _close(child.control)
        child.control = None
        log.info("serving process for %s started (pid %d) on %s", child.member, child.proc.pid, child.endpoint)

    def _look_after(self, child: Serving, now: float) -> None:
        """Start ``child`` again when it has exited; note when it answers."""
        proc = child.proc
        if proc is not None and proc.poll() is not None:
            if child.noted != proc.pid:
                log.error("serving process for %s (pid %d) exited with status %s%s", child.member, proc.pid,
                          proc.returncode, "" if child.ready else " before it answered")
                child.noted = proc.pid
                if child.ready:  # it had served: start again soon
                    child.ready, child.failed = False, 0
            delay = min(RESTART_MAX_S, RESTART_MIN_S * 2 ** child.failed)
            if not self._stop.is_set() and now - child.started >= delay:
                log.info("starting the serving process for %s again (restart %d)", child.member, child.restarts + 1)
                child.restarts += 1
                child.failed += 1
                self._spawn(child)
            return
        if not child.ready:
            child.ready = self._control(child, wait=0.2) is not None
            if child.ready:
                child.failed = 0

    def _control(self, child: Serving, wait: float = FORWARD_S) -> Any:
        """The front's client of ``child`` (made on first use), or None while it does not answer."""
        if child.control is None:
            from vkpool.daemon.client import Client
            from vkpool.daemon.errors import DaemonUnavailable

            try:
                child.control = Client(child.endpoint, hello_timeout=wait, local_lane=False, follow=False,
                                       name="front", context=self.ctx, timeout=FORWARD_S)
            except (DaemonUnavailable, OSError):
                return None
        return child.control

    def _refresh_loads(self) -> None:
        """Learn how many clients each serving process has, at most once in LOAD_EVERY_S (asked
        only when a client arrives, so that an idle daemon's counters stay still)."""
        now = time.monotonic()
        if now < self._next_load:
            return
        self._next_load = now + LOAD_EVERY_S
        for child, status in self._ask_all("status", wait=LOAD_WAIT_S):
            if isinstance(status, dict):
                child.noted_clients(status)

    def _ask(self, child: Serving, action: str, content: dict[str, Any] | None = None,
             wait: float = FORWARD_S) -> dict[str, Any] | Exception:
        """``child``'s answer to one request within ``wait`` seconds, or the exception that came
        instead (at once for a process that is not running or has not answered yet)."""
        from vkpool.daemon.errors import DaemonError, DaemonUnavailable

        running = child.ready and child.proc is not None and child.proc.poll() is None
        control = self._control(child) if running else None
        if control is None:
            return DaemonUnavailable(f"the serving process for {child.member} is not running")
        try:
            return control.request(action, content or {}, timeout=wait)[0]
        except Exception as exc:  # an error reply, a timeout, or a process gone
            if not isinstance(exc, DaemonError):
                _close(child.control)  # made afresh when next asked
                child.control = None
            return exc

    def _ask_all(self, action: str, content: dict[str, Any] | None = None, wait: float = FORWARD_S,
                 children: list[Serving] | None = None) -> list[tuple[Serving, dict[str, Any] | Exception]]:
        """Each serving process's (or each of ``children``'s) :meth:`_ask`, all asked at once: a
        request waits ``wait`` at most however many of them hang. Each process's client is used by
        one thread at a time, and by none while this thread is elsewhere."""
        children = self.children if children is None else children
        if len(children) < 2:
            return [(c, self._ask(c, action, content, wait)) for c in children]
        with ThreadPoolExecutor(max_workers=len(children), thread_name_prefix="vkpool-front-ask") as askers:
            asked = [(c, askers.submit(self._ask, c, action, content, wait)) for c in children]
            return [(c, future.result()) for c, future in asked]

    def start(self) -> None:
        """Start every serving process and wait until each answers; raises EndpointError when one
        exits first or does not answer within READY_S."""
        path = ipc_path(self.endpoint)
        assert path is not None
        self._lock = EndpointLock(path)
        self._lock.acquire()
        for child in self.children:
            self._spawn(child)
        deadline = time.monotonic() + READY_S
        while not all(c.ready for c in self.children):
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None:
                    self.stop_children()
                    raise EndpointError(f"the serving process for {child.member} exited with status "
                                        f"{child.proc.returncode} while starting (its log is above)")
                if not child.ready:
                    child.ready = self._control(child, wait=0.5) is not None
            if time.monotonic() > deadline:
                self.stop_children()
                raise EndpointError(f"the serving processes did not all answer within {READY_S:g} s")
            if self._stop.wait(0.05):
                self.stop_children()
                raise EndpointError("stopped while the serving processes were starting")
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        router.setsockopt(zmq.LINGER, 1000)
        old = os.umask(0o177)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            router.close(0)
            self.stop_children()
            raise EndpointError(f"cannot bind {self.endpoint}: {exc}") from None
        finally:
            os.umask(old)
        self._router = router
        log.info("listening on %s; serving processes: %s", self.endpoint,
                 ", ".join(f"{c.member} (pid {c.proc.pid})" for c in self.children if c.proc is not None))

    def metric_sources(self) -> list[tuple[str, str | None, int]]:
        """``(member, address of its metrics or None, restarts)`` of each serving process, for
        :class:`vkpool.daemon.metrics.GatheredMetrics`."""
        out = []
        for child in self.children:
            try:
                address: str | None = metrics_file(child.endpoint).read_text().strip() or None
            except OSError:
                address = None
            running = child.ready and child.proc is not None and child.proc.poll() is None
            out.append((child.member, address if running else None, child.restarts))
        return out

    def request_stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> int:
        assert self._router is not None
        router = self._router
        try:
            while not self._stop.is_set():
                ready = router.poll(_TICK_MS, zmq.POLLIN)
                now = time.monotonic()
                for child in self.children:  # first: a process that has exited is asked nothing
                    self._look_after(child, now)
                for _ in range(64 if ready else 0):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_request(frames)
            return 0
        finally:
            self.stop_children()
            router.close(linger=1000)
            if self._lock is not None:
                self._lock.release()
            log.info("stopped: %d request(s) answered here, %d of them errors", self.accepted, self.errors)

    def stop_children(self) -> None:
        """Ask every serving process to stop (draining its jobs) and wait for them."""
        self._stop.set()
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for child, answer in self._ask_all("shutdown", children=running):
            if isinstance(answer, Exception):
                child.proc.terminate()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.settings.drain_deadline + 15.0
        for child in self.children:
            _close(child.control)
            child.control = None
            metrics_file(child.endpoint).unlink(missing_ok=True)
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("serving process for %s (pid %d) did not stop; killed", child.member, child.proc.pid)
                child.proc.kill()
                child.proc.wait()

    # -- requests --------------------------------------------------------------------------------
    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # nothing after the routing frame: nowhere to reply
        client = frames[0]
        header: dict[str, Any] = {}
        self.accepted += 1
        try:
            body = P.split_routing(frames[1:])[1]
            peeked = P.unpack(body[0]) if body else None
            if isinstance(peeked, dict):
                header = peeked  # unpacked once: decode_request checks it as it is
            header, content, raw = P.decode_request(body, header or None)
            action = P.action_of(header)
            handler: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(
                self, f"_{action}", None) if action in P.FRONT_ACTIONS else None
            if handler is None:
                there = self._choose().endpoint
                raise ProtocolViolation("Redirected", f"this daemon serves each device from a process of its own "
                                        f"(daemon.process_per_device): send {action} to the endpoint in hello's "
                                        f"redirect ({there})", {"redirect": there})
            if raw:
                raise ProtocolViolation("InvalidRequest", f"{action}_request takes no raw frames, got {len(raw)}")
            result, status = handler(content), "ok"
        except ProtocolViolation as exc:
            result, status = {"type": exc.type, "message": exc.message, "details": exc.details}, "error"
        except Exception as exc:  # a request that cannot be taken is answered, whatever went wrong
            log.exception("a request to the front failed")
            result, status = {"type": "InternalError", "message": f"{type(exc).__name__}: {exc}"[:500],
                              "details": {}}, "error"
        if status == "error":
            self.errors += 1
        rid = header.get("id") if isinstance(header.get("id"), str) else None
        action = P.action_of(header)
        try:
            self._router.send_multipart([client, *P.encode(P.reply_header(action, rid, status), result)])  # type: ignore[union-attr]
        except zmq.ZMQError:
            pass  # the client has gone
        if status == "ok" and action == "shutdown":
            self._stop.set()

    def _choose(self) -> Serving:
        """The serving process with the fewest clients (those it reported, and those sent since)."""
        ready = [c for c in self.children if c.ready and c.proc is not None and c.proc.poll() is None]
        if not ready:
            raise ProtocolViolation("ShuttingDown", "no serving process is running now (one is being started "
                                    "again); retry in a second")
        return min(ready, key=lambda c: (c.clients + c.given, self.children.index(c)))

    def _hello(self, content: dict[str, Any]) -> dict[str, Any]:
        from vkpool import __version__

        self._refresh_loads()
        child = self._choose()
        child.given += 1
        return {"server_version": __version__, "protocol_version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                "limits": {"max_message_bytes": self.settings.max_message_bytes,
                           "max_frames": self.settings.max_frames, "queue_limit": self.settings.queue_limit},
                "local_lane": None, "redirect": child.endpoint,
                "serving": [c.describe() for c in self.children]}

    def _gather(self, action: str, content: dict[str, Any] | None = None) -> list[tuple[Serving, dict[str, Any]]]:
        """The serving processes' answers, those that answered within FORWARD_S; the others are
        noted (:attr:`Serving.answered`) for ``status``."""
        answers = self._ask_all(action, content)
        for child, answer in answers:
            child.answered = isinstance(answer, dict)
        return [(c, a) for c, a in answers if isinstance(a, dict)]

    def _devices(self, content: dict[str, Any]) -> dict[str, Any]:
        return {"members": [m for _, a in self._gather("devices") for m in a["members"]]}

    def _list_models(self, content: dict[str, Any]) -> dict[str, Any]:
        answers = self._gather("list_models", {"samples": True})
        return {"models": merge_models([a["models"] for _, a in answers], bool(content.get("samples")))}

    def _status(self, content: dict[str, Any]) -> dict[str, Any]:
        answers = self._gather("status", {"samples": True})
        for child, answer in answers:
            child.noted_clients(answer)
        return merge_status([a for _, a in answers], time.monotonic() - self.started,
                            [c.describe() for c in self.children], bool(content.get("samples")))

    def _set_budget(self, content: dict[str, Any]) -> dict[str, Any]:
        member = content["member"]
        child = next((c for c in self.children if c.member == member), None)
        if child is None:
            raise ProtocolViolation("UnknownMember", f"no pool member {member!r}; members: "
                                    f"{', '.join(c.member for c in self.children)}", {"member": member})
        return _answer(self._ask(child, "set_budget", content))

    def _shutdown(self, content: dict[str, Any]) -> dict[str, Any]:
        in_flight = sum(a["counters"]["in_flight"] for _, a in self._gather("status"))
        return {"draining": True, "in_flight": in_flight}


def _answer(answer: dict[str, Any] | Exception) -> dict[str, Any]:
    if isinstance(answer, dict):
        return answer
    kind = getattr(answer, "type", None)
    if kind in P.ERROR_TYPES:
        raise ProtocolViolation(kind, getattr(answer, "message", str(answer)), getattr(answer, "details", None))
    raise ProtocolViolation("ShuttingDown", f"the serving process did not answer: {answer}")


def merge_models(lists: list[list[dict[str, Any]]], samples: bool = False) -> list[dict[str, Any]]:
    """One entry per model id over the serving processes' lists (asked with ``samples``): counts
    added, memory by member joined; a batching model's queue delay percentiles those of all its
    processes' queue delays together, which stay in the entry only with ``samples``."""
    merged: dict[str, dict[str, Any]] = {}
    for models in lists:
        for m in models:
            have = merged.get(m["id"])
            if have is None:
                merged[m["id"]] = {**m, "memory_by_member": dict(m["memory_by_member"]),
                                   "batching": dict(m["batching"]) if m.get("batching") else m.get("batching")}
                continue
            for key in ("refs", "queued", "running", "done"):
                if key in m:
                    have[key] = have.get(key, 0) + m[key]
            have["memory_by_member"].update(m["memory_by_member"])
            a, b = have.get("batching"), m.get("batching")
            if a and b:
                for key in ("batches", "requests", "rows", "padded_rows", "failed_batches", "where_read"):
                    if key in a or key in b:
                        a[key] = a.get(key, 0) + b.get(key, 0)
                a["mean_batch_size"] = a["requests"] / a["batches"] if a.get("batches") else 0.0
                a["queue_delays_us"] = [*a.get("queue_delays_us", ()), *b.get("queue_delays_us", ())]
    for m in merged.values():
        batching = m.get("batching")
        if batching:
            if "queue_delays_us" in batching:
                delays = batching["queue_delays_us"] if samples else batching.pop("queue_delays_us")
                batching["queue_delay_p50_us"], batching["queue_delay_p99_us"] = delay_percentiles_us(delays)
    return list(merged.values())


def merge_status(answers: list[dict[str, Any]], uptime_s: float, processes: list[dict[str, Any]],
                 samples: bool = False) -> dict[str, Any]:
    """The daemon's status from its serving processes' (asked with ``samples``): counters and
    jobs/s added, latency percentiles those of all the processes' latencies together (which stay
    in the reply only with ``samples``), members and models joined."""
    counters: dict[str, int] = {}
    for a in answers:
        for key, value in a["counters"].items():
            counters[key] = counters.get(key, 0) + value
    counters["connections"] = max(0, counters.get("connections", 0) - len(answers))  # the front's own
    latencies_ms = [v for a in answers for v in a.get("latency_samples_ms", ())]
    status = {"uptime_s": round(uptime_s, 3), "counters": counters,
              "jobs_per_s": round(sum(a["jobs_per_s"] for a in answers), 3),
              "latency_ms": latency_percentiles([v / 1e3 for v in latencies_ms]),
              "members": [m for a in answers for m in a["members"]],
              "models": merge_models([a["models"] for a in answers], samples),
              "loading": [entry for a in answers for entry in a.get("loading", [])],
              "queues": {k: v for a in answers for k, v in a.get("queues", {}).items()},
              "draining": any(a.get("draining") for a in answers), "processes": processes}
    if samples:
        status["latency_samples_ms"] = latencies_ms
    return status


def _close(client: Any) -> None:
    """Close one of the front's clients (None: nothing to close)."""
    if client is not None:
        try:
            client.close()
        except (zmq.ZMQError, OSError) as exc:
            log.debug("closing a client of a serving process: %s", exc)


def _die_with_front(front: int, config: str | None) -> None:
    """In a serving process: stop when the front (pid ``front``) dies, so that no serving process
    outlives its daemon; exit now when it has died already. A thread looks for a new parent every
    half second and sends this process SIGTERM (a drain for the clients it still has); a process
    still running ORPHAN_GRACE_S after its drain deadline exits at once."""
    if os.getppid() != front:
        raise SystemExit(f"the daemon's front (pid {front}) is gone")
    threading.Thread(target=_watch_front, args=(front, config), name="vkpool-front-watch", daemon=True).start()


def _watch_front(front: int, config: str | None) -> None:
    while os.getppid() == front:
        time.sleep(0.5)
    from vkpool.daemon.main import load_settings

    try:
        limit = load_settings(config)[1].drain_deadline + ORPHAN_GRACE_S
    except Exception:  # the process reports a bad configuration itself
        limit = DaemonSettings().drain_deadline + ORPHAN_GRACE_S
    log.warning("the daemon's front (pid %d) is gone: stopping", front)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(limit)
    log.error("still running %.0f s after the daemon's front went: exiting now", limit)
    _exit(1)


def _exit(status: int) -> None:
    """Leave a serving process at once: Python's exit functions (the pipeline cache) and the logs
    flushed, then no interpreter teardown (a driver's exit handlers can wait on threads that the
    teardown has stopped)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve_front(settings: DaemonSettings, endpoint: str, config: str | Path | None, cfg: Any,
                on_listening: Callable[[], None]) -> int:
    """Run the front until a shutdown; exit status."""
    from vkpool.daemon.server import stop_on_signals

    from vkpool.discovery import discover
    from vkpool.pool import resolve_members

    members = [member_id for member_id, *_ in resolve_members(cfg, discover())]
    metrics = None
    try:
        front = Front(settings, endpoint, None if config is None else str(config), members)
        if settings.metrics is not None:
            from vkpool.daemon.metrics import GatheredMetrics

            metrics = GatheredMetrics(front.metric_sources)
            try:
                metrics.serve(settings.metrics)
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", *settings.metrics, exc)
                return 1
        stop_on_signals(front.request_stop)
        front.start()
    except EndpointError as exc:
        log.error("%s", exc)
        return 1
    else:
        on_listening()
        return front.serve_forever()
    finally:
        if metrics is not None:
            metrics.close()


def main(argv: list[str] | None = None) -> int:
    """A serving process of one member, as the front starts it."""
    parser = argparse.ArgumentParser(prog="python -m vkpool.daemon.front",
                                     description="serve one pool member for a daemon with process_per_device")
    parser.add_argument("--member", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--front", type=int, required=True, help="the front's pid")
    parser.add_argument("--config")
    parser.add_argument("--metrics", action="store_true", help="serve metrics on a free local port for the front")
    args = parser.parse_args(argv)
    _die_with_front(args.front, args.config)
    from vkpool.daemon.main import serve

    return serve(args.config, args.endpoint, member=args.member, member_metrics=args.metrics)


if __name__ == "__main__":
    _exit(main())
