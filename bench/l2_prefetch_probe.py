"""Does reading the next layer's first weight rows into the L2 cache shorten a chain of GEMVs?

Usage: python -m bench.l2_prefetch_probe [--size 4096] [--layers 16] [--megabytes 0 4 8 16]
                                          [--groups 32] [--runs 200] [--rounds 5]

Builds ``layers`` chained products y = x @ W (``gemv_t``, 4096 x 4096 float32 weights: the
``matmul_1GB_16layers`` shape), takes the session's own recorded commands and records them
again with one more dispatch after each GEMV but the last: ``l2_prefetch.comp`` over the first
N MiB of the next layer's weights, with no barrier between it and the GEMV it follows (it
reads only weights), so it runs in that GEMV's tail and the next GEMV finds those rows in L2.
Each variant is its own command buffer; rounds alternate the variants; the figure is the
median host time of submit + wait per run (the same overhead in every variant).
"""
from __future__ import annotations

import argparse
import statistics
import struct
import time
from typing import Any

import numpy as np

from bench.gemv_probe import _model


def _with_prefetch(device: Any, commands: list[tuple[Any, ...]], labels: list[str], sink: Any,
                   megabytes: float, groups: int) -> list[tuple[Any, ...]]:
    if megabytes <= 0:
        return list(commands)
    pipe = device.pipeline("l2_prefetch", {})
    dispatches = [i for i, c in enumerate(commands) if c[0] == "dispatch"]
    gemvs = [i for i, label in zip(dispatches, labels) if "gemv_t" in label]
    weights = [struct.unpack_from("<Q", commands[i][2], 8)[0] for i in gemvs]  # push: x, b (weights), c, y
    for i, j in zip(gemvs, gemvs[1:]):  # each product reads the one before: the layout is read right
        assert struct.unpack_from("<Q", commands[i][2], 24) == struct.unpack_from("<Q", commands[j][2], 0)
    vectors = int(megabytes * 2 ** 20) // 16
    out: list[tuple[Any, ...]] = []
    for i, c in enumerate(commands):
        out.append(c)
        if i in gemvs[:-1]:
            nxt = weights[gemvs.index(i) + 1]
            push = struct.pack("<QQI", nxt, sink.address, vectors) + b"\0" * 4
            out.append(("dispatch", pipe, push, (groups, 1, 1)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--megabytes", type=float, nargs="+", default=[0, 4, 8, 16])
    ap.add_argument("--groups", type=int, default=32, help="workgroups of each prefetch dispatch")
    ap.add_argument("--runs", type=int, default=200, help="runs per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    from vkpool.session import Session

    sess = Session(_model(args.size, transposed=True, layers=args.layers))
    x = np.random.default_rng(1).standard_normal((1, args.size)).astype(np.float32)
    expected = sess.run(None, {"x": x})[0]
    chunk, member = sess._chunk, sess.member
    device = chunk.device
    sink = member.alloc(256)
    subs = []
    try:
        variants = {}
        for mb in args.megabytes:
            cmd = device.allocate_command_buffer()
            device.record(cmd, _with_prefetch(device, chunk.commands, chunk.dispatch_labels, sink, mb, args.groups))
            sub = device.submission(cmd)
            subs.append(sub)
            variants[mb] = sub
        print(f"{device.info.name}, {args.layers} x GEMV {args.size} x {args.size}, prefetch dispatches of "
              f"{args.groups} workgroups; dispatches: {chunk.dispatch_labels}", flush=True)
        t_end = time.perf_counter() + 1.0  # clocks up
        while time.perf_counter() < t_end:
            device.submit(subs[0])
            device.wait(subs[0])
        times: dict[float, list[float]] = {mb: [] for mb in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
            for mb in order:
                sub = variants[mb]
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    device.submit(sub)
                    device.wait(sub)
                    times[mb].append((time.perf_counter() - t0) * 1e6)
        base = statistics.median(times[args.megabytes[0]])
        for mb, ts in times.items():
            rounds = [statistics.median(ts[i * args.runs:(i + 1) * args.runs]) for i in range(args.rounds)]
            print(f"  prefetch {mb:5.1f} MiB per layer: median {statistics.median(ts):8.1f} us "
                  f"(rounds {', '.join(f'{v:.1f}' for v in rounds)}), {statistics.median(ts) / base:.3f} of the first")
        got = sess.run(None, {"x": x})[0]
        print(f"  outputs unchanged: {bool(np.array_equal(got, expected))}")
    finally:
        for sub in subs:
            sub.release()
        sink.free()
        sess.close()


if __name__ == "__main__":
    main()
