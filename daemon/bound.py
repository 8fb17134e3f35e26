"""Bound infers: an infer of fixed input shapes laid out once in a lane's ring.

A framed infer costs the daemon's lane thread its decoding, its checks and the packing of its
reply, every time. A client whose lane has a ring (:class:`vkpool.daemon.lane.Ring`) binds an
infer instead, once per model, output names, options and input names, dtypes and shapes:
``bind_infer`` carries exactly what an ``infer`` carries and is checked as one; its reply gives
the binding a number and each input a place (a byte offset) in the ring's request half. From then
on the client writes the inputs' bytes at their places, the binding's number + 1 in the
request-kind word and the next request sequence number, nothing else. The daemon reads one word to
know the request, checks nothing more (the shapes were checked at binding; the bytes are the
client's own business), and answers with a *record* in the reply half (reply-kind word 1):

    u32 n | n × (u8 dtype index in DTYPES, u8 ndim, ndim × u64 dim) | each output's bytes, C order,
    at the next multiple of 64 from the half's start                                 (little-endian)

An error, or outputs that do not fit the half, is answered as a framed ``infer_reply`` instead
(reply-kind word 0).

The lane thread takes every bound infer it finds in one pass over the lanes and runs them by
model: a batching model's as batches of their rows, any other back to back on the thread itself
(see :meth:`vkpool.daemon.service.Service.run_bound`).

Over ZeroMQ a binding works the same way, with a frame in place of the ring's halves
(:class:`FrameBinding`): a bound infer is one frame, ``FRAME_HEAD`` (``b"vkB1"``, the binding's
number, a request sequence number) then the inputs' bytes at the places the binding gave; its
reply is one frame, ``FRAME_HEAD`` (``b"vkR1"``, 0, the same sequence number) then, from byte 64
(``RECORD_AT``), a record as above, its offsets counted from there. An error is a framed
``infer_reply`` whose id is ``frame-`` and the sequence number. These frames save the request's
header, its content and a frame per tensor, each way.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from vkpool.daemon import protocol as P

#: bound infers one lane (or one ZeroMQ client) keeps; a bind past it is answered ``binding:
#: null`` (infer as usual)
BINDINGS_MAX = 64
#: a bound infer's frame over ZeroMQ, and its reply's: magic, binding number (0 in a reply),
#: request sequence number; what follows starts at the next multiple of 64
FRAME_HEAD = struct.Struct("<4sIQ")
REQUEST_MAGIC = b"vkB1"
REPLY_MAGIC = b"vkR1"
RECORD_AT = 64
_ALIGN = 64
_COUNT = struct.Struct("<I")
_DESC = struct.Struct("<BB")
_CODE_OF = {P._DTYPE_OF[name]: code for code, name in enumerate(P.DTYPES)}
_DTYPE_AT = [P._DTYPE_OF[name] for name in P.DTYPES]


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def places(sizes: Sequence[int], start: int = 0) -> tuple[list[int], int]:
    """Where blocks of ``sizes`` bytes go, in order, each at a multiple of 64 from ``start`` on
    (a request half's inputs, a record's outputs), and the end of the last."""
    at, out = _up(start), []
    for size in sizes:
        out.append(at)
        at = _up(at + size)
    return out, at


def frame_places(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where the inputs of a bound infer's frame over ZeroMQ go (after ``FRAME_HEAD``, each at a
    multiple of 64), and the frame's length: the end of the last."""
    offsets, _ = places(sizes, FRAME_HEAD.size)
    return offsets, (offsets[-1] + sizes[-1]) if sizes else FRAME_HEAD.size


def views(half: Any, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], offsets: Sequence[int]) -> list[np.ndarray]:
    """Arrays over ``half`` at ``offsets``, of the given dtypes and shapes."""
    return [np.frombuffer(half, dtype, math.prod(shape), at).reshape(shape)
            for (dtype, shape), at in zip(specs, offsets)]


def record_layout(arrays: Sequence[np.ndarray]) -> tuple[bytes, list[int], int]:
    """A record's head, where each output's bytes go, and the bytes it takes. ``KeyError`` for a
    dtype the protocol has no name for."""
    head = [_COUNT.pack(len(arrays))]
    for a in arrays:
        head.append(_DESC.pack(_CODE_OF[a.dtype], a.ndim) + struct.pack(f"<{a.ndim}Q", *a.shape))
    packed = b"".join(head)
    return (packed, *places([a.nbytes for a in arrays], len(packed)))


class Binding:
    """The daemon's side of a bound infer: the checked plan (:class:`vkpool.daemon.service.InferPlan`),
    the feeds (arrays over the ring's request half), their rows for a batching model, and the
    layout of the last outputs written (outputs of the same shapes reuse it)."""

    __slots__ = ("_head", "_out", "feeds", "plan", "rows")

    def __init__(self, plan: Any, feeds: dict[str, np.ndarray], rows: int) -> None:
        self.plan, self.feeds, self.rows = plan, feeds, rows
        self._head = b""
        self._out: list[np.ndarray] = []

    def fill(self, half: Any, arrays: Sequence[np.ndarray]) -> bool:
        """Write ``arrays`` as a record into ``half``; False (nothing written) when they do not fit
        or have a dtype the protocol cannot name."""
        out = self._out
        fresh = not self._head or len(out) != len(arrays)
        if not fresh:
            for o, a in zip(out, arrays):
                if o.shape != a.shape or o.dtype != a.dtype:
                    fresh = True
                    break
        if fresh:  # outputs of other shapes than the last: laid out again
            try:
                head, offsets, end = record_layout(arrays)
            except KeyError:
                return False
            if end > len(half):
                return False
            self._head = head
            self._out = out = views(half, [(a.dtype, a.shape) for a in arrays], offsets)
        half[:len(self._head)] = self._head
        for o, a in zip(out, arrays):
            o[...] = a  # the same dtype and shape: a plain copy
        return True


