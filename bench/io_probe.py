"""Where a model's inputs and outputs live, and what it costs: an A/B of the engine's choices.

Usage: python -m bench.io_probe MODEL.onnx [MODEL.onnx ...] [--device vk0] [--runs 100]

For each model, four sessions in one process: inputs in host memory or in device memory the
host maps (where the device has such memory), and outputs written by the last kernel across the
bus or computed in device memory and copied out (``vkpool.engine.STAGED_OUTPUT_BYTES``). Prints
the host-measured median latency and the GPU time of the recorded commands for each.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device")
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    from vkpool import engine
    from vkpool.cli import random_inputs
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(None)
    staged_default = engine.STAGED_OUTPUT_BYTES
    for m in pool.members:
        if m.kind == "vulkan":
            d = m.device
            print(f"{m.id}: memory types {d.memory_flags}; device {d.device_type}, host {d.host_type}, "
                  f"inputs {d.upload_type}")
    print("| model | inputs in | outputs | run median µs | GPU µs |\n|---|---|---|---|---|")
    for model in args.models:
        for inputs_on_device in (False, True):
            for staged in (False, True):
                engine.STAGED_OUTPUT_BYTES = staged_default if staged else 1 << 62
                member = pool.member(args.device) if args.device else next(
                    m for m in pool.members if m.kind == "vulkan")
                saved = member.inputs
                if not inputs_on_device:
                    member.inputs = member.io
                try:
                    sess = Session(model, pool=pool, device=member.id)
                    feeds = random_inputs(sess.get_inputs())
                    for _ in range(20):
                        sess.run(None, feeds)
                    walls = []
                    for _ in range(args.runs):
                        t0 = time.perf_counter()
                        sess.run(None, feeds)
                        walls.append((time.perf_counter() - t0) * 1e6)
                    chunk = sess._chunk
                    gpu = statistics.median(sum(chunk.device.profile(chunk.commands)) for _ in range(5))
                    sess.close()
                finally:
                    member.inputs = saved
                where = "device memory" if inputs_on_device and saved is not member.io else "host memory"
                out = "copied out" if staged else "written across the bus"
                print(f"| {Path(model).stem} | {where} | {out} | {statistics.median(walls):.1f} | {gpu:.1f} |",
                      flush=True)
    engine.STAGED_OUTPUT_BYTES = staged_default
    pool.close()


if __name__ == "__main__":
    main()
