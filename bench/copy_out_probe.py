"""Where a run's host time goes beyond the GPU's, for a model with a large output.

Usage: python -m bench.copy_out_probe MODEL.onnx [--device vk0] [--runs 50]

Loads MODEL in a ``vkpool.Session`` on one member (inputs: zeros of the declared shapes and
types) and times, per run (medians of ``--runs``): the whole ``Session.run``; the chunk's wait
for the device (``wait_in_place``); the copies of the outputs into arrays the caller owns
(``engine.copy_out``). Then, on the first output's mapped memory, the pieces of such a copy:
a fresh array's pages touched (``np.empty`` then a fill), ``copy_out`` as runs use it, one
thread's ``np.copyto`` into a fresh array and into an array already touched.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _median_us(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="vk0")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args(argv)

    import vkpool
    from vkpool import engine

    sess = vkpool.Session(args.model, device=args.device)
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], dtype=i.dtype)
             for i in sess.get_inputs()}
    chunk = sess._chunk
    spent = {"wait": [], "copy": []}
    wait, copy = chunk.wait_in_place, engine.copy_out

    def timed_wait(*a, **k):
        t0 = time.perf_counter()
        try:
            return wait(*a, **k)
        finally:
            spent["wait"].append((time.perf_counter() - t0) * 1e6)

    def timed_copy(view):
        t0 = time.perf_counter()
        try:
            return copy(view)
        finally:
            spent["copy"].append((time.perf_counter() - t0) * 1e6)

    for _ in range(10):
        sess.run(None, feeds)
    chunk.wait_in_place, engine.copy_out = timed_wait, timed_copy
    total = _median_us(lambda: sess.run(None, feeds), args.runs)
    chunk.wait_in_place, engine.copy_out = wait, copy
    n = len(chunk.output_names)
    copies = [sum(spent["copy"][i:i + n]) for i in range(0, len(spent["copy"]), n)]
    print(f"{args.model} on {args.device}: outputs {[tuple(v.shape) for v in chunk.slot_views(0)[1].values()]}")
    print(f"Session.run median {total:.1f} µs; device wait {statistics.median(spent['wait']):.1f} µs; "
          f"copies out {statistics.median(copies):.1f} µs (engine.copy_out, {engine._COPY_THREADS} threads "
          f"from {engine.PARALLEL_COPY_BYTES >> 20} MiB)")
    view = next(iter(chunk.slot_views(0)[1].values()))
    touched = np.empty_like(view)
    print(f"one output of {view.nbytes / 2**20:.1f} MiB:")
    print(f"  np.empty + fill (pages touched)   {_median_us(lambda: np.empty_like(view).fill(0), args.runs):8.1f} µs")
    print(f"  copy_out into a fresh array       {_median_us(lambda: copy(view), args.runs):8.1f} µs")
    print(f"  np.copyto into a fresh array      {_median_us(lambda: np.copyto(np.empty_like(view), view), args.runs):8.1f} µs")
    print(f"  np.copyto into a touched array    {_median_us(lambda: np.copyto(touched, view), args.runs):8.1f} µs")
    print(f"  view.copy()                       {_median_us(lambda: view.copy(), args.runs):8.1f} µs")
    sess.close()


if __name__ == "__main__":
    main()
