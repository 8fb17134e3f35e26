"""Config loading: every kind of bad config is refused with file, line and key, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import vulkan_pool
from vkpool.config.loader import ConfigError, load_config, parse_config
from vkpool.discovery import discover
from vkpool.pool import resolve_members

GOOD = """\
devices:
  - match: {name: "llvmpipe*"}
    split: 3
    budget: [64MiB, 128MiB, 25%]
  - match: {vendor: nvidia}
    budget: 90%
  - match: {type: integrated}
    exclude: true
host:
  enabled: true
  budget: 2GiB
"""


def test_example_config_parses():
    cfg = parse_config(GOOD, "good.yaml")
    assert [r.split for r in cfg.devices] == [3, 1, 1]
    assert cfg.devices[2].exclude and cfg.host.budget == "2GiB"


@pytest.mark.parametrize("text, line, key, words", [
    ("devices: []\nhosts: {}\n", 2, "hosts", "unknown key"),
    ("host:\n  enabled: true\n  enabled: false\n", 3, "host.enabled", "duplicate key"),
    ("devices:\n  - match: {index: 0}\n    budget: -5MiB\n", 3, "devices[0].budget", "negative"),
    ("devices:\n  - match: {index: 0}\n    budget: lots\n", 3, "devices[0].budget", "not a size"),
    ("devices:\n  - match: {index: 0}\n    split: 0\n", 3, "devices[0].split", "1 or more"),
    ("devices:\n  - match: {colour: red}\n", 2, "devices[0].match.colour", "unknown key"),
    ("host:\n  budget: 12 parsecs\n", 2, "host.budget", "not a size"),
    ("devices:\n  - match: {index: 0}\n    split: 2\n    budget: [1MiB, 2MiB, 3MiB]\n", 4, "devices[0].budget",
     "one per split member"),
    ("devices:\n  - match: {index: 0}\n    cost: {flops: 1}\n", 3, "devices[0].cost.flops", "unknown key"),
    ("devices:\n  - match: {index: 0}\n    cost:\n      flops_per_s: 0\n", 4, "devices[0].cost.flops_per_s",
     "> 0"),
    ("host:\n  cost:\n    dispatch_s: fast\n", 3, "host.cost.dispatch_s", "SI units"),
])
def test_bad_config_names_file_line_and_key(text, line, key, words):
    with pytest.raises(ConfigError) as err:
        parse_config(text, "bad.yaml")
    msg = str(err.value)
    assert msg.startswith(f"bad.yaml:{line}: {key}:"), msg
    assert words in msg


@pytest.mark.parametrize("text, line, key, words", [
    ("devices:\n  - match: {name: 'no-such-gpu*'}\n    budget: 1GiB\n", 2, "devices[0].match", "matches no device"),
    ("devices:\n  - match: {index: 0}\n    budget: 100TiB\n", 3, "devices[0].budget", "more than the heap"),
    ("devices:\n  - match: {index: 0}\n    split: 2\n    budget: [60%, 60%]\n", 4, "devices[0].budget", "add up"),
])
def test_config_checked_against_devices(text, line, key, words):
    cfg = parse_config(text, "dev.yaml")
    with pytest.raises(ConfigError) as err:
        resolve_members(cfg, discover())
    msg = str(err.value)
    assert msg.startswith(f"dev.yaml:{line}: {key}:"), msg
    assert words in msg


def test_cli_reports_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  - match: {index: 0}\n    split: 0\n")
    res = subprocess.run([sys.executable, "-m", "vkpool", "--config", str(bad), "devices"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert f"{bad}:3: devices[0].split" in res.stderr


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_default_config_loads():
    cfg = load_config(None)
    assert cfg.host.enabled


def test_config_cost_overrides_the_planner_speeds_of_its_members():
    from vkpool.partition.cost import DEFAULT_COSTS, pool_member_cost
    cfg = parse_config("devices:\n  - match: {index: 0}\n    split: 2\n    cost:\n      flops_per_s: 1.5e12\n"
                       "      dispatch_s: 4.0e-6\nhost:\n  cost: {bytes_per_s: 3.0e9}\n", "cost.yaml")
    pool = vulkan_pool(cfg)
    try:
        for member in (pool.member("vk0.0"), pool.member("vk0.1")):
            cost = pool_member_cost(member)
            assert (cost.flops_per_s, cost.dispatch_s) == (1.5e12, 4.0e-6)
        host = pool_member_cost(pool.member("cpu"))
        assert host.bytes_per_s == 3.0e9
    finally:
        pool.close()
    assert DEFAULT_COSTS["vulkan"].flops_per_s != 1.5e12  # the override, not the default, was read


# -- the cache of parsed configs ------------------------------------------------------------------


def _config_entries(folder):
    return sorted((folder / "config").glob("*.json")) if (folder / "config").exists() else []


def test_parsed_config_is_cached_and_reads_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    first = parse_config(GOOD, "good.yaml")
    [entry] = _config_entries(tmp_path)
    again = parse_config(GOOD, "other.yaml")
    assert (again.devices, again.host, again.daemon) == (first.devices, first.host, first.daemon)
    assert again.where.lines == first.where.lines and again.path == "other.yaml"
    # an error found on the cached values names the same line as on freshly parsed ones
    bad = "devices:\n  - match: {index: 0}\n    split: 2\n    budget: [1MiB, 2MiB, 3MiB]\n"
    messages = []
    for _ in range(2):
        with pytest.raises(ConfigError) as err:
            parse_config(bad, "bad.yaml")
        messages.append(str(err.value))
    assert len(_config_entries(tmp_path)) == 2
    assert messages[0] == messages[1] and messages[0].startswith("bad.yaml:4: devices[0].budget:")
    # a damaged entry is parsed again and rewritten
    entry.write_text("{not json")
    assert parse_config(GOOD, "good.yaml").devices == first.devices
    assert entry.read_text().startswith("{\"data\"")


def test_config_values_json_cannot_hold_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    text = "daemon:\n  since: 2024-01-02\n  1: one\n"
    for _ in range(2):
        cfg = parse_config(text, "odd.yaml")
        assert set(cfg.daemon) == {"since", 1} and type(cfg.daemon["since"]).__name__ == "date"
    assert _config_entries(tmp_path) == []


def test_unchanged_config_does_not_import_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(GOOD)
    script = ("import sys; from vkpool.config.loader import load_config; load_config(sys.argv[1]); "
              "print('yaml' in sys.modules)")
    env = {**os.environ, "VKPOOL_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", script, str(config)], capture_output=True, text=True,
                           timeout=120, env=env, check=True).stdout.strip() for _ in range(2)]
    assert runs == ["True", "False"]


def test_lane_ring_bytes_is_a_size_within_its_bounds():
    from vkpool.daemon.settings import DaemonSettings, SettingsError

    assert DaemonSettings().lane_ring_bytes == 16 << 20
    assert DaemonSettings.from_dict({"lane_ring_bytes": "1MiB"}).lane_ring_bytes == 1 << 20
    for bad in ("1KiB", "2GiB", "lots", 0):
        with pytest.raises(SettingsError) as err:
            DaemonSettings.from_dict({"lane_ring_bytes": bad})
        assert str(err.value).startswith("daemon.lane_ring_bytes:"), str(err.value)
