"""vkpool: pool every Vulkan compute device on a workstation and run ONNX models on them."""
from __future__ import annotations

__version__ = "0.1.0"
