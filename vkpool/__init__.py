"""vkpool: pool every Vulkan compute device on a workstation and run ONNX models on them.

The public names are loaded on first use so that ``import vkpool`` stays cheap for clients
(``vkpool.Client`` never imports onnx or the Vulkan binding).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Session": "vkpool.session",
    "NodeArg": "vkpool.session",
    "InvalidInput": "vkpool.errors",
    "DevicePool": "vkpool.pool",
    "DeviceOutOfMemory": "vkpool.memory",
    "ModelError": "vkpool.model",
    "UnsupportedOp": "vkpool.kernels.base",
    "Client": "vkpool.daemon.client",
    "AsyncClient": "vkpool.daemon.client",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vkpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