class FrameBinding:
    """The daemon's side of a bound infer over ZeroMQ: the checked plan
    (:class:`vkpool.daemon.service.InferPlan`), and the inputs' names, dtypes, shapes and places
    in a request's frame, and that frame's size."""

    __slots__ = ("names", "offsets", "plan", "size", "specs")

    def __init__(self, plan: Any, names: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        self.plan = plan
        self.names = list(names)
        self.specs = [(a.dtype, a.shape) for a in arrays]
        self.offsets, self.size = frame_places([a.nbytes for a in arrays])

    def feeds(self, frame: Any) -> dict[str, np.ndarray]:
        """The inputs over a request's frame (read-only arrays; the frame is checked to be
        ``size`` bytes by the caller)."""
        return dict(zip(self.names, views(frame, self.specs, self.offsets)))


def record_frame(seq: int, arrays: Sequence[np.ndarray]) -> bytearray | None:
    """The reply frame of bound infer ``seq`` over ZeroMQ carrying ``arrays``: the head, then from
    ``RECORD_AT`` their record; None for a dtype the protocol cannot name. A new buffer each time
    (a reply may wait to be sent while the next is made)."""
    try:
        head, offsets, end = record_layout(arrays)
    except KeyError:
        return None
    frame = bytearray(RECORD_AT + end)
    FRAME_HEAD.pack_into(frame, 0, REPLY_MAGIC, 0, seq)
    frame[RECORD_AT:RECORD_AT + len(head)] = head
    at = [RECORD_AT + o for o in offsets]
    for place, a in zip(views(frame, [(a.dtype, a.shape) for a in arrays], at), arrays):
        place[...] = a
    return frame


class ClientFrameBinding:
    """The client's side of a bound infer over ZeroMQ: the binding's number, its inputs' places and
    the frame's size, and the last record layout read (a :class:`ClientBinding`)."""

    __slots__ = ("index", "offsets", "reader", "size")

    def __init__(self, index: int, arrays: Sequence[np.ndarray]) -> None:
        self.index = index
        self.offsets, self.size = frame_places([a.nbytes for a in arrays])
        self.reader = ClientBinding(index, [])

    def frame(self, seq: int, arrays: Sequence[np.ndarray]) -> bytearray:
        """Request ``seq``'s frame: the head, then each array's bytes (C order) at its place."""
        buf = bytearray(self.size)
        FRAME_HEAD.pack_into(buf, 0, REQUEST_MAGIC, self.index, seq)
        for place, a in zip(views(buf, [(a.dtype, a.shape) for a in arrays], self.offsets), arrays):
            place[...] = a
        return buf

    def read(self, frame: Any) -> list[np.ndarray]:
        """The outputs of a reply frame's record, copied out; ``ConnectionResetError`` for a
        record that does not parse."""
        return self.reader.read(memoryview(frame)[RECORD_AT:])


class ClientBinding:
    """The client's side: the binding's number, the inputs' arrays over the request half (in the
    order of the feeds it was made from), and the last record layout read: its head's bytes and
    where each output lies, kept as one tuple, so that threads reading records of one binding
    together (over ZeroMQ) never see one layout's head with another's places."""

    __slots__ = ("_layout", "index", "inputs")

    def __init__(self, index: int, inputs: list[np.ndarray]) -> None:
        self.index, self.inputs = index, inputs
        self._layout: tuple[bytes, list[tuple[np.dtype, int, int, tuple[int, ...]]]] = (b"", [])

    def write(self, values: Sequence[np.ndarray]) -> None:
        for place, value in zip(self.inputs, values):
            np.copyto(place, value, casting="no")

    def read(self, half: memoryview) -> list[np.ndarray]:
        """The outputs of the record in ``half``, copied out (writable, the caller's own)."""
        head, outs = self._layout
        if not head or half[:len(head)] != head:
            head, outs = self._layout = _parse_record(half)
        return [np.frombuffer(half, dtype, count, at).reshape(shape).copy()
                for dtype, count, at, shape in outs]


def _parse_record(half: memoryview) -> tuple[bytes, list[tuple[np.dtype, int, int, tuple[int, ...]]]]:
    """A record's head (its bytes) and each output's dtype, element count, offset and shape;
    ``ConnectionResetError`` for a record that does not parse or runs past ``half``."""
    (n,) = _COUNT.unpack_from(half)
    if n > 4096:
        raise ConnectionResetError(f"the daemon's reply record names {n} outputs")
    pos, descs = _COUNT.size, []
    for _ in range(n):
        code, ndim = _DESC.unpack_from(half, pos)
        shape = struct.unpack_from(f"<{ndim}Q", half, pos + _DESC.size)
        pos += _DESC.size + 8 * ndim
        if code >= len(_DTYPE_AT):
            raise ConnectionResetError(f"the daemon's reply record has dtype index {code}")
        descs.append((_DTYPE_AT[code], shape))
    counts = [math.prod(shape) for _, shape in descs]
    offsets, end = places([c * dtype.itemsize for c, (dtype, _) in zip(counts, descs)], pos)
    if end > len(half):
        raise ConnectionResetError("the daemon's reply record runs past its end")
    return bytes(half[:pos]), [(dtype, c, at, shape) for (dtype, shape), c, at in zip(descs, counts, offsets)]
