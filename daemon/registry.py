"""Loaded models: identified by content hash, shared, reference-counted per client.

A model loaded twice (by path or by bytes, by one client or several) is one entry with one
runtime session. Each client holds references; when none is left and the model has had no job
for its keep-alive (as Ollama's ``keep_alive``), the daemon frees it.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from vkpool import progress
from vkpool.daemon.protocol import ProtocolViolation


def content_id(source: Path | bytes, max_bytes: int = 1 << 62) -> str:
    """sha256 of the model bytes and, for a path, of the external data files it names.

    External locations that leave the model's folder are refused here, before anything reads
    them (the runtime refuses them too). Only regular files are read, and at most ``max_bytes``
    in all (see :func:`open_regular`).
    """
    digest = hashlib.sha256()
    if isinstance(source, (bytes, bytearray, memoryview)):
        digest.update(source)
        return digest.hexdigest()
    with open_regular(source, max_bytes) as handle:
        data = handle.read()
    base = source.parent.resolve()
    external = [(location, _inside(base, location)) for location in _external_locations(data)]
    total = len(data) + sum(path.stat().st_size for _, path in external)  # stat never waits on a FIFO
    left = max_bytes - len(data)
    with progress.task("hash", total, unit="B", what=source.name) as task:
        view = memoryview(data)
        for start in range(0, len(data), _HASH_BLOCK):
            block = view[start:start + _HASH_BLOCK]
            digest.update(block)
            task.advance(len(block))
        for location, path in external:
            digest.update(location.encode())
            with open_regular(path, left) as handle:
                for chunk in iter(lambda: handle.read(_HASH_BLOCK), b""):
                    digest.update(chunk)
                    task.advance(len(chunk))
                    left -= len(chunk)
    return digest.hexdigest()


_HASH_BLOCK = 32 << 20


def check_regular(path: Path, max_bytes: int) -> None:
    """Refuse (``ModelError``) a path that is not a regular file of at most ``max_bytes``, by its
    metadata alone: a FIFO, a device or a socket is never opened, so never waited on.
    ``OSError`` when it cannot be looked at."""
    _check_stat(path, os.stat(path), max_bytes)


@contextmanager
def open_regular(path: Path, max_bytes: int) -> Iterator[BinaryIO]:
    """``path`` opened for reading when it is a regular file of at most ``max_bytes``, else
    ``ModelError``. The open does not wait for a FIFO's writer (``O_NONBLOCK``), and the check is
    made on the opened file, so a path swapped after an earlier check is caught too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_stat(path, os.fstat(fd), max_bytes)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


def _check_stat(path: Path, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolViolation("ModelError", f"{path} is not a regular file; the daemon reads models and their "
                                "external data from regular files only", {"path": str(path)})
    if st.st_size > max_bytes:
        raise ProtocolViolation("ModelError", f"{path} has {st.st_size} bytes, more than the "
                                f"{max_bytes} left under daemon.max_model_bytes; raise it in the config",
                                {"path": str(path), "bytes": st.st_size, "max_model_bytes": max_bytes})


def bound_id(content: str, binding: dict[str, Any]) -> str:
    """The id of a model loaded with symbolic dims bound: the content hash when nothing is bound,
    else a hash of it and the binding (one model, two batch sizes: two entries)."""
    if not binding:
        return content
    return hashlib.sha256(f"{content}:{json.dumps(binding, sort_keys=True)}".encode()).hexdigest()


def _external_locations(data: bytes) -> list[str]:
    import onnx  # only path loads pay for importing onnx

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)  # parsing never reads external files
    except Exception:
        return []  # not ONNX: the runtime says so with its own message
    found: list[str] = []
    tensors = list(proto.graph.initializer)
    for node in proto.graph.node:
        tensors += [a.t for a in node.attribute if a.HasField("t")]
    for tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in tensor.external_data}.get("location", "")
            if location not in found:
                found.append(location)
    return found


def _inside(base: Path, location: str) -> Path:
    rel = Path(location)
    resolved = (base / rel).resolve()
    if not location or rel.is_absolute() or ".." in rel.parts or not resolved.is_relative_to(base):
        raise ProtocolViolation("ModelError", f"external data {location!r} lies outside the model's "
                                f"folder {base}", {"location": location, "folder": str(base)})
    return resolved


def describe_values(values: Any) -> list[dict[str, Any]]:
    # ints as they are, a symbolic dim by its name, a dim known only at run time (a cut model's
    # outputs, vkpool.dynamic) as None, as the in-process Session gives them
    return [{"name": v.name, "shape": [d if d is None or isinstance(d, int) else str(d) for d in v.shape],
             "type": v.type, "dtype": str(v.dtype)} for v in values]


