"""Memory bandwidth of one-row products (GEMV) in the two weight layouts vkpool can use.

Usage: python -m bench.gemv_probe [--sizes 4096 16384] [--device vk0] [--runs 100] [--variants]

For each size S it builds two one-op models, y = x @ W with W of S x S float32 weights:
``MatMul`` (W stored K x N: columns contiguous, read by ``gemv.comp`` with split K) and
``Gemm transB=1`` (W stored N x K: each output's weights contiguous, read by ``gemv_t.comp``).
It prints each dispatch's GPU time from timestamps, the product's bandwidth,
and the host-measured latency of a whole run. With ``--variants`` each layout is also tried
with other work splits (the tunables of ``vkpool.kernels.ops.gemm``), to choose their defaults.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.stats import median_run_s


def _model(size: int, transposed: bool, stage_input: bool = False, softmax: bool = False,
           stage_output: bool = False, layers: int = 1) -> bytes:
    """y = x @ W (``layers`` times, each with its own weights); ``stage_input`` first adds zero
    to x (so the product reads device memory, not the mapped input), ``softmax`` ends with a
    Softmax, ``stage_output`` adds zero at the end (so the op before writes device memory, not
    the mapped output)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.zeros(1, np.float32), "zero")]
    nodes, prev = [], "x"
    if stage_input:
        nodes.append(helper.make_node("Add", ["x", "zero"], ["xs"]))
        prev = "xs"
    for k in range(layers):
        w = (rng.standard_normal((size, size), dtype=np.float32) / np.sqrt(size)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        if transposed:
            nodes.append(helper.make_node("Gemm", [prev, f"w{k}"], [f"p{k}"], transB=1))
        else:
            nodes.append(helper.make_node("MatMul", [prev, f"w{k}"], [f"p{k}"]))
        prev = f"p{k}"
    if softmax:
        nodes.append(helper.make_node("Softmax", [prev], ["s"], axis=-1))
        prev = "s"
    if stage_output:
        nodes.append(helper.make_node("Add", [prev, "zero"], ["o"]))
        prev = "o"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size])
    g = helper.make_graph(nodes, "gemv", [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return m.SerializeToString()


#: work splits tried with --variants: overrides of vkpool.kernels.ops.gemm's tunables
VARIANTS: dict[bool, list[dict[str, int]]] = {
    False: [{"_GEMV_TARGET_GROUPS": 4096, "_GEMV_MIN_ROWS_PER_SPLIT": 64},
            {"_GEMV_TARGET_GROUPS": 16384, "_GEMV_MIN_ROWS_PER_SPLIT": 32}],
    True: [{"_GEMV_T_ROWS": 1, "_GEMV_T_THREADS_PER_ROW": 256},
           {"_GEMV_T_ROWS": 2, "_GEMV_T_THREADS_PER_ROW": 128},
           {"_GEMV_T_ROWS": 4, "_GEMV_T_THREADS_PER_ROW": 64},
           {"_GEMV_T_ROWS": 8, "_GEMV_T_THREADS_PER_ROW": 64},
           {"_GEMV_T_ROWS": 4, "_GEMV_T_THREADS_PER_ROW": 32},
           {"_GEMV_T_ROWS": 16, "_GEMV_T_THREADS_PER_ROW": 32}],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--device")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--variants", action="store_true", help="also try the other work splits")
    ap.add_argument("--stage-input", action="store_true", help="add zero to x first (product reads device memory)")
    ap.add_argument("--softmax", action="store_true", help="end with a Softmax, as matmul_1GB_1layer does")
    ap.add_argument("--stage-output", action="store_true", help="add zero last (the op before writes device memory)")
    ap.add_argument("--layers", type=int, default=1, help="products in a chain, each with its own weights")
    ap.add_argument("--file", type=Path,
                    help="instead: profile this one-MatMul model (matmul_1GB_1layer) as loaded from its file "
                         "(weights transposed while uploaded) against the same weights given as Gemm "
                         "transB=1 (uploaded as they are), alternately, in this process")
    args = ap.parse_args()
    from vkpool.kernels.ops import gemm
    from vkpool.session import Session

    if args.file:
        _compare_file(Session, args)
        return

    print("| weights | layout | split | dispatches (GPU µs each, mean) | product GPU µs | GB/s | run median µs |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for transposed in (False, True):
                path = Path(tmp) / f"gemv_{size}_{int(transposed)}.onnx"
                path.write_bytes(_model(size, transposed, args.stage_input, args.softmax, args.stage_output, args.layers))
                defaults = {name: getattr(gemm, name) for v in VARIANTS[transposed] for name in v}
                for variant in [{}] + (VARIANTS[transposed] if args.variants else []):
                    for name, value in {**defaults, **variant}.items():
                        setattr(gemm, name, value)
                    _time(Session, path, size, transposed, variant, args)
                for name, value in defaults.items():
                    setattr(gemm, name, value)
                path.unlink()


def _compare_file(Session: type, args: argparse.Namespace) -> None:
    """matmul_1GB_*'s product runs far slower in its own process than the probe's: is it the
    upload (transposed by copy regions from the file's K x N) or the weights' placement?"""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(args.file))
    (w,) = [numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2]
    size = w.shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        alt = Path(tmp) / "gemm_t.onnx"
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")]
        del w
        g = helper.make_graph(
            [helper.make_node("Gemm", ["x", "wt"], ["p"], transB=1),
             helper.make_node("Softmax", ["p"], ["y"], axis=-1)], "gemm_t",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, size])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, size])], inits)
        alt.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
                        .SerializeToString())
        del inits, g
        for label, path in (("file, MatMul K x N", args.file), ("Gemm transB=1 N x K", alt),
                            ("file, MatMul K x N", args.file), ("Gemm transB=1 N x K", alt)):
            print(f"{label}: ", end="")
            _time(Session, path, size, True, {}, args)


def _time(Session: type, path: Path, size: int, transposed: bool, variant: dict[str, int],
          args: argparse.Namespace) -> None:
    sess = Session(str(path), device=args.device)
    x = np.random.default_rng(1).standard_normal((1, size), dtype=np.float32)
    wall_us = median_run_s(lambda: sess.run(None, {"x": x}), args.runs) * 1e6
    chunk = sess._chunk
    profiles = [chunk.device.profile(chunk.commands) for _ in range(5)]
    each = [statistics.median(p[i] for p in profiles) for i in range(len(chunk.dispatch_labels))]
    gpu = sum(t for t, label in zip(each, chunk.dispatch_labels) if "gemv" in label or "gemm" in label)
    layout = "N x K (Gemm transB=1)" if transposed else "K x N (MatMul)"
    by_shader: dict[str, list[float]] = {}
    for label, t in zip(chunk.dispatch_labels, each):
        by_shader.setdefault(label.rsplit("[", 1)[-1].rstrip("]"), []).append(t)
    shaders = ", ".join(f"{name} {statistics.mean(ts):.1f}" + (f" ×{len(ts)}" if len(ts) > 1 else "")
                        for name, ts in by_shader.items())
    gbps = getattr(args, "layers", 1) * size * size * 4 / (gpu * 1e-6) / 1e9
    split = " ".join(f"{k.strip('_').lower()}={v}" for k, v in variant.items()) or "default"
    print(f"| {args.layers} x {size * size * 4 / 2**20:.0f} MiB | {layout} | {split} | {shaders} | {gpu:.1f} | {gbps:.0f} | "
          f"{wall_us:.1f} |", flush=True)
    sess.close()


if __name__ == "__main__":
    main()
