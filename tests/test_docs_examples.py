"""Every example of README.md and docs/*.md runs as written, on this machine's Vulkan device.

The blocks are read from the Markdown, so the docs and the tests cannot drift. A fenced block's
language says what is done with it:

- ``sh``: run by bash (``set -e``), from a folder that stands for the repository root
  (``bench``, ``partition`` and ``.venv`` are links to this checkout's and to the environment
  running the tests), with one ``vkpool serve`` of the tests answering at ``$VKPOOL_ENDPOINT``;
- ``console``: each ``$ COMMAND`` run the same way, its output (stdout and stderr) compared with
  the lines under it: ``...`` alone on a line stands for any lines, within a line for any text;
  runs of spaces compare as one, and ``solved in N ms`` matches any time;
- ``python``: executed in that folder, in this process;
- ``yaml``: a config file, loaded and checked as ``vkpool --config FILE`` would, pool and daemon
  settings included;
- ``text`` and ``json``: output shown, not examples.

A block whose first line is ``# not run: REASON`` is not run; the reason is in the docs (a GPU
machine, a long benchmark, a command that stays in the foreground). The model files the examples
name are in that folder: ``mnist12_like.onnx`` and ``conv_many_255MB.onnx`` as
``python -m bench.workloads`` writes them, ``model.onnx`` (any model: a copy of mnist12_like),
``encoder.onnx`` (inputs with a symbolic batch dim and a dim named ``seq``), ``classifier.onnx``
(an image batch ``x[N, 3, 224, 224]`` to 10 scores) and ``topk.onnx``
(``tests/test_dynamic_shapes.py``'s TopK whose k is computed from an input).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from test_daemon_support import short_folder, spawn_daemon, wait_ready

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = ("sh", "console", "python", "yaml")
SHOWN = ("text", "json")
NOT_RUN = re.compile(r"#\s*not run: (\S.*)")
FENCE = re.compile(r"^(\s*)```(.*)$")
NEEDS_DAEMON = re.compile(r"--remote|vkpool (status|load|unload|budget|stop)\b|Client\(")
SOLVED = re.compile(r"solved in [0-9.]+ m?s")
ACTIVATE = ". .venv/bin/activate"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        first = self.text.lstrip("\n").split("\n", 1)[0]
        match = NOT_RUN.fullmatch(first.strip())
        return match.group(1) if match else None


def read_blocks(path: Path) -> list[Block]:
    blocks, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening:
            indent, lang, start = opening.group(1), opening.group(2).strip(), i
            i += 1
            body = []
            while not re.fullmatch(r"\s*```\s*", lines[i]):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [b for path in DOCS for b in read_blocks(path)]
EXAMPLES = [b for b in BLOCKS if b.lang in RUN and b.not_run is None]


def test_every_block_says_what_it_is_and_every_skipped_one_why() -> None:
    unlabelled = [b.id for b in BLOCKS if b.lang not in RUN + SHOWN]
    assert not unlabelled, f"fenced blocks need a language of {RUN + SHOWN}: {unlabelled}"
    assert all(b.not_run is None for b in BLOCKS if b.lang in SHOWN)
    assert len(EXAMPLES) >= 15  # the parser finds the blocks (README alone has six)


# -- the folder that stands for the repository root, and the daemon --------------------------------


class Daemon:
    """One ``vkpool serve`` for the examples; started when one needs it, again after one stops it."""

    def __init__(self, folder: Path) -> None:
        self.endpoint = f"ipc://{folder}/d.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None and not self.serving():
            self.proc.wait(60)  # an example stopped it: it is draining
        if self.proc is None or self.proc.poll() is not None:
            self.proc = spawn_daemon(self.endpoint)
            wait_ready(self.endpoint, self.proc)

    def serving(self) -> bool:
        from vkpool.daemon.client import Client

        try:
            with Client(self.endpoint, hello_timeout=2) as client:
                return not client.status()["draining"]
        except (ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


@pytest.fixture(scope="module")
def root() -> Iterator[tuple[Path, Daemon]]:
    with short_folder("vkdoc") as folder:
        work = folder / "repo"
        work.mkdir()
        for name in ("bench", "partition"):
            (work / name).symlink_to(REPO / name)
        (work / ".venv").symlink_to(Path(sys.prefix))
        write_models(work)
        daemon = Daemon(folder)
        try:
            yield work, daemon
        finally:
            daemon.stop()


def write_models(work: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from bench import workloads
    from test_dynamic_shapes import topk_model

    for name in ("mnist12_like", "conv_many_255MB"):
        onnx.save(workloads.build(name), work / f"{name}.onnx")
    shutil.copy(work / "mnist12_like.onnx", work / "model.onnx")
    onnx.save(topk_model(), work / "topk.onnx")
    w = numpy_helper.from_array(np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
              work / "encoder.onnx")
    w = numpy_helper.from_array(np.linspace(-1, 1, 3 * 10, dtype=np.float32).reshape(3, 10), "w")
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=0),
         helper.make_node("MatMul", ["m", "w"], ["y"])],
        "classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], [w, axes])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
              work / "classifier.onnx")


def shell_env(daemon: Daemon, activates: bool) -> dict[str, str]:
    """The environment of a shell example: the test's own, with the environment's ``bin`` first
    on PATH unless the example activates ``.venv`` itself (then that is what must find vkpool)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VKPOOL_CONFIG", "VIRTUAL_ENV")}
    if not activates:
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["VKPOOL_ENDPOINT"] = daemon.endpoint
    return env


