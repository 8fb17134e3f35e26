"""One ledger of budgeted memory per machine, shared by every vkpool process.

A daemon, sessions in other programs and one-shot ``vkpool`` commands all charge the same
members; each process's :class:`~vkpool.memory.Budget` checks a request against what *every*
live process holds on that member, so a budget holds across processes.

The ledger is the folder ``ledger`` in :func:`ledger_dir` (``$VKPOOL_LEDGER_DIR``, else
``$XDG_RUNTIME_DIR/vkpool``, else ``<tmp>/vkpool-<uid>``): one JSON file per process holding
memory, ``<pid>-<start time>.json`` (its command line, the bytes it holds per member), which only
that process writes, and ``lock``, an ``fcntl.flock`` every change and every read is made
under. A file whose process is gone, or whose pid now names a process started at another time,
is ignored when the ledger is read and deleted by the next change: a process that dies gives
its share back without doing anything.

Members are named across processes by a key that does not depend on a process's numbering:
the device UUID, with the split (``<uuid>/<index>of<count>``) for a member that is part of
one, and ``host`` for the host member. Processes configured with different splits of one
device therefore account apart; the device's heap still bounds them all.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEDGER_DIR_ENV = "VKPOOL_LEDGER_DIR"
HOST_KEY = "host"


def ledger_dir() -> Path:
    """Where this machine's ledger lives (see the module docstring)."""
    explicit = os.environ.get(LEDGER_DIR_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "vkpool"
    return Path(tempfile.gettempdir()) / f"vkpool-{os.getuid()}"


def member_key(uuid: str, split_index: int | None = None, split_count: int = 1) -> str:
    """The name of a Vulkan member in the ledger: its device's UUID, and its split."""
    return uuid if split_index is None else f"{uuid}/{split_index}of{split_count}"


def process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from ``/proc``); None when it is not running
    (or has exited and awaits its parent's wait).

    Where ``/proc`` is missing, a running process answers ``"?"``: its pid alone names it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped by its parent: it holds nothing
        return None
    return fields[19].decode()


@dataclass(frozen=True)
class Holding:
    """What one process holds on one member."""

    pid: int
    command: str
    key: str
    member: str  # the member's id in that process (``vk0``, ``vk0.1``, ``cpu``)
    nbytes: int

    def describe(self) -> str:
        from vkpool.units import format_size

        return f"pid {self.pid} ({self.command}) holds {format_size(self.nbytes)}"


class Ledger:
    """This process's view of the machine's ledger; :func:`machine_ledger` gives the shared one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "ledger"  # a folder: ``lock`` and one ``<pid>-<start>.json`` per process
        self._lock = threading.Lock()
        self._mine: dict[str, int] = {}
        self._ids: dict[str, str] = {}
        self._me = f"{os.getpid()}-{process_start(os.getpid())}"
        self._command = _command_line()
        #: set in a child forked from the process that made this object: the bytes are the parent's
        self.inherited = False

    # -- changes ------------------------------------------------------------------------------
    def reserve(self, key: str, member: str, nbytes: int, budget_bytes: int) -> None:
        """Charges ``nbytes`` on ``key`` to this process, or raises
        :class:`~vkpool.memory.DeviceOutOfMemory` naming the holders when every process's
        bytes on it would pass ``budget_bytes``."""
        from vkpool.memory import DeviceOutOfMemory

        if self.inherited:
            raise RuntimeError("a device pool made before this process was forked cannot allocate here: "
                               "make the pool (or the Session) in the child process")
        with self._lock, self._locked() as records:
            held = _holdings(records, key)
            used = sum(h.nbytes for h in held)
            if used + nbytes > budget_bytes:
                raise DeviceOutOfMemory(member, nbytes, used, budget_bytes, _over_budget(held))
            self._mine[key] = self._mine.get(key, 0) + nbytes
            self._ids[key] = member
            self._write_mine()

    def release(self, key: str, nbytes: int) -> None:
        if self.inherited:  # freed in a forked child: the parent still holds the memory it charged
            return
        with self._lock, self._locked():
            left = self._mine.get(key, 0) - nbytes
            if left < 0:
                raise AssertionError(f"{key}: releasing {nbytes} bytes but this process holds {left + nbytes}")
            self._mine[key] = left
            self._write_mine()

    def check_budget(self, key: str, member: str, budget_bytes: int) -> None:
        """Raises ValueError when the processes already hold more than ``budget_bytes`` on ``key``."""
        held = self.holders(key)
        used = sum(h.nbytes for h in held)
        if budget_bytes < used:
            from vkpool.units import format_size

            raise ValueError(f"{member}: a budget of {format_size(budget_bytes)} is below the "
                             f"{format_size(used)} already in use ({_names(held)})")

    # -- reading ------------------------------------------------------------------------------
    def holders(self, key: str | None = None) -> list[Holding]:
        """What every live process holds (on ``key``, or on every member), largest first."""
        with self._locked(write=False) as records:
            return _holdings(records, key)

    def used_bytes(self, key: str) -> int:
        return sum(h.nbytes for h in self.holders(key))

    # -- the files ----------------------------------------------------------------------------
    def _write_mine(self) -> None:
        mine = {k: {"member": self._ids[k], "bytes": n} for k, n in self._mine.items() if n}
        path = self.path / f"{self._me}.json"
        if not mine:
            path.unlink(missing_ok=True)
            return
        # only this process writes its file, under the lock: written in place (a rename per
        # change cost 0.85 ms on an overlay /tmp); a process killed mid-write is dead, its file ignored
        data = json.dumps({"command": self._command, "members": mine}, sort_keys=True).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def _locked(self, write: bool = True) -> "_Locked":
        return _Locked(self, write)


class _Locked:
    """Every live process's record (process → ``{command, members}``), read under the lock; a
    writer deletes the files of processes that are gone."""

    def __init__(self, ledger: Ledger, write: bool) -> None:
        self.ledger = ledger
        self.write = write
        self.fd = -1

    def __enter__(self) -> dict[str, Any]:
        folder = self.ledger.path
        try:
            self.fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            self.fd = _create(folder)
        except OSError as exc:
            raise _unusable(folder, exc) from None
        fcntl.flock(self.fd, fcntl.LOCK_EX if self.write else fcntl.LOCK_SH)
        records: dict[str, Any] = {}
        for name in os.listdir(folder):
            proc, dot, ext = name.partition(".")
            if ext != "json":
                continue
            if proc != self.ledger._me and not _alive(proc):
                if self.write:
                    (folder / name).unlink(missing_ok=True)
                continue
            try:
                records[proc] = json.loads((folder / name).read_bytes())
            except (FileNotFoundError, ValueError):
                continue  # its process is ending or was killed while writing it
        return records

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _create(folder: Path) -> int:
    """Makes the ledger's folder (private to this user) and opens its lock."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.parent.stat().st_uid != os.getuid():  # another user's folder in a shared /tmp
            raise PermissionError(f"{folder.parent} belongs to another user")
        return os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise _unusable(folder, exc) from None


def _unusable(folder: Path, exc: OSError) -> RuntimeError:
    return RuntimeError(f"the vkpool ledger {folder} cannot be used ({exc}); every vkpool process of this "
                        f"machine shares it: set {LEDGER_DIR_ENV} to a folder of yours")


def _command_line() -> str:
    """This process as ``vkpool devices`` names it: ``vkpool serve``, ``python -c``, ``pytest ...``."""
    argv = list(sys.argv) or [""]
    argv[0] = os.path.basename(argv[0]) if argv[0] not in ("", "-c", "-m") else f"python {argv[0]}".strip()
    return " ".join(argv)[:120]


def _alive(proc: str) -> bool:
    pid, _, start = proc.partition("-")
    return pid.isdigit() and process_start(int(pid)) == start


def _holdings(records: dict[str, Any], key: str | None) -> list[Holding]:
    out = [Holding(int(proc.partition("-")[0]), rec["command"], k, held["member"], int(held["bytes"]))
           for proc, rec in records.items() for k, held in rec["members"].items() if key in (None, k)]
    return sorted(out, key=lambda h: (-h.nbytes, h.pid, h.key))


def _names(held: list[Holding]) -> str:
    return "; ".join(h.describe() for h in held) or "no process holds any"


def _over_budget(held: list[Holding]) -> str:
    return f"over budget, counting every vkpool process on this machine ({_names(held)})"


_LEDGERS: dict[Path, Ledger] = {}
_LEDGERS_LOCK = threading.Lock()


def machine_ledger() -> Ledger:
    """The ledger of :func:`ledger_dir`, one object per directory in this process."""
    directory = ledger_dir()
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(directory)
        if ledger is None:
            ledger = _LEDGERS[directory] = Ledger(directory)
        return ledger


def _forget_in_child() -> None:
    # a forked child holds nothing yet: what its parent holds stays the parent's, and a pool it
    # inherited charges nothing here (its Vulkan objects are the parent's too)
    global _LEDGERS_LOCK
    for ledger in _LEDGERS.values():
        ledger.inherited = True
    _LEDGERS.clear()
    _LEDGERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
