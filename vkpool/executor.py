"""Running a partition Plan in threads of this process: one recorded chunk per plan chunk,
requests pipelined across members.

A :class:`PlanExecutor` builds, for every chunk of a :class:`~vkpool.partition.plan.Plan`, a
:class:`~vkpool.engine.VulkanChunk` (recorded once) or a :class:`~vkpool.engine.HostChunk` on
its member, and for every replica member one whole-model chunk. A request's bookkeeping (which
copy of the model, its place, its stages' dependencies, failure, trace, outputs) is
:class:`~vkpool.pipeline.Pipeline`'s; here is how its stages run:

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
  tensor stays on the device (unless ``link_on_device`` is False): producer and consumer share
  its memory, one allocation per run slot, and the consumer is submitted as soon as the
  producer is, waiting on the device for the value the producer's run signals on its timeline
  semaphore (no host round trip between them). The plan's copy then has ``RUN_SLOTS`` places,
  the run slot indices: a request holds one for its whole life and every linked chunk runs it
  in that slot, so the shared memory of a slot belongs to one request at a time.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from vkpool.engine import HostChunk, VulkanChunk
from vkpool.model import LoadedModel
from vkpool.pipeline import (TRACE_REQUESTS, ChunkEvent, ModelCopy, Pipeline, Request, Shape, Stage, back_to_back,
                             plan_copies, submit_all)

#: runs a member's Vulkan chunk may have on the device at once: one executing, one queued
RUN_SLOTS = 2


class MemberGroup:
    """The members a session's plan runs on; ``id`` joins theirs with ``+`` (``vk0.0+vk0.1``)."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.members = list(members)
        self.id = "+".join(m.id for m in self.members)

    def __repr__(self) -> str:
        return f"MemberGroup({self.id})"


def link_stages(model: LoadedModel, stages: list[Stage]) -> bool:
    """Marks every edge between Vulkan chunks on one logical device as linked (its tensors
    stay on the device) and narrows each stage's host inputs and outputs to the rest; returns
    whether any edge is linked."""
    from vkpool.pool import VulkanMember

    def device(stage: Stage) -> Any:
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


def build_chunk(model: LoadedModel, stage: Stage, io: Sequence[Mapping[str, Any]] | None = None,
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
        self._waiting: deque[tuple[Request, Stage]] = deque()  # ready, not yet started
        self._started: queue.SimpleQueue[tuple[Request, Stage, Any] | None] = queue.SimpleQueue()
        self._running = 0  # runs being started or in flight
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"vkpool-{member_id}", daemon=True)
        self._thread.start()

    def offer(self, request: Request, stage: Stage) -> None:
        with self._lock:
            if self._running >= self.depth or self._stopping:
                self._waiting.append((request, stage))
                return
            self._running += 1
        self._start(request, stage)

    def _start(self, request: Request, stage: Stage) -> None:
        """Starts this run, or the next startable one; gives its place back if none is."""
        item: tuple[Request, Stage] | None = (request, stage)
        while item is not None:
            request, stage = item
            if request.error is None:
                request.started[stage.index] = time.perf_counter_ns()
                feeds = {name: request.values[name] for name in stage.host_inputs}
                try:
                    if stage.linked_preds or stage.linked_succs:  # in the request's slot, after its preds
                        token = stage.chunk.start(feeds, request.place, [request.signals[p] for p in stage.linked_preds])
                    else:
                        token = stage.chunk.start(feeds)
                except BaseException as exc:  # the request fails; the member serves the next one
                    self.executor._run_ended(request, stage, exc)
                else:
                    self._started.put((request, stage, token))
                    if stage.linked_succs:
                        request.signals[stage.index] = stage.chunk.signaled(token)
                        self.executor._run_submitted(request, stage)
                    return
            else:
                self.executor._run_ended(request, stage, None)
            with self._lock:
                item = self._waiting.popleft() if self._waiting and not self._stopping else None
                if item is None:
                    self._running -= 1

    def _loop(self) -> None:
        while True:
            item = self._started.get()
            if item is None:
                return
            request, stage, token = item
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
            self.executor._run_ended(request, stage, produced)

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


