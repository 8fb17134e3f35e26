"""Plans in worker processes: each chunk of a plan, and each replica, runs in a process of its own.

On small models, and on a pipeline of chunks, a request's host work (writing its inputs,
submitting, waiting for the device, reading its outputs) is what bounds throughput, and in one
process the members' threads do that work one at a time, under one interpreter lock.
:class:`ProcessExecutor` moves it out: one worker process per chunk of the plan and per
replica (``python -m vkpool.processes``) opens its own logical device on the member's GPU,
loads the model, records its chunk once (two run slots, so one run executes while the next is
queued behind it) and serves requests until told to stop. What remains in the calling process
per request is a copy into shared memory, one byte written to a pipe per chunk and, when the
last chunk answers, a copy out.

- **Lanes and shared memory.** A lane is one complete copy of the model: the plan's chunks,
  or one replica. Each lane has ``slots`` request slots in one file-backed mapping that the
  calling process and the lane's workers map; a slot holds the model's inputs and outputs
  and every tensor that crosses between the lane's chunks, each at a fixed offset (page
  aligned). A chunk's worker reads its inputs from the slot and writes its outputs there, so
  a tensor crossing members goes device → host (the mapping) → device without passing
  through the caller. Where both devices import host memory (``VK_EXT_external_memory_host``)
  that hop can copy nothing on the host: the producer's kernels write the tensor into the
  slot and the consumer's commands read it from there (``in_place``, off by default: see
  :class:`ProcessExecutor`); otherwise the workers copy it out of and into their chunks' own memory. The file
  is unlinked once the lane's workers have mapped it, so nothing is left behind however the
  processes end.
- **Wire.** Caller → worker: one byte per run, the request's slot (``CLOSE`` asks the worker to
  finish what it holds and exit). Worker → caller: ``slot, 0`` when the chunk's outputs are
  written; ``slot, 1``, a 4-byte length and a UTF-8 message when the run failed; at start,
  ``HELLO`` frames carrying JSON: the compiled chunk's statistics, or the error that stopped
  the worker. The caller sends a slot to a chunk's worker once every chunk it reads from has
  answered for that slot, so independent chunks run at once and, with several requests in
  flight, chunk 1 runs request k+1 while chunk 2 runs request k.
- **Scheduling.** A request goes to the live lane with the most free slots (the least
  loaded); with every slot taken it waits in a queue that the first slot to free takes from.
- **Answers.** The thread that submits, and a thread that waits on a request's future, read
  the workers' answers themselves (one ``poll`` of their pipes, under one lock), so no
  hand-over between threads happens per request: on two H200s that took mnist12_like from
  24–29 k to 29–46 k requests/s. A reader thread completes the answers nobody waits for; it
  leaves them to a waiting thread that has read within ``HELP_SLICE_S``.
- **Mapping.** ``/dev/shm`` where it has room (its space reserved up front), else the temp
  folder.
- **Failures.** A failed run fails its own request only. A worker that dies fails the
  requests its lane held, with its exit status and the end of its error output, and the
  lane's other workers are stopped; the other lanes keep serving the rest.
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
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vkpool import vk
from vkpool.engine import ChunkStats
from vkpool.executor import RUN_SLOTS, TRACE_REQUESTS, LaneReports, _Lane, _Stage, plan_lanes, stage_nodes
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel

#: whether this system can run worker processes (POSIX pipes passed to a child, ``poll``)
AVAILABLE = os.name == "posix" and hasattr(select, "poll")
#: request slots of a one-chunk lane: two on the device (the chunk's run slots) and two
#: waiting; a lane gets two more for each further chunk, so every chunk can keep two runs
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
#: fields of a slot start on page boundaries, so a device can import each one in place
_ALIGN = 4096
_STDERR_TAIL = 2000


@dataclass(frozen=True)
class _Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def view(self, buffer: Any, base: int) -> np.ndarray:
        return np.ndarray(self.shape, np.dtype(self.dtype), buffer, base + self.offset)


def _span(nbytes: int) -> int:
    """The bytes a field of ``nbytes`` takes in a slot: whole pages, at least one."""
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def _layout(model: LoadedModel, names: Sequence[str]) -> tuple[list[_Field], int]:
    fields, at = [], 0
    for name in names:
        info = model.tensors[name]
        fields.append(_Field(name, np.dtype(info.dtype).str, tuple(int(d) for d in info.shape), at))
        at += _span(info.nbytes)
    return fields, at


def _slot_views(buffer: Any, fields: list[_Field], slots: int, slot_bytes: int) -> list[dict[str, np.ndarray]]:
    return [{f.name: f.view(buffer, k * slot_bytes) for f in fields} for k in range(slots)]


class _RemoteChunk:
    """What the calling process knows of a worker's chunk: its statistics, run slots, and
    the tensors it reads or writes in the shared slots in place."""

    def __init__(self, stats: dict[str, int], slots: int, in_place: list[str]) -> None:
        self.stats = ChunkStats(**stats)
        self.slots = slots
        self.in_place = in_place


@dataclass(eq=False)
class _Held:
    """A request in a lane's slot: what it waits for and what it has run."""

    feeds: Mapping[str, np.ndarray]
    shape: Callable[[dict[str, np.ndarray]], Any] | None
    future: Future
    id: int
    waiting: list[int]  # per chunk, how many of the chunks it reads from have not answered
    left: int  # chunks not yet answered
    outstanding: int  # runs sent to workers (or about to be) and not yet answered
    sent: list[int]  # per chunk, when its run was sent (perf_counter_ns)
    events: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    error: BaseException | None = None


