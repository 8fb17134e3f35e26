"""Which variant of a kernel family a device runs: chosen from its properties, measured where
they do not decide, and forced for tests.

The products (``gemm.comp``, which also runs implicit-GEMM convolutions) come in two tilings:

- ``shared``: tiles of A and B staged through shared memory by a workgroup of up to 256
  invocations, for GPUs;
- ``register``: one SIMD-wide workgroup, each invocation keeping TM x TN outputs in registers
  and reading its operands straight from memory, with no barrier: for a device of type ``cpu``
  (lavapipe, SwiftShader), where shared memory is ordinary memory and a barrier switches between
  the invocations of a workgroup.

The register tiling also runs convolutions of at most 64 window taps as ``conv_taps.comp`` (the
window arithmetic hoisted out of the reduction) and splits a product's reduction only where its
tiles are fewer than 16 workgroups. On a device of type ``cpu`` (``DeviceCaps.cpu_like``) the
other kernels whose GPU form leans on shared memory, barriers or many invocations take their CPU
form, each chosen where the op plans its dispatches: attention on ``attention_rows.comp`` (a
query row per invocation, its online softmax in registers), element-wise binary ops of
same-shape inputs without the per-element index division, element-wise ops whose grid holds
exactly their elements without a bounds test, a one-row product by a transposed
matrix and a global pooling with one subgroup per row. Every other device keeps the GPU kernels.

A device of type ``cpu`` runs ``register`` with the tile ``vkpool calibrate``'s tuning pass
(:func:`tune_register_tile`) measured fastest on it (``vkpool calibrate``, kept per device and driver under
``$VKPOOL_CACHE_DIR/tuning``), else :data:`DEFAULT_REGISTER_TILE`; any other device runs
``shared``. ``VKPOOL_KERNEL_VARIANT`` forces one for every device: ``gemm=shared``,
``gemm=register`` or ``gemm=register:TMxTNxWG`` (the test suite runs both on lavapipe).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

TUNING_VERSION = 1
#: (TM, TN, WG) of the register tiling where no tuning pass has run. NOTE: lavapipe (Mesa 22.3.6,
#: 2 cores): 32 x 16 ran a lone 128 x 768 x 3072 product faster (21 against 19 GFLOP/s) but
#: ResNet-50 slower (836 against 636 ms) and compiled its shaders for longer
DEFAULT_REGISTER_TILE = (32, 8, 8)
#: the register tiles the tuning pass tries (TM x TN accumulators of WG lanes each)
REGISTER_TILES = ((32, 8, 8), (32, 16, 8), (16, 8, 8), (8, 8, 8))
_FORCED = re.compile(r"^gemm=(shared|register)(?::(\d+)x(\d+)x(\d+))?$")


class KernelVariantError(ValueError):
    """VKPOOL_KERNEL_VARIANT does not name a variant."""


@dataclass(frozen=True)
class GemmChoice:
    """A device's product tiling: ``variant`` "shared" or "register", and why it was chosen."""

    variant: str
    register_tile: tuple[int, int, int] = DEFAULT_REGISTER_TILE
    why: str = ""  # "forced", "tuned", "device type"


def forced() -> GemmChoice | None:
    """The variant ``VKPOOL_KERNEL_VARIANT`` forces, or None when it is unset."""
    text = os.environ.get("VKPOOL_KERNEL_VARIANT", "").strip()
    if not text:
        return None
    m = _FORCED.match(text)
    if m is None:
        raise KernelVariantError(f"VKPOOL_KERNEL_VARIANT={text!r}: expected gemm=shared, gemm=register or "
                                 "gemm=register:TMxTNxWG (e.g. gemm=register:32x8x8)")
    tile = tuple(int(v) for v in m.groups()[1:]) if m.group(2) else DEFAULT_REGISTER_TILE
    if any(v < 1 for v in tile) or tile[0] * tile[1] > 1024:
        raise KernelVariantError(f"VKPOOL_KERNEL_VARIANT={text!r}: TM, TN, WG must be >= 1 and TM x TN <= 1024")
    return GemmChoice(m.group(1), tile, "forced")  # type: ignore[arg-type]


