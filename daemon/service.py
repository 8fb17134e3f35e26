"""What each request does. The I/O thread calls :meth:`Service.handle`; slow work (loading,
planning, budgets) runs on one admin thread, inference on the scheduler's workers, and
control requests are answered right here so they never wait behind compute."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vkpool import progress
from vkpool.batching import BatchFailed
from vkpool.daemon import protocol as P
from vkpool.daemon.runtime import classify
from vkpool.daemon.protocol import ProtocolViolation
from vkpool.daemon.registry import ModelEntry, Registry, bound_id, check_regular, content_id
from vkpool.daemon.scheduler import Busy, Job, Scheduler
from vkpool.daemon.settings import DaemonSettings
from vkpool.daemon.stats import Stats
from vkpool.partition.algorithms import OBJECTIVES  # what a model's plan is made for; the first is the default
from vkpool.units import format_size

log = logging.getLogger("vkpool.daemon")

Reply = Callable[[bytes, str, str, str, "dict[str, Any] | bytes", list[Any]], None]  # content packed or not
_PLANS_MAX = 256  # remembered infer contents; the cache is emptied when it is full
_HELD_MAX = 64  # jobs of a model that does not batch that a reading thread runs after one pass


class StartedBatch:
    """A batch started on its model's run slot (:meth:`Service._start_batch`): :meth:`finish`
    waits for it, counts it and answers its requests."""

    __slots__ = ("_failed", "_pending", "_ran")

    def __init__(self, pending: Any, ran: Callable[[Any], Any], failed: BaseException | None = None) -> None:
        self._pending, self._ran, self._failed = pending, ran, failed

    def done(self) -> bool:
        """Whether its run has ended (finishing then does not wait)."""
        return self._pending is None or self._pending.done()

    def finish(self) -> Any:
        if self._pending is None:  # it failed to start
            return self._ran(self._failed)
        try:
            return self._pending.finish(lambda outputs, rows: self._ran((outputs, rows)))
        except BatchFailed as exc:
            return self._ran(exc.cause)


class Flight:
    """A batch of bound infers left running on the lanes' thread (:meth:`Service.run_bound`): the
    model's claim (its scheduler queue, its gate taken shared, the requests counted running) is
    held until :meth:`Service.land`."""

    __slots__ = ("batch", "failed", "gate", "jobs", "queue")

    def __init__(self, batch: StartedBatch, queue: Any, gate: Any, jobs: int,
                 failed: Callable[[BaseException], None]) -> None:
        self.batch, self.queue, self.gate, self.jobs, self.failed = batch, queue, gate, jobs, failed

    def done(self) -> bool:
        return self.batch.done()


class InferPlan:
    """An ``infer`` content checked against the model it names, once: its fields, its tensor
    descriptions, the model's inputs and outputs. A later request with the same content bytes
    (a client running one model on same-shaped inputs sends the same bytes each time) only has
    its frames checked (:meth:`feeds`)."""

    __slots__ = ("entry", "inputs", "metas", "outputs", "priority", "timeout")

    def __init__(self, entry: ModelEntry, feeds: dict[str, np.ndarray], content: dict[str, Any],
                 outputs: list[str] | None, timeout: float | None) -> None:
        self.entry = entry
        self.inputs = [(name, a.dtype, a.shape, a.nbytes) for name, a in feeds.items()]
        self.metas = content["inputs"]
        self.outputs = outputs
        self.priority = int(content.get("priority") or 0)
        self.timeout = timeout

    def feeds(self, frames: list[Any]) -> dict[str, np.ndarray]:
        """Read-only arrays over the frames; raises the same InvalidTensor as a first request would."""
        inputs = self.inputs
        if len(frames) == len(inputs):
            feeds = {}
            for (name, dtype, shape, nbytes), frame in zip(inputs, frames):
                buffer = frame if type(frame) is memoryview or type(frame) is bytes else P._buffer(frame)
                if len(buffer) != nbytes:
                    break
                feeds[name] = np.ndarray(shape, dtype, buffer)  # read-only over bytes, as frombuffer
            else:
                return feeds
        P.decode_tensors(self.metas, frames, "inputs")  # raises, naming the problem
        raise ProtocolViolation("InvalidTensor", "the frames do not match the tensor descriptions")


class Service:
    def __init__(self, runtime: Any, settings: DaemonSettings, reply: Reply, stats: Stats) -> None:
        self.runtime = runtime
        self.settings = settings
        self.reply = reply
        self.stats = stats
        self.registry = Registry()
        self.scheduler = Scheduler(queue_limit=settings.queue_limit, max_queued=settings.max_queued_jobs,
                                   workers_per_model=settings.workers_per_model, run_job=self._run_job,
                                   run_batch=self._run_batch)
        self._admin: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._admin_busy = 0
        self._admin_thread = threading.Thread(target=self._admin_loop, name="vkpool-admin", daemon=True)
        self._admin_thread.start()
        self.draining = False
        self._plans: dict[bytes, InferPlan] = {}
        self._held = threading.local()  # .models, per reading thread: batching models with jobs held in its pass
        self._replies = P.InferReplies()

    # -- dispatch -----------------------------------------------------------------------------
    def handle(self, client: bytes, header: dict[str, Any], content: dict[str, Any], frames: list[Any],
               connections: int = 0, inline: bool | None = None, raw_content: bytes | None = None) -> None:
        """Answer (now or later) one decoded request; raises ProtocolViolation for a bad one.
        ``inline``: whether a short job may run on the calling thread (None: ask
        :meth:`inline_allowed`). ``raw_content``: the packed content of an ``infer``, under which
        its checked plan is remembered (see :meth:`cached_plan`)."""
        action = P.action_of(header)
        assert action is not None
        rid = header["id"]
        if action == "infer":
            if self.draining:
                raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
            plan, feeds = self._plan_infer(client, content, frames, raw_content)
            self._infer(client, rid, plan, feeds, inline)
        elif action in ("hello", "devices", "list_models", "status", "cancel"):
            if frames:
                raise ProtocolViolation("InvalidRequest", f"{action}_request takes no raw frames, got {len(frames)}")
            result = getattr(self, f"_{action}")(client, content, connections)
            self.reply(client, rid, action, "ok", result, [])
        elif action == "shutdown":
            raise AssertionError("shutdown is handled by the server")
        else:
            if self.draining:
                raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
            if action != "load_model" and frames:
                raise ProtocolViolation("InvalidRequest", f"{action}_request takes no raw frames, got {len(frames)}")
            prepared = getattr(self, f"_prepare_{action}")(client, content, frames)
            self._submit_admin(client, rid, action, prepared)

    def _submit_admin(self, client: bytes, rid: str, action: str, work: Callable[[], dict[str, Any]]) -> None:
        def run() -> None:
            try:
                result = work()
            except Exception as exc:
                violation = classify(exc)
                if violation.type in ("EngineError", "InternalError"):
                    log.exception("%s failed", action)
                self.reply(client, rid, action, "error", _error(violation), [])
            else:
                self.reply(client, rid, action, "ok", result, [])
        self._admin.put(run)

    def _admin_loop(self) -> None:
        while (work := self._admin.get()) is not None:
            self._admin_busy += 1
            try:
                work()
            finally:
                self._admin_busy -= 1

    def admin_idle(self) -> bool:
        return self._admin.empty() and self._admin_busy == 0

    # -- control ------------------------------------------------------------------------------
    def _hello(self, client: bytes, content: dict[str, Any], connections: int) -> dict[str, Any]:
        import os

        from vkpool import __version__

        return {"server_version": __version__, "protocol_version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                "limits": {"max_message_bytes": self.settings.max_message_bytes,
                           "max_frames": self.settings.max_frames, "queue_limit": self.settings.queue_limit},
                "local_lane": None if self.draining else self.lane_offer(client)}

    def _devices(self, client: bytes, content: dict[str, Any], connections: int) -> dict[str, Any]:
        return {"members": self.runtime.members()}

    def model_infos(self, samples: bool = False) -> list[dict[str, Any]]:
        return [e.info(*self.scheduler.counts(e.id), samples=samples) for e in self.registry.all()]

    def _list_models(self, client: bytes, content: dict[str, Any], connections: int) -> dict[str, Any]:
        return {"models": self.model_infos(bool(content.get("samples")))}

    def _status(self, client: bytes, content: dict[str, Any], connections: int) -> dict[str, Any]:
        samples = bool(content.get("samples"))
        snap = self.stats.snapshot(connections, samples)
        counters = snap["counters"]  # as they stood before this request: it is not counted as in flight
        counters["accepted"] -= 1
        counters["in_flight"] -= 1
        return {**snap, "members": self.runtime.members(), "models": self.model_infos(samples),
                "loading": self.registry.loading_infos(), "queues": self.scheduler.depths(),
                "draining": self.draining}

    def _cancel(self, client: bytes, content: dict[str, Any], connections: int) -> dict[str, Any]:
        job = self.scheduler.find(client, content["request_id"])
        if job is None:
            return {"cancelled": False, "state": "unknown"}
        state = "queued" if job.state == "queued" else "running"
        self.scheduler.drop_queued(lambda j: j is job)
        cancelled = job.fail("Cancelled", f"request {job.request_id} was cancelled"
                             + (" (its result is discarded)" if state == "running" else ""))
        return {"cancelled": cancelled, "state": state if cancelled else "unknown"}

    # -- inference ----------------------------------------------------------------------------
    def _model_for(self, client: bytes, model_id: str) -> ModelEntry:
        entry = self.registry.get(model_id)
        if entry is None:
            raise ProtocolViolation("UnknownModel", f"no loaded model has id {model_id!r}", {"model": model_id})
        if not self.registry.holds(entry, client):
            raise ProtocolViolation("UnknownModel", f"model {model_id[:12]} is not loaded by this client; "
                                    "send load_model first", {"model": model_id})
        return entry

    def _plan_infer(self, client: bytes, content: dict[str, Any], frames: list[Any], raw_content: bytes | None
                    ) -> tuple[InferPlan, dict[str, np.ndarray]]:
        """Check an infer request in full; its plan (remembered under ``raw_content``) and feeds."""
        entry = self._model_for(client, content["model"])
        feeds = P.decode_tensors(content["inputs"], frames, "inputs")
        _check_feeds(entry, feeds)
        outputs = content.get("outputs")
        if outputs is not None:
            unknown = [o for o in outputs if o not in entry.output_names]
            if unknown or not all(isinstance(o, str) for o in outputs):
                # a wrong name, as a wrong input is: the client raises InvalidInput's kin
                raise ProtocolViolation("InvalidTensor", f"unknown output(s) {unknown}; the model has "
                                        f"{entry.output_names}", {"unknown": unknown})
        timeout = content.get("timeout")
        if timeout is None:
            timeout = self.settings.job_timeout
        elif timeout <= 0:
            raise ProtocolViolation("InvalidRequest", f"timeout must be positive, got {timeout}")
        plan = InferPlan(entry, feeds, content, outputs, timeout)
        if raw_content is not None:
            if len(self._plans) >= _PLANS_MAX:
                self._plans.clear()
            self._plans[raw_content] = plan
        return plan, feeds

    def cached_plan(self, raw_content: bytes, client: bytes) -> InferPlan | None:
        """The plan of an infer content seen before, when its model is still loaded and held by
        ``client``; None otherwise (the request then takes the full path, errors included)."""
        plan = self._plans.get(raw_content)
        if plan is not None and self.registry.current(plan.entry, client):
            return plan
        return None

    def infer_planned(self, client: bytes, rid: str, plan: InferPlan, frames: list[Any], inline: bool | None) -> None:
        """:meth:`handle` for an infer whose content has a cached plan."""
        if self.draining:
            raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
        self._infer(client, rid, plan, plan.feeds(frames), inline)

    def _infer(self, client: bytes, rid: str, plan: InferPlan, feeds: dict[str, np.ndarray],
               inline: bool | None, accepted: float | None = None) -> None:
        if accepted is None:
            accepted = time.monotonic()
        entry, outputs = plan.entry, plan.outputs
        deadline = None if plan.timeout is None else accepted + plan.timeout
        run_s = entry.run_s
        rows = 1
        if entry.batching is not None:  # queued, so that requests arriving together run together
            try:
                feeds, rows = entry.batching.check(feeds, outputs)
            except ValueError as exc:
                raise ProtocolViolation("InvalidTensor", str(exc)) from None
        elif (run_s is not None and run_s <= self.settings.inline_run_max
                and (self.inline_allowed() if inline is None else inline)
                and self._run_inline(client, rid, entry, outputs, feeds, accepted, deadline)):
            return
        job = Job(client=client, request_id=rid, model_id=entry.id, feeds=feeds, outputs=outputs,
                  priority=plan.priority, finish_cb=self._job_finished,
                  deadline=deadline, accepted_at=accepted, rows=rows)
        # a quick model, read by a thread that calls run_held after each pass over what it read
        # (the I/O thread, the lanes'): its jobs run there once the pass is read (a batching
        # model's as batches), not on its workers, unless the caller asked for them to be queued
        mine = getattr(self._held, "models", None) if inline is not False else None
        held = mine is not None and run_s is not None and run_s <= self.settings.inline_run_max
        try:
            self.scheduler.submit(job, wake=not held)
        except Busy as exc:
            self.stats.count("busy")
            raise ProtocolViolation("Busy", str(exc), {"model": entry.id}) from None
        if held:
            mine[entry.id] = entry
        self.watch(job)

    def holds(self) -> bool:
        """Whether this thread's last pass held batches for :meth:`run_held`."""
        return bool(getattr(self._held, "models", None))

    def run_held(self) -> None:
        """The batches of the jobs this thread held in its last pass (:meth:`_infer`), run here
        when their model can take them now; what it cannot goes to the model's workers. So
        requests read together run together, and none crosses a thread on its way: the thread
        that read them (the I/O thread, or the lanes') runs their batch and writes the replies.
        A thread that calls this after each pass over what it read has its batches held from
        its next pass on; other threads never do."""
        held = getattr(self._held, "models", None)
        if not held:
            if held is None:  # this thread reads in passes: its next ones hold batches
                self._held.models = {}
            return
        self._held.models = {}
        for entry in held.values():
            if entry.batching is None:  # one after another, each as a worker would run it
                jobs = self.scheduler.take_idle(entry.id, _HELD_MAX, entry.gate)
                if jobs is not None:
                    try:
                        self.scheduler.run_taken(jobs, lambda taken, entry=entry: [self._run_job(job, entry)
                                                                                   for job in taken])
                    finally:
                        entry.gate.release_shared()
                continue
            jobs = self.scheduler.take_now(entry.id, entry.gate)  # the rest to the workers meanwhile
            if jobs is not None:
                self.scheduler.run_taken(jobs, lambda taken, entry=entry: self._run_gathered(entry, taken, True))

    # -- bound infers (vkpool.daemon.bound) ---------------------------------------------------
    def check_bound(self, client: bytes, content: dict[str, Any], frames: list[Any]
                    ) -> tuple[InferPlan, dict[str, np.ndarray], int]:
        """A ``bind_infer`` checked as the same ``infer`` would be: its plan, the feeds it carried
        and their rows (1 unless the model batches)."""
        if self.draining:
            raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
        plan, feeds = self._plan_infer(client, content, frames, None)
        rows = 1
        if plan.entry.batching is not None:
            try:
                feeds, rows = plan.entry.batching.check(feeds, plan.outputs)
            except ValueError as exc:
                raise ProtocolViolation("InvalidTensor", str(exc)) from None
        return plan, feeds, rows

    def claim_where_read(self, entry: ModelEntry, jobs: int, beside: int = 0) -> Any:
        """The claim (:meth:`Scheduler.claim_idle`) for ``jobs`` bound infers of ``entry`` that the
        reading thread runs itself (beside ``beside`` of its own claimed before); None when they go
        to the model's queue instead: the model is busy, being re-planned, not yet timed or slower
        than ``inline_run_max``, or the daemon drains. Pair with :meth:`Scheduler.release_claim`."""
        if self.draining or not self.runs_where_read(entry):
            return None
        return self.scheduler.claim_idle(entry.id, entry.gate, jobs, beside)

    def run_one(self, entry: ModelEntry, outputs: list[str] | None, feeds: dict[str, np.ndarray], accepted: float
                ) -> tuple[Any, float, float]:
        """One request run with ``Session.run`` on the calling thread, which holds the model's claim,
        counted: its outputs or the error to answer, its queue delay (since ``accepted``) and run
        time. For a session without a plan's executor, nothing is kept in flight beside it, and
        ``Session.run_many``'s machinery for one request cost more than the run's own host time (13
        µs against 49 for add_chain_1 on lavapipe)."""
        started = time.monotonic()
        try:
            result: Any = entry.session.run(outputs, feeds)
        except Exception as exc:  # answered as run_many would: the request's own error
            result = exc
        finished = time.monotonic()
        queued = started - accepted
        return self._ran(entry, result, started, finished, queued), queued, finished - started

    def run_bound(self, entry: ModelEntry, items: list[Any], accepted: list[float],
                  answer_batch: Callable[..., None], fallback: Callable[[int], None],
                  failed: Callable[[BaseException], None] | None = None, flight: Flight | None = None
                  ) -> Flight | None:
        """The bound infers of one batching model that the lanes' thread runs now (``items``, each
        with ``plan``, ``feeds`` and ``rows``, accepted at ``accepted``, ``time.monotonic()``
        values), as batches of their rows on this thread when the model is idle and quick.
        ``answer_batch(at, count, results, started, finished)`` answers ``items[at:at + count]``,
        run as one batch (``results``: each request's outputs, views of the batch's valid only
        during the call (:meth:`BatchRunner.views`), or the batch's ProtocolViolation);
        ``fallback(k)`` has ``items[k]`` queued as a job instead (:meth:`queue_bound`), when the
        model is busy, being re-planned, not yet timed or slower than ``inline_run_max``.

        The model's last batch is left running: returned as a :class:`Flight` that the
        caller lands (:meth:`land`) once it has ended, working meanwhile (reading the next
        requests), or gives back here as ``flight`` with the model's next requests. Their first
        batch then starts behind it on the device, in a run slot of its own, before it is landed,
        so that the device runs one batch while this thread writes the next one's rows and
        answers the last one's requests. ``failed(exc)`` answers the requests of the returned
        flight that landing it left unanswered (what ``answer_batch`` raised)."""
        queue = self.claim_where_read(entry, len(items), 0 if flight is None else flight.jobs)
        if queue is None and flight is not None:  # a re-plan waits, or jobs were queued: land first
            self.land(flight)
            flight = None
            queue = self.claim_where_read(entry, len(items))
        if queue is None:
            for k in range(len(items)):
                fallback(k)
            return None
        kept = None
        try:
            runner = entry.batching  # read under the gate: a re-plan swaps the session
            if runner is None:  # re-planned without batching meanwhile: each request as a job
                for k in range(len(items)):
                    fallback(k)
                return None
            at = 0
            counts = runner.batches([item.rows for item in items])
            for i, count in enumerate(counts):
                runner.stats.where_read += 1
                group = items[at:at + count]

                def answer_group(batch: Any, started: float, finished: float, at: int = at, count: int = count,
                                 group: list[Any] = group) -> None:
                    if not isinstance(batch, ProtocolViolation):
                        batch = runner.views(*batch, [item.plan.outputs for item in group])
                    answer_batch(at, count, batch, started, finished)

                feeds, waited = [i.feeds for i in group], accepted[at:at + count]
                batch = self._start_batch(entry, runner, feeds, waited, None, answer_group, block=flight is None)
                if batch is None:  # the batch in flight holds the variant's only free slot
                    assert flight is not None
                    self.land(flight)
                    flight = None
                    batch = self._start_batch(entry, runner, feeds, waited, None, answer_group)
                    assert batch is not None
                if flight is not None:  # the batch before: answered while this one runs
                    self.land(flight)
                    flight = None
                if i == len(counts) - 1 and failed is not None:
                    kept = Flight(batch, queue, entry.gate, len(items), failed)
                else:
                    batch.finish()
                at += count
        finally:
            if flight is not None:
                self.land(flight)
            if kept is None:
                self.scheduler.release_claim(queue, entry.gate, len(items))
        return kept

    def land(self, flight: Flight) -> None:
        """A batch left running by :meth:`run_bound`: waited for, its requests answered, and the
        model's claim given back. What answering it raises is passed to its ``failed``."""
        try:
            flight.batch.finish()
        except Exception as exc:  # never a request without its reply
            flight.failed(exc)
        finally:
            self.scheduler.release_claim(flight.queue, flight.gate, flight.jobs)

    def run_many(self, entry: ModelEntry, items: list[Any], accepted: list[float], answer: Callable[..., None]
                 ) -> None:
        """Bound infers of a model that does not batch (``items``, each with ``plan`` and ``feeds``,
        accepted at ``accepted``), run on the calling thread, which holds the model's claim: the
        requests of each output list go to ``Session.run_many`` together, so a plan over several
        members or replicas works on them at once, and each is answered as it ends with
        ``answer(k, outputs or ProtocolViolation, queued_s, run_s)``; a lone request of an output
        list on a session without a plan's executor runs with :meth:`run_one`."""
        by_outputs: dict[Any, list[int]] = {}
        for k, item in enumerate(items):
            outputs = item.plan.outputs
            by_outputs.setdefault(None if outputs is None else tuple(outputs), []).append(k)
        for outputs, ks in by_outputs.items():
            session, names = entry.session, None if outputs is None else list(outputs)
            if len(ks) == 1 and session.executor is None:
                answer(ks[0], *self.run_one(entry, names, items[ks[0]].feeds, accepted[ks[0]]))
                continue
            started = last = time.monotonic()

            def each(i: int, result: Any, ks: list[int] = ks, started: float = started) -> None:
                nonlocal last
                finished = time.monotonic()
                k = ks[i]
                results = self._ran(entry, result, last, finished, started - accepted[k])
                last = finished
                answer(k, results, started - accepted[k], finished - started)

            session.run_many((items[k].feeds for k in ks), names, each)

    def queue_bound(self, client: bytes, rid: str, plan: InferPlan, feeds: dict[str, np.ndarray],
                    accepted: float, inline: bool | None = False) -> None:
        """A bound infer that does not run where it was read: queued as a job, answered by id. Its
        queue delay and timeout count from ``accepted`` (``time.monotonic()``), when it was read.
        ``inline``: as :meth:`_infer`'s (None: a batching model's job is held for :meth:`run_held`
        by a thread that reads in passes)."""
        if self.draining:
            raise ProtocolViolation("ShuttingDown", "the daemon is shutting down and accepts no new work")
        self._infer(client, rid, plan, feeds, inline, accepted)

    def runs_where_read(self, entry: ModelEntry) -> bool:
        """Whether bound infers of ``entry`` may run on the lanes' thread (:meth:`run_bound`) as far
        as its speed goes: timed, and quicker than ``inline_run_max``."""
        run_s = entry.run_s
        return run_s is not None and run_s <= self.settings.inline_run_max

    def watch(self, job: Job) -> None:
        """Overridden by the server to track deadlines."""

    def inline_allowed(self) -> bool:
        """Overridden by the server: True when nothing else waits for the I/O thread."""
        return False

    def lane_offer(self, client: bytes) -> dict[str, Any] | None:
        """Overridden by the server: ``hello``'s ``local_lane`` for this client."""
        return None

    def _run_inline(self, client: bytes, rid: str, entry: ModelEntry, outputs: list[str] | None,
                    feeds: dict[str, np.ndarray], accepted: float, deadline: float | None) -> bool:
        """Run a short job on the calling thread (the I/O thread, or a lane's) when its model is
        idle: no queue, no thread hop. False when it must be queued instead (the model is busy or
        being re-planned)."""
        queue = self.scheduler.claim_idle(entry.id, entry.gate)
        if queue is None:
            return False
        try:
            status, content, frames, finished = self._execute(entry, outputs, feeds, 0.0, time.monotonic())
        finally:
            self.scheduler.release_claim(queue, gate=entry.gate)
        if deadline is not None and finished > deadline:
            status, content, frames = "error", _timeout(deadline - accepted), []
        if status == "ok":
            self.stats.infer_done(finished - accepted, finished)
        self.reply(client, rid, "infer", status, content, frames)
        return True

    def _execute(self, entry: ModelEntry, outputs: list[str] | None, feeds: dict[str, np.ndarray],
                 queued_s: float, started: float) -> tuple[str, dict[str, Any] | bytes, list[Any], float]:
        """Run a job on its model (the caller holds the model's gate): status, content (packed
        already when ok), frames, and the ``time.monotonic()`` at which the run ended (``started``:
        the one read just before the call; the two are the only clock reads of a run)."""
        results, finished = self._timed_run(entry, outputs, feeds, queued_s, started)
        if isinstance(results, ProtocolViolation):
            return "error", _error(results), [], finished
        try:
            content, frames = self._replies.pack(entry.output_names if outputs is None else outputs, results,
                                                 queued_s, finished - started)
        except Exception as exc:
            return "error", _error(classify(exc)), [], finished
        return "ok", content, frames, finished

    def _timed_run(self, entry: ModelEntry, outputs: list[str] | None, feeds: dict[str, np.ndarray],
                   queued_s: float, started: float) -> tuple[list[np.ndarray] | ProtocolViolation, float]:
        """One run of a job on its model (the caller holds the model's gate), counted and timed:
        its outputs or the error to answer, and the ``time.monotonic()`` at which it ended."""
        try:
            results = entry.session.run(outputs, feeds)  # None: all, as the in-process session is asked
        except Exception as exc:
            results = exc
        finished = time.monotonic()
        return self._ran(entry, results, started, finished, queued_s), finished

    def _ran(self, entry: ModelEntry, results: Any, started: float, finished: float, *queued_s: float
             ) -> Any:
        """A run of ``entry`` from ``started`` to ``finished``, of one request or a batch of them
        (each queued for one of ``queued_s``), that gave ``results`` (its outputs, or the
        exception it raised) counted: the outputs, or the error to answer."""
        entry.last_used = finished
        run_s = finished - started
        if isinstance(results, BaseException):
            violation = classify(results)
            log.warning("%s on %s failed: %s", "job" if len(queued_s) == 1 else f"a batch of {len(queued_s)} jobs",
                        entry.id[:12], violation.message)
            self.stats.ran(entry, violation.type, run_s, *queued_s)
            return violation
        entry.run_s = run_s if entry.run_s is None else 0.8 * entry.run_s + 0.2 * run_s
        self.stats.ran(entry, "ok", run_s, *queued_s)
        return results

    def _timed_batch(self, entry: ModelEntry, runner: Any, feeds: list[dict[str, np.ndarray]], accepted: list[float],
                     taken: list[float | None] | None, answer: Callable[[Any, float, float], Any]) -> Any:
        """One batch of checked requests' feeds on a batching model (the caller holds the model's
        gate, under which it read ``runner``, its :class:`BatchRunner`), counted and timed;
        returns ``answer(batch, started, finished)``, called once:
        ``batch`` is the batch's outputs by name and the requests' rows
        (:meth:`BatchRunner.run_whole`; the outputs valid only during the call) or the batch's
        error, ``started`` and ``finished`` when the batch started and ended. A request's queue
        delay runs from its ``accepted`` to its ``taken`` (when the scheduler took it; None, or no
        list: the batch's start), ``time.monotonic()`` values."""
        batch = self._start_batch(entry, runner, feeds, accepted, taken, answer)
        assert batch is not None
        return batch.finish()

    def _start_batch(self, entry: ModelEntry, runner: Any, feeds: list[dict[str, np.ndarray]],
                     accepted: list[float], taken: list[float | None] | None,
                     answer: Callable[[Any, float, float], Any], block: bool = True) -> StartedBatch | None:
        """:meth:`_timed_batch` in two halves: the batch started (:meth:`BatchRunner.start_whole`),
        and its :meth:`StartedBatch.finish`, which waits for it and answers. ``block`` False: None
        when the variant has no free run slot."""
        started = time.monotonic()

        def ran(results: Any) -> Any:
            finished = time.monotonic()
            queued = ([started - a for a in accepted] if taken is None else
                      [(started if t is None else t) - a for a, t in zip(accepted, taken)])
            results = self._ran(entry, results, started, finished, *queued)
            if not isinstance(results, ProtocolViolation):
                runner.stats.record_delays(queued)
            return answer(results, started, finished)

        try:
            pending = runner.start_whole(feeds, block)
        except BatchFailed as exc:
            return StartedBatch(None, ran, exc.cause)
        return None if pending is None else StartedBatch(pending, ran)

    def _run_job(self, job: Job, held: ModelEntry | None = None) -> None:
        """Run a job a worker took (or a reading thread, :meth:`run_held`: ``held`` is then its
        model, whose gate that thread holds shared), and answer it."""
        entry = held or self.registry.get(job.model_id)
        if entry is None:
            job.fail("UnknownModel", f"model {job.model_id[:12]} was unloaded")
            return
        if held is None:
            entry.gate.acquire_shared()
        try:
            feeds = job.feeds  # taken before the state is read: answering the job empties them
            if job.state == "done":  # timed out or cancelled while waiting for a re-plan
                return
            started = time.monotonic()
            queued = (job.started_at or started) - job.accepted_at
            status, content, frames, _ = self._execute(entry, job.outputs, feeds, queued, started)
        finally:
            if held is None:
                entry.gate.release_shared()
        self.scheduler.settle(job)
        if job.finish(status, content, frames) and status == "ok":
            self.stats.infer_done(time.monotonic() - job.accepted_at)

    def _run_batch(self, jobs: list[Job]) -> None:
        """Run jobs of a batching model as one batch (the scheduler gathered them); each gets its
        own rows back, or the batch's error."""
        entry = self.registry.get(jobs[0].model_id)
        if entry is None:
            for job in jobs:
                job.fail("UnknownModel", f"model {job.model_id[:12]} was unloaded")
            return
        entry.gate.acquire_shared()
        self._run_gathered(entry, jobs)

    def _run_gathered(self, entry: ModelEntry, jobs: list[Job], where_read: bool = False) -> None:
        """:meth:`_run_batch` once the caller holds the model's gate shared (released here);
        ``where_read``: on the thread that read the requests (counted in the batch stats)."""
        try:
            runner = entry.batching  # read under the gate: a re-plan swaps the session
            runner.stats.where_read += where_read
            # feeds taken before the state is read (answering a job empties them); jobs timed out
            # while waiting for a re-plan left out
            taken = [(job, job.feeds) for job in jobs]
            taken = [(job, feeds) for job, feeds in taken if job.state != "done"]
            jobs = [job for job, _ in taken]
            if not jobs:
                return
            # a job's queue delay ends when the scheduler took it (started_at), not when its batch starts
            def split(batch: Any, started: float, finished: float) -> tuple[Any, float, float]:
                if isinstance(batch, ProtocolViolation):
                    return batch, started, finished
                return runner.split(*batch, [job.outputs for job in jobs]), started, finished

            results, started, finished = self._timed_batch(
                entry, runner, [feeds for _, feeds in taken], [job.accepted_at for job in jobs],
                [job.started_at for job in jobs], split)
        finally:
            entry.gate.release_shared()
        runner.answered([job.client for job in jobs])
        if isinstance(results, ProtocolViolation):
            for job in jobs:
                self.scheduler.settle(job)
                job.finish("error", _error(results))
            return
        for job, result in zip(jobs, results):
            queued = (job.started_at or started) - job.accepted_at
            content, frames = self._replies.pack(entry.output_names if job.outputs is None else job.outputs,
                                                 result, queued, finished - started)
            job.feeds = {}  # the request's frames are not needed any more
            self.scheduler.settle(job)
            if job.finish("ok", content, frames):
                self.stats.infer_done(finished - job.accepted_at)

    def _job_finished(self, job: Job, status: str, content: dict[str, Any], frames: list[Any]) -> None:
        self.scheduler.forget(job)
        self.reply(job.client, job.request_id, "infer", status, content, frames)

    # -- models -------------------------------------------------------------------------------
    def _prepare_load_model(self, client: bytes, content: dict[str, Any], frames: list[Any]) -> Callable[[], dict]:
        path = content.get("path")
        if (path is None) == (len(frames) != 1) or (path is not None and frames):
            raise ProtocolViolation("InvalidRequest", "load_model needs either `path` or exactly one raw "
                                    f"frame with the model bytes (got path={path!r} and {len(frames)} frame(s))")
        source: Path | bytes = Path(path).expanduser() if path is not None else bytes(P._buffer(frames[0]))
        if isinstance(source, Path):
            if not source.is_absolute():
                raise ProtocolViolation("InvalidRequest", f"path {path!r} must be absolute (the daemon's "
                                        "working directory is not the client's)", {"path": path})
            try:  # here, on the I/O thread: a FIFO or a device never reaches the admin thread
                check_regular(source, self.settings.max_model_bytes)
            except OSError as exc:
                raise classify(exc) from None
        keep_alive = content.get("keep_alive")
        name = content.get("name") or (source.name if isinstance(source, Path) else "model")
        binding = _binding(content.get("batch"), content.get("dims"))
        asked = _batching(content.get("max_batch"), content.get("max_queue_delay"))
        objective = content.get("objective")
        if objective not in (None, *OBJECTIVES):
            raise ProtocolViolation("InvalidRequest", f"objective must be one of {', '.join(OBJECTIVES)}, got "
                                    f"{objective!r}", {"objective": objective})
        if asked and binding.get("batch"):
            raise ProtocolViolation("InvalidRequest", "batch fixes the batch dimension and max_batch batches "
                                    "requests along it: give one of them", {"batch": binding["batch"]})
        return lambda: self._load(client, source, str(name), keep_alive, binding, asked, objective)

    def _load(self, client: bytes, source: Path | bytes, name: str, keep_alive: float | None,
              binding: dict[str, Any] | None = None, batching: dict[str, Any] | None = None,
              objective: str | None = None) -> dict[str, Any]:
        binding = binding or {}
        with self.registry.loading(name, source) as loading, progress.reporting(loading.report):
            model_id = bound_id(content_id(source, self.settings.max_model_bytes), binding)
            entry = self.registry.get(model_id)
            shared = entry is not None
            if entry is not None and batching and batching != entry.batch_config:
                raise ProtocolViolation(
                    "InvalidRequest", f"model {entry.name} ({model_id[:12]}) is loaded already with batching "
                    f"{entry.batch_config or 'off'}; clients that open a model share its batching: load it "
                    "without max_batch/max_queue_delay, or unload it first", {"batching": entry.batch_config})
            if entry is not None and objective and objective != entry.objective:
                raise ProtocolViolation(
                    "InvalidRequest", f"model {entry.name} ({model_id[:12]}) is loaded already with objective "
                    f"{entry.objective}; clients that open a model share its plan: load it without objective, "
                    "or unload it first", {"objective": entry.objective})
            if entry is None:
                if not batching and not binding:
                    batching = self.settings.batching_for(name)
                objective = objective or OBJECTIVES[0]
                session = self._open_admitted(source, binding, batching or {}, objective)
                entry = ModelEntry(id=model_id, name=name, source=source, session=session, binding=binding,
                                   keep_alive=self.settings.keep_alive if keep_alive is None else keep_alive,
                                   batch_config=batching or {}, objective=objective)
                self.registry.add(entry)
                self.scheduler.add_model(model_id, batching=entry.batching)
                log.info("loaded %s (%s) on %s", name, model_id[:12], entry.memory)
        self.registry.take_ref(entry, client, keep_alive)
        return {"model": entry.info(*self.scheduler.counts(entry.id)), "shared": shared}

    def open_session(self, source: Path | bytes, binding: dict[str, Any], batching: dict[str, Any],
                     objective: str = "latency") -> Any:
        if isinstance(source, Path):  # read again at a re-plan: it may have been replaced since
            check_regular(source, self.settings.max_model_bytes)
        return self.runtime.open(source, binding, batching, objective, self.settings.run_slots)

    def _open_admitted(self, source: Path | bytes, binding: dict[str, Any], batching: dict[str, Any],
                       objective: str) -> Any:
        """Open a session; when it does not fit and eviction is on, free idle models first."""
        while True:
            try:
                return self.open_session(source, binding, batching, objective)
            except Exception as exc:
                violation = classify(exc)
                if violation.type != "InsufficientMemory":
                    raise violation from None
                idle = sorted((e for e in self.registry.unreferenced() if not self.scheduler.active(e.id)),
                              key=lambda e: e.last_used)
                if not self.settings.evict_idle or not idle:
                    free = {m["id"]: m["budget_bytes"] - m["used_bytes"] for m in self.runtime.members()}
                    size = len(source) if isinstance(source, bytes) else source.stat().st_size
                    raise ProtocolViolation("InsufficientMemory", (
                        f"the model ({format_size(size)} of ONNX) does not fit the free budgets "
                        f"({', '.join(f'{m} {format_size(n)}' for m, n in free.items())}): {violation.message}"),
                        {**violation.details, "model_bytes": size, "free_bytes": free,
                         "idle_models": [e.id for e in idle]}) from None
                log.info("evicting idle model %s to admit a load", idle[0].id[:12])
                self._free(idle[0])

    def _prepare_unload_model(self, client: bytes, content: dict[str, Any], frames: list[Any]) -> Callable[[], dict]:
        now = bool(content.get("now"))
        entry = self.registry.get(content["model"]) if now else None
        if entry is None:
            entry = self._model_for(client, content["model"])

        def unload() -> dict[str, Any]:
            self.registry.drop_ref(entry, client)
            if now and not entry.refs:
                entry.keep_alive = 0
            unloaded = False
            if not entry.refs and entry.keep_alive == 0 and not self.scheduler.active(entry.id):
                self._free(entry)
                unloaded = True
            return {"model": entry.id, "refs": sum(entry.refs.values()), "unloaded": unloaded}
        return unload

    def _free(self, entry: ModelEntry) -> None:
        """Free a model (admin thread only)."""
        if self.registry.remove(entry.id) is None:
            return
        self.scheduler.remove_model(entry.id)
        entry.session.close()
        log.info("unloaded %s (%s)", entry.name, entry.id[:12])

    def expire_idle(self) -> None:
        """Queue the freeing of unreferenced models idle for longer than their keep-alive."""
        now = time.monotonic()
        for entry in self.registry.unreferenced():
            if 0 <= entry.keep_alive <= now - entry.last_used and not self.scheduler.active(entry.id):
                def free(entry: ModelEntry = entry) -> None:
                    if not entry.refs and not self.scheduler.active(entry.id):
                        self._free(entry)
                entry.last_used = float("inf")  # queued once; _free runs on the admin thread
                self._admin.put(free)

    def client_gone(self, client: bytes) -> list[Job]:
        """Release everything a departed client held; its queued jobs, to be answered by the caller."""
        self.registry.drop_client(client)
        return self.scheduler.drop_queued(lambda j: j.client == client)

    # -- plans and budgets ----------------------------------------------------------------------
    def _prepare_plan(self, client: bytes, content: dict[str, Any], frames: list[Any]) -> Callable[[], dict]:
        entry = self._model_for(client, content["model"])
        budgets = _parse_budgets(content.get("budgets"), self.runtime)

        def plan() -> dict[str, Any]:
            entry.gate.acquire_shared()
            try:
                # as `vkpool plan` renders the same placement
                the_plan = self.runtime.what_if(entry.session, budgets)
            finally:
                entry.gate.release_shared()
            as_json = the_plan.to_json()
            return {"text": the_plan.to_text(), "plan": json.loads(as_json) if isinstance(as_json, str) else as_json}
        return plan

    def _prepare_set_budget(self, client: bytes, content: dict[str, Any], frames: list[Any]) -> Callable[[], dict]:
        member = content["member"]
        nbytes = _parse_budgets({member: content["size"]}, self.runtime)[member]
        from vkpool.daemon.budgets import change_budget

        return lambda: change_budget(self, member, nbytes)

    def close(self) -> None:
        self._admin.put(None)
        self._admin_thread.join()
        for entry in self.registry.all():
            self._free(entry)


