"""A model on the cluster: placed over every node's members, run by the nodes' actors.

The plan is :func:`vkpool.partition.place_model`'s over the cluster's members (their links
include the network, :mod:`vkpool.cluster.links`), as ``vkpool plan --cluster`` shows it. It
runs in *copies*, as :class:`vkpool.executor.PlanExecutor` does on one machine: copy 0 is the
plan's chunks, copy k the whole model on replica k. A copy whose plan is one chunk, and every
replica, is a :class:`vkpool.Session` on that member's node (batching included). A plan over
several nodes runs as steps, each a run of consecutive chunks on one node: the request's feeds
are put in the object store once, and each step is a call on its node's actor that receives the
object references of the steps it reads from, so that Ray moves a tensor from the node that made
it to the node that reads it, never through the caller. Only the steps that make model outputs
return to the caller.

Each request goes to the copy with the fewest requests in flight. When a node's actor dies, its
copies go down and their requests in flight go to another copy where there is one; each gets a
clear error where there is none. A thread then waits for Ray to restart the actor, opens the
model on it again and puts the copy back.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from vkpool.errors import InvalidInput
from vkpool.pipeline import IDLE

#: requests one call to a copy carries at most, and calls each step of a copy may keep in flight
#: (a replica is one step; a plan over two nodes two). A Ray call costs the driver and the node's
#: actor a fixed amount of work whatever it carries, so requests that wait for a copy share a
#: call, packed (vkpool.cluster.rows); calls in flight let a node run one call while the next
#: travels, and every stage of a plan over nodes work at once on calls of its own. A copy keeps
#: as many calls in flight as its requests fill, MAX_BUNDLE each, at least MIN_CALLS and at most
#: CALLS_PER_STEP per step: full calls cost a node the least per request, and under a light load
#: a node still has the next call while it answers one. ``ClusterSession(max_bundle=,
#: calls_per_step=)`` sets them per session. NOTE: two H200 nodes on one host, 256 requests in
#: flight (docs/gpu/h200x2-cluster.md): mnist12_like replicas, 12,353 jobs/s on one node with
#: calls of 64 (4 in flight) against 10,633 with calls of 32; on two nodes 18,992 with 2 calls of
#: 64 per node, 16,081 with 4 of 32. As calls fill: 12,231 on one node, 17,656 on two (20,845
#: with 512 in flight); a split of conv_many_255MB 1.46x one node
MAX_BUNDLE = 64
_END, _FLUSH = object(), object()
#: what the packing of a call adds to its tensors' bytes, at most (pickle's framing, the names).
#: A call's feeds are kept under the largest argument the driver's Ray sends inside the call
#: (``Cluster.inline_bytes``) where requests are small enough: a larger one goes through the
#: object store, which from the driver's node to another node costs a transfer of several
#: milliseconds (bench.cluster's hop: 5-9 ms on one host), so that a call reaches any node as
#: fast as the driver's own. Calls of 64 mnist12_like requests through the store left the second
#: of two nodes idle half the time (two H200 nodes on one host: its actor at 0.51 CPU s/s against
#: 0.80 for the node of the driver, docs/cluster.md)
INLINE_SLACK = 2048
#: a model split over nodes hands its stages' tensors from node to node through Ray's object
#: store, whose throughput grows with what one transfer carries (bench.cluster's hop figures: 180
#: MiB/s with transfers of 1 MiB, 469 with 3.5 MiB, 883 with 14 MiB, eight in flight). So the calls
#: of a split carry, unless told otherwise, enough requests for its largest hand-over to reach
#: HANDOVER_BYTES, from MAX_BUNDLE up to SPLIT_MAX_BUNDLE; a copy still sends only the requests
#: that wait (a light load makes small calls). NOTE: two H200 nodes on one host, conv_many_255MB
#: split in two stages (57 KiB a request between them), two nodes against one over 3 rounds:
#: 1.29 (1.27-1.39) with calls of 64, 1.39 (1.38-1.40) with 128, 1.42 (1.35-1.45) with 256
#: (docs/cluster.md)
HANDOVER_BYTES = 16 << 20
SPLIT_MAX_BUNDLE = 256
CALLS_PER_STEP = 4
MIN_CALLS = 2
#: how often a session looks for a restarted actor of a copy that went down, in seconds
REVIVE_EVERY_S = 0.5
#: how long a restarted actor may take to answer before the next look
PING_TIMEOUT_S = 5.0


class NodeLost(RuntimeError):
    """A node's actor died while it ran the request, and no other copy could take it."""


