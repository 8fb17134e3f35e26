"""vkpool's benchmark harness: the workloads of docs/benchmarks.md and the runners that time them."""
from __future__ import annotations
