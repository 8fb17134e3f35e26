"""The ``daemon:`` section of the config file: schema, defaults and validation.

The config loader hands us the raw mapping and a ``where(key)`` that names the key's place in
the file for error messages (``"vkpool.yaml: daemon.queue_limit"``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping


class SettingsError(ValueError):
    """A bad value in the ``daemon:`` section; the message names the key and the reason."""


@dataclass(frozen=True)
class CurveSettings:
    """CURVE keys for a TCP endpoint (files written by ``zmq.auth.create_certificates``)."""

    server_secret_key: Path
    authorized_keys_dir: Path


@dataclass(frozen=True)
class DaemonSettings:
    endpoint: str | None = None          # None: ipc:// socket in the user's runtime directory
    max_connections: int = 4096          # clients beyond this get TooManyConnections
    max_lane_connections: int = 256      # local lane connections; 0 = offer no lane
    lane_ring_bytes: int = 16 << 20      # each half (request, reply) of a lane's shared-memory ring
    lane_poll: float = field(default_factory=lambda: _default_lane_poll())  # see docs/daemon.md; 0 = never
    zmq_poll: float = field(default_factory=lambda: _default_zmq_poll())  # see docs/daemon.md; 0 = never
    queue_limit: int = 256               # queued jobs per model before Busy
    max_queued_jobs: int = 4096          # queued jobs over all models before Busy
    max_message_bytes: int = 256 << 20   # total size of one request
    max_frames: int = 1024               # frames in one request
    max_model_bytes: int = 64 << 30      # a model file read by load_model, with its external data
    keep_alive: float = 300.0            # seconds an unused model stays loaded; < 0 = forever
    job_timeout: float | None = 300.0    # default infer timeout (seconds); None = no limit
    drain_deadline: float = 30.0         # seconds SIGTERM waits for in-flight jobs
    evict_idle: bool = False             # free unused models to admit a load that does not fit
    workers_per_model: int = 2           # runtime calls in flight per model
    inline_run_max: float = 0.001        # jobs this fast run where they are read, when idle; 0 = never
    run_slots: int = 2                   # a model compiled whole on one Vulkan member: runs it keeps in flight
    replay_window: int = 1024            # remembered replies per daemon for retried request ids
    log_file: Path | None = None
    log_level: str = "INFO"
    pid_file: Path | None = None         # None: <runtime dir>/daemon.pid for `serve --detach`, else none
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint; None = off
    curve: CurveSettings | None = None
    #: dynamic batching per model: rules ``{match: glob on the model's name, max_batch, max_queue_delay}``,
    #: the first that matches applies to a load that asks for no batching itself
    batching: tuple[dict[str, Any], ...] = ()
    #: serve each Vulkan pool member from a process of its own, behind a front (daemon/front.py)
    process_per_device: bool = False

    def batching_for(self, name: str) -> dict[str, Any]:
        """``{max_batch, max_queue_delay}`` of the first batching rule matching ``name``, or empty."""
        from fnmatch import fnmatchcase

        for rule in self.batching:
            if fnmatchcase(name, rule["match"]):
                return {"max_batch": rule["max_batch"], "max_queue_delay": rule["max_queue_delay"]}
        return {}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None,
                  where: Callable[[str], str] = lambda key: f"daemon.{key}") -> "DaemonSettings":
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise SettingsError(f"{where(key)}: unknown key; known keys: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            parse = _PARSERS[key]
            try:
                values[key] = parse(value)
            except (TypeError, ValueError) as exc:
                raise SettingsError(f"{where(key)}: {exc}") from None
        settings = cls(**values)
        if settings.endpoint and settings.endpoint.startswith("tcp://") and settings.curve is None:
            raise SettingsError(
                f"{where('endpoint')}: a TCP endpoint needs CURVE keys (daemon.curve.server_secret_key "
                "and daemon.curve.authorized_keys_dir): plain TCP would let anyone on the network "
                "load files and run jobs as this user")
        return settings


def _default_lane_poll() -> float:
    """100 µs, or 0 (no polling) on a machine with fewer than 4 CPUs."""
    from vkpool.daemon.lane import POLL_MIN_CPUS

    from vkpool.cpus import usable_cpus

    return 0.0001 if usable_cpus() >= POLL_MIN_CPUS else 0.0


def _default_zmq_poll() -> float:
    """400 µs, or 0 (no polling) on a machine with fewer than 4 CPUs."""
    from vkpool.daemon.lane import ZMQ_POLL_MAX_S

    return ZMQ_POLL_MAX_S


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(us|µs|ms|s|m|h)?\s*$")
_DURATION_SCALE = {None: 1.0, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as ``"200us"``, ``"30s"``, ``"5m"``, ``"1h"``."""
    if isinstance(value, bool):
        raise TypeError("expected a duration, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration (examples: 30, \"30s\", \"5m\", \"1h\")")
    return float(match.group(1)) * _DURATION_SCALE[match.group(2)]


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _size(value: Any) -> int:
    from vkpool.units import parse_size

    size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size(str(value))
    if size < 1:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def _size_between(value: Any, least: int, most: int) -> int:
    size = _size(value)
    if not least <= size <= most:
        raise ValueError(f"expected a size from {least} to {most} bytes, got {value!r}")
    return size


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _endpoint(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("ipc://", "tcp://")):
        raise ValueError(f"expected an ipc:// or tcp:// endpoint, got {value!r}")
    return value