@dataclass
class _Step:
    """Consecutive chunks of copy 0 on one node."""

    node: str
    chunks: list[int]
    preds: list[int]  # steps whose outputs it reads
    reads_feeds: bool
    outputs: list[str]  # model outputs it makes


@dataclass(eq=False)
class _Copy:
    index: int
    key: str
    nodes: list[str]
    member: str | None  # a copy on one member (a Session there); None: steps
    steps: list[_Step] = field(default_factory=list)
    in_flight: int = 0  # requests given to it: queued or in a call
    queued: int = 0  # requests in ``queue``
    served: int = 0  # requests it completed
    down: str | None = None  # why it is down
    queue: deque = field(default_factory=deque)  # _Pending waiting for a call
    calls: dict[int, list] = field(default_factory=dict)  # calls in flight: their _Pending
    max_calls: int = CALLS_PER_STEP


class _Pending:
    """Requests the session has not answered, which travel together: given to a copy (queued or
    in a call), or being given to another. One request of :meth:`ClusterSession.submit` (its
    future gets the request's outputs), or a group of :meth:`ClusterSession.run_many` (its future
    gets the group's :class:`~vkpool.cluster.rows.Rows`, which the caller's thread splits)."""

    __slots__ = ("rows", "names", "future", "tried", "group")

    def __init__(self, rows: list[dict[str, np.ndarray]], names: list[str], future: Future,
                 tried: set[int], group: bool = False) -> None:
        self.rows, self.names, self.future, self.tried, self.group = rows, names, future, tried, group


