"""The five real architectures of bench/export_models.py, exported small, match onnxruntime CPU.

Same builders and exporter as the full-size models; only the sizes differ, so what the loader
and the kernels see (op kinds, attributes, folding chains) is what the full models give them.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from bench import export_models as em

#: max|vkpool - ort| / max|ort|, FP32
MAX_REL_ERR = 1e-4

SMALL: dict[str, dict[str, object]] = {
    "bert": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "seq": 16, "vocab": 100},
    "gpt2": {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 100},
    "resnet50": {"blocks": (1, 1, 1, 1), "width": 8, "image": 32, "classes": 10},
    "mobilenetv2": {"width_mult": 0.25, "image": 32, "classes": 10},
    "unet": {"levels": 4, "base": 4, "image": 32},
}

#: ops each exported graph must contain: the architecture's defining parts survived export
DEFINING_OPS: dict[str, set[str]] = {
    "bert": {"Gather", "LayerNormalization", "MatMul", "Softmax", "Erf"},
    "gpt2": {"Gather", "LayerNormalization", "MatMul", "Softmax", "Where", "Tanh"},
    "resnet50": {"Conv", "MaxPool", "Add", "Relu", "GlobalAveragePool", "Gemm"},
    "mobilenetv2": {"Conv", "Clip", "Add", "GlobalAveragePool", "Gemm"},
    "unet": {"Conv", "MaxPool", "ConvTranspose", "Concat", "Relu"},
}


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(SMALL))
def test_small_real_model_matches_onnxruntime(name: str, pool) -> None:
    from vkpool import Session

    built = em.build(name, **SMALL[name])
    data = em.to_onnx(built)
    model = onnx.load_from_string(data)
    assert model.opset_import[0].version >= 17
    ops = Counter(n.op_type for n in model.graph.node)
    assert DEFINING_OPS[name] <= set(ops), f"{name} exported without {DEFINING_OPS[name] - set(ops)}"
    if name == "unet":
        assert ops["ConvTranspose"] == ops["Concat"] == 4

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"]).run(None, built.inputs)[0]
    with torch.inference_mode():
        eager = built.module(*(torch.from_numpy(v) for v in built.inputs.values())).numpy()
    assert _rel_err(eager, ref) < MAX_REL_ERR  # the exported graph is the torch module

    member = pool.vulkan_members[0]
    with Session(data, pool=pool, device=member.id) as sess:
        assert [i.name for i in sess.get_inputs()] == list(built.inputs)
        (y,) = sess.run(None, built.inputs)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    err = _rel_err(y, ref)
    assert err < MAX_REL_ERR, f"{name}: max relative error {err:.3g} against onnxruntime"


def test_the_real_models_bench_times_vkpool_beside_onnxruntime(tmp_path, monkeypatch, capsys) -> None:
    """``python -m bench.real_models`` as docs/benchmarks.md runs it on lavapipe, with the models
    exported small (the full-size run takes minutes there)."""
    import functools
    import json

    from bench import real_models

    for name in ("resnet50", "bert"):
        monkeypatch.setitem(em.BUILDERS, name, functools.partial(em.BUILDERS[name], **SMALL[name]))
    out = tmp_path / "real.json"
    rc = real_models.main(["--models", "resnet50", "bert", "--runtimes", "vkpool", "ort_cpu", "--device", "vk0",
                           "--runs", "3", "--warmup", "1", "--models-dir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())
    for name in ("resnet50", "bert"):
        runtimes = results["models"][name]["runtimes"]
        assert set(runtimes) == {"vkpool", "ort_cpu"}
        for entry in runtimes.values():
            assert 0 < entry["p05_ms"] <= entry["median_ms"] <= entry["p95_ms"]
        assert runtimes["vkpool"]["max_rel_err"] <= real_models.MAX_REL_ERR
    table = capsys.readouterr().out
    assert table.count("\n| resnet50 |") + table.count("\n| bert |") == 2
