"""``vkpool serve``: build the runtime and settings from the config file, run the server; with
``--detach``, in a process of its own that outlives the command, found again by its pid file."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vkpool.daemon.endpoint import EndpointError, default_endpoint, runtime_dir
from vkpool.daemon.settings import DaemonSettings, SettingsError

log = logging.getLogger("vkpool.daemon")

#: how long ``serve --detach`` waits for the daemon to listen (building the pool, binding)
DETACH_READY_S = 60.0


def load_settings(config: str | Path | None) -> tuple[Any, DaemonSettings]:
    """The parsed config (``config``, else ``$VKPOOL_CONFIG``, else the default) and its ``daemon:``
    section validated."""
    from vkpool.config.loader import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise SettingsError(str(exc)) from None
    settings = DaemonSettings.from_dict(cfg.daemon, where=lambda key: f"{cfg.where('daemon.' + key)}: daemon.{key}")
    return cfg, settings


def setup_logging(settings: DaemonSettings, member: str | None = None) -> None:
    where = "%(name)s" if member is None else f"%(name)s[{member}]"  # a serving process names its member
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s {where}: %(message)s")
    handlers: list[logging.Handler] = []
    if settings.log_file is not None:
        settings.log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(settings.log_file))
    if settings.log_file is None or not _same_file(sys.stderr, settings.log_file):
        handlers.append(logging.StreamHandler(sys.stderr))  # a detached daemon's stderr is its log file
    root = logging.getLogger("vkpool")
    root.setLevel(settings.log_level)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)


def serve(config: str | Path | None = None, endpoint: str | None = None, runtime: Any = None, *,
          pid_file: Path | None = None, log_file: Path | None = None, member: str | None = None,
          member_metrics: bool = False) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT or a shutdown request; exit status.
    ``pid_file`` (else ``daemon.pid_file``): written once the daemon listens, removed at exit;
    a start is refused while it names a live daemon. ``member``: serve that Vulkan member alone,
    as one serving process of a daemon with ``process_per_device`` (:mod:`vkpool.daemon.front`),
    which owns the pid file; with ``member_metrics``, its metrics are served on a free local port,
    named in a file beside its socket for the front to gather (:func:`front.metrics_file`)."""
    try:
        cfg, settings = load_settings(config)
    except SettingsError as exc:
        print(f"vkpool serve: {exc}", file=sys.stderr)
        return 2
    if member is not None:
        settings = dataclasses.replace(settings, process_per_device=False, pid_file=None,
                                       metrics=("127.0.0.1", 0) if member_metrics else None)
    endpoint = endpoint or settings.endpoint or default_endpoint()
    refusal = getattr(runtime, "refuses", lambda _: None)(settings)
    if settings.process_per_device:
        from vkpool.daemon.front import refusal as front_refusal

        refusal = front_refusal(settings, endpoint, runtime is not None)
    if refusal:
        print(f"vkpool serve: {refusal}", file=sys.stderr)
        return 2
    if log_file is not None:
        settings = dataclasses.replace(settings, log_file=log_file)
    pid_file = pid_file or settings.pid_file
    setup_logging(settings, member)
    if endpoint.startswith("tcp://") and settings.curve is None:
        log.error("refusing plain TCP on %s: anyone who reaches the port could load files and run jobs as "
                  "this user. Configure CURVE keys (daemon.curve: server_secret_key, authorized_keys_dir), "
                  "or use the default ipc:// endpoint", endpoint)
        return 2
    if pid_file is not None and (running := live_daemon(pid_file)) is not None:
        log.error("a vkpool daemon (pid %d) is running per %s; stop it first (`vkpool stop`)", running, pid_file)
        return 1
    if settings.process_per_device:
        from vkpool.daemon.front import serve_front

        listening = (lambda: write_pid_file(pid_file)) if pid_file is not None else (lambda: None)
        try:
            return serve_front(settings, endpoint, config, cfg, listening)
        finally:
            if pid_file is not None:
                remove_pid_file(pid_file)
    if member is not None:
        from vkpool.daemon.runtime import Runtime
        from vkpool.pool import DevicePool

        runtime = Runtime(DevicePool.from_config(cfg, only=member))
    metrics = None
    if settings.metrics is not None:
        from vkpool.daemon.metrics import Metrics

        metrics = Metrics()
        try:
            bound = metrics.serve(settings.metrics)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d: %s", *settings.metrics, exc)
            return 1
        if member is not None:
            from vkpool.daemon.front import metrics_file

            metrics_file(endpoint).write_text(f"{bound[0]}:{bound[1]}\n")
    try:
        return _run(cfg, settings, endpoint, runtime, pid_file, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _run(cfg: Any, settings: DaemonSettings, endpoint: str, runtime: Any, pid_file: Path | None,
         metrics: Any) -> int:
    from vkpool.daemon.server import Server

    if runtime is None:
        from vkpool.daemon.runtime import Runtime

        runtime = Runtime.from_config(cfg)
    try:
        server = Server(runtime, settings, endpoint, metrics=metrics)
    except EndpointError as exc:
        log.error("%s", exc)
        return 1
    if metrics is not None:
        metrics.watch(server.service, server.stats)
    server.install_signal_handlers()
    if pid_file is not None:
        write_pid_file(pid_file)
    try:
        return server.serve_forever()
    finally:
        if pid_file is not None:
            remove_pid_file(pid_file)


# -- pid files ----------------------------------------------------------------------------------
def default_pid_file() -> Path:
    return runtime_dir() / "daemon.pid"


def default_log_file() -> Path:
    """``$XDG_STATE_HOME/vkpool/daemon.log``, else ``~/.local/state/vkpool/daemon.log``."""
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) if base else Path.home() / ".local" / "state") / "vkpool" / "daemon.log"


