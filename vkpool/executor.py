"""Running a partition Plan: one recorded chunk per plan chunk, requests pipelined across members.

A :class:`PlanExecutor` builds, for every chunk of a :class:`~vkpool.partition.plan.Plan`, a
:class:`~vkpool.engine.VulkanChunk` (recorded once) or a :class:`~vkpool.engine.HostChunk` on
its member, and for every replica member one whole-model chunk. Requests then flow like this:

- each member takes chunk runs in the order they become ready, with up to two on its device
  at once (one executing, the next queued behind it); a request's chunk is offered to its
  member as soon as every chunk it reads from has finished, so independent chunks on
  different members run at once, and member A runs request k+1 while member B runs request k.
  A run is submitted by the thread that makes it ready when the member has room, and by the
  member's own thread right after a run before it ends otherwise; that thread waits for the
  device and completes runs (see :class:`_MemberRunner`);
- a tensor crossing chunks on different devices is staged through host memory: the
  producer's chunk output lives in host-visible mapped memory, is copied into the request's
  own host array when the chunk finishes, and written into the consumer chunk's mapped input
  when that chunk starts. A Vulkan chunk has two run slots, each with its own mapped inputs
  and outputs (boundary tensors double-buffered), and each request owns its host copies, so
  nothing in flight is ever overwritten;
- between chunks on one device (members of a split device, or two chunks of one member) the
  tensor stays on the device: producer and consumer share its memory, one allocation per run
  slot, and the consumer is submitted as soon as the producer is, waiting on the device for
  the value the producer's run signals on its timeline semaphore (no host round trip between
  them). A request on a lane with such links holds one run slot index for its whole life
  (the lane has ``RUN_SLOTS`` of them) and every linked chunk runs it in that slot, so the
  shared memory of a slot belongs to one request at a time;
- with replicas, a request goes to the lane (the plan's chunks, or one replica) with the
  fewest requests in flight.

Every cross-member transfer (staged or on the device) is counted as ``(tensor, src, dst)``
and every chunk run is traced with host ``perf_counter_ns`` start (its submission) and end
(its outputs read), per request.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vkpool.engine import ChunkStats, HostChunk, VulkanChunk
from vkpool.model import LoadedModel, Node
from vkpool.partition.plan import Transfer  # one tensor staged device → host → device

#: runs a member's Vulkan chunk may have on the device at once: one executing, one queued
RUN_SLOTS = 2
#: requests whose chunk timings :meth:`PlanExecutor.trace` keeps (oldest dropped first)
TRACE_REQUESTS = 4096


@dataclass(frozen=True)
class ChunkEvent:
    """One chunk run of one request: host timestamps around input staging, run and read-back."""

    request: int
    lane: int
    chunk: int
    member: str
    ops: int
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class MemberGroup:
    """The members a session's plan runs on; ``id`` joins theirs with ``+`` (``vk0.0+vk0.1``)."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.members = list(members)
        self.id = "+".join(m.id for m in self.members)

    def __repr__(self) -> str:
        return f"MemberGroup({self.id})"


@dataclass(eq=False)
class _Stage:
    index: int
    member: Any
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    preds: list[int] = field(default_factory=list)
    succs: list[int] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)  # what it receives from other members
    chunk: Any = None
    # preds and succs on the same device, whose tensors stay there (see link_stages)
    linked_preds: list[int] = field(default_factory=list)
    linked_succs: list[int] = field(default_factory=list)
    host_inputs: list[str] = field(default_factory=list)  # the inputs the host writes at start
    host_outputs: list[str] = field(default_factory=list)  # the outputs the host reads at the end


@dataclass(eq=False)
class _Lane:
    """One complete copy of the model: the plan's chunks, or a replica's single chunk."""

    index: int
    stages: list[_Stage]
    in_flight: int = 0
    # with linked stages: the run slot indices no request holds, and requests waiting for one
    free_slots: list[int] | None = None
    backlog: deque[_Request] = field(default_factory=deque)


