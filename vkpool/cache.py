"""Where vkpool keeps what it can rebuild: SPIR-V, pipeline caches, calibration."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$VKPOOL_CACHE_DIR`` (else ``$XDG_CACHE_HOME/vkpool``, else ``~/.cache/vkpool``) / parts."""
    root = os.environ.get("VKPOOL_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "vkpool"
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` so that a concurrent reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