class _Worker:
    """One chunk's process and its pipes."""

    def __init__(self, home: _Home, stage: _Stage, proc: subprocess.Popen, to_fd: int, from_fd: int,
                 stderr: Any) -> None:
        self.home = home
        self.stage = stage
        self.member = stage.member
        self.proc = proc
        self.to_fd = to_fd
        self.from_fd = from_fd
        self.stderr = stderr
        self.alive = True
        self.charged = 0
        self.serving = False  # loaded the model and answering requests
        self.buf = b""  # answers read but not yet whole

    def why_ended(self) -> str:
        code = self.proc.poll()
        self.stderr.seek(0)
        tail = self.stderr.read()[-_STDERR_TAIL:].decode(errors="replace").strip()
        status = "is still running" if code is None else f"exited with status {code}"
        what = f"chunk {self.stage.index} on {self.member.id}" if len(self.home.workers) > 1 else self.member.id
        return f"the worker process of {what} {status}" + (f"; its last output:\n{tail}" if tail else "")


class _Home:
    """One lane's shared request slots and its workers (one per chunk, in the lane's order)."""

    def __init__(self, lane: _Lane, fields: list[_Field], slots: int, slot_bytes: int) -> None:
        self.lane = lane
        self.fields = fields
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.path: str | None = None  # the mapping's file, until the workers have mapped it
        self.mapping: mmap.mmap | None = None
        self.views: list[dict[str, np.ndarray]] = []
        self.free = list(range(slots))
        self.busy: dict[int, _Held] = {}
        self.workers: list[_Worker] = []
        self.alive = True
        self.roots = [s.index for s in lane.stages if not s.preds]
        # tensors one chunk of the lane writes and another reads
        produced = {name for s in lane.stages for name in s.outputs}
        self.crossing = sorted({name for s in lane.stages for name in s.inputs if name in produced})

    def map(self) -> None:
        size = self.slots * self.slot_bytes
        for folder in (["/dev/shm"] if os.path.isdir("/dev/shm") else []) + [None]:
            fd, path = tempfile.mkstemp(prefix=f"vkpool-lane{self.lane.index}-", dir=folder)
            try:
                if hasattr(os, "posix_fallocate"):  # a full /dev/shm (64 MiB in a container) fails here
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
                break
            except OSError:
                os.close(fd)
                os.unlink(path)
                if folder is None:
                    raise
        try:
            self.mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self.views = _slot_views(self.mapping, self.fields, self.slots, self.slot_bytes)

    def unlink(self) -> None:
        if self.path is not None:
            os.unlink(self.path)
            self.path = None


