"""Exceptions the client raises from error replies: one class per protocol error type.

A mistake that the in-process API reports with its own exception is reported through the daemon
with a class derived from that one too (:data:`IN_PROCESS`), so ``except vkpool.InvalidInput``
catches a wrong input either way."""
from __future__ import annotations

from typing import Any, Mapping

from vkpool.daemon.protocol import ERROR_TYPES
from vkpool.errors import InvalidInput
from vkpool.kernels.base import UnsupportedOp
from vkpool.model import ModelError


class DaemonError(Exception):
    """An error reply from the daemon. ``type`` is the protocol error type, ``details`` a map."""

    type = "DaemonError"

    def __init__(self, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)  # one argument, also for the OSError bases: str() is the message
        self.message = message
        self.details = dict(details or {})


class DaemonUnavailable(ConnectionError):
    """No daemon answers at the endpoint."""


#: error type -> the exceptions the in-process API raises for the same mistake
IN_PROCESS: dict[str, tuple[type[BaseException], ...]] = {
    "InvalidTensor": (InvalidInput,),
    "InvalidRequest": (ValueError,),
    "ModelError": (ModelError,),
    "UnsupportedOp": (UnsupportedOp,),
    "InsufficientMemory": (MemoryError,),  # DeviceOutOfMemory is one; PartitionUnfeasible is sent as this too
    "UnknownMember": (LookupError,),  # DevicePool.member raises KeyError
    "FileNotFound": (ModelError, FileNotFoundError),  # a Session reading a missing file raises ModelError
    "Timeout": (TimeoutError,),
}


def _make(name: str, doc: str) -> type[DaemonError]:
    bases = (DaemonError, *IN_PROCESS.get(name, ()))
    return type(name, bases, {"type": name, "__doc__": doc[0].upper() + doc[1:] + "."})


ERRORS: dict[str, type[DaemonError]] = {name: _make(name, doc) for name, doc in ERROR_TYPES.items()}
globals().update(ERRORS)


#: the type of the error reply a client makes itself for the requests it still waits on when its
#: connection to the daemon drops (not a type the daemon sends): raised as DaemonUnavailable
CONNECTION_LOST = "DaemonUnavailable"


def from_reply(content: Mapping[str, Any]) -> DaemonError | DaemonUnavailable:
    """The exception for an error reply's content (unknown types map to DaemonError)."""
    if content.get("type") == CONNECTION_LOST:
        return DaemonUnavailable(str(content.get("message", "")))
    cls = ERRORS.get(str(content.get("type")), DaemonError)
    details = content.get("details")
    return cls(str(content.get("message", "")), details if isinstance(details, dict) else None)


__all__ = ["DaemonError", "DaemonUnavailable", "ERRORS", "from_reply", *ERRORS]
