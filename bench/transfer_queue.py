"""Copies on the transfer queue against copies in the run, on one GPU.

A chunk with several run slots (as in a multi-member plan) copies a slot's inputs from host
memory and its large outputs back to host memory. With a transfer-only queue family
(the config's ``transfer_queue: auto``) those copies run on the copy engine, overlapping
other runs' compute; with ``"off"`` they are copy shaders inside the run's command buffer. The
member keeps its inputs in host memory either way (``member.inputs = None``: a GPU whose memory
the host cannot map), so both directions cross the bus. One model: ``x`` [ROWS, 4096] times a
4096 × 4096 weight, inputs and outputs of ROWS × 16 KiB each.

    python -m bench.transfer_queue [--rows 1024] [--rounds 3] [--requests 400]

For each round and each mode, a fresh pool (the mode is read when the device is created), a
one-member plan (the executor, two run slots), latency of single runs and throughput with 8
requests in flight after a second of the same load. Outputs are compared between the modes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np


def model_bytes(rows: int, width: int = 4096) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, width])
    w = numpy_helper.from_array((rng.standard_normal((width, width)) / 64).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "io_heavy", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def measure(mode: str, model: bytes, feeds: dict[str, np.ndarray], requests: int, host_inputs: bool) -> dict[str, Any]:
    from bench.multi_gpu import latency_ms, throughput
    from vkpool.config.loader import parse_config
    from vkpool.partition.graph import build_graph
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(parse_config(f'devices:\n  - match: {{name: "*"}}\n    transfer_queue: "{mode}"\n'))
    try:
        member = min(pool.vulkan_members, key=lambda m: m.info.type == "cpu")  # a GPU where there is one
        if host_inputs:
            member.inputs = None
        with Session(model, pool=pool, device=member.id) as probe:
            whole = {op: member.id for op in build_graph(probe.model).nodes}
        with Session(model, pool=pool, plan=whole, processes=False) as s:
            (y,) = s.run(None, feeds)
            chunk = s.executor.copies[0].stages[0].chunk
            return {"mode": mode, "transfer_family": member.device.transfer_family,
                    "queue_family": member.device.queue_family, "links": len(chunk._links),
                    "latency_ms": latency_ms(s, feeds, 30), "per_s": throughput(s, feeds, requests), "y": y}
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer_queue", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--device-inputs", action="store_true",
                        help="keep inputs in device memory the host maps, where the device has it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model = model_bytes(args.rows)
    feeds = {"x": np.random.default_rng(2).standard_normal((args.rows, 4096)).astype(np.float32)}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for mode in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
            rows.append({"round": r, **measure(mode, model, feeds, args.requests, not args.device_inputs)})
    ys = [row.pop("y") for row in rows]
    identical = all(np.array_equal(ys[0], y) for y in ys[1:])
    print(f"x, y: [{args.rows}, 4096] float32 ({args.rows * 16} KiB each); inputs in "
          f"{'device memory the host maps' if args.device_inputs else 'host memory'}; outputs identical: {identical}")
    print("| round | copies | transfer family | command buffers on it | latency ms | req/s (8 in flight) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {'transfer queue' if row['links'] else 'in the run'} | {row['transfer_family']} "
              f"| {row['links']} | {row['latency_ms']:.3f} | {row['per_s']:.1f} |")
    on = [r["per_s"] for r in rows if r["links"]]
    off = [r["per_s"] for r in rows if not r["links"]]
    if on and off:
        print(f"median req/s: transfer queue {statistics.median(on):.1f}, in the run {statistics.median(off):.1f}, "
              f"ratio {statistics.median(on) / statistics.median(off):.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "identical": identical, "rows_x": args.rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
