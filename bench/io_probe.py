"""What a model's outputs cost: computed in device memory and copied out, or written by the
last kernel straight into host memory (an A/B of ``vkpool.engine.STAGED_OUTPUT_BYTES``).

Usage: python -m bench.io_probe MODEL.onnx [MODEL.onnx ...] [--device vk0] [--runs 100]

Prints, for each model and choice, the host-measured median latency and the GPU time of the
recorded commands (timestamps after each dispatch).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device")
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    from bench.stats import median_run_s
    from vkpool import engine
    from vkpool.cli import random_inputs
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(None)
    staged_default = engine.STAGED_OUTPUT_BYTES
    member = pool.member(args.device) if args.device else next(m for m in pool.members if m.kind == "vulkan")
    print("| model | outputs | run median µs | GPU µs |\n|---|---|---|---|")
    for model in args.models:
        for staged in (False, True):
            engine.STAGED_OUTPUT_BYTES = staged_default if staged else 1 << 62
            sess = Session(model, pool=pool, device=member.id)
            feeds = random_inputs(sess.get_inputs())
            wall_us = median_run_s(lambda: sess.run(None, feeds), args.runs) * 1e6
            chunk = sess._chunk
            gpu = statistics.median(sum(chunk.device.profile(chunk.commands)) for _ in range(5))
            sess.close()
            out = "copied out" if staged else "written across the bus"
            print(f"| {Path(model).stem} | {out} | {wall_us:.1f} | {gpu:.1f} |", flush=True)
    engine.STAGED_OUTPUT_BYTES = staged_default
    pool.close()


if __name__ == "__main__":
    main()
