"""Element types of the elementwise and data-movement shaders.

Every shader of those families is specialised with three defines per tensor (prefix ``X``,
``Y`` ...): ``{p}T`` the storage type, ``{p}BUF`` the buffer-reference type and ``{p}CT`` the
type arithmetic happens in. Types narrower than 32 bits are computed in 32 bits (only their
storage is 8/16-bit), so no shader needs ``shaderInt8``/``shaderInt16``/``shaderFloat16``.
"""
from __future__ import annotations

import numpy as np

from vkpool.kernels.base import UnsupportedOp

#: numpy dtype -> (storage type, buffer type, compute type, kind); kind is 0 float, 1 signed,
#: 2 unsigned, 3 bool (the ``{p}KIND`` define)
ELEMENT_TYPES: dict[np.dtype, tuple[str, str, str, int]] = {
    np.dtype(np.float32): ("float", "F32Buf", "float", 0),
    np.dtype(np.float16): ("float16_t", "F16Buf", "float", 0),
    np.dtype(np.int64): ("int64_t", "I64Buf", "int64_t", 1),
    np.dtype(np.int32): ("int", "I32Buf", "int", 1),
    np.dtype(np.int16): ("int16_t", "I16Buf", "int", 1),
    np.dtype(np.int8): ("int8_t", "I8Buf", "int", 1),
    np.dtype(np.uint64): ("uint64_t", "U64Buf", "uint64_t", 2),
    np.dtype(np.uint32): ("uint", "U32Buf", "uint", 2),
    np.dtype(np.uint16): ("uint16_t", "U16Buf", "uint", 2),
    np.dtype(np.uint8): ("uint8_t", "U8Buf", "uint", 2),
    np.dtype(np.bool_): ("uint8_t", "U8Buf", "uint", 3),
}

FLOAT_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float16)})
INT_TYPES = frozenset(d for d, v in ELEMENT_TYPES.items() if v[3] in (1, 2))
NUMERIC_TYPES = FLOAT_TYPES | INT_TYPES
BOOL = np.dtype(np.bool_)

#: element size in bytes -> (storage type, buffer type) of the word a data-movement shader copies
WORD_TYPES: dict[int, tuple[str, str]] = {
    1: ("uint8_t", "U8Buf"),
    2: ("uint16_t", "U16Buf"),
    4: ("uint", "U32Buf"),
    8: ("uint64_t", "U64Buf"),
}


def element_defines(dtype: np.dtype, prefix: str) -> dict[str, str | int]:
    """``{prefix}T``, ``{prefix}BUF``, ``{prefix}CT`` and ``{prefix}KIND`` for ``dtype``."""
    try:
        storage, buf, compute, kind = ELEMENT_TYPES[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedOp(f"element type {np.dtype(dtype)} has no kernel") from None
    return {f"{prefix}T": storage, f"{prefix}BUF": buf, f"{prefix}CT": compute, f"{prefix}KIND": kind}


def word_defines(dtype: np.dtype) -> dict[str, str]:
    """``WT``/``WBUF``: the word type moving one element of ``dtype`` unchanged."""
    size = np.dtype(dtype).itemsize
    kind = np.dtype(dtype).kind
    # ml_dtypes' types (bfloat16, float8, int4 one per byte) are kind "V" to numpy: bytes to move
    narrow = kind == "V" and np.dtype(dtype).type.__module__.startswith("ml_dtypes")
    if kind in "OUS" or (kind == "V" and not narrow) or size not in WORD_TYPES:
        raise UnsupportedOp(f"element type {np.dtype(dtype)} cannot be stored on a device")
    storage, buf = WORD_TYPES[size]
    return {"WT": storage, "WBUF": buf}


def require(op_type: str, dtype: np.dtype, allowed: frozenset[np.dtype], what: str = "input") -> None:
    """Raises UnsupportedOp unless ``dtype`` is one of ``allowed``."""
    if np.dtype(dtype) not in allowed:
        names = ", ".join(sorted(str(d) for d in allowed))
        raise UnsupportedOp(f"{op_type}: {what} type {np.dtype(dtype)} has no kernel (supported: {names})")
