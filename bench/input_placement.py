"""Inputs in mapped device memory against inputs in host memory copied in, on the same device.

Usage: python -m bench.input_placement MODEL.onnx [MODEL.onnx ...] [--device vk0] [--runs 2000]
                                     [--staged-output-bytes N | --no-subgroup-reduce]

For each model it builds two sessions on the member: one as vkpool places inputs (in device
memory the host writes through a mapping, where the device has such memory), one with that
memory taken away (inputs in host memory; those a product reads are copied into device memory
by a dispatch first). The two are timed in alternating rounds (median of ``--runs`` each) and
their outputs compared. It prints the memory types the device offers first.

With ``--staged-output-bytes N`` the second session instead keeps vkpool's input placement and
copies out only outputs of at least N bytes (``vkpool.engine.STAGED_OUTPUT_BYTES``, whose
default the first session uses): the kernel producing a smaller output writes it to host memory
itself. With ``--no-subgroup-reduce`` it keeps both placements and builds its kernels as for a
device without subgroup arithmetic (reductions through shared memory only).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default=None)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--staged-output-bytes", type=int, default=None)
    ap.add_argument("--no-subgroup-reduce", action="store_true")
    args = ap.parse_args()
    import dataclasses

    from bench.stats import median_run_s
    from vkpool import engine
    from vkpool.cli import random_inputs
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(None)
    member = pool.member(args.device) if args.device else next(m for m in pool.members if m.kind == "vulkan")
    device = member.device
    props = device._ffi.new("VkPhysicalDeviceMemoryProperties*")
    device._lib.vkGetPhysicalDeviceMemoryProperties(device.info.handle, props)
    b = device._b
    flag_names = {b.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT: "device-local", b.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT: "host-visible",
                  b.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT: "coherent", b.VK_MEMORY_PROPERTY_HOST_CACHED_BIT: "cached"}
    for i in range(props.memoryTypeCount):
        t = props.memoryTypes[i]
        flags = ", ".join(n for bit, n in flag_names.items() if t.propertyFlags & bit) or "-"
        print(f"memory type {i}: heap {t.heapIndex}, {flags}")
    print(f"{member.id}: device memory {device.device_type}, inputs in type {device.mapped_device_type}, "
          f"host memory {device.host_type}\n")
    if args.staged_output_bytes is None and not args.no_subgroup_reduce and not member.device_local_inputs:
        print("the device has no mapped device memory: both sessions would be the same")
        return
    other = ("reductions through shared memory only" if args.no_subgroup_reduce
             else "host memory, copied in" if args.staged_output_bytes is None
             else f"outputs under {args.staged_output_bytes} B written by their kernel")
    print(f"| model | as placed (µs) | {other} (µs) | ratio | outputs equal |")
    print("|---|---|---|---|---|")
    kept, threshold, caps = member.inputs, engine.STAGED_OUTPUT_BYTES, device.caps
    for path in args.models:
        mapped = Session(path, pool=pool, device=member.id)
        if args.no_subgroup_reduce:
            device.caps = dataclasses.replace(caps, subgroup_arithmetic=False)
        elif args.staged_output_bytes is None:
            member.inputs = None
        else:
            engine.STAGED_OUTPUT_BYTES = args.staged_output_bytes
        try:
            staged = Session(path, pool=pool, device=member.id)
        finally:
            member.inputs, engine.STAGED_OUTPUT_BYTES, device.caps = kept, threshold, caps
        feeds = random_inputs(mapped.get_inputs())
        equal = all(np.array_equal(a, c) for a, c in zip(mapped.run(None, feeds), staged.run(None, feeds)))
        fast, slow = [], []
        for _ in range(args.rounds):
            fast.append(median_run_s(lambda: mapped.run(None, feeds), args.runs, warmup=200) * 1e6)
            slow.append(median_run_s(lambda: staged.run(None, feeds), args.runs, warmup=200) * 1e6)
        f, s = statistics.median(fast), statistics.median(slow)
        name = path.rsplit("/", 1)[-1].removesuffix(".onnx")
        print(f"| {name} | {f:.1f} | {s:.1f} | {f / s:.3f} | {equal} |", flush=True)
        mapped.close()
        staged.close()
    pool.close()


if __name__ == "__main__":
    main()
