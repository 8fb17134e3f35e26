"""Where replicated throughput goes on the host: requests per second and process CPU time per
request, one member against replicas, under a few host-side settings.

Usage: python -m bench.replica_probe [--split] [--requests 2000] [--models mnist12_like conv_few_15MB]

With two GPUs the replicas are one per GPU; with ``--split`` (or one GPU) the first GPU is split
into two members, which share its queue: that still shows what the host costs per request.
Settings compared: as shipped; the interpreter's thread switch interval at 0.1 ms instead of
5 ms (``sys.setswitchinterval``); fence waits that block in the driver at once instead of
polling first.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any, Callable

from bench import workloads
from bench.multi_gpu import throughput


def _measure(session: Any, feeds: dict, requests: int) -> tuple[float, float]:
    cpu0 = time.process_time()
    per_s = throughput(session, feeds, requests)
    # throughput() also runs 8 warm-up requests; CPU per request over everything it ran
    return per_s, (time.process_time() - cpu0) / (requests + 8) * 1e6


def _settings() -> list[tuple[str, Callable[[], Callable[[], None]]]]:
    from vkpool.device import LogicalDevice

    def switch() -> Callable[[], None]:
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        return lambda: sys.setswitchinterval(old)

    def block() -> Callable[[], None]:
        original = LogicalDevice.wait
        LogicalDevice.wait = functools.partialmethod(original, spin_seconds=0.0)  # type: ignore[assignment]
        return lambda: setattr(LogicalDevice, "wait", original)

    return [("as shipped", lambda: (lambda: None)), ("switch interval 0.1 ms", switch),
            ("blocking fence wait", block)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", action="store_true", help="split the first GPU into two members")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--models", nargs="+", default=["mnist12_like", "conv_few_15MB"])
    args = ap.parse_args()
    from vkpool.config.loader import parse_config
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n")
                                  if args.split else None)
    gpus = [m.id for m in pool.vulkan_members if m.info.type != "cpu"][:2]
    if len(gpus) < 2:
        pool.close()
        pool = DevicePool.from_config(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n"))
        gpus = [m.id for m in pool.vulkan_members][:2]
    print(f"members: {gpus} ({pool.member(gpus[0]).info.name})\n")
    print("| model | setting | 1 member req/s | CPU µs/req | replicas req/s | CPU µs/req | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        model = workloads.build(name).SerializeToString()
        feeds = workloads.input_for(name)
        with Session(model, pool=pool, device=gpus[0]) as one, \
                Session(model, pool=pool, devices=gpus, objective="throughput") as both:
            for label, apply in _settings():
                undo = apply()
                try:
                    one_s, one_cpu = _measure(one, feeds, args.requests)
                    two_s, two_cpu = _measure(both, feeds, args.requests)
                finally:
                    undo()
                print(f"| {name} | {label} | {one_s:.0f} | {one_cpu:.1f} | {two_s:.0f} | {two_cpu:.1f} | "
                      f"{two_s / one_s:.2f}× |", flush=True)
    pool.close()


if __name__ == "__main__":
    main()
