"""The runtimes the harness can time, by name, in the order the tables show them."""
from __future__ import annotations

from bench.runners.base import Runner, RunnerOptions, RunFn, Unavailable
from bench.runners.ncnn_rt import NcnnVulkan
from bench.runners.ort import OrtCpu, OrtCuda
from bench.runners.torch_rt import TorchCudaGraph, TorchEager
from bench.runners.vkpool_rt import VkpoolDaemon, VkpoolInProcess

RUNNERS: dict[str, type[Runner]] = {
    cls.name: cls
    for cls in (VkpoolInProcess, VkpoolDaemon, OrtCpu, OrtCuda, NcnnVulkan, TorchEager, TorchCudaGraph)
}

__all__ = ["RUNNERS", "Runner", "RunnerOptions", "RunFn", "Unavailable"]
