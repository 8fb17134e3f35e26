"""Where torch's float16 CUDA graph spends the GPU's time on a real model, kernel by kernel: the
peer beside which ``bench.gpu_profile`` reads vkpool's dispatches.

Usage: python -m bench.torch_kernels [bert gpt2 ...] [--runs 20] [--top 25]

Each model of ``bench.real_models`` (``bench/export_models.py``), in float16 as ``bench.real_models
--half`` times it, is captured as a CUDA graph and replayed ``--runs`` times under
``torch.profiler`` (CUDA activity). Prints per replay: the span from the first kernel's start to
the last one's end (the figure to set beside vkpool's "GPU, first command to last"), the kernels'
own time summed, and the kernels by name (count per replay, mean µs, total µs per replay).
Needs torch with CUDA.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any


def profile(name: str, runs: int, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench import export_models as em
    from bench import fp16_models
    from bench.real_models import capture_cudagraph

    built = em.build(name)
    fp16_models.half(built)
    _, graph, _, _ = capture_cudagraph(built)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            graph.replay()
            torch.cuda.synchronize()  # replays apart, so that each one's span is its own
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    kernels.sort(key=lambda e: e.time_range.start)
    # replays are apart in time: a gap of more than 50 µs starts the next one
    replays: list[list[Any]] = [[]]
    for e in kernels:
        if replays[-1] and e.time_range.start - replays[-1][-1].time_range.end > 50:
            replays.append([])
        replays[-1].append(e)
    spans = [r[-1].time_range.end - r[0].time_range.start for r in replays if r]
    own = [sum(e.time_range.end - e.time_range.start for e in r) for r in replays if r]
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
    n = len(replays)
    print(f"{name}: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, float16 CUDA graph; "
          f"{n} replays, {len(kernels) / max(1, n):.0f} kernels each")
    print(f"span, first kernel start to last end: median {statistics.median(spans):.1f} µs; "
          f"kernels' own time {statistics.median(own):.1f} µs")
    print("| kernel | per replay | mean µs | µs per replay |\n|---|---|---|---|")
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    for kname, times in rows[:top]:
        print(f"| {kname[:110]} | {len(times) / n:.0f} | {statistics.mean(times):.2f} | {sum(times) / n:.1f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["bert", "gpt2"])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for name in args.models:
        profile(name, args.runs, args.top)


if __name__ == "__main__":
    main()
