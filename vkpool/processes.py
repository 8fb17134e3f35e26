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

- **Copies and mailboxes.** A copy is one complete copy of the model: the plan's chunks, or
  one replica (:class:`~vkpool.pipeline.ModelCopy`). Each copy has ``mailboxes`` in one
  file-backed mapping that the calling process and the copy's workers map; a mailbox holds a
  request's inputs and outputs and every tensor that crosses between the copy's chunks, each at
  a fixed offset (page aligned). A chunk's worker reads its inputs from the mailbox and writes
  its outputs there, so a tensor crossing members goes device → host (the mapping) → device
  without passing through the caller. Where both devices import host memory
  (``VK_EXT_external_memory_host``) that hop can copy nothing on the host: the producer's
  kernels write the tensor into the mailbox and the consumer's commands read it from there
  (``in_place``, off by default: see :class:`ProcessExecutor`); otherwise the workers copy it
  out of and into their chunks' own memory. The file is unlinked once the copy's workers have
  mapped it, so nothing is left behind however the processes end.
- **Wire.** Caller → worker: one byte per run, the request's mailbox (``CLOSE`` asks the worker
  to finish what it holds and exit). Worker → caller: ``mailbox, 0`` when the chunk's outputs
  are written; ``mailbox, 1``, a 4-byte length and a UTF-8 message when the run failed; at
  start, ``HELLO`` frames carrying JSON: the compiled chunk's statistics, or the error that
  stopped the worker. The caller sends a mailbox to a chunk's worker once every chunk it reads
  from has answered for it, so independent chunks run at once and, with several requests in
  flight, chunk 1 runs request k+1 while chunk 2 runs request k.
- **Scheduling** is the pipeline's (:mod:`vkpool.pipeline`): a copy's mailboxes are its places,
  so a request goes to the live copy with the fewest requests in flight that has a free
  mailbox; with every mailbox taken it waits in the backlog, which the first mailbox to free
  takes from.
- **Answers.** The thread that submits, and a thread that waits on a request's future, read
  the workers' answers themselves (one ``poll`` of their pipes, under one lock), so no
  hand-over between threads happens per request: on two H200s that took mnist12_like from
  24–29 k to 29–46 k requests/s. A reader thread completes the answers nobody waits for; it
  leaves them to a waiting thread that has read within ``HELP_SLICE_S``.
- **Mapping.** ``/dev/shm`` where it has room (its space reserved up front), else the temp
  folder.
- **Failures.** A failed run fails its own request only. A worker that dies fails the
  requests its copy held, with its exit status and the end of its error output, and the
  copy's other workers are stopped; the other copies keep serving the rest.
- **Budgets.** A worker compiles under what the member's budget has free in the calling
  process, and the calling process then charges what the worker's chunk holds to that
  budget, so plans, ``vkpool status`` and other sessions see the memory as used.