@dataclass(eq=False)
class _Request:
    id: int
    lane: _Lane
    values: dict[str, np.ndarray]
    waiting: list[int]  # per stage, how many of its preds have not finished
    future: Future
    left: int
    shape: Callable[[dict[str, np.ndarray]], Any] | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (chunk, member, ops, start ns, end ns) per chunk run; ChunkEvents are built when asked for
    events: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    failed: bool = False
    slot: int = -1  # the run slot its linked chunks use (lanes with links only)
    signals: dict[int, int] = field(default_factory=dict)  # stage → timeline value its run signals
    active: int = 0  # chunk runs started and not yet completed
    done: bool = False  # finished or failed


def stage_nodes(model: LoadedModel, node_indices: Sequence[Sequence[int]],
                members: Sequence[Any]) -> list[_Stage]:
    """Stages (chunk inputs, outputs, preds) for node index groups given in execution order."""
    produced_by: dict[str, int] = {}
    for s, indices in enumerate(node_indices):
        for i in indices:
            for name in model.nodes[i].outputs:
                if name:
                    produced_by[name] = s
    model_outputs = {name for name, _ in model.outputs}
    read_by: dict[str, set[int]] = {}
    stages: list[_Stage] = []
    for s, indices in enumerate(node_indices):
        nodes = [model.nodes[i] for i in sorted(indices)]
        inside = {name for node in nodes for name in node.outputs if name}
        inputs: list[str] = []
        for node in nodes:
            for name in node.inputs:
                if name and name not in inside and name not in model.constants and name not in inputs:
                    inputs.append(name)
                    read_by.setdefault(name, set()).add(s)
        stages.append(_Stage(s, members[s], nodes, inputs, [], host_inputs=list(inputs)))
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


def link_stages(model: LoadedModel, stages: list[_Stage]) -> bool:
    """Marks every edge between Vulkan chunks on one logical device as linked (its tensors
    stay on the device) and narrows each stage's host inputs and outputs to the rest; returns
    whether any edge is linked."""
    from vkpool.pool import VulkanMember

    def device(stage: _Stage) -> Any:
        return stage.member.device if isinstance(stage.member, VulkanMember) else None

    model_outputs = {name for name, _ in model.outputs}
    for stage in stages:
        here = device(stage)
        stage.linked_preds = [p for p in stage.preds if here is not None and device(stages[p]) is here]
        for p in stage.linked_preds:
            stages[p].linked_succs.append(stage.index)
    for stage in stages:
        linked_in = {n for p in stage.linked_preds for n in stages[p].outputs}
        stage.host_inputs = [n for n in stage.inputs if n not in linked_in]
    host_read = {n for stage in stages for n in stage.host_inputs} | model_outputs
    for stage in stages:
        stage.host_outputs = [n for n in stage.outputs if n in host_read]
    return any(stage.linked_preds for stage in stages)


def plan_groups(plan: Any, graph: Any) -> list[list[int]]:
    """The model node indices of each of the plan's chunks, in the plan's order."""
    index_of = {op: int(graph.nodes[op]["index"]) for op in graph.nodes}
    return [[index_of[op] for op in chunk.ops] for chunk in plan.chunks]


def plan_lanes(pool: Any, model: LoadedModel, plan: Any, graph: Any) -> list[_Lane]:
    """The plan's lanes, chunks not built yet: lane 0 runs the plan's chunks on their members,
    lane k the whole model on replica k."""
    members = [pool.member(chunk.member) for chunk in plan.chunks]
    lanes = [_Lane(0, stage_nodes(model, plan_groups(plan, graph), members))]
    everything = list(range(len(model.nodes)))
    for k, replica in enumerate(plan.replicas, start=1):
        lanes.append(_Lane(k, stage_nodes(model, [everything], [pool.member(replica)])))
    return lanes


