"""``vkpool calibrate``: measure every pool member's speeds and write the cost model's cache.

Each figure of :class:`~vkpool.partition.cost.MemberCost` comes from timing real runs of small
generated ONNX models with :class:`vkpool.Session` on the member, each at two sizes so that the
fixed cost of a run cancels out (the difference of two medians over the difference in work):

- ``dispatch_s``: a chain of ``Add`` ops on 16 floats, short against long;
- ``transfer_latency_s``: what is left of the short chain's run once its dispatches are taken
  away, halved: a run is one upload and one download, and the cost model charges each a latency;
- ``bytes_per_s``: a chain of ``Add`` ops on a large vector; bytes per op as the planner counts
  them (:func:`~vkpool.partition.graph.build_graph`), per-op time less one dispatch;
- ``flops_per_s``: a chain of square ``MatMul`` ops, FLOPs as the planner counts them;
- ``h2d_bytes_per_s``: ``Slice`` of the first element of a small and a large input (the run
  writes the whole input to the member, the kernel reads one element);
- ``d2h_bytes_per_s``: one float ``Expand``-ed to a large vector that is either the output (the
  run reads it all back) or only sliced to its first element: the difference is the read-back,
  plus the one ``Slice`` dispatch.

A transfer difference within timing noise (the host member, whose "transfers" are numpy views)
is priced at the member's memory bandwidth: a copy cannot beat it.

Members that share a physical device (splits) are measured once; the cache is keyed by the
device UUID (:func:`~vkpool.partition.cost.calibration_path`); the host member's key is
:func:`~vkpool.partition.cost.host_calibration_key`. O(repeat · sizes) model runs per member.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO

import numpy as np

from vkpool import progress

if TYPE_CHECKING:
    import onnx

    from vkpool.partition.cost import MemberCost

# onnx, statistics and the cost model are imported where they are used: `vkpool run` builds the
# parser that registers `vkpool calibrate`, and must not pay for them

OPSET = 17
_MIN_SECONDS = 1e-9  # a difference of medians at or below zero is noise: floor it, and say so


@dataclass(frozen=True)
class Sizes:
    """How big the calibration models are; ``quick`` trades accuracy for seconds.

    With ``grow_to_s``, the vector length, GEMM side and large transfer start at their quick
    values and double while one op (or one run) stays under that many seconds, up to the sizes
    given here: a GPU gets sizes that dwarf its launch cost, a software device sizes it can run.
    """

    tiny_layers: tuple[int, int]
    stream_elems: int
    stream_layers: tuple[int, int]
    gemm_dim: int
    gemm_layers: tuple[int, int]
    transfer_elems: tuple[int, int]
    repeat: int
    grow_to_s: float | None = None


QUICK = Sizes(tiny_layers=(4, 32), stream_elems=1 << 16, stream_layers=(1, 4), gemm_dim=96,
              gemm_layers=(1, 3), transfer_elems=(1 << 8, 1 << 18), repeat=5)
FULL = Sizes(tiny_layers=(4, 64), stream_elems=1 << 24, stream_layers=(2, 10), gemm_dim=3072,
             gemm_layers=(1, 5), transfer_elems=(1 << 8, 1 << 26), repeat=15, grow_to_s=0.02)


# -- generated models ----------------------------------------------------------------------------


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           initializers: list[onnx.TensorProto], name: str) -> bytes:
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model.SerializeToString()


def add_chain_model(elems: int, layers: int) -> bytes:
    """``x + c`` applied ``layers`` times to a float vector of ``elems`` (one shared constant)."""
    from onnx import TensorProto, helper, numpy_helper

    c = numpy_helper.from_array(np.full(elems, 1e-3, np.float32), "c")
    names = ["x"] + [f"a{k}" for k in range(layers)]
    nodes = [helper.make_node("Add", [names[k], "c"], [names[k + 1]]) for k in range(layers)]
    vec = [elems]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, vec)],
                  [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, vec)], [c], "add_chain")


def matmul_chain_model(dim: int, layers: int, seed: int = 0) -> bytes:
    """``x @ W`` applied ``layers`` times, ``x`` and ``W`` square ``dim × dim``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32), "w")
    names = ["x"] + [f"m{k}" for k in range(layers)]
    nodes = [helper.make_node("MatMul", [names[k], "w"], [names[k + 1]]) for k in range(layers)]
    sq = [dim, dim]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, sq)],
                  [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, sq)], [w], "matmul_chain")


