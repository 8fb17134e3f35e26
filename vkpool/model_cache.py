"""The loaded-model cache: a model file loaded once loads again without ``onnx``.

:func:`vkpool.model.load_model` parses a model with protobuf, runs onnx's checker and shape
inference and folds constants, and importing ``onnx`` for that is the largest single cost of a
process's start. What it produces, a :class:`~vkpool.model.LoadedModel`, is plain data: nodes
whose attributes are numbers, strings and numpy arrays, numpy constants, shapes and dtypes. A
load from a file writes that to ``$VKPOOL_CACHE_DIR/models/<hash>.vkm``, and the next load of
the same file with the same arguments reads it back instead; neither ``onnx`` nor protobuf is
imported then.

An entry is msgpack, never pickle: reading one builds lists, strings, numbers and numpy arrays
of plain dtypes, so a file planted in the cache folder cannot run code. Layout: 8 bytes of magic,
the header's length (8 bytes, little-endian), the msgpack header, then a data section aligned to
64 bytes. Constants go where they are cheapest to have again:

- a weight the loader reads in place, a view of the memory-mapped model file
  (:mod:`vkpool.inline_weights`) or of an external data file, is stored as (file, byte offset,
  dtype, shape) and mapped again on a hit, so a 1 GiB model costs the entry a few bytes and a
  hit no more host memory than a load;
- a constant computed at load (folding, fusion) of 64 KiB or more is written to the data
  section and mapped from the entry on a hit;
- smaller ones are stored in the header.

An entry is used only when everything it was made from is unchanged: the model file (resolved
path, size, mtime in ns, inode), each external data file the load read (same, and the loader's
checks again: resolved inside the model's folder, a regular file with one hard link), the load
arguments (batch, dims, fuse, partial), vkpool's version, this format's version, and the size
and mtime of the loader's sources and of onnx's ``__init__.py`` (another onnx may check, infer or
fold differently). A file modified less than :data:`SETTLE_NS` before the load is not cached: file
times advance in coarse steps (a few ms on ext4, 2 s on FAT), so a rewrite of the same size in
the same step would keep size and mtime; once that much time has passed, any later change shows.

An entry that cannot be read (truncated, garbage, another format, a file it refers to changed)
is a miss: the model is loaded from the file and the entry written again. A model whose
attributes hold what msgpack cannot carry (the subgraphs of If and Loop, object dtypes, ...) is
not cached. ``VKPOOL_NO_MODEL_CACHE=1`` or ``load_model(..., cache=False)`` skip the cache;
deleting ``$VKPOOL_CACHE_DIR/models`` is always safe.
"""
from __future__ import annotations

import hashlib
import importlib.util
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from vkpool import __version__, inline_weights
from vkpool.cache import cache_dir, write_atomic
from vkpool.kernels.base import TensorInfo

if TYPE_CHECKING:
    from vkpool.model import LoadedModel, LoadTrace

#: the entry layout's version; entries of another are misses, and get rewritten
FORMAT = 1
#: set to anything but "" or "0" to load every model from its file
DISABLE_ENV = "VKPOOL_NO_MODEL_CACHE"
#: files modified less than this before the load are not cached (see the module docstring)
SETTLE_NS = 2_000_000_000
#: constants from this size on are referred to or put in the data section, not in the header
INLINE_MAX_BYTES = inline_weights.MIN_IN_PLACE_BYTES
_MAGIC = b"VKPMODEL"
_ALIGN = 64
_ARRAY_EXT = 1
_LOADER_SOURCES = ("model.py", "model_cache.py", "fusion.py", "inline_weights.py", "subgraph.py")


class Unrepresentable(ValueError):
    """The model holds a value an entry cannot carry; it is not cached."""


class BadEntry(ValueError):
    """The entry is not one this version wrote for this file and these arguments."""


@dataclass(frozen=True)
class LoadArgs:
    """The arguments of ``load_model`` that change what it returns."""

    batch: int
    dims: tuple[tuple[str, int], ...]
    fuse: bool
    partial: bool


@dataclass(frozen=True)
class Snapshot:
    """A model file's (size, mtime_ns, inode) and the time it was taken, before a load."""

    stat: tuple[int, int, int]
    taken_ns: int


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _resolved(src: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(src)).resolve()