def tuning_path(uuid: str) -> Path:
    from vkpool.cache import cache_dir

    safe = "".join(c for c in uuid if c.isalnum() or c in "-_")
    return cache_dir("tuning", create=False) / f"{safe}.json"


def driver_of(info: Any) -> str:
    return f"{info.driver_name} {info.driver_info}".strip()


def load_tuned(info: Any) -> GemmChoice | None:
    """The register tile measured on this device with this driver, or None."""
    try:
        record = json.loads(tuning_path(info.uuid).read_text())
        if record.get("version") != TUNING_VERSION or record.get("driver") != driver_of(info):
            return None
        tm, tn, wg = (int(v) for v in record["register_tile"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return GemmChoice("register", (tm, tn, wg), "tuned")


def save_tuned(info: Any, tile: tuple[int, int, int], timings: dict[str, float]) -> Path:
    from vkpool.cache import write_atomic

    path = tuning_path(info.uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": TUNING_VERSION, "uuid": info.uuid, "device": info.name, "driver": driver_of(info),
              "register_tile": list(tile), "seconds": timings}
    write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


def describe(choice: GemmChoice) -> str:
    """``register tiles 32x8x8 (tuned)``, as ``vkpool devices`` shows a device's choice."""
    tiles = "shared-memory tiles" if choice.variant == "shared" else \
        "register tiles " + "x".join(map(str, choice.register_tile))
    return f"{tiles} ({choice.why})"


def gemm_choice(info: Any) -> GemmChoice:
    """The product tiling of the device ``info`` (see the module docstring)."""
    chosen = forced()
    if chosen is not None:
        return chosen
    if info.type != "cpu":
        return GemmChoice("shared", why="device type")
    return load_tuned(info) or GemmChoice("register", DEFAULT_REGISTER_TILE, "device type")




def _tuning_models() -> list[bytes]:
    """What the tuning pass times: a square product and a convolution of a CNN's middle layers."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    out = []
    for node, x_shape, w_shape, y_shape in (
            (helper.make_node("MatMul", ["x", "w"], ["y"]), [256, 256], (256, 256), [256, 256]),
            (helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]), [1, 64, 28, 28], (64, 64, 3, 3),
             [1, 64, 28, 28])):
        w = numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w")
        graph = helper.make_graph([node], "tune", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], [w])
        out.append(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                     ir_version=8).SerializeToString())
    return out


def tune_register_tile(pool: Any, member: Any, repeat: int, out: TextIO,
                       tiles: tuple[tuple[int, int, int], ...] = REGISTER_TILES
                       ) -> tuple[tuple[int, int, int], dict[str, float]]:
    """The register tile of ``tiles`` whose product and convolution
    (:func:`_tuning_models`) run fastest on ``member`` (median of ``repeat`` runs each, summed),
    and every tile's seconds.
    The member's device runs that tile from then on. O(tiles · repeat) runs of two small models."""
    import statistics
    import time

    from vkpool.session import Session

    device = member.device
    models = _tuning_models()
    timings: dict[str, float] = {}
    for tile in tiles:
        device.caps = dataclasses.replace(device.caps, gemm_variant="register", register_tile=tile)
        total = 0.0
        for model in models:
            with Session(model, pool=pool, device=member.id) as session:
                x = np.random.default_rng(1).standard_normal(session.get_inputs()[0].shape).astype(np.float32)
                session.run(None, {"x": x})
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    session.run(None, {"x": x})
                    times.append(time.perf_counter() - t0)
            total += statistics.median(times)
        timings["x".join(map(str, tile))] = total
        print(f"  register tile {'x'.join(map(str, tile)):<8} {total * 1e3:9.2f} ms", file=out, flush=True)
    best = min(tiles, key=lambda t: timings["x".join(map(str, t))])
    device.caps = dataclasses.replace(device.caps, gemm_variant="register", register_tile=best)
    return best, timings


__all__ = ["GemmChoice", "gemm_choice", "describe", "forced", "load_tuned", "save_tuned", "tune_register_tile",
           "KernelVariantError", "DEFAULT_REGISTER_TILE", "REGISTER_TILES"]
