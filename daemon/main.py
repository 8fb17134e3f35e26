"""``vkpool serve``: build the engine and settings from the config file, run the server."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from vkpool.daemon.endpoint import EndpointError, default_endpoint
from vkpool.daemon.settings import DaemonSettings, SettingsError

log = logging.getLogger("vkpool.daemon")


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


def setup_logging(settings: DaemonSettings) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if settings.log_file is not None:
        settings.log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(settings.log_file))
    root = logging.getLogger("vkpool")
    root.setLevel(settings.log_level)
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)


def serve(config: str | Path | None = None, endpoint: str | None = None, engine: Any = None) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT or a shutdown request; exit status."""
    try:
        cfg, settings = load_settings(config)
    except SettingsError as exc:
        print(f"vkpool serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings)
    endpoint = endpoint or settings.endpoint or default_endpoint()
    if endpoint.startswith("tcp://") and settings.curve is None:
        log.error("refusing plain TCP on %s: anyone who reaches the port could load files and run jobs as "
                  "this user. Configure CURVE keys (daemon.curve: server_secret_key, authorized_keys_dir), "
                  "or use the default ipc:// endpoint", endpoint)
        return 2
    from vkpool.daemon.server import Server

    if engine is None:
        from vkpool.daemon.engine import Engine

        engine = Engine.from_config(cfg)
    try:
        server = Server(engine, settings, endpoint)
    except EndpointError as exc:
        log.error("%s", exc)
        return 1
    server.install_signal_handlers()
    return server.serve_forever()