def file_stat(src: str | os.PathLike[str]) -> Snapshot | None:
    """The model file's snapshot, taken before a load from it; None when it cannot be read
    (the load says why)."""
    taken = time.time_ns()
    try:
        return Snapshot(_stat_key(os.stat(_resolved(src))), taken)
    except (OSError, RuntimeError):
        return None


def _code_stamp() -> list[Any]:
    """Size and mtime of the loader's sources and of onnx's ``__init__.py``: an edited loader
    or another onnx makes every entry a miss."""
    here = Path(__file__).parent
    stamp: list[Any] = []
    paths = [here / name for name in _LOADER_SOURCES]
    spec = importlib.util.find_spec("onnx")
    if spec is not None and spec.origin:
        paths.append(Path(spec.origin))
    for path in paths:
        try:
            st = os.stat(path)
            stamp += [st.st_size, st.st_mtime_ns]
        except OSError:
            stamp += [-1, -1]
    return stamp


def _entry(path: Path, args: LoadArgs) -> Path:
    """One entry per (file, arguments): a changed file rewrites its entry, not a new one."""
    name = msgpack.packb([str(path), args.batch, [list(d) for d in args.dims], args.fuse, args.partial])
    return cache_dir("models") / (hashlib.sha256(name).hexdigest()[:32] + ".vkm")


def _key(path: Path, stat: tuple[int, int, int], args: LoadArgs) -> list[Any]:
    return [FORMAT, __version__, _code_stamp(), str(path), *stat, args.batch,
            [[str(k), int(v)] for k, v in args.dims], bool(args.fuse), bool(args.partial)]


# -- dtypes and arrays ---------------------------------------------------------------------------


def _dtype_code(dtype: np.dtype) -> str:
    """A name :func:`_dtype` turns back into ``dtype``: numpy's own (``'<f4'``) for plain numbers,
    ``'ml_dtypes:bfloat16'`` for ml_dtypes' narrow types."""
    if dtype.kind in "biufc":
        code = dtype.str
    elif dtype.kind == "V" and dtype.type.__module__ == "ml_dtypes":
        code = f"ml_dtypes:{dtype.name}"
    else:
        raise Unrepresentable(f"dtype {dtype}")
    if _dtype(code) != dtype:
        raise Unrepresentable(f"dtype {dtype}")
    return code


def _dtype(code: Any) -> np.dtype:
    if not isinstance(code, str):
        raise BadEntry(f"dtype {code!r}")
    prefix, _, name = code.partition(":")
    if prefix == "ml_dtypes" and name.isidentifier():
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, name))
        if dtype.kind != "V" or dtype.name != name:
            raise BadEntry(f"dtype {code!r}")
        return dtype
    dtype = np.dtype(code)
    if dtype.kind not in "biufc" or dtype.str != code:
        raise BadEntry(f"dtype {code!r}")
    return dtype


def _shape(value: Any, *, unknown_ok: bool = False) -> tuple[int, ...]:
    lowest = -1 if unknown_ok else 0
    if not isinstance(value, list) or not all(type(d) is int and d >= lowest for d in value):
        raise BadEntry(f"shape {value!r}")
    return tuple(value)


def _info(value: Any, *, unknown_ok: bool = False) -> TensorInfo:
    code, shape = value
    return TensorInfo(_shape(shape, unknown_ok=unknown_ok), _dtype(code))


def _array_bytes(array: np.ndarray) -> list[Any]:
    return [_dtype_code(array.dtype), list(array.shape), np.ascontiguousarray(array).tobytes()]


def _array_from_bytes(value: Any) -> np.ndarray:
    code, shape, raw = value
    if not isinstance(raw, bytes):
        raise BadEntry("array data is not bytes")
    # a copy: writable like the arrays a load from the file gives
    return np.frombuffer(raw, _dtype(code)).reshape(_shape(shape)).copy()


def _pack_default(obj: Any) -> Any:
    if type(obj) is np.ndarray:
        return msgpack.ExtType(_ARRAY_EXT, msgpack.packb(_array_bytes(obj), use_bin_type=True))
    raise Unrepresentable(f"an attribute value of type {type(obj).__name__}")