@dataclass(eq=False)
class ModelEntry:
    id: str
    name: str
    source: Path | bytes
    session: Any
    keep_alive: float
    binding: dict[str, Any] = field(default_factory=dict)  # {batch, dims} the session was opened with
    refs: Counter[bytes] = field(default_factory=Counter)
    last_used: float = field(default_factory=time.monotonic)
    # Workers hold it shared while running; a re-plan holds it exclusively to swap the session.
    gate: "SharedGate" = field(default_factory=lambda: SharedGate())
    run_s: float | None = None      # moving average of the runtime's run time, once measured
    batch_config: dict[str, Any] = field(default_factory=dict)  # {max_batch, max_queue_delay}; empty: off
    objective: str = "latency"  # what the session's plan was made for

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Cache what the I/O thread needs, so it never calls into a session being replaced."""
        #: the session's :class:`~vkpool.batching.BatchRunner` when the model batches requests, else
        #: None (read on every request: an attribute, not a lookup in the session)
        self.batching: Any = getattr(self.session, "batch_runner", None)
        self.inputs = describe_values(self.session.get_inputs())
        self.outputs = describe_values(self.session.get_outputs())
        if self.batching is not None:  # requests carry 1..max_batch rows along the first dim
            for value in (*self.inputs, *self.outputs):
                value["shape"][0] = "batch"
            self.input_specs = {i["name"]: i for i in self.inputs}
        else:  # a dim the model leaves symbolic may take another size per request (the session
            # compiles that shape on first use), so the check leaves it free
            self.input_specs = {i["name"]: i for i in describe_values(self.session.get_inputs(symbolic=True))}
        self.input_dtypes = {i["name"]: np.dtype(i["dtype"]) for i in self.inputs}
        self.output_names = [o["name"] for o in self.outputs]
        self.memory = {k: int(v) for k, v in self.session.memory_by_member().items()}

    def info(self, queued: int = 0, running: int = 0, done: int = 0, samples: bool = False) -> dict[str, Any]:
        """The model as ``list_models`` describes it; ``samples``: with its queue delays
        (:meth:`vkpool.batching.BatchStats.snapshot`)."""
        runner = self.batching
        batching = None if runner is None else {**self.batch_config, **runner.stats.snapshot(samples)}
        return {"id": self.id, "name": self.name, "binding": self.binding, "objective": self.objective,
                "batching": batching,
                "inputs": self.inputs, "outputs": self.outputs,
                "memory_by_member": self.memory, "members": sorted(m for m, n in self.memory.items() if n),
                "refs": sum(self.refs.values()), "keep_alive": self.keep_alive,
                "idle_s": round(time.monotonic() - self.last_used, 3),
                "queued": queued, "running": running, "done": done}


@dataclass(eq=False)
class Loading:
    """A model being loaded: what its load reported last (:mod:`vkpool.progress`)."""

    name: str
    path: str | None
    started: float = field(default_factory=time.monotonic)
    update: Any = None  # the latest vkpool.progress.Update; None before the first

    def report(self, update: Any) -> None:
        self.update = update

    def info(self) -> dict[str, Any]:
        u = self.update
        fraction = None if u is None else u.fraction
        return {"name": self.name, "path": self.path, "elapsed_s": round(time.monotonic() - self.started, 3),
                "stage": None if u is None else u.stage, "what": "" if u is None else u.what,
                "done": 0 if u is None else u.done, "total": None if u is None else u.total,
                "unit": "" if u is None else u.unit,
                "fraction": None if fraction is None else round(fraction, 4)}


class SharedGate:
    """A readers-writer lock: many jobs run at once; a re-plan waits for them and excludes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken directly where nothing waits or is notified: cheaper
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._writer = False

    def acquire_shared(self) -> None:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1

    def try_acquire_shared(self) -> bool:
        """Take a shared hold without waiting; False while a re-plan holds or waits for the gate."""
        with self._lock:
            if self._writer:
                return False
            self._readers += 1
            return True

    def release_shared(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._writer and not self._readers:  # only a re-plan waits for the readers
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()

    def release_exclusive(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class Registry:
    """Model entries by id; every method is safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelEntry] = {}
        self._loading: list[Loading] = []

    @contextmanager
    def loading(self, name: str, source: Path | bytes) -> Iterator[Loading]:
        """A load in progress, listed by :meth:`loading_infos` until the block ends."""
        entry = Loading(name, str(source) if isinstance(source, Path) else None)
        with self._lock:
            self._loading.append(entry)
        try:
            yield entry
        finally:
            with self._lock:
                self._loading.remove(entry)

    def loading_infos(self) -> list[dict[str, Any]]:
        with self._lock:
            return [entry.info() for entry in self._loading]

    def get(self, model_id: str) -> ModelEntry | None:
        with self._lock:
            return self._models.get(model_id)

    def all(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._models.values())

    def add(self, entry: ModelEntry) -> None:
        with self._lock:
            self._models[entry.id] = entry

    def remove(self, model_id: str) -> ModelEntry | None:
        with self._lock:
            return self._models.pop(model_id, None)

    def take_ref(self, entry: ModelEntry, client: bytes, keep_alive: float | None) -> None:
        with self._lock:
            entry.refs[client] += 1
            if keep_alive is not None:
                entry.keep_alive = keep_alive
            entry.last_used = time.monotonic()

    def drop_ref(self, entry: ModelEntry, client: bytes) -> bool:
        """Drop one reference of ``client``; False when it held none."""
        with self._lock:
            if entry.refs[client] <= 0:
                return False
            entry.refs[client] -= 1
            if entry.refs[client] == 0:
                del entry.refs[client]
            entry.last_used = time.monotonic()
            return True

    def drop_client(self, client: bytes) -> list[ModelEntry]:
        """Drop every reference of a client that left; the entries it held."""
        with self._lock:
            held = [e for e in self._models.values() if client in e.refs]
            for entry in held:
                del entry.refs[client]
                entry.last_used = time.monotonic()
            return held

    def current(self, entry: ModelEntry, client: bytes) -> bool:
        """True when ``entry`` is still the loaded model of its id and ``client`` holds it. Two
        reads, each atomic, without the lock: a change racing with them is one that the same
        check under the lock could have seen either before or after."""
        return self._models.get(entry.id) is entry and entry.refs.get(client, 0) > 0

    def holds(self, entry: ModelEntry, client: bytes) -> bool:
        with self._lock:
            return entry.refs.get(client, 0) > 0

    def unreferenced(self) -> list[ModelEntry]:
        with self._lock:
            return [e for e in self._models.values() if not e.refs]
