"""Attribute helpers shared by op modules."""
from __future__ import annotations

from typing import Any


def str_attr(op: Any, name: str, default: str) -> str:
    """A STRING attribute as ``str``: the loader hands ONNX strings over as ``bytes``."""
    value = op.attr(name, default)
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