def bash(script: str, work: Path, daemon: Daemon) -> subprocess.CompletedProcess[str]:
    env = shell_env(daemon, ACTIVATE in script)
    return subprocess.run(["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)


# -- console output ----------------------------------------------------------------------------------


def console_steps(text: str) -> list[tuple[str, str]]:
    """``[(command, expected output)]`` of a console block."""
    steps: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], ""))
        elif steps:
            steps[-1] = (steps[-1][0], steps[-1][1] + line + "\n")
    return steps


def _normal(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in SOLVED.sub("solved in T", text).strip("\n").splitlines()]
    return [line for line in lines if line]


def output_matches(want: str, got: str) -> bool:
    parts = []
    for line in _normal(want):
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    return re.fullmatch("".join(parts), "".join(line + "\n" for line in _normal(got))) is not None


def test_output_matching_is_strict_where_the_docs_are() -> None:
    want = "Plan: chunks=2 (1 KiB)\n  solved in 1.7 ms\n...\nMembers:\n  gpu0   50 KiB of ... (90%)\n"
    members = "Members:\ngpu0 50 KiB of 56 KiB"
    assert output_matches(want, f"Plan: chunks=2 (1 KiB)\nsolved in 9.25 ms\nx\ny\n{members} (90%)\n")
    assert not output_matches(want, f"Plan: chunks=4 (1 KiB)\nsolved in 1 ms\n{members} (90%)\n")
    assert not output_matches(want, f"Plan: chunks=2 (1 KiB)\nsolved in 1 ms\n{members} (91%)\n")


# -- the examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.id for b in EXAMPLES])
def test_example_runs_as_written(block: Block, root: tuple[Path, Daemon], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    work, daemon = root
    if NEEDS_DAEMON.search(block.text):
        daemon.ensure()
    if block.lang == "sh":
        if ACTIVATE in block.text and not (work / ".venv" / "bin" / "activate").exists():
            pytest.skip(f"the tests run outside a virtual environment ({sys.prefix}): no .venv/bin/activate")
        done = bash("set -e\n" + block.text, work, daemon)
        assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stdout[-4000:]}"
    elif block.lang == "console":
        for command, want in console_steps(block.text):
            done = bash(command, work, daemon)
            assert output_matches(want, done.stdout), f"{block.id}: `{command}` printed\n{done.stdout}"
            assert (done.returncode != 0) == ("vkpool: error:" in want), f"{command}: exit {done.returncode}"
    elif block.lang == "python":
        monkeypatch.chdir(work)
        monkeypatch.setenv("VKPOOL_ENDPOINT", daemon.endpoint)
        namespace: dict[str, Any] = {"__name__": "__docs__"}
        exec(compile(block.text, block.id, "exec"), namespace)
    else:
        from vkpool.daemon.main import load_settings
        from vkpool.pool import DevicePool

        config = tmp_path / "vkpool.yaml"
        config.write_text(block.text)
        load_settings(config)
        DevicePool.from_config(str(config)).close()
