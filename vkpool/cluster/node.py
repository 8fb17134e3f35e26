"""The vkpool actor of one Ray node: it owns the node's pool and runs what sessions open on it.

One actor per node (the node's ``vkpool`` custom resource, one unit, and node-affinity
scheduling): :meth:`vkpool.cluster.Cluster.refresh` names it after the node, so that every
driver finds the same one.
Ray sets ``CUDA_VISIBLE_DEVICES`` for the GPUs it gives the actor, which Vulkan ignores: the
pool holds exactly the Vulkan devices whose UUIDs those GPUs have (:func:`ray_gpu_uuids`).
An actor given no GPU builds its pool from the node's own config. ``VKPOOL_NODE_MEMBERS``
(member ids, comma-separated) narrows what a node offers, for nodes sharing one host's devices.

What a session opens on a node is either a replica (a whole :class:`vkpool.Session` on one
member, batching included) or the node's chunks of a plan over several nodes (compiled with
:func:`vkpool.executor.build_chunk` exactly as the plan cuts them).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import socket
import subprocess
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from vkpool.cluster.rows import Rows, gather, merge, pending
from vkpool.pipeline import IDLE

#: the Ray namespace of the drivers' leases (vkpool.cluster.NAMESPACE)
LEASE_NAMESPACE = "vkpool"


class NotOpen(KeyError):
    """The node holds no model under this key: its actor restarted since the session opened it."""


def node_name() -> str:
    """``$VKPOOL_NODE_NAME``, else the host's name."""
    return os.environ.get("VKPOOL_NODE_NAME") or socket.gethostname()


def ray_gpu_uuids(gpu_ids: Sequence[Any]) -> list[str]:
    """The UUIDs of the GPUs Ray gave this process (``ray.get_gpu_ids()``: NVML indices, or
    ``GPU-<uuid>`` strings), lower case without the prefix. An index is looked up in NVML (the
    copy Ray ships, as Ray numbers GPUs by it), else in ``nvidia-smi``'s table, both in PCI bus
    order; Vulkan reports the same UUID for the device."""
    table: dict[str, str] | None = None
    out = []
    for gpu in gpu_ids:
        text = str(gpu)
        if text.upper().startswith("GPU-"):
            out.append(text[4:].lower())
            continue
        if table is None:
            table = _nvml_uuids() or _nvidia_smi_uuids()
        if text not in table:
            raise RuntimeError(f"Ray gave GPU {text}, which NVML does not list ({sorted(table)})")
        out.append(table[text])
    return out


def _uuid_text(raw: Any) -> str:
    text = (raw.decode() if isinstance(raw, bytes) else str(raw)).strip()
    return (text[4:] if text.upper().startswith("GPU-") else text).lower()


def _nvml_uuids() -> dict[str, str]:
    """Index → UUID of every NVIDIA GPU through NVML; empty where NVML cannot be reached."""
    try:
        from ray._private.thirdparty import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        return {str(i): _uuid_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())}
    except Exception:
        return {}
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_uuids() -> dict[str, str]:
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"Ray gave this actor GPUs, but neither NVML nor nvidia-smi maps them to UUIDs: "
                           f"{exc}") from None
    table = {}
    for line in text.splitlines():
        index, _, uuid = line.partition(",")
        table[index.strip()] = _uuid_text(uuid)
    return table


def _bare(uuid: str) -> str:
    return uuid.lower().replace("-", "")


def node_pool(gpu_uuids: Sequence[str]) -> Any:
    """The node's pool: the node's config over the Vulkan devices with these UUIDs (every device
    the config allows when none are given)."""
    from vkpool.discovery import discover
    from vkpool.pool import DevicePool

    infos = discover()
    if gpu_uuids:
        wanted = {_bare(u) for u in gpu_uuids}
        missing = wanted - {_bare(i.uuid) for i in infos}
        if missing:
            raise RuntimeError(f"Ray gave GPUs {sorted(missing)} that no Vulkan device has (Vulkan sees "
                               f"{', '.join(f'{i.name} {i.uuid}' for i in infos)})")
        # the others stay described (config rules that name them still match) but are not used
        infos = [i if _bare(i.uuid) in wanted else dataclasses.replace(
            i, usable=False, unusable_reason="Ray gave this node's vkpool actor other GPUs") for i in infos]
    return DevicePool.from_config(None, infos=infos)


