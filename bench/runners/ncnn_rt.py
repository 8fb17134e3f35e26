"""ncnn with its Vulkan backend, FP32 paths only (the VKML paper's configuration)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.ncnn_export import INPUT_BLOB, OUTPUT_BLOB, ConversionError, convert, pnnx_executable, pnnx_version
from bench.runners.base import Runner, RunFn, Unavailable, is_add_chain

#: Off, as the paper set them, so that every path is FP32 (flags absent in a build are skipped).
_FP32_ONLY = (
    "use_fp16_packed", "use_fp16_storage", "use_fp16_arithmetic", "use_bf16_packed", "use_bf16_storage",
    "use_int8_inference", "use_sgemm_convolution", "use_cooperative_matrix",
)


class NcnnVulkan(Runner):
    name = "ncnn_vulkan"

    def probe(self) -> str | None:
        try:
            import ncnn
        except ImportError as exc:
            raise Unavailable(f"the ncnn wheel is not installed ({exc})") from exc
        if ncnn.get_gpu_count() < 1:
            raise Unavailable("ncnn sees no Vulkan device")
        try:
            pnnx_executable()
        except ConversionError as exc:
            raise Unavailable(str(exc)) from exc
        return (f"ncnn {ncnn.__version__}, models by pnnx {pnnx_version()}, "
                f"Vulkan device 0: {ncnn.get_gpu_info(0).device_name()}")

    def prepare(self, onnx_path: Path, workload: str) -> Path:
        param = onnx_path.with_suffix(".ncnn.param")
        weights = onnx_path.with_suffix(".ncnn.bin")
        if not (param.exists() and weights.exists() and param.stat().st_mtime >= onnx_path.stat().st_mtime):
            convert(onnx_path, param, weights, add_chain=is_add_chain(workload))
        return param

    def load(self, model_path: Path, workload: str) -> RunFn:
        import ncnn

        net = ncnn.Net()
        net.opt.use_vulkan_compute = True
        for flag in _FP32_ONLY:
            if hasattr(net.opt, flag):
                setattr(net.opt, flag, False)
        if net.load_param(str(model_path)) != 0:
            raise RuntimeError(f"ncnn could not read {model_path}")
        if net.load_model(str(model_path.with_suffix("").with_suffix(".ncnn.bin"))) != 0:
            raise RuntimeError(f"ncnn could not read the weights of {model_path}")

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            x = feed["x"]
            x = x[0] if x.ndim == 4 else x.reshape(-1)  # ncnn blobs have no batch axis
            extractor = net.create_extractor()
            # NOTE: ncnn 1.0.20261020 segfaults when an in-place first layer (ReLU, scalar BinaryOp)
            # writes into a Mat that wraps numpy memory; clone() gives ncnn its own copy.
            extractor.input(INPUT_BLOB, ncnn.Mat(np.ascontiguousarray(x)).clone())
            status, out = extractor.extract(OUTPUT_BLOB)
            if status != 0:
                raise RuntimeError(f"ncnn extract returned {status}")
            return np.array(out)

        run.net = net  # type: ignore[attr-defined]  # keeps the net alive with the closure
        return run
