"""Where vkpool keeps what it can rebuild: SPIR-V, pipeline caches, calibration, loaded models."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable


def cache_dir(*parts: str, create: bool = True) -> Path:
    """``$VKPOOL_CACHE_DIR`` (else ``$XDG_CACHE_HOME/vkpool``, else ``~/.cache/vkpool``) / parts,
    created unless ``create`` is False (a path only read from need not exist)."""
    root = os.environ.get("VKPOOL_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "vkpool"
    path = base.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes | Iterable[Any]) -> None:
    """Writes ``data`` (bytes, or buffers written one after the other) so that a concurrent
    reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
