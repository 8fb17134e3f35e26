"""Where the time of one ``Session.run`` goes: input copy, submit, wait, output copy (host clocks),
and the GPU's own time for the run's commands (a timestamp before the first and after the last,
the commands recorded once more with them: the wait beyond it is the device's start and the
host's look at the fence).

Usage: python -m bench.where_time_goes MODEL.onnx [--runs 200] [--device vk0]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.stats import gpu_times_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--device")
    args = ap.parse_args()
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    t0 = time.perf_counter()
    sess = Session(args.model, device=args.device)
    load = time.perf_counter() - t0
    chunk = sess._chunk
    slot = chunk._slots[0]  # a one-member session's chunk has one run slot
    dev = chunk.device
    feeds = random_inputs(sess.get_inputs())
    for _ in range(20):
        sess.run(None, feeds)
    parts: dict[str, list[float]] = {"write inputs": [], "submit": [], "wait": [], "read outputs": [], "run total": []}
    for _ in range(args.runs):
        a = time.perf_counter()
        for name, view in slot.in_views.items():
            np.copyto(view, feeds[name], casting="no")
        b = time.perf_counter()
        dev.submit(chunk.submission)
        c = time.perf_counter()
        dev.wait(chunk.submission)
        d = time.perf_counter()
        _ = {n: v.copy() for n, v in slot.out_views.items()}
        e = time.perf_counter()
        parts["write inputs"].append(b - a)
        parts["submit"].append(c - b)
        parts["wait"].append(d - c)
        parts["read outputs"].append(e - d)
        t = time.perf_counter()
        sess.run(None, feeds)
        parts["run total"].append(time.perf_counter() - t)
    parts["GPU, first command to last"] = [us * 1e-6 for us in gpu_times_us(chunk, min(args.runs, 50))]
    s = chunk.stats
    print(f"{args.model} on {sess.member.id} ({sess.member.info.name}): load {load * 1e3:.1f} ms; "
          f"{s.dispatches} dispatches, {s.levels} levels, {s.barriers} barriers; recording happens once at load")
    print("| part | median µs | p05 µs | p95 µs |\n|---|---|---|---|")
    for k, v in parts.items():
        q = np.percentile(np.array(v) * 1e6, [5, 50, 95])
        print(f"| {k} | {q[1]:.1f} | {q[0]:.1f} | {q[2]:.1f} |")
    sess.close()


if __name__ == "__main__":
    main()
