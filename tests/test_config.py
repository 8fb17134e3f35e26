"""Config loading: every kind of bad config is refused with file, line and key, never a traceback."""
from __future__ import annotations

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
