"""``python -m bench.fp16_policies MODEL.onnx ... [--policies NAME=SPEC ...]``: whole float16 models
under other product policies than the planner's, on the GPU, in one process.

A policy sets what ``kernels/ops/gemm_f16.py`` decides from constants: the smallest
cooperative-matrix tile (the one taken when larger tiles leave the device short of workgroups),
the tile split products run, the workgroups split-K aims at and the least K per split
(``split=off``: never split). ``SPEC`` is comma-separated ``tile=CoopTile name``,
``split_tile=CoopTile name``, ``target=N``, ``min_k=N``, ``split=off``, ``act_split=off`` (products
with a fused activation never split), ``attn_split=off`` (an attention's Q/K/V product never
split: the attention reads it in float16), ``staged_out=BYTES`` (outputs from this size are
computed in device memory and copied out, smaller ones written by their kernels into the
memory the host reads: ``vkpool.engine.STAGED_OUTPUT_BYTES``), ``matmul_split=off`` (MatMul and
Gemm nodes never split: only the products a LayerNormalization computes, which need no pass to
add their splits); an empty SPEC is the planner's own. Each model is loaded once per
policy, checked against the first policy's output (max|y - y0| / max|y0|, float16 rounding
differs between tile shapes), and timed (median of ``--runs`` after 20 warm-up runs), with the GPU
time of its commands (median of 30 runs, between a timestamp before the first and one after the
last: far steadier between calls than the host's time) and its dispatch count. ``--rounds N``
goes through the policies N times, in order, so that each is timed between the others. The
constants are set in this process only; nothing of vkpool is changed.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench.stats import gpu_times_us

DEFAULT_POLICIES = (
    "planner=",
    "t512=target=512",
    "narrow-split=split_tile=32x64x64_w1x2_p2_z8",
    "k512=min_k=512",
)


def apply(spec: str) -> dict[str, Any]:
    """Sets gemm_f16's constants for ``spec``; returns the previous values."""
    from vkpool.kernels.ops import gemm_f16

    saved = {k: getattr(gemm_f16, k) for k in ("COOP_TILES", "SPLIT_TILE", "_SPLIT_TARGET_GROUPS", "_SPLIT_MIN_K")}
    saved["split_k"] = gemm_f16.HalfMatmulPlan.__dict__["split_k"]
    from vkpool.kernels.ops import matmul

    saved["matmul"] = (matmul.HalfMatmulPlan, gemm_f16.HalfMatmulPlan)
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "tile":
            gemm_f16.COOP_TILES = (*saved["COOP_TILES"][:-1], gemm_f16.CoopTile.parse(value))
        elif key == "split_tile":
            gemm_f16.SPLIT_TILE = gemm_f16.CoopTile.parse(value)
        elif key == "attn_split" and value == "off":
            planner_plan = saved.setdefault("fused_product_plan", gemm_f16.fused_product_plan)

            def unsplit_attention(op: Any, *args: Any, plan: Any = planner_plan) -> Any:
                product = plan(op, *args)
                if op.op_type == "Attention":  # a norm's product (imported by norms.py) keeps its split
                    product.splits = 1
                return product
            gemm_f16.fused_product_plan = unsplit_attention
        elif key == "staged_out":
            from vkpool import engine

            saved.setdefault("STAGED_OUTPUT_BYTES", engine.STAGED_OUTPUT_BYTES)
            engine.STAGED_OUTPUT_BYTES = int(value)
        elif key == "target":
            gemm_f16._SPLIT_TARGET_GROUPS = int(value)
        elif key == "min_k":
            gemm_f16._SPLIT_MIN_K = int(value)
        elif key == "split" and value == "off":
            gemm_f16._SPLIT_MIN_K = 1 << 30
        elif key == "matmul_split" and value == "off":
            class Unsplit(gemm_f16.HalfMatmulPlan):
                split_k = staticmethod(lambda p: 1)
            matmul.HalfMatmulPlan = gemm_f16.HalfMatmulPlan = Unsplit  # Gemm imports it from gemm_f16 when run
        elif key == "act_split" and value == "off":
            planner_split = saved["split_k"].__func__
            gemm_f16.HalfMatmulPlan.split_k = staticmethod(lambda p, split=planner_split: 1 if p.act else split(p))
        else:
            raise SystemExit(f"unknown policy item {item!r}")
    return saved


def restore(saved: dict[str, Any]) -> None:
    from vkpool.kernels.ops import gemm_f16, matmul

    matmul.HalfMatmulPlan, gemm_f16.HalfMatmulPlan = saved.pop("matmul")
    if "STAGED_OUTPUT_BYTES" in saved:
        from vkpool import engine

        engine.STAGED_OUTPUT_BYTES = saved.pop("STAGED_OUTPUT_BYTES")
    for key, value in saved.items():
        setattr(gemm_f16.HalfMatmulPlan if key == "split_k" else gemm_f16, key, value)


def run(model: str, device: str | None, runs: int) -> tuple[float, float, int, np.ndarray]:
    """The median ``Session.run`` in ms, the median GPU time of the run's commands in µs (first
    command to last, from two timestamps), the dispatch count and the first output."""
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    with Session(model, device=device) as sess:
        rng_feeds = random_inputs(sess.get_inputs())
        feeds = {k: np.zeros_like(v) if v.dtype.kind in "iu" else v for k, v in rng_feeds.items()}
        out = sess.run(None, feeds)[0]
        for _ in range(20):
            sess.run(None, feeds)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        gpu = statistics.median(gpu_times_us(sess._chunk))
        return statistics.median(times) * 1e3, gpu, len(sess._chunk.dispatch_labels), out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="NAME=SPEC")
    ap.add_argument("--device", help="member id (default: the first Vulkan member that fits)")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1, help="times through the policies, in order (alternation)")
    args = ap.parse_args(argv)
    for model in args.models:
        print(f"\n{model}\n| policy | spec | ms, median | GPU µs, first command to last | dispatches "
              f"| max rel diff to the first |\n|---|---|---|---|---|---|")
        first = None
        for policy in args.policies * args.rounds:
            name, _, spec = policy.partition("=")
            saved = apply(spec)
            try:
                ms, gpu, count, out = run(model, args.device, args.runs)
            except Exception as exc:  # noqa: BLE001 - a policy the device rejects is reported, not fatal
                print(f"| {name} | {spec} | {type(exc).__name__}: {exc} | | | |", flush=True)
                continue
            finally:
                restore(saved)
            wide = out.astype(np.float64)
            first = wide if first is None else first
            diff = float(np.abs(wide - first).max() / np.abs(first).max())
            print(f"| {name} | {spec or 'the planner'} | {ms:.3f} | {gpu:.1f} | {count} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
