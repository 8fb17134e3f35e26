"""``python -m bench.real_models``: latency of five real model graphs on vkpool, torch and onnxruntime.

For each model of :mod:`bench.export_models` (full size), exported once into ``--models-dir``:

- ``vkpool``: in-process ``vkpool.Session`` (``--device`` picks the member);
- ``torch_eager``: the torch module the ONNX file was exported from, same weights, on CUDA when
  torch sees a GPU, else on the CPU;
- ``torch_cudagraph``: that module captured once and replayed as a CUDA graph (CUDA only);
- ``ort_cpu``: onnxruntime, CPU execution provider, default graph optimisations.

Every timed call starts from host numpy inputs and ends with the output on the host, so input
writes and output reads are inside each sample. ``max_rel_err`` is max|y - ref| / max|ref| with
``ref`` the output of onnxruntime CPU with every graph optimisation off (plain op-by-op FP32);
vkpool must stay under 1e-4 on every model or the command exits with status 1.

With ``--half`` the models are the float16 exports of :mod:`bench.fp16_models` (``bert`` and
``gpt2``) and every torch runtime runs the module in float16. Two references then: ``ref16``, the
float16 module on CUDA (torch's own float16 numbers; onnxruntime CPU on the float16 file where
torch sees no GPU), and ``ref32``, onnxruntime CPU on the float32 export of the same weights.
``max_rel_err`` is against ``ref16``, ``max_rel_err_fp32`` against ``ref32``. vkpool passes when
its error against ``ref16`` is at most 2e-2 (a few float16 roundings of the largest output) and
its error against ``ref32`` is at most twice ref16's own error against ``ref32`` plus 1e-3: the
float16 rounding that torch's float16 makes, not a wrong result.

``--batch N`` exports the models with a fixed batch of N images or sequences instead of one (the
same weights; each input is N of the seeded samples), for what a batch costs on each runtime.

Prints a markdown table and writes every number to ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import export_models as em
from bench.stats import LatencySummary, summarize

RUNTIMES = ("vkpool", "torch_eager", "torch_cudagraph", "ort_cpu")
#: the correctness gate on vkpool: max|y - ref| / max|ref|
MAX_REL_ERR = 1e-4
#: --half: the gate against torch's float16 output, and how far beyond torch's own float16 error
#: (both against the float32 reference) vkpool's may be: factor, then slack
HALF_MAX_REL_ERR = 2e-2
HALF_FP32_FACTOR, HALF_FP32_SLACK = 2.0, 1e-3
HALF_MODELS = ("bert", "gpt2")

RunFn = Callable[[], np.ndarray]


class Unavailable(RuntimeError):
    """The runtime cannot run on this machine; the message says why."""


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


def time_runs(fn: RunFn, warmup: int, runs: int) -> tuple[LatencySummary, np.ndarray]:
    """At least one untimed warm-up (the first call compiles and allocates), then ``runs`` samples."""
    for _ in range(max(warmup, 1)):
        fn()
    samples: list[int] = []
    out = np.empty(0)
    for _ in range(runs):
        start = time.perf_counter_ns()
        out = fn()
        samples.append(time.perf_counter_ns() - start)
    return summarize(samples), out


# -- runtimes: each returns (what runs, the timed function) and keeps what it loaded alive ----------


def _vkpool(path: Path, built: em.Built, device: str | None, keep: list[Any]) -> tuple[str, RunFn]:
    from vkpool import Session

    session = Session(str(path), device=device)
    keep.append(session)
    info = getattr(session.member, "info", None)
    what = f"{session.member.id} ({info.name})" if info is not None else session.member.id
    feeds = built.inputs
    return what, lambda: session.run(None, feeds)[0]


def _torch_setup() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc})") from exc
    # FP32 everywhere, as for the other runtimes: no TF32 in cuDNN convolutions or matmuls (float16
    # modules keep torch's defaults for float16)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


def _torch_eager(built: em.Built, keep: list[Any]) -> tuple[str, RunFn]:
    torch = _torch_setup()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    module = built.module.to(dev)
    keep.append(module)
    what = (f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}" if dev == "cuda"
            else f"torch {torch.__version__}, CPU ({torch.get_num_threads()} threads)")
    feeds = list(built.inputs.values())

    def run() -> np.ndarray:
        with torch.inference_mode():
            args = [torch.from_numpy(v).to(dev) for v in feeds]
            return module(*args).cpu().numpy()  # .cpu() waits for the GPU

    return what, run


def capture_cudagraph(built: em.Built) -> tuple[Any, Any, list[Any], Any]:
    """``built``'s module on the GPU captured as a CUDA graph: (module, graph, its input tensors,
    its output tensor); :class:`Unavailable` where torch sees no CUDA device."""
    torch = _torch_setup()
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA device")
    module = built.module.to("cuda")
    static_in = [torch.from_numpy(v).to("cuda") for v in built.inputs.values()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):  # warm-up outside capture, as torch's CUDA-graph notes require
            module(*static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        static_out = module(*static_in)
    return module, graph, static_in, static_out


def _torch_cudagraph(built: em.Built, keep: list[Any]) -> tuple[str, RunFn]:
    module, graph, static_in, static_out = capture_cudagraph(built)
    import torch  # set up by capture_cudagraph
    keep.extend([module, graph, static_in, static_out])
    feeds = list(built.inputs.values())

    def run() -> np.ndarray:
        for dst, src in zip(static_in, feeds):
            dst.copy_(torch.from_numpy(src))
        graph.replay()
        return static_out.cpu().numpy()

    return f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA graph", run


def _ort_session(path: Path, optimize: bool) -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Unavailable(f"onnxruntime is not installed ({exc})") from exc
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _ort_cpu(path: Path, built: em.Built, keep: list[Any]) -> tuple[str, RunFn]:
    import onnxruntime as ort

    session = _ort_session(path, optimize=True)
    keep.append(session)
    feeds = built.inputs
    return f"onnxruntime {ort.__version__}, CPUExecutionProvider", lambda: session.run(None, feeds)[0]


# -- one model -------------------------------------------------------------------------------------


def _half_references(name: str, args: argparse.Namespace) -> tuple[Path, em.Built, np.ndarray, np.ndarray, str]:
    """--half: the float16 file, the float16 module, ref16 (and what computed it) and ref32."""
    from bench import fp16_models

    built = em.build(name)
    ref32 = _ort_session(em.ensure(name, args.models_dir), optimize=False).run(None, built.inputs)[0]
    fp16_models.half(built)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    path = fp16_models.ensure_half(name, args.models_dir)
    if cuda:
        module = built.module.to("cuda")
        with torch.inference_mode():
            ref16 = module(*(torch.from_numpy(v).to("cuda") for v in built.inputs.values())).cpu().numpy()
        built.module.to("cpu")
        source = f"torch {torch.__version__} float16 on {torch.cuda.get_device_name(0)}"
    else:
        ref16 = _ort_session(path, optimize=False).run(None, built.inputs)[0]
        source = "onnxruntime CPU on the float16 file (torch sees no GPU)"
    return path, built, ref16, ref32, source


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ref32: np.ndarray | None = None
    if args.half:
        path, built, ref, ref32, ref_source = _half_references(name, args)
    else:
        path = em.ensure(name, args.models_dir, args.batch)
        built = em.build(name, batch=args.batch)
        ref = _ort_session(path, optimize=False).run(None, built.inputs)[0]
        ref_source = "onnxruntime CPU, graph optimisations off"
    result: dict[str, Any] = {
        "load_average": os.getloadavg(),  # other work on the machine skews every runtime
        "model": str(path), "onnx_mib": round(path.stat().st_size / 2**20, 1),
        "inputs": {k: list(v.shape) for k, v in built.inputs.items()}, "output_shape": list(ref.shape),
        "reference": ref_source, "runtimes": {},
    }
    if ref32 is not None:
        result["ref16_max_rel_err_fp32"] = rel_err(ref, ref32)
    for rt in args.runtimes:
        keep: list[Any] = []
        start = time.monotonic()
        try:
            if rt == "vkpool":
                what, fn = _vkpool(path, built, args.device, keep)
            elif rt == "torch_eager":
                what, fn = _torch_eager(built, keep)
            elif rt == "torch_cudagraph":
                what, fn = _torch_cudagraph(built, keep)
            else:
                what, fn = _ort_cpu(path, built, keep)
            load_s = time.monotonic() - start
            summary, out = time_runs(fn, args.warmup, args.runs)
        except Unavailable as exc:
            result["runtimes"][rt] = {"unavailable": str(exc)}
            _log(f"{name} {rt}: unavailable ({exc})")
            continue
        except Exception as exc:  # noqa: BLE001 - one runtime failing must not hide the others' numbers
            result["runtimes"][rt] = {"error": f"{type(exc).__name__}: {exc}"}
            _log(f"{name} {rt}: error {type(exc).__name__}: {exc}")
            continue
        finally:
            if rt.startswith("torch"):
                built.module.to("cpu")
            del keep
            gc.collect()
        err = rel_err(out, ref)
        entry = {"runtime": what, "load_s": round(load_s, 3), **summary.to_dict(), "max_rel_err": err}
        if ref32 is not None:
            entry["max_rel_err_fp32"] = rel_err(out, ref32)
        result["runtimes"][rt] = entry
        _log(f"{name} {rt}: median {summary.median_ms:.3f} ms, max rel err {err:.2e} "
             f"({time.monotonic() - start:.0f} s)")
    return result


def passes(result: dict[str, Any], half: bool) -> bool:
    """The correctness gate on vkpool's entry of one model's ``result``."""
    vk = result["runtimes"].get("vkpool", {})
    if "max_rel_err" not in vk:
        return False
    if not half:
        return vk["max_rel_err"] <= MAX_REL_ERR
    own = result["ref16_max_rel_err_fp32"]
    return (vk["max_rel_err"] <= HALF_MAX_REL_ERR
            and vk["max_rel_err_fp32"] <= HALF_FP32_FACTOR * own + HALF_FP32_SLACK)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- report ----------------------------------------------------------------------------------------


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "not run"
    if "unavailable" in entry:
        return "—"
    if "error" in entry:
        return "error"
    return f"{entry['median_ms']:.3f} ({entry['p05_ms']:.3f}–{entry['p95_ms']:.3f})"


def render_markdown(results: dict[str, Any]) -> str:
    half = results.get("half", False)
    err_cols = " | vkpool max rel err | vkpool err vs fp32 | ref16 err vs fp32 |" if half else " | vkpool max rel err |"
    lines = [
        "| model | " + " | ".join(f"{rt} ms, median (p05–p95)" for rt in RUNTIMES) + err_cols,
        "|---|" + "---|" * (len(RUNTIMES) + (3 if half else 1)),
    ]
    for name, res in results["models"].items():
        rts = res["runtimes"]
        vk = rts.get("vkpool", {})
        err = f"{vk['max_rel_err']:.1e}" if "max_rel_err" in vk else "—"
        if half:
            err += f" | {vk['max_rel_err_fp32']:.1e}" if "max_rel_err_fp32" in vk else " | —"
            err += f" | {res['ref16_max_rel_err_fp32']:.1e}"
        lines.append(f"| {name} | " + " | ".join(_cell(rts.get(rt)) for rt in RUNTIMES) + f" | {err} |")
    notes = []
    for rt in RUNTIMES:
        seen = {e.get("runtime") or e.get("unavailable") or e.get("error")
                for r in results["models"].values() if (e := r["runtimes"].get(rt))}
        if seen:
            notes.append(f"- {rt}: {'; '.join(sorted(str(s) for s in seen))}")
    refs = {r.get("reference") for r in results["models"].values()}
    notes.append(f"- reference: {'; '.join(sorted(str(r) for r in refs))}")
    return "\n".join(lines + [""] + notes) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.real_models", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", metavar="NAME", choices=list(em.BUILDERS),
                        help=f"models (default: all; with --half: {', '.join(HALF_MODELS)}): {', '.join(em.BUILDERS)}")
    parser.add_argument("--half", action="store_true",
                        help="the float16 exports (bench.fp16_models), torch in float16, two references")
    parser.add_argument("--runtimes", nargs="+", metavar="NAME", choices=RUNTIMES, default=list(RUNTIMES),
                        help=f"runtimes (default: all): {', '.join(RUNTIMES)}")
    parser.add_argument("--batch", type=int, default=1, metavar="N",
                        help="the models exported with a fixed batch of N (default 1; not with --half)")
    parser.add_argument("--runs", type=int, default=100, help="timed runs (default 100)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs first, at least 1 (default 20)")
    parser.add_argument("--device", help="vkpool member for the session (default: chosen by vkpool)")
    parser.add_argument("--models-dir", type=Path, default=em.DEFAULT_OUT,
                        help="where the exported .onnx files are kept (default: models/)")
    parser.add_argument("--out", type=Path, default=em.REPO_ROOT / "bench" / "out" / "real_models.json",
                        help="JSON results (default: bench/out/real_models.json)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.half and args.batch != 1:
        parser.error("--half exports a batch of 1 only: leave --batch out")
    if args.half and args.models and set(args.models) - set(HALF_MODELS):
        parser.error(f"--half exports only {', '.join(HALF_MODELS)}")
    args.models = args.models or list(HALF_MODELS if args.half else em.BUILDERS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.real_models", *(sys.argv[1:] if argv is None else argv)]),
        "host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "warmup": max(args.warmup, 1), "runs": args.runs, "half": args.half, "batch": args.batch,
        "models": {},
        "max_rel_err_gate": (f"{HALF_MAX_REL_ERR:g} against ref16; against ref32 {HALF_FP32_FACTOR:g} x ref16's "
                             f"+ {HALF_FP32_SLACK:g}") if args.half else MAX_REL_ERR,
    }
    for name in args.models:
        results["models"][name] = bench_model(name, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # after each model: partial results survive
    print(render_markdown(results), end="")
    failed = [name for name, r in results["models"].items()
              if "vkpool" in args.runtimes and not passes(r, args.half)]
    if failed:
        _log(f"vkpool failed or exceeded the error gate ({results['max_rel_err_gate']}) on: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
