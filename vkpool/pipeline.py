"""How a request moves through vkpool, whatever runs the model.

Every way of running a model is a **runner** with one contract: ``submit(feeds, shape=None)``
returns a future of ``{output name: array}`` (or of what ``shape`` makes of it), ``run(feeds)``
waits for it, ``close()`` ends the runner, failing every request it cannot finish, and
``stats()`` counts requests (:class:`RequestStats`: accepted = ok + failed + pending). The
runners are:

- :class:`InlineRunner`: the model runs in the caller's thread, one call per caller at a time:
  a whole model compiled as one chunk on one member, or a model cut at data-dependent shapes
  (:class:`vkpool.dynamic.DynamicModel`);
- :class:`~vkpool.executor.PlanExecutor`: a plan's chunks on their members, driven by one
  thread per member of this process;
- :class:`~vkpool.processes.ProcessExecutor`: each chunk of the plan, and each replica, in a
  worker process of its own;
- :class:`~vkpool.batching.Batcher`: requests submitted together run as one batch on a variant
  compiled at that batch size (dynamic batching, ``Session(..., max_batch=N)``), from a
  dispatcher thread. It refuses a request it cannot feed in ``submit``, before accepting it.

:class:`vkpool.session.Session` is a façade over one of them (``session.runner``). The daemon
queues jobs per model and client (:mod:`vkpool.daemon.scheduler`: priorities, fairness, timeouts,
one reply per job) and runs each through its model's session, so through one of these runners.

The two plan executors share :class:`Pipeline`, which holds a request's bookkeeping once; they
only say how a chunk run is started and how its end is seen. A request's life:

1. **Admitted** (:meth:`Pipeline.submit`). It gets an id and a future and goes to a
   :class:`ModelCopy`, one complete copy of the model (copy 0: the plan's chunks; copy k: the
   whole model on replica k): the live copy with the fewest requests in flight among those with
   a free *place*. A copy whose chunks keep per-request memory (the run slot indices of chunks
   linked on one device, the mailboxes of worker processes) has a fixed number of places, and a
   request holds one for its whole life; other copies take any number. With every place taken,
   the request waits in the backlog, which the first place to free takes from, oldest first.
2. **Started.** The backend prepares the request (:meth:`Pipeline._prepare`: a worker
   process's mailbox gets its inputs) and every stage (chunk) of the copy that reads only the
   model's inputs is launched (:meth:`Pipeline._launch`).
3. **A stage ends** (:meth:`Pipeline._run_ended`, called once for every launched stage, in
   whichever thread sees it end). Its outputs are kept (:meth:`Pipeline._absorb`), the run is
   traced (host ``perf_counter_ns`` at its start and when its end was seen), the tensors it
   received from other members are counted in ``transfers_executed``, and each successor whose
   predecessors have all ended is launched. A successor linked to it on one device (its
   tensors stay on the device) was launched already, when this stage's run was submitted
   (:meth:`Pipeline._run_submitted`): it waits for it on the device.
4. **Finished** after its last stage: the backend collects the outputs (:meth:`Pipeline._outputs`;
   an input that is also an output is copied), ``shape`` is applied, the request is counted
   and traced, its place goes to the next request, and its future gets the result.
5. **Failed**, exactly once, by the first error: a stage that fails, a backend that loses a
   copy (:meth:`Pipeline._copy_lost`: a worker process died), or ``close``. Stages not yet
   launched are not; a stage the backend had queued ends without running. The future gets the
   error at once, but the request's place goes back only when none of its runs is left on a
   device, so no later request's run overwrites memory a run still uses.

``close`` refuses new requests, lets the backend stop (:meth:`Pipeline._stop`: threads end after
the runs on their devices, worker processes serve what they hold first), fails what is still
pending, and frees the compiled chunks (:meth:`Pipeline._free`).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from vkpool.model import LoadedModel, Node

if TYPE_CHECKING:  # the partitioner (and networkx) stays off the import path of a session on one member
    from vkpool.engine import ChunkStats
    from vkpool.partition.plan import Transfer

#: requests whose chunk timings :meth:`Pipeline.trace` keeps (oldest dropped first)
TRACE_REQUESTS = 4096
CLOSED = "the session was closed before this request finished"

Shape = Callable[[dict[str, np.ndarray]], Any]


@dataclass
class RequestStats:
    """Requests a runner took: every accepted one is ok, failed or still pending."""

    accepted: int = 0
    ok: int = 0
    failed: int = 0
    pending: int = 0


class Runner(Protocol):
    """What every way of running a model offers (see the module doc)."""

    runs_in: str

    def submit(self, feeds: Mapping[str, np.ndarray], shape: Shape | None = None) -> Future: ...

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...

    def stats(self) -> RequestStats: ...


# -- in the caller's thread ------------------------------------------------------------------------
#: what a stream of requests given to ``run_many`` (:func:`back_to_back`, :func:`submit_all`) yields
#: when it has no request ready: the requests started are finished and reported before the
#: stream is read again, so that a stream that then waits for its next request (a node's requests
#: from calls that have not come yet) does not hold back the results of those before it
IDLE = object()


def back_to_back(start: Callable[[Any], Any], finish: Callable[[Any], Any], items: Iterable[Any],
                 depth: int, each: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Runs every item, ``start(item)`` beginning a run and ``finish(handle)`` waiting for it and
    returning its result, with up to ``depth`` runs in flight: with a chunk's run slots, the
    device runs one item while the host writes the next one's inputs and reads the last one's
    outputs. ``items`` is read lazily, each item only when its run can start (:data:`IDLE`
    items finish the runs in flight). Returns each item's result, or the exception its start or
    finish raised (an item that fails fails alone); ``each(index, result)`` is called as each
    one ends, in order."""
    out: list[Any] = []
    started: deque[tuple[int, Any]] = deque()

    def settle(index: int, result: Any) -> None:
        out[index] = result
        if each is not None:
            each(index, result)

    def finish_one() -> None:
        index, handle = started.popleft()
        try:
            result = finish(handle)
        except Exception as exc:
            result = exc
        settle(index, result)

    source = iter(items)
    while True:
        if len(started) >= max(1, depth):
            finish_one()
        try:
            item = next(source)
        except StopIteration:
            break
        if item is IDLE:
            while started:
                finish_one()
            continue
        index = len(out)
        out.append(None)
        try:
            started.append((index, start(item)))
        except Exception as exc:
            while started:  # the runs before it end first: results come in order
                finish_one()
            settle(index, exc)
    while started:
        finish_one()
    return out


