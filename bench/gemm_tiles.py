"""``python -m bench.gemm_tiles``: GPU time of the tiled GEMM (``gemm.comp``) per tile shape, on the
float32 products of transformer blocks at batch 1 (BERT-base / GPT-2 small at 128 tokens).

For every product shape M x N x K (A an input, B constant weights) and every tile configuration
(BM x BN x BK with TM x TN outputs per invocation, split-K as the planner's rule would give for
that tile), the product is compiled alone and its dispatches are timed with GPU timestamps
(median of ``--runs`` profiled runs; the gemm_reduce pass of split-K included). Prints one table
per shape, best first, with GFLOP/s, and the configuration the planner picks today marked.

Usage: python -m bench.gemm_tiles [--device vk0] [--runs 20] [--shapes 128x768x768 ...]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from onnx import TensorProto, helper, numpy_helper

DEFAULT_SHAPES = ["128x768x768", "128x3072x768", "128x768x3072", "128x2304x768"]
#: (BM, BN, BK, TM, TN)
CONFIGS = [
    (32, 32, 16, 2, 2), (64, 64, 16, 4, 4), (64, 64, 8, 8, 8), (64, 64, 16, 8, 8), (32, 64, 16, 4, 4),
    (64, 32, 16, 4, 4), (32, 64, 16, 4, 8), (64, 128, 8, 8, 8), (128, 64, 8, 8, 8), (32, 128, 16, 4, 8),
    (128, 128, 8, 8, 8), (32, 128, 16, 2, 8), (32, 256, 16, 4, 8), (16, 128, 16, 2, 4), (32, 64, 16, 2, 4),
]


def _conv_model(c: int, h: int, w: int, m: int) -> bytes:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((m, c, 3, 3)).astype(np.float32) * 0.1, "w")
    graph = helper.make_graph([helper.make_node("Conv", ["a", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, c, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, h, w])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _model(m: int, n: int, k: int) -> bytes:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _time(model: bytes, device: str | None, runs: int, feeds: dict) -> tuple[float, str, float]:
    from vkpool.session import Session

    with Session(model, device=device) as sess:
        got = sess.run(None, feeds)[0]
        chunk = sess._chunk
        labels = chunk.dispatch_labels
        samples = [sum(chunk.device.profile(chunk.commands)) for _ in range(runs)]
        ref = _REFERENCE[model](feeds["a"])
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        return statistics.median(samples), ",".join(label.rsplit("[", 1)[-1].rstrip("]") for label in labels), err


_REFERENCE: dict[bytes, object] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="MxNxK",
                    help="products A[M,K] @ W[K,N]; or convolutions conv:CxHxW:M (3x3, pad 1, M output channels)")
    args = ap.parse_args()
    from vkpool.kernels.ops import gemm

    planned = gemm.MatmulPlan._plan_gemm
    for shape in args.shapes:
        import onnxruntime as ort

        if shape.startswith("conv:"):
            (c, h, w), m = (int(v) for v in shape.split(":")[1].split("x")), int(shape.split(":")[2])
            model, n, k = _conv_model(c, h, w, m), h * w, 9 * c
            feeds = {"a": np.random.default_rng(1).standard_normal((1, c, h, w)).astype(np.float32)}
        else:
            m, n, k = (int(v) for v in shape.split("x"))
            model = _model(m, n, k)
            feeds = {"a": np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)}
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        _REFERENCE[model] = lambda a, _s=session: _s.run(None, {"a": a})[0]
        rows = []
        gemm.MatmulPlan._plan_gemm = planned
        us, kinds, err = _time(model, args.device, args.runs, feeds)
        rows.append(("planner today", us, kinds, err))
        for bm, bn, bk, tm, tn in CONFIGS:
            def forced(self, _c=(bm, bn, bk, tm, tn)) -> None:
                planned(self)  # the split rule for the default tile first, then the forced tile's
                self.tile = dict(zip(("BM", "BN", "BK", "TM", "TN"), _c))
                self.splits = 1
                p = self.p
                tiles = -(-p.M // _c[0]) * -(-p.N // _c[1]) * p.batch_count
                splits = min(-(-gemm._GEMM_TARGET_GROUPS // tiles), p.K // gemm._GEMM_MIN_K_PER_SPLIT)
                if splits > 1:
                    self.kchunk = -(-(-(-p.K // splits)) // _c[2]) * _c[2]
                    self.splits = -(-p.K // self.kchunk)
            gemm.MatmulPlan._plan_gemm = forced
            try:
                us, kinds, err = _time(model, args.device, args.runs, feeds)
                rows.append((f"{bm}x{bn}x{bk} t{tm}x{tn}", us, kinds, err))
            except Exception as exc:  # noqa: BLE001 (a configuration the device refuses is reported)
                rows.append((f"{bm}x{bn}x{bk} t{tm}x{tn}: {type(exc).__name__}: {exc}"[:120], float("inf"), "", 0.0))
        gemm.MatmulPlan._plan_gemm = planned
        flops = 2 * m * n * k
        print(f"\n### {shape}: M={m} N={n} K={k}\n\n| tile | GPU µs | GFLOP/s | dispatches | max rel err |\n|---|---|---|---|---|")
        for name, us, kinds, err in sorted(rows, key=lambda r: r[1]):
            print(f"| {name} | {us:.1f} | {flops / us / 1e3:.0f} | {kinds} | {err:.1e} |")


if __name__ == "__main__":
    main()
