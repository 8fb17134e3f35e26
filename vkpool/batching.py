"""Dynamic batching: requests for one model that arrive together run as one batched execution.

The model's inputs share a leading batch dimension (symbolic, or anonymous, in the ONNX file).
A :class:`BatchRunner` holds variants of the model compiled at batch sizes 1, 2, 4, ... up to
``max_batch`` and runs a batch on the right one; a :class:`Batcher` queues the requests of this
process for it with one dispatcher thread (the daemon's scheduler queues its clients' jobs for
it instead, ``vkpool.daemon.scheduler``):

1. ``submit(feeds)`` checks the request against the model's inputs (names, element types, the
   dims after the first, a leading dim of 1 to ``max_batch`` rows shared by every input) and
   refuses a bad one at once: an invalid request never joins a batch.
2. The dispatcher takes the oldest request and waits at most ``max_queue_delay`` seconds from its
   arrival for company (0: only what is already queued), taking requests in arrival order while
   their rows fit in ``max_batch``. The wait ends sooner once every sender of the batch answered
   last (a client of the daemon, a thread here) has as many requests in this one as it had
   there: clients that each send again when answered are all back, and a lone client waits for
   no one.
3. The batch's rows are written per input, padded with zeros, into a run slot of the smallest
   variant that holds them (where that would waste more than a quarter of the run, the longest
   prefix of requests that fills a variant exactly runs, and the rest opens the next batch;
   a variant without run slots, on the host member, gets them stacked into arrays); the variant
   runs; each request gets its own rows of every output back, copied out of the slot.
4. A request cancelled (``future.cancel()``) or past its ``timeout`` before its batch starts
   leaves the batch; a batch that fails fails only its own requests, each with the error.

This follows the semantics of Triton's dynamic batcher (``max_batch_size``,
``max_queue_delay_microseconds``) and Ray Serve's ``@serve.batch``. Every output must follow the
batch (its first dim is the batch size); a model whose outputs do not is refused at creation.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vkpool.percentiles import delay_percentiles_us
from vkpool.pipeline import RequestStats


class BatchingError(ValueError):
    """The model cannot be batched as asked (no batch dimension, outputs that do not follow it)."""


class BatchFailed(Exception):
    """A batch's run failed (:meth:`BatchRunner.run_whole`): ``cause`` is what it raised, which
    every request of the batch is answered with."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class PendingBatch:
    """A batch started by :meth:`BatchRunner.start_whole`: :meth:`done` says whether its run has
    ended, and :meth:`finish` (called once) waits for it and hands its outputs to ``use``."""

    __slots__ = ("_outputs", "_runner", "_slot", "rows", "size")

    def __init__(self, runner: BatchRunner, rows: list[int], size: int, slot: Any, outputs: list[np.ndarray] | None
                 ) -> None:
        self._runner, self.rows, self.size, self._slot, self._outputs = runner, rows, size, slot, outputs

    def done(self) -> bool:
        """Whether the run has ended (finishing it then does not wait)."""
        return self._slot is None or self._slot.done()

    def finish(self, use: Callable[[dict[str, np.ndarray], list[int]], Any]) -> Any:
        """Waits for the run and returns ``use(outputs, rows)`` (:meth:`BatchRunner.run_whole`);
        the run slot is given back after. Raises :class:`BatchFailed` when the batch failed."""
        runner, slot = self._runner, self._slot
        try:
            try:
                if slot is not None:
                    got = slot.finish()
                    outputs = [got[name] for name in runner.outputs]
                else:
                    outputs = self._outputs
                    assert outputs is not None
                for name, out in zip(runner.outputs, outputs):
                    if out.ndim == 0 or out.shape[0] != self.size:
                        raise BatchingError(f"output {name!r} has shape {list(out.shape)}: its first dim does "
                                            f"not follow the batch size {self.size}")
            except Exception as exc:
                runner.stats.failed_batches += 1
                raise BatchFailed(exc) from exc
            runner.stats.padded_rows += self.size - sum(self.rows)
            return use(dict(zip(runner.outputs, outputs)), self.rows)
        finally:
            if slot is not None:
                slot.release()