def submit_all(submit: Callable[[Any], Future], items: Iterable[Any],
               each: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Submits every item (``submit(item)`` returns a future), then waits for each in order:
    each item's result, or the exception its submit or its run raised (an item that fails fails
    alone); ``each(index, result)`` as each one is waited for. At an :data:`IDLE` item, the
    items submitted so far are waited for before ``items`` is read again."""
    futures: list[Any] = []
    out: list[Any] = []

    def wait_all() -> None:
        for future in futures[len(out):]:
            try:
                result = future if isinstance(future, Exception) else future.result()
            except Exception as exc:
                result = exc
            out.append(result)
            if each is not None:
                each(len(out) - 1, result)

    for item in items:
        if item is IDLE:
            wait_all()
            continue
        try:
            futures.append(submit(item))
        except Exception as exc:  # refused: it fails alone
            futures.append(exc)
    wait_all()
    return out


class InlineRunner:
    """Runs ``run(feeds)`` in the caller's thread: a whole-model chunk's run, a cut model's.
    ``close`` (after the calls in progress have returned) calls ``close``. Nothing waits, so
    nothing queues: :meth:`submit` returns a future that is done already."""

    runs_in = "the caller's thread"

    def __init__(self, run: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]],
                 close: Callable[[], None] | None = None, *,
                 start: Callable[[Mapping[str, np.ndarray]], Any] | None = None,
                 finish: Callable[[Any], dict[str, np.ndarray]] | None = None, depth: int = 1,
                 stage: Callable[[Callable[[bool], None], bool], Any] | None = None) -> None:
        self._run = run
        self._close = close
        # a run whose caller writes the inputs and reads the outputs in place (:meth:`staged`)
        self._stage = stage
        # a run in two halves (a chunk's start and finish), for run_many to keep depth in flight
        self._start, self._finish, self._depth = start, finish, depth if start and finish else 1
        # one run_many at a time: two, each holding a run slot while it starts another, would
        # wait for each other forever (a plain run holds one slot at a time and never waits)
        self._many = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._accepted = self._ok = self._failed = 0

    def run(self, feeds: Mapping[str, np.ndarray], shape: Shape | None = None) -> Any:
        # the one-member path of every Session.run: plain acquire/release, measured at 0.3 µs
        # a call where a context manager and a helper call took 0.7 µs
        lock = self._lock
        lock.acquire()
        if self._closed:
            lock.release()
            raise RuntimeError("the runner is closed")
        self._accepted += 1
        lock.release()
        try:
            out = self._run(feeds)
            if shape is not None:
                out = shape(out)
        except BaseException:
            with lock:
                self._failed += 1
            raise
        lock.acquire()
        self._ok += 1
        lock.release()
        return out

    def staged(self, block: bool = True) -> Any:
        """A run slot held for a caller that writes the inputs into it and reads the outputs
        where the run leaves them (:class:`vkpool.engine.StagedRun`), counted as one request from
        here until it is given back; None where this runner has no such slot (a host chunk, a
        cut model, or a chunk whose outputs are handed out). ``block`` False: raises
        :class:`queue.Empty` at once when every slot is in use."""
        if self._stage is None:
            return None
        with self._lock:
            if self._closed:
                raise RuntimeError("the runner is closed")
            self._accepted += 1
        try:
            run = self._stage(self._staged_ended, block)
        except queue.Empty:  # no slot free: not counted
            with self._lock:
                self._accepted -= 1
            raise
        except BaseException:
            self._staged_ended(False)
            raise
        if run is None:
            with self._lock:
                self._accepted -= 1
        return run

    def _staged_ended(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._ok += 1
            else:
                self._failed += 1

    @property
    def depth(self) -> int:
        """Runs :meth:`run_many` keeps in flight (1: one after another)."""
        return self._depth

    def run_many(self, feeds: Iterable[Mapping[str, np.ndarray]], shape: Shape | None = None,
                 each: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Runs several requests back to back in the caller's thread: each one's result, or the
        exception it raised (it fails alone); ``each(index, result)`` as each one ends, in order.
        ``feeds`` is read lazily, a request only when it can start. With a run in two halves and
        a depth over one, the next request starts before the last one is waited for
        (:func:`back_to_back`), while no other ``run_many`` of this runner does (two, each
        holding a run slot while it starts another, would wait for each other forever); else
        they run one after another."""
        if not (self._depth > 1 and self._many.acquire(blocking=False)):
            return back_to_back(lambda one: self.run(one, shape), lambda out: out, feeds, 1, each)

        def start(one: Mapping[str, np.ndarray]) -> Any:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the runner is closed")
                self._accepted += 1
            try:
                return self._start(one)  # type: ignore[misc]
            except Exception:
                with self._lock:
                    self._failed += 1
                raise

        def finish(handle: Any) -> Any:
            try:
                out = self._finish(handle)  # type: ignore[misc]
                if shape is not None:
                    out = shape(out)
            except Exception:
                with self._lock:
                    self._failed += 1
                raise
            with self._lock:
                self._ok += 1
            return out

        try:
            return back_to_back(start, finish, feeds, self._depth, each)
        finally:
            self._many.release()

    def submit(self, feeds: Mapping[str, np.ndarray], shape: Shape | None = None) -> Future:
        if self._closed:  # refused here, as the plan executors refuse it
            raise RuntimeError("the runner is closed")
        future: Future = Future()
        try:
            future.set_result(self.run(feeds, shape))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def stats(self) -> RequestStats:
        with self._lock:
            ended = self._ok + self._failed
            return RequestStats(self._accepted, self._ok, self._failed, self._accepted - ended)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while self.stats().pending:  # a call in progress ends on its own; closing is rare
            time.sleep(0.001)
        if self._close is not None:
            self._close()


