"""A chain of dependent dispatches ordered by counters in memory instead of pipeline barriers.

Usage: python -m bench.dep_probe [--device vk0] [--lengths 100 1000] [--runs 50]

Builds a chain of N dependent one-element Adds (x + 1, N times: y = x + N) from the engine's
own ``binary.comp`` dispatches and records it two ways:

- ``barrier``: a compute-to-compute pipeline barrier between dispatches, as the engine does;
- ``counters``: no barrier; the shader built with ``DEP = 1`` (``kernels/shaders/dep_main.glsl``)
  has each dispatch wait until the one before has bumped its counter, then bump its own. The
  counters are zeroed by a fill dispatch and one barrier at the start of every run.

For each it checks y = x + N on a fresh x every run and prints the host-measured median of a
run and the slope per dispatch between the two lengths. Without barriers the driver may start later dispatches while earlier ones run; the
counters keep the order, and the dispatches before the one a dispatch waits for have all been
started by then.
"""
from __future__ import annotations

import argparse
import statistics
import struct
from typing import Any

import numpy as np

from bench.stats import median_run_s

NONE = 0xFFFFFFFF


def _chain(member: Any, n: int, dep: bool) -> tuple[list[tuple], Any, Any, list[Any]]:
    from vkpool.engine import TensorHandle, _address
    from vkpool.kernels.base import DispatchContext, TensorInfo, pack_push_constants
    from vkpool.kernels.ops.binary import broadcast_dispatch
    from vkpool.kernels.ops.fill import fill_value

    device = member.device
    caps = device.caps
    info = TensorInfo((1,), np.dtype(np.float32))
    x = member.alloc(4, host_visible=True, input=True)
    y = member.alloc(4, host_visible=True)
    one = member.alloc(4)
    member.upload(one, np.ones(1, np.float32))
    ping = member.alloc(8)
    counters = member.alloc(4 * n)
    allocs = [x, y, one, ping, counters]
    h = lambda a, off=0: TensorHandle(a, off, 4)  # noqa: E731
    ctx = DispatchContext([], [], None, caps, {})
    offset = device.push_constant_bytes - 24
    commands: list[tuple] = []
    if dep:
        for d in fill_value(TensorHandle(counters, 0, 4 * n), np.zeros(n, np.uint32), caps):
            commands.append(("dispatch", device.pipeline(d.shader, d.defines),
                             pack_push_constants(d.args, _address), d.groups))
        commands.append(("barrier",))
    for k in range(n):
        src = h(x) if k == 0 else h(ping, 4 * ((k - 1) % 2))
        dst = h(y) if k == n - 1 else h(ping, 4 * (k % 2))
        d = broadcast_dispatch(0, (src, info), (h(one), info), (dst, info), ctx)
        push = pack_push_constants(d.args, _address)
        defines = dict(d.defines)
        if dep:
            defines.update(DEP=1, DEP_OFFSET=offset)
            push = push.ljust(offset, b"\0") + struct.pack(
                "<QIII", counters.address, NONE if k == 0 else k - 1, 1, k)
        elif k:
            commands.append(("barrier",))
        commands.append(("dispatch", device.pipeline("binary", defines), push, d.groups))
    commands.append(("host_barrier",))
    return commands, x, y, allocs


def _time(member: Any, n: int, dep: bool, runs: int) -> float:
    """Host median µs of one run of the chain (GPU timestamps between dispatches would order
    them as a barrier does, so none are taken)."""
    device = member.device
    commands, x, y, allocs = _chain(member, n, dep)
    cmd = device.allocate_command_buffer()
    device.record(cmd, commands)
    sub = device.submission(cmd)
    xv, yv = x.view(np.float32), y.view(np.float32)
    rng = np.random.default_rng(0)
    bad = 0

    def run() -> None:
        nonlocal bad
        value = np.float32(rng.integers(0, 1000))
        xv[0] = value
        device.submit(sub)
        device.wait(sub)
        if yv[0] != value + np.float32(n):
            bad += 1

    try:
        host = median_run_s(run, runs) * 1e6
    finally:
        sub.release()
        for a in allocs:
            a.free()
    if bad:
        raise SystemExit(f"{'counters' if dep else 'barrier'} chain of {n}: {bad} wrong results")
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--lengths", type=int, nargs=2, default=[100, 1000])
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    from vkpool.pool import DevicePool

    pool = DevicePool.from_config(None)
    member = pool.member(args.device) if args.device else next(m for m in pool.members if m.kind == "vulkan")
    n0, n1 = args.lengths
    print(f"{member.device.info.name}, {args.runs} runs each; every run's result checked\n")
    print(f"| ordering | N={n0} µs | N={n1} µs | slope µs/op |")
    print("|---|---|---|---|")
    for dep in (False, True):
        t = {n: _time(member, n, dep, args.runs) for n in (n0, n1)}
        print(f"| {'counters' if dep else 'barrier'} | {t[n0]:.1f} | {t[n1]:.1f} | {(t[n1] - t[n0]) / (n1 - n0):.3f} |",
              flush=True)
    pool.close()


if __name__ == "__main__":
    main()
