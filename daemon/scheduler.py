"""Per-model job queues, fair across clients, bounded, with timeouts and cancellation.

Each loaded model has a :class:`ModelQueue` and a few worker threads. A queue keeps one
priority heap per client and serves clients round-robin, so a client that floods a model
with jobs delays only its own jobs. Queues are bounded (per model and in total): a job
that does not fit is refused with ``Busy`` instead of growing memory.

The runtime's ``run`` releases the GIL inside its C calls, so while workers wait on devices
the I/O thread keeps receiving, decoding and replying.

A job is finished exactly once (:meth:`Job.finish`): by its worker, by a timeout, by a
cancel, by its client leaving or by shutdown, whichever comes first; later attempts are
ignored, so every accepted job gets one reply.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

log = logging.getLogger("vkpool.daemon")

_sequence = itertools.count()


@dataclass(eq=False)
class Job:
    client: bytes
    request_id: str
    model_id: str
    feeds: dict[str, np.ndarray]
    outputs: list[str] | None
    priority: int
    deadline: float | None          # time.monotonic() value
    finish_cb: Callable[["Job", str, Any, list[Any]], None]
    accepted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    state: str = "queued"           # queued -> running -> done
    seq: int = field(default_factory=lambda: next(_sequence))
    settled: bool = False           # counted as done by the scheduler
    rows: int = 1                   # rows along the batch dim (a model that batches requests)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, status: str, content: dict[str, Any] | bytes, frames: list[Any] | None = None) -> bool:
        """Reply once (``content`` a map, or packed already); False when the job was already answered."""
        with self._lock:
            if self.state == "done":
                return False
            self.state = "done"
        # the request's frames are freed with its answer, not when the job leaves the deadline
        # heap (a worker still running it holds its own reference)
        self.feeds = {}
        self.finish_cb(self, status, content, frames or [])
        return True

    def fail(self, error_type: str, message: str, details: dict[str, Any] | None = None) -> bool:
        return self.finish("error", {"type": error_type, "message": message, "details": details or {}})


class Busy(Exception):
    """A queue is full; the message says which limit."""


class ModelQueue:
    """Jobs of one model: a heap per client, clients served round-robin."""

    def __init__(self, model_id: str, limit: int) -> None:
        self.model_id = model_id
        self.limit = limit
        self._heaps: dict[bytes, list[tuple[int, int, Job]]] = {}
        self._rotation: deque[bytes] = deque()
        self.size = 0
        self.running = 0
        self.done = 0
        self.batching: Any = None  # the model's BatchRunner when it batches requests
        self.gathering = False     # a worker is gathering this model's next batch
        self.gathered = 0          # jobs taken out of the queue into that batch, not running yet

    def push(self, job: Job) -> None:
        heap = self._heaps.get(job.client)
        if heap is None:
            heap = self._heaps[job.client] = []
            self._rotation.append(job.client)
        heapq.heappush(heap, (-job.priority, job.seq, job))
        self.size += 1

    def pop(self) -> Job | None:
        """The next job: the highest head priority, first client in rotation order among ties."""
        while self._rotation:
            best = max(-self._heaps[c][0][0] for c in self._rotation)
            for _ in range(len(self._rotation)):
                client = self._rotation[0]
                self._rotation.rotate(-1)  # served (or skipped) clients go to the back
                heap = self._heaps[client]
                if -heap[0][0] == best:
                    _, _, job = heapq.heappop(heap)
                    self.size -= 1
                    if not heap:
                        del self._heaps[client]
                        self._rotation.remove(client)
                    if job.state == "queued":
                        return job
                    break  # a cancelled or expired job: look again
            else:
                raise AssertionError("no client has the best priority")
        return None

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        removed: list[Job] = []
        for client in list(self._heaps):
            heap = self._heaps[client]
            keep = [item for item in heap if not predicate(item[2])]
            removed += [item[2] for item in heap if predicate(item[2])]
            if keep:
                heapq.heapify(keep)
                self._heaps[client] = keep
            else:
                del self._heaps[client]
                self._rotation.remove(client)
        self.size -= len(removed)
        return removed

    def jobs(self) -> list[Job]:
        return [item[2] for heap in self._heaps.values() for item in heap]


class Scheduler:
    """All model queues, their worker threads, and the job index used by cancel and timeouts."""

    def __init__(self, *, queue_limit: int, max_queued: int, workers_per_model: int,
                 run_job: Callable[[Job], None], run_batch: Callable[[list[Job]], None] | None = None) -> None:
        self.queue_limit = queue_limit
        self.max_queued = max_queued
        self.workers_per_model = workers_per_model
        self._run_job = run_job
        self._run_batch = run_batch
        self._lock = threading.RLock()  # taken directly where nothing waits or is notified: cheaper
        self._cond = threading.Condition(self._lock)
        self._queues: dict[str, ModelQueue] = {}
        self._workers: dict[str, list[threading.Thread]] = {}
        self._index: dict[tuple[bytes, str], Job] = {}  # queued or running jobs
        self._closing: set[str] = set()

    # -- models -------------------------------------------------------------------------------
    def add_model(self, model_id: str, batching: Any = None) -> None:
        """Queue and workers for a model. ``batching``: the model's
        :class:`~vkpool.batching.BatchRunner`; its workers then take several queued jobs at once
        (:meth:`_take_batch`) and hand them to ``run_batch``."""
        with self._cond:
            if model_id in self._queues:
                return
            queue = self._queues[model_id] = ModelQueue(model_id, self.queue_limit)
            queue.batching = batching
            work = self._worker if batching is None else self._batch_worker
            threads = [threading.Thread(target=work, args=(model_id,), daemon=True,
                                        name=f"vkpool-worker-{model_id[:8]}-{i}")
                       for i in range(self.workers_per_model)]
            self._workers[model_id] = threads
        for thread in threads:
            thread.start()

    def remove_model(self, model_id: str) -> None:
        """Stop the model's workers once its running jobs are done (call with nothing queued)."""
        with self._cond:
            self._closing.add(model_id)
            self._cond.notify_all()
            threads = self._workers.pop(model_id, [])
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
        with self._cond:
            self._queues.pop(model_id, None)
            self._closing.discard(model_id)

    def active(self, model_id: str) -> int:
        """Queued plus running jobs of a model."""
        with self._cond:
            queue = self._queues.get(model_id)
            return 0 if queue is None else queue.size + queue.gathered + queue.running

    # -- jobs ---------------------------------------------------------------------------------
    def claim_idle(self, model_id: str, gate: Any = None, jobs: int = 1, beside: int = 0) -> ModelQueue | None:
        """Count ``jobs`` jobs as running on a model with nothing queued or running, for a caller
        that runs them itself; None when the model is busy. ``gate``: the model's
        :class:`~vkpool.daemon.registry.SharedGate`, taken shared in the same call (None when a
        re-plan holds it or waits for it). Pair with :meth:`release_claim`, given the same gate and
        count. ``beside``: jobs the caller's own earlier claim counts running, which are no
        other caller's."""
        with self._lock:
            queue = self._queues.get(model_id)
            if queue is None or queue.size or queue.running != beside or model_id in self._closing:
                return None
            if gate is not None and not gate.try_acquire_shared():  # the gate's lock nests in ours
                return None
            queue.running += jobs
            return queue

    def release_claim(self, queue: ModelQueue, gate: Any = None, jobs: int = 1) -> None:
        """The claimed jobs ran: counted done, and the gate released."""
        if gate is not None:
            gate.release_shared()
        with self._lock:
            queue.running -= jobs
            queue.done += jobs

    def submit(self, job: Job, wake: bool = True) -> None:
        """Queue a job (:class:`Busy` when it does not fit). ``wake`` False: the workers are not
        told yet; the caller then calls :meth:`take_now`, which runs what it can and tells them
        of the rest."""
        with self._cond:
            queue = self._queues[job.model_id]
            if queue.size >= queue.limit:
                raise Busy(f"model {job.model_id[:12]} has {queue.size} queued jobs (queue_limit "
                           f"{queue.limit}); retry later")
            total = sum(q.size for q in self._queues.values())
            if total >= self.max_queued:
                raise Busy(f"{total} jobs queued over all models (max_queued_jobs {self.max_queued}); "
                           "retry later")
            queue.push(job)
            self._index[(job.client, job.request_id)] = job
            if wake:
                self._cond.notify_all()

    def find(self, client: bytes, request_id: str) -> Job | None:
        with self._cond:
            return self._index.get((client, request_id))

    def forget(self, job: Job) -> None:
        with self._cond:
            if self._index.get((job.client, job.request_id)) is job:
                del self._index[(job.client, job.request_id)]

    def pending(self, predicate: Callable[[Job], bool]) -> list[Job]:
        with self._cond:
            return [job for job in self._index.values() if predicate(job)]

    def drop_queued(self, predicate: Callable[[Job], bool]) -> list[Job]:
        """Take queued jobs matching ``predicate`` out of their queues (the caller answers them)."""
        with self._cond:
            removed = [job for q in self._queues.values() for job in q.remove(predicate)]
            for job in removed:
                self._index.pop((job.client, job.request_id), None)
            return removed

    def depths(self) -> dict[str, int]:
        with self._cond:
            return {model_id: q.size for model_id, q in self._queues.items()}

    def counts(self, model_id: str) -> tuple[int, int, int]:
        with self._cond:
            q = self._queues.get(model_id)
            return (0, 0, 0) if q is None else (q.size + q.gathered, q.running, q.done)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._index)

    # -- workers ------------------------------------------------------------------------------
    def _worker(self, model_id: str) -> None:
        while True:
            with self._cond:
                queue = self._queues[model_id]
                job = queue.pop()
                while job is None:
                    if model_id in self._closing:
                        return
                    self._cond.wait()
                    job = queue.pop()
                with job._lock:
                    if job.state != "queued":
                        continue
                    job.state = "running"
                job.started_at = time.monotonic()
                queue.running += 1
            try:
                self._run_job(job)
            except Exception as exc:  # the run callback answers errors itself; this is a bug
                log.exception("job %s crashed the worker callback", job.request_id)
                job.fail("InternalError", f"worker failed: {type(exc).__name__}: {exc}")
            finally:
                self.settle(job)

    def _take_batch(self, model_id: str) -> list[Job] | None:
        """The next batch of a batching model's queue for one of its workers (None when the model
        is closing), waiting for its first job: :meth:`_gather`."""
        with self._cond:
            queue = self._queues[model_id]
            while True:  # one worker gathers at a time; the others run the batches gathered before
                first = None if queue.gathering else queue.pop()
                if first is not None:
                    break
                if model_id in self._closing and not queue.gathering:
                    return None
                self._cond.wait()
            return self._gather(queue, first, True)

    def take_now(self, model_id: str, gate: Any = None) -> list[Job] | None:
        """A batch of a batching model's queued jobs for a caller that runs it itself, without
        waiting: None when none can run now (nothing queued, a worker gathering, the model
        closing, a re-plan holding ``gate``, or a queue delay that still waits for company,
        which the workers then wait out). The workers are told of what stays queued. ``gate`` is
        taken shared as in :meth:`claim_idle` and held for the caller while it runs the batch;
        the jobs are settled as a worker's are. A model with a queue delay and fewer jobs queued
        than its batch before held is left to the workers before anything is gathered: its batch
        still waits for company, and gathering it only to give it back would cost each pass."""
        with self._cond:
            queue = self._queues.get(model_id)
            if queue is None or not queue.size:
                return None
            runner = queue.batching
            if (queue.gathering or model_id in self._closing
                    or (runner.max_queue_delay > 0 and queue.size < runner.company())
                    or (gate is not None and not gate.try_acquire_shared())):
                self._cond.notify_all()  # the workers take them
                return None
            first = queue.pop()
            jobs = None if first is None else self._gather(queue, first, False)  # tells of what it leaves
            if not jobs and gate is not None:
                gate.release_shared()
            return jobs or None

    def take_idle(self, model_id: str, limit: int, gate: Any = None) -> list[Job] | None:
        """Up to ``limit`` queued jobs of a model that does not batch, in the queue's order, for a
        caller that runs them itself, one after another, as a worker would (then
        :meth:`run_taken`), when none of the model's workers runs a job now: None otherwise, or
        when nothing is queued (the workers are told of what stays queued). ``gate`` is taken
        shared as in :meth:`claim_idle` and held for the caller while it runs them (None: a
        re-plan holds it or waits for it)."""
        with self._cond:
            queue = self._queues.get(model_id)
            if queue is None or not queue.size:
                return None
            if (queue.running or model_id in self._closing
                    or (gate is not None and not gate.try_acquire_shared())):
                self._cond.notify_all()  # the workers take them
                return None
            now, jobs = time.monotonic(), []
            while len(jobs) < limit:
                job = queue.pop()
                if job is None:
                    break
                with job._lock:
                    if job.state != "queued":  # cancelled or timed out while queued
                        continue
                    job.state = "running"
                job.started_at = now
                queue.running += 1
                jobs.append(job)
            if queue.size:
                self._cond.notify_all()
            if not jobs and gate is not None:
                gate.release_shared()
            return jobs or None

    def _gather(self, queue: ModelQueue, first: Job, wait: bool) -> list[Job]:
        """The batch that ``first`` opens (the caller holds the lock): more jobs in queue order
        while their rows fit in ``max_batch``, waiting for them (``wait``) until
        ``max_queue_delay`` after the first was accepted; the runner's :meth:`fit` decides how
        many run now and the rest go back to the queue (:meth:`vkpool.batching.BatchRunner.gather`,
        as the in-process batcher gathers, each job's company being its client's). Without
        ``wait``, a batch whose first job may still wait for company goes back whole (an empty
        list). The jobs returned are marked running."""
        runner, model_id = queue.batching, queue.model_id
        queue.gathering = True
        queue.gathered = 1

        def take() -> Job | None:
            job = queue.pop()
            queue.gathered += job is not None
            return job

        def give_back(back: list[Job]) -> None:
            for job in back:  # each keeps its place (its sequence number)
                queue.push(job)
                queue.gathered -= 1

        until = first.accepted_at + runner.max_queue_delay
        try:
            jobs = runner.gather(first, lambda j: j.rows, take, give_back, self._cond.wait if wait else None,
                                 lambda: 0.0 if model_id in self._closing else until - time.monotonic(),
                                 lambda j: j.client)
        finally:
            queue.gathering = False
            queue.gathered = 0
            if wait or queue.size:  # another worker may gather now, or take what went back
                self._cond.notify_all()
        now = time.monotonic()
        live = []
        for job in jobs:
            with job._lock:
                if job.state != "queued":  # cancelled or timed out while the batch gathered
                    continue
                job.state = "running"
            job.started_at = now
            queue.running += 1
            live.append(job)
        return live

    def _batch_worker(self, model_id: str) -> None:
        assert self._run_batch is not None
        while True:
            jobs = self._take_batch(model_id)
            if jobs is None:
                return
            if jobs:
                self.run_taken(jobs, self._run_batch)

    def run_taken(self, jobs: list[Job], run: Callable[[list[Job]], None]) -> None:
        """Run a batch taken by a worker or :meth:`take_now` with ``run(jobs)``, which answers
        them; should it fail itself, each job fails. The jobs are settled after."""
        try:
            run(jobs)
        except Exception as exc:  # the run callback answers errors itself; this is a bug
            log.exception("a batch of %d job(s) crashed the run callback", len(jobs))
            for job in jobs:
                job.fail("InternalError", f"worker failed: {type(exc).__name__}: {exc}")
        finally:
            for job in jobs:
                self.settle(job)

    def settle(self, job: Job) -> None:
        """Count a job that a worker ran as done; the run callback calls it before replying, so
        that a client never sees its reply before the counts do."""
        with self._cond:
            if job.settled:
                return
            job.settled = True
            queue = self._queues[job.model_id]
            queue.running -= 1
            queue.done += 1
            self._index.pop((job.client, job.request_id), None)  # (no worker waits for this)
