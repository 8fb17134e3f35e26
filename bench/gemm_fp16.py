"""FP16 GEMM throughput: vkpool's float16 MatMul against torch.matmul on float16 CUDA tensors.

Usage: python -m bench.gemm_fp16 [--sizes 8192 4096] [--shapes 128x768x3072 ...] [--device vk0] [--reps 20]
                                 [--variants default|all|TILE,TILE...] [--no-torch] [--json FILE]

For each size S (M = N = K = S), and each shape MxNxK of ``--shapes`` (a transformer's products
at batch 1: few rows), it builds a one-node ONNX model, ``y = MatMul(a, b)`` with
float16 a, b and y, and runs it through ``vkpool.Session``: the output's accuracy on a sample
of rows against numpy's float32 product of the same halves, the host-measured latency of a
whole run (inputs copied in and the output copied out, for reference only) and, from Vulkan
timestamps, the GPU time of the session's own GEMM dispatch replayed ``--reps`` times (median).
torch.matmul runs on the same inputs as CUDA float16 tensors in the same process, timed
with CUDA events (median of ``--reps``), its accuracy measured the same way.

``--variants`` also times workgroup tiles of the cooperative-matrix kernel other than the
planner's choice (``CoopTile`` names such as ``128x256x32_w2x4_p2_z8``, with ``/sN`` for N
K splits, e.g. ``64x64x32_w2x2_p1_z8/s4``, and ``/bias``, ``/gelu`` or ``/gelu_tanh`` for a fused
epilogue (a bias, and the bias with GELU by erf or by tanh); ``all``: the list below), each on the
same device buffers, each checked on the sample rows.

Accuracy: the largest |y - ref| over the sampled rows divided by the largest |ref| there
("max error / max |ref|"), and the largest elementwise |y - ref| / |ref| over elements with
|ref| at least 1 % of the largest.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

#: tiles tried with ``--variants all``: 64 x 64 or 64 x 32 accumulators per subgroup, one or
#: two slices in flight, L2 bands of 8 tile-rows or none; the 128 x 128 tiles leave room for
#: two workgroups per multiprocessor
CANDIDATES = (
    "128x256x32_w2x4_p2_z8", "128x256x32_w2x4_p1_z8", "128x256x32_w2x4_p2_z0", "128x256x32_w4x4_p2_z8",
    "256x128x32_w4x2_p2_z8", "128x128x32_w2x2_p2_z8", "128x128x32_w2x2_p1_z8", "128x128x64_w2x4_p1_z8",
    "128x128x32_w2x4_p2_z8", "64x256x32_w1x4_p2_z8", "64x64x32_w2x2_p1_z8",
)
SAMPLE_ROWS = 64


Shape = tuple[int, int, int]


def _model(m: int, n: int, k: int) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "gemm_fp16",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [m, k]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT16, [k, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [m, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return model.SerializeToString()


#: a variant's epilogue suffix: the activation code (kernels/ops/gemm.py), after a bias
EPILOGUES = {"bias": 0, "gelu": 2, "gelu_tanh": 3}


def _variant(name: str) -> tuple[str, int, int | None]:
    """``TILE[/sN][/EPILOGUE]`` as (tile name, K splits, activation code or None: no bias)."""
    tile, *rest = name.split("/")
    split, act = 1, None
    for part in rest:
        if part in EPILOGUES:
            act = EPILOGUES[part]
        elif part.startswith("s") and part[1:].isdigit():
            split = int(part[1:])
        else:
            raise SystemExit(f"variant {name!r}: {part!r} is neither /sN nor one of /{', /'.join(EPILOGUES)}")
    return tile, split, act


def accuracy(y_rows: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Errors of ``y_rows`` (the sampled rows of a result) against the float32 ``ref``."""
    err = np.abs(y_rows.astype(np.float32) - ref)
    peak = float(np.max(np.abs(ref)))
    big = np.abs(ref) >= 0.01 * peak
    return {"max_err_over_max_ref": float(err.max()) / peak,
            "max_rel_err": float(np.max(err[big] / np.abs(ref[big])))}


def tflops(shape: Shape, us: float) -> float:
    m, n, k = shape
    return 2.0 * m * n * k / (us * 1e-6) / 1e12