def variant_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch sizes compiled for ``max_batch``: the powers of two below it, and itself."""
    if max_batch < 1:
        raise BatchingError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [1 << k for k in range(max_batch.bit_length()) if (1 << k) < max_batch]
    return (*sizes, max_batch)


@dataclass
class _Request:
    feeds: dict[str, np.ndarray]
    rows: int
    outputs: list[str] | None
    future: Future
    arrived: float
    deadline: float  # perf_counter time after which it may no longer start; inf: none
    shape: Callable[[dict[str, np.ndarray]], Any] | None = None  # applied to the request's outputs
    settled: bool = False  # counted (Batcher._ended)
    sender: int = 0  # the submitting thread (BatchRunner.gather's company)


@dataclass
class BatchStats:
    """What a batcher did: batches run, requests and rows in them, and queue delays (seconds from
    a request's arrival to the start of its batch; the last ``keep`` are kept for percentiles)."""

    batches: int = 0
    requests: int = 0
    rows: int = 0
    padded_rows: int = 0
    failed_batches: int = 0
    where_read: int = 0  # batches run by the thread that read their requests (the daemon's)
    cancelled: int = 0
    timed_out: int = 0
    keep: int = 10_000
    delays: deque = field(default_factory=deque)

    def record_delay(self, seconds: float) -> None:
        self.record_delays((seconds,))

    def record_delays(self, seconds: Sequence[float]) -> None:
        delays = self.delays
        delays.extend(seconds)
        while len(delays) > self.keep:
            delays.popleft()

    def snapshot(self, samples: bool = False) -> dict[str, Any]:
        """The figures; ``samples``: the kept queue delays too (``queue_delays_us``, oldest
        first), for merging several batchers' (:func:`delay_percentiles_us`)."""
        delays_us = np.asarray(self.delays, dtype=np.float64) * 1e6
        p50, p99 = delay_percentiles_us(delays_us)
        snap = {
            "batches": self.batches, "requests": self.requests, "rows": self.rows,
            "padded_rows": self.padded_rows, "failed_batches": self.failed_batches, "where_read": self.where_read,
            "cancelled": self.cancelled, "timed_out": self.timed_out,
            "mean_batch_size": self.requests / self.batches if self.batches else 0.0,
            "queue_delay_p50_us": p50, "queue_delay_p99_us": p99,
        }
        if samples:
            snap["queue_delays_us"] = np.round(delays_us, 1).tolist()
        return snap


class BatchRunner:
    """The batched execution of one model, shared by every queue that batches it (the in-process
    :class:`Batcher`, the daemon's scheduler): the requests' check, the choice of how many queued
    requests run together (:meth:`fit`), and the run of a batch on the right variant (:meth:`run`).

    ``make_variant(size)`` returns something with ``run(output_names, feeds) -> list[ndarray]``
    and ``close()`` compiled at batch ``size``; ``inputs`` and ``outputs`` describe the model at
    batch 1 as ``(name, shape, dtype)`` with the batch dim first. Variants are compiled by
    :meth:`compile_all`, or else when first needed, one at a time.
    """

    def __init__(self, make_variant: Callable[[int], Any], inputs: Sequence[tuple[str, tuple[int, ...], Any]],
                 outputs: Sequence[str], *, max_batch: int, max_queue_delay: float = 0.0) -> None:
        if not (max_queue_delay >= 0.0 and np.isfinite(max_queue_delay)):
            raise BatchingError(f"max_queue_delay must be a finite number of seconds >= 0, got {max_queue_delay}")
        self.sizes = variant_sizes(int(max_batch))
        self.max_batch = int(max_batch)
        self.max_queue_delay = float(max_queue_delay)
        self.inputs = [(n, tuple(s[1:]), np.dtype(d)) for n, s, d in inputs]
        self.outputs = list(outputs)
        self._make_variant = make_variant
        self._variants: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.stats = BatchStats()
        self._awaited: Counter[Any] = Counter()  # requests per sender of the batch answered last

    def check(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None
              ) -> tuple[dict[str, np.ndarray], int]:
        """The request's arrays and row count, or :class:`~vkpool.session.InvalidInput` naming what is wrong."""
        from vkpool.session import InvalidInput

        expected = {n for n, _, _ in self.inputs}
        extra, missing = sorted(set(feeds) - expected), sorted(expected - set(feeds))
        if extra:
            raise InvalidInput(f"unknown input(s) {extra}; the model's inputs are {sorted(expected)}")
        if missing:
            raise InvalidInput(f"missing input(s) {missing}")
        arrays: dict[str, np.ndarray] = {}
        rows: int | None = None
        for name, tail, dtype in self.inputs:
            value = np.asarray(feeds[name])
            if value.dtype != dtype:
                raise InvalidInput(f"input {name!r} must be {dtype}, got {value.dtype}")
            if value.ndim != len(tail) + 1 or tuple(value.shape[1:]) != tail:
                raise InvalidInput(f"input {name!r} must have shape [rows, {', '.join(map(str, tail))}] "
                                   f"(rows 1..{self.max_batch}), got {list(value.shape)}")
            if rows is None:
                rows = value.shape[0]
            elif value.shape[0] != rows:
                raise InvalidInput(f"input {name!r} has {value.shape[0]} rows where the others have {rows}")
            arrays[name] = value
        assert rows is not None
        if not 1 <= rows <= self.max_batch:
            raise InvalidInput(f"a request carries 1 to {self.max_batch} rows (max_batch), got {rows}")
        unknown = [n for n in (output_names or ()) if n not in self.outputs]
        if unknown:
            raise InvalidInput(f"unknown output(s) {unknown}; the model's outputs are {self.outputs}")
        return arrays, rows

    def fit(self, rows: Sequence[int]) -> int:
        """How many of the queued requests (their row counts, in order) to run now. Rows are padded
        up to the next variant size; where that would waste more than a quarter of the run (5 rows
        in a variant of 8), the longest prefix whose rows fill a variant exactly runs instead and
        the rest opens the next batch."""
        total = sum(rows)
        size = next(s for s in self.sizes if s >= total)
        if 4 * (size - total) <= size:
            return len(rows)
        running, exact = 0, 0
        for k, r in enumerate(rows, 1):
            running += r
            if running in self.sizes:
                exact = k
        return exact or len(rows)

    def batches(self, rows: Sequence[int]) -> list[int]:
        """How requests read together (their row counts, in order, each at most ``max_batch``)
        split into consecutive batches: the number of requests in each, as :meth:`gather` and
        :meth:`fit` would take them from a queue that holds them all."""
        if len(rows) == 1:  # what a lone client sends: one request, one batch
            return [1]
        out, start = [], 0
        while start < len(rows):
            end, total = start, 0
            while end < len(rows) and total + rows[end] <= self.max_batch:
                total += rows[end]
                end += 1
            keep = self.fit(rows[start:max(end, start + 1)])
            out.append(keep)
            start += keep
        return out

    def company(self) -> int:
        """How many requests company is awaited from (:meth:`awaits`; ``max_batch`` before any
        batch was answered): a queue holding fewer still waits for it."""
        return min(sum(self._awaited.values()), self.max_batch) if self._awaited else self.max_batch

    def awaits(self, senders: Sequence[Any], rows: int) -> bool:
        """Whether requests gathered for a batch (who sent each, ``senders``; ``rows`` rows in
        all) still wait for company while their queue delay lasts: while their rows are under
        ``max_batch`` and a sender of the batch answered last (:meth:`answered`) has fewer
        requests among them than it had there; before any batch was answered, until
        ``max_batch`` rows. Clients that each send again once answered are so all back, and a
        lone client waits for no one; clients whose batch still runs are not waited for."""
        if rows >= self.max_batch:
            return False
        if not self._awaited:
            return True
        have = Counter(senders)
        return any(have[who] < n for who, n in self._awaited.items())

    def answered(self, senders: Sequence[Any]) -> None:
        """A batch of requests from ``senders`` ran and is being answered: company is awaited
        from them (:meth:`awaits`). Called before its replies go out."""
        self._awaited = Counter(senders)

    def gather(self, first: Any, rows: Callable[[Any], int], take: Callable[[], Any], give_back: Callable[[list], None],
               wait: Callable[[float], Any] | None, left: Callable[[], float],
               sender: Callable[[Any], Any]) -> list:
        """The batch that request ``first`` opens, for a queue that holds its lock: more requests
        (``take()``, the queue's next or None) while their rows (``rows(request)``) fit in
        ``max_batch``, waiting (``wait(seconds)``, which lets the lock go) while ``left()`` says
        time remains of the first one's queue delay (0 once the queue closes) and company is due
        (:meth:`awaits`, ``sender(request)`` telling who sent each); :meth:`fit` then decides how
        many run, and the others go back to the front of the queue in order (``give_back``), the
        first of them opening the next batch. ``wait`` None: nothing is waited for, and a batch
        that would wait goes back whole (an empty list)."""
        batch, total = [first], rows(first)
        while total < self.max_batch:
            nxt = take()
            if nxt is not None:
                if total + rows(nxt) > self.max_batch:
                    give_back([nxt])  # it keeps its place: it opens the next batch
                    break
                batch.append(nxt)
                total += rows(nxt)
                continue
            remaining = left() if self.awaits([sender(r) for r in batch], total) else 0.0
            if remaining <= 0:
                break
            if wait is None:
                give_back(batch)
                return []
            wait(remaining)
        keep = self.fit([rows(r) for r in batch])
        if keep < len(batch):
            give_back(batch[keep:])
        return batch[:keep]

    def compile_all(self) -> None:
        """Compiles every variant now, so that no request waits for a compile (a load pays for
        them instead, and the budgets refuse a ``max_batch`` that does not fit at load)."""
        for size in self.sizes:
            self._variant(size)

    def _variant(self, size: int) -> Any:
        with self._lock:
            variant = self._variants.get(size)
            if variant is None:
                variant = self._variants[size] = self._make_variant(size)
            return variant

    def run(self, requests: Sequence[tuple[Mapping[str, np.ndarray], Sequence[str] | None]]) -> list[list[np.ndarray]]:
        """Runs checked requests (arrays as :meth:`check` gives them, and output names or None for
        all) as one batch; each request's outputs, its own rows, copied. Raises when the batch fails."""
        names = [names for _, names in requests]
        try:
            return self.run_whole([feeds for feeds, _ in requests],
                                  lambda outputs, rows: self.split(outputs, rows, names))
        except BatchFailed as exc:
            raise exc.cause from None

    def run_whole(self, feeds: Sequence[Mapping[str, np.ndarray]], use: Callable[[dict[str, np.ndarray], list[int]], Any]
                  ) -> Any:
        """Runs checked requests' feeds as one batch and returns ``use(outputs, rows)``: the batch's
        outputs by name (the requests' rows first, in order, then any padding), valid only until
        ``use`` returns, and each request's row count. The rows go straight into a run slot of
        the variant where it has one (:meth:`vkpool.session.Session.staged`), else are stacked
        and given to its ``run``. Raises :class:`BatchFailed` when the batch fails (``use`` is
        not called then); what ``use`` raises passes through as it is."""
        pending = self.start_whole(feeds)
        assert pending is not None
        return pending.finish(use)

    def start_whole(self, feeds: Sequence[Mapping[str, np.ndarray]], block: bool = True) -> PendingBatch | None:
        """:meth:`run_whole` in two halves: the batch written into a run slot and submitted, and
        :meth:`PendingBatch.finish`, which waits for it (the caller may work meanwhile, and
        must finish it). A variant without run slots runs here and now. ``block`` False: None
        when the variant's run slots are all in use (nothing is counted then). Raises
        :class:`BatchFailed` when the batch fails."""
        first = self.inputs[0][0]
        rows = [f[first].shape[0] for f in feeds]
        total = sum(rows)
        size = next(s for s in self.sizes if s >= total)
        stats = self.stats
        stats.batches += 1
        stats.requests += len(rows)
        stats.rows += total
        slot = None
        try:
            variant = self._variant(size)
            stage = getattr(variant, "staged", None)
            try:
                slot = stage(block) if stage is not None else None
            except queue.Empty:
                stats.batches -= 1
                stats.requests -= len(rows)
                stats.rows -= total
                return None
            if slot is not None and self._fill(slot.inputs, feeds, rows, total, size):
                slot.start()
                return PendingBatch(self, rows, size, slot, None)
            if slot is not None:
                slot.release()
                slot = None
            return PendingBatch(self, rows, size, None, variant.run(self.outputs, self._stack(feeds, total, size)))
        except Exception as exc:
            stats.failed_batches += 1
            if slot is not None:
                slot.release()
            raise BatchFailed(exc) from exc

    def _fill(self, into: Mapping[str, np.ndarray], feeds: Sequence[Mapping[str, np.ndarray]], rows: Sequence[int],
              total: int, size: int) -> bool:
        """The requests' rows written into a run slot's inputs ``into``, the padding zeroed; False
        (nothing run) where the slot's inputs are not of the batch's shapes."""
        for name, tail, dtype in self.inputs:
            dst = into.get(name)
            if dst is None or dst.dtype != dtype or dst.shape != (size, *tail):
                return False
        for name, _, _ in self.inputs:
            dst, at = into[name], 0
            for f, r in zip(feeds, rows):
                dst[at:at + r] = f[name]
                at += r
            if size > total:
                dst[total:] = 0
        return True

    def _stack(self, feeds: Sequence[Mapping[str, np.ndarray]], total: int, size: int) -> dict[str, np.ndarray]:
        """The requests' rows of each input in one array, padded with zeros to ``size`` rows."""
        stacked = {}
        for name, tail, dtype in self.inputs:
            parts = [f[name] for f in feeds]
            if size > total:
                parts.append(np.zeros((size - total, *tail), dtype))
            stacked[name] = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        return stacked

    def views(self, outputs: Mapping[str, np.ndarray], rows: Sequence[int], names: Sequence[Sequence[str] | None]
              ) -> list[list[np.ndarray]]:
        """Each request's own rows of :meth:`run_whole`'s outputs, the outputs it names (``names``,
        None for all), as views: valid only while the outputs are (inside ``use``)."""
        results, offset = [], 0
        for wanted, r in zip(names, rows):
            results.append([outputs[n][offset:offset + r] for n in (wanted or self.outputs)])
            offset += r
        return results

    def split(self, outputs: Mapping[str, np.ndarray], rows: Sequence[int], names: Sequence[Sequence[str] | None]
              ) -> list[list[np.ndarray]]:
        """:meth:`views`, copied: the batch's outputs may be a run slot's memory, written again by
        the next run."""
        return [[v.copy() for v in request] for request in self.views(outputs, rows, names)]

    def close(self) -> None:
        with self._lock:
            for variant in self._variants.values():
                variant.close()
            self._variants.clear()


class Batcher:
    """Groups requests submitted in this process into batched runs (module docstring): a queue
    and a dispatcher thread (started at the first request) over a :class:`BatchRunner`. It is a
    runner of the request pipeline (:mod:`vkpool.pipeline`): ``submit``, ``run``, ``close`` and
    ``stats`` keep the contract every runner keeps."""

    runs_in = "a batching thread, over a variant per batch size"

    def __init__(self, runner: BatchRunner, name: str = "model") -> None:
        self.runner = runner
        self.max_batch = runner.max_batch
        self.max_queue_delay = runner.max_queue_delay
        self.batch_stats = runner.stats
        self.name = name
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._accepted = self._ok = self._failed = 0

    def submit(self, feeds: Mapping[str, Any], shape: Callable[[dict[str, np.ndarray]], Any] | None = None, *,
               output_names: Sequence[str] | None = None, timeout: float | None = None) -> Future:
        """Queues a request; its future gives ``{output name: array}`` of the outputs named (all
        when None), each with the request's own rows, or what ``shape`` makes of that (an error
        ``shape`` raises is the request's). ``timeout``: seconds it may wait before its batch
        starts. A request that does not fit the model is refused here, before it is accepted
        (:class:`~vkpool.session.InvalidInput`): it never joins a batch."""
        from vkpool.session import InvalidInput

        arrays, rows = self.runner.check(feeds, output_names)
        if timeout is not None and not timeout > 0:
            raise InvalidInput(f"timeout must be a positive number of seconds, got {timeout}")
        now = time.perf_counter()
        request = _Request(arrays, rows, list(output_names) if output_names is not None else None, Future(), now,
                           now + timeout if timeout is not None else float("inf"), shape,
                           sender=threading.get_ident())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the batcher of {self.name!r} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"vkpool-batcher-{self.name}", daemon=True)
                self._thread.start()
            self._queue.append(request)
            self._accepted += 1
            self._cond.notify()
        return request.future

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """:meth:`submit` and wait: the request runs in a batch with what else is queued."""
        return self.submit(feeds).result()

    def stats(self) -> RequestStats:
        with self._cond:
            ended = self._ok + self._failed
            return RequestStats(self._accepted, self._ok, self._failed, self._accepted - ended)

    def _ended(self, request: _Request, result: Any = None, error: BaseException | None = None) -> None:
        """Settle a request, exactly once: counted, then its future answered (a cancelled one
        is only counted)."""
        with self._cond:
            if request.settled:
                return
            request.settled = True
            if error is None and not request.future.cancelled():
                self._ok += 1
            else:
                self._failed += 1
        if request.future.cancelled():
            return
        if error is None:
            request.future.set_result(result)
        else:
            request.future.set_exception(error)

    def _take_batch(self) -> list[_Request] | None:
        """The next batch, waiting for its first request and then up to the queue delay
        (:meth:`BatchRunner.gather`)."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            queue = self._queue
            first = queue.popleft()
            until = first.arrived + self.max_queue_delay
            return self.runner.gather(first, lambda r: r.rows, lambda: queue.popleft() if queue else None,
                                      lambda back: queue.extendleft(reversed(back)), self._cond.wait,
                                      lambda: 0.0 if self._closed else until - time.perf_counter(),
                                      lambda r: r.sender)

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            start = time.perf_counter()
            live = []
            for r in batch:
                if r.deadline < start:
                    if r.future.set_running_or_notify_cancel():
                        self.batch_stats.timed_out += 1
                        self._ended(r, error=TimeoutError(f"the request waited past its timeout before its "
                                                          f"batch started ({(start - r.arrived) * 1e3:.1f} ms)"))
                    else:
                        self.batch_stats.cancelled += 1
                        self._ended(r)
                elif r.future.set_running_or_notify_cancel():
                    live.append(r)
                else:
                    self.batch_stats.cancelled += 1
                    self._ended(r)
            if not live:
                continue
            for r in live:
                self.batch_stats.record_delay(start - r.arrived)
            # the one dispatcher gathers no other batch while this one runs: its senders are
            # awaited from here on, as they are once answered
            self.runner.answered([r.sender for r in live])
            try:
                results = self.runner.run([(r.feeds, r.outputs) for r in live])
            except Exception as exc:  # the batch's own requests fail, each with the error; the next batch runs
                for r in live:
                    self._ended(r, error=exc)
                continue
            for r, result in zip(live, results):
                produced = dict(zip(r.outputs or self.runner.outputs, result))
                try:
                    shaped = produced if r.shape is None else r.shape(produced)
                except Exception as exc:  # the request's own shaping failed: only it fails
                    self._ended(r, error=exc)
                else:
                    self._ended(r, shaped)

    def close(self) -> None:
        """Stops the dispatcher once the batch it runs has ended; requests still queued fail with
        a RuntimeError. The runner's variants are its owner's to close."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        for r in pending:
            if r.future.set_running_or_notify_cancel():
                self._ended(r, error=RuntimeError(f"the batcher of {self.name!r} was closed"))
            else:
                self._ended(r)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
