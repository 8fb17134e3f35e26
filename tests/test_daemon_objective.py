"""A model loaded into the daemon for throughput runs a whole copy on every member that holds one;
for latency (the default) on one member. On lavapipe split in two members; outputs against numpy."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Iterator

import numpy as np
import pytest

from conftest import vulkan_pool
from test_daemon_support import (InprocDaemon, assert_balanced, daemon_env, mlp_model, short_folder, spawn_daemon,
                                 wait_ready)
from vkpool.config.loader import parse_config
from vkpool.daemon import errors as E
from vkpool.daemon.cli import render_status
from vkpool.daemon.runtime import Runtime

RNG = np.random.default_rng(11)


def reference(x: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    """What :func:`mlp_model` computes, in float64."""
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((8, 16)), rng.standard_normal((1, 16))
    w2 = rng.standard_normal((16, 8))
    y = np.maximum(x.astype(np.float64) @ w1.astype(np.float32) + b1.astype(np.float32), 0) @ w2.astype(np.float32)
    return [y, 2 * y]


SPLIT = "devices:\n  - match: {index: 0}\n    split: 2\n    budget: 128MiB\nhost:\n  enabled: false\n"


@pytest.fixture(scope="module")
def daemon() -> Iterator[InprocDaemon]:
    pool = vulkan_pool(parse_config(SPLIT))
    d = InprocDaemon(Runtime(pool))
    yield d
    d.stop()
    pool.close()


def test_a_model_loaded_for_throughput_has_a_copy_on_each_member(daemon: InprocDaemon) -> None:
    data = mlp_model(seed=3)
    with daemon.client() as c:
        fast = c.load_model(data, name="latency", keep_alive=0)
        assert fast["objective"] == "latency" and len(fast["members"]) == 1, fast
        # one loaded copy, one plan: a client asking for the other objective is told so
        with pytest.raises(E.InvalidRequest, match="loaded already with objective latency"):
            c.load_model(data, objective="throughput")
        with pytest.raises(E.InvalidRequest, match="objective must be one of latency, throughput"):
            c.request("load_model", {"objective": "speed"}, [data])
        c.request("unload_model", {"model": fast["id"], "now": True})

        model = c.load_model(data, name="throughput", objective="throughput", keep_alive=0)
        assert model["objective"] == "throughput"
        assert sorted(model["members"]) == ["vk0.0", "vk0.1"], model
        listed = next(m for m in c.list_models() if m["id"] == model["id"])
        assert listed["objective"] == "throughput" and sorted(listed["members"]) == ["vk0.0", "vk0.1"]
        shown = render_status(c.status())
        assert "(for throughput)" in shown and "vk0.0" in shown and "vk0.1" in shown, shown
        plan = c.request("plan", {"model": model["id"]})[0]
        assert "vk0.0" in plan["text"] and "vk0.1" in plan["text"], plan["text"]

        session = c.session(data, objective="throughput")  # shares the loaded copy
        xs = [RNG.standard_normal((1, 8)).astype(np.float32) for _ in range(12)]
        got: dict[int, list[np.ndarray]] = {}

        def run(i: int) -> None:
            with daemon.client() as own:
                got[i] = own.session(data).run(None, {"x": xs[i]})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(got) == list(range(len(xs)))
        for i, x in enumerate(xs):
            for out, want in zip(got[i], reference(x, seed=3)):
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(session.run(None, {"x": xs[0]})[1], reference(xs[0], seed=3)[1],
                                   rtol=1e-4, atol=1e-5)
        session.close()
        assert_balanced(c)


def test_the_command_line_loads_for_throughput() -> None:
    cli = [sys.executable, "-m", "vkpool"]
    done = subprocess.run([*cli, "load", "m.onnx", "--objective", "speed"], env=daemon_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'speed'" in done.stderr, done.stderr
    with short_folder("vko") as folder:
        config = folder / "pool.yaml"
        config.write_text(SPLIT)
        model = folder / "m.onnx"
        model.write_bytes(mlp_model(seed=4))
        endpoint = f"ipc://{folder}/d.sock"
        proc = spawn_daemon(endpoint, config=config)
        try:
            wait_ready(endpoint, proc)
            load = subprocess.run([*cli, "load", str(model), "--objective", "throughput", "--endpoint", endpoint],
                                  env=daemon_env(), capture_output=True, text=True, timeout=120)
            assert load.returncode == 0 and "for throughput" in load.stdout, load.stdout + load.stderr
            assert "vk0.0" in load.stdout and "vk0.1" in load.stdout, load.stdout
            status = subprocess.run([*cli, "status", "--endpoint", endpoint], env=daemon_env(), capture_output=True,
                                    text=True, timeout=60)
            assert status.returncode == 0 and "(for throughput)" in status.stdout, status.stdout
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