def _replayed(device: Any, dispatches: list[tuple[Any, ...]], reps: int) -> float:
    """Median GPU microseconds of ``dispatches`` (a product's: one, or split-K's two) replayed
    ``reps`` times, a barrier between each dispatch (every replay writes the same output)."""
    commands: list[tuple[Any, ...]] = []
    for i in range(reps):
        for dispatch in dispatches:
            if commands:
                commands.append(("barrier",))
            commands.append(dispatch)
    device.profile(commands)  # warm-up: clocks up, caches filled
    times = device.profile(commands)
    per = len(dispatches)
    return statistics.median(sum(times[i:i + per]) for i in range(0, len(times), per))


def bench_vkpool(shape: Shape, a: np.ndarray, b: np.ndarray, rows: np.ndarray, ref: np.ndarray,
                 device_id: str | None, reps: int, variants: list[str]) -> dict[str, Any]:
    from vkpool.kernels.base import pack_push_constants
    from vkpool.kernels.ops.gemm import MatmulProblem, apply_activation
    from vkpool.kernels.ops.gemm_f16 import CoopTile, HalfMatmulPlan, coop_shape
    from vkpool.session import Session

    out: dict[str, Any] = {}
    sess = Session(_model(*shape), device=device_id)
    try:
        chunk = sess._chunk
        device = chunk.device
        caps = device.caps
        (y,) = sess.run(None, {"a": a, "b": b})
        out["device"] = device.info.name
        out["driver"] = device.info.driver_version
        out["kernel"] = [label for label in chunk.dispatch_labels]
        out["coop_shape"] = list(caps.cooperative_matrix_f16)
        out["accuracy"] = accuracy(y[rows], ref)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            sess.run(None, {"a": a, "b": b})
            walls.append((time.perf_counter() - t0) * 1e6)
        out["session_run_us"] = statistics.median(walls)
        # the inputs' copies into device memory come first; the product is the MatMul's dispatches
        dispatches = [c for c in chunk.commands if c[0] == "dispatch"]
        gemm = [c for c, label in zip(dispatches, chunk.dispatch_labels) if label.startswith("MatMul")]
        if not gemm:
            raise RuntimeError(f"expected the GEMM's dispatches, found {chunk.dispatch_labels}")
        out["gpu_us"] = _replayed(device, gemm, reps)
        out["tflops"] = tflops(shape, out["gpu_us"])
        if variants and coop_shape(caps) is None:
            out["variants"] = {name: {"error": "the device has no cooperative matrices"} for name in variants}
        elif variants:
            member = sess.member
            m, n, k = shape
            plain = HalfMatmulPlan(MatmulProblem(M=m, N=n, K=k, sAm=k, sAk=1, sBk=n, sBn=1))
            parsed = {name: _variant(name) for name in variants}
            most = max([1, *(split for _, split, _ in parsed.values())])
            bias = np.random.default_rng(n).uniform(-1.0, 1.0, n).astype(np.float16)
            bufs = [member.alloc(a.nbytes), member.alloc(b.nbytes), member.alloc(2 * m * n),
                    member.alloc(4 * most * m * n), member.alloc(bias.nbytes)]
            try:
                member.upload(bufs[0], a)
                member.upload(bufs[1], b)
                member.upload(bufs[4], bias)
                out["variants"] = {}
                for name in variants:
                    tile_name, split, act = parsed[name]
                    tile = CoopTile.parse(tile_name)
                    plan = plain if act is None else HalfMatmulPlan(MatmulProblem(
                        M=m, N=n, K=k, sAm=k, sAk=1, sBk=n, sBn=1, has_bias=True, sCn=1, act=act))
                    want = ref if act is None else apply_activation(act, ref + bias.astype(np.float32))
                    try:
                        ds = plan.dispatches(*bufs[:3], caps, tile, c=bufs[4], ws=bufs[3], splits=split)
                        commands = [("dispatch", device.pipeline(d.shader, d.defines),
                                     pack_push_constants(d.args, lambda alloc: alloc.address), d.groups) for d in ds]
                        us = _replayed(device, commands, reps)
                        yv = member.download(bufs[2], (m, n), np.float16)
                        out["variants"][name] = {"gpu_us": us, "tflops": tflops(shape, us),
                                                 "accuracy": accuracy(yv[rows], want)}
                    except Exception as exc:  # a tile the device rejects is reported, not fatal
                        out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                    print(f"  {m}x{n}x{k} tile {name}: {out['variants'][name]}", file=sys.stderr, flush=True)
            finally:
                for buf in bufs:
                    buf.free()
    finally:
        sess.close()
    return out


