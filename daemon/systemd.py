"""``vkpool service install``: the shipped systemd user unit (``config/vkpool.service``) written
to ``$XDG_CONFIG_HOME/systemd/user/`` (else ``~/.config/systemd/user/``), its ``ExecStart``
naming this Python's vkpool, so the unit runs the install it was made from."""
from __future__ import annotations

import os
import shlex
import sys
from importlib import resources
from pathlib import Path

UNIT_NAME = "vkpool.service"


def unit_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME")
    return (Path(base) if base else Path.home() / ".config") / "systemd" / "user"


def shipped_unit() -> str:
    return resources.files("vkpool.config").joinpath(UNIT_NAME).read_text()


def render_unit(config: str | None = None) -> str:
    """The shipped unit with ``ExecStart`` running ``python -m vkpool serve`` with this
    interpreter (a virtual environment's too), and ``--config`` when given (made absolute)."""
    command = [sys.executable, "-m", "vkpool"]
    if config:
        command += ["--config", str(Path(config).expanduser().absolute())]
    exec_start = "ExecStart=" + " ".join(shlex.quote(part) for part in [*command, "serve"])
    lines = shipped_unit().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(starts) != 1:
        raise RuntimeError(f"the shipped {UNIT_NAME} has {len(starts)} ExecStart lines; expected one")
    lines[starts[0]] = exec_start
    return "\n".join(lines) + "\n"


def install(config: str | None = None, *, force: bool = False) -> Path:
    """Write the unit; refuses to replace a different unit unless ``force``. The path written."""
    text = render_unit(config)
    path = unit_dir() / UNIT_NAME
    if path.exists() and path.read_text() != text and not force:
        raise FileExistsError(f"{path} exists and differs from the unit this vkpool would write; "
                              "`vkpool service install --print` shows it, --force replaces it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def uninstall() -> Path | None:
    """Remove the unit file; the path removed, None when there was none."""
    path = unit_dir() / UNIT_NAME
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path
