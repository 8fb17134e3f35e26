"""Replicas in worker processes: each replica member runs the model in a process of its own.

With the model replicated on several GPUs, a request's host work (writing its inputs,
submitting, waiting for the device, reading its outputs) is what bounds throughput on small
models, and in one process the replicas' threads do that work one at a time, under one
interpreter lock. :class:`ReplicaProcesses` moves it out: one worker process per replica
member (``python -m vkpool.replicas``) opens its own logical device on the member's GPU,
loads and records the model once (a two-slot :class:`~vkpool.engine.VulkanChunk`, so one run
executes while the next is queued behind it) and serves requests until told to stop. What
remains in the calling process per request is a copy into shared memory, one byte written to
a pipe and, when the worker answers, a copy out.

- **Shared memory.** Each worker has ``PROCESS_SLOTS`` request slots in one file-backed
  mapping that both processes map; a slot holds the
  model's inputs and outputs at fixed offsets. The file is unlinked once the worker has
  mapped it, so nothing is left behind however the processes end.
- **Wire.** Caller → worker: one byte per request, the slot it was written to (``CLOSE`` asks
  the worker to finish what it holds and exit). Worker → caller: ``slot, 0`` when the slot's
  outputs are written; ``slot, 1``, a 4-byte length and a UTF-8 message when the run failed;
  at start, ``HELLO`` frames carrying JSON: the compiled chunk's statistics, or the error
  that stopped the worker.
- **Scheduling.** A request goes to the live worker with the most free slots (the least
  loaded); with every slot taken it waits in a queue that the first slot to free takes from.
- **Answers.** The thread that submits, and a thread that waits on a request's future, read
  the workers' answers themselves (one ``poll`` of their pipes, under one lock), so no
  hand-over between threads happens per request: on two H200s that took mnist12_like from
  24–29 k to 29–46 k requests/s. A reader thread completes the answers nobody waits for; it
  leaves them to a waiting thread that has read within ``HELP_SLICE_S``.
- **Mapping.** ``/dev/shm`` where it has room (its space reserved up front), else the temp
  folder.
- **Failures.** A failed run fails its own request only. A worker that dies fails the
  requests it held, with its exit status and the end of its error output; the other
  replicas keep serving the rest.
- **Budgets.** A worker compiles under what the member's budget has free in the calling
  process, and the calling process then charges what the worker's chunk holds to that
  budget, so plans, ``vkpool status`` and other sessions see the memory as used.

The executor's interface (``lanes``, ``submit``, ``trace``, ``stats``, ...) is
:class:`~vkpool.executor.PlanExecutor`'s, so :class:`~vkpool.session.Session` uses either.
"""
from __future__ import annotations

import itertools
import json
import mmap
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vkpool.engine import ChunkStats
from vkpool.executor import TRACE_REQUESTS, LaneReports, _Lane, stage_nodes
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel

#: request slots per worker: two on the device (the chunk's run slots) and two waiting
PROCESS_SLOTS = 4
#: seconds a worker may take to load and record the model before the session gives up
START_TIMEOUT_S = 600.0
#: seconds a waiting thread reads answers before it looks at its future again; the reader
#: thread leaves answers alone while a waiting thread has read within this time
HELP_SLICE_S = 0.001
#: seconds ``close`` waits for the requests accepted before it to be served
CLOSE_WAIT_S = 60.0
CLOSE = 0xFF  # caller → worker: finish what you hold and exit
HELLO = 0xFF  # worker → caller, first byte of a start-up frame
_OK, _FAILED, _READY, _REFUSED = 0, 1, 2, 3
_ALIGN = 64
_STDERR_TAIL = 2000


@dataclass(frozen=True)
class _Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def view(self, buffer: Any, base: int) -> np.ndarray:
        return np.ndarray(self.shape, np.dtype(self.dtype), buffer, base + self.offset)


