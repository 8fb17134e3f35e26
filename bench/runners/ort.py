"""ONNX Runtime, CPU and CUDA execution providers: the reference and the paper's CUDA baseline."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from bench.runners.base import Runner, RunFn, Unavailable, is_add_chain


class _OrtRunner(Runner):
    provider: ClassVar[str]

    def probe(self) -> str | None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise Unavailable(f"onnxruntime is not installed ({exc})") from exc
        if self.provider not in ort.get_available_providers():
            raise Unavailable(f"{self.provider} is not in this onnxruntime build "
                              f"(has {', '.join(ort.get_available_providers())})")
        return f"onnxruntime {ort.__version__}, {self.provider}"

    def load(self, model_path: Path, workload: str) -> RunFn:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if is_add_chain(workload):
            # The add chain measures per-op dispatch: no fusion, no elimination of Add(x, 0).
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(model_path), opts, providers=[self.provider])

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return session.run(None, feed)[0]

        return run


class OrtCpu(_OrtRunner):
    name = "ort_cpu"
    provider = "CPUExecutionProvider"


class OrtCuda(_OrtRunner):
    name = "ort_cuda"
    provider = "CUDAExecutionProvider"
