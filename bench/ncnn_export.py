"""The benchmark workloads in ncnn's ``.param``/``.bin`` format.

Every workload but the add chain is converted by pnnx (its PyPI wheel; the ``pnnx`` executable
reads ONNX directly, no torch needed) with FP32 weights (``fp16=0``), as the VKML paper ran ncnn.
pnnx folds ``Add(x, 0)`` away, so an add chain would become an empty net; the add chain is written
here instead, one ncnn ``BinaryOp`` layer (add, scalar) per ONNX ``Add``, which is the dispatch
work the benchmark measures.

Both paths name the input blob ``in0`` and the output blob ``out0``. ncnn blobs drop the batch
axis: [1,C,H,W] is ncnn's (c, h, w) and [1] its 1-D ``w``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

MAGIC = 7767517
INPUT_BLOB = "in0"
OUTPUT_BLOB = "out0"


class ConversionError(RuntimeError):
    """pnnx is missing or could not convert the model; the message says why."""


def pnnx_executable() -> Path:
    """The ``pnnx`` converter: ``$PNNX``, else the one inside the installed ``pnnx`` wheel (found
    without importing the package, whose Python side imports torch), else one on ``PATH``."""
    if os.environ.get("PNNX"):
        return Path(os.environ["PNNX"])
    spec = importlib.util.find_spec("pnnx")
    if spec is not None and spec.submodule_search_locations:
        exe = Path(next(iter(spec.submodule_search_locations))) / "pnnx"
        if exe.exists():
            return exe
    found = shutil.which("pnnx")
    if found:
        return Path(found)
    raise ConversionError("pnnx is not installed: pip install pnnx (or set PNNX to its executable)")


def pnnx_version() -> str:
    try:
        return importlib.metadata.version("pnnx")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def convert(onnx_path: Path, param_path: Path, bin_path: Path, add_chain: bool) -> None:
    """Write ``onnx_path`` as ncnn files: pnnx for the networks, BinaryOp layers for an add chain."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    if add_chain:
        write_add_chain(model, param_path, bin_path)
    else:
        _run_pnnx(onnx_path, model, param_path, bin_path)


def _input_shape(model: onnx.ModelProto) -> list[int]:
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise ConversionError(f"expected one graph input, found {len(inputs)}")
    dims = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim]
    if not dims or any(d <= 0 for d in dims):
        raise ConversionError(f"input {inputs[0].name!r} needs a static shape, got {dims}")
    return dims


def _run_pnnx(onnx_path: Path, model: onnx.ModelProto, param_path: Path, bin_path: Path) -> None:
    shape = ",".join(str(d) for d in _input_shape(model))
    exe = pnnx_executable()
    # pnnx also writes its own graph, a simplified ONNX copy and two Python scripts; the
    # weights-sized ones go to a scratch folder next to the outputs and are deleted.
    with tempfile.TemporaryDirectory(dir=param_path.parent, prefix=".pnnx-") as scratch:
        s = Path(scratch)
        args = [str(exe), str(onnx_path), f"inputshape=[{shape}]f32", "fp16=0",
                f"ncnnparam={param_path}", f"ncnnbin={bin_path}", f"ncnnpy={s / 'model_ncnn.py'}",
                f"pnnxparam={s / 'model.pnnx.param'}", f"pnnxbin={s / 'model.pnnx.bin'}",
                f"pnnxpy={s / 'model_pnnx.py'}", f"pnnxonnx={s / 'model.pnnx.onnx'}"]
        try:
            done = subprocess.run(args, cwd=s, capture_output=True, text=True, timeout=1800)
        finally:
            # pnnx writes its simplified ONNX copy beside the input, whatever the options say
            onnx_path.with_suffix(".pnnxsim.onnx").unlink(missing_ok=True)
    if done.returncode != 0 or not param_path.exists() or not bin_path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise ConversionError(f"pnnx failed on {onnx_path.name} (exit {done.returncode}):\n{tail}")
    _check_blob_names(param_path)


def _check_blob_names(param_path: Path) -> None:
    layers = [line.split() for line in param_path.read_text().splitlines()[2:] if line.strip()]
    produced = {blob for tokens in layers for blob in _outputs(tokens)}
    if INPUT_BLOB not in produced or OUTPUT_BLOB not in produced:
        raise ConversionError(f"{param_path.name}: expected blobs {INPUT_BLOB!r} and {OUTPUT_BLOB!r}")
    if len(layers) < 2:
        raise ConversionError(f"{param_path.name}: pnnx wrote no compute layer (the graph folded away)")


def _outputs(tokens: list[str]) -> list[str]:
    n_in, n_out = int(tokens[2]), int(tokens[3])
    return tokens[4 + n_in:4 + n_in + n_out]


def write_add_chain(model: onnx.ModelProto, param_path: Path, bin_path: Path) -> None:
    """One ``BinaryOp`` (op 0 = add, ``1=1`` with scalar ``2=b``) per ``Add(prev, scalar constant)``."""
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    n_in = int(np.prod(_input_shape(model)))
    lines = [f"Input input 0 1 {INPUT_BLOB} 0={n_in}"]
    prev_onnx, prev_blob = model.graph.input[0].name, INPUT_BLOB
    nodes = list(model.graph.node)
    for i, node in enumerate(nodes):
        const = consts.get(node.input[1]) if len(node.input) == 2 else None
        if node.op_type != "Add" or node.input[0] != prev_onnx or const is None or const.size != 1:
            raise ConversionError(f"node {node.name or i}: an add chain is Add(previous, scalar constant)")
        blob = OUTPUT_BLOB if i == len(nodes) - 1 else f"b{i}"
        lines.append(f"BinaryOp add{i} 1 1 {prev_blob} {blob} 0=0 1=1 2={float(const.reshape(-1)[0]):.9g}")
        prev_onnx, prev_blob = node.output[0], blob
    param_path.write_text("\n".join([str(MAGIC), f"{len(lines)} {len(lines)}", *lines]) + "\n")
    bin_path.write_bytes(b"")  # the chain's scalars live in the .param