def live_daemon(pid_file: Path) -> int | None:
    """The pid ``pid_file`` names when that process is alive and is a vkpool command; None when the
    file is absent, unreadable, or stale (its process gone, or the pid reused by another program)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid <= 0 or not process_running(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid  # no /proc, or another user's process: a live process is taken at its word
    return pid if b"vkpool" in cmdline else None


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a child not yet reaped is a zombie:
    it has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def write_pid_file(pid_file: Path) -> None:
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_file.with_name(f".{pid_file.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, pid_file)


def remove_pid_file(pid_file: Path) -> None:
    """Remove ``pid_file`` when it still names this process."""
    try:
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError):
        pass


# -- detaching ----------------------------------------------------------------------------------
def detach(config: str | None, endpoint: str | None, pid_file: Path | None, log_file: Path | None) -> int:
    """``vkpool serve --detach``: start the daemon in a new session with its output going to the
    log file, wait until it listens (it has written its pid file) and print where things are."""
    try:
        _, settings = load_settings(config)
    except SettingsError as exc:
        print(f"vkpool serve: {exc}", file=sys.stderr)
        return 2
    pid_file = (pid_file or settings.pid_file or default_pid_file()).expanduser().absolute()
    log_file = (log_file or settings.log_file or default_log_file()).expanduser().absolute()
    running = live_daemon(pid_file)
    if running is not None:
        print(f"vkpool serve: a vkpool daemon (pid {running}) is running per {pid_file}; stop it first "
              "(`vkpool stop`)", file=sys.stderr)
        return 1
    log_file.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vkpool", *(["--config", config] if config else []), "serve",
               "--pid-file", str(pid_file), "--log-file", str(log_file),
               *(["--endpoint", endpoint] if endpoint else [])]
    with open(log_file, "ab") as log_out, open(os.devnull, "rb") as nothing:
        start = log_out.tell()
        child = subprocess.Popen(command, stdin=nothing, stdout=log_out, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True)
    deadline = time.monotonic() + DETACH_READY_S
    while live_daemon(pid_file) != child.pid:
        if child.poll() is not None or time.monotonic() > deadline:
            if child.returncode is None:  # still starting after DETACH_READY_S: give up on it
                child.kill()
            print(f"vkpool serve: the daemon did not start (exit status {child.wait()}); from {log_file}:\n"
                  + _tail(log_file, start), file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"vkpool daemon started: pid {child.pid}, endpoint {endpoint or settings.endpoint or default_endpoint()}")
    print(f"  pid file {pid_file}")
    print(f"  log file {log_file}")
    return 0


def _tail(path: Path, start: int, lines: int = 20) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _same_file(stream: Any, path: Path) -> bool:
    try:
        a, b = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, AttributeError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
