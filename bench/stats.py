"""Numbers of the protocol: latency summaries, the dispatch-overhead fit, the correctness gate."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

#: Correctness gate: elementwise |y - ref| <= RTOL * |ref| + ATOL_SCALE * max|ref|.
#: rtol 1e-4 is the paper's "consistent to six decimal places" for unit-scale values; the absolute
#: term follows the output's scale so that near-zero entries (logits, wide softmaxes) don't fail on
#: accumulation-order noise while a TF32 or FP16 path still does.
RTOL = 1e-4
ATOL_SCALE = 1e-5


@dataclass(frozen=True)
class LatencySummary:
    """Milliseconds over the timed runs (warm-up and first run already excluded)."""

    median_ms: float
    p05_ms: float
    p95_ms: float
    mean_ms: float
    runs: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def median_run_s(run: Callable[[], object], runs: int, warmup: int = 20) -> float:
    """Median wall time of ``run()`` in seconds over ``runs`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def spin(gap_s: float) -> float:
    """Polls the clock for ``gap_s`` (a caller's own work between runs, touching nothing);
    returns ``time.perf_counter()`` at its end."""
    clock = time.perf_counter
    until = clock() + gap_s
    while (now := clock()) < until:
        pass
    return now


def gpu_times_us(chunk: object, runs: int = 30) -> list[float]:
    """The GPU time of a Vulkan chunk's recorded commands (``chunk.commands`` on
    ``chunk.device``), in µs from a timestamp before the first command to one after the last,
    once per run: the commands recorded once more with the two timestamps and run ``runs`` times."""
    device, commands = chunk.device, chunk.commands  # type: ignore[attr-defined]
    return [device.profile(commands, each=False)[0] for _ in range(runs)]


def summarize(samples_ns: list[int] | np.ndarray) -> LatencySummary:
    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    if ms.size == 0:
        raise ValueError("no latency samples to summarize")
    p05, median, p95 = np.percentile(ms, [5, 50, 95])
    return LatencySummary(float(median), float(p05), float(p95), float(ms.mean()), int(ms.size))


@dataclass(frozen=True)
class DispatchFit:
    """L = C + S * N, least squares over the add-chain lengths N."""

    c_us: float
    s_us_per_op: float
    r2: float
    points: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def fit_dispatch(ns: list[int], latencies_ms: list[float]) -> DispatchFit:
    """Ordinary least squares of latency (ms) against chain length; returns C and S in µs.

    Needs two distinct N at least. Plain (unweighted) least squares, as the protocol says: the
    longest chains dominate S, which is what a per-op cost should describe.
    """
    n = np.asarray(ns, dtype=np.float64)
    lat_us = np.asarray(latencies_ms, dtype=np.float64) * 1e3
    if n.shape != lat_us.shape:
        raise ValueError(f"{n.size} chain lengths but {lat_us.size} latencies")
    if np.unique(n).size < 2:
        raise ValueError("the fit needs at least two distinct chain lengths")
    design = np.stack([np.ones_like(n), n], axis=1)
    (c, s), *_ = np.linalg.lstsq(design, lat_us, rcond=None)
    residual = lat_us - (c + s * n)
    total = lat_us - lat_us.mean()
    ss_tot = float(total @ total)
    r2 = 1.0 - float(residual @ residual) / ss_tot if ss_tot > 0 else 1.0
    return DispatchFit(float(c), float(s), r2, int(n.size))


@dataclass(frozen=True)
class GateResult:
    ok: bool
    max_abs_err: float
    max_rel_err: float
    reason: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def check_output(y: np.ndarray, ref: np.ndarray) -> GateResult:
    """Compare a runtime's output with the onnxruntime CPU reference (see RTOL, ATOL_SCALE)."""
    y = np.asarray(y)
    if y.size != ref.size:
        return GateResult(False, float("inf"), float("inf"), f"shape {y.shape} != reference {ref.shape}")
    y = y.reshape(ref.shape).astype(np.float64)
    ref64 = ref.astype(np.float64)
    if not np.all(np.isfinite(y)):
        return GateResult(False, float("inf"), float("inf"), "non-finite values in the output")
    err = np.abs(y - ref64)
    scale = float(np.abs(ref64).max()) if ref64.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    bad = err > RTOL * np.abs(ref64) + ATOL_SCALE * scale
    if np.any(bad):
        return GateResult(
            False, max_abs, max_rel,
            f"{int(bad.sum())}/{bad.size} values beyond rtol {RTOL:g} + {ATOL_SCALE:g}*max|ref|",
        )
    return GateResult(True, max_abs, max_rel, "")
