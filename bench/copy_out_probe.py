"""Where a run's host time goes beyond the GPU's, for a model with a large output.

Usage: python -m bench.copy_out_probe MODEL.onnx [--device vk0] [--runs 50]
       [--imported-output-bytes N] [--compare]

Loads MODEL in a ``vkpool.Session`` on one member (inputs: zeros of the declared shapes and
types) and times, per run (medians of ``--runs``): the whole ``Session.run``; the chunk's wait
for the device (``wait_in_place``); what ``finish`` does after it (copies of the outputs into
arrays the caller owns, ``engine.copy_out``, or outputs handed out in host memory the device
wrote, ``engine.IMPORTED_OUTPUT_BYTES``). Then, on the first output's mapped memory, the pieces
of such a copy: a fresh array's pages touched (``np.empty`` then a fill), ``copy_out`` as runs
use it, one thread's ``np.copyto`` into a fresh array and into an array already touched.

``--imported-output-bytes N``: outputs of N bytes and more are handed out in imported host
memory (default: the engine's threshold; a huge N keeps every output on the copy path).
``--compare``: loads the model twice, on the copy path and with N, and times both in
alternating blocks of ten runs, so both see the same machine state.
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


class _Probe:
    """A session whose chunk's waits, finishes and copies out are timed (µs, one entry per call)."""

    def __init__(self, model: str, device: str, imported_output_bytes: int) -> None:
        import vkpool
        from vkpool import engine

        kept = engine.IMPORTED_OUTPUT_BYTES
        engine.IMPORTED_OUTPUT_BYTES = imported_output_bytes
        try:
            self.sess = vkpool.Session(model, device=device)
        finally:
            engine.IMPORTED_OUTPUT_BYTES = kept
        self.feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], dtype=i.dtype)
                      for i in self.sess.get_inputs()}
        self.chunk = self.sess._chunk
        self.spent: dict[str, list[float]] = {"run": [], "wait": [], "finish": [], "copy": []}
        for _ in range(10):
            self.sess.run(None, self.feeds)

    def timed(self, runs: int) -> None:
        from vkpool import engine

        chunk, spent = self.chunk, self.spent
        wait, finish, copy = chunk.wait_in_place, chunk.finish, engine.copy_out

        def timing(key, fn):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[key].append((time.perf_counter() - t0) * 1e6)
            return call

        chunk.wait_in_place, chunk.finish = timing("wait", wait), timing("finish", finish)
        engine.copy_out = timing("copy", copy)
        try:
            for _ in range(runs):
                t0 = time.perf_counter()
                self.sess.run(None, self.feeds)
                spent["run"].append((time.perf_counter() - t0) * 1e6)
        finally:
            del chunk.wait_in_place, chunk.finish
            engine.copy_out = copy

    def report(self, label: str) -> None:
        s = self.spent
        after = [f - w for f, w in zip(s["finish"], s["wait"])]
        n = len(s["run"])
        print(f"{label}: Session.run median {statistics.median(s['run']):.1f} µs "
              f"(p05 {np.percentile(s['run'], 5):.1f}, p95 {np.percentile(s['run'], 95):.1f}); "
              f"device wait {statistics.median(s['wait']):.1f} µs; "
              f"after the wait {statistics.median(after):.1f} µs; copies out {len(s['copy']) / n:.1f} a run")
        for name, buffers in self.chunk.imported.items():
            print(f"  {name}: imported in {buffers.imports} host buffers (of {buffers.cap}), "
                  f"{buffers.reuses} reuses, {buffers.copies} runs copied with every buffer held")


def main(argv: list[str] | None = None) -> None:
    from vkpool import engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="vk0")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--imported-output-bytes", type=int, default=engine.IMPORTED_OUTPUT_BYTES)
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args(argv)

    label = "imported" if args.compare else "this run"
    probes = {label: _Probe(args.model, args.device, args.imported_output_bytes)}
    if args.compare:
        probes["copied"] = _Probe(args.model, args.device, 1 << 62)
    for start in range(0, args.runs, 10):
        for probe in probes.values():
            probe.timed(min(10, args.runs - start))
    first = next(iter(probes.values()))
    chunk = first.chunk
    shapes = [tuple(v.shape) for v in chunk.slot_views(0)[1].values()]
    print(f"{args.model} on {args.device}: outputs {shapes}; copies out by {engine._COPY_THREADS} threads "
          f"from {engine.PARALLEL_COPY_BYTES >> 20} MiB, imported from {args.imported_output_bytes} bytes")
    for label, probe in probes.items():
        probe.report(label)
    if args.compare:
        runs = {label: statistics.median(p.spent["run"]) for label, p in probes.items()}
        print(f"imported / copied: {runs['imported'] / runs['copied']:.3f}")
    view = next(iter(chunk.slot_views(0)[1].values()))
    touched = np.empty_like(view)
    print(f"one output of {view.nbytes / 2**20:.1f} MiB:")
    print(f"  np.empty + fill (pages touched)   {_median_us(lambda: np.empty_like(view).fill(0), args.runs):8.1f} µs")
    copy = engine.copy_out
    print(f"  copy_out into a fresh array       {_median_us(lambda: copy(view), args.runs):8.1f} µs")
    print(f"  np.copyto into a fresh array      {_median_us(lambda: np.copyto(np.empty_like(view), view), args.runs):8.1f} µs")
    print(f"  np.copyto into a touched array    {_median_us(lambda: np.copyto(touched, view), args.runs):8.1f} µs")
    print(f"  view.copy()                       {_median_us(lambda: view.copy(), args.runs):8.1f} µs")
    for probe in probes.values():
        probe.sess.close()


if __name__ == "__main__":
    main()