def _unpack_ext(code: int, data: bytes) -> np.ndarray:
    if code != _ARRAY_EXT:
        raise BadEntry(f"msgpack extension type {code}")
    return _array_from_bytes(msgpack.unpackb(data, raw=False))


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# -- writing -------------------------------------------------------------------------------------


def store(src: str | os.PathLike[str], args: LoadArgs, model: LoadedModel, trace: LoadTrace,
          before: Snapshot) -> bool:
    """Writes the entry of ``model``, just loaded from ``src`` with ``args``; ``trace`` holds the
    files the load read, ``before`` the model file's snapshot taken before the load. Returns
    whether an entry was written; a model that cannot be cached, a file changed too recently or
    a cache folder that cannot be written leave none."""
    settled = before.taken_ns - SETTLE_NS
    if before.stat[1] > settled:
        return False
    files: list[list[Any]] = []  # external data files: [location, size, mtime_ns, inode]
    file_index: dict[str, int] = {}
    for location, stat in trace.external.items():
        if stat is None or stat[1] > settled:
            return False
        file_index[location] = len(files)
        files.append([location, *stat])
    try:
        path = _resolved(src)
        blobs: list[tuple[int, np.ndarray]] = []
        data_end = 0
        constants = []
        for name, value in model.constants.items():
            if type(value) is not np.ndarray:
                raise Unrepresentable(f"constant {name!r} of type {type(value).__name__}")
            code = _dtype_code(value.dtype)
            shape = list(value.shape)
            found = inline_weights.mapped(value) if value.nbytes and value.flags.c_contiguous else None
            source = trace.maps.get(id(found[0])) if found is not None else None
            if found is not None and source is not None and source[0] is found[0]:
                if source[1] is None:
                    where: list[Any] = ["model", found[1]]
                else:
                    where = ["file", file_index[source[1]], found[1]]
            elif value.nbytes < INLINE_MAX_BYTES:
                where = ["inline", np.ascontiguousarray(value).tobytes()]
            else:
                data_end = _align(data_end)
                blobs.append((data_end, np.ascontiguousarray(value)))
                where = ["data", data_end]
                data_end += value.nbytes
            constants.append([name, code, shape, where])
        header = {
            "key": _key(path, before.stat, args),
            "files": files,
            "opset": int(model.opset),
            "inputs": [[n, _dtype_code(i.dtype), list(i.shape)] for n, i in model.inputs],
            "outputs": [[n, _dtype_code(i.dtype), list(i.shape)] for n, i in model.outputs],
            "tensors": [[n, _dtype_code(i.dtype), list(i.shape)] for n, i in model.tensors.items()],
            "unresolved": list(model.unresolved),
            "symbolic": {n: list(axes) for n, axes in model.symbolic.items()},
            "nodes": [[n.name, n.op_type, n.domain, list(n.inputs), list(n.outputs), dict(n.attrs)]
                      for n in model.nodes],
            "constants": constants,
        }
        head = msgpack.packb(header, use_bin_type=True, strict_types=True, default=_pack_default)
        start = _align(16 + len(head))
        chunks: list[Any] = [_MAGIC, len(head).to_bytes(8, "little"), head, bytes(start - 16 - len(head))]
        at = 0
        for offset, array in blobs:
            chunks += [bytes(offset - at), array.reshape(-1).view(np.uint8)]
            at = offset + array.nbytes
        write_atomic(_entry(path, args), chunks)
        return True
    except (Unrepresentable, OSError, RuntimeError, ValueError, TypeError, OverflowError):
        return False


# -- reading -------------------------------------------------------------------------------------


def load(src: str | os.PathLike[str], args: LoadArgs) -> LoadedModel | None:
    """The model of the entry for ``src`` and ``args``, or None on a miss (no entry, or one that
    does not hold for the file as it is now)."""
    try:
        path = _resolved(src)
        fd = os.open(path, os.O_RDONLY)
    except (OSError, RuntimeError):
        return None  # the load from the file says what is wrong
    try:
        entry = _entry(path, args)
        with open(entry, "rb") as f:
            return _read(f, path, fd, args)
    except Exception:  # any fault in an entry makes it a miss: the load rewrites it
        return None
    finally:
        os.close(fd)


