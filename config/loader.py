"""Loading and validating vkpool's YAML config, with file:line in every error.

The schema is documented in ``docs/config.md``. Unknown keys, duplicate keys, malformed or
negative sizes and zero splits are refused here; what needs the devices (a selector that
matches nothing, a budget above the heap) is refused when the pool is built, still naming
the file and line.

Importing ``yaml`` costs 10 to 20 ms, a good part of a short-lived process's start, so the
values a config's YAML stands for and the line of each key are kept as JSON in
``$VKPOOL_CACHE_DIR/config``, by a hash of the text (and of this file's size and mtime): a
process whose config has not changed reads that instead of importing yaml. The checks above run
on those values every time, so an error reads the same either way.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vkpool.units import parse_size

if TYPE_CHECKING:
    import yaml

SELECTOR_KEYS = ("index", "name", "vendor", "type", "uuid")
DEVICE_TYPES = ("discrete", "integrated", "virtual", "cpu", "other")
#: where a device runs the copies of a run slot's I/O (``devices[].transfer_queue``; :mod:`vkpool.device`)
TRANSFER_QUEUE_MODES = ("auto", "off", "main")


class ConfigError(ValueError):
    """A config file is invalid: the message names the file, the line and the key."""


@dataclass
class Where:
    """Source positions of the keys of a config file: ``where("devices[0].budget")``."""

    path: str
    lines: dict[str, int] = field(default_factory=dict)

    def __call__(self, key: str) -> str:
        line = self.lines.get(key)
        while line is None and key:
            key = key.rpartition(".")[0] if "." in key else ""
            line = self.lines.get(key)
        return f"{self.path}:{line}" if line else self.path

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self(key)}: {key}: {message}")


@dataclass
class DeviceRule:
    match: dict[str, Any]
    split: int = 1
    budget: list[str | int] | None = None
    exclude: bool = False
    key: str = ""  # e.g. "devices[1]": for error messages
    cost: dict[str, float] = field(default_factory=dict)  # planner speeds that replace calibration's
    transfer_queue: str = "auto"  # which queue copies run slots' I/O (vkpool.device.TRANSFER_QUEUE_MODES)


@dataclass
class HostSettings:
    enabled: bool = True
    budget: str | int = "2GiB"
    cost: dict[str, float] = field(default_factory=dict)
    engine: str = "auto"  # one of HOST_ENGINES


#: how the ``cpu`` member runs its chunks: onnxruntime where it is installed and takes the chunk, else numpy
HOST_ENGINES = ("auto", "onnxruntime", "numpy")
#: where a model goes when no member is asked for (``docs/partitioning.md``, "Where a model runs")
PLACEMENTS = ("fastest", "vulkan")


@dataclass
class Config:
    devices: list[DeviceRule]
    host: HostSettings
    daemon: dict[str, Any]
    where: Where
    placement: str = "fastest"  # one of PLACEMENTS; $VKPOOL_PLACEMENT wins (placement_policy)

    @property
    def path(self) -> str:
        return self.where.path


def default_config_text() -> str:
    return Path(__file__).with_name("default.yaml").read_text()


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Loads ``path``, else ``$VKPOOL_CONFIG``, else the default config shipped with vkpool."""
    if path is None:
        path = os.environ.get("VKPOOL_CONFIG") or None
    if path is None:
        return parse_config(default_config_text(), "<default config>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
    return parse_config(text, str(p))


def parse_config(text: str, source: str = "<config>") -> Config:
    where = Where(source)
    data = _values(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping with keys devices, host, daemon, placement")
    _only(data, ("devices", "host", "daemon", "placement"), "", where)
    rules = _device_rules(data.get("devices") or [], where)
    host = _host(data.get("host") or {}, where)
    daemon = data.get("daemon") or {}
    if not isinstance(daemon, dict):
        raise where.error("daemon", "must be a mapping")
    placement = data.get("placement", "fastest")
    if placement not in PLACEMENTS:
        raise where.error("placement", f"must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    return Config(rules, host, daemon, where, placement)


def placement_policy(config: Config | None) -> str:
    """Where a model goes when no member is asked for: ``$VKPOOL_PLACEMENT``, else the config's
    ``placement``, else ``fastest``. Raises ConfigError for a value not in :data:`PLACEMENTS`."""
    value = os.environ.get("VKPOOL_PLACEMENT") or (config.placement if config is not None else "fastest")
    if value not in PLACEMENTS:
        raise ConfigError(f"VKPOOL_PLACEMENT must be one of {', '.join(PLACEMENTS)}, got {value!r}")
    return value


def _only(mapping: dict[str, Any], allowed: tuple[str, ...], prefix: str, where: Where) -> None:
    for key in mapping:
        if key not in allowed:
            full = f"{prefix}.{key}" if prefix else str(key)
            raise where.error(full, f"unknown key {key!r} (allowed: {', '.join(allowed)})")


def _device_rules(raw: Any, where: Where) -> list[DeviceRule]:
    if not isinstance(raw, list):
        raise where.error("devices", "must be a list of device rules")
    rules = []
    for i, item in enumerate(raw):
        key = f"devices[{i}]"
        if not isinstance(item, dict):
            raise where.error(key, "a device rule is a mapping with match, split, budget, exclude, cost, "
                              "transfer_queue")
        _only(item, ("match", "split", "budget", "exclude", "cost", "transfer_queue"), key, where)
        match = item.get("match")
        if not isinstance(match, dict) or not match:
            raise where.error(f"{key}.match", f"needs a mapping with one of {', '.join(SELECTOR_KEYS)}")
        _only(match, SELECTOR_KEYS, f"{key}.match", where)
        if "index" in match and (not isinstance(match["index"], int) or isinstance(match["index"], bool)
                                 or match["index"] < 0):
            raise where.error(f"{key}.match.index", "must be a device index (0, 1, ...)")
        if "type" in match and str(match["type"]).lower() not in DEVICE_TYPES:
            raise where.error(f"{key}.match.type", f"must be one of {', '.join(DEVICE_TYPES)}")
        split = item.get("split", 1)
        if not isinstance(split, int) or isinstance(split, bool) or split < 1:
            raise where.error(f"{key}.split", f"must be a whole number of members, 1 or more (got {split!r})")
        exclude = item.get("exclude", False)
        if not isinstance(exclude, bool):
            raise where.error(f"{key}.exclude", "must be true or false")
        budget = item.get("budget")
        budgets: list[str | int] | None = None
        if budget is not None:
            budgets = list(budget) if isinstance(budget, list) else [budget]
            if len(budgets) not in (1, split):
                raise where.error(f"{key}.budget", f"give one budget or one per split member ({split})")
            for j, b in enumerate(budgets):
                _check_size(b, f"{key}.budget", where, allow_percent=True)
        transfer_queue = item.get("transfer_queue", "auto")
        if transfer_queue is False:  # YAML 1.1 reads a bare `off` as false
            transfer_queue = "off"
        if transfer_queue not in TRANSFER_QUEUE_MODES:
            raise where.error(f"{key}.transfer_queue", f"must be one of {', '.join(TRANSFER_QUEUE_MODES)} "
                              f"(got {transfer_queue!r})")
        rules.append(DeviceRule(dict(match), split, budgets, exclude, key, _cost(item.get("cost"), f"{key}.cost", where),
                                transfer_queue))
    return rules


def _host(raw: Any, where: Where) -> HostSettings:
    if not isinstance(raw, dict):
        raise where.error("host", "must be a mapping with enabled, budget, cost, engine")
    _only(raw, ("enabled", "budget", "cost", "engine"), "host", where)
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise where.error("host.enabled", "must be true or false")
    budget = raw.get("budget", "2GiB")
    _check_size(budget, "host.budget", where, allow_percent=False)
    engine = raw.get("engine", "auto")
    if engine not in HOST_ENGINES:
        raise where.error("host.engine", f"must be one of {', '.join(HOST_ENGINES)}, got {engine!r}")
    return HostSettings(enabled, budget, _cost(raw.get("cost"), "host.cost", where), engine)


#: the planner's speeds a config may set (vkpool.partition.cost.MemberCost, SI units)
COST_KEYS = ("flops_per_s", "bytes_per_s", "dispatch_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
             "transfer_latency_s")


def _cost(raw: Any, key: str, where: Where) -> dict[str, float]:
    """Speeds that override the member's calibration (``vkpool calibrate``) for the planner."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise where.error(key, f"must be a mapping of {', '.join(COST_KEYS)}")
    _only(raw, COST_KEYS, key, where)
    out = {}
    for name, value in raw.items():
        try:  # YAML reads 1.5e12 (no sign in the exponent) as a string
            number = float(value) if not isinstance(value, bool) else float("nan")
        except (TypeError, ValueError):
            number = float("nan")
        if not 0 <= number < float("inf") or (name.endswith("per_s") and number == 0):
            raise where.error(f"{key}.{name}", f"must be a number {'> 0' if name.endswith('per_s') else '>= 0'} "
                              f"in SI units (e.g. 5.0e13 FLOP/s, 2.0e-6 s), got {value!r}")
        out[name] = number
    return out


def _check_size(value: Any, key: str, where: Where, *, allow_percent: bool) -> None:
    """A budget: a size (or a percentage where allowed) above zero."""
    try:
        size = parse_size(value, of=1 << 40 if allow_percent else None)
    except ValueError as exc:
        raise where.error(key, str(exc)) from None
    if size == 0:
        off = "set `host.enabled: false`" if key.startswith("host") else "set `exclude: true` in the device rule"
        raise where.error(key, f"a budget of {value!r} leaves the member no memory; to leave it out of the pool, {off}")


# -- YAML, and the cache of what it stands for --------------------------------------------------


def _values(text: str, where: Where) -> Any:
    """The Python values of the YAML ``text``, each key's line recorded in ``where``; from the
    cache when this text was parsed before, else parsed and, when JSON holds them exactly,
    cached."""
    entry = _cache_entry(text)
    if entry is not None:
        try:
            cached = json.loads(entry.read_text())
            lines = cached["lines"]
            if isinstance(lines, dict) and all(type(v) is int for v in lines.values()):
                where.lines.update(lines)
                return cached["data"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing or damaged: parse again, and write it anew
    data = _parse_yaml(text, where)
    if entry is not None:
        try:
            encoded = json.dumps({"data": data, "lines": where.lines})
            if _same(json.loads(encoded)["data"], data):  # a date, a set or an int key would not be
                from vkpool.cache import write_atomic

                write_atomic(entry, encoded.encode())
        except (OSError, ValueError, TypeError):
            pass
    return data


def _cache_entry(text: str) -> Path | None:
    try:
        from vkpool.cache import cache_dir

        st = os.stat(__file__)
        key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}\n{text}".encode()).hexdigest()[:32]
        return cache_dir("config") / f"{key}.json"
    except OSError:
        return None


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (``1 == 1.0 == True`` is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _parse_yaml(text: str, where: Where) -> Any:
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{where.path}{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return _to_python(root, "", where) if root is not None else {}


#: the tags of plain YAML values; a config holds nothing else (``!!python/...``, ``!!binary``,
#: ``!!set``, a local ``!tag``: all refused with the file and line) but what YAML reads a plain
#: scalar as by itself (a date)
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "seq", "map"))


def _plain(node: yaml.Node) -> bool:
    import yaml

    if node.tag in _PLAIN_TAGS:
        return True
    return isinstance(node, yaml.ScalarNode) and node.tag == yaml.SafeLoader("").resolve(
        yaml.ScalarNode, node.value, (True, False))


def _to_python(node: yaml.Node, path: str, where: Where) -> Any:
    """Builds Python values from YAML nodes, recording each key's line, refusing duplicates and
    every value that is not plain YAML."""
    import yaml

    line = node.start_mark.line + 1
    where.lines.setdefault(path, line)
    if not _plain(node):
        raise ConfigError(f"{where.path}:{line}: {path or 'the config'}: tag {node.tag!r} is not allowed; "
                          "a config holds plain values (maps, lists, strings, numbers, booleans, null)")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for knode, vnode in node.value:
            key = _scalar(knode, f"{path}.<key>" if path else "<key>", where)
            full = f"{path}.{key}" if path else str(key)
            if key in out:
                raise ConfigError(f"{where.path}:{knode.start_mark.line + 1}: {full}: duplicate key {key!r}")
            where.lines[full] = knode.start_mark.line + 1
            out[key] = _to_python(vnode, full, where)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, f"{path}[{i}]", where) for i, v in enumerate(node.value)]
    return _scalar(node, path, where)


def _scalar(node: yaml.Node, path: str, where: Where) -> Any:
    """The value of a plain scalar node (a list or a map as a key is refused); errors name the
    file and line."""
    import yaml

    line = node.start_mark.line + 1
    if not isinstance(node, yaml.ScalarNode) or not _plain(node):
        raise ConfigError(f"{where.path}:{line}: {path}: a key must be a plain string or number")
    try:
        return yaml.SafeLoader("").construct_object(node)
    except (yaml.YAMLError, ValueError) as exc:  # `!!int abc` raises int()'s ValueError
        raise ConfigError(f"{where.path}:{line}: {path}: {getattr(exc, 'problem', None) or exc}") from None
