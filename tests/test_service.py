"""Running the daemon as a service: ``vkpool service install`` writes the shipped systemd user
unit, ``vkpool serve --detach`` starts a daemon that outlives the command (pid file, log file,
refused while one runs), ``vkpool stop`` waits for it to exit. systemctl is never called."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_daemon_support import add_model, daemon_env, short_folder
from vkpool.daemon import errors as E
from vkpool.daemon.client import Client
from vkpool.daemon.main import live_daemon

pytestmark = pytest.mark.timeout(120)


def vkpool(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vkpool", *args], capture_output=True, text=True,
                          env=env or daemon_env(), timeout=timeout)


def _unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def test_service_install_writes_the_unit_under_xdg_config_home(tmp_path: Path) -> None:
    env = {**daemon_env(), "XDG_CONFIG_HOME": str(tmp_path / "conf")}
    config = tmp_path / "vkpool.yaml"
    config.write_text("daemon: {queue_limit: 8}\n")
    unit_path = tmp_path / "conf" / "systemd" / "user" / "vkpool.service"

    printed = vkpool("service", "install", "--print", "--config", str(config), env=env)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines()[0] == f"# {unit_path}"
    assert not unit_path.exists(), "--print writes nothing"

    done = vkpool("service", "install", "--config", str(config), env=env)
    assert done.returncode == 0, done.stderr
    assert f"wrote {unit_path}" in done.stdout and "systemctl --user enable --now vkpool" in done.stdout
    unit = _unit(unit_path.read_text())
    assert unit["Service"]["ExecStart"] == f"{sys.executable} -m vkpool --config {config} serve"
    assert unit["Install"]["WantedBy"] == "default.target"
    assert unit_path.read_text() == "\n".join(printed.stdout.splitlines()[1:]) + "\n"
    # the command it names starts: its parser knows every argument
    check = subprocess.run([*unit["Service"]["ExecStart"].split()[:-1], "serve", "--help"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert check.returncode == 0 and "--detach" in check.stdout

    assert vkpool("service", "install", "--config", str(config), env=env).returncode == 0  # same unit again
    unit_path.write_text(unit_path.read_text().replace("RestartSec=2", "RestartSec=9"))
    refused = vkpool("service", "install", env=env)
    assert refused.returncode == 1 and "--force replaces it" in refused.stderr
    assert "RestartSec=9" in unit_path.read_text()
    assert vkpool("service", "install", "--force", env=env).returncode == 0
    assert "RestartSec=2" in unit_path.read_text()

    assert vkpool("service", "uninstall", env=env).returncode == 0
    assert not unit_path.exists()
    assert vkpool("service", "uninstall", env=env).returncode == 1


def test_serve_detach_writes_pid_and_log_refuses_a_second_and_stop_waits() -> None:
    with short_folder("vks") as folder:
        env = {**daemon_env(), "XDG_RUNTIME_DIR": str(folder), "XDG_STATE_HOME": str(folder / "state")}
        pid_file, log_file = folder / "vkpool" / "daemon.pid", folder / "state" / "vkpool" / "daemon.log"
        endpoint = f"ipc://{folder}/vkpool/daemon.sock"
        started = vkpool("serve", "--detach", env=env)
        try:
            assert started.returncode == 0, started.stderr
            assert f"pid file {pid_file}" in started.stdout and f"log file {log_file}" in started.stdout
            assert f"endpoint {endpoint}" in started.stdout
            pid = live_daemon(pid_file)
            assert pid is not None and f"pid {pid}," in started.stdout
            assert os.getsid(pid) == pid, "the daemon leads a session of its own"

            again = vkpool("serve", "--detach", env=env)
            assert again.returncode == 1 and f"(pid {pid}) is running per {pid_file}" in again.stderr
            foreground = vkpool("serve", "--pid-file", str(pid_file), env=env)
            assert foreground.returncode == 1 and f"(pid {pid})" in foreground.stderr

            model = folder / "add.onnx"
            model.write_bytes(add_model(4))
            with Client(endpoint) as client:
                session = client.session(str(model))
                with pytest.raises((E.InvalidTensor, ValueError)):
                    session.run(None, {"x": np.ones(5, np.float32)})
                session.close()
            stopped = vkpool("stop", env=env)
            assert stopped.returncode == 0, stopped.stderr
            assert f"daemon (pid {pid}) stopped" in stopped.stdout
            assert live_daemon(pid_file) is None and not pid_file.exists()
        finally:
            running = live_daemon(pid_file)
            if running is not None:
                os.kill(running, 15)
        log = log_file.read_text()
        assert "listening on " + endpoint in log and "stopped:" in log
        assert log.count("listening on") == 1, "each line once: stderr is the log file"
        warnings = [line for line in log.splitlines() if " WARNING " in line and "answered InvalidTensor" in line]
        assert len(warnings) == 1, log


def test_stop_without_a_daemon_ignores_stale_pid_files_and_signals_a_mute_one() -> None:
    with short_folder("vks") as folder:
        env = {**daemon_env(), "XDG_RUNTIME_DIR": str(folder)}
        pid_file = folder / "vkpool" / "daemon.pid"
        pid_file.parent.mkdir(mode=0o700)
        pid_file.write_text(f"{int(Path('/proc/sys/kernel/pid_max').read_text()) + 1}\n")  # no such process
        assert live_daemon(pid_file) is None
        other = subprocess.Popen(["sleep", "30"])  # alive, but not a vkpool daemon
        try:
            pid_file.write_text(f"{other.pid}\n")
            assert live_daemon(pid_file) is None
            stopped = vkpool("stop", env=env)
            assert stopped.returncode == 1 and "no vkpool daemon answers" in stopped.stderr
            assert other.poll() is None, "stop signals only a vkpool daemon"
        finally:
            other.kill()
            other.wait()
        # a vkpool process that does not answer at the endpoint is sent SIGTERM, and stop waits for it
        mute = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vkpool-stand-in"])
        try:
            pid_file.write_text(f"{mute.pid}\n")
            stopped = vkpool("stop", env=env)
            assert stopped.returncode == 0, stopped.stderr
            assert f"sent SIGTERM to pid {mute.pid} (from {pid_file})" in stopped.stdout
            assert f"daemon (pid {mute.pid}) stopped" in stopped.stdout
            assert mute.wait(10) == -15
        finally:
            mute.kill()
            mute.wait()


def test_a_detached_daemon_that_cannot_start_says_why() -> None:
    import socket

    with short_folder("vks") as folder, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = folder / "vkpool.yaml"
        config.write_text(f"daemon: {{metrics: '127.0.0.1:{taken.getsockname()[1]}'}}\n")
        env = {**daemon_env(), "XDG_RUNTIME_DIR": str(folder), "XDG_STATE_HOME": str(folder / "state")}
        failed = vkpool("--config", str(config), "serve", "--detach", env=env)
        assert failed.returncode == 1
        assert "the daemon did not start (exit status 1)" in failed.stderr
        assert "cannot serve metrics on 127.0.0.1:" in failed.stderr  # the end of its log
        assert not (folder / "vkpool" / "daemon.pid").exists()