def upload_model(elems: int) -> bytes:
    """The first element of a float vector of ``elems``: the run moves ``elems`` floats in, 1 out."""
    from onnx import TensorProto, helper, numpy_helper

    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s", 0), ("e", 1))]
    nodes = [helper.make_node("Slice", ["x", "s", "e"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elems])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], consts, "upload")


def download_model(elems: int, *, read_back: bool) -> bytes:
    """One float expanded to ``elems``; with ``read_back`` that vector is the output, else only
    its first element is (a ``Slice`` more): the two differ by the read-back of ``elems`` floats."""
    from onnx import TensorProto, helper, numpy_helper

    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("shape", elems), ("s", 0), ("e", 1))]
    nodes = [helper.make_node("Expand", ["x", "shape"], ["y"])]
    out = "y"
    if not read_back:
        nodes.append(helper.make_node("Slice", ["y", "s", "e"], ["z"]))
        out = "z"
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, [elems if read_back else 1])], consts,
                  "download")


# -- measuring -------------------------------------------------------------------------------------


def _graph_sums(model: bytes) -> tuple[int, int]:
    """(FLOPs, bytes read + written) of one op of ``model`` as the planner counts them."""
    from vkpool.model import load_model
    from vkpool.partition.graph import build_graph

    with progress.muted():  # one step of the calibration
        G = build_graph(load_model(model))
    attrs = G.nodes[G.graph["order"][-1]]
    return int(attrs["flops"]), int(attrs["bytes_read"] + attrs["bytes_written"])


class Timer:
    """Median wall time of ``Session.run`` for generated models on one pool member."""

    def __init__(self, pool: Any, member_id: str, repeat: int) -> None:
        self.pool = pool
        self.member_id = member_id
        self.repeat = repeat

    def median_s(self, model: bytes) -> float:
        import statistics

        from vkpool.session import Session

        with progress.muted():  # one step of the calibration
            session = Session(model, pool=self.pool, device=self.member_id)
        try:
            feeds = {arg.name: np.random.default_rng(0).standard_normal(arg.shape).astype(np.float32)
                     for arg in session.get_inputs()}
            session.run(None, feeds)  # first run: pipelines, caches, page faults
            times = []
            for _ in range(self.repeat):
                t0 = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            session.close()

    def grown(self, build: Callable[[int], bytes], start: int, limit: int, target_s: float | None) -> int:
        """The first of ``start, 2·start, …, limit`` whose model runs for ``target_s`` or more."""
        size = start
        while target_s is not None and size < limit:
            saved, self.repeat = self.repeat, 1
            try:
                if self.median_s(build(size)) >= target_s:
                    break
            finally:
                self.repeat = saved
            size = min(2 * size, limit)
        return size

    def slope(self, build: Callable[[int], bytes], sizes: tuple[int, int]) -> tuple[float, float, bool]:
        """(seconds per unit of size, seconds at the smaller size, whether the slope was noise)."""
        small, large = sizes
        t_small, t_large = self.median_s(build(small)), self.median_s(build(large))
        per = (t_large - t_small) / (large - small)
        return max(per, _MIN_SECONDS / (large - small)), t_small, per <= 0


#: the figures :func:`measure` reports, the steps of its progress
FIGURES = 6
#: figures that fall back to the memory bandwidth when their difference is noise (a copy cannot beat it)
TRANSFERS = ("host → device", "device → host")


