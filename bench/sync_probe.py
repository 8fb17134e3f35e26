"""What a run's submission and the host's look at its end cost, per way of learning that it ended.

Usage: python -m bench.sync_probe MODEL.onnx [--device vk0] [--runs 300] [--gaps-us 0 30 100]

Loads MODEL in a ``vkpool.Session`` on one member and records its commands (those every run
replays) into two more command buffers, and an empty one (a host barrier alone) twice; then, in
alternating blocks of runs, times each of them submitted and waited for in two ways, and the
run's own recording as a run submits and waits for it (with and without its inputs written):

- ``fence``: as the engine does, a fence in the submission, polled with ``vkGetFenceStatus``
  and reset after;
- ``timeline``: no fence; the submission signals the next value of a timeline semaphore, polled
  with ``vkGetSemaphoreCounterValue`` (nothing to reset).

Prints the medians (µs) of the ``vkQueueSubmit`` call, of the polling until the end is seen, of
the reset, and of the whole, and the GPU time of the model's commands (two timestamps). Each
``--gaps-us`` value is a table: the host waits that long (polling the clock) between a run's
end and the next submit, as a caller's own work between runs would. Last, the cost of one look
at a run that has ended (``vkGetFenceStatus`` against ``vkGetSemaphoreCounterValue``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench.stats import gpu_times_us, spin


class _Timed:
    """A way of running and waiting, with its times per part (µs, one entry per run)."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {"submit": [], "poll": [], "reset": [], "whole": []}

    def record(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """A run submitted from ``t0`` to ``t1``, seen ended at ``t2``, reset by ``t3``."""
        for key, v in zip(("submit", "poll", "reset", "whole"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            self.spent[key].append(v * 1e6)


class _Engine(_Timed):
    """The chunk's own submission, submitted and waited for as a run does (``LogicalDevice.submit``
    and ``wait``, the fence's reset inside the wait), with the run's inputs written first when
    ``feeds`` are given."""

    def __init__(self, chunk: Any, feeds: dict[str, Any] | None) -> None:
        super().__init__()
        self.chunk, self.feeds = chunk, feeds

    def once(self, gap_s: float) -> None:
        clock, chunk = time.perf_counter, self.chunk
        device, sub = chunk.device, chunk.submission
        t0 = spin(gap_s)
        if self.feeds is not None:
            views = chunk._slots[0].in_views
            for name, value in self.feeds.items():
                np.copyto(views[name], value, casting="no")
        device.submit(sub)
        t1 = clock()
        device.wait(sub)
        t2 = clock()
        self.record(t0, t1, t2, t2)


class _Way(_Timed):
    """``commands`` recorded once more, submitted raw, their end seen by a fence (reset after) or
    by a timeline semaphore's counter."""

    def __init__(self, device: Any, commands: list[tuple[Any, ...]], timeline: bool) -> None:
        super().__init__()
        self.device, self.timeline = device, timeline
        ffi, b, lib = device._ffi, device._b, device._lib
        self.ffi, self.lib = ffi, lib
        self.cmd = device.allocate_command_buffer()
        device.record(self.cmd, commands)
        self.cmds = ffi.new("VkCommandBuffer[]", [self.cmd])
        fields: dict[str, Any] = {"sType": b.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1,
                                  "pCommandBuffers": self.cmds}
        self.value = 0
        if timeline:
            self.sem = device.create_timeline().handle
            self.sems = ffi.new("VkSemaphore[]", [self.sem])
            self.values = ffi.new("uint64_t[]", 1)
            self.tl = ffi.new("VkTimelineSemaphoreSubmitInfo*", {
                "sType": b.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "signalSemaphoreValueCount": 1, "pSignalSemaphoreValues": self.values})
            fields.update(signalSemaphoreCount=1, pSignalSemaphores=self.sems, pNext=self.tl)
            self.counter = ffi.new("uint64_t*")
            self.fence = ffi.NULL
        else:
            fence = ffi.new("VkFence*")
            lib.vkCreateFence(device.handle, ffi.new("VkFenceCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO}),
                              ffi.NULL, fence)
            self.fence = fence[0]
            self.fences = ffi.new("VkFence[]", [self.fence])
        self.info = ffi.new("VkSubmitInfo*", fields)

    def close(self) -> None:
        if self.timeline:
            self.device.destroy_semaphore(self.sem)
        else:
            self.lib.vkDestroyFence(self.device.handle, self.fence, self.ffi.NULL)
        self.device.free_command_buffer(self.cmd)

    def once(self, gap_s: float, reset: bool = True) -> None:
        t0 = spin(gap_s)
        if self.timeline:
            self.value += 1
            self.values[0] = self.value
        self.lib.vkQueueSubmit(self.device.queue, 1, self.info, self.fence)
        t1 = time.perf_counter()
        t2 = t3 = self.wait(reset)
        if not self.timeline and reset:
            t3 = time.perf_counter()
        self.record(t0, t1, t2, t3)

    def wait(self, reset: bool) -> float:
        """Polls until the last submit ended (then resets the fence, when ``reset``); returns when
        it was seen ended."""
        lib, dev = self.lib, self.device.handle
        if self.timeline:
            counter, sem, want = self.counter, self.sem, self.value
            while True:
                lib.vkGetSemaphoreCounterValue(dev, sem, counter)
                if counter[0] >= want:
                    return time.perf_counter()
        while lib.vkGetFenceStatus(dev, self.fence) != 0:
            pass
        seen = time.perf_counter()
        if reset:
            lib.vkResetFences(dev, 1, self.fences)
        return seen

    def look_us(self, n: int = 10000) -> float:
        """What one look at an ended run costs: a last run, left unreset, then ``n`` looks at it."""
        self.once(0.0, reset=False)
        lib, dev = self.lib, self.device.handle
        t0 = time.perf_counter()
        if self.timeline:
            for _ in range(n):
                lib.vkGetSemaphoreCounterValue(dev, self.sem, self.counter)
        else:
            for _ in range(n):
                lib.vkGetFenceStatus(dev, self.fence)
        spent = (time.perf_counter() - t0) / n * 1e6
        if not self.timeline:
            lib.vkResetFences(dev, 1, self.fences)
        return spent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="vk0")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[0.0])
    args = ap.parse_args(argv)
    from vkpool import Session
    from vkpool.cli import random_inputs

    sess = Session(args.model, device=args.device)
    chunk = sess._chunk
    feeds = random_inputs(sess.get_inputs())
    device = chunk.device
    gpu = statistics.median(gpu_times_us(chunk))
    print(f"{args.model} on {sess.member.id} ({device.info.name}): {len(chunk.dispatch_labels)} dispatches, "
          f"GPU time of its commands {gpu:.1f} µs (median of 30); µs, medians of {args.runs} runs")
    for gap in args.gaps_us:
        ways: dict[str, Any] = {f"{what}, {how}": _Way(device, commands, how == "timeline")
                                for what, commands in (("model", chunk.commands), ("empty", [("host_barrier",)]))
                                for how in ("fence", "timeline")}
        ways["model, the run's own submission"] = _Engine(chunk, None)
        ways["model, the run's own submission, inputs written"] = _Engine(chunk, feeds)
        for way in ways.values():
            for _ in range(20):
                way.once(gap * 1e-6)
            for v in way.spent.values():
                v.clear()
        for _ in range(0, args.runs, 10):
            for way in ways.values():
                for _ in range(10):
                    way.once(gap * 1e-6)
        print(f"\n{gap:g} µs between runs\n\n| command buffer, end seen by | vkQueueSubmit | polling | reset | whole |\n"
              "|---|---|---|---|---|")
        for label, way in ways.items():
            m = {k: statistics.median(v) for k, v in way.spent.items()}
            print(f"| {label} | {m['submit']:.1f} | {m['poll']:.1f} | {m['reset']:.1f} | {m['whole']:.1f} |")
        # what one look at an ended run costs the host (a look the daemon's thread makes at
        # every batch in flight on each pass)
        fence, timeline = ways["empty, fence"].look_us(), ways["empty, timeline"].look_us()
        print(f"\none look at an ended run: fence {fence:.2f} µs, timeline {timeline:.2f} µs")
        device.wait_idle()
        for way in ways.values():
            if isinstance(way, _Way):
                way.close()
    sess.close()


if __name__ == "__main__":
    main()
