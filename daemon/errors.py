"""Exceptions the client raises from error replies: one class per protocol error type."""
from __future__ import annotations

from typing import Any, Mapping

from vkpool.daemon.protocol import ERROR_TYPES


class DaemonError(Exception):
    """An error reply from the daemon. ``type`` is the protocol error type, ``details`` a map."""

    type = "DaemonError"

    def __init__(self, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})


class DaemonUnavailable(ConnectionError):
    """No daemon answers at the endpoint."""


def _make(name: str, doc: str) -> type[DaemonError]:
    return type(name, (DaemonError,), {"type": name, "__doc__": doc[0].upper() + doc[1:] + "."})


ERRORS: dict[str, type[DaemonError]] = {name: _make(name, doc) for name, doc in ERROR_TYPES.items()}
globals().update(ERRORS)


def from_reply(content: Mapping[str, Any]) -> DaemonError:
    """The exception for an error reply's content (unknown types map to DaemonError)."""
    cls = ERRORS.get(str(content.get("type")), DaemonError)
    details = content.get("details")
    return cls(str(content.get("message", "")), details if isinstance(details, dict) else None)


__all__ = ["DaemonError", "DaemonUnavailable", "ERRORS", "from_reply", *ERRORS]