class PlanExecutor(Pipeline):
    """Builds a plan's chunks on pool members and runs requests through them (see module doc).
    ``link_on_device``: chunks on one device hand tensors over on the device, ordered by
    timeline semaphores (False: through host memory, as between devices)."""

    runs_in = "threads of this process"

    def __init__(self, pool: Any, model: LoadedModel, plan: Any, graph: Any, *, link_on_device: bool = True) -> None:
        super().__init__(model, plan, plan_copies(pool, model, plan, graph))
        self._runners: dict[str, _MemberRunner] = {}
        self._shared: list[tuple[str, Any]] = []
        self._boundary: dict[str, list[Any]] = {}  # linked tensor → its memory per run slot
        first = self.copies[0]  # replicas run one chunk each: nothing to link
        if link_on_device and link_stages(model, first.stages):
            first.free = list(range(RUN_SLOTS))
        try:
            for copy in self.copies:
                for stage in copy.stages:
                    stage.chunk = build_chunk(self.model, stage, *self._linked_io(copy.stages, stage))
            for member_id in self.members:
                depth = min(s.chunk.slots for copy in self.copies for s in copy.stages if s.member.id == member_id)
                self._runners[member_id] = _MemberRunner(self, member_id, depth)
        except BaseException:
            self.close()
            raise

    def _linked_io(self, stages: list[Stage], stage: Stage) -> tuple[list[dict[str, Any]] | None, list[Any]]:
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

    def _launch(self, request: Request, stage: Stage) -> None:
        self._runners[stage.member.id].offer(request, stage)

    def run_many(self, feeds: Iterable[Mapping[str, np.ndarray]], shape: Shape | None = None,
                 each: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Runs several requests and returns each one's result, or the exception it raised (it
        fails alone); ``each(index, result)`` as each ends, in order. Where every copy of the model is one chunk (a
        whole model on one member: the copies of a throughput plan), this thread drives them
        itself: each request starts on the next copy in turn, with every copy's run slots in
        flight (:func:`~vkpool.pipeline.back_to_back`), and ends in order, with no thread of a
        member in between; such runs are counted in :meth:`stats` but not traced. Otherwise the
        requests are submitted together and waited for in order."""
        live = [c for c in self.copies if c.alive]
        if not live or any(len(c.stages) != 1 for c in live):
            return submit_all(lambda one: self.submit(one, shape), feeds, each)
        stages = [c.stages[0] for c in live]
        turn = itertools.cycle(range(len(stages)))
        counts, lock, outputs = self._counts, self._lock, self._output_names
        copied = self._input_names

        def start(one: Mapping[str, np.ndarray]) -> tuple[Stage, Any]:
            with lock:
                if self._closed:
                    raise RuntimeError("the executor is closed")
                counts.accepted += 1
                self._driving += 1
                counts.pending = len(self._pending) + self._driving
            stage = stages[next(turn)]
            try:
                return stage, stage.chunk.start({n: one[n] for n in stage.inputs})
            except BaseException:
                ended(False)
                raise

        def finish(handle: tuple[Stage, Any]) -> Any:
            stage, slot = handle
            try:
                produced = stage.chunk.finish(slot)
                out = {n: produced[n].copy() if n in copied else produced[n] for n in outputs}
                if shape is not None:
                    out = shape(out)
            except BaseException:
                ended(False)
                raise
            ended(True)
            return out

        def ended(ok: bool) -> None:
            with lock:
                self._driving -= 1
                counts.pending = len(self._pending) + self._driving
                if ok:
                    counts.ok += 1
                else:
                    counts.failed += 1

        # round robin over copies of equal depth: the oldest run in flight is on the copy the
        # next one starts on, and is finished first
        depth = len(stages) * min(getattr(st.chunk, "slots", 1) for st in stages)
        return back_to_back(start, finish, feeds, depth, each)

    def staged(self, block: bool = True) -> Any:
        """Where every copy of the model is one chunk (the copies of a throughput plan): a run slot
        of the first copy with one free (so batches started one behind another, as the daemon's
        lanes' thread starts them, keep to one device, whose clocks stay up: taken in turn, each
        device idled half the time and two served less than one), else of the copy with the
        fewest requests in flight, held for a caller that writes the inputs into
        it and reads the outputs in place (:meth:`vkpool.engine.VulkanChunk.staged`), counted as
        a request of this executor and of that copy until it is given back; None otherwise, or
        where that copy has no such slot (a host member's). ``block`` False: raises
        :class:`queue.Empty` at once when that copy's slots are all in use."""
        counts, lock = self._counts, self._lock
        with lock:
            if self._closed:
                raise RuntimeError("the executor is closed")
            live = [c for c in self.copies if c.alive]
            if not live or any(len(c.stages) != 1 for c in live):
                return None
            def busy(c: Any) -> tuple[bool, int, int]:  # (no free slot, runs in flight when none, index)
                full = c.in_flight >= getattr(c.stages[0].chunk, "slots", 1)
                return full, c.in_flight if full else 0, c.index

            copy = min(live, key=busy)
            stage_of = getattr(copy.stages[0].chunk, "staged", None)
            if stage_of is None:
                return None
            counts.accepted += 1
            copy.in_flight += 1
            self._driving += 1
            counts.pending = len(self._pending) + self._driving

        def ended(ok: bool, counted: bool = True) -> None:
            with lock:
                copy.in_flight -= 1
                self._driving -= 1
                counts.pending = len(self._pending) + self._driving
                if not counted:
                    counts.accepted -= 1
                elif ok:
                    counts.ok += 1
                else:
                    counts.failed += 1

        try:
            run = stage_of(ended, block)
        except queue.Empty:
            ended(False, counted=False)
            raise
        except BaseException:
            ended(False)
            raise
        if run is None:
            ended(False, counted=False)
        return run

    def _stop(self) -> None:
        # a stage queued behind a stopped member never runs: close fails its request
        for runner in self._runners.values():
            runner.stop()

    def _free(self) -> None:
        for copy in self.copies:
            for stage in copy.stages:
                if stage.chunk is not None:
                    stage.chunk.close()
                    stage.chunk = None
        for _, alloc in self._shared:
            alloc.free()
        self._shared = []


__all__ = ["PlanExecutor", "MemberGroup", "ChunkEvent", "ModelCopy", "link_stages", "build_chunk", "TRACE_REQUESTS",
           "RUN_SLOTS"]