def _error(v: ProtocolViolation) -> dict[str, Any]:
    return {"type": v.type, "message": v.message, "details": v.details}


def _timeout(seconds: float) -> dict[str, Any]:
    """The error content of a job that ran inline past its timeout."""
    return {"type": "Timeout", "message": f"job did not finish within its timeout ({seconds:.3g} s)",
            "details": {"state": "running"}}


def _in_time(plan: InferPlan, results: Any, accepted: float, finished: float) -> Any:
    """``results``, or the Timeout (:func:`_timeout`) of a job that ran past its plan's timeout."""
    if plan.timeout is not None and finished - accepted > plan.timeout and not isinstance(results, ProtocolViolation):
        error = _timeout(plan.timeout)
        return ProtocolViolation(error["type"], error["message"], error["details"])
    return results


def _check_feeds(entry: ModelEntry, feeds: dict[str, np.ndarray]) -> None:
    expected = entry.input_specs
    if feeds.keys() != expected.keys():
        missing = sorted(set(expected) - set(feeds))
        unknown = sorted(set(feeds) - set(expected))
        raise ProtocolViolation("InvalidTensor", f"inputs do not match the model: missing {missing}, "
                                f"unknown {unknown}", {"missing": missing, "unknown": unknown,
                                                       "expected": sorted(expected)})
    for name, array in feeds.items():
        spec = expected[name]
        if array.dtype != entry.input_dtypes[name]:
            raise ProtocolViolation("InvalidTensor", f"input {name!r} must be {spec['dtype']}, got "
                                    f"{array.dtype.name}", {"tensor": name, "expected": spec["dtype"],
                                                            "got": array.dtype.name})
        shape = spec["shape"]
        if len(shape) != array.ndim or any(isinstance(d, int) and d != n for d, n in zip(shape, array.shape)):
            raise ProtocolViolation("InvalidTensor", f"input {name!r} must have shape {shape}, got "
                                    f"{list(array.shape)}", {"tensor": name, "expected": shape,
                                                             "got": list(array.shape)})


