"""GPU time of every dispatch of a model's recorded command buffer, from Vulkan timestamps.

Usage: python -m bench.gpu_profile MODEL.onnx [--device vk0] [--runs 5] [--top 15] [--shapes]

The model's own commands (the ones every run replays) are recorded once more with a timestamp
after each dispatch and run ``--runs`` times; each dispatch's share is the median over those
runs of the time since the previous timestamp, so the barrier in front of a dispatch counts
towards it. Prints the total, the time per shader and the costliest dispatches, next to the
host-measured latency of a normal run.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from bench.stats import median_run_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", help="member id (default: the first Vulkan member that fits)")
    ap.add_argument("--runs", type=int, default=5, help="profiled runs; each dispatch's median is shown")
    ap.add_argument("--top", type=int, default=15, help="how many of the costliest dispatches to list")
    ap.add_argument("--shapes", action="store_true",
                    help="beside each of the costliest: its product (M x N x K, tile) and TFLOP/s")
    args = ap.parse_args()
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    sess = Session(args.model, device=args.device)
    chunk = sess._chunk
    device = chunk.device
    feeds = random_inputs(sess.get_inputs())
    wall_us = median_run_s(lambda: sess.run(None, feeds), 100) * 1e6
    profiles = [device.profile(chunk.commands) for _ in range(args.runs)]
    per_dispatch = [statistics.median(p[i] for p in profiles) for i in range(len(chunk.dispatch_labels))]
    total = sum(per_dispatch)
    print(f"{args.model} on {sess.member.id} ({device.info.name}): {len(per_dispatch)} dispatches, "
          f"{chunk.stats.barriers} barriers")
    print(f"host-measured run: median {wall_us:.1f} µs; "
          f"GPU timestamps: first to last {total:.1f} µs, {total / max(1, len(per_dispatch)):.2f} µs per dispatch")
    by_shader: dict[str, list[float]] = defaultdict(list)
    for label, us in zip(chunk.dispatch_labels, per_dispatch):
        by_shader[label.rsplit("[", 1)[-1].rstrip("]")].append(us)
    print("\n| shader | dispatches | GPU µs | share |\n|---|---|---|---|")
    for shader, times in sorted(by_shader.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {shader} | {len(times)} | {sum(times):.1f} | {100 * sum(times) / max(total, 1e-9):.0f} % |")
    products = {f"{node.op_type} {node.name}": op for op, node in zip(chunk.ops, chunk.nodes)}
    head = " product | TFLOP/s |\n|---|---|---|---|" if args.shapes else "\n|---|---|"
    print("\n| costliest dispatches | GPU µs |" + head)
    ranked = sorted(zip(chunk.dispatch_labels, per_dispatch), key=lambda lt: -lt[1])
    winograd = {label.rsplit(" [", 1)[0] for label in chunk.dispatch_labels if label.endswith("[winograd]")}
    for label, us in ranked[: args.top]:
        op = label.rsplit(" [", 1)[0]
        transform = label.endswith("[winograd]")  # a transform of Winograd's, not its products
        shape = ""
        if args.shapes:
            shape = " | |" if transform else _product(products.get(op), us, op in winograd)
        print(f"| {label} | {us:.1f} |{shape}")
    sess.close()


def _product(op: object, us: float, winograd: bool = False) -> str:
    """`` M x N x K (tile) | TFLOP/s |`` of the product ``op`` runs (a convolution's Winograd
    products where it ran them, ``16 x`` in front, else its folded one where it has it), or
    empty cells."""
    plan = (getattr(op, "winograd", None) if winograd else None) or getattr(op, "folded", None) \
        or getattr(op, "plan", None)
    p = getattr(plan, "p", None)
    if p is None or getattr(plan, "kind", "") != "gemm":
        return " | |"
    tile = plan.tile
    name = f"{tile['BM']}x{tile['BN']}{'v' if tile.get('VEC4') else ''}"
    flops = 2 * p.M * p.N * p.K * p.batch_count
    batch = f"{p.batch_count} x " if p.batch_count > 1 else ""
    return f" {batch}{p.M} x {p.N} x {p.K} ({name}, {plan.splits} splits) | {flops / us / 1e6:.1f} |"


if __name__ == "__main__":
    main()
