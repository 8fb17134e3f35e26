"""Does a process spinning on another CPU slow ``Session.run`` down?

Usage: python -m bench.spin_probe MODEL.onnx [--device vk0] [--runs 3000]

A daemon's client spins while it waits for its reply, and so does the daemon's lane thread
while it waits for the next request. This probe pins itself to one CPU and times
``Session.run`` (median of ``--runs``) alone, then with a second process spinning a Python loop
on the same physical core's other hardware thread (when the machine has one), then on another
core, then on the same CPU, to show what a spinning neighbour costs a run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time



def _spin(cpu: int, stop: mp.Event) -> None:  # type: ignore[valid-type]
    os.sched_setaffinity(0, {cpu})
    n = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        for _ in range(1000):
            n += 1


def _siblings(cpu: int) -> list[int]:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        text = open(path).read().strip()
    except OSError:
        return [cpu]
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--runs", type=int, default=3000)
    args = ap.parse_args()
    from bench.stats import median_run_s
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    cpus = sorted(os.sched_getaffinity(0))
    me = cpus[len(cpus) // 2]
    os.sched_setaffinity(0, {me})
    sibling = [c for c in _siblings(me) if c != me]
    other = [c for c in cpus if c != me and c not in _siblings(me)]
    sess = Session(args.model, device=args.device)
    feeds = random_inputs(sess.get_inputs())

    def median_us() -> float:
        return median_run_s(lambda: sess.run(None, feeds), args.runs, warmup=200) * 1e6

    print(f"measuring on CPU {me}; its hardware-thread siblings {sibling or 'none'}", flush=True)
    rows = [("alone", None), ("spinner on the sibling thread", sibling[0] if sibling else None),
            ("spinner on another core", other[0] if other else None), ("spinner on the same CPU", me),
            ("alone again", None)]
    for label, cpu in rows:
        if label.startswith("spinner") and cpu is None:
            print(f"{label}: no such CPU")
            continue
        stop = mp.Event()
        proc = mp.Process(target=_spin, args=(cpu, stop)) if cpu is not None else None
        if proc is not None:
            proc.start()
            time.sleep(0.2)
        try:
            print(f"{label}: {median_us():.1f} µs median", flush=True)
        finally:
            if proc is not None:
                stop.set()
                proc.join()
    sess.close()


if __name__ == "__main__":
    main()