def _binding(batch: Any, dims: Any) -> dict[str, Any]:
    """``{batch, dims}`` of a load request, validated; the defaults (batch 1, no dims) are left out
    so that a model loaded with and without them is the same entry."""
    binding: dict[str, Any] = {}
    if batch is not None:
        if batch < 1:
            raise ProtocolViolation("InvalidRequest", f"batch must be at least 1, got {batch}", {"batch": batch})
        if batch != 1:
            binding["batch"] = batch
    if dims:
        bad = {k: v for k, v in dims.items()
               if not isinstance(k, str) or not k or type(v) is not int or v < 1}
        if bad:
            raise ProtocolViolation("InvalidRequest", f"dims must map dim names to positive ints, got {bad!r}"[:300],
                                    {"dims": repr(bad)[:200]})
        binding["dims"] = dict(sorted(dims.items()))
    return binding


def _batching(max_batch: Any, max_queue_delay: Any) -> dict[str, Any]:
    """``{max_batch, max_queue_delay}`` of a load request, validated; empty when it asks for none."""
    if max_batch is None:
        if max_queue_delay is not None:
            raise ProtocolViolation("InvalidRequest", "max_queue_delay needs max_batch", {})
        return {}
    if type(max_batch) is not int or not 1 <= max_batch <= 4096:
        raise ProtocolViolation("InvalidRequest", f"max_batch must be an integer from 1 to 4096, got {max_batch!r}",
                                {"max_batch": repr(max_batch)[:50]})
    delay = 0.0 if max_queue_delay is None else max_queue_delay
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 10:
        raise ProtocolViolation("InvalidRequest", "max_queue_delay must be a number of seconds from 0 to 10, "
                                f"got {max_queue_delay!r}", {"max_queue_delay": repr(max_queue_delay)[:50]})
    return {"max_batch": max_batch, "max_queue_delay": float(delay)}


def _parse_budgets(raw: dict[str, Any] | None, runtime: Any) -> dict[str, int]:
    from vkpool.units import parse_size

    out: dict[str, int] = {}
    for member, size in (raw or {}).items():
        if not runtime.has_member(member):
            raise ProtocolViolation("UnknownMember", f"no pool member {member!r}",
                                    {"member": member, "members": [m["id"] for m in runtime.members()]})
        try:
            if isinstance(size, bool) or not isinstance(size, (int, str)):
                raise ValueError(f"{size!r} is not a size")
            out[member] = parse_size(size)
        except ValueError as exc:
            raise ProtocolViolation("InvalidRequest", f"budget for {member}: {exc}",
                                    {"member": member}) from None
    return out
