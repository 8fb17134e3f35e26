"""The percentiles that status replies show, computed one way whether one process kept the samples
or a daemon's front merges several processes' (``vkpool.daemon.front``)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def latency_percentiles(latencies_s: Sequence[float]) -> dict[str, float]:
    """``{p50, p90, p99}`` in ms (to the µs) of latencies in seconds, each the sample at that rank;
    zeros without any."""
    lat = sorted(latencies_s)

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else 0.0

    return {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99)}


def delay_percentiles_us(delays_us: Any) -> tuple[float, float]:
    """p50 and p99 of queue delays in µs, interpolated between samples; zeros without any."""
    delays = np.asarray(delays_us, dtype=np.float64)
    if not delays.size:
        return 0.0, 0.0
    p50, p99 = np.percentile(delays, [50, 99]).tolist()
    return p50, p99