def _optional_duration(value: Any) -> float | None:
    return None if value is None else _non_negative(parse_duration(value))


def _non_negative(seconds: float) -> float:
    if seconds < 0:
        raise ValueError(f"expected a non-negative duration, got {seconds}")
    return seconds


def _log_level(value: Any) -> str:
    level = str(value).upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError(f"expected DEBUG, INFO, WARNING or ERROR, got {value!r}")
    return level


def parse_address(value: Any) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"``, ``"[::1]:9464"``, ``"localhost:9464"`` → (host, port); None for
    null. Port 0 asks for any free port (the one bound is logged)."""
    if value is None:
        return None
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _curve(value: Any) -> CurveSettings | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"server_secret_key", "authorized_keys_dir"}:
        raise ValueError("expected a map with exactly server_secret_key and authorized_keys_dir")
    secret = Path(value["server_secret_key"]).expanduser()
    keys_dir = Path(value["authorized_keys_dir"]).expanduser()
    if not secret.is_file():
        raise ValueError(f"server_secret_key {secret} is not a file")
    if not keys_dir.is_dir():
        raise ValueError(f"authorized_keys_dir {keys_dir} is not a directory")
    return CurveSettings(secret, keys_dir)


def _batching_rules(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise ValueError("expected a list of {match, max_batch, max_queue_delay} rules")
    rules = []
    for i, rule in enumerate(value):
        if not isinstance(rule, dict) or not {"match", "max_batch"} <= set(rule) \
                or not set(rule) <= {"match", "max_batch", "max_queue_delay"}:
            raise ValueError(f"rule {i}: expected a map with match, max_batch and optionally max_queue_delay")
        if not isinstance(rule["match"], str) or not rule["match"]:
            raise ValueError(f"rule {i}: match must be a glob on the model's name, got {rule['match']!r}")
        max_batch = _positive_int(rule["max_batch"])
        delay = _non_negative(parse_duration(rule.get("max_queue_delay", 0)))
        if not delay <= 10:
            raise ValueError(f"rule {i}: max_queue_delay must be at most 10 s, got {rule.get('max_queue_delay')!r}")
        rules.append({"match": rule["match"], "max_batch": max_batch, "max_queue_delay": delay})
    return tuple(rules)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "batching": _batching_rules,
    "endpoint": _endpoint,
    "max_connections": _positive_int,
    "max_lane_connections": _non_negative_int,
    "lane_poll": lambda v: _non_negative(parse_duration(v)),
    "lane_ring_bytes": lambda v: _size_between(v, 4 << 10, 1 << 30),
    "zmq_poll": lambda v: _non_negative(parse_duration(v)),
    "queue_limit": _positive_int,
    "max_queued_jobs": _positive_int,
    "max_message_bytes": _size,
    "max_frames": _positive_int,
    "max_model_bytes": _size,
    "keep_alive": parse_duration,
    "job_timeout": _optional_duration,
    "drain_deadline": lambda v: _non_negative(parse_duration(v)),
    "evict_idle": _bool,
    "process_per_device": _bool,
    "workers_per_model": _positive_int,
    "run_slots": _positive_int,
    "inline_run_max": lambda v: _non_negative(parse_duration(v)),
    "replay_window": _positive_int,
    "log_file": lambda v: None if v is None else Path(str(v)).expanduser(),
    "log_level": _log_level,
    "pid_file": lambda v: None if v is None else Path(str(v)).expanduser(),
    "metrics": parse_address,
    "curve": _curve,
}