class ClusterSession:
    """``vkpool.Session`` over a cluster (see the module doc). ``model``: a path or the model's
    bytes; ``objective``, ``devices`` (cluster member ids), ``budgets`` (cluster member id →
    size, set on the nodes), ``plan`` (a Plan made for this model on these members),
    ``batch``, ``dims``, ``max_batch``, ``max_queue_delay`` as for :class:`vkpool.Session`;
    ``max_bundle``: requests one call carries at most (default: :data:`MAX_BUNDLE`, or fewer where
    that many requests' feeds would not travel inside Ray's call, :data:`INLINE_SLACK`),
    ``calls_per_step``: calls each step of a copy may keep in flight (:data:`CALLS_PER_STEP`).

    ``name`` shares the session: sessions of one name, in any driver process, run on the same
    copies (:class:`~vkpool.cluster.node.Names`). The first one plans and opens them; the others
    take its plan and hold the copies too, which close once no driver holds them. Sessions of a
    name must open the same model with the same options (else refused): as Ray Serve's callers of
    one deployment, several drivers then feed one set of replicas."""

    def __init__(self, cluster: Any, model: str | os.PathLike | bytes, *, objective: str = "latency",
                 devices: Sequence[str] | None = None, budgets: Mapping[str, int | str] | None = None,
                 plan: Any = None, batch: int = 1, dims: Mapping[str, int] | None = None,
                 max_batch: int | None = None, max_queue_delay: float = 0.0, max_bundle: int | None = None,
                 calls_per_step: int = CALLS_PER_STEP, name: str | None = None) -> None:
        import pickle

        import ray

        from vkpool.cluster.placement import place_on_cluster

        self.cluster = cluster
        self._ray = ray
        self._closed = False
        self._lock = threading.Lock()
        self._copies: list[_Copy] = []
        self.name = name
        # what holds its copies on the nodes: the driver's lease (the nodes close what a gone
        # driver held), and this session (sessions of one name in one driver hold them apart)
        self._holder = f"{cluster.lease}#{uuid.uuid4().hex[:8]}"
        self._reviver: threading.Thread | None = None
        # completions are handled here, not in Ray's thread that completes a reference: handling
        # one may start calls (a request sent to another copy) and runs the callers' callbacks
        # while the completion thread answers a call: the copies whose queues it flushes after
        # (``deferred``, see _gather)
        self._answering = threading.local()
        self._completions = ThreadPoolExecutor(1, thread_name_prefix="vkpool-cluster",
                                               initializer=_name_os_thread, initargs=("vkpool-cluster",))
        if (max_bundle is not None and max_bundle < 1) or calls_per_step < 1:
            raise ValueError(f"max_bundle and calls_per_step must be at least 1, got {max_bundle} and "
                             f"{calls_per_step}")
        self._max_bundle, self._calls_per_step = max_bundle or MAX_BUNDLE, calls_per_step
        self._call_ids = iter(range(1 << 62))
        data = bytes(model) if isinstance(model, (bytes, bytearray)) else Path(os.fspath(model)).read_bytes()
        self._batch, self._dims = batch, dict(dims or {})
        for member_id, size in (budgets or {}).items():
            cluster.set_budget(member_id, size)
        members = cluster.planner_members()
        digest = held = None
        if name is not None:  # a shared session: the plan of the name where a driver holds it
            import hashlib

            asked = pickle.dumps((objective, devices, sorted((budgets or {}).items()), plan, batch,
                                  sorted(self._dims.items()), max_batch, max_queue_delay))
            hashed = hashlib.sha256(data)
            hashed.update(asked)
            digest = hashed.hexdigest()
            held = ray.get(cluster.names.plan_of.remote(name, digest))

        def place(given: Any) -> None:
            self.model, self.graph, self.placement = place_on_cluster(
                data, members, objective=objective, devices=None if given is not plan else devices,
                plan=given, batch=batch, dims=self._dims)

        place(plan if held is None else pickle.loads(held))
        self._key = uuid.uuid4().hex[:12]
        if name is not None:
            # the plan taken from the name as it was stored (a plan pickled again after a round trip
            # need not give the same bytes), or this one's
            mine = held if held is not None else pickle.dumps(self.placement)
            held, token = ray.get(cluster.names.claim.remote(name, digest, mine, self._holder))
            if held != mine:  # the name changed hands meanwhile: the plan held now
                place(pickle.loads(held))
            self._key = f"{name}-{token}"
        self.load_options = {"batch": batch, "dims": self._dims}
        self._options: dict[str, Any] = dict(self.load_options)
        if max_batch is not None:
            self._options.update(max_batch=max_batch, max_queue_delay=max_queue_delay)
        if max_batch is not None and len(self.placement.chunks) > 1:
            raise ValueError("max_batch batches requests on one member; this plan splits the model over "
                             f"{', '.join(dict.fromkeys(c.member for c in self.placement.chunks))}: leave "
                             "max_batch unset, or give budgets that hold the model on one member")
        self.model_bytes = data
        self._model_ref = ray.put(data)
        self._inputs = {name: (np.dtype(info.dtype), tuple(info.shape)) for name, info in self.model.inputs}
        row = sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in self._inputs.values())
        inline = cluster.inline_bytes - INLINE_SLACK
        if max_bundle is None and 0 < row <= inline:  # calls that travel inside Ray's call
            self._max_bundle = min(MAX_BUNDLE, inline // row)
        handed = self._largest_handover()
        if max_bundle is None and handed:  # a split: calls whose hand-overs the store moves well
            self._max_bundle = max(self._max_bundle, min(SPLIT_MAX_BUNDLE, -(-HANDOVER_BYTES // handed)))
        self._output_names = [name for name, _ in self.model.outputs]
        try:
            self._copies = self._make_copies()
            ray.get([ref for copy in self._copies for ref in self._open(copy)])
        except BaseException:
            self.close()
            raise

    # -- copies ---------------------------------------------------------------------------------
    def _largest_handover(self) -> int:
        """Bytes of one request that the plan hands from one node to another, on its largest
        hop (0: the plan does not cross nodes)."""
        from vkpool.cluster.links import node_of

        hops: Counter[tuple[str, str]] = Counter()
        for t in self.placement.transfers:
            src, dst = node_of(t.src), node_of(t.dst)
            if src != dst:
                hops[src, dst] += t.nbytes
        return max(hops.values(), default=0)

    def _make_copies(self) -> list[_Copy]:
        from vkpool.cluster.links import node_of

        plan = self.placement
        copies = []
        if len(plan.chunks) == 1:
            member = plan.chunks[0].member
            copies.append(_Copy(0, f"{self._key}:0", [node_of(member)], member))
        else:
            copies.append(_Copy(0, f"{self._key}:0", [], None, self._steps()))
            copies[0].nodes = list(dict.fromkeys(s.node for s in copies[0].steps))
        for k, member in enumerate(plan.replicas, start=1):
            copies.append(_Copy(k, f"{self._key}:{k}", [node_of(member)], member))
        for copy in copies:
            copy.max_calls = self._calls_per_step * max(1, len(copy.steps))
        return copies

    def _steps(self) -> list[_Step]:
        from vkpool.cluster.links import node_of

        plan = self.placement
        uses = self.graph.graph["tensors"]
        outputs = set(self._output_names)
        steps: list[_Step] = []
        step_of: dict[int, int] = {}
        for chunk in plan.chunks:
            node = node_of(chunk.member)
            if not steps or steps[-1].node != node:
                steps.append(_Step(node, [], [], False, []))
            steps[-1].chunks.append(chunk.index)
            step_of[chunk.index] = len(steps) - 1
        for s, step in enumerate(steps):
            for index in step.chunks:
                chunk = plan.chunks[index]
                step.preds += [step_of[p] for p in chunk.preds if step_of[p] != s]
                for op in chunk.ops:
                    attrs = self.graph.nodes[op]
                    step.reads_feeds |= any(uses[t].producer is None for t in attrs["inputs"])
                    step.outputs += [t for t in attrs["outputs"] if t in outputs]
            step.preds = sorted(set(step.preds))
        return steps

    def _open(self, copy: _Copy) -> list[Any]:
        """Opens the copy on its nodes; returns the calls' references."""
        from vkpool.cluster.links import node_of

        actors = self.cluster.actors
        if copy.member is not None:
            node = node_of(copy.member)
            return [actors[node].open_replica.remote(copy.key, self._holder, self._model_ref,
                                                     copy.member[len(node) + 1:], self._options)]
        plan = self.placement
        chunks = [(c.member, list(c.ops)) for c in plan.chunks]
        return [actors[node].open_chunks.remote(copy.key, self._holder, self._model_ref, node,
                                                dict(plan.member_of), chunks, dict(self.model.column_splits),
                                                self._batch, self._dims)
                for node in copy.nodes]

    # -- running -------------------------------------------------------------------------------
    def get_inputs(self, symbolic: bool = False) -> list[Any]:
        """The inputs, with the shapes fixed at load (``symbolic`` is accepted as
        :meth:`vkpool.Session.get_inputs` takes it: a cluster runs the shapes bound at load)."""
        from vkpool.session import NodeArg

        return [NodeArg(n, list(i.shape), i.dtype) for n, i in self.model.inputs]

    def get_outputs(self) -> list[Any]:
        from vkpool.session import NodeArg

        return [NodeArg(n, list(i.shape), i.dtype) for n, i in self.model.outputs]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[np.ndarray]:
        """Runs the model; returns the outputs named (all, in model order, when None)."""
        return self.submit(input_feed, output_names).result()

    def submit(self, input_feed: Mapping[str, Any], output_names: Sequence[str] | None = None) -> Future:
        """Starts a run on the least-loaded copy; returns a future of its outputs."""
        if self._closed:
            raise RuntimeError("the session is closed")
        feeds = self._check_feeds(input_feed)
        names = self._output_names if output_names is None else self._output_list(output_names)
        future: Future = Future()
        future.set_running_or_notify_cancel()
        self._dispatch(_Pending([feeds], names, future, set()))
        return future

    def run_many(self, input_feeds: Iterable[Mapping[str, Any]], output_names: Sequence[str] | None = None,
                 each: Callable[[int, Any], None] | None = None, *,
                 window: int | None = None) -> list[list[np.ndarray] | Exception]:
        """Runs several requests and returns, for each, its outputs or the exception it raised,
        as :meth:`vkpool.Session.run_many` does (a request that fails, its feeds refused
        included, fails alone); ``each(index, result)`` as each one ends, in order (a request
        that ends before one given earlier is reported after it, but frees its place at once).

        ``input_feeds`` is read lazily, with up to ``window`` requests in flight (default: as
        many as every copy's calls hold, ``max_bundle`` each; :data:`vkpool.pipeline.IDLE` sends
        what was read and ends it before reading on). They travel in groups, a group
        a call's worth for one copy (at most ``max_bundle``, and small enough that every copy
        gets two calls of the window): a group is one entry in the session's queues and one
        answer, where :meth:`submit` costs that per request, so a caller with many inputs at hand
        keeps more copies busy from one thread."""
        if self._closed:
            raise RuntimeError("the session is closed")
        names = self._output_list(output_names)
        with self._lock:
            up = [c for c in self._copies if c.down is None] or self._copies
            if window is None:
                window = sum(c.max_calls for c in up) * self._max_bundle
            size = max(1, min(self._max_bundle, window // (2 * len(up))))
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        out: list[Any] = []  # each request's result; None while it runs
        ended: queue.SimpleQueue = queue.SimpleQueue()  # groups whose calls ended, as they end
        sent, flying, reported = 0, 0, 0  # groups and requests in flight, requests reported

        def deliver() -> None:  # the results of the group that ends first (any: none waits for another)
            nonlocal sent, flying
            live, fed, future = ended.get()
            sent, flying = sent - 1, flying - len(live)
            try:
                rows = future.result()
            except Exception as exc:
                rows = exc
            for k, index in enumerate(live):
                out[index] = rows if isinstance(rows, Exception) else self._outputs_of(rows, k, names, fed[k])
            report()

        def report() -> None:  # each result known, in order
            nonlocal reported
            while reported < len(out) and out[reported] is not None:
                if each is not None:
                    each(reported, out[reported])
                reported += 1

        live: list[int] = []
        feeds: list[dict[str, np.ndarray]] = []
        source = iter(input_feeds)
        while True:
            given = next(source, _END)
            if given is IDLE:  # nothing more ready: send what is read, and end what is sent
                given = _FLUSH
            elif given is not _END:
                try:
                    feeds.append(self._check_feeds(given))
                    live.append(len(out))
                    out.append(None)
                except Exception as exc:  # refused: it fails alone
                    out.append(exc)
            if live and (len(live) >= size or given is _END or given is _FLUSH):
                future: Future = Future()
                future.set_running_or_notify_cancel()
                future.add_done_callback(lambda f, group=(live, feeds, future): ended.put(group))
                sent, flying = sent + 1, flying + len(live)
                self._dispatch(_Pending(feeds, names, future, set(), group=True))
                live, feeds = [], []
            while sent and (flying + size > window or given is _END or given is _FLUSH):
                deliver()
            if given is _END:
                break
        report()  # the refusals after the last group
        return out

    def _dispatch(self, pending: _Pending, why: str = "") -> None:
        with self._lock:
            copy = None
            for c in self._copies:
                if c.down is None and c.index not in pending.tried and (
                        copy is None or c.in_flight < copy.in_flight):
                    copy = c
            if copy is not None and not self._closed:
                copy.in_flight += len(pending.rows)
                copy.queued += len(pending.rows)
                pending.tried.add(copy.index)
                copy.queue.append(pending)
                free, share = self._room(copy)
                send = free > 0 and (not copy.calls or copy.queued >= share)
            else:
                down = [f"copy {c.index} on {', '.join(c.nodes)}: {c.down}" for c in self._copies if c.down]
        if copy is None:
            _settle(pending.future, NodeLost(
                (why or "every copy of this model is down") + "; no other replica can take the request"
                + (f" ({'; '.join(down)})" if down else "") + ". It runs again once Ray restarts the node's "
                "vkpool actor (the session reopens the model there)."))
        elif self._closed:
            _settle(pending.future, RuntimeError("the session was closed before this request finished"))
        elif send:
            deferred = getattr(self._answering, "deferred", None)
            if deferred is not None:
                deferred.add(copy)
            else:
                self._flush(copy)

    def _flush(self, copy: _Copy) -> None:
        """Sends what waits on ``copy`` while it has room for another call (:meth:`_room`). A
        call carries an even share of the copy's requests in flight: a copy with calls in flight
        waits for that many to queue before it starts another, or for a call to end, so that
        calls do not shrink to one request each under load (a call that ends frees room while
        its requests' callers have not yet sent the next ones); an idle copy sends at once."""
        while True:
            with self._lock:
                free, share = self._room(copy)
                waiting = copy.queued
                if free <= 0 or not waiting or copy.down is not None:
                    return
                if copy.calls and waiting < share:
                    return
                size = min(waiting, self._max_bundle, max(share, -(-waiting // free)))
                bundle, taken = [], 0
                while taken < size:  # whole groups (a group is at most max_bundle)
                    bundle.append(copy.queue.popleft())
                    taken += len(bundle[-1].rows)
                copy.queued -= taken
                call = next(self._call_ids)
                copy.calls[call] = bundle
            try:
                refs = self._start(copy, bundle)
            except BaseException as exc:
                with self._lock:
                    del copy.calls[call]
                for pending in bundle:
                    self._ended(copy, pending)
                    _settle(pending.future, exc)
                continue
            self._gather(copy, call, refs)

    def _room(self, copy: _Copy) -> tuple[int, int]:
        """(calls ``copy`` may start now, requests a call of it carries when it is busy): as many
        calls as its requests in flight fill, ``max_bundle`` each, between MIN_CALLS and its
        ``max_calls``; each an even share of those requests. Under the session's lock."""
        calls = min(copy.max_calls, max(MIN_CALLS, -(-copy.in_flight // self._max_bundle)))
        return calls - len(copy.calls), max(1, min(self._max_bundle, copy.in_flight // calls))

    def _start(self, copy: _Copy, bundle: list[_Pending]) -> list[Any]:
        """The calls of some requests on ``copy``: the references whose values hold their outputs."""
        from vkpool.cluster.rows import Rows

        actors = self.cluster.actors
        feeds = Rows.pack([f for p in bundle for f in p.rows], self._inputs)
        if copy.member is not None:
            return [actors[copy.nodes[0]].run.remote(copy.key, feeds)]
        readers = sum(step.reads_feeds for step in copy.steps)
        feeds_arg = self._ray.put(feeds) if readers > 1 else feeds
        refs: list[Any] = []
        for step in copy.steps:
            args = ([feeds_arg] if step.reads_feeds else []) + [refs[p] for p in step.preds]
            refs.append(actors[step.node].run_chunks.remote(copy.key, step.chunks, *args))
        return [refs[s] for s, step in enumerate(copy.steps) if step.outputs]

    def _gather(self, copy: _Copy, call: int, refs: list[Any]) -> None:
        left = [len(refs)]
        parts: list[Any] = [None] * len(refs)
        gate = threading.Lock()

        def done(k: int, part: Future) -> None:
            with gate:
                if left[0] <= 0:
                    return
                exc = part.exception()
                if exc is not None:
                    left[0] = 0
                else:
                    parts[k] = part.result()
                    left[0] -= 1
                    if left[0]:
                        return
            with self._lock:
                bundle = copy.calls.pop(call, None)
            if bundle is None:  # the session closed, which failed them
                return
            # requests that the callers' callbacks submit while this call's are answered leave
            # together once all are answered: a call's worth of answers then makes a call's worth
            # of new requests, not a call of the first and another of the rest
            self._answering.deferred = deferred = {copy}
            try:
                if exc is None:
                    self._answer(copy, bundle, parts)
                elif self._node_failed(exc):
                    self._copy_down(copy, exc)
                    why = f"copy {copy.index} failed: {_first_line(exc)}"
                    for pending in bundle:
                        self._ended(copy, pending)
                        self._dispatch(pending, why=why)
                else:
                    for pending in bundle:
                        self._ended(copy, pending)
                        _settle(pending.future, _cause(exc))
            finally:
                self._answering.deferred = None
            for waiting in sorted(deferred, key=lambda c: c.index):
                self._flush(waiting)

        for k, ref in enumerate(refs):
            ref.future().add_done_callback(lambda part, k=k: self._later(done, k, part))

    def _answer(self, copy: _Copy, bundle: list[_Pending], parts: list[Any]) -> None:
        """Gives each request of a call its outputs (views of the call's packed outputs), or its
        own error; a group its rows."""
        from vkpool.cluster.rows import Rows, merge

        try:
            rows = merge(parts).writable()
        except Exception as exc:
            for pending in bundle:
                self._ended(copy, pending)
                _settle(pending.future, exc)
            return
        count = sum(len(p.rows) for p in bundle)
        with self._lock:
            copy.in_flight -= count
            copy.served += count - len(rows.failed)
        start = 0
        for pending in bundle:
            n = len(pending.rows)
            if pending.group:
                _settle(pending.future, None, Rows(
                    n, {name: t[start:start + n] for name, t in rows.tensors.items()},
                    {i - start: e for i, e in rows.failed.items() if start <= i < start + n}))
            else:
                result = self._outputs_of(rows, start, pending.names, pending.rows[0])
                _settle(pending.future, result if isinstance(result, Exception) else None, result)
            start += n

    def _outputs_of(self, rows: Any, index: int, names: list[str],
                    feeds: dict[str, np.ndarray]) -> list[np.ndarray] | Exception:
        """Request ``index``'s outputs ``names`` in ``rows`` (views), or its error. An output no
        chunk computes is a model input passed through (``feeds``: the request's), or a
        constant."""
        error = rows.failed.get(index)
        if error is not None:
            return error
        try:
            tensors = rows.tensors
            return [tensors[name][index] if name in tensors else self._not_computed(name, feeds)
                    for name in names]
        except Exception as exc:
            return exc

    def _not_computed(self, name: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """An output no chunk computes: a model input passed through, or a constant."""
        if name in feeds:
            return feeds[name].copy()
        return np.array(self.model.constants[name], copy=True)

    def _later(self, handle: Any, *args: Any) -> None:
        try:
            self._completions.submit(handle, *args)
        except RuntimeError:
            pass  # the session closed, which failed the request

    def _ended(self, copy: _Copy, pending: _Pending) -> None:
        with self._lock:
            copy.in_flight -= len(pending.rows)

    def _node_failed(self, exc: BaseException) -> bool:
        from ray.exceptions import RayActorError

        from vkpool.cluster.node import NotOpen

        return isinstance(exc, (RayActorError, NotOpen))

    # -- faults --------------------------------------------------------------------------------
    def _copy_down(self, copy: _Copy, exc: BaseException) -> None:
        """Marks ``copy`` down and sends the requests waiting on it to another copy."""
        with self._lock:
            if copy.down is None:
                copy.down = _first_line(exc)
            waiting = list(copy.queue)
            copy.queue.clear()
            copy.queued = 0
            if self._reviver is None and not self._closed:
                self._reviver = threading.Thread(target=self._revive, name="vkpool-cluster-revive",
                                                 daemon=True)
                self._reviver.start()
        why = f"copy {copy.index} failed: {_first_line(exc)}"
        for pending in waiting:
            self._ended(copy, pending)
            self._dispatch(pending, why=why)

    def _revive(self) -> None:
        """Puts copies back once their nodes' actors answer again and hold the model again."""
        while not self._closed:
            with self._lock:
                down = [ln for ln in self._copies if ln.down is not None]
                if not down:
                    self._reviver = None
                    return
            for copy in down:
                try:
                    for node in copy.nodes:
                        self._get_while_open(self.cluster.actors[node].ping.remote(), PING_TIMEOUT_S)
                    for node in copy.nodes:  # what survived on another node of the copy is opened anew
                        closing = self.cluster.actors[node].close.remote(copy.key, self._holder)
                        self._get_while_open(closing, PING_TIMEOUT_S)
                    self._get_while_open(self._open(copy), PING_TIMEOUT_S * 10)
                except Exception:
                    if self._closed:
                        return
                    continue
                with self._lock:
                    copy.down = None
                    closed = self._closed
                if closed:  # close() may have run before this copy was opened again
                    for node in copy.nodes:
                        self.cluster.actors[node].close.remote(copy.key, self._holder)
            time.sleep(REVIVE_EVERY_S)

    def _get_while_open(self, refs: Any, timeout: float) -> Any:
        """``ray.get(refs)`` (one reference or a list) within ``timeout`` seconds, given up
        (RuntimeError) once the session closes: looked at every REVIVE_EVERY_S, so that
        :meth:`close` can wait for the thread that asks."""
        waiting = list(refs) if isinstance(refs, list) else [refs]
        deadline = time.monotonic() + timeout
        while waiting:
            if self._closed:
                raise RuntimeError("the session closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout} s")
            _, waiting = self._ray.wait(waiting, num_returns=len(waiting), timeout=min(left, REVIVE_EVERY_S))
        return self._ray.get(refs)

    @property
    def copies(self) -> list[dict[str, Any]]:
        """Each copy: index, members, nodes, requests in flight and served, and why it is down (None: up)."""
        with self._lock:
            return [{"index": ln.index, "nodes": list(ln.nodes), "in_flight": ln.in_flight,
                     "served": ln.served, "down": ln.down,
                     "members": [ln.member] if ln.member else
                     list(dict.fromkeys(self.placement.chunks[c].member for s in ln.steps for c in s.chunks))}
                    for ln in self._copies]

    # -- checks --------------------------------------------------------------------------------
    def _check_feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feeds, checked against the model's inputs and copied: a request may wait for a
        call, and its caller may reuse its arrays as soon as ``submit`` returns."""
        if len(input_feed) != len(self._inputs) or any(name not in self._inputs for name in input_feed):
            extra = sorted(set(input_feed) - set(self._inputs))
            if extra:
                raise InvalidInput(f"unknown input(s) {extra}; the model's inputs are {sorted(self._inputs)}")
            raise InvalidInput(f"missing input(s) {sorted(set(self._inputs) - set(input_feed))}")
        feeds = {}
        for name, (dtype, shape) in self._inputs.items():
            value = np.array(input_feed[name], order="C")
            if value.dtype != dtype:
                raise InvalidInput(f"input {name!r} must be {dtype}, got {value.dtype}")
            if value.shape != shape:
                raise InvalidInput(f"input {name!r} must have shape {list(shape)}, got {list(value.shape)}")
            feeds[name] = value
        return feeds

    def _output_list(self, output_names: Sequence[str] | None) -> list[str]:
        if output_names is None:
            return list(self._output_names)
        unknown = [n for n in output_names if n not in self._output_names]
        if unknown:
            raise InvalidInput(f"unknown output(s) {unknown}; the model's outputs are "
                               f"{sorted(self._output_names)}")
        return list(output_names)

    # -- what it holds -------------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        """The plan that runs (:class:`~vkpool.cluster.placement.ClusterPlan`), as ``vkpool plan
        --cluster`` shows it."""
        from vkpool.cluster.placement import ClusterPlan

        return ClusterPlan(self.placement, self.graph)

    @property
    def batching(self) -> list[dict[str, Any] | None]:
        """Per copy, the figures of its node's batcher (:attr:`vkpool.Session.batching`; None:
        the copy does not batch, or is down)."""
        return [None if copy.down is not None or copy.member is None
                else self._ray.get(self.cluster.actors[copy.nodes[0]].batching.remote(copy.key))
                for copy in self._copies]

    def memory_by_member(self) -> dict[str, int]:
        """What the model holds on each cluster member, as the nodes' actors count it."""
        out: dict[str, int] = {}
        for copy in self._copies:
            if copy.down is not None:
                continue
            for node in copy.nodes:
                held = self._ray.get(self.cluster.actors[node].memory_by_member.remote(copy.key))
                for member, nbytes in held.items():
                    out[f"{node}/{member}"] = out.get(f"{node}/{member}", 0) + nbytes
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            reviver = self._reviver
        if reviver is not None and reviver is not threading.current_thread():
            reviver.join(REVIVE_EVERY_S * 4)  # it gives up at its next look (_get_while_open)
        for copy in self._copies:
            for node in copy.nodes:
                try:
                    self._ray.get(self.cluster.actors[node].close.remote(copy.key, self._holder),
                                  timeout=PING_TIMEOUT_S)
                except Exception:
                    pass  # a node that is gone holds nothing of it
        if self.name is not None:
            try:
                self._ray.get(self.cluster.names.release.remote(self.name, self._holder),
                              timeout=PING_TIMEOUT_S)
            except Exception:
                pass  # the names' actor restarted: it holds nothing of this driver
        # answers not handled yet are dropped here, in this thread: each holds the future of a
        # Ray reference, and a reference Ray frees after a shutdown (a driver's next step once its
        # sessions are closed) ends the process
        self._completions.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # their completions will not be handled now
            left = [p for copy in self._copies for p in copy.queue]
            left += [p for copy in self._copies for call in copy.calls.values() for p in call]
            for copy in self._copies:
                copy.queue.clear()
                copy.queued = 0
                copy.calls.clear()
        for pending in left:
            _settle(pending.future, RuntimeError("the session was closed before this request finished"))
        try:  # the answer being handled now, if any, ends before this returns
            self._completions.shutdown(wait=True)
        except RuntimeError:
            pass  # closed from a completion's callback: that thread cannot wait for itself

    def __enter__(self) -> ClusterSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # at interpreter exit Ray may be gone already


def _name_os_thread(name: str) -> None:
    """Gives the calling thread ``name`` where the OS shows threads (``top -H``, ``/proc``): a thread
    otherwise bears the name of the one that started it, here Ray's I/O thread, whose CPU would then
    seem to include this one's."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the name only helps reading the OS's thread lists


def _settle(future: Future, exc: BaseException | None, result: Any = None) -> None:
    """Completes ``future`` unless it is complete already (a closed session failed it)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, rather than Ray's wrapper of it."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        return exc.cause
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(_cause(exc)).strip().splitlines()
    return f"{type(_cause(exc)).__name__}: {text[0] if text else ''}"
