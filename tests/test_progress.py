"""Progress of long work: what a load reports (reading, uploading, building pipelines), how it is
drawn (a bar on a terminal, plain lines otherwise), silence by default, and a daemon's
``status`` listing a model while it loads."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import matmul_model
from test_daemon_support import short_folder, spawn_daemon, wait_ready
from vkpool import progress
from vkpool.daemon.cli import describe_loading, render_status
from vkpool.daemon.client import Client
from vkpool.session import Session

pytestmark = pytest.mark.timeout(120)


def _stages(updates: list[progress.Update]) -> dict[str, list[progress.Update]]:
    out: dict[str, list[progress.Update]] = {}
    for u in updates:
        out.setdefault(u.stage, []).append(u)
    return out


def test_a_load_reports_reading_uploading_and_building_each_to_its_end(pool, tmp_path: Path) -> None:
    path = tmp_path / "mm.onnx"
    path.write_bytes(matmul_model(4, 256, 192, seed=3))
    updates: list[progress.Update] = []
    with progress.reporting(updates.append):
        session = Session(path, pool=pool, device="vk0")
    try:
        stages = _stages(updates)
        assert {"load", "upload", "compile"} <= set(stages)
        for stage, seen in stages.items():
            last = seen[-1]
            assert last.finished and not last.failed, stage
            assert last.fraction == 1.0
            assert all(u.total is None or 0 <= u.done <= u.total for u in seen), stage
            assert [u.done for u in seen] == sorted(u.done for u in seen), f"{stage} went backwards"
        assert stages["load"][-1].what == "mm.onnx"
        upload = stages["upload"][-1]
        assert upload.unit == "B" and upload.what == "to vk0"
        assert upload.total == upload.done == session.stats.weight_bytes >= 256 * 192 * 4
        assert stages["compile"][-1].done == stages["compile"][-1].total >= 1
        x = np.ones((4, 256), np.float32)
        (y,) = session.run(None, {"x": x})
        assert y.shape == (4, 192)
    finally:
        session.close()


def test_a_library_load_is_silent_unless_asked(pool, capfd: pytest.CaptureFixture[str]) -> None:
    session = Session(matmul_model(2, 64, 64, seed=1), pool=pool, device="vk0")
    session.close()
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert isinstance(progress.task("upload", 10), type(progress.task("load")))  # the silent task
    with progress.reporting(lambda u: None):
        assert isinstance(progress.task("upload", 10), progress.Task)
        with progress.muted():
            assert not isinstance(progress.task("upload", 10), progress.Task)


def test_plain_lines_when_not_a_terminal_and_bars_on_one(pool) -> None:
    model = matmul_model(2, 128, 128, seed=2)
    plain = io.StringIO()
    with progress.reporting(progress.Console(plain, delay_s=0.0, every_s=0.0)):
        Session(model, pool=pool, device="vk0").close()
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert any(line.startswith("vkpool: uploading weights to vk0: ") and "%" in line for line in lines), lines
    assert "vkpool: uploading weights to vk0: done in" in plain.getvalue()
    assert any(line.startswith("vkpool: building pipelines for vk0: done in") for line in lines), lines

    drawn = io.StringIO()
    console = progress.Console(drawn, bars=True, delay_s=0.0)
    with progress.reporting(console):
        Session(model, pool=pool, device="vk0").close()
    assert console._bars == {}, "every bar is closed when its stage ends"
    text = drawn.getvalue()
    assert "uploading weights to vk0:" in text and "%|" in text and "\r" in text


def test_quiet_stages_print_nothing_and_a_failed_stage_is_not_done() -> None:
    out = io.StringIO()
    console = progress.Console(out, delay_s=3600.0)
    with progress.reporting(console):
        with progress.task("upload", 100, unit="B", what="to vk0") as task:
            task.advance(100)
    assert out.getvalue() == ""  # shorter than the delay

    seen: list[progress.Update] = []
    with pytest.raises(RuntimeError), progress.reporting(seen.append):
        with progress.task("compile", 3, what="for vk0"):
            progress.advance("compile")
            progress.advance("upload")  # not the open stage: ignored
            raise RuntimeError("glslang failed")
    assert [u.done for u in seen] == [0, 1, 1]
    assert seen[-1].failed and not seen[-1].finished and seen[-1].fraction == pytest.approx(1 / 3)


def _weights_model(path: Path, layers: int, side: int) -> None:
    """``layers`` Adds of ``side``² float weights: a file that takes a while to hash and upload."""
    names = ["x"] + [f"a{k}" for k in range(layers)]
    inits = [numpy_helper.from_array(np.full((side, side), k, np.float32), f"w{k}") for k in range(layers)]
    nodes = [helper.make_node("Add", [names[k], f"w{k}"], [names[k + 1]]) for k in range(layers)]
    graph = helper.make_graph(nodes, "weights", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [side, side])],
                              [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, [side, side])], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_status_lists_a_model_while_the_daemon_loads_it() -> None:
    with short_folder("vkp") as folder:
        endpoint = f"ipc://{folder}/d.sock"
        model = folder / "weights.onnx"
        _weights_model(model, layers=4, side=2048)  # 64 MiB of weights
        proc = spawn_daemon(endpoint)
        try:
            wait_ready(endpoint, proc)
            seen: list[dict] = []
            with Client(endpoint) as watcher, Client(endpoint) as loader:
                loaded = threading.Thread(target=loader.load_model, args=(str(model),))
                loaded.start()
                deadline = time.monotonic() + 60
                while loaded.is_alive() and time.monotonic() < deadline:
                    seen += [entry for entry in watcher.status()["loading"] if entry["path"] == str(model)]
                    time.sleep(0.005)
                loaded.join(60)
                after = watcher.status()
            assert seen, "the load was never listed as loading"
            assert all(entry["name"] == "weights.onnx" for entry in seen)
            for entry in seen:
                assert entry["stage"] in (None, *progress.STAGES)
                assert entry["fraction"] is None or 0.0 <= entry["fraction"] <= 1.0
                assert "weights.onnx" in render_status({**after, "loading": [entry]})
                assert describe_loading(entry)
            uploads = [e for e in seen if e["stage"] == "upload"]
            assert all(e["unit"] == "B" and e["total"] == 4 * 2048 * 2048 * 4 for e in uploads)
            assert after["loading"] == [] and [m["name"] for m in after["models"]] == ["weights.onnx"]
        finally:
            proc.terminate()
            assert proc.wait(60) == 0


class _ScriptedStatus:
    """Answers ``status`` with the next of some ``loading`` lists (a daemon sampled mid-load)."""

    def __init__(self, path: str, samples: list[tuple[str, int, int, str]]) -> None:
        self.replies = [[{"name": "m.onnx", "path": path, "elapsed_s": 2.0, "stage": stage, "what": "to vk0",
                          "done": done, "total": total, "unit": unit, "fraction": done / total}]
                        for stage, done, total, unit in samples]
        self.asked = 0

    def status(self) -> dict:
        self.asked += 1
        return {"loading": self.replies[min(self.asked, len(self.replies)) - 1]}


def test_vkpool_load_draws_the_daemons_load_as_it_samples_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from vkpool.daemon.cli import _watch_load

    model = tmp_path / "m.onnx"
    client = _ScriptedStatus(str(model), [("upload", 1 << 20, 4 << 20, "B"), ("upload", 3 << 20, 4 << 20, "B"),
                                          ("compile", 1, 2, "")])
    with _watch_load(client, str(model), every_s=0.01):
        deadline = time.monotonic() + 30
        while client.asked < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "vkpool: uploading weights to vk0: 25% (1 MiB of 4 MiB)"
    assert "vkpool: building pipelines to vk0: 50% (1 of 2)" in lines
    assert not any("done" in line for line in lines), "an end it did not see is not reported"