def build_chunk(model: LoadedModel, stage: _Stage, io: Sequence[Mapping[str, Any]] | None = None,
                waits: Sequence[Any] = ()) -> Any:
    """The stage's chunk on its member: a :class:`VulkanChunk` with ``RUN_SLOTS`` run slots
    (or one per entry of ``io``, each reading and writing that memory in place; its runs wait
    on the device for ``waits``, and signal a timeline of their own when the stage has linked
    successors), or a :class:`HostChunk` on the ``cpu`` member."""
    from vkpool.pool import VulkanMember

    args = (stage.member, stage.nodes, dict(model.tensors), model.constants, stage.inputs, stage.outputs,
            model.opset)
    if isinstance(stage.member, VulkanMember):
        return VulkanChunk(*args, slots=RUN_SLOTS, io=io, waits=waits, signal=bool(stage.linked_succs))
    return HostChunk(*args)


class _MemberRunner:
    """Runs one member's chunk runs in the order they become ready, up to ``depth`` at a time.

    A run *starts* (inputs written, recorded commands submitted) in whichever thread offers it
    while the member has room (the submitting thread, or the thread that finished the chunk it
    waited for), else in the member's own thread the moment a run before it ends. With a depth
    of two (Vulkan chunks hold two run slots) the next run is queued on the device behind the
    one executing, so the device never idles while the host reads one run's outputs and writes
    the next one's inputs: a pipeline stage stays busy. The member's thread takes started runs
    from a queue, waits for each and completes it: outputs copied out, the next queued run
    started before anything else, then the request moved on. It polls the device only when no
    other run is queued behind the one it waits for (the device would idle until it is seen
    done); otherwise it sleeps in the driver with the interpreter lock free, which the threads
    of other members and the submitting thread need. Hand-overs use plain locks and a C queue:
    on small models the host's cost per request, not the devices, bounds throughput.
    """

    def __init__(self, executor: PlanExecutor, member_id: str, depth: int) -> None:
        self.executor = executor
        self.member_id = member_id
        self.depth = depth
        self._lock = threading.Lock()
        self._waiting: deque[tuple[_Request, _Stage]] = deque()  # ready, not yet started
        self._started: queue.SimpleQueue[tuple[_Request, _Stage, int, Any] | None] = queue.SimpleQueue()
        self._running = 0  # runs being started or in flight
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"vkpool-{member_id}", daemon=True)
        self._thread.start()

    def offer(self, request: _Request, stage: _Stage) -> None:
        with self._lock:
            if self._running >= self.depth or self._stopping:
                self._waiting.append((request, stage))
                return
            self._running += 1
        self._start(request, stage)

    def _start(self, request: _Request, stage: _Stage) -> None:
        """Starts this run, or the next startable one; gives its place back if none is."""
        item: tuple[_Request, _Stage] | None = (request, stage)
        while item is not None:
            request, stage = item
            if not request.failed:
                start = time.perf_counter_ns()
                feeds = {name: request.values[name] for name in stage.host_inputs}
                try:
                    if stage.linked_preds or stage.linked_succs:  # in the request's slot, after its preds
                        token = stage.chunk.start(feeds, request.slot, [request.signals[p] for p in stage.linked_preds])
                    else:
                        token = stage.chunk.start(feeds)
                except BaseException as exc:  # the request fails; the member serves the next one
                    self.executor._fail(request, exc)
                else:
                    with request.lock:
                        request.active += 1
                    self._started.put((request, stage, start, token))
                    if stage.linked_succs:
                        self.executor._submitted(request, stage, token)
                    return
            with self._lock:
                item = self._waiting.popleft() if self._waiting and not self._stopping else None
                if item is None:
                    self._running -= 1

    def _loop(self) -> None:
        while True:
            item = self._started.get()
            if item is None:
                return
            request, stage, start, token = item
            try:
                # a run whose outputs only linked chunks read is awaited by nobody (they waited
                # for it on the device): sleep in the driver, leaving the interpreter lock to the
                # threads that poll for what the request waits on
                produced: dict[str, np.ndarray] | BaseException = stage.chunk.finish(
                    token, spin=self._running < 2 and (bool(stage.host_outputs) or not stage.linked_succs),
                    outputs=stage.host_outputs)
            except BaseException as exc:
                produced = exc
            with self._lock:
                nxt = self._waiting.popleft() if self._waiting and not self._stopping else None
                if nxt is None:
                    self._running -= 1
            if nxt is not None:
                self._start(*nxt)
            self.executor._completed(request, stage, start, produced)

    def stop(self) -> None:
        """Lets the runs in flight end, drops the queued ones (their requests are failed by
        :meth:`PlanExecutor.close`) and ends the thread."""
        with self._lock:
            self._stopping = True
            self._waiting.clear()
        while True:  # a run being started or in flight ends on its own; closing is rare
            with self._lock:
                if not self._running:
                    break
            time.sleep(0.001)
        self._started.put(None)
        self._thread.join()