def _read(f: Any, path: Path, fd: int, args: LoadArgs) -> LoadedModel:
    from vkpool.model import LoadedModel, Node

    lead = f.read(16)
    if len(lead) != 16 or lead[:8] != _MAGIC:
        raise BadEntry("not an entry")
    size = int.from_bytes(lead[8:], "little")
    if 16 + size > os.fstat(f.fileno()).st_size:
        raise BadEntry("truncated header")
    head = f.read(size)
    if len(head) != size:
        raise BadEntry("truncated header")
    header = msgpack.unpackb(head, raw=False, ext_hook=_unpack_ext, strict_map_key=True)
    if header["key"] != _key(path, _stat_key(os.fstat(fd)), args):
        raise BadEntry("made from another file, or other arguments or code")
    with _Files(path.parent, header["files"], fd, f.fileno(), _align(16 + size)) as files:
        constants = {name: files.array(name, code, shape, where)
                     for name, code, shape, where in header["constants"]}
    nodes = []
    for name, op_type, domain, inputs, outputs, attrs in header["nodes"]:
        if not all(isinstance(v, str) for v in (name, op_type, domain, *inputs, *outputs)):
            raise BadEntry("a node's names are not strings")
        if not isinstance(attrs, dict):
            raise BadEntry("a node's attributes are not a mapping")
        nodes.append(Node(name, op_type, domain, list(inputs), list(outputs), attrs))
    opset = header["opset"]
    if type(opset) is not int:
        raise BadEntry("opset")
    return LoadedModel(
        inputs=[(n, _info([c, s])) for n, c, s in header["inputs"]],
        outputs=[(n, _info([c, s], unknown_ok=True)) for n, c, s in header["outputs"]],
        nodes=nodes,
        constants=constants,
        tensors={n: _info([c, s]) for n, c, s in header["tensors"]},
        opset=opset,
        unresolved=[str(n) for n in header["unresolved"]],
        symbolic={str(n): tuple(int(a) for a in axes) for n, axes in header["symbolic"].items()},
    )


class _Files:
    """The files an entry's constants lie in, mapped on first use: the model file, the entry's
    data section and the external data files, each of which is checked on entering as the
    loader checks it and must have the size, mtime and inode it had when the entry was made."""

    def __init__(self, base_dir: Path, external: list[Any], model_fd: int, entry_fd: int, data_start: int) -> None:
        self.base_dir = base_dir
        self.external = external
        self.fds: dict[Any, int] = {"model": model_fd, "data": entry_fd}
        self.data_start = data_start
        self.maps: dict[Any, mmap.mmap] = {}
        self.opened: list[int] = []

    def __enter__(self) -> _Files:
        from vkpool.model import open_external

        try:
            for index, (location, *stat) in enumerate(self.external):
                fd, st, _ = open_external(self.base_dir, location, location)
                self.opened.append(fd)
                if list(_stat_key(st)) != stat:
                    raise BadEntry(f"external data {location!r} changed")
                self.fds[index] = fd
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for fd in self.opened:
            os.close(fd)
        self.opened.clear()

    def _map(self, key: Any) -> mmap.mmap:
        if key not in self.maps:
            self.maps[key] = mmap.mmap(self.fds[key], 0, access=mmap.ACCESS_READ)
        return self.maps[key]

    def array(self, name: str, code: Any, shape: Any, where: Any) -> np.ndarray:
        kind = where[0]
        if kind == "inline":
            return _array_from_bytes([code, shape, where[1]])
        if kind == "model":
            buf, offset = self._map("model"), where[1]
        elif kind == "data":
            buf, offset = self._map("data"), self.data_start + where[1]
        elif kind == "file" and type(where[1]) is int and 0 <= where[1] < len(self.external):
            buf, offset = self._map(where[1]), where[2]
        else:
            raise BadEntry(f"constant {name!r} stored as {where!r}")
        dtype, dims = _dtype(code), _shape(shape)
        count = int(np.prod(dims, dtype=np.int64))
        if type(offset) is not int or offset < 0 or offset + count * dtype.itemsize > len(buf):
            raise BadEntry(f"constant {name!r} lies outside its file")
        return np.frombuffer(buf, dtype, count, offset).reshape(dims)
