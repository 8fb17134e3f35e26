"""Writing values known at load time into an output (``shaders/fill.comp``).

Shape, Size, Constant and ConstantOfShape are normally folded by the loader; when such a value
must still be produced on the device (say, it is a chunk output), these dispatches write it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from vkpool.kernels.base import Dispatch, DeviceCaps, Ptr, U32, UnsupportedOp, groups_1d

PATTERN_BYTES = 104  # what is left of the 128-byte push-constant block
#: a value longer than one pattern takes one dispatch per 104 bytes: keep that bounded
MAX_VALUE_BYTES = 64 * PATTERN_BYTES


def _dispatch(dst: Any, offset: int, pattern: bytes, nbytes: int, caps: DeviceCaps) -> Dispatch:
    words = np.zeros(PATTERN_BYTES // 4, dtype=np.uint32)
    words.view(np.uint8)[: len(pattern)] = np.frombuffer(pattern, dtype=np.uint8)
    args: list[Any] = [Ptr(dst, offset), U32(nbytes), U32(len(pattern))] + [U32(int(w)) for w in words]
    return Dispatch("fill", args, groups_1d(nbytes, 256, caps))


def fill_value(dst: Any, value: np.ndarray, caps: DeviceCaps) -> list[Dispatch]:
    """Dispatches writing ``value``'s bytes (C order) into ``dst``."""
    data = np.ascontiguousarray(value).tobytes()
    if len(data) > MAX_VALUE_BYTES:
        raise UnsupportedOp(
            f"a constant of {len(data)} bytes written by dispatches (at most {MAX_VALUE_BYTES})"
        )
    return [_dispatch(dst, off, data[off:off + PATTERN_BYTES], len(data[off:off + PATTERN_BYTES]), caps)
            for off in range(0, len(data), PATTERN_BYTES)]


def fill_repeated(dst: Any, element: np.ndarray, count: int, caps: DeviceCaps) -> list[Dispatch]:
    """Dispatches writing ``count`` copies of the one-element ``element``."""
    pattern = np.ascontiguousarray(element).reshape(-1)[:1].tobytes()
    if count == 0:
        return []
    return [_dispatch(dst, 0, pattern, len(pattern) * count, caps)]