class LaneReports:
    """What an executor with ``lanes`` (and a ``_trace`` guarded by ``_trace_lock``) reports."""

    lanes: list[_Lane]
    _trace: deque[tuple[int, int, list[tuple[int, str, int, int, int]]]]
    _trace_lock: Any
    #: memory shared by linked chunks: (member id, allocation); none unless a subclass links chunks
    _shared: Sequence[tuple[str, Any]] = ()

    @property
    def members(self) -> list[str]:
        return list(dict.fromkeys(s.member.id for lane in self.lanes for s in lane.stages))

    @property
    def planned_transfers(self) -> list[Transfer]:
        """The cross-member stagings one request on the plan's own lane performs."""
        return [t for stage in self.lanes[0].stages for t in stage.transfers]

    def memory_by_member(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lane in self.lanes:
            for stage in lane.stages:
                s = stage.chunk.stats
                out[stage.member.id] = out.get(stage.member.id, 0) + s.weight_bytes + s.arena_bytes + s.io_bytes
        for member_id, alloc in self._shared:
            out[member_id] += alloc.nbytes
        return out

    def stats(self) -> ChunkStats:
        """The chunks' statistics summed (largest live set: the largest of any chunk)."""
        total = ChunkStats()
        for lane in self.lanes:
            for stage in lane.stages:
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
        with self._trace_lock:
            done = list(self._trace)
        return [ChunkEvent(rid, lane, *e) for rid, lane, events in done for e in events]


class PlanExecutor(LaneReports):
    """Builds a plan's chunks on pool members and runs requests through them (see module doc).
    ``link_on_device``: chunks on one device hand tensors over on the device, ordered by
    timeline semaphores (False: through host memory, as between devices)."""

    runs_in = "threads of this process"

    def __init__(self, pool: Any, model: LoadedModel, plan: Any, graph: Any, *, link_on_device: bool = True) -> None:
        self.model = model
        self.plan = plan
        self._closed = False
        self._ids = itertools.count()
        self._lane_lock = threading.Lock()
        self._trace_lock = self._lane_lock
        # (request id, lane, chunk runs) of the last requests; guarded by _lane_lock
        self._trace: deque[tuple[int, int, list[tuple[int, str, int, int, int]]]] = deque(maxlen=TRACE_REQUESTS)
        self.transfers_executed: Counter[tuple[str, str, str]] = Counter()
        self._count_lock = threading.Lock()
        self._runners: dict[str, _MemberRunner] = {}
        self._pending: dict[int, _Request] = {}
        self._input_names = [name for name, _ in model.inputs]
        self._output_names = [name for name, _ in model.outputs if name not in model.constants]
        self.lanes: list[_Lane] = plan_lanes(pool, model, plan, graph)
        self._shared: list[tuple[str, Any]] = []
        self._boundary: dict[str, list[Any]] = {}  # linked tensor → its memory per run slot
        lane = self.lanes[0]  # replicas run one chunk each: nothing to link
        if link_on_device and link_stages(model, lane.stages):
            lane.free_slots = list(range(RUN_SLOTS))
        try:
            for lane in self.lanes:
                for stage in lane.stages:
                    stage.chunk = build_chunk(self.model, stage, *self._linked_io(lane.stages, stage))
            for member_id in dict.fromkeys(s.member.id for lane in self.lanes for s in lane.stages):
                depth = min(s.chunk.slots for lane in self.lanes for s in lane.stages if s.member.id == member_id)
                self._runners[member_id] = _MemberRunner(self, member_id, depth)
        except BaseException:
            self.close()
            raise

    def _linked_io(self, stages: list[_Stage], stage: _Stage) -> tuple[list[dict[str, Any]] | None, list[Any]]:
        """For a stage with linked preds or succs: per run slot, the memory it shares with them
        (allocated by the producer, once per tensor and slot: device memory the host does not
        map, or host-visible memory when the host reads the tensor too), and its preds' timelines."""
        if not (stage.linked_preds or stage.linked_succs):
            return None, []
        linked_in = {n for p in stage.linked_preds for n in stages[p].outputs}
        shared = {name: self._boundary[name] for name in stage.inputs if name in linked_in}
        for name in stage.outputs:
            if any(name in stages[c].inputs for c in stage.linked_succs):
                host_visible = name in stage.host_outputs
                shared[name] = self._boundary[name] = []
                for _ in range(RUN_SLOTS):
                    alloc = stage.member.alloc(self.model.tensors[name].nbytes, host_visible=host_visible)
                    self._shared.append((stage.member.id, alloc))
                    shared[name].append(alloc)
        io = [{name: slots[r] for name, slots in shared.items()} for r in range(RUN_SLOTS)]
        return io, [stages[p].chunk.timeline for p in stage.linked_preds]

    # -- running -------------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray],
               shape: Callable[[dict[str, np.ndarray]], Any] | None = None) -> Future:
        """Starts one request; the future's result is ``{output name: array}``, or what
        ``shape`` makes of it (called once, in the thread that completes the request)."""
        if self._closed:
            raise RuntimeError("the executor is closed")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lane_lock:
            lane = min(self.lanes, key=lambda ln: (ln.in_flight, ln.index))
            lane.in_flight += 1
            request = _Request(next(self._ids), lane, dict(feeds), [len(s.preds) for s in lane.stages], future,
                               len(lane.stages), shape)
            self._pending[request.id] = request
            if lane.free_slots is not None:
                if not lane.free_slots:  # it starts when a request before it gives its slot back
                    lane.backlog.append(request)
                    return future
                request.slot = lane.free_slots.pop()
        self._offer_first(request)
        return future

    def _offer_first(self, request: _Request) -> None:
        for stage in request.lane.stages:
            if not stage.preds:
                self._runners[stage.member.id].offer(request, stage)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(feeds).result()

    def _submitted(self, request: _Request, stage: _Stage, slot: int) -> None:
        """A chunk run with linked successors was submitted: offer those whose preds are all
        submitted (linked) or done (the others); they wait on the device for this run."""
        ready: list[_Stage] = []
        with request.lock:
            request.signals[stage.index] = stage.chunk.signaled(slot)
            for succ in stage.linked_succs:
                request.waiting[succ] -= 1
                if request.waiting[succ] == 0:
                    ready.append(request.lane.stages[succ])
        for nxt in ready:
            self._runners[nxt.member.id].offer(request, nxt)

    def _completed(self, request: _Request, stage: _Stage, start: int,
                   produced: dict[str, np.ndarray] | BaseException) -> None:
        """A chunk run ended (in its member's thread): record it, offer the request's chunks
        that became ready to their members, and end the request after its last chunk."""
        if isinstance(produced, BaseException) or request.failed:
            with request.lock:
                request.active -= 1
            self._fail(request, produced if isinstance(produced, BaseException) else None)
            return
        event = (stage.index, stage.member.id, len(stage.nodes), start, time.perf_counter_ns())
        if stage.transfers:
            with self._count_lock:
                for t in stage.transfers:
                    self.transfers_executed[(t.tensor, t.src, t.dst)] += 1
        if len(request.lane.stages) == 1:
            # a one-chunk lane (a replica, a whole-model plan): nothing else touches the request
            request.values.update(produced)
            request.events.append(event)
            request.active -= 1
            self._finish(request)
            return
        ready: list[_Stage] = []
        with request.lock:
            request.values.update(produced)
            request.events.append(event)
            request.active -= 1
            for succ in stage.succs:
                if succ in stage.linked_succs:  # offered when this run was submitted
                    continue
                request.waiting[succ] -= 1
                if request.waiting[succ] == 0:
                    ready.append(request.lane.stages[succ])
            request.left -= 1
            finished = request.left == 0
        for nxt in ready:
            self._runners[nxt.member.id].offer(request, nxt)
        if finished:
            self._finish(request)

    def _end(self, request: _Request, *, traced: bool) -> bool:
        """Takes the request off its lane, once (``traced``: its runs go to the trace);
        False when it had ended already (a run of another branch failed it meanwhile)."""
        with self._lane_lock:
            if request.done:
                return False
            request.done = True
            request.lane.in_flight -= 1
            self._pending.pop(request.id, None)
            if traced:
                self._trace.append((request.id, request.lane.index, request.events))
        return True

    def _finish(self, request: _Request) -> None:
        ended = self._end(request, traced=True)
        self._give_back_slot(request)
        if not ended:
            return
        out = {}
        for name in self._output_names:
            value = request.values[name]
            out[name] = value.copy() if name in self._input_names else value
        try:
            result = out if request.shape is None else request.shape(out)
        except BaseException as exc:
            request.future.set_exception(exc)
            return
        request.future.set_result(result)

    def _fail(self, request: _Request, exc: BaseException | None) -> None:
        """Fails the request with ``exc`` (once; None: it failed already) and gives its run
        slot back when none of its runs is left on a device."""
        with request.lock:
            first = not request.failed
            request.failed = True
        if first and self._end(request, traced=False) and exc is not None:
            request.future.set_exception(exc)
        self._give_back_slot(request)

    def _give_back_slot(self, request: _Request) -> None:
        """Once a request is done and none of its runs is in flight, its run slot goes to the
        first request waiting for one (which then starts), or back to the lane's free ones."""
        lane = request.lane
        with request.lock:
            if request.slot < 0 or request.active or not request.done:
                return
            slot, request.slot = request.slot, -1
        with self._lane_lock:
            nxt = lane.backlog.popleft() if lane.backlog and not self._closed else None
            if nxt is None:
                lane.free_slots.append(slot)  # type: ignore[union-attr]
            else:
                nxt.slot = slot
        if nxt is not None:
            self._offer_first(nxt)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for runner in self._runners.values():
            runner.stop()
        # a request whose next chunk was queued after its member's worker stopped never ends, nor
        # one waiting for a run slot (a closed executor gives none out): fail them
        with self._lane_lock:
            for lane in self.lanes:
                lane.backlog.clear()
        for request in list(self._pending.values()):
            self._fail(request, RuntimeError("the session was closed before this request finished"))
        for lane in self.lanes:
            for stage in lane.stages:
                if stage.chunk is not None:
                    stage.chunk.close()
                    stage.chunk = None
        for _, alloc in self._shared:
            alloc.free()
        self._shared = []


__all__ = ["PlanExecutor", "LaneReports", "MemberGroup", "ChunkEvent", "stage_nodes", "plan_groups", "plan_lanes",
           "build_chunk", "TRACE_REQUESTS", "RUN_SLOTS"]