Both this executor and :class:`~vkpool.executor.PlanExecutor` are a
:class:`~vkpool.pipeline.Pipeline` (``copies``, ``submit``, ``trace``, ``stats``, ...), so
:class:`~vkpool.session.Session` uses either.
"""
from __future__ import annotations

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
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from vkpool import vk
from vkpool.engine import ChunkStats, copy_out
from vkpool.executor import RUN_SLOTS
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel
from vkpool.pipeline import CLOSED, ModelCopy, Pipeline, Request, Stage, plan_copies, stage_nodes

#: whether this system can run worker processes (POSIX pipes passed to a child, ``poll``)
AVAILABLE = os.name == "posix" and hasattr(select, "poll")
#: mailboxes of a one-chunk copy: two on the device (the chunk's run slots) and two
#: waiting; a copy gets two more for each further chunk, so every chunk can keep two runs
MAILBOXES = 4
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
#: fields of a mailbox start on page boundaries, so a device can import each one in place
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
    """The bytes a field of ``nbytes`` takes in a mailbox: whole pages, at least one."""
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def _layout(model: LoadedModel, names: Sequence[str]) -> tuple[list[_Field], int]:
    fields, at = [], 0
    for name in names:
        info = model.tensors[name]
        fields.append(_Field(name, np.dtype(info.dtype).str, tuple(int(d) for d in info.shape), at))
        at += _span(info.nbytes)
    return fields, at


def _mailbox_views(buffer: Any, fields: list[_Field], mailboxes: int, mailbox_bytes: int) -> list[dict[str, np.ndarray]]:
    return [{f.name: f.view(buffer, k * mailbox_bytes) for f in fields} for k in range(mailboxes)]


class _RemoteChunk:
    """What the calling process knows of a worker's chunk: its statistics, run slots, and
    the tensors it reads or writes in the shared mailboxes in place."""

    def __init__(self, stats: dict[str, int], slots: int, in_place: list[str]) -> None:
        self.stats = ChunkStats(**stats)
        self.slots = slots
        self.in_place = in_place


class _Worker:
    """One chunk's process and its pipes."""

    def __init__(self, home: _Home, stage: Stage, proc: subprocess.Popen, to_fd: int, from_fd: int,
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
    """One copy's mailboxes, in one shared mapping, and its workers (one per chunk, in the copy's order)."""

    def __init__(self, copy: ModelCopy, fields: list[_Field], mailboxes: int, mailbox_bytes: int) -> None:
        self.copy = copy
        self.fields = fields
        self.mailboxes = mailboxes
        self.mailbox_bytes = mailbox_bytes
        self.path: str | None = None  # the mapping's file, until the workers have mapped it
        self.mapping: mmap.mmap | None = None
        self.views: list[dict[str, np.ndarray]] = []
        self.held: dict[int, Request] = {}  # mailbox → the request in it
        self.workers: list[_Worker] = []
        # tensors one chunk of the copy writes and another reads
        produced = {name for s in copy.stages for name in s.outputs}
        self.crossing = sorted({name for s in copy.stages for name in s.inputs if name in produced})
        copy.free = list(range(mailboxes))

    def map(self) -> None:
        size = self.mailboxes * self.mailbox_bytes
        for folder in (["/dev/shm"] if os.path.isdir("/dev/shm") else []) + [None]:
            fd, path = tempfile.mkstemp(prefix=f"vkpool-copy{self.copy.index}-", dir=folder)
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
        self.views = _mailbox_views(self.mapping, self.fields, self.mailboxes, self.mailbox_bytes)

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


class ProcessExecutor(Pipeline):
    """Runs ``plan`` (its chunks, and the whole model on each replica) with one worker process
    per chunk and per replica (see the module doc). ``source`` is the model as the session got
    it (a path or its bytes) with ``batch`` and ``dims``, which each worker loads; ``graph`` is
    the partition graph the plan was made on. ``mailboxes`` overrides the mailboxes per copy.

    ``in_place``: a worker imports the mailboxes' tensors that cross between chunks into its
    device (``VK_EXT_external_memory_host``) where the device can: the producing chunk's kernels
    write them into the shared mailbox and the consuming chunk's commands read them from there,
    with no copy by any process (the model's own inputs and outputs are copied either way:
    kernels reading a request across the bus made one mnist12_like worker slower, 21.0 k against
    22.8 k requests/s on an H200). Off by default: on two H200s the workloads at hand ran faster
    with the workers copying, whose copies overlap the device's work while the consumer's read
    across the bus does not (conv_many_255MB cut after its convolutions, a 49 KiB tensor
    crossing: 9.40-9.44 k requests/s over four runs copying, 8.98-9.22 k over three in place;
    matmul_1GB_16layers 5.79-5.83 k over four against 5.65-5.76 k over two)."""

    runs_in = "a worker process per chunk and per replica"

    def __init__(self, pool: Any, model: LoadedModel, plan: Any, graph: Any, source: str | bytes, batch: int,
                 dims: Mapping[str, int], mailboxes: int | None = None, *, in_place: bool = False) -> None:
        from vkpool.pool import VulkanMember

        if not AVAILABLE:
            raise ValueError("worker processes need POSIX pipes and shared mappings; on this system "
                             "leave processes unset (or False)")
        super().__init__(model, plan, plan_copies(pool, model, plan, graph))
        self._in_place = in_place
        others = sorted({s.member.id for copy in self.copies for s in copy.stages
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
            for copy in self.copies:
                names = list(dict.fromkeys(n for s in copy.stages for n in [*s.inputs, *s.outputs]))
                fields, size = _layout(model, names)
                count = mailboxes if mailboxes is not None else MAILBOXES + 2 * (len(copy.stages) - 1)
                if not 1 <= count < CLOSE:
                    raise ValueError(f"mailboxes must be 1 to {CLOSE - 1}")
                self._homes.append(_Home(copy, fields, count, max(_ALIGN, size)))
            if isinstance(source, (bytes, bytearray)):
                fd, model_file = tempfile.mkstemp(prefix="vkpool-model-", suffix=".onnx")
                with os.fdopen(fd, "wb") as f:
                    f.write(source)
                source = model_file
            for home in self._homes:  # all start loading at once
                home.map()
                groups = [[position[id(node)] for node in s.nodes] for s in home.copy.stages]
                for stage in home.copy.stages:
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
    def _spawn(self, home: _Home, stage: Stage, groups: list[list[int]], source: str, batch: int,
               dims: dict[str, int]) -> _Worker:
        member = stage.member
        by_name = {f.name: f for f in home.fields}
        from_caller, to_worker = os.pipe()  # (read end, write end)
        from_worker, to_caller = os.pipe()
        spec = {
            "model": source, "batch": batch, "dims": dims, "member": member.id, "uuid": member.info.uuid,
            "index": member.info.index, "split_index": member.split_index, "budget": member.budget.free_bytes,
            "transfer_queue": member.device.transfer_queue_mode,
            "shm": home.path, "mailboxes": home.mailboxes, "mailbox_bytes": home.mailbox_bytes,
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
        mailbox, status, body, _ = header
        answer = json.loads(body)
        if mailbox != HELLO or status not in (_READY, _REFUSED):
            raise RuntimeError(f"the worker process on {worker.member.id} answered {mailbox, status} at start")
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
        shared mailboxes themselves (``VK_EXT_external_memory_host``), with no copy by any process."""
        return sorted({name for w in self.workers if w.stage.chunk is not None for name in w.stage.chunk.in_place})

    # -- the pipeline's backend ----------------------------------------------------------------
    def _new_future(self) -> Future:
        return _Answer(self)

    def _no_copy_left(self) -> str:
        return "no worker process is running; " + "; ".join(w.why_ended() for w in self.workers if not w.alive)

    def _prepare(self, request: Request) -> None:
        """Writes the request's inputs into its mailbox."""
        home = self._homes[request.copy.index]  # type: ignore[union-attr]
        home.held[request.place] = request
        views = home.views[request.place]
        for name in self._input_names:
            if name in views:
                np.copyto(views[name], request.feeds[name], casting="no")

    def _launch(self, request: Request, stage: Stage) -> None:
        worker = self._homes[request.copy.index].workers[stage.index]  # type: ignore[union-attr]
        request.started[stage.index] = time.perf_counter_ns()
        try:
            os.write(worker.to_fd, bytes((request.place,)))
        except OSError as exc:  # the worker is gone: its copy takes no more requests
            worker.alive = False
            error = RuntimeError(worker.why_ended())
            error.__cause__ = exc
            self._copy_lost(worker.home.copy, error)
            self._run_ended(request, stage, error)

    def _outputs(self, request: Request) -> dict[str, np.ndarray]:
        views = self._homes[request.copy.index].views[request.place]  # type: ignore[union-attr]
        return {name: copy_out(views[name]) if name in views else np.array(request.feeds[name], copy=True)
                for name in self._output_names}

    def _after_submit(self) -> None:
        # complete what has been answered meanwhile here, in the submitting thread: handing each
        # answer to the reader thread and back costs more than the answer itself
        if self._drain_lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._drain_lock.release()

    # -- answers -------------------------------------------------------------------------------
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
                mailbox, status, body, buf = frame
                answers.append((mailbox, {} if status == _OK else RuntimeError(
                    f"{worker.member.id}: {body.decode(errors='replace')}")))
            worker.buf = buf  # before completing: a callback may read further answers
            for mailbox, outcome in answers:
                request = worker.home.held.get(mailbox)
                if request is not None:
                    self._run_ended(request, worker.stage, outcome)

    def _ended(self, worker: _Worker) -> None:
        """The worker's pipe closed: fail what its copy held (and the backlog, when no copy is
        left) and stop the copy's other workers."""
        if worker.proc.poll() is None:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        worker.alive = False
        home = worker.home
        for other in home.workers:
            if other.alive and other is not worker:
                try:
                    os.write(other.to_fd, bytes((CLOSE,)))
                except OSError:
                    pass
        self._copy_lost(home.copy, RuntimeError(CLOSED if self._closed else worker.why_ended()))

    def _stop(self) -> None:
        """Lets the live copies serve every accepted request (up to ``CLOSE_WAIT_S``), then
        stops the workers and gives their memory back to the budgets."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if not any(r.copy is not None and r.copy.alive for r in self._pending.values()) \
                        or not all(w.serving for w in self.workers):
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

    def _free(self) -> None:
        for home in self._homes:
            home.unlink()
            home.views = []
            if home.mapping is not None:
                try:
                    home.mapping.close()
                except BufferError:  # a caller still holds a view of a mailbox; the mapping goes with it
                    pass


def _frame(buf: bytes) -> tuple[int, int, bytes, bytes] | None:
    """The first whole frame of ``buf``: (mailbox, status, body, rest), or None until it is whole."""
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


def _body(mailbox: int, status: int, body: bytes) -> bytes:
    return bytes((mailbox, status)) + struct.pack("<I", len(body)) + body


# -- the worker process ------------------------------------------------------------------------
def _imported_io(device: Any, mapping: Any, fields: list[_Field], mailboxes: int, mailbox_bytes: int
                 ) -> tuple[list[dict[str, Any]], list[Any]] | None:
    """Per mailbox, each field's bytes of the shared mapping imported into ``device``
    (``VK_EXT_external_memory_host``), with the imports to free; None where the device cannot
    import them (no extension, an alignment above the fields', or the driver refusing)."""
    from vkpool.memory import HostImport

    align = device.host_import_alignment
    if not align or _ALIGN % align:
        return None
    imports: list[Any] = []
    try:
        io = []
        for k in range(mailboxes):
            per = {}
            for f in fields:
                region = np.frombuffer(mapping, np.uint8, _span(f.nbytes), k * mailbox_bytes + f.offset)
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
    mailboxes, mailbox_bytes = int(spec["mailboxes"]), int(spec["mailbox_bytes"])
    fd = os.open(spec["shm"], os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, mailboxes * mailbox_bytes)
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
            imported = _imported_io(device, mapping, crossing, mailboxes, mailbox_bytes)
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
    _loop(chunk, rfd, wfd, depth,
          _mailbox_views(mapping, [f for f in in_fields if f.name not in direct], mailboxes, mailbox_bytes),
          _mailbox_views(mapping, [f for f in out_fields if f.name not in direct], mailboxes, mailbox_bytes),
          bool(imported))
    chunk.close()
    for imp in imported[1] if imported else []:
        imp.allocation.free()
    device.close()


def _loop(chunk: Any, rfd: int, wfd: int, depth: int, inputs: list[dict[str, np.ndarray]],
          outputs: list[dict[str, np.ndarray]], in_place: bool) -> None:
    """Serves mailboxes until ``CLOSE`` (or the caller's end of the pipe closing): keeps up to
    ``depth`` runs on the device, starting the next request before waiting for the oldest.
    ``inputs`` and ``outputs`` are the mailboxes' tensors this worker copies in and out; with
    ``in_place`` the chunk has a run slot per mailbox and reads and writes the others
    (tensors crossing between chunks) in the shared mailbox itself."""
    os.set_blocking(rfd, False)
    waiting: deque[int] = deque()  # mailboxes written by the caller, not yet started
    running: deque[tuple[int, int]] = deque()  # (mailbox, the chunk's run slot)
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
            mailbox = waiting.popleft()
            try:
                if in_place:
                    into = chunk.slot_views(mailbox)[0]
                    for name, view in inputs[mailbox].items():
                        np.copyto(into[name], view, casting="no")
                    chunk.start_in_place(mailbox)
                    running.append((mailbox, mailbox))
                else:
                    running.append((mailbox, chunk.start(inputs[mailbox])))
            except Exception as exc:
                os.write(wfd, _body(mailbox, _FAILED, f"{type(exc).__name__}: {exc}".encode()))
            continue
        if running:
            mailbox, token = running.popleft()
            try:
                if in_place:
                    chunk.wait_in_place(token)
                    produced = chunk.slot_views(mailbox)[1]
                else:
                    produced = chunk.finish(token)
                for name, view in outputs[mailbox].items():
                    np.copyto(view, produced[name], casting="no")
            except Exception as exc:
                os.write(wfd, _body(mailbox, _FAILED, f"{type(exc).__name__}: {exc}".encode()))
            else:
                os.write(wfd, bytes((mailbox, _OK)))
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


__all__ = ["ProcessExecutor", "MAILBOXES", "AVAILABLE"]