def measure(pool: Any, member_id: str, sizes: Sizes, out: TextIO | None = None,
            noisy: list[str] | None = None) -> MemberCost:
    """Measures one member; prints each figure as it comes (to ``out``, default stdout) and
    advances an open ``calibrate`` task (:mod:`vkpool.progress`) by one. The labels of figures
    within timing noise are appended to ``noisy`` (a new list when None)."""
    from vkpool.partition.cost import MemberCost

    out = out or sys.stdout
    timer = Timer(pool, member_id, sizes.repeat)
    noisy = [] if noisy is None else noisy

    def report(label: str, value: str, how: str, is_noise: bool) -> None:
        if is_noise:
            noisy.append(label)
        flag = "  (within noise: floored, or memory bandwidth for a transfer)" if is_noise else ""
        with progress.interlude():
            print(f"  {label:<18} {value:>14}   {how}{flag}", file=out, flush=True)
        progress.advance("calibrate")

    lo, hi = sizes.tiny_layers
    dispatch, t_short, bad = timer.slope(lambda n: add_chain_model(16, n), sizes.tiny_layers)
    report("dispatch overhead", f"{dispatch * 1e6:.2f} µs", f"Add chain on 16 floats, {lo} vs {hi} ops", bad)
    latency = max((t_short - lo * dispatch) / 2, _MIN_SECONDS)
    report("transfer latency", f"{latency * 1e6:.2f} µs", f"half the rest of a {lo}-op run", latency <= _MIN_SECONDS)

    grow = sizes.grow_to_s
    elems = timer.grown(lambda n: add_chain_model(n, 1), QUICK.stream_elems, sizes.stream_elems, grow)
    _, stream_bytes = _graph_sums(add_chain_model(elems, 1))
    per_op, _, bad = timer.slope(lambda n: add_chain_model(elems, n), sizes.stream_layers)
    bandwidth = stream_bytes / max(per_op - dispatch, _MIN_SECONDS)
    report("memory bandwidth", f"{bandwidth / 1e9:.2f} GB/s",
           f"Add chain on {elems} floats, {stream_bytes} B per op", bad or per_op <= dispatch)

    d = timer.grown(lambda n: matmul_chain_model(n, 1), QUICK.gemm_dim, sizes.gemm_dim, grow)
    gemm_flops, _ = _graph_sums(matmul_chain_model(d, 1))
    per_op, _, bad = timer.slope(lambda n: matmul_chain_model(d, n), sizes.gemm_layers)
    flops = gemm_flops / max(per_op - dispatch, _MIN_SECONDS)
    report("GEMM", f"{flops / 1e9:.2f} GFLOP/s", f"MatMul chain {d}×{d}·{d}×{d}", bad or per_op <= dispatch)

    small = sizes.transfer_elems[0]
    large = timer.grown(upload_model, QUICK.transfer_elems[1], sizes.transfer_elems[1], grow)
    per_elem, _, bad = timer.slope(upload_model, (small, large))
    h2d = bandwidth if bad else 4 / per_elem
    report("host → device", f"{h2d / 1e9:.2f} GB/s", f"input of {small} vs {large} floats", bad)

    back = timer.median_s(download_model(large, read_back=True))
    kept = timer.median_s(download_model(large, read_back=False))
    read_s = back - kept + dispatch
    bad = read_s <= 0
    d2h = bandwidth if bad else 4 * large / read_s
    report("device → host", f"{d2h / 1e9:.2f} GB/s", f"output of {large} floats vs its first one", bad)
    if noisy:
        print(f"  {len(noisy)} figure(s) were within timing noise ({', '.join(noisy)}); "
              "an idle machine (and no --quick) gives better figures", file=out)
    return MemberCost(flops_per_s=flops, bytes_per_s=bandwidth, dispatch_s=dispatch, h2d_bytes_per_s=h2d,
                      d2h_bytes_per_s=d2h, transfer_latency_s=latency)


# -- the command -----------------------------------------------------------------------------------


