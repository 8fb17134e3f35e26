"""Every flag of every ``vkpool`` command is honoured or refused with the reason, never ignored;
a check that fails exits non-zero. :data:`COVERED` names the test of each flag, and a test fails
when the parser has a flag that table does not name."""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import matmul_model
from test_daemon_support import batched_model, daemon_env, short_folder, spawn_daemon, wait_ready
from vkpool.cli import build_parser, main

pytestmark = pytest.mark.timeout(180)

SERVICE_TEST = "test_service.test_service_install_writes_the_unit_under_xdg_config_home"
#: (command, flag) -> the test that shows it honoured or refused (in this module unless prefixed)
COVERED: dict[tuple[str, str], str] = {
    ("vkpool", "--version"): "test_cli.test_version_and_help",
    ("vkpool", "--config"): "test_plan_devices_refuses_a_config_it_would_not_read",
    ("vkpool", "--debug"): "test_debug_shows_the_traceback",
    ("devices", "--json"): "test_cli.test_devices_json_with_split_config",
    ("ops", "--json"): "test_ops_json_is_the_registry",
    ("run", "--input"): "test_run_input_replaces_a_random_input",
    ("run", "--device"): "test_run_refuses_flags_it_cannot_honour",
    ("run", "--check"): "test_run_check_exits_1_past_its_tolerance",
    ("run", "--tolerance"): "test_run_check_exits_1_past_its_tolerance",
    ("run", "--repeat"): "test_negative_counts_are_refused",
    ("run", "--seed"): "test_run_input_replaces_a_random_input",
    ("run", "--remote"): "test_remote_run_checks_and_reports_like_a_local_run",
    ("run", "--endpoint"): "test_run_refuses_flags_it_cannot_honour",
    ("plan", "--budget"): "test_docs_examples (README's plan examples)",
    ("plan", "--devices"): "test_docs_examples (README's plan examples)",
    ("plan", "--objective"): "test_plan_remote_refuses_what_the_daemon_decides",
    ("plan", "--algorithm"): "test_plan_remote_refuses_what_the_daemon_decides",
    ("plan", "--format"): "test_plan_remote_refuses_what_the_daemon_decides",
    ("plan", "--batch"): "test_a_batch_the_model_cannot_bind_is_refused",
    ("plan", "--output"): "test_docs_examples (README's plan --format svg -o plan.svg)",
    ("plan", "--remote"): "test_plan_remote_refuses_what_the_daemon_decides",
    ("calibrate", "--member"): "test_partition_calibrate.test_calibrate_refuses_an_unknown_member",
    ("calibrate", "--quick"):
        "test_partition_calibrate.test_calibrate_quick_prints_every_figure_and_writes_nothing",
    ("calibrate", "--repeat"): "test_negative_counts_are_refused",
    ("calibrate", "--no-save"): "test_calibrate_no_save_writes_nothing",
    ("serve", "--config"): "test_the_daemon_commands_reach_the_endpoint_of_config",
    ("serve", "--endpoint"): "test_daemon_e2e (every test spawns `serve` at its own endpoint)",
    ("service install", "--config"): SERVICE_TEST,
    ("service install", "--print"): SERVICE_TEST,
    ("service install", "--dry-run"): "test_service (the same option as --print: one dest)",
    ("service install", "--force"): SERVICE_TEST,
    ("status", "--endpoint"): "test_remote_run_checks_and_reports_like_a_local_run",
    ("status", "--json"): "test_the_daemon_commands_reach_the_endpoint_of_config",
    ("load", "--keep-alive"): "test_load_binds_what_the_model_has_and_refuses_the_rest",
    ("load", "--batch"): "test_load_binds_what_the_model_has_and_refuses_the_rest",
    ("load", "--dim"): "test_load_binds_what_the_model_has_and_refuses_the_rest",
    ("load", "--endpoint"): "test_load_binds_what_the_model_has_and_refuses_the_rest",
    ("serve", "--detach"):
        "test_service.test_serve_detach_writes_pid_and_log_refuses_a_second_and_stop_waits",
    ("serve", "--pid-file"): "test_serve_pid_and_log_files_and_stop_by_pid_file",
    ("serve", "--log-file"): "test_serve_pid_and_log_files_and_stop_by_pid_file",
    ("stop", "--pid-file"): "test_serve_pid_and_log_files_and_stop_by_pid_file",
    ("stop", "--no-wait"): "test_serve_pid_and_log_files_and_stop_by_pid_file",
    ("stop", "--timeout"): "test_stop_refuses_a_timeout_it_would_not_wait",
    ("load", "--max-batch"): "test_daemon_batching.test_a_client_killed_while_its_requests_wait_in_a_batch",
    ("load", "--max-delay"): "test_negative_counts_are_refused",
    ("load", "--objective"): "test_daemon_objective.test_the_command_line_loads_for_throughput",
    ("devices", "--cluster"): "test_cluster.test_the_cluster_pool_lists_every_nodes_members",
    ("plan", "--cluster"): "test_cluster.test_vkpool_plan_cluster_is_what_a_cluster_session_runs",
    ("serve", "--cluster"): "test_cluster.test_serve_cluster_offers_the_cluster_to_a_daemon_client",
    ("unload", "--endpoint"): "test_docs_examples (docs/daemon.md's commands)",
    ("budget", "--endpoint"): "test_docs_examples (docs/daemon.md's commands)",
    ("stop", "--endpoint"): "test_docs_examples (docs/daemon.md's commands)",
}