def bench_torch(shape: Shape, a: np.ndarray, b: np.ndarray, rows: np.ndarray, ref: np.ndarray,
                reps: int) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"error": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"error": "torch sees no CUDA device"}
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    y = torch.matmul(ta, tb)
    for _ in range(3):
        torch.matmul(ta, tb, out=y)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(ta, tb, out=y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    us = statistics.median(times)
    y_rows = y[torch.from_numpy(rows).cuda()].cpu().numpy()
    reduced = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_us": us,
              "tflops": tflops(shape, us), "accuracy": accuracy(y_rows, ref),
              "fp16_reduced_precision_reduction": bool(reduced)}
    del ta, tb, y
    torch.cuda.empty_cache()
    return result


def run_size(shape: Shape, args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    m, n, k = shape
    rng = np.random.default_rng(m * n * k)
    a = rng.uniform(-1.0, 1.0, size=(m, k)).astype(np.float16)
    b = rng.uniform(-1.0, 1.0, size=(k, n)).astype(np.float16)
    rows = np.sort(rng.choice(m, size=min(SAMPLE_ROWS, m), replace=False))
    ref = a[rows].astype(np.float32) @ b.astype(np.float32)
    result: dict[str, Any] = {"shape": list(shape), "reps": args.reps, "sample_rows": len(rows)}
    result["vkpool"] = bench_vkpool(shape, a, b, rows, ref, args.device, args.reps, variants)
    if not args.no_torch:
        result["torch"] = bench_torch(shape, a, b, rows, ref, args.reps)
        if "tflops" in result["torch"]:
            result["ratio"] = result["vkpool"]["tflops"] / result["torch"]["tflops"]
    return result


def report(r: dict[str, Any]) -> str:
    v, t = r["vkpool"], r.get("torch", {})
    m, n, k = r["shape"]
    lines = [f"== M = {m}, N = {n}, K = {k} ({r['reps']} replays, median; accuracy on {r['sample_rows']} rows)",
             f"vkpool: {v['device']} (driver {v['driver']}), cooperative-matrix shapes {v['coop_shape']}",
             f"  kernel: {', '.join(v['kernel'])}",
             f"  GPU {v['gpu_us']:.1f} us  {v['tflops']:.1f} TFLOP/s  "
             f"max err / max |ref| {v['accuracy']['max_err_over_max_ref']:.2e}  "
             f"max rel err {v['accuracy']['max_rel_err']:.2e}",
             f"  Session.run (inputs in, output out, host clock): {v['session_run_us'] / 1000:.2f} ms"]
    if "tflops" in t:
        lines += [f"torch {t['torch']}: {t['device']}",
                  f"  GPU {t['gpu_us']:.1f} us  {t['tflops']:.1f} TFLOP/s  "
                  f"max err / max |ref| {t['accuracy']['max_err_over_max_ref']:.2e}  "
                  f"max rel err {t['accuracy']['max_rel_err']:.2e}",
                  f"vkpool / torch throughput: {r['ratio']:.3f}"]
    elif t:
        lines.append(f"torch: {t['error']}")
    for name, res in v.get("variants", {}).items():
        if "error" in res:
            lines.append(f"  tile {name:24s} {res['error']}")
        else:
            lines.append(f"  tile {name:24s} {res['gpu_us']:9.1f} us  {res['tflops']:6.1f} TFLOP/s  "
                         f"max err / max |ref| {res['accuracy']['max_err_over_max_ref']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[8192, 4096], help="square products M = N = K")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="MxNxK", help="products of other shapes")
    ap.add_argument("--device", help="member id (default: the first Vulkan member that fits)")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per kernel (median)")
    ap.add_argument("--variants", default="default",
                    help="'default' (the planner's tile only), 'all' (the candidate list) or tile names, "
                         "comma-separated")
    ap.add_argument("--no-torch", action="store_true", help="skip torch")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    variants = [] if args.variants == "default" else list(CANDIDATES) if args.variants == "all" \
        else [v for v in args.variants.split(",") if v]
    results = []
    shapes = [(s, s, s) for s in args.sizes] + [tuple(int(v) for v in t.split("x")) for t in args.shapes]
    for shape in shapes:
        r = run_size(shape, args, variants)  # type: ignore[arg-type]
        results.append(r)
        print(report(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