def _tune(pool: Any, member: Any, repeat: int, *, save: bool) -> None:
    """The tuning pass of a CPU-like device, whose properties do not decide its product tiling
    (:mod:`vkpool.kernel_variants`): each register tile timed, the fastest kept for the figures
    that follow and, with ``save``, for every later start of vkpool on this device and driver."""
    from vkpool.kernel_variants import save_tuned, tune_register_tile

    print("  tuning the product tiling (register tiles TMxTNxWG: a 256² MatMul + a 64-channel 3x3 Conv)",
          flush=True)
    with progress.muted():
        best, timings = tune_register_tile(pool, member, max(3, repeat // 3), sys.stdout)
    print(f"  fastest: {'x'.join(map(str, best))}", flush=True)
    if save:
        print(f"  wrote {save_tuned(member.info, best, timings)}", flush=True)


HELP = """\
Measure each pool member with small generated ONNX models run through vkpool.Session, and write
the figures the planner's cost model reads:

  dispatch overhead   a chain of Add ops on 16 floats, short vs long
  transfer latency    the rest of a short run, halved (one upload + one download per run)
  memory bandwidth    a chain of Add ops on a large vector
  GEMM FLOP/s         a chain of square MatMul ops
  host -> device      Slice of the first element of a small vs a large input
  device -> host      a large Expand output read back vs sliced to one float

Each figure is a difference of two medians, so the fixed cost of a run cancels out. Results go to
$VKPOOL_CACHE_DIR/calibration/<device uuid>.json (default ~/.cache/vkpool/calibration/), one file
per physical device (splits of a device share it), host-<hostname>.json for the host member,
each valid for the driver (for the host, the engine: onnxruntime or numpy) it was measured with.
`vkpool plan`, vkpool.Session and the daemon price members with them; a member without a file
uses the defaults of its kind. Once every member is measured, a model no one places goes to the
member predicted fastest (config `placement: fastest`, the default). A member with a figure
within timing noise (floored) gets no file: the command says which and exits 1 (a transfer
within noise is priced at the memory bandwidth and kept). On a CPU-like Vulkan device (lavapipe)
a tuning pass comes first: each register tile of the product kernels is timed and the fastest
kept in $VKPOOL_CACHE_DIR/tuning/<uuid>.json for that driver. --quick uses tiny models (seconds
on a software device) to check the setup: it prints the figures and writes nothing.
"""


def add_parser(subparsers: Any) -> None:
    from vkpool.cli import positive_int

    p = subparsers.add_parser("calibrate", help="measure each member's speeds for the planner's cost model",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="Examples:\n  vkpool calibrate\n  vkpool calibrate --member vk0 --quick")
    p.add_argument("--member", action="append", default=[], metavar="ID",
                   help="measure only this member (repeatable; default: every member)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models and 5 repeats: seconds, rough figures, printed and not written "
                        "(default: sizes grow until an op takes 20 ms, up to 16 Mi floats, 3072² GEMM, "
                        "256 MiB transfers)")
    p.add_argument("--repeat", type=positive_int, metavar="N",
                   help="timed runs per model (median; default 15, 5 with --quick)")
    p.add_argument("--no-save", action="store_true", help="print the figures, write nothing")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from vkpool.host_engine import engine_label
    from vkpool.partition.cost import calibration_driver, calibration_key, save_calibration
    from vkpool.pool import DevicePool

    sizes = QUICK if args.quick else FULL
    if args.repeat is not None:
        sizes = dataclasses.replace(sizes, repeat=args.repeat)
    unwritten: list[str] = []
    pool = DevicePool.from_config(None)
    try:
        known = [m.id for m in pool.members]
        unknown = [i for i in args.member if i not in known]
        if unknown:
            raise ValueError(f"unknown member(s) {', '.join(unknown)}; the pool has {', '.join(known)}")
        chosen = [m for m in pool.members if not args.member or m.id in args.member]
        done: dict[str, str] = {}
        for member in chosen:
            info = getattr(member, "info", None)
            key = calibration_key(member)
            if key in done:
                print(f"{member.id}: same device as {done[key]}, measured once", flush=True)
                continue
            done[key] = member.id
            name = info.name if info is not None else f"host ({engine_label(member.engine)})"
            print(f"{member.id}: {name}, calibrating{' (quick)' if args.quick else ''}", flush=True)
            if info is not None and member.device.gemm.why != "forced" and info.type == "cpu":
                _tune(pool, member, sizes.repeat, save=not (args.quick or args.no_save))
            noisy: list[str] = []
            with progress.task("calibrate", FIGURES, what=member.id):
                cost = measure(pool, member.id, sizes, noisy=noisy)
            floored = [label for label in noisy if label not in TRANSFERS]
            if args.no_save:
                continue
            if args.quick:
                print("  not written: --quick figures check the setup; `vkpool calibrate` measures for the "
                      "planner", flush=True)
            elif floored:
                unwritten.append(member.id)
                print(f"  not written: {', '.join(floored)} within timing noise would mislead every plan; "
                      "calibrate again on an idle machine", flush=True)
            else:
                path = save_calibration(key, cost, device_name=name, driver=calibration_driver(member))
                print(f"  wrote {path}", flush=True)
    finally:
        pool.close()
    if unwritten:
        print(f"vkpool: error: no calibration written for {', '.join(unwritten)}", file=sys.stderr)
        return 1
    return 0

