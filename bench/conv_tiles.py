"""Which ``gemm.comp`` tile a batched CNN's products should take: one model, several tile policies.

Usage: python -m bench.conv_tiles MODEL.onnx [...] [--policies planner 128x128:264 ...] [--runs 30]
       [--rounds 2] [--device vk0]

The planner (:func:`vkpool.kernels.ops.gemm.choose_tile`) picks its tiles for batch-1 shapes: few
tiles, so mostly 64 x 64 with the reduction split. A batch of images gives each convolution many
times the tiles, where larger tiles do more arithmetic per shared-memory load. Policies:

- ``planner``: the tree as it is;
- ``TILE:N``: every product (convolutions and plain products alike) whose ``TILE`` tiles number at
  least N takes ``TILE``, the rest are left to the planner;
- ``A>B`` (several, comma-separated): tile B wherever the planner takes A;
- ``scalar``: the planner's tiles, their stages read as scalars instead of vec4.

TILE, A and B are of :data:`CANDIDATES`. For each policy, in ``--rounds`` alternating rounds, the
model is loaded again and timed: the host median of ``--runs`` runs and the GPU time of one run
from two timestamps. Each policy's outputs are compared with the planner's (max relative
difference).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

from bench.stats import median_run_s
from vkpool.kernels.ops.gemm import TILES

#: tiles a policy may name (BM x BN outputs per workgroup, BK deep stages, TM x TN per invocation):
#: the planner's own, and two halves of its 128 x 128
CANDIDATES: dict[str, dict[str, int]] = {
    **TILES,
    "128x64": {**TILES["128x128"], "BN": 64, "TN": 4},
    "64x128": {**TILES["128x128"], "BM": 64, "TM": 4},
}
# variants of the 64 x 64 tile: BK of 8 or 32, 8 rows or 8 columns per invocation, or both
CANDIDATES.update({
    "64x64k8": {**TILES["64x64"], "BK": 8}, "64x64k32": {**TILES["64x64"], "BK": 32},
    "64x64m8": {**TILES["64x64"], "TM": 8}, "64x64n8": {**TILES["64x64"], "TN": 8},
    "64x64x8": {**TILES["64x64"], "TM": 8, "TN": 8},
})
# the 128 x 128 tile and its halves with 16-deep stages
CANDIDATES.update({f"{name}k16": {**CANDIDATES[name], "BK": 16} for name in ("128x128", "128x64", "64x128")})
# each with its stages read as scalars, where it reads them as vec4 (gemm.comp's VEC4)
CANDIDATES.update({f"{name}s": {**tile, "VEC4": 0}
                   for name, tile in list(CANDIDATES.items()) if tile.get("VEC4")})


def policy_choose(spec: str, planner: Any) -> Any:
    """A ``choose_tile`` for policy ``spec`` (see above) over the ``planner``'s."""
    from vkpool.kernels.ops import gemm

    if ">" in spec or spec == "scalar":  # tiles the planner takes swapped for others
        swaps = dict(pair.split(">", 1) for pair in spec.split(",")) if ">" in spec else \
            {name[:-1]: name for name in CANDIDATES if name.endswith("s") and name[:-1] in CANDIDATES}
        for now in swaps.values():
            if now not in CANDIDATES:
                raise SystemExit(f"unknown tile {now!r}; known: {', '.join(CANDIDATES)}")

        def swap(p: Any, workgroups: Any) -> str:
            chosen = planner(p, workgroups)
            now = swaps.get(chosen)
            if now is None:
                return chosen
            gemm.TILES.setdefault(now, CANDIDATES[now])
            return now

        return swap
    name, _, least = spec.partition(":")
    if name not in CANDIDATES:
        raise SystemExit(f"unknown tile {name!r}; known: {', '.join(CANDIDATES)}")
    gemm.TILES.setdefault(name, CANDIDATES[name])
    tile, least_groups = CANDIDATES[name], int(least or 1)

    def choose(p: Any, workgroups: Any) -> str:
        tiles = gemm.ceil_div(p.M, tile["BM"]) * gemm.ceil_div(p.N, tile["BN"]) * p.batch_count
        return name if tiles >= least_groups else planner(p, workgroups)

    return choose


def time_policy(model: str, spec: str, device: str | None, runs: int) -> tuple[float, float, np.ndarray]:
    """(host median ms, GPU ms of one run, first output) of ``model`` loaded under ``spec``."""
    from vkpool.cli import random_inputs
    from vkpool.kernels.ops import gemm
    from vkpool.session import Session

    planner = gemm.choose_tile
    if spec != "planner":
        gemm.choose_tile = policy_choose(spec, planner)
    try:
        sess = Session(model, device=device)
    finally:
        gemm.choose_tile = planner
    try:
        feeds = random_inputs(sess.get_inputs(), seed=0)
        out = sess.run(None, feeds)[0]
        host_ms = median_run_s(lambda: sess.run(None, feeds), runs, warmup=5) * 1e3
        chunk = sess._chunk
        gpu_us = [chunk.device.profile(chunk.commands, each=False)[0] for _ in range(5)]
        gpu_ms = statistics.median(gpu_us) / 1e3
        return host_ms, gpu_ms, out
    finally:
        sess.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--policies", nargs="+", default=["planner", "128x128:264"])
    ap.add_argument("--device", help="member id (default: the first Vulkan member that fits)")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for model in args.models:
        rows: dict[str, list[tuple[float, float]]] = {p: [] for p in args.policies}
        diff: dict[str, float] = {}
        ref: np.ndarray | None = None
        for _ in range(args.rounds):
            for spec in args.policies:
                host, gpu, out = time_policy(model, spec, args.device, args.runs)
                rows[spec].append((host, gpu))
                if spec == "planner":
                    ref = out
                if ref is not None:
                    scale = float(np.max(np.abs(ref))) or 1.0
                    diff[spec] = max(diff.get(spec, 0.0), float(np.max(np.abs(out - ref))) / scale)
        print(f"\n{model}\n\n| policy | host ms (each round) | GPU ms (each round) | max diff to planner |")
        print("|---|---|---|---|")
        for spec, got in rows.items():
            hosts, gpus = ", ".join(f"{h:.3f}" for h, _ in got), ", ".join(f"{g:.3f}" for _, g in got)
            print(f"| {spec} | {hosts} | {gpus} | {diff.get(spec, float('nan')):.1e} |")


if __name__ == "__main__":
    main()
