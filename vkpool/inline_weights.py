"""An ONNX file's inline weights read in place, from a memory map, instead of through protobuf.

Parsing a model file with protobuf holds the file's bytes and the parsed message at once, and
taking a weight's ``raw_data`` out copies it again: a 1 GiB model costs 2 to 3 GiB of host memory
before anything reaches a device. Here the file is mapped read-only and its protobuf wire format
walked just deep enough (``ModelProto.graph`` → ``GraphProto.initializer`` → ``TensorProto``) to
find each large initializer's ``raw_data``; the message protobuf then parses is the file without
those payloads, and each weight becomes a numpy view of the map. Its pages come in when the
weight is uploaded, and being clean file pages the kernel can drop them again.

Wire format: https://protobuf.dev/programming-guides/encoding/ (tags, varints, length-delimited
fields). Field numbers from onnx.proto: ModelProto.graph = 7, GraphProto.initializer = 5,
TensorProto.dims = 1, data_type = 2, name = 8, raw_data = 9.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_RAW_DATA = 1, 2, 9
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
#: payloads from this size on stay in the file; smaller ones are not worth a view of their own
MIN_IN_PLACE_BYTES = 1 << 16


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message where an ONNX model's should be."""


def _varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf: mmap.mmap | bytes, start: int, end: int):
    """(field number, wire type, tag start, value start, value end) of each field in
    ``buf[start:end]``; for a length-delimited field the value starts after its length."""
    pos = start
    while pos < end:
        tag_start = pos
        tag, pos = _varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, value_end = _varint(buf, pos, end)
        elif wire == _I64:
            value_end = pos + 8
        elif wire == _I32:
            value_end = pos + 4
        elif wire == _LEN:
            length, pos = _varint(buf, pos, end)
            value_end = pos + length
        else:
            raise WireError(f"unsupported wire type {wire} at byte {tag_start}")
        if value_end > end:
            raise WireError(f"field {field} at byte {tag_start} runs past its message")
        yield field, wire, tag_start, pos, value_end
        pos = value_end


def _tag(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def _in_place(buf: mmap.mmap, start: int, end: int) -> tuple[np.ndarray, bytes] | None:
    """A TensorProto's weight as a view of ``buf`` and the tensor re-encoded without it, when
    its raw_data is worth leaving in place."""
    dims: list[int] = []
    data_type = 0
    raw: tuple[int, int, int] | None = None
    for field, wire, tag_start, pos, value_end in _fields(buf, start, end):
        if field == _TENSOR_DIMS and wire == _VARINT:
            dims.append(_varint(buf, pos, value_end)[0])
        elif field == _TENSOR_DIMS and wire == _LEN:  # packed
            p = pos
            while p < value_end:
                d, p = _varint(buf, p, value_end)
                dims.append(d)
        elif field == _TENSOR_DATA_TYPE and wire == _VARINT:
            data_type = _varint(buf, pos, value_end)[0]
        elif field == _TENSOR_RAW_DATA and wire == _LEN:
            raw = (tag_start, pos, value_end)
    if raw is None or raw[2] - raw[1] < MIN_IN_PLACE_BYTES:
        return None
    from onnx import helper  # only a load from the file gets here, and it parses with onnx next

    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, ValueError, TypeError):
        return None
    tag_start, raw_start, raw_end = raw
    if dtype.kind not in "biuf" or int(np.prod(dims, dtype=np.int64)) * dtype.itemsize != raw_end - raw_start:
        return None  # left to protobuf and the loader's own checks
    view = np.frombuffer(buf, dtype=dtype, count=(raw_end - raw_start) // dtype.itemsize, offset=raw_start)
    return view.reshape(tuple(dims)), buf[start:tag_start] + buf[raw_end:end]


def _message(field: int, body: bytes) -> bytes:
    return _tag(field, _LEN) + _encode_varint(len(body)) + body


def read(path: Path) -> tuple[bytes, dict[int, np.ndarray]]:
    """The model's bytes without its large inline weights, and those weights as read-only views
    of the mapped file, by their index among the graph's initializers."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b"", {}
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    weights: dict[int, np.ndarray] = {}
    out: list[bytes] = []
    model_pos = 0
    for field, wire, tag_start, pos, value_end in _fields(mm, 0, size):
        if field != _MODEL_GRAPH or wire != _LEN:
            continue
        graph: list[bytes] = []
        graph_pos, index = pos, 0
        for gfield, gwire, gtag, gpos, gend in _fields(mm, pos, value_end):
            if gfield != _GRAPH_INITIALIZER or gwire != _LEN:
                continue
            found = _in_place(mm, gpos, gend)
            if found is not None:
                weights[index], tensor = found
                graph += [mm[graph_pos:gtag], _message(_GRAPH_INITIALIZER, tensor)]
                graph_pos = gend
            index += 1
        if not weights:
            continue
        graph.append(mm[graph_pos:value_end])
        out += [mm[model_pos:tag_start], _message(_MODEL_GRAPH, b"".join(graph))]
        model_pos = value_end
    out.append(mm[model_pos:size])
    return b"".join(out), weights


def mapped(array: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """The memory map ``array`` is a view of and the byte offset of its first element in it, or
    None for an array that is not a view of a mapped file."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap):
        return None
    start = array.__array_interface__["data"][0] - np.frombuffer(base, np.uint8).__array_interface__["data"][0]
    return base, start


def release(array: np.ndarray) -> None:
    """Drops the resident pages of a weight read in place (after its upload): they are clean
    file pages, read again from the file should the weight be needed once more. Does nothing
    for an array that is not a view of a mapped file."""
    found = mapped(array)
    if found is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base, start = found
    first = start - start % mmap.PAGESIZE
    last = min(len(base), start + array.nbytes)
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)