def parser_flags() -> set[tuple[str, str]]:
    """(command, flag) of every flag of ``vkpool``, its commands and their actions
    (``service install``)."""
    flags: set[tuple[str, str]] = set()
    parsers = [("vkpool", build_parser())]
    while parsers:
        name, parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                prefix = "" if name == "vkpool" else name + " "
                parsers += [(prefix + sub, p) for sub, p in action.choices.items()]
            flags |= {(name, opt) for opt in action.option_strings
                      if opt.startswith("--") and opt != "--help"}
    return flags


def test_every_flag_of_every_command_has_its_test() -> None:
    assert parser_flags() == set(COVERED), "a flag without its test, or a test of a flag that is gone"
    for test in COVERED.values():
        if " " in test:  # a module's examples, not one test
            continue
        module, _, name = test.rpartition(".")
        where = importlib.import_module(module) if module else sys.modules[__name__]
        assert callable(getattr(where, name, None)), test


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``vkpool ARGV`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def model(tmp_path: Path) -> str:
    """A MatMul whose sums differ from onnxruntime's in the last bits (their order differs)."""
    path = tmp_path / "matmul.onnx"
    path.write_bytes(matmul_model(4, 256, 8, seed=1))
    return str(path)


def test_negative_counts_are_refused(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", model, "--repeat", "-5"], ["calibrate", "--repeat", "0"],
                 ["plan", model, "--batch", "0"], ["load", model, "--batch", "-1"],
                 ["run", model, "--check", "--tolerance", "-1"], ["load", model, "--max-batch", "0"],
                 ["stop", "--timeout", "0"]):
        code, _, err = run(argv, capsys)
        assert code == 2 and "expected" in err, (argv, err)
    code, _, err = run(["load", model, "--max-delay", "2ms"], capsys)
    assert code == 2 and "--max-delay needs --max-batch" in err


def test_stop_refuses_a_timeout_it_would_not_wait(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = "ipc:///nowhere/d.sock"
    code, out, err = run(["stop", "--no-wait", "--timeout", "5", "--endpoint", nowhere], capsys)
    assert code == 2 and "--no-wait returns without waiting" in err and out == ""


def test_serve_pid_and_log_files_and_stop_by_pid_file(tmp_path: Path) -> None:
    """Two daemons in the foreground with their own pid and log files: the first is stopped
    without waiting, the second through its pid file alone (nothing answers at the endpoint
    given to stop)."""
    cli = [sys.executable, "-m", "vkpool"]
    with short_folder("vkp") as folder:
        for n, stop in ((1, ["--no-wait"]), (2, ["--pid-file", str(folder / "2.pid")])):
            endpoint = f"ipc://{folder}/{n}.sock"
            pid_file, log_file = folder / f"{n}.pid", folder / f"{n}.log"
            proc = subprocess.Popen([*cli, "serve", "--endpoint", endpoint, "--pid-file", str(pid_file),
                                     "--log-file", str(log_file)], env=daemon_env(),
                                    stderr=subprocess.DEVNULL)
            try:
                wait_ready(endpoint, proc)
                assert int(pid_file.read_text().split()[0]) == proc.pid
                target = endpoint if n == 1 else f"ipc://{folder}/nobody.sock"
                done = subprocess.run([*cli, "stop", "--endpoint", target, *stop], env=daemon_env(),
                                      capture_output=True, text=True, timeout=90)
                assert done.returncode == 0, done.stderr
                if n == 1:
                    assert "daemon stopping" in done.stdout and f"(pid {proc.pid}) stopped" not in done.stdout
                else:
                    assert f"sent SIGTERM to pid {proc.pid}" in done.stdout
                    assert f"(pid {proc.pid}) stopped" in done.stdout
                assert proc.wait(60) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert log_file.read_text().strip() and not pid_file.exists()


def test_run_refuses_flags_it_cannot_honour(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {("--remote", "--device", "vk0"): "where the daemon's plan puts it",
             ("--endpoint", "ipc:///nowhere"): "--endpoint names the daemon of --remote",
             ("--tolerance", "0.1"): "--tolerance is the limit of --check"}
    for flags, why in cases.items():
        code, out, err = run(["run", model, *flags], capsys)
        assert code == 2 and why in err and "cannot be honoured" in err, (flags, err)
        assert out == ""  # refused before anything runs


def test_run_check_exits_1_past_its_tolerance(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["run", model, "--check"], capsys)
    assert code == 0, err
    assert "check y: max abs diff" in out and "DIFFERENT" not in out
    code, out, err = run(["run", model, "--check", "--tolerance", "1e-30"], capsys)
    assert code == 1 and "DIFFERENT (tolerance 1e-30)" in out
    assert "1 output(s) differ from onnxruntime: y" in err


def test_run_check_without_onnxruntime_is_refused_before_running(
        model: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as where it is not installed
    code, out, err = run(["run", model, "--check"], capsys)
    assert code == 1 and "pip install onnxruntime" in err and out == ""


def test_run_input_replaces_a_random_input(model: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    zeros = tmp_path / "x.npy"
    np.save(zeros, np.zeros((4, 256), np.float32))
    code, out, _ = run(["run", model, "--input", f"x={zeros}"], capsys)
    assert code == 0 and "checksum sum=0 abs=0" in out
    seeded = [run(["run", model, "--seed", str(seed)], capsys)[1].splitlines()[1] for seed in (1, 1, 2)]
    assert seeded[0] == seeded[1] != seeded[2]


def test_plan_devices_refuses_a_config_it_would_not_read(model: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.partition.cost import specs_dir

    monkeypatch.setenv("VKPOOL_CONFIG", "")  # main() sets it from --config; restored afterwards
    config = tmp_path / "vkpool.yaml"
    config.write_text("host:\n  budget: 1MiB\n")
    spec = str(specs_dir() / "2xh200.yaml")
    code, out, err = run(["--config", str(config), "plan", model, "--devices", spec], capsys)
    assert code == 2 and "the config's are not read" in err and out == ""
    code, out, err = run(["plan", model, "--devices", spec], capsys)
    assert code == 0 and "Plan: algorithm=dp" in out, err


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "absent.onnx")
    code, _, err = run(["run", missing], capsys)
    assert code == 1 and err.startswith("vkpool: error: cannot read")
    from vkpool.model import ModelError

    with pytest.raises(ModelError):
        main(["--debug", "run", missing])


def test_ops_json_is_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.kernels.registry import supported_ops

    code, out, _ = run(["ops", "--json"], capsys)
    assert code == 0 and json.loads(out) == supported_ops()


def test_calibrate_no_save_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    code, out, err = run(["calibrate", "--member", "cpu", "--quick", "--repeat", "2", "--no-save"], capsys)
    assert code == 0, err
    assert "GEMM" in out and "written" not in out and "wrote" not in out
    assert not (tmp_path / "calibration").exists()


def test_a_batch_the_model_cannot_bind_is_refused(model: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", model, "--batch", "8"], capsys)
    assert code == 1 and "batch=8: no input of the model has such a symbolic dim" in err
    batched = tmp_path / "batched.onnx"
    batched.write_bytes(batched_model())
    code, out, err = run(["plan", str(batched), "--batch", "8"], capsys)
    assert code == 1 and "'T'" in err  # T is named: only --dim binds it, and plan has none
    from vkpool.model import load_model

    assert load_model(str(batched), batch=8, dims={"T": 3}).inputs[0][1].shape == (8, 4, 3)


def test_a_closed_stdout_ends_the_command_quietly() -> None:
    """``vkpool devices | head -1``: the reader is gone before the command writes (the pipe is
    closed before the interpreter has started), so every write meets a closed pipe."""
    proc = subprocess.Popen([sys.executable, "-c", "from vkpool.cli import program; program()", "devices"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()


# -- through a daemon ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[str, Path]]:
    """(endpoint, config naming that endpoint) of a ``vkpool serve`` subprocess."""
    with short_folder("vkf") as folder:
        endpoint = f"ipc://{folder}/d.sock"
        config = folder / "vkpool.yaml"
        config.write_text(f"daemon:\n  endpoint: {endpoint}\n")
        proc = spawn_daemon(endpoint, config=config)
        try:
            wait_ready(endpoint, proc)
            yield endpoint, config
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0


def test_remote_run_checks_and_reports_like_a_local_run(daemon: tuple[str, Path], model: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, _ = daemon
    remote = ["run", model, "--remote", "--endpoint", endpoint, "--check"]
    code, out, err = run([*remote, "--repeat", "3"], capsys)
    assert code == 0, err
    assert "check y: max abs diff" in out and "latency over 3 runs" in out
    code, out, err = run([*remote, "--tolerance", "1e-30"], capsys)
    assert code == 1 and "DIFFERENT" in out
    code, out, _ = run(["status", "--endpoint", endpoint], capsys)
    assert code == 0 and "members:" in out


def test_plan_remote_refuses_what_the_daemon_decides(daemon: tuple[str, Path], model: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, _ = daemon
    for flags in (["--objective", "throughput"], ["--algorithm", "greedy"], ["--devices", "x.yaml"]):
        code, _, err = run(["plan", model, "--remote", endpoint, *flags], capsys)
        assert code == 1 and "drop " + flags[0] in err, err
    code, _, err = run(["plan", model, "--remote", endpoint, "--format", "svg"], capsys)
    assert code == 1 and "text or json" in err
    code, out, err = run(["plan", model, "--remote", endpoint, "--format", "json"], capsys)
    assert code == 0, err
    assert isinstance(json.loads(out), dict)


def test_load_binds_what_the_model_has_and_refuses_the_rest(
        daemon: tuple[str, Path], model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, _ = daemon
    code, _, err = run(["load", model, "--batch", "8", "--endpoint", endpoint], capsys)
    assert code == 1 and "batch=8: no input of the model has such a symbolic dim" in err
    code, _, err = run(["load", model, "--dim", "seq=128", "--endpoint", endpoint], capsys)
    assert code == 1 and "dims ['seq']" in err
    batched = tmp_path / "batched.onnx"
    batched.write_bytes(batched_model())
    code, out, err = run(["load", str(batched), "--batch", "8", "--dim", "T=5", "--keep-alive", "1h",
                          "--endpoint", endpoint], capsys)
    assert code == 0, err
    assert "x[8, 4, 5]" in out and "kept 3600 s once unused" in out


def test_the_daemon_commands_reach_the_endpoint_of_config(daemon: tuple[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, config = daemon
    monkeypatch.delenv("VKPOOL_ENDPOINT", raising=False)
    monkeypatch.setenv("VKPOOL_CONFIG", "")  # main() sets it from --config; restored afterwards
    code, out, err = run(["--config", str(config), "status", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["members"]
