"""What a pool member costs: the roofline of its ops, its link to the host, its budget.

- ``time(op) = dispatch_s + max(flops / flops_per_s, (bytes_read + bytes_written) / bytes_per_s)``
  (the roofline model: Williams, Waterman, Patterson, CACM 52(4), 2009);
- ``upload(b) = transfer_latency_s + b / h2d_bytes_per_s`` and
  ``download(b) = transfer_latency_s + b / d2h_bytes_per_s``; a tensor moving between members goes
  device → host → device, so it pays the producer's download and the consumer's upload;
- ``network_latency_s`` (0 on one machine; half a node's link in a cluster,
  :mod:`vkpool.cluster.links`) adds to each upload's and download's latency;
- how long a chunk keeps its member's link **busy** per request, which bounds a pipelined stream
  of requests, is ``transfer_latency_s`` once (the chunk's one submission and its wait: its
  upload and download travel in it) plus ``b / h2d_bytes_per_s + b / d2h_bytes_per_s``; the
  network's latency passes while other requests are in flight, so it is not counted there.

Measured figures (``vkpool calibrate``, :mod:`vkpool.partition.calibrate`) live in a JSON file
per physical device, keyed by its UUID (the host member by :func:`host_calibration_key`), under
``$VKPOOL_CACHE_DIR/calibration`` (default ``~/.cache/vkpool/calibration``). A device spec file
(YAML) describes the members of a machine that is not this one, so plans can be made anywhere.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

CALIBRATION_VERSION = 1
SPEC_VERSION = 1
PS_PER_S = 10**12  # plans price time in integer picoseconds so sums and ties are exact


@dataclass(frozen=True)
class MemberCost:
    """Speeds of one member; every field in SI units (FLOP/s, B/s, s)."""

    flops_per_s: float
    bytes_per_s: float
    dispatch_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    transfer_latency_s: float
    network_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
            if f.name.endswith("per_s") and value == 0:
                raise ValueError(f"{f.name} must be > 0")

    def op_ps(self, flops: int, nbytes: int) -> int:
        """Roofline time of one op, in picoseconds."""
        seconds = self.dispatch_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)
        return int(round(seconds * PS_PER_S))

    def upload_ps(self, nbytes: Any) -> Any:
        """Host → member time of ``nbytes`` (scalar or array) moved in one submission; 0 for 0 bytes."""
        return link_ps(nbytes, self.transfer_latency_s + self.network_latency_s, self.h2d_bytes_per_s)

    def download_ps(self, nbytes: Any) -> Any:
        return link_ps(nbytes, self.transfer_latency_s + self.network_latency_s, self.d2h_bytes_per_s)

    def link_busy_ps(self, up_bytes: Any, down_bytes: Any) -> Any:
        """How long a chunk moving ``up_bytes`` in and ``down_bytes`` out keeps the link busy per
        request while requests stream: what bounds a pipelined stage."""
        return busy_ps(up_bytes, down_bytes, self.transfer_latency_s, self.h2d_bytes_per_s, self.d2h_bytes_per_s)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemberCost:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown cost fields {sorted(unknown)}; known: {sorted(names)}")
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        missing = names - optional - set(data)
        if missing:
            raise ValueError(f"missing cost fields {sorted(missing)}")
        return cls(**{k: float(v) for k, v in data.items()})

    def with_overrides(self, overrides: Mapping[str, Any]) -> MemberCost:
        """A copy with some fields replaced (the ``cost:`` section of a member in the config)."""
        return MemberCost.from_dict({**self.to_dict(), **overrides})


def link_ps(nbytes: Any, latency_s: float, bytes_per_s: float) -> Any:
    # one expression for scalars and arrays, so the DP and the plan evaluator round alike
    b = np.asarray(nbytes, dtype=np.float64)
    ps = np.where(b > 0, np.rint(latency_s * PS_PER_S + b * (PS_PER_S / bytes_per_s)), 0).astype(np.int64)
    return int(ps) if ps.ndim == 0 else ps


def busy_ps(up_bytes: Any, down_bytes: Any, latency_s: float, h2d_bytes_per_s: float,
            d2h_bytes_per_s: float) -> Any:
    """:meth:`MemberCost.link_busy_ps` for scalars or arrays (broadcast), rounded as :func:`link_ps`."""
    up, down = np.asarray(up_bytes, dtype=np.float64), np.asarray(down_bytes, dtype=np.float64)
    fixed = np.where((up > 0) | (down > 0), np.rint(np.asarray(latency_s) * PS_PER_S), 0).astype(np.int64)
    ps = fixed + link_ps(up, 0.0, h2d_bytes_per_s) + link_ps(down, 0.0, d2h_bytes_per_s)
    return int(ps) if np.ndim(ps) == 0 else ps


@dataclass(frozen=True)
class Member:
    """A pool member as the partitioner sees it: an id, a hard budget and its speeds."""

    id: str
    budget_bytes: int
    cost: MemberCost
    kind: str = "vulkan"  # 'vulkan' or 'host'
    name: str = ""
    #: whether ``cost`` was measured (``vkpool calibrate``) or set in the config rather than its
    #: kind's default (:func:`vkpool.placement.planner_members` says): the ``fastest`` placement
    #: ranks members only by such speeds
    measured: bool = False

    def with_budget(self, budget_bytes: int) -> Member:
        return dataclasses.replace(self, budget_bytes=int(budget_bytes))


#: Rough figures per member kind, used when a member has no calibration yet.
DEFAULT_COSTS: dict[str, MemberCost] = {
    "vulkan": MemberCost(10e12, 500e9, 5e-6, 12e9, 12e9, 20e-6),
    "host": MemberCost(200e9, 50e9, 1e-6, 20e9, 20e9, 1e-6),
}


# -- calibration cache -------------------------------------------------------------------------


def calibration_path(device_uuid: str) -> Path:
    """``<cache>/calibration/<uuid>.json``; the cache root honours ``VKPOOL_CACHE_DIR``."""
    from vkpool.cache import cache_dir

    safe = "".join(c for c in device_uuid if c.isalnum() or c in "-_")
    if not safe:
        raise ValueError(f"bad device UUID {device_uuid!r}")
    return cache_dir("calibration", create=False) / f"{safe}.json"


def pool_member_cost(member: Any) -> MemberCost:
    """The planner's speeds of a pool member: its cached calibration (``vkpool calibrate``; by
    device UUID, or ``host-<hostname>`` for the host member) when it was measured with the
    member's driver (:func:`calibration_driver`), else its kind's :data:`DEFAULT_COSTS`; then the
    config's ``cost:`` values for it, which win."""
    cost = load_calibration(calibration_key(member), driver=calibration_driver(member)) or DEFAULT_COSTS[member.kind]
    override = getattr(member, "cost_override", None)
    return dataclasses.replace(cost, **override) if override else cost


