"""Budgets hold across processes: one ledger per machine (vkpool.ledger), real processes holding
real lavapipe allocations."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import vulkan_pool
from vkpool.ledger import machine_ledger, process_start
from vkpool.memory import DeviceOutOfMemory

MiB = 1 << 20
CONFIG = "devices:\n  - match: {name: 'llvmpipe*'}\n    budget: 32MiB\nhost:\n  budget: 32MiB\n"
#: a process holding ``argv[2]`` bytes of vk0 (or saying it was refused) until its stdin closes;
#: with ``argv[3]``, it allocates only once that file exists
HOLDER = """
import os, sys, time
from vkpool.pool import DevicePool
pool = DevicePool.from_config(sys.argv[1])
go = sys.argv[3] if len(sys.argv) > 3 else None
print("up", flush=True)
deadline = time.monotonic() + 60
while go and not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.005)
try:
    held = pool.member("vk0").alloc(int(sys.argv[2]))
    print("held", flush=True)
except MemoryError as exc:
    print("refused", exc, flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "vkpool.yaml"
    path.write_text(CONFIG)
    return path


def holder(config: Path, nbytes: int, go: Path | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", HOLDER, str(config), str(nbytes)] + ([str(go)] if go else [])
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen[str]) -> str:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise AssertionError(f"holder exited {proc.wait(10)}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
    return line.strip()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream:
            stream.close()


def test_another_process_holding_memory_counts_against_the_budget_here(config: Path) -> None:
    pool = vulkan_pool(config)
    other = holder(config, 20 * MiB)
    try:
        assert said(other) == "up" and said(other) == "held"
        vk0 = pool.member("vk0")
        assert vk0.used_bytes == 20 * MiB and vk0.budget.free_bytes == 12 * MiB
        [held] = vk0.budget.holders()
        assert (held.pid, held.nbytes, held.member) == (other.pid, 20 * MiB, "vk0")
        with pytest.raises(DeviceOutOfMemory) as refused:
            vk0.alloc(16 * MiB)
        assert f"pid {other.pid}" in str(refused.value) and "counting every vkpool process" in str(refused.value)
        mine = vk0.alloc(10 * MiB)  # what is left is this process's to take
        assert vk0.used_bytes == 30 * MiB and vk0.budget.used_bytes == 10 * MiB
        with pytest.raises(ValueError, match=f"pid {other.pid}"):
            pool.set_budget("vk0", 24 * MiB)  # below what the two processes hold together
        # a process that dies gives its share back: no stale entry, even before its parent reaps it
        other.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process_start(other.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [h.pid for h in vk0.budget.holders()] == [os.getpid()] and vk0.used_bytes == 10 * MiB
        more = vk0.alloc(20 * MiB)
        more.free()
        mine.free()
        assert vk0.used_bytes == 0 and vk0.budget.holders() == []
    finally:
        stop(other)
        pool.close()


def test_two_processes_asking_at_once_cannot_both_pass_the_budget(config: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [holder(config, 20 * MiB, go) for _ in range(2)]
    try:
        assert [said(p) for p in procs] == ["up", "up"]
        go.touch()
        answers = sorted(said(p).split()[0] for p in procs)
        assert answers == ["held", "refused"]
        assert machine_ledger().used_bytes(machine_ledger().holders()[0].key) == 20 * MiB
    finally:
        for p in procs:
            stop(p)


def test_vkpool_devices_shows_what_each_process_holds(config: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from vkpool.cli import main

    vulkan_pool(config).close()
    monkeypatch.setenv("VKPOOL_CONFIG", str(config))  # as --config would, undone after the test
    other = holder(config, 20 * MiB)
    try:
        assert said(other) == "up" and said(other) == "held"
        assert main(["devices"]) == 0
        out = capsys.readouterr().out
        vk0_row = next(line for line in out.splitlines() if line.startswith("vk0 "))
        assert vk0_row.split()[-2:] == ["20", "MiB"]  # USED counts the other process
        holders = out.split("Held by processes on this machine:")[1].splitlines()
        assert any(line.split()[:2] == ["vk0", str(other.pid)] and line.endswith("20 MiB") for line in holders)
        assert main(["devices", "--json"]) == 0
        vk0 = json.loads(capsys.readouterr().out)["members"][0]
        assert vk0["used_bytes"] == 20 * MiB
        assert [(h["pid"], h["bytes"]) for h in vk0["holders"]] == [(other.pid, 20 * MiB)]
    finally:
        stop(other)
    assert main(["devices"]) == 0
    assert "No vkpool process holds memory." in capsys.readouterr().out


def test_a_record_of_a_dead_or_reused_pid_is_dropped_when_read(own_ledger: str) -> None:
    ledger = machine_ledger()
    key = "0000-test/0of1"
    ledger.reserve(key, "vk0", 5, 100)
    folder = Path(own_ledger, "ledger")
    me = f"{os.getpid()}-{process_start(os.getpid())}.json"
    assert sorted(p.name for p in folder.glob("*.json")) == [me]
    held = json.dumps({"command": "gone", "members": {key: {"member": "vk0", "bytes": 90}}})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = [folder / f"{dead.pid}-{process_start(os.getpid())}.json",  # exited
             folder / f"{os.getppid()}-1.json"]                          # a live pid started at another time
    for path in stale:
        path.write_text(held)
    assert [h.pid for h in ledger.holders(key)] == [os.getpid()]
    ledger.reserve(key, "vk0", 90, 100)  # the stale 180 bytes do not count, and their files go
    assert not any(path.exists() for path in stale)
    ledger.release(key, 95)
    assert ledger.holders(key) == [] and list(folder.glob("*.json")) == []


def test_a_forked_child_holds_nothing_of_its_parents(own_ledger: str) -> None:
    ledger = machine_ledger()
    key = "0000-test/0of1"
    ledger.reserve(key, "vk0", 5, 100)
    pid = os.fork()
    if pid == 0:  # the child: ledger code only, then out
        code = 1
        try:
            ledger.release(key, 5)  # freeing an inherited allocation leaves the parent's bytes alone
            fresh = machine_ledger()
            fresh.reserve(key, "vk0", 95, 100)  # with the parent's 5 the budget is full
            try:
                fresh.reserve(key, "vk0", 1, 100)
            except MemoryError:
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    assert [(h.pid, h.nbytes) for h in ledger.holders(key)] == [(os.getpid(), 5)]  # the child's 95 left with it
    ledger.release(key, 5)


def test_an_unusable_ledger_folder_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VKPOOL_LEDGER_DIR", str(blocker / "below"))
    with pytest.raises(RuntimeError, match="VKPOOL_LEDGER_DIR"):
        machine_ledger().holders()


def test_the_daemon_and_a_session_here_share_one_budget(config: Path, tmp_path: Path) -> None:
    """The case that went wrong: a daemon holds most of vk0's budget; a session in another
    process must not put a second model's worth on vk0."""
    import tempfile

    from test_daemon_support import spawn_daemon, wait_ready
    from vkpool.daemon.client import Client
    from vkpool.session import Session
    from conftest import matmul_model

    models = [tmp_path / f"m{seed}.onnx" for seed in (1, 2)]
    for seed, path in enumerate(models, 1):
        path.write_bytes(matmul_model(1, 1024, 3072, seed=seed))  # a 12 MiB weight
    vulkan_pool(config).close()
    folder = Path(tempfile.mkdtemp(prefix="vkp", dir="/tmp"))  # ipc paths are limited to 107 bytes
    endpoint = f"ipc://{folder}/d.sock"
    daemon = spawn_daemon(endpoint, config=config)
    try:
        wait_ready(endpoint, daemon)
        with Client(endpoint) as client:
            for path in models:  # 24 MiB of vk0's 32 held
                assert client.session(str(path)).info["members"] == ["vk0"]
            with Session(str(models[0]), config=str(config)) as session:
                assert session.member.id != "vk0" and "vk0" not in session.memory_by_member()
                placed = {c.member for c in session.placement.chunks}
                assert placed == {"cpu"}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and {h.pid for h in machine_ledger().holders()} != {daemon.pid}:
                time.sleep(0.05)
            assert {h.pid for h in machine_ledger().holders()} == {daemon.pid}
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        if daemon.stderr:
            daemon.stderr.close()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    assert machine_ledger().holders() == []