# -- the plan's structure --------------------------------------------------------------------------
@dataclass(eq=False)
class Stage:
    """One chunk of a copy of the model: its nodes on one member, what it reads and writes."""

    index: int
    member: Any
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    preds: list[int] = field(default_factory=list)
    succs: list[int] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)  # what it receives from other members
    chunk: Any = None
    # preds and succs on the same device, whose tensors stay there (vkpool.executor.link_stages)
    linked_preds: list[int] = field(default_factory=list)
    linked_succs: list[int] = field(default_factory=list)
    host_inputs: list[str] = field(default_factory=list)  # the inputs the host writes at start
    host_outputs: list[str] = field(default_factory=list)  # the outputs the host reads at the end


@dataclass(eq=False)
class ModelCopy:
    """One complete copy of the model: the plan's chunks (copy 0), or a replica's single chunk."""

    index: int
    stages: list[Stage]
    in_flight: int = 0
    #: the places no request holds (run slot indices, mailboxes); None: any number of requests
    free: list[int] | None = None
    alive: bool = True


@dataclass(eq=False)
class Request:
    id: int
    feeds: Mapping[str, np.ndarray]
    future: Future
    shape: Shape | None
    copy: ModelCopy | None = None  # None while in the backlog
    place: int = -1  # the place it holds on its copy (-1: none)
    waiting: list[int] = field(default_factory=list)  # per stage, how many of its preds have not ended
    left: int = 0  # stages not yet ended
    active: int = 0  # stages launched whose end has not been seen
    values: dict[str, np.ndarray] = field(default_factory=dict)  # tensors on the host: feeds, chunk outputs
    started: dict[int, int] = field(default_factory=dict)  # stage → perf_counter_ns of its run's start
    signals: dict[int, int] = field(default_factory=dict)  # stage → timeline value its run signals
    # (chunk, member, ops, start ns, end ns) per stage run; ChunkEvents are built when asked for
    events: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False  # finished or failed
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class ChunkEvent:
    """One chunk run of one request: host timestamps around input staging, run and read-back."""

    request: int
    copy: int
    chunk: int
    member: str
    ops: int
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def stage_nodes(model: LoadedModel, node_indices: Sequence[Sequence[int]], members: Sequence[Any]) -> list[Stage]:
    """Stages (chunk inputs, outputs, preds) for node index groups given in execution order."""
    from vkpool.partition.plan import Transfer  # one tensor staged device → host → device

    produced_by: dict[str, int] = {}
    for s, indices in enumerate(node_indices):
        for i in indices:
            for name in model.nodes[i].outputs:
                if name:
                    produced_by[name] = s
    model_outputs = {name for name, _ in model.outputs}
    read_by: dict[str, set[int]] = {}
    stages: list[Stage] = []
    for s, indices in enumerate(node_indices):
        nodes = [model.nodes[i] for i in sorted(indices)]
        inside = {name for node in nodes for name in node.outputs if name}
        inputs: list[str] = []
        for node in nodes:
            for name in node.inputs:
                if name and name not in inside and name not in model.constants and name not in inputs:
                    inputs.append(name)
                    read_by.setdefault(name, set()).add(s)
        stages.append(Stage(s, members[s], nodes, inputs, [], host_inputs=list(inputs)))
    for stage in stages:
        stage.outputs = [name for node in stage.nodes for name in node.outputs
                         if name and (name in model_outputs or read_by.get(name, set()) - {stage.index})]
        stage.host_outputs = list(stage.outputs)
        preds = sorted({produced_by[n] for n in stage.inputs if n in produced_by})
        stage.preds = preds
        for p in preds:
            stages[p].succs.append(stage.index)
    for stage in stages:
        for name in stage.inputs:
            src = produced_by.get(name)
            if src is not None and stages[src].member.id != stage.member.id:
                stage.transfers.append(Transfer(name, model.tensors[name].nbytes,
                                                stages[src].member.id, stage.member.id, src, stage.index))
    return stages