class _Answer(Future):
    """The future of one request. A thread that waits for it (``result``, ``exception``) reads
    the workers' answers itself while no other thread does, instead of sleeping until the
    reader thread wakes it: each hand-over between threads costs more than the answer."""

    def __init__(self, owner: ProcessExecutor) -> None:
        super().__init__()
        self._owner = owner

    def result(self, timeout: float | None = None) -> Any:
        return super().result(timeout=self._owner._help(self, timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(timeout=self._owner._help(self, timeout))


class ProcessExecutor(LaneReports):
    """Runs ``plan`` (its chunks, and the whole model on each replica) with one worker process
    per chunk and per replica (see the module doc). ``source`` is the model as the session got
    it (a path or its bytes) with ``batch`` and ``dims``, which each worker loads; ``graph`` is
    the partition graph the plan was made on. ``slots`` overrides the request slots per lane.

    ``in_place``: a worker imports the slots' tensors that cross between chunks into its device
    (``VK_EXT_external_memory_host``) where the device can: the producing chunk's kernels write
    them into the shared slot and the consuming chunk's commands read them from there, with no
    copy by any process (the model's own inputs and outputs are copied either way: kernels
    reading a request across the bus made one mnist12_like worker slower, 21.0 k against 22.8 k
    requests/s on an H200). Off by default: on two H200s the workloads at hand ran faster with
    the workers copying, whose copies overlap the device's work while the consumer's read across
    the bus does not (conv_many_255MB cut after its convolutions, a 49 KiB tensor crossing:
    9.40-9.44 k requests/s over four runs copying, 8.98-9.22 k over three in place;
    matmul_1GB_16layers 5.79-5.83 k over four against 5.65-5.76 k over two)."""

    runs_in = "a worker process per chunk and per replica"

    def __init__(self, pool: Any, model: LoadedModel, plan: Any, graph: Any, source: str | bytes, batch: int,
                 dims: Mapping[str, int], slots: int | None = None, *, in_place: bool = False) -> None:
        from vkpool.pool import VulkanMember

        if not AVAILABLE:
            raise ValueError("worker processes need POSIX pipes and shared mappings; on this system "
                             "leave processes unset (or False)")
        self.model = model
        self.plan = plan
        self._in_place = in_place
        self.transfers_executed: Counter[tuple[str, str, str]] = Counter()
        self._closed = False
        self._lock = threading.Lock()
        self._trace_lock = self._lock
        self._ids = itertools.count()
        self._backlog: deque[tuple[Any, ...]] = deque()
        self._trace: deque[tuple[int, int, list[tuple[int, str, int, int, int]]]] = deque(maxlen=TRACE_REQUESTS)
        self._input_names = [name for name, _ in model.inputs]
        self._output_names = [name for name, _ in model.outputs if name not in model.constants]
        self.lanes: list[_Lane] = plan_lanes(pool, model, plan, graph)
        others = sorted({s.member.id for lane in self.lanes for s in lane.stages
                         if not isinstance(s.member, VulkanMember)})
        if others:
            raise ValueError(f"worker processes run chunks on Vulkan members; this plan puts chunks on "
                             f"{', '.join(others)}")
        self._homes: list[_Home] = []
        self.workers: list[_Worker] = []
        self._reader: threading.Thread | None = None
        # one thread at a time reads the workers' answers (re-entered by a callback that waits)
        self._drain_lock = threading.RLock()
        self._helped = 0.0  # when a waiting thread last read answers (time.monotonic)
        self._poller = select.poll()  # the serving workers' answer pipes; polled under _drain_lock
        self._by_fd: dict[int, _Worker] = {}
        self._open_fds: tuple[int, ...] = ()
        position = {id(node): i for i, node in enumerate(model.nodes)}
        model_file = None
        try:
            for lane in self.lanes:
                names = list(dict.fromkeys(n for s in lane.stages for n in [*s.inputs, *s.outputs]))
                fields, size = _layout(model, names)
                count = slots if slots is not None else PROCESS_SLOTS + 2 * (len(lane.stages) - 1)
                if not 1 <= count < CLOSE:
                    raise ValueError(f"slots must be 1 to {CLOSE - 1}")
                self._homes.append(_Home(lane, fields, count, max(_ALIGN, size)))
            if isinstance(source, (bytes, bytearray)):
                fd, model_file = tempfile.mkstemp(prefix="vkpool-model-", suffix=".onnx")
                with os.fdopen(fd, "wb") as f:
                    f.write(source)
                source = model_file
            for home in self._homes:  # all start loading at once
                home.map()
                groups = [[position[id(node)] for node in s.nodes] for s in home.lane.stages]
                for stage in home.lane.stages:
                    worker = self._spawn(home, stage, groups, os.fspath(source), batch, dict(dims))
                    home.workers.append(worker)
                    self.workers.append(worker)
            for worker in self.workers:
                self._await_ready(worker)
            for home in self._homes:
                home.unlink()
            for worker in self.workers:
                os.set_blocking(worker.from_fd, False)
                self._poller.register(worker.from_fd, select.POLLIN)
                self._by_fd[worker.from_fd] = worker
                worker.serving = True
            self._open_fds = tuple(self._by_fd)
            self._reader = threading.Thread(target=self._read_answers, name="vkpool-processes", daemon=True)
            self._reader.start()
        except BaseException:
            self.close()
            raise
        finally:
            if model_file is not None:
                os.unlink(model_file)

    # -- start-up ------------------------------------------------------------------------------
    def _spawn(self, home: _Home, stage: _Stage, groups: list[list[int]], source: str, batch: int,
               dims: dict[str, int]) -> _Worker:
        member = stage.member
        by_name = {f.name: f for f in home.fields}
        from_caller, to_worker = os.pipe()  # (read end, write end)
        from_worker, to_caller = os.pipe()
        spec = {
            "model": source, "batch": batch, "dims": dims, "member": member.id, "uuid": member.info.uuid,
            "index": member.info.index, "split_index": member.split_index, "budget": member.budget.free_bytes,
            "transfer_queue": member.device.transfer_queue_mode,
            "shm": home.path, "slots": home.slots, "slot_bytes": home.slot_bytes,
            "column_splits": self.model.column_splits, "groups": groups, "stage": stage.index,
            "in_place": self._in_place, "crossing": home.crossing,
            "inputs": [vars(by_name[n]) for n in stage.inputs], "outputs": [vars(by_name[n]) for n in stage.outputs],
            "fds": [from_caller, to_caller],
        }
        stderr = tempfile.TemporaryFile(prefix="vkpool-worker-")
        try:
            # the worker imports vkpool from where this process did
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            proc = subprocess.Popen([sys.executable, "-m", "vkpool.processes", json.dumps(spec)],
                                    pass_fds=(from_caller, to_caller), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr, close_fds=True, env=env)
        except BaseException:
            for fd in (to_worker, from_worker):
                os.close(fd)
            stderr.close()
            raise
        finally:
            os.close(from_caller)
            os.close(to_caller)
        return _Worker(home, stage, proc, to_worker, from_worker, stderr)

    def _await_ready(self, worker: _Worker) -> None:
        """Reads the worker's start-up frame; charges its chunk to the member's budget."""
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        header = None
        while header is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the worker process on {worker.member.id} did not load the model in "
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
        slot, status, body, _ = header
        answer = json.loads(body)
        if slot != HELLO or status not in (_READY, _REFUSED):
            raise RuntimeError(f"the worker process on {worker.member.id} answered {slot, status} at start")
        if status == _REFUSED:
            worker.alive = False
            if answer["type"] == "DeviceOutOfMemory":
                raise DeviceOutOfMemory(*answer["args"])
            raise RuntimeError(f"the worker process on {worker.member.id} could not load the model: "
                               f"{answer['type']}: {answer['message']}")
        stats = answer["stats"]
        charge = stats["weight_bytes"] + stats["arena_bytes"] + stats["io_bytes"]
        worker.member.budget.reserve(charge)  # refused (DeviceOutOfMemory) if others took the room meanwhile
        worker.charged = charge
        worker.stage.chunk = _RemoteChunk(stats, answer["run_slots"], answer["in_place"])

    # -- what it holds -------------------------------------------------------------------------
    @property
    def in_place(self) -> list[str]:
        """The tensors crossing between chunks that the workers' devices write and read in the
        shared slots themselves (``VK_EXT_external_memory_host``), with no copy by any process."""
        return sorted({name for w in self.workers if w.stage.chunk is not None for name in w.stage.chunk.in_place})

    # -- running -------------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray],
               shape: Callable[[dict[str, np.ndarray]], Any] | None = None) -> Future:
        """Starts one request on the least-loaded lane; the future's result is
        ``{output name: array}``, or what ``shape`` makes of it."""
        future = _Answer(self)
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is closed")
            home = max(self._homes, key=lambda h: len(h.free) if h.alive else -1)
            if not home.alive:
                raise RuntimeError("no worker process is running; " + "; ".join(
                    w.why_ended() for w in self.workers if not w.alive))
            if not home.free:
                self._backlog.append((feeds, shape, future))
                return future
            slot = home.free.pop()
            held = self._hold(home, slot, feeds, shape, future)
        self._start(home, slot, held)
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

    def _hold(self, home: _Home, slot: int, feeds: Mapping[str, np.ndarray],
              shape: Callable[[dict[str, np.ndarray]], Any] | None, future: Future) -> _Held:
        """Puts a request in ``slot`` (``_lock`` held); its first chunks count as sent."""
        stages = home.lane.stages
        held = _Held(feeds, shape, future, next(self._ids), [len(s.preds) for s in stages], len(stages),
                     len(home.roots), [0] * len(stages))
        home.busy[slot] = held
        return held

    def _start(self, home: _Home, slot: int, held: _Held) -> None:
        """Writes the request's inputs into its slot and sends it to the chunks that read only them."""
        try:
            views = home.views[slot]
            for name in self._input_names:
                if name in views:
                    np.copyto(views[name], held.feeds[name], casting="no")
        except BaseException as exc:  # the request fails, and its slot serves the next one
            held.outstanding = 1
            self._answered(home.workers[home.roots[0]], slot, exc)
            return
        for k in home.roots:
            self._send(home.workers[k], slot, held)

    def _send(self, worker: _Worker, slot: int, held: _Held) -> None:
        held.sent[worker.stage.index] = time.perf_counter_ns()
        try:
            os.write(worker.to_fd, bytes((slot,)))
        except OSError as exc:  # the worker is gone: its lane takes no more requests
            with self._lock:
                worker.alive = worker.home.alive = False
            error = RuntimeError(worker.why_ended())
            error.__cause__ = exc
            self._answered(worker, slot, error)

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
        that has read in the last ``HELP_SLICE_S`` or holds the pipes."""
        while True:
            fds = self._open_fds  # the pipes not yet seen closed (a tuple, replaced whole)
            if not fds:
                return
            select.select(fds, [], [])
            while time.monotonic() - self._helped < HELP_SLICE_S:
                time.sleep(HELP_SLICE_S)
            # never make a waiting thread wait for this one: it would sleep on its future until
            # this thread completes it, and each such hand-over costs more than the answer
            if not self._drain_lock.acquire(blocking=False):
                time.sleep(HELP_SLICE_S)
                continue
            try:
                if time.monotonic() - self._helped >= HELP_SLICE_S:
                    self._drain()
            finally:
                self._drain_lock.release()

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
        """``worker``'s chunk has run (or failed) for the request in ``slot``: send the request
        to the chunks that became ready, or complete it after its last chunk."""
        home, stage = worker.home, worker.stage
        now = time.perf_counter_ns()
        ready: list[_Worker] = []
        with self._lock:
            held = home.busy.get(slot)
            if held is None:  # the lane ended and its requests were failed already
                return
            held.outstanding -= 1
            if error is not None:
                held.error = held.error or error
            elif held.error is None:
                held.events.append((stage.index, worker.member.id, len(stage.nodes), held.sent[stage.index], now))
                for t in stage.transfers:
                    self.transfers_executed[(t.tensor, t.src, t.dst)] += 1
                held.left -= 1
                for succ in stage.succs:
                    held.waiting[succ] -= 1
                    if held.waiting[succ] == 0:
                        ready.append(home.workers[succ])
                held.outstanding += len(ready)
            finished = held.outstanding == 0
            if finished:
                del home.busy[slot]
        for nxt in ready:
            self._send(nxt, slot, held)
        if finished:
            self._finish(home, slot, held)

    def _finish(self, home: _Home, slot: int, held: _Held) -> None:
        """The request in ``slot`` has no run left: read its outputs, give the slot to the next."""
        if held.error is None:
            views = home.views[slot]
            out = {}
            for name in self._output_names:
                out[name] = views[name].copy() if name in views else np.array(held.feeds[name], copy=True)
        with self._lock:
            nxt = self._backlog.popleft() if self._backlog and home.alive else None
            if nxt is None:
                home.free.append(slot)
            else:
                queued = self._hold(home, slot, *nxt)
            if held.error is None:
                self._trace.append((held.id, home.lane.index, held.events))
        if nxt is not None:
            self._start(home, slot, queued)
        if held.error is not None:
            held.future.set_exception(held.error)
            return
        try:
            held.future.set_result(out if held.shape is None else held.shape(out))
        except BaseException as exc:
            held.future.set_exception(exc)

    def _ended(self, worker: _Worker) -> None:
        """The worker's pipe closed: fail what its lane held (and the queue, when no lane is
        left) and stop the lane's other workers."""
        if worker.proc.poll() is None:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        home = worker.home
        with self._lock:
            worker.alive = home.alive = False
            held = list(home.busy.values())
            home.busy.clear()
            left = [] if any(h.alive for h in self._homes) else list(self._backlog)
            if left:
                self._backlog.clear()
        for other in home.workers:
            if other.alive and other is not worker:
                try:
                    os.write(other.to_fd, bytes((CLOSE,)))
                except OSError:
                    pass
        if not held and not left:
            return
        error = RuntimeError(worker.why_ended() if not self._closed else
                             "the session was closed before this request finished")
        for item in held:
            if not item.future.done():
                item.future.set_exception(error)
        for item in left:
            item[2].set_exception(error)

    def close(self) -> None:
        """Refuses new requests, lets the live lanes serve every accepted one (up to
        ``CLOSE_WAIT_S``), then stops the workers and gives their memory back to the budgets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if not any(h.alive and h.busy and all(w.serving for w in h.workers) for h in self._homes):
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
            if worker.charged:
                worker.member.budget.release(worker.charged)
                worker.charged = 0
        with self._lock:
            left = list(self._backlog)
            self._backlog.clear()
        for item in left:
            item[2].set_exception(RuntimeError("the session was closed before this request finished"))
        for home in self._homes:
            home.unlink()
            home.views = []
            if home.mapping is not None:
                try:
                    home.mapping.close()
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
def _imported_io(device: Any, mapping: Any, fields: list[_Field], slots: int, slot_bytes: int
                 ) -> tuple[list[dict[str, Any]], list[Any]] | None:
    """Per request slot, each field's bytes of the shared mapping imported into ``device``
    (``VK_EXT_external_memory_host``), with the imports to free; None where the device cannot
    import them (no extension, an alignment above the fields', or the driver refusing)."""
    from vkpool.memory import HostImport

    align = device.host_import_alignment
    if not align or _ALIGN % align:
        return None
    imports: list[Any] = []
    try:
        io = []
        for k in range(slots):
            per = {}
            for f in fields:
                region = np.frombuffer(mapping, np.uint8, _span(f.nbytes), k * slot_bytes + f.offset)
                imports.append(HostImport(device, region))
                per[f.name] = imports[-1].allocation
            io.append(per)
    except (vk.VulkanError, ValueError):
        for imp in imports:
            imp.allocation.free()
        return None
    return io, imports


def _serve(spec: dict[str, Any]) -> None:
    from vkpool.column_split import split_products
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
    imported = None
    try:
        info = next((i for i in discover() if i.uuid == spec["uuid"] and i.index == spec["index"]), None)
        if info is None:
            raise RuntimeError(f"no Vulkan device with UUID {spec['uuid']} at index {spec['index']}")
        device = LogicalDevice(info, spec["transfer_queue"])
        member = VulkanMember(spec["member"], info, device, int(spec["budget"]), spec["split_index"])
        model = load_model(spec["model"], batch=int(spec["batch"]), dims=dict(spec["dims"]), partial=True)
        split_products(model, spec["column_splits"])
        groups = [[int(i) for i in g] for g in spec["groups"]]
        stage = stage_nodes(model, groups, [member] * len(groups))[int(spec["stage"])]
        if stage.inputs != [f.name for f in in_fields] or stage.outputs != [f.name for f in out_fields]:
            raise RuntimeError("the model loaded in the worker has other chunk inputs or outputs than the caller's")
        crossing = [f for f in in_fields + out_fields if f.name in spec["crossing"]]
        if spec["in_place"] and crossing:
            imported = _imported_io(device, mapping, crossing, slots, slot_bytes)
        chunk = build_chunk(model, stage, io=imported[0] if imported else None)
    except BaseException as exc:
        kind = type(exc).__name__
        args = [exc.member, exc.requested, exc.used, exc.budget] if isinstance(exc, DeviceOutOfMemory) else []
        os.write(wfd, _body(HELLO, _REFUSED, json.dumps({"type": kind, "args": args, "message": str(exc)}).encode()))
        raise
    s = chunk.stats
    stats = {name: int(getattr(s, name)) for name in ("weight_bytes", "arena_bytes", "io_bytes", "peak_live_bytes",
                                                      "dispatches", "barriers", "levels")}
    depth = min(chunk.slots, RUN_SLOTS)
    os.write(wfd, _body(HELLO, _READY, json.dumps({"stats": stats, "run_slots": depth,
                                                   "in_place": [f.name for f in crossing] if imported else []}
                                                  ).encode()))
    direct = {f.name for f in crossing} if imported else set()
    _loop(chunk, rfd, wfd, depth, _slot_views(mapping, [f for f in in_fields if f.name not in direct], slots,
                                              slot_bytes),
          _slot_views(mapping, [f for f in out_fields if f.name not in direct], slots, slot_bytes), bool(imported))
    chunk.close()
    for imp in imported[1] if imported else []:
        imp.allocation.free()
    device.close()


def _loop(chunk: Any, rfd: int, wfd: int, depth: int, inputs: list[dict[str, np.ndarray]],
          outputs: list[dict[str, np.ndarray]], in_place: bool) -> None:
    """Serves slots until ``CLOSE`` (or the caller's end of the pipe closing): keeps up to
    ``depth`` runs on the device, starting the next request before waiting for the oldest.
    ``inputs`` and ``outputs`` are the slots' tensors this worker copies in and out; with
    ``in_place`` the chunk has a run slot per request slot and reads and writes the others
    (tensors crossing between chunks) in the shared slot itself."""
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
        if waiting and len(running) < depth:
            slot = waiting.popleft()
            try:
                if in_place:
                    into = chunk.slot_views(slot)[0]
                    for name, view in inputs[slot].items():
                        np.copyto(into[name], view, casting="no")
                    chunk.start_in_place(slot)
                    running.append((slot, slot))
                else:
                    running.append((slot, chunk.start(inputs[slot])))
            except Exception as exc:
                os.write(wfd, _body(slot, _FAILED, f"{type(exc).__name__}: {exc}".encode()))
            continue
        if running:
            slot, token = running.popleft()
            try:
                if in_place:
                    chunk.wait_in_place(token)
                    produced = chunk.slot_views(slot)[1]
                else:
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
        print("usage: python -m vkpool.processes SPEC_JSON (started by vkpool.Session, not by hand)", file=sys.stderr)
        return 2
    _serve(json.loads(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ProcessExecutor", "PROCESS_SLOTS", "AVAILABLE"]
