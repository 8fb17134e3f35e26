"""The plan shown is the plan run: ``vkpool plan`` (local and ``--remote``) shows the placement that
a Session and the daemon then run, over the paper's workloads (the small ones)."""
from __future__ import annotations

import json
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench import workloads
from conftest import vulkan_pool
from vkpool.cli import main

WORKLOADS = ["mnist12_like", "mlp", "conv_few_15MB", "add_chain_10"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vulkan_pool().close()
    folder = tmp_path_factory.mktemp("workloads")
    return {name: workloads.save(name, folder) for name in WORKLOADS}


def shown(*argv: str, tmp: Path) -> dict[str, Any]:
    """``vkpool plan ... --format json``, read back."""
    out = tmp / "plan.json"
    assert main(["plan", *argv, "--format", "json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def placement(plan: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """What decides where a model runs: op → member, and the chunks' members in order."""
    return {op["name"]: op["member"] for op in plan["ops"]}, [c["member"] for c in plan["chunks"]]


def runs_on(session: Any) -> set[str]:
    """The members the compiled session holds memory on."""
    return {m for m, n in session.memory_by_member().items() if n}


@pytest.mark.parametrize("name", WORKLOADS)
def test_vkpool_plan_is_what_a_session_runs(name: str, models: dict[str, Path], tmp_path: Path) -> None:
    from vkpool.partition.render import to_json_dict
    from vkpool.session import Session

    plan = shown(str(models[name]), tmp=tmp_path)
    with Session(models[name]) as session:
        assert placement(to_json_dict(session.placement)) == placement(plan)
        assert runs_on(session) == set(placement(plan)[1])
    assert plan["algorithm"] == "whole" and placement(plan)[1] == ["vk0"]  # the default pool holds each


@pytest.mark.parametrize(("name", "budget", "objective"), [
    ("conv_few_15MB", "10MiB", "latency"),   # vk0 cannot hold it whole: split with the host
    ("conv_few_15MB", "1KiB", "latency"),    # nothing fits on vk0: the host alone
    ("mlp", "64MiB", "throughput"),          # the objective is the planner's, not only --devices'
])
def test_vkpool_plan_with_a_budget_is_what_a_session_with_it_runs(
        name: str, budget: str, objective: str, models: dict[str, Path], tmp_path: Path) -> None:
    from vkpool.partition.render import to_json_dict
    from vkpool.session import Session

    plan = shown(str(models[name]), "--budget", f"vk0={budget}", "--objective", objective, tmp=tmp_path)
    with Session(models[name], budgets={"vk0": budget}, objective=objective) as session:
        assert placement(to_json_dict(session.placement)) == placement(plan)
        assert runs_on(session) == set(placement(plan)[1])
    if budget == "10MiB":
        assert placement(plan)[1] == ["vk0", "cpu"]


def test_vkpool_plan_remote_is_what_the_daemon_runs(models: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from test_daemon_support import spawn_daemon, wait_ready
    from vkpool.daemon.client import Client

    folder = Path(tempfile.mkdtemp(prefix="vkp", dir="/tmp"))  # ipc paths are limited to 107 bytes
    endpoint = f"ipc://{folder}/d.sock"
    daemon = spawn_daemon(endpoint)
    try:
        wait_ready(endpoint, daemon)
        with Client(endpoint) as client:
            for name in WORKLOADS:
                local = shown(str(models[name]), tmp=tmp_path)
                remote_session = client.session(str(models[name]))
                remote = shown(str(models[name]), "--remote", endpoint, tmp=tmp_path)
                assert placement(remote) == placement(local), name
                assert set(remote_session.info["members"]) == set(placement(remote)[1]), name
                # one format with and without --budget, as the local command prints it
                assert main(["plan", str(models[name]), "--remote", endpoint]) == 0
                text = capsys.readouterr().out
                assert main(["plan", str(models[name]), "--remote", endpoint, "--budget", "vk0=1GiB"]) == 0
                assert capsys.readouterr().out == text
                assert main(["plan", str(models[name])]) == 0
                assert capsys.readouterr().out.splitlines()[:4] == text.splitlines()[:4]
                remote_session.close()
                client.request("unload_model", {"model": remote_session.model_id, "now": True})

            # a budget the model still fits leaves it where it is, and the what-if says so
            conv = client.session(str(models["conv_few_15MB"]))
            what_if = shown(str(models["conv_few_15MB"]), "--remote", endpoint, "--budget", "vk0=64MiB", tmp=tmp_path)
            assert placement(what_if)[1] == ["vk0"]
            client.set_budget("vk0", 64 << 20)
            assert placement(shown(str(models["conv_few_15MB"]), "--remote", endpoint, tmp=tmp_path)) == \
                placement(what_if)
            # one it does not fit re-places it, as the what-if showed
            what_if = shown(str(models["conv_few_15MB"]), "--remote", endpoint, "--budget", "vk0=10MiB", tmp=tmp_path)
            assert placement(what_if)[1] == ["vk0", "cpu"]
            assert client.set_budget("vk0", 10 << 20)["replanned"] == [conv.model_id]
            after = shown(str(models["conv_few_15MB"]), "--remote", endpoint, tmp=tmp_path)
            assert placement(after) == placement(what_if)
            assert set(client.list_models()[0]["members"]) == {"vk0", "cpu"}
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        if daemon.stderr:
            daemon.stderr.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("faster", ["cpu", "vk0"])
def test_under_the_fastest_policy_the_plan_shown_is_run(faster: str, models: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With measured speeds (a calibration per member) the default placement follows them, and
    ``vkpool plan`` shows what the session then runs: the host member's onnxruntime session or vk0."""
    import dataclasses

    from vkpool.partition.cost import DEFAULT_COSTS, calibration_driver, calibration_key, save_calibration
    from vkpool.partition.render import to_json_dict
    from vkpool.session import Session

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VKPOOL_PLACEMENT", "fastest")
    p = vulkan_pool()
    try:
        for member in p.members:
            cost = dataclasses.replace(DEFAULT_COSTS["vulkan"], flops_per_s=1e13 if member.id == faster else 1e8)
            save_calibration(calibration_key(member), cost, driver=calibration_driver(member))
    finally:
        p.close()
    for name in WORKLOADS:
        plan = shown(str(models[name]), tmp=tmp_path)
        with Session(models[name]) as session:
            assert placement(to_json_dict(session.placement)) == placement(plan)
            assert runs_on(session) == set(placement(plan)[1]) == {faster}, name