def has_measured_cost(member: Any) -> bool:
    """Whether a pool member's speeds are known rather than its kind's default: a calibration
    for its driver or engine, or ``cost:`` values in the config."""
    if getattr(member, "cost_override", None):
        return True
    return load_calibration(calibration_key(member), driver=calibration_driver(member)) is not None


def calibration_key(member: Any) -> str:
    """The file a member's calibration is kept in: its device's UUID (splits share it), or
    :func:`host_calibration_key` for the host member."""
    info = getattr(member, "info", None)
    return info.uuid if info is not None else host_calibration_key()


def calibration_driver(member: Any) -> str:
    """What a calibration holds for: the Vulkan driver's name and version, or for the host
    member the engine its chunks run with (``onnxruntime 1.32.0``, ``numpy``)."""
    info = getattr(member, "info", None)
    if info is not None:
        return f"{info.driver_name} {info.driver_info}".strip()
    from vkpool.host_engine import engine_name

    return engine_name(getattr(member, "engine", "auto"))


def host_calibration_key() -> str:
    """The cache key of this machine's host member, which has no Vulkan UUID: ``host-<hostname>``."""
    import socket

    return "host-" + "".join(c for c in socket.gethostname() if c.isalnum() or c in "-_")


def save_calibration(device_uuid: str, cost: MemberCost, *, device_name: str = "", driver: str = "") -> Path:
    """Writes ``{"version", "uuid", "device", "driver", "measured_at", "cost": {...}}`` atomically."""
    from vkpool.cache import write_atomic

    path = calibration_path(device_uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": CALIBRATION_VERSION, "uuid": device_uuid, "device": device_name, "driver": driver,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cost": cost.to_dict()}
    write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


def load_calibration(device_uuid: str, *, driver: str | None = None) -> MemberCost | None:
    """The cached cost of a device, or None when absent, of another version, or of another driver."""
    path = calibration_path(device_uuid)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("version") != CALIBRATION_VERSION or (driver is not None and record.get("driver") != driver):
        return None
    try:
        return MemberCost.from_dict(record["cost"])
    except (KeyError, ValueError, TypeError):
        return None


# -- device spec files ----------------------------------------------------------------------------


def load_device_spec(path: str | Path) -> list[Member]:
    """Members described by a YAML spec file (see ``partition/specs/*.yaml`` and docs).

    ``version: 1``, ``name``, and ``members``: each with ``id``, ``kind`` (vulkan|host), ``budget``
    (a size string such as ``80GiB``), an optional ``name``, and the six :class:`MemberCost`
    fields (missing ones take the kind's default).
    """
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or data.get("version") != SPEC_VERSION:
        raise ValueError(f"{path}: not a device spec (expected a mapping with version: {SPEC_VERSION})")
    entries = data.get("members")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: 'members' must be a non-empty list")
    members = []
    for entry in entries:
        members.append(member_from_mapping(entry, where=str(path)))
    ids = [m.id for m in members]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate member ids in {ids}")
    return members


def member_from_mapping(entry: Mapping[str, Any], *, where: str = "spec") -> Member:
    from vkpool.units import parse_size

    entry = dict(entry)
    try:
        member_id = str(entry.pop("id"))
        budget = parse_size(entry.pop("budget"))
    except KeyError as exc:
        raise ValueError(f"{where}: a member needs {exc.args[0]!r}") from None
    kind = str(entry.pop("kind", "vulkan"))
    if kind not in DEFAULT_COSTS:
        raise ValueError(f"{where}: member {member_id}: kind must be one of {sorted(DEFAULT_COSTS)}")
    name = str(entry.pop("name", ""))
    try:
        cost = DEFAULT_COSTS[kind].with_overrides(entry)
    except ValueError as exc:
        raise ValueError(f"{where}: member {member_id}: {exc}") from None
    return Member(member_id, budget, cost, kind, name)


def specs_dir() -> Path:
    """The example spec files shipped next to this module."""
    return Path(__file__).with_name("specs")
