"""`make demo` end to end: `python -m vkpool.demo` starts a daemon, serves the shipped digit
classifier to 3 client processes, reports the accuracy and stops the daemon."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(180)

DATA = Path(__file__).resolve().parent.parent / "vkpool" / "demo_data"


def test_shipped_model_and_test_split() -> None:
    import onnx

    model = onnx.load(str(DATA / "digits.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x"]
    assert [o.name for o in model.graph.output] == ["logits"]
    test = np.load(DATA / "digits_test.npz")
    assert test["images"].dtype == np.uint8 and test["images"].shape[1:] == (8, 8)
    assert test["labels"].shape == (len(test["images"]),) and set(np.unique(test["labels"])) == set(range(10))


def test_demo_runs_end_to_end(pool) -> None:  # the pool fixture skips where there is no Vulkan device
    env = dict(os.environ)
    env.pop("VKPOOL_CONFIG", None)
    env.pop("VKPOOL_ENDPOINT", None)
    proc = subprocess.run([sys.executable, "-m", "vkpool.demo"], env=env, capture_output=True, text=True,
                          timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    match = re.search(r"^accuracy: (\d\.\d+) \((\d+)/(\d+) test digits, (\d+) clients answered\)$", out, re.M)
    assert match, out
    assert float(match.group(1)) >= 0.9
    assert int(match.group(4)) == 3
    for client in (1, 2, 3):  # every client finished its share and has a row in the results table
        assert re.search(rf"^\s+\[client {client}\]\s+(\d+)/\1 jobs answered$", out, re.M), out
        assert re.search(rf"^\s+{client}\s+\d+\s+\d+\s+\d+\s+\d\.\d+\s+[\d.]+ ms", out, re.M), out
    assert "Chunk 0: device=" in out  # the plan was printed, as `vkpool plan` prints it
    assert re.search(r"agrees on (\d+)/\1 predictions", out), out
    assert "stopped (exit status 0)" in out