def plan_groups(plan: Any, graph: Any) -> list[list[int]]:
    """The model node indices of each of the plan's chunks, in the plan's order."""
    index_of = {op: int(graph.nodes[op]["index"]) for op in graph.nodes}
    return [[index_of[op] for op in chunk.ops] for chunk in plan.chunks]


def plan_copies(pool: Any, model: LoadedModel, plan: Any, graph: Any) -> list[ModelCopy]:
    """The plan's copies of the model, chunks not built yet: copy 0 runs the plan's chunks on
    their members, copy k the whole model on replica k."""
    members = [pool.member(chunk.member) for chunk in plan.chunks]
    copies = [ModelCopy(0, stage_nodes(model, plan_groups(plan, graph), members))]
    everything = list(range(len(model.nodes)))
    for k, replica in enumerate(plan.replicas, start=1):
        copies.append(ModelCopy(k, stage_nodes(model, [everything], [pool.member(replica)])))
    return copies


# -- the pipeline of a plan ------------------------------------------------------------------------
class Pipeline(ABC):
    """A request's bookkeeping over a plan's copies (see the module doc); a backend subclass
    says how a stage is launched (:meth:`_launch`) and reports each launched stage's end
    (:meth:`_run_ended`)."""

    runs_in = ""
    #: memory shared by linked chunks: (member id, allocation); none unless a backend links chunks
    _shared: Sequence[tuple[str, Any]] = ()

    def __init__(self, model: LoadedModel, plan: Any, copies: list[ModelCopy]) -> None:
        self.model = model
        self.plan = plan
        self.copies = copies
        self.transfers_executed: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()  # copies' loads and places, the backlog, pending, counts, trace
        self._ids = itertools.count()
        self._closed = False
        self._backlog: deque[Request] = deque()
        self._pending: dict[int, Request] = {}
        self._counts = RequestStats()
        self._driving = 0  # requests a backend's run_many drives in the caller's thread, not in _pending
        # (request id, copy, stage runs) of the last requests
        self._trace: deque[tuple[int, int, list[tuple[int, str, int, int, int]]]] = deque(maxlen=TRACE_REQUESTS)
        self._input_names = {name for name, _ in model.inputs}
        self._output_names = [name for name, _ in model.outputs if name not in model.constants]

    # -- what a backend provides -----------------------------------------------------------------
    def _new_future(self) -> Future:
        return Future()

    def _prepare(self, request: Request) -> None:
        """Before its first stages launch (the request has its copy and place); may raise."""

    @abstractmethod
    def _launch(self, request: Request, stage: Stage) -> None:
        """Starts ``stage`` for ``request``, or queues it; its end must come to :meth:`_run_ended`."""

    def _absorb(self, request: Request, stage: Stage, produced: Mapping[str, np.ndarray]) -> None:
        request.values.update(produced)

    def _outputs(self, request: Request) -> dict[str, np.ndarray]:
        return {name: request.values[name].copy() if name in self._input_names else request.values[name]
                for name in self._output_names}

    def _no_copy_left(self) -> str:
        return "no copy of the model is left to run requests"

    def _after_submit(self) -> None:
        """In the submitting thread, after a request was started or queued."""

    def _stop(self) -> None:
        """Ends the backend's runs (``close``): afterwards no stage is launched or ends."""

    def _free(self) -> None:
        """Frees what the backend built (``close``, after every request ended)."""

    # -- a request's life ------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray], shape: Shape | None = None) -> Future:
        """Starts one request; the future's result is ``{output name: array}``, or what
        ``shape`` makes of it (called once, in the thread that completes the request)."""
        future = self._new_future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is closed")
            live = [c for c in self.copies if c.alive]
            if not live:
                raise RuntimeError(self._no_copy_left())
            request = Request(next(self._ids), feeds, future, shape)
            self._counts.accepted += 1
            self._pending[request.id] = request
            room = [c for c in live if c.free is None or c.free]
            if room:
                self._seat(request, min(room, key=lambda c: (c.in_flight, c.index)))
            else:
                self._backlog.append(request)
        if request.copy is not None:
            self._start(request)
        self._after_submit()
        return future

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(feeds).result()

    def _seat(self, request: Request, copy: ModelCopy, place: int | None = None) -> None:
        """Puts ``request`` on ``copy`` in ``place`` (else a free one) (``_lock`` held)."""
        copy.in_flight += 1
        request.copy = copy
        if copy.free is not None:
            request.place = copy.free.pop() if place is None else place
        request.waiting = [len(s.preds) for s in copy.stages]
        request.left = len(copy.stages)
        request.values = dict(request.feeds)

    def _start(self, request: Request) -> None:
        try:
            self._prepare(request)
        except BaseException as exc:  # the request fails; its place serves the next one
            self._fail(request, exc)
            return
        roots = [s for s in request.copy.stages if not s.preds]  # type: ignore[union-attr]
        with request.lock:
            request.active += len(roots)
        for stage in roots:
            self._launch(request, stage)

    def _run_submitted(self, request: Request, stage: Stage) -> None:
        """A run of ``stage`` with linked successors was submitted: launch those whose preds are
        all submitted (linked) or ended (the others); they wait on the device for this run."""
        ready: list[Stage] = []
        stages = request.copy.stages  # type: ignore[union-attr]
        with request.lock:
            if request.error is not None:
                return
            for succ in stage.linked_succs:
                request.waiting[succ] -= 1
                if request.waiting[succ] == 0:
                    ready.append(stages[succ])
            request.active += len(ready)
        for nxt in ready:
            self._launch(request, nxt)

    def _run_ended(self, request: Request, stage: Stage, outcome: Mapping[str, np.ndarray] | BaseException | None
                   ) -> None:
        """The run of ``stage`` for ``request`` ended: ``outcome`` is what it produced (an empty
        mapping where the backend keeps the outputs), its error, or None when it did not run
        because the request had failed already."""
        now = time.perf_counter_ns()
        ready: list[Stage] = []
        finished = False
        stages = request.copy.stages  # type: ignore[union-attr]
        with request.lock:
            request.active -= 1
            ok = isinstance(outcome, Mapping) and request.error is None
            if ok:
                self._absorb(request, stage, outcome)  # type: ignore[arg-type]
                request.events.append((stage.index, stage.member.id, len(stage.nodes),
                                       request.started.get(stage.index, now), now))
                for succ in stage.succs:
                    if succ in stage.linked_succs:  # launched when this run was submitted
                        continue
                    request.waiting[succ] -= 1
                    if request.waiting[succ] == 0:
                        ready.append(stages[succ])
                request.active += len(ready)
                request.left -= 1
                finished = request.left == 0
        if not ok:
            self._fail(request, outcome if isinstance(outcome, BaseException) else None)
            return
        if stage.transfers:
            with self._lock:
                for t in stage.transfers:
                    self.transfers_executed[(t.tensor, t.src, t.dst)] += 1
        for nxt in ready:
            self._launch(request, nxt)
        if finished:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        error: BaseException | None = None
        try:
            out = self._outputs(request)
            result = out if request.shape is None else request.shape(out)
        except BaseException as exc:
            error = exc
        settled = self._settle(request, error)
        self._release(request)
        if settled:
            if error is None:
                request.future.set_result(result)
            else:
                request.future.set_exception(error)

    def _fail(self, request: Request, error: BaseException | None) -> None:
        """Fails ``request`` with ``error`` once (None: it failed already), and gives its place
        back when none of its runs is left on a device."""
        if error is not None:
            with request.lock:
                first = request.error is None
                if first:
                    request.error = error
            if first and self._settle(request, error):
                request.future.set_exception(error)
        self._release(request)

    def _settle(self, request: Request, error: BaseException | None) -> bool:
        """Ends the request's life once: False when it had ended already."""
        with self._lock:
            if request.done:
                return False
            request.done = True
            if request.copy is not None:
                request.copy.in_flight -= 1
            self._pending.pop(request.id, None)
            self._counts.pending = len(self._pending) + self._driving
            if error is None:
                self._counts.ok += 1
                self._trace.append((request.id, request.copy.index, request.events))  # type: ignore[union-attr]
            else:
                self._counts.failed += 1
        return True

    def _release(self, request: Request) -> None:
        """Once the request has ended and none of its runs is in flight, its place goes to the
        first request in the backlog (which then starts), or back to its copy's free places."""
        with request.lock:
            if request.place < 0 or request.active or not request.done:
                return
            place, request.place = request.place, -1
        copy = request.copy
        assert copy is not None and copy.free is not None
        with self._lock:
            nxt = self._backlog.popleft() if self._backlog and copy.alive else None
            if nxt is None:
                if copy.alive:
                    copy.free.append(place)
            else:
                self._seat(nxt, copy, place)
        if nxt is not None:
            self._start(nxt)

    def _copy_lost(self, copy: ModelCopy, error: BaseException) -> None:
        """``copy`` can run nothing more: fail its requests, and the backlog when no copy is left."""
        with self._lock:
            copy.alive = False
            lost = [r for r in self._pending.values() if r.copy is copy]
            if not any(c.alive for c in self.copies):
                lost += list(self._backlog)
                self._backlog.clear()
        for request in lost:
            self._fail(request, error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop()
        with self._lock:
            left = list(self._pending.values())
            self._backlog.clear()
        for request in left:
            self._fail(request, RuntimeError(CLOSED))
        while self._driving:  # a run_many in the caller's thread ends its runs on its own
            time.sleep(0.001)
        self._free()

    # -- what it reports -------------------------------------------------------------------------
    def stats(self) -> RequestStats:
        with self._lock:
            return RequestStats(**vars(self._counts))

    @property
    def members(self) -> list[str]:
        return list(dict.fromkeys(s.member.id for copy in self.copies for s in copy.stages))

    @property
    def planned_transfers(self) -> list[Transfer]:
        """The cross-member stagings one request on the plan's own copy performs."""
        return [t for stage in self.copies[0].stages for t in stage.transfers]

    def memory_by_member(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for copy in self.copies:
            for stage in copy.stages:
                s = stage.chunk.stats
                out[stage.member.id] = out.get(stage.member.id, 0) + s.weight_bytes + s.arena_bytes + s.io_bytes
        for member_id, alloc in self._shared:
            out[member_id] += alloc.nbytes
        return out

    def chunk_stats(self) -> ChunkStats:
        """The chunks' statistics summed (largest live set: the largest of any chunk)."""
        from vkpool.engine import ChunkStats

        total = ChunkStats()
        for copy in self.copies:
            for stage in copy.stages:
                s = stage.chunk.stats
                total.weight_bytes += s.weight_bytes
                total.arena_bytes += s.arena_bytes
                total.io_bytes += s.io_bytes
                total.peak_live_bytes = max(total.peak_live_bytes, s.peak_live_bytes)
                total.dispatches += s.dispatches
                total.barriers += s.barriers
                total.levels += s.levels
        return total

    def trace(self) -> list[ChunkEvent]:
        """Chunk runs of the last requests, in the order they ended."""
        with self._lock:
            done = list(self._trace)
        return [ChunkEvent(rid, copy, *e) for rid, copy, events in done for e in events]


__all__ = ["Runner", "InlineRunner", "back_to_back", "submit_all", "Pipeline", "RequestStats", "ModelCopy",
           "Stage", "Request", "ChunkEvent", "stage_nodes", "plan_groups", "plan_copies", "TRACE_REQUESTS", "CLOSED"]