def _layout(model: LoadedModel, names: Sequence[str]) -> tuple[list[_Field], int]:
    fields, at = [], 0
    for name in names:
        info = model.tensors[name]
        fields.append(_Field(name, np.dtype(info.dtype).str, tuple(int(d) for d in info.shape), at))
        at += -(-max(info.nbytes, 1) // _ALIGN) * _ALIGN
    return fields, at


def _slot_views(buffer: Any, fields: list[_Field], slots: int, slot_bytes: int) -> list[dict[str, np.ndarray]]:
    return [{f.name: f.view(buffer, k * slot_bytes) for f in fields} for k in range(slots)]


class _RemoteChunk:
    """What the calling process knows of a worker's chunk: its statistics and run slots."""

    def __init__(self, stats: dict[str, int], slots: int) -> None:
        self.stats = ChunkStats(**stats)
        self.slots = slots


class _Worker:
    """One replica's process, its pipes and its shared request slots."""

    def __init__(self, lane: _Lane, proc: subprocess.Popen, to_fd: int, from_fd: int, mapping: mmap.mmap,
                 path: str, inputs: list[dict[str, np.ndarray]], outputs: list[dict[str, np.ndarray]], stderr: Any) -> None:
        self.lane = lane
        self.member = lane.stages[0].member
        self.proc = proc
        self.to_fd = to_fd
        self.from_fd = from_fd
        self.mapping = mapping
        self.path: str | None = path  # the mapping's file, until the worker has mapped it
        self.inputs = inputs
        self.outputs = outputs
        self.stderr = stderr
        self.free = list(range(len(inputs)))
        self.busy: dict[int, tuple[Any, ...]] = {}  # slot → (feeds, shape, future, request id, start ns)
        self.alive = True
        self.charged = 0
        self.serving = False  # loaded the model and answering requests
        self.buf = b""  # answers read but not yet whole

    def unlink(self) -> None:
        if self.path is not None:
            os.unlink(self.path)
            self.path = None

    def why_ended(self) -> str:
        code = self.proc.poll()
        self.stderr.seek(0)
        tail = self.stderr.read()[-_STDERR_TAIL:].decode(errors="replace").strip()
        status = "is still running" if code is None else f"exited with status {code}"
        return f"the replica process on {self.member.id} {status}" + (f"; its last output:\n{tail}" if tail else "")


class _Answer(Future):
    """The future of one request. A thread that waits for it (``result``, ``exception``) reads
    the workers' answers itself while no other thread does, instead of sleeping until the
    reader thread wakes it: each hand-over between threads costs more than the answer."""

    def __init__(self, owner: ReplicaProcesses) -> None:
        super().__init__()
        self._owner = owner

    def result(self, timeout: float | None = None) -> Any:
        return super().result(timeout=self._owner._help(self, timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(timeout=self._owner._help(self, timeout))


class ReplicaProcesses(LaneReports):
    """Runs a plan with the whole model on every member of ``[plan's member, *replicas]`` (the
    replicas may be none) with one worker process per member (see the module doc). ``source`` is the model as the
    session got it (a path or its bytes) with ``batch`` and ``dims``, which each worker loads."""

    def __init__(self, pool: Any, model: LoadedModel, plan: Any, source: str | bytes, batch: int,
                 dims: Mapping[str, int], slots: int = PROCESS_SLOTS) -> None:
        if len(plan.chunks) != 1:
            raise ValueError("worker processes run a plan with the whole model on each member, not a split")
        self.model = model
        self.plan = plan
        self.transfers_executed: Counter[tuple[str, str, str]] = Counter()
        self._closed = False
        self._lock = threading.Lock()
        self._trace_lock = self._lock
        self._ids = itertools.count()
        self._backlog: deque[tuple[Any, ...]] = deque()
        self._trace: deque[tuple[int, int, list[tuple[int, str, int, int, int]]]] = deque(maxlen=TRACE_REQUESTS)
        self._input_names = [name for name, _ in model.inputs]
        self._output_names = [name for name, _ in model.outputs if name not in model.constants]
        self.workers: list[_Worker] = []
        self.lanes: list[_Lane] = []
        self._reader: threading.Thread | None = None
        # one thread at a time reads the workers' answers (re-entered by a callback that waits)
        self._drain_lock = threading.RLock()
        self._helped = 0.0  # when a waiting thread last read answers (time.monotonic)
        self._poller = select.poll()  # the serving workers' answer pipes; polled under _drain_lock
        self._by_fd: dict[int, _Worker] = {}
        self._open_fds: tuple[int, ...] = ()
        everything = list(range(len(model.nodes)))
        for index, member_id in enumerate([plan.chunks[0].member, *plan.replicas]):
            self.lanes.append(_Lane(index, stage_nodes(model, [everything], [pool.member(member_id)])))
        stage = self.lanes[0].stages[0]
        self._in_fields, in_bytes = _layout(model, stage.inputs)
        self._out_fields, out_bytes = _layout(model, stage.outputs)
        self._out_fields = [_Field(f.name, f.dtype, f.shape, f.offset + in_bytes) for f in self._out_fields]
        self._slot_bytes = max(_ALIGN, in_bytes + out_bytes)
        if not 1 <= slots < CLOSE:
            raise ValueError(f"slots must be 1 to {CLOSE - 1}")
        self._slots = slots
        model_file = None
        try:
            if isinstance(source, (bytes, bytearray)):
                fd, model_file = tempfile.mkstemp(prefix="vkpool-model-", suffix=".onnx")
                with os.fdopen(fd, "wb") as f:
                    f.write(source)
                source = model_file
            for lane in self.lanes:  # all start loading at once
                self.workers.append(self._spawn(lane, os.fspath(source), batch, dict(dims)))
            for worker in self.workers:
                self._await_ready(worker)
            for worker in self.workers:
                os.set_blocking(worker.from_fd, False)
                self._poller.register(worker.from_fd, select.POLLIN)
                self._by_fd[worker.from_fd] = worker
                worker.serving = True
            self._open_fds = tuple(self._by_fd)
            self._reader = threading.Thread(target=self._read_answers, name="vkpool-replicas", daemon=True)
            self._reader.start()
        except BaseException:
            self.close()
            raise
        finally:
            if model_file is not None:
                os.unlink(model_file)

    # -- start-up ------------------------------------------------------------------------------
    def _spawn(self, lane: _Lane, source: str, batch: int, dims: dict[str, int]) -> _Worker:
        member = lane.stages[0].member
        size = self._slots * self._slot_bytes
        for folder in (["/dev/shm"] if os.path.isdir("/dev/shm") else []) + [None]:
            fd, path = tempfile.mkstemp(prefix=f"vkpool-{member.id}-", dir=folder)
            try:
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm (64 MiB in a container) fails here
                break
            except OSError:
                os.close(fd)
                os.unlink(path)
                if folder is None:
                    raise
        try:
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        from_caller, to_worker = os.pipe()  # (read end, write end)
        from_worker, to_caller = os.pipe()
        spec = {
            "model": source, "batch": batch, "dims": dims, "member": member.id, "uuid": member.info.uuid,
            "index": member.info.index, "split_index": member.split_index, "budget": member.budget.free_bytes,
            "shm": path, "slots": self._slots, "slot_bytes": self._slot_bytes,
            "inputs": [vars(f) for f in self._in_fields], "outputs": [vars(f) for f in self._out_fields],
            "fds": [from_caller, to_caller],
        }
        stderr = tempfile.TemporaryFile(prefix="vkpool-replica-")
        try:
            # the worker imports vkpool from where this process did
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            proc = subprocess.Popen([sys.executable, "-m", "vkpool.replicas", json.dumps(spec)],
                                    pass_fds=(from_caller, to_caller), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr, close_fds=True, env=env)
        except BaseException:
            for fd in (to_worker, from_worker):
                os.close(fd)
            stderr.close()
            mapping.close()
            os.unlink(path)
            raise
        finally:
            os.close(from_caller)
            os.close(to_caller)
        return _Worker(lane, proc, to_worker, from_worker, mapping, path,
                       _slot_views(mapping, self._in_fields, self._slots, self._slot_bytes),
                       _slot_views(mapping, self._out_fields, self._slots, self._slot_bytes), stderr)

    def _await_ready(self, worker: _Worker) -> None:
        """Reads the worker's start-up frame; charges its chunk to the member's budget."""
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        header = None
        while header is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the replica process on {worker.member.id} did not load the model in "
                                   f"{START_TIMEOUT_S:.0f} s; {worker.why_ended()}")
            ready, _, _ = select.select([worker.from_fd], [], [], min(1.0, left))
            if not ready:
                continue
            data = os.read(worker.from_fd, 65536)
            if not data:
                worker.alive = False
                try:
                    worker.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                raise RuntimeError(worker.why_ended())
            buf += data
            header = _frame(buf)
        worker.unlink()
        slot, status, body, _ = header
        answer = json.loads(body)
        if slot != HELLO or status not in (_READY, _REFUSED):
            raise RuntimeError(f"the replica process on {worker.member.id} answered {slot, status} at start")
        if status == _REFUSED:
            worker.alive = False
            if answer["type"] == "DeviceOutOfMemory":
                raise DeviceOutOfMemory(*answer["args"])
            raise RuntimeError(f"the replica process on {worker.member.id} could not load the model: "
                               f"{answer['type']}: {answer['message']}")
        stats = answer["stats"]
        charge = stats["weight_bytes"] + stats["arena_bytes"] + stats["io_bytes"]
        worker.member.budget.reserve(charge)  # refused (DeviceOutOfMemory) if others took the room meanwhile
        worker.charged = charge
        worker.lane.stages[0].chunk = _RemoteChunk(stats, answer["run_slots"])

    # -- what it holds -------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        return [lane.stages[0].member.id for lane in self.lanes]

    @property
    def planned_transfers(self) -> list[Any]:
        return []

    # -- running -------------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray],
               shape: Callable[[dict[str, np.ndarray]], Any] | None = None) -> Future:
        """Starts one request on the least-loaded replica; the future's result is
        ``{output name: array}``, or what ``shape`` makes of it."""
        future = _Answer(self)
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is closed")
            worker = max(self.workers, key=lambda w: len(w.free) if w.alive else -1)
            if not worker.alive:
                raise RuntimeError("no replica process is running; " + "; ".join(w.why_ended() for w in self.workers))
            if not worker.free:
                self._backlog.append((feeds, shape, future))
                return future
            slot = worker.free.pop()
            worker.busy[slot] = (feeds, shape, future, next(self._ids), time.perf_counter_ns())
        self._send(worker, slot, feeds)
        # complete what has been answered meanwhile here, in the submitting thread: handing each
        # answer to the reader thread and back costs more than the answer itself
        if self._drain_lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._drain_lock.release()
        return future

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.submit(feeds).result()

    def _send(self, worker: _Worker, slot: int, feeds: Mapping[str, np.ndarray]) -> None:
        try:
            for name, view in worker.inputs[slot].items():
                np.copyto(view, feeds[name], casting="no")
            os.write(worker.to_fd, bytes((slot,)))
        except OSError as exc:  # the worker is gone: no request queued here goes to it again
            with self._lock:
                worker.alive = False
            error = RuntimeError(worker.why_ended())
            error.__cause__ = exc
            self._answered(worker, slot, error)
        except BaseException as exc:  # the request fails, and its slot serves the next one
            self._answered(worker, slot, exc)

    def _help(self, future: Future, timeout: float | None) -> float | None:
        """Reads answers in this thread until ``future`` is done, ``timeout`` passes or no
        worker is left to answer; returns what is left of ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        while not future.done():
            wait = HELP_SLICE_S if deadline is None else min(HELP_SLICE_S, left())
            if wait <= 0:
                break
            self._helped = time.monotonic()
            if self._drain_lock.acquire(blocking=False):
                try:
                    if not self._by_fd:
                        break
                    self._drain(max(1, int(wait * 1000)))
                finally:
                    self._drain_lock.release()
            else:  # another thread reads: it completes this future or frees the lock soon
                try:
                    Future.exception(future, timeout=wait)
                except (TimeoutError, FutureTimeout):
                    pass
        return left()

    def _read_answers(self) -> None:
        """The reader thread: completes answers nobody waits for (futures with callbacks). It
        sleeps until a worker answers (or ends), and leaves the answers to a waiting thread
        that has read in the last ``HELP_SLICE_S``."""
        while True:
            fds = self._open_fds  # the pipes not yet seen closed (a tuple, replaced whole)
            if not fds:
                return
            select.select(fds, [], [])
            while time.monotonic() - self._helped < HELP_SLICE_S:
                time.sleep(HELP_SLICE_S)
            with self._drain_lock:
                self._drain()

    def _drain(self, wait_ms: int = 0) -> None:
        """Completes every answer the workers have written so far, after waiting up to
        ``wait_ms`` for one (``_drain_lock`` held)."""
        for fd, _ in self._poller.poll(wait_ms):
            worker = self._by_fd[fd]
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._poller.unregister(fd)
                del self._by_fd[fd]
                self._open_fds = tuple(self._by_fd)
                self._ended(worker)
                continue
            buf = worker.buf + data
            answers = []
            while True:
                frame = _frame(buf)
                if frame is None:
                    break
                slot, status, body, buf = frame
                answers.append((slot, None if status == _OK else RuntimeError(
                    f"{worker.member.id}: {body.decode(errors='replace')}")))
            worker.buf = buf  # before completing: a callback may read further answers
            for slot, error in answers:
                self._answered(worker, slot, error)

    def _answered(self, worker: _Worker, slot: int, error: BaseException | None) -> None:
        """Slot ``slot`` of ``worker`` is done: complete its request, give the slot to the next."""
        with self._lock:
            entry = worker.busy.pop(slot, None)
        if entry is None:  # the worker ended and its requests were failed already
            return
        feeds, shape, future, rid, start = entry
        if error is None:
            produced = {name: view.copy() for name, view in worker.outputs[slot].items()}
        end = time.perf_counter_ns()
        with self._lock:
            nxt = self._backlog.popleft() if self._backlog and worker.alive else None
            if nxt is None:
                worker.free.append(slot)
            else:
                worker.busy[slot] = (*nxt, next(self._ids), end)
            if error is None:
                self._trace.append((rid, worker.lane.index, [(0, worker.member.id, len(self.model.nodes), start,
                                                               end)]))
        if nxt is not None:
            self._send(worker, slot, nxt[0])
        if error is not None:
            future.set_exception(error)
            return
        out = {}
        for name in self._output_names:
            out[name] = produced[name] if name in produced else np.array(feeds[name], copy=True)
        try:
            future.set_result(out if shape is None else shape(out))
        except BaseException as exc:
            future.set_exception(exc)

    def _ended(self, worker: _Worker) -> None:
        """The worker's pipe closed: fail what it held (and the queue, when no replica is left)."""
        if worker.proc.poll() is None:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            worker.alive = False
            held = list(worker.busy.values())
            worker.busy.clear()
            left = [] if any(w.alive for w in self.workers) else list(self._backlog)
            if left:
                self._backlog.clear()
        if not held and not left:
            return
        error = RuntimeError(worker.why_ended() if not self._closed else
                             "the session was closed before this request finished")
        for item in held:
            item[2].set_exception(error)
        for item in left:
            item[2].set_exception(error)

    def close(self) -> None:
        """Refuses new requests, lets the live workers serve every accepted one (up to
        ``CLOSE_WAIT_S``), then stops them and gives their memory back to the budgets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if not any(w.alive and w.serving and w.busy for w in self.workers):
                    break
            time.sleep(0.001)
        for worker in self.workers:
            if not worker.serving:  # still loading (another worker failed): no need to wait for it
                worker.proc.kill()
            elif worker.alive:
                try:
                    os.write(worker.to_fd, bytes((CLOSE,)))
                except OSError:
                    pass
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        if self._reader is not None:
            self._reader.join()  # it ends once every worker's pipe has closed
        for worker in self.workers:
            if worker.alive:
                with self._drain_lock:
                    self._ended(worker)
            for fd in (worker.to_fd, worker.from_fd):
                os.close(fd)
            worker.stderr.close()
            worker.unlink()
            if worker.charged:
                worker.member.budget.release(worker.charged)
                worker.charged = 0
        with self._lock:
            left = list(self._backlog)
            self._backlog.clear()
        for item in left:
            item[2].set_exception(RuntimeError("the session was closed before this request finished"))
        for worker in self.workers:
            worker.inputs = worker.outputs = []
            try:
                worker.mapping.close()
            except BufferError:  # a caller still holds a view of a slot; the mapping goes with it
                pass


def _frame(buf: bytes) -> tuple[int, int, bytes, bytes] | None:
    """The first whole frame of ``buf``: (slot, status, body, rest), or None until it is whole."""
    if len(buf) < 2:
        return None
    if buf[1] == _OK:
        return buf[0], _OK, b"", buf[2:]
    if len(buf) < 6:
        return None
    (n,) = struct.unpack_from("<I", buf, 2)
    if len(buf) < 6 + n:
        return None
    return buf[0], buf[1], buf[6:6 + n], buf[6 + n:]


def _body(slot: int, status: int, body: bytes) -> bytes:
    return bytes((slot, status)) + struct.pack("<I", len(body)) + body


# -- the worker process ------------------------------------------------------------------------
def _serve(spec: dict[str, Any]) -> None:
    from vkpool.device import LogicalDevice
    from vkpool.discovery import discover
    from vkpool.executor import build_chunk
    from vkpool.model import load_model
    from vkpool.pool import VulkanMember

    rfd, wfd = spec["fds"]
    slots, slot_bytes = int(spec["slots"]), int(spec["slot_bytes"])
    fd = os.open(spec["shm"], os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, slots * slot_bytes)
    finally:
        os.close(fd)
    in_fields = [_Field(f["name"], f["dtype"], tuple(f["shape"]), f["offset"]) for f in spec["inputs"]]
    out_fields = [_Field(f["name"], f["dtype"], tuple(f["shape"]), f["offset"]) for f in spec["outputs"]]
    try:
        info = next((i for i in discover() if i.uuid == spec["uuid"] and i.index == spec["index"]), None)
        if info is None:
            raise RuntimeError(f"no Vulkan device with UUID {spec['uuid']} at index {spec['index']}")
        device = LogicalDevice(info)
        member = VulkanMember(spec["member"], info, device, int(spec["budget"]), spec["split_index"])
        model = load_model(spec["model"], batch=int(spec["batch"]), dims=dict(spec["dims"]), partial=True)
        stage = stage_nodes(model, [list(range(len(model.nodes)))], [member])[0]
        if stage.inputs != [f.name for f in in_fields] or stage.outputs != [f.name for f in out_fields]:
            raise RuntimeError("the model loaded in the worker has other inputs or outputs than the caller's")
        chunk = build_chunk(model, stage)
    except BaseException as exc:
        kind = type(exc).__name__
        args = [exc.member, exc.requested, exc.used, exc.budget] if isinstance(exc, DeviceOutOfMemory) else []
        os.write(wfd, _body(HELLO, _REFUSED, json.dumps({"type": kind, "args": args, "message": str(exc)}).encode()))
        raise
    s = chunk.stats
    stats = {name: int(getattr(s, name)) for name in ("weight_bytes", "arena_bytes", "io_bytes", "peak_live_bytes",
                                                      "dispatches", "barriers", "levels")}
    os.write(wfd, _body(HELLO, _READY, json.dumps({"stats": stats, "run_slots": chunk.slots}).encode()))
    inputs = _slot_views(mapping, in_fields, slots, slot_bytes)
    outputs = _slot_views(mapping, out_fields, slots, slot_bytes)
    _loop(chunk, rfd, wfd, inputs, outputs)
    chunk.close()
    device.close()


def _loop(chunk: Any, rfd: int, wfd: int, inputs: list[dict[str, np.ndarray]],
          outputs: list[dict[str, np.ndarray]]) -> None:
    """Serves slots until ``CLOSE`` (or the caller's end of the pipe closing): keeps up to the
    chunk's run slots on the device, starting the next request before waiting for the oldest."""
    os.set_blocking(rfd, False)
    waiting: deque[int] = deque()  # slots written by the caller, not yet started
    running: deque[tuple[int, int]] = deque()  # (slot, chunk run slot)
    closing = False
    while True:
        if not closing:
            try:
                data = os.read(rfd, 4096)
            except BlockingIOError:
                data = None
            if data is not None:
                if not data or CLOSE in data:
                    closing = True
                    data = data.split(bytes((CLOSE,)))[0]
                waiting.extend(data)
        if waiting and len(running) < chunk.slots:
            slot = waiting.popleft()
            try:
                running.append((slot, chunk.start(inputs[slot])))
            except Exception as exc:
                os.write(wfd, _body(slot, _FAILED, f"{type(exc).__name__}: {exc}".encode()))
            continue
        if running:
            slot, token = running.popleft()
            try:
                produced = chunk.finish(token)
                for name, view in outputs[slot].items():
                    np.copyto(view, produced[name], casting="no")
            except Exception as exc:
                os.write(wfd, _body(slot, _FAILED, f"{type(exc).__name__}: {exc}".encode()))
            else:
                os.write(wfd, bytes((slot, _OK)))
            continue
        if closing:
            return
        select.select([rfd], [], [])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m vkpool.replicas SPEC_JSON (started by vkpool.Session, not by hand)", file=sys.stderr)
        return 2
    _serve(json.loads(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ReplicaProcesses", "PROCESS_SLOTS"]
