"""What one dependent dispatch costs on this device, per way of ordering it after the one before.

Usage: python -m bench.barrier_probe [--device vk0] [--family K] [--lengths 100 1000] [--runs 50]
                                    [--models MODEL.onnx ...] [--rounds 3]

Takes the recorded commands of ``add_chain_N`` (one 1-element Add per dispatch, each reading the
one before) and records them again with each kind of synchronisation between the dispatches:

- ``compute``: a pipeline barrier between the compute stages, as the engine records one;
- ``all-commands``: the same barrier over every stage;
- ``execution``: the compute-to-compute barrier without its memory barrier (an execution
  dependency only: what the driver charges for ordering alone, not a correct recording);
- ``event``: a set/wait event pair with the same memory barrier instead of the pipeline barrier;
- ``state-first``: the engine's barrier, recorded after the next dispatch's pipeline bind and
  push constants instead of before them (whether the driver sets the next dispatch up while the
  one before still runs);
- ``none``: no synchronisation at all (wrong results; the floor of dispatching alone).

For each, the host-measured median of a run and the GPU time between a timestamp before the
first and after the last command; the slope per dispatch is the difference between the two
chain lengths divided by their difference in ops. ``--family K`` runs on queue family K instead
of the first compute family (the families are listed first). ``--models``: each model's own
recorded commands too, as ``compute`` and ``state-first`` in ``--rounds`` alternating rounds (GPU
medians; the chains are then left out).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np

from bench import workloads
from bench.stats import median_run_s

KINDS = ("compute", "all-commands", "execution", "event", "state-first", "none")


def _record(device: Any, cmd: Any, commands: list[tuple], kind: str, query_pool: Any, events: list[Any]) -> None:
    ffi, b, lib = device._ffi, device._b, device._lib
    compute = b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
    every = b.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
    mb, host_mb, _ = device.memory_barriers()  # the engine's barriers around copies and for the host
    begin = ffi.new("VkCommandBufferBeginInfo*", {"sType": b.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
    lib.vkBeginCommandBuffer(cmd, begin)
    lib.vkCmdResetQueryPool(cmd, query_pool, 0, 2)
    lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, query_pool, 0)
    for ev in events:
        lib.vkCmdResetEvent(cmd, ev, compute)
    bound, e, deferred = None, 0, False
    for c in commands:
        if c[0] == "dispatch":
            _, pipe, push, groups = c
            if pipe != bound:
                lib.vkCmdBindPipeline(cmd, b.VK_PIPELINE_BIND_POINT_COMPUTE, pipe)
                bound = pipe
            if push:
                lib.vkCmdPushConstants(cmd, device.layout, b.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push),
                                       ffi.from_buffer(push))
            if deferred:  # state-first: the barrier comes after the dispatch's state
                lib.vkCmdPipelineBarrier(cmd, compute, compute, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
                deferred = False
            lib.vkCmdDispatch(cmd, *groups)
        elif c[0] == "barrier":
            if kind == "state-first":
                deferred = True
            elif kind == "compute":
                lib.vkCmdPipelineBarrier(cmd, compute, compute, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
            elif kind == "execution":
                lib.vkCmdPipelineBarrier(cmd, compute, compute, 0, 0, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL)
            elif kind == "all-commands":
                lib.vkCmdPipelineBarrier(cmd, every, every, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
            elif kind == "event":
                ev = ffi.new("VkEvent[]", [events[e]])
                lib.vkCmdSetEvent(cmd, events[e], compute)
                lib.vkCmdWaitEvents(cmd, 1, ev, compute, compute, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
                e += 1
        elif c[0] == "host_barrier":
            lib.vkCmdPipelineBarrier(cmd, every, b.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, host_mb, 0, ffi.NULL, 0, ffi.NULL)
        else:
            raise SystemExit(f"the chain's commands hold a {c[0]!r}; this probe records dispatches and barriers only")
    lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, query_pool, 1)
    lib.vkEndCommandBuffer(cmd)


def _time(device: Any, commands: list[tuple], kind: str, runs: int) -> tuple[float, float]:
    """(host median µs, GPU median µs) of ``commands`` recorded with ``kind``."""
    from vkpool import vk

    ffi, b, lib = device._ffi, device._b, device._lib
    qinfo = ffi.new("VkQueryPoolCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                                               "queryType": b.VK_QUERY_TYPE_TIMESTAMP, "queryCount": 2})
    qp = ffi.new("VkQueryPool*")
    vk.call("vkCreateQueryPool", device.handle, qinfo, ffi.NULL, qp)
    events = []
    if kind == "event":
        einfo = ffi.new("VkEventCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_EVENT_CREATE_INFO})
        for _ in range(sum(c[0] == "barrier" for c in commands)):
            ev = ffi.new("VkEvent*")
            vk.call("vkCreateEvent", device.handle, einfo, ffi.NULL, ev)
            events.append(ev[0])
    cmd = device.allocate_command_buffer()
    sub = device.submission(cmd)
    _record(device, cmd, commands, kind, qp[0], events)
    props = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(device.info.handle, props)
    period_us = props.limits.timestampPeriod / 1000.0
    stamps = np.zeros(2, dtype=np.uint64)
    gpu: list[float] = []

    def run() -> None:
        device.submit(sub)
        device.wait(sub)
        lib.vkGetQueryPoolResults(device.handle, qp[0], 0, 2, stamps.nbytes, ffi.from_buffer(stamps), 8,
                                  b.VK_QUERY_RESULT_64_BIT | b.VK_QUERY_RESULT_WAIT_BIT)
        gpu.append(float(stamps[1] - stamps[0]) * period_us)

    host = median_run_s(run, runs) * 1e6
    sub.release()
    for ev in events:
        lib.vkDestroyEvent(device.handle, ev, ffi.NULL)
    lib.vkDestroyQueryPool(device.handle, qp[0], ffi.NULL)
    return host, statistics.median(gpu[-runs:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--family", type=int, default=None, help="queue family to run on (default: the first with compute)")
    ap.add_argument("--lengths", type=int, nargs=2, default=[100, 1000])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--models", nargs="*", default=[], help="models whose own commands are timed instead")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds for --models")
    args = ap.parse_args()
    from vkpool import device as device_module
    from vkpool import vk
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    if args.family is not None:
        device_module.choose_queue_family = lambda flags: args.family
    pool = DevicePool.from_config(None)
    member = pool.member(args.device) if args.device else next(m for m in pool.members if m.kind == "vulkan")
    if args.models:
        for path in args.models:
            with Session(path, pool=pool, device=member.id) as sess:
                device, commands = sess._chunk.device, sess._chunk.commands
                times: dict[str, list[float]] = {"compute": [], "state-first": []}
                for _ in range(args.rounds):
                    for kind in times:
                        times[kind].append(_time(device, commands, kind, args.runs)[1])
                print(f"{path} on {member.id} ({device.info.name}): {len(sess._chunk.dispatch_labels)} dispatches; "
                      "GPU µs, median of each round's runs: " + "; ".join(
                          f"{kind} {', '.join(f'{t:.1f}' for t in ts)}" for kind, ts in times.items()), flush=True)
        pool.close()
        return
    sessions = {n: Session(workloads.build(f"add_chain_{n}").SerializeToString(), pool=pool, device=member.id)
                for n in args.lengths}
    device = sessions[args.lengths[0]]._chunk.device
    ffi, lib, b = device._ffi, device._lib, vk.binding()
    count = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(device.info.handle, count, ffi.NULL)
    fams = ffi.new("VkQueueFamilyProperties[]", count[0])
    lib.vkGetPhysicalDeviceQueueFamilyProperties(device.info.handle, count, fams)
    names = {b.VK_QUEUE_GRAPHICS_BIT: "graphics", b.VK_QUEUE_COMPUTE_BIT: "compute", b.VK_QUEUE_TRANSFER_BIT: "transfer"}
    for i in range(count[0]):
        flags = "+".join(n for bit, n in names.items() if fams[i].queueFlags & bit) or "other"
        print(f"queue family {i}: {flags}, {fams[i].queueCount} queues" + (" (used)" if i == device.queue_family else ""))
    print(f"\n{device.info.name}, {args.runs} runs each\n")
    print("| synchronisation | " + " | ".join(f"N={n} host µs | N={n} GPU µs" for n in args.lengths)
          + " | slope host µs/op | slope GPU µs/op |")
    print("|---|" + "---|" * (2 * len(args.lengths) + 2))
    n0, n1 = args.lengths
    for kind in KINDS:
        t = {n: _time(device, sessions[n]._chunk.commands, kind, args.runs) for n in args.lengths}
        cells = " | ".join(f"{t[n][0]:.1f} | {t[n][1]:.1f}" for n in args.lengths)
        print(f"| {kind} | {cells} | {(t[n1][0] - t[n0][0]) / (n1 - n0):.3f} | "
              f"{(t[n1][1] - t[n0][1]) / (n1 - n0):.3f} |", flush=True)
    for s in sessions.values():
        s.close()
    pool.close()


if __name__ == "__main__":
    main()
