"""torch on CUDA, eager and replayed as a CUDA graph, built from the ONNX model's own weights.

The module interprets the workload graph node by node (the eight ops the workloads use), so the
weights, the op order and the output are those of the ONNX file the other runtimes load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.runners.base import Runner, RunFn, Unavailable


def onnx_to_torch(model_path: Path, device: str) -> Any:
    """A ``torch.nn.Module`` evaluating the ONNX graph at ``model_path`` on ``device``."""
    import onnx
    import torch
    import torch.nn.functional as F
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node]
    shapes = {t.name: tuple(int(v) for v in numpy_helper.to_array(t)) for t in model.graph.initializer
              if t.data_type == onnx.TensorProto.INT64}

    def conv(a: dict[str, Any], x: Any, w: Any, b: Any = None) -> Any:
        pads = list(a.get("pads", [0, 0, 0, 0]))
        if pads[:2] != pads[2:]:
            raise Unavailable("the torch model builder has no asymmetric Conv padding")
        return F.conv2d(x, w, b, stride=tuple(a.get("strides", [1, 1])), padding=tuple(pads[:2]))

    def gemm(a: dict[str, Any], a_: Any, b: Any, c: Any = None) -> Any:
        if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
            raise Unavailable("the torch model builder has no Gemm with transA or alpha/beta != 1")
        y = a_ @ (b.T if a.get("transB", 0) else b)
        return y if c is None else y + c

    ops = {
        "Conv": conv,
        "Add": lambda a, x, y: x + y,
        "Relu": lambda a, x: torch.relu(x),
        "MaxPool": lambda a, x: F.max_pool2d(x, tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"]))),
        "MatMul": lambda a, x, y: x @ y,
        "Gemm": gemm,
        "Softmax": lambda a, x: torch.softmax(x, dim=a.get("axis", -1)),
    }

    class OnnxModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.consts: dict[str, Any] = {}
            for t in model.graph.initializer:
                if t.name not in shapes:
                    self.consts[t.name] = torch.from_numpy(numpy_helper.to_array(t).copy()).to(device)
            self.nodes = [(n.op_type, list(n.input), n.output[0], a) for n, a in zip(model.graph.node, attrs)]
            for op, *_ in self.nodes:
                if op not in ops and op != "Reshape":
                    raise Unavailable(f"op {op} has no torch equivalent in the torch model builder")

        def forward(self, x: Any) -> Any:
            env = dict(self.consts)
            env["x"] = x
            for op, inputs, output, a in self.nodes:
                if op == "Reshape":
                    env[output] = env[inputs[0]].reshape(shapes[inputs[1]])
                else:
                    env[output] = ops[op](a, *(env[i] for i in inputs))
            return env["y"]

    return OnnxModule().eval()


class _TorchCuda(Runner):
    def probe(self) -> str | None:
        try:
            import torch
        except ImportError as exc:
            raise Unavailable(f"torch is not installed ({exc})") from exc
        if not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        return f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"

    def _module(self, model_path: Path) -> Any:
        import torch

        # FP32 everywhere, as for the other runtimes: no TF32 in cuDNN convolutions or matmuls.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_grad_enabled(False)
        return onnx_to_torch(model_path, "cuda")


class TorchEager(_TorchCuda):
    name = "torch_eager"

    def load(self, model_path: Path, workload: str) -> RunFn:
        import torch

        module = self._module(model_path)

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                x = torch.from_numpy(feed["x"]).to("cuda")
                return module(x).cpu().numpy()  # .cpu() waits for the GPU

        return run


class TorchCudaGraph(_TorchCuda):
    name = "torch_cudagraph"

    def load(self, model_path: Path, workload: str) -> RunFn:
        import torch

        module = self._module(model_path)
        from bench.workloads import input_for

        static_in = torch.from_numpy(input_for(workload)["x"]).to("cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):  # warm-up outside capture, as torch's CUDA-graph notes require
                module(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            static_out = module(static_in)

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            static_in.copy_(torch.from_numpy(feed["x"]))
            graph.replay()
            return static_out.cpu().numpy()

        return run