class _Chunks:
    """A node's chunks of a plan over several nodes, compiled; ``run`` runs some of them in order."""

    def __init__(self, pool: Any, model: Any, member_of: Mapping[str, str],
                 chunks: Sequence[tuple[str, list[str]]], node: str) -> None:
        from vkpool.executor import build_chunk
        from vkpool.partition.graph import build_graph
        from vkpool.pipeline import stage_nodes

        graph = build_graph(model)
        index_of = {op: int(graph.nodes[op]["index"]) for op in graph.nodes}
        unknown = sorted(set(member_of) ^ set(index_of))
        if unknown:
            raise ValueError(f"the plan was made for another model: ops {unknown[:5]} differ")
        prefix = f"{node}/"
        members = [pool.member(m[len(prefix):]) if m.startswith(prefix) else SimpleNamespace(id=m)
                   for m, _ in chunks]
        self.stages = stage_nodes(model, [[index_of[op] for op in ops] for _, ops in chunks], members)
        self.compiled: dict[int, Any] = {}
        # each chunk runs the requests of every call as one stream, with its run slots in flight
        # (two calls each holding one slot while waiting for another would wait forever)
        self.streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        try:
            for stage, (member, _) in zip(self.stages, chunks):
                if member.startswith(prefix):
                    self.compiled[stage.index] = build_chunk(model, stage)
        except BaseException:
            self.close()
            raise

    def run(self, indices: Sequence[int], rows: Rows) -> Rows:
        """Runs chunks ``indices`` (in order) on every request of ``rows``, chunk after chunk,
        each over all the requests with its run slots in flight (a Vulkan chunk has two: the
        device runs one request while the host moves the next one's tensors), the requests of
        every call to a chunk back to back (:class:`_Stream`). Returns every output the chunks
        send on."""
        sent: list[Rows] = []
        for index in indices:
            stage = self.stages[index]
            wanted = merge([rows, *sent]) if sent else rows
            feeds = Rows(wanted.count, {n: wanted.tensors[n] for n in stage.inputs}, wanted.failed)
            live = pending(feeds)
            sent.append(gather(feeds, self._stream(index).run(live) if live else []))
        return merge(sent)

    def _stream(self, index: int) -> _Stream:
        """Chunk ``index``'s stream (a new one where the last one failed)."""
        from vkpool.pipeline import back_to_back

        chunk = self.compiled[index]
        return _live_stream(self.streams, index, self._lock, lambda: _Stream(
            lambda source, each: back_to_back(chunk.start, chunk.finish, source, chunk.slots, each)))

    def memory_by_member(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for index, chunk in self.compiled.items():
            s = chunk.stats
            member = self.stages[index].member.id
            out[member] = out.get(member, 0) + s.weight_bytes + s.arena_bytes + s.io_bytes
        return out

    def close(self) -> None:
        with self._lock:
            streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream.close()
        for chunk in self.compiled.values():
            chunk.close()
        self.compiled = {}


def lease_alive(holder: str) -> bool:
    """Whether the driver of ``holder`` lives: a lease name, or a lease name and ``#`` and what of
    that driver holds it (one of its sessions); the driver lives while an actor of that name does."""
    import ray

    try:
        ray.get_actor(holder.partition("#")[0], namespace=LEASE_NAMESPACE)
        return True
    except ValueError:  # no live actor has that name: the driver is gone
        return False


class Names:
    """The shared sessions of a cluster (``cluster.session(model, name=...)``): a named actor
    that keeps, per name, what the sessions of that name run, the first one's plan, and the
    drivers that hold it. A session of a name that is held adopts its plan and the copies it
    opened (the nodes count each driver as a holder), so that drivers in several processes send
    their requests to the same replicas. A name is free again once no live driver holds it."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, Any]] = {}

    def claim(self, name: str, digest: str, plan: bytes, lease: str) -> tuple[bytes, str]:
        """(plan, token) of ``name``: those held, where a live driver holds it with the same
        ``digest`` (what the session runs), else ``plan`` and a new token; the driver whose
        lease is ``lease`` holds it then. A name held for something else is refused."""
        held = self._live(name, digest)
        if held is None:
            import uuid

            held = self._held[name] = {"digest": digest, "plan": plan, "token": uuid.uuid4().hex[:8],
                                       "holders": set()}
        held["holders"].add(lease)
        return held["plan"], held["token"]

    def plan_of(self, name: str, digest: str) -> bytes | None:
        """The plan ``name`` runs, where a live driver holds it (refused as :meth:`claim` does)."""
        held = self._live(name, digest)
        return None if held is None else held["plan"]

    def release(self, name: str, lease: str) -> None:
        held = self._held.get(name)
        if held is not None:
            held["holders"].discard(lease)
            if not held["holders"]:
                del self._held[name]

    def _live(self, name: str, digest: str) -> dict[str, Any] | None:
        """What ``name`` holds, where a live driver holds it; refused when that is not ``digest``."""
        held = self._held.get(name)
        if held is None:
            return None
        held["holders"] = {lease for lease in held["holders"] if lease_alive(lease)}
        if not held["holders"]:
            del self._held[name]
            return None
        if held["digest"] != digest:
            raise ValueError(f"the shared session {name!r} runs another model, or the same with other "
                             f"options ({len(held['holders'])} driver(s) hold it): open this one under another "
                             "name, or with the same model and options")
        return held


class Lease:
    """A named actor that lives as long as the driver that made it (Ray ends an actor with its
    owner): a node closes what a driver opened once no actor has that driver's lease name."""

    def ping(self) -> bool:
        return True


class _Call:
    """One call's requests on a replica's stream, and their results as they end."""

    __slots__ = ("feeds", "first", "results", "left", "done")

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds, self.first = feeds, -1
        self.results: list[Any] = [None] * len(feeds)
        self.left = len(feeds)
        self.done = threading.Event()


class _Stream:
    """The requests of every call to a replica, or to a chunk of a plan over nodes, run back to
    back as one stream: ``run_many(source, each)`` (:meth:`vkpool.Session.run_many`,
    :func:`vkpool.pipeline.back_to_back` over a chunk's run slots) in a thread of its own reads
    the calls' requests as they come, so the next call's first request starts while the last
    call's end, the device never waiting between calls, and a call of a few requests costs the
    node what a long one does per request. Each call waits for its own results (``shape`` makes
    each one's outputs a dict by output name) and leaves as soon as they are in."""

    def __init__(self, run_many: Callable[[Iterator[Any], Callable[[int, Any], None]], Any],
                 shape: Callable[[Any], dict[str, np.ndarray]] = dict) -> None:
        self._run_many, self._shape = run_many, shape
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._read: list[_Call] = []  # calls whose requests were read and have not all ended
        self._count = 0  # requests read
        self._lock = threading.Lock()
        self.failed: BaseException | None = None  # why the stream stopped (None: it serves)
        self._thread = threading.Thread(target=self._serve, name="vkpool-stream", daemon=True)
        self._thread.start()

    def run(self, feeds: list[dict[str, np.ndarray]]) -> list[Any]:
        """Each request's outputs (by output name) or its error, once all of them have ended."""
        call = _Call(feeds)
        with self._lock:
            if self.failed is not None:
                raise self.failed
            self._calls.put(call)
        call.done.wait()
        return call.results

    def close(self) -> None:
        """Ends the stream once the calls given to it have ended."""
        self._calls.put(None)
        self._thread.join()

    def _source(self) -> Iterator[Any]:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                yield IDLE  # what was started ends before this thread waits for the next call
                call = self._calls.get()
            if call is None:
                return
            with self._lock:
                call.first = self._count
                self._count += len(call.feeds)
                self._read.append(call)
            yield from call.feeds

    def _ended(self, index: int, result: Any) -> None:
        with self._lock:
            call = next(c for c in self._read if c.first <= index < c.first + len(c.feeds))
            call.results[index - call.first] = result if isinstance(result, Exception) else self._shape(result)
            call.left -= 1
            if call.left:
                return
            self._read.remove(call)
        call.done.set()

    def _serve(self) -> None:
        from vkpool.cluster.session import _name_os_thread

        _name_os_thread("vkpool-stream")  # its CPU apart from Ray's threads' in `top -H`, /proc
        try:
            self._run_many(self._source(), self._ended)
            error: BaseException = RuntimeError("the replica was closed")
        except BaseException as exc:  # the session failed as a whole: every call waiting gets it
            error = exc
        with self._lock:
            self.failed = error
            waiting = self._read
            self._read = []
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                waiting.append(call)
        for call in waiting:
            call.results = [error if r is None else r for r in call.results]
            call.done.set()


def _live_stream(streams: dict[Any, _Stream], key: Any, lock: threading.Lock, make: Callable[[], _Stream]
                 ) -> _Stream:
    """``streams[key]``, made anew (``make()``) where there is none or the last one failed."""
    with lock:
        stream = streams.get(key)
        if stream is None or stream.failed is not None:
            stream = streams[key] = make()
        return stream


class NodeActor:
    """The node's pool and the models sessions opened on it (see the module doc). Ray runs its
    methods in several threads at once: requests of different sessions and replicas overlap."""

    def __init__(self) -> None:
        import ray

        self.name = node_name()
        self.pool = node_pool(ray_gpu_uuids(ray.get_gpu_ids()))
        offered = os.environ.get("VKPOOL_NODE_MEMBERS", "")
        ids = [m.id for m in self.pool.members]
        self.offered = [i.strip() for i in offered.split(",") if i.strip()] or ids
        unknown = [i for i in self.offered if i not in ids]
        if unknown:
            raise ValueError(f"VKPOOL_NODE_MEMBERS names {unknown}, which this node's pool lacks ({ids})")
        self.opened: dict[str, Any] = {}
        self.leases: dict[str, set[str]] = {}  # key → the lease names of the drivers that hold it
        self.link: dict[str, float] | None = None
        self._lock = threading.Lock()
        # runs in progress per opened model (by id): what is closed waits for them, so that no
        # run meets a chunk being closed
        self._users: dict[int, int] = {}
        self._idle = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}  # key → its replica's stream of requests

    # -- what the node has ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The node's name, process, and each offered member: budget, use, what the planner sees."""
        from vkpool.host_engine import engine_label
        from vkpool.placement import planner_members

        self._drop_orphans()
        planned = {m.id: m for m in planner_members(self.pool, self.offered)}
        members = []
        for member_id in self.offered:
            member, seen = self.pool.member(member_id), planned[member_id]
            info = getattr(member, "info", None)
            members.append({
                "id": member_id, "kind": member.kind,
                "name": seen.name or (f"host ({engine_label(member.engine)})" if info is None else ""),
                "uuid": None if info is None else info.uuid, "budget_bytes": member.budget_bytes,
                "used_bytes": member.used_bytes, "free_bytes": seen.budget_bytes,
                "cost": seen.cost.to_dict()})
        return {"node": self.name, "pid": os.getpid(), "members": members, "link": self.link,
                "models": sorted(self.opened)}

    def set_budget(self, member_id: str, size: int | str) -> None:
        if member_id not in self.offered:
            raise KeyError(f"node {self.name} has no member {member_id!r}; members: "
                           f"{', '.join(self.offered)}")
        self.pool.set_budget(member_id, size)

    def set_link(self, link: dict[str, float]) -> None:
        """Keeps the node's measured link for every later plan (the same figures every driver sees)."""
        self.link = dict(link)

    def ping(self) -> str:
        return self.name

    def pull(self, blob: np.ndarray) -> int:
        """Receives ``blob`` (a calibration transfer through the object store); returns its size."""
        return int(blob.nbytes)

    def put(self, nbytes: int) -> list[Any]:
        """An object of ``nbytes`` in this node's object store (the reference inside a list, so
        the caller receives the reference rather than the bytes)."""
        import ray

        return [ray.put(np.ones(nbytes, np.uint8))]

    # -- models ------------------------------------------------------------------------------------
    def open_replica(self, key: str, lease: str, model: bytes, member: str,
                     options: dict[str, Any]) -> list[str]:
        """A whole :class:`vkpool.Session` of ``model`` on ``member``, for the driver whose
        :class:`Lease` is named ``lease``; returns its output names. A key open already (a
        shared session, :class:`Names`) is held by that driver too, not opened again."""
        from vkpool.executor import RUN_SLOTS
        from vkpool.session import Session

        self._check_member(member)
        self._drop_orphans()
        held = self._hold(key, lease)
        if held is not None:
            return [o.name for o in held.get_outputs()]
        # run slots as a plan's chunks have: the requests of calls run back to back (_Stream)
        session = Session(model, device=member, pool=self.pool, run_slots=RUN_SLOTS, **options)
        self._keep(key, session, lease)
        return [o.name for o in session.get_outputs()]

    def open_chunks(self, key: str, lease: str, model: bytes, node: str, member_of: dict[str, str],
                    chunks: list[tuple[str, list[str]]], column_splits: dict[str, int], batch: int,
                    dims: dict[str, int]) -> None:
        """The chunks on ``node`` (this node's name in the cluster) of a plan over several nodes
        (op → ``node/member``; the chunks in the plan's order as (member, ops)), for the driver
        whose lease is named ``lease``; ``column_splits`` as the plan divided the products."""
        from vkpool.column_split import split_products
        from vkpool.model import load_model

        self._drop_orphans()
        if self._hold(key, lease) is not None:
            return
        loaded = load_model(model, batch=batch, dims=dims)
        split_products(loaded, column_splits)
        for member, _ in chunks:
            where, _, local = member.rpartition("/")
            if where == node:
                self._check_member(local)
        self._keep(key, _Chunks(self.pool, loaded, member_of, chunks, node), lease)

    def _hold(self, key: str, lease: str) -> Any:
        """What is open under ``key``, now held by ``lease`` too; None when nothing is."""
        with self._lock:
            opened = self.opened.get(key)
            if opened is not None:
                self.leases[key].add(lease)
            return opened

    def _keep(self, key: str, opened: Any, lease: str) -> None:
        """Keeps what was opened under ``key``, closing what an earlier open left there."""
        with self._lock:
            earlier = self.opened.get(key)
            self.opened[key], self.leases[key] = opened, {lease}
            stream = self._streams.pop(key, None)
        if earlier is not None:
            self._close_when_idle(earlier, stream)

    def _drop_orphans(self) -> None:
        """Closes what drivers that are gone opened (their leases ended with them)."""
        with self._lock:
            held = [(key, lease) for key, leases in self.leases.items() for lease in leases]
        alive: dict[str, bool] = {}  # per driver: its sessions hold as ``driver#session``
        for key, lease in held:
            driver = lease.partition("#")[0]
            if driver not in alive:
                alive[driver] = lease_alive(driver)
            if not alive[driver]:
                self.close(key, lease)

    def _close_when_idle(self, opened: Any, stream: _Stream | None = None) -> None:
        """Closes ``opened`` (no longer under any key), and its replica's ``stream``, once the
        runs using it have ended."""
        with self._idle:
            while self._users.get(id(opened)):
                self._idle.wait()
        if stream is not None:
            stream.close()
        opened.close()

    def _check_member(self, member: str) -> None:
        if member not in self.offered:
            raise KeyError(f"node {self.name} offers no member {member!r}; it offers "
                           f"{', '.join(self.offered)}")

    def _get(self, key: str) -> Any:
        try:
            return self.opened[key]
        except KeyError:
            raise NotOpen(f"model {key} is not open on node {self.name} (its vkpool actor restarted, or the "
                          "session closed or reopened it)") from None

    @contextmanager
    def _using(self, key: str) -> Iterator[Any]:
        """The model opened under ``key``, kept open while the block runs."""
        with self._lock:
            opened = self._get(key)
            self._users[id(opened)] = self._users.get(id(opened), 0) + 1
        try:
            yield opened
        finally:
            with self._idle:
                left = self._users.pop(id(opened)) - 1
                if left:
                    self._users[id(opened)] = left
                else:
                    self._idle.notify_all()

    def run(self, key: str, rows: Rows) -> Rows:
        """Requests on a replica, several per call (:class:`~vkpool.cluster.rows.Rows`); returns
        their outputs, packed the same way. The requests of every call to the replica run back
        to back, in the order the calls come (:class:`_Stream`: the device runs one while the
        host moves the next one's tensors, across calls too), batched where the model is; one
        that fails fails alone. A call's answer leaves as soon as its own requests are done, while
        the next call runs (calls run side by side would share the device and all end together,
        leaving the node idle while they travel)."""
        with self._using(key) as session:
            feeds = pending(rows)
            return gather(rows, self._stream(key, session).run(feeds) if feeds else [])

    def _stream(self, key: str, session: Any) -> _Stream:
        """The stream of the replica opened under ``key`` (a new one where the last one failed)."""
        names = [o.name for o in session.get_outputs()]
        return _live_stream(self._streams, key, self._lock, lambda: _Stream(
            lambda source, each: session.run_many(source, None, each), lambda out: dict(zip(names, out))))

    def run_chunks(self, key: str, indices: list[int], *parts: Rows) -> Rows:
        """Chunks ``indices`` of several requests; ``parts``: the requests' feeds and what the
        chunks before sent, each packed (Ray hands them over from the nodes that made them).
        Returns every tensor the chunks send on; a request that failed before stays failed."""
        rows = merge(parts)
        with self._using(key) as opened:
            return opened.run(indices, rows)

    def batching(self, key: str) -> dict[str, Any] | None:
        """The batcher's figures of a replica opened with ``max_batch`` (None without)."""
        opened = self._get(key)
        return opened.batching if not isinstance(opened, _Chunks) else None

    def memory_by_member(self, key: str) -> dict[str, int]:
        return self._get(key).memory_by_member()

    def close(self, key: str, lease: str | None = None) -> None:
        """Lets the driver whose lease is ``lease`` go of what is open under ``key``, and closes
        it once no driver holds it (None: whoever holds it), after the runs using it have ended
        (no new one starts)."""
        with self._lock:
            leases = self.leases.get(key, set())
            leases.discard(lease)
            if lease is not None and leases:
                return
            opened = self.opened.pop(key, None)
            self.leases.pop(key, None)
            stream = self._streams.pop(key, None)
        if opened is not None:
            self._close_when_idle(opened, stream)
