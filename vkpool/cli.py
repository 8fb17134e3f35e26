"""The ``vkpool`` command line."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any, Callable

from vkpool import __version__

#: modules that add subcommands: (module, function taking the subparsers object)
COMMAND_MODULES = [
    ("vkpool.partition.cli", "add_parser"),
    ("vkpool.partition.calibrate", "add_parser"),
    ("vkpool.daemon.cli", "add_parsers"),
]

EPILOG = """\
Configuration: --config FILE or $VKPOOL_CONFIG (else the shipped default); see docs/config.md.
Examples:
  vkpool devices                      list the pool's members, budgets and capabilities
  vkpool run model.onnx --check       run once with random inputs, compare with onnxruntime
  vkpool run model.onnx --repeat 100  latency median and percentiles
  vkpool plan model.onnx --budget vk0=256MiB --format text
  vkpool serve                        start the daemon (then: vkpool status, vkpool run --remote)
"""


#: set by :func:`program`: this process is the ``vkpool`` command itself, not a caller of main()
_PROGRAM = False
#: a finished ``vkpool run`` left its session open for the process's exit to release
_LEFT_OPEN: list[Any] = []


def program() -> None:
    """The ``vkpool`` command: :func:`main`, then exit. A one-shot ``vkpool run`` leaves its
    Vulkan device to the process's exit instead of tearing it down (about 30 ms of a 0.5 s
    start on an NVIDIA H200); the pipeline cache is already on disk by then."""
    global _PROGRAM
    _PROGRAM = True
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        code = _stdout_closed()
    if _LEFT_OPEN:
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _stdout_closed() -> int:
    """The reader of stdout left (``vkpool devices | head -1``): end quietly, as ``cat`` does.
    stdout is pointed at /dev/null so that the interpreter's last flush finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, the status of a command a closed pipe ends


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    refused = refused_flag(args)
    if refused:
        print(f"vkpool: error: {refused}", file=sys.stderr)
        return 2
    if args.config:
        os.environ["VKPOOL_CONFIG"] = args.config
    from vkpool import progress

    console = progress.Console()  # long work (loading, uploading, building, calibrating) shows on stderr
    try:
        with progress.reporting(console):
            result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise
    except Exception as exc:  # every failure a user can cause ends in one clear line
        if getattr(args, "debug", False):
            raise
        print(f"vkpool: error: {_describe(exc)}", file=sys.stderr)
        return 1
    return int(result or 0)


def _describe(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc) or name
    return text if name in ("ConfigError", "ModelError", "VulkanUnavailable") else f"{text} [{name}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vkpool",
        description="Pool every Vulkan compute device on this machine and run ONNX models on them, "
                    "in-process or through a daemon shared by many processes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vkpool {__version__}")
    parser.add_argument("--config", metavar="FILE", help="config file (default: $VKPOOL_CONFIG or the shipped one)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser("devices", help="list pool members: devices, budgets, limits, capabilities",
                       description="List every member of the pool built from the config: Vulkan devices "
                                   "(or their splits) and the host member, with budgets and capabilities.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cluster", metavar="ADDRESS", help="every node's members of the Ray cluster at ADDRESS "
                   "(host:port of its head; docs/cluster.md)")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("ops", help="list the supported ONNX ops", description="List the ONNX ops vkpool has kernels for.")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("run", help="run a model once or repeatedly, with random or given inputs",
                       description="Run MODEL and print each output's shape, dtype and checksum.")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input from a .npy file")
    p.add_argument("--device", metavar="ID", help="pool member to run on (vk0, vk0.1, cpu); default: "
                   "the config's placement, as `vkpool plan` shows (not with --remote: the daemon "
                   "places its models)")
    p.add_argument("--check", action="store_true", help="compare with onnxruntime (CPU); exit 1 when an "
                   "output differs by more than --tolerance")
    p.add_argument("--tolerance", type=positive_float, metavar="REL",
                   help=f"with --check: largest difference allowed, relative to the largest |reference| "
                        f"(default {CHECK_TOLERANCE:g})")
    p.add_argument("--repeat", type=non_negative_int, default=0, metavar="N",
                   help="run N more times after up to 20 warm-up runs; print latency percentiles")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--remote", action="store_true", help="run through the daemon instead of in-process")
    p.add_argument("--endpoint", help="daemon endpoint (with --remote)")
    p.set_defaults(func=cmd_run, refuse=REFUSED_RUN)

    for module, fn in COMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        getattr(mod, fn)(sub)
    return parser


# -- flags ---------------------------------------------------------------------------------------
#: largest difference ``vkpool run --check`` allows, relative to the largest |reference| value
CHECK_TOLERANCE = 1e-3


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


#: (flag, attribute, when it cannot be honoured, why): checked before a command runs
Refusal = tuple[str, str, Callable[[argparse.Namespace], bool], str]
REFUSED_RUN: list[Refusal] = [
    ("--device", "device", lambda a: a.remote,
     "--remote runs the model where the daemon's plan puts it; `vkpool plan MODEL --remote` shows where"),
    ("--endpoint", "endpoint", lambda a: not a.remote, "--endpoint names the daemon of --remote"),
    ("--tolerance", "tolerance", lambda a: not a.check, "--tolerance is the limit of --check"),
]


def refused_flag(args: argparse.Namespace) -> str | None:
    """Why a flag given cannot be honoured in this combination, or None when all can."""
    for flag, attr, refused, why in getattr(args, "refuse", []):
        if getattr(args, attr, None) not in (None, False, [], "") and refused(args):
            return f"{flag} cannot be honoured here: {why}"
    return None


# -- devices -----------------------------------------------------------------------------------
def cmd_devices(args: argparse.Namespace) -> int:
    from vkpool.config.loader import placement_policy
    from vkpool.host_engine import engine_label
    from vkpool.kernel_variants import describe as describe_gemm
    from vkpool.partition.cost import has_measured_cost
    from vkpool.pool import DevicePool
    from vkpool.units import format_size

    if args.cluster:
        from vkpool.cluster.cli import cmd_devices as cluster_devices

        return cluster_devices(args)

    pool = DevicePool.from_config(None)
    try:
        if args.json:
            members = [{**d, "measured_speeds": has_measured_cost(m)} for d, m in zip(pool.describe(), pool.members)]
            print(json.dumps({"config": pool.config.path if pool.config else None,
                              "placement": placement_policy(pool.config), "members": members}, indent=2))
            return 0
        rows = [("MEMBER", "DEVICE", "VENDOR", "TYPE", "DRIVER", "API", "HEAP", "BUDGET", "USED")]
        for m in pool.members:
            if m.kind == "vulkan":
                i = m.info
                heap = i.device_local_heap
                rows.append((m.id, i.name, i.vendor, i.type, f"{i.driver_name} {i.driver_info}".strip(),
                             i.api_version, format_size(heap.size), format_size(m.budget_bytes),
                             format_size(m.used_bytes)))
            else:
                rows.append((m.id, f"host ({engine_label(m.engine)})", "-", "cpu", "-", "-", "-",
                             format_size(m.budget_bytes),
                             format_size(m.used_bytes)))
        _table(rows)
        print(_placement_line(pool))
        _print_holders(pool.members)
        seen = set()
        for m in pool.vulkan_members:
            i = m.info
            if i.index in seen:
                continue
            seen.add(i.index)
            caps = ", ".join(k for k, v in i.capabilities.items() if v) or "none"
            heaps = "; ".join(
                f"heap {h.index}: {format_size(h.size)}{' device-local' if h.device_local else ''}"
                + (f", budget {format_size(h.budget)}, usage {format_size(h.usage or 0)}" if h.budget else "")
                for h in i.heaps)
            print(f"\nvk{i.index}: {i.name}  uuid {i.uuid}")
            print(f"  {heaps}")
            print(f"  subgroup {i.subgroup_size}, workgroup ≤ {i.max_workgroup_invocations} invocations "
                  f"{list(i.max_workgroup_size)}, shared memory {format_size(i.max_shared_memory_bytes)}, "
                  f"push constants {i.max_push_constant_bytes} B, storage buffer range "
                  f"{format_size(i.max_storage_buffer_range)}"
                  + (f", loops ≤ {i.max_loop_iterations} iterations per invocation" if i.max_loop_iterations else ""))
            print(f"  capabilities: {caps}")
            print(f"  products and convolutions: {describe_gemm(m.device.gemm)}")
        return 0
    finally:
        pool.close()


def _placement_line(pool: Any) -> str:
    """Where a model no one places goes (``placement`` in the config, ``docs/partitioning.md``)."""
    from vkpool.config.loader import placement_policy
    from vkpool.partition.cost import has_measured_cost

    policy = placement_policy(pool.config)
    unmeasured = [m.id for m in pool.members if not has_measured_cost(m)]
    if policy == "fastest" and not unmeasured:
        return "\nPlacement (fastest): a model goes whole to the member with the least predicted latency."
    why = (f"placement: {policy}" if policy != "fastest" else
           f"speeds not measured for {', '.join(unmeasured)}: `vkpool calibrate` lets the fastest member take it")
    return f"\nPlacement: a model goes whole to the first Vulkan member that holds it ({why})."


def _print_holders(members: list[Any]) -> None:
    """What each vkpool process on this machine holds on each member (the shared ledger)."""
    from vkpool.units import format_size

    rows: list[tuple[Any, ...]] = [("MEMBER", "PID", "PROCESS", "HOLDS")]
    for m in members:
        rows += [(m.id, h.pid, h.command, format_size(h.nbytes)) for h in m.budget.holders()]
    print("\nHeld by processes on this machine:" if len(rows) > 1 else "\nNo vkpool process holds memory.")
    if len(rows) > 1:
        _table(rows)


def _table(rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


# -- ops -----------------------------------------------------------------------------------------
def cmd_ops(args: argparse.Namespace) -> int:
    from vkpool.kernels.registry import supported_ops

    ops = supported_ops()
    if args.json:
        print(json.dumps(ops))
    else:
        print(f"{len(ops)} supported ONNX ops (domain ai.onnx):")
        line = ""
        for op in ops:
            if len(line) + len(op) + 2 > 100:
                print("  " + line.rstrip(", "))
                line = ""
            line += op + ", "
        if line:
            print("  " + line.rstrip(", "))
    return 0


# -- run -----------------------------------------------------------------------------------------
def random_inputs(inputs: list[Any], seed: int = 0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in inputs:
        shape, dtype = tuple(arg.shape), np.dtype(arg.dtype)
        if dtype.kind == "f":
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[arg.name] = rng.integers(0, 10, shape).astype(dtype)
    return feeds


def _load_feeds(specs: list[str], inputs: list[Any], seed: int) -> dict[str, Any]:
    import numpy as np

    # an input with dims bound only at run time gets no random values: it needs --input
    feeds = random_inputs([i for i in inputs if None not in i.shape], seed)
    names = [i.name for i in inputs]
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--input takes NAME=FILE.npy, got {spec!r}")
        if name not in names:
            raise ValueError(f"--input {name}: the model has no input {name!r} (inputs: {', '.join(names)})")
        feeds[name] = np.load(path)
    for i in inputs:
        if i.name not in feeds:
            raise ValueError(f"input {i.name!r} has dims its feed binds ({['?' if d is None else d for d in i.shape]}): "
                             f"give --input {i.name}=FILE.npy")
    return feeds


def cmd_run(args: argparse.Namespace) -> int:
    if args.check:
        _onnxruntime()  # before the run: a check that cannot happen is refused, not skipped
    if args.remote:
        from vkpool.daemon.cli import remote_run

        return int(remote_run(args) or 0)
    from vkpool.session import Session

    t0 = time.perf_counter()
    sess = Session(args.model, device=args.device)
    finished = False
    try:
        t_load = time.perf_counter() - t0
        feeds = _load_feeds(args.input, sess.get_inputs(), args.seed)
        t1 = time.perf_counter()
        outputs = sess.run(None, feeds)
        t_first = time.perf_counter() - t1
        print(f"model {args.model} on {_where(sess)}: loaded in {t_load * 1e3:.1f} ms, "
              f"first run {t_first * 1e3:.2f} ms")
        print_outputs(sess, outputs)
        # timed before the check: onnxruntime in this process slowed the runs after it (a 1 GiB
        # product ran 0.77 ms after it against 0.32 ms before, on an H200)
        print_latency(sess, feeds, args.repeat)
        code = 0
        if args.check:
            code = check_against_onnxruntime(args.model, feeds, sess, outputs, args.tolerance)
        finished = True
    finally:
        if finished and _PROGRAM:
            _LEFT_OPEN.append(sess)
        else:
            sess.close()
    return code


def _where(sess: Any) -> str:
    """The member a session runs on, with the engine of a host chunk (``cpu (onnxruntime 1.32.0)``)."""
    from vkpool.placement import engine_suffix

    plan = sess.plan
    return sess.member.id + (engine_suffix(plan) if hasattr(plan, "engine") else "")


def print_outputs(sess: Any, outputs: list[Any]) -> None:
    """Each output's name, shape, dtype and checksum (a Session or a daemon RemoteSession)."""
    for arg, value in zip(sess.get_outputs(), outputs):
        print(f"  {arg.name}: shape {list(value.shape)} {value.dtype} checksum {_checksum(value)}")


def print_latency(sess: Any, feeds: dict[str, Any], repeat: int) -> None:
    """Runs ``repeat`` more times, after as many warm-up runs as the benchmark protocol (20, or
    ``repeat`` if fewer: clocks and caches settle), and prints the median, p05 and p95 latency."""
    import numpy as np

    if repeat <= 0:
        return
    for _ in range(min(20, repeat)):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    q = np.percentile(np.array(times) * 1e3, [5, 50, 95])
    print(f"latency over {repeat} runs: median {q[1]:.3f} ms, p05 {q[0]:.3f} ms, p95 {q[2]:.3f} ms")


def _checksum(value: Any) -> str:
    import numpy as np

    if value.dtype.kind in "fc":
        return f"sum={float(np.sum(value, dtype=np.float64)):.6g} abs={float(np.abs(value).sum(dtype=np.float64)):.6g}"
    return f"sum={int(np.sum(value.astype(np.int64)))}"


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeError("--check compares with onnxruntime, which is not installed: pip install "
                           "onnxruntime (`make test` installs it)") from None
    return onnxruntime


def check_against_onnxruntime(model: str, feeds: dict[str, Any], sess: Any, outputs: list[Any],
                              tolerance: float | None = None) -> int:
    """Prints each output's largest difference from onnxruntime (CPU); 1 when one is past
    ``tolerance`` (relative to the largest |reference|; None: :data:`CHECK_TOLERANCE`), has NaN
    where the reference has none, or differs in shape, dtype or (for integers and booleans) any
    element; else 0."""
    import numpy as np

    tolerance = CHECK_TOLERANCE if tolerance is None else tolerance

    ref = _onnxruntime().InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    failed = []
    for arg, got, want in zip(sess.get_outputs(), outputs, ref):
        want = np.asarray(want)
        if got.shape != want.shape or got.dtype != want.dtype:
            print(f"  check {arg.name}: {got.dtype}{list(got.shape)} where onnxruntime gives "
                  f"{want.dtype}{list(want.shape)}: DIFFERENT")
            failed.append(arg.name)
        elif got.dtype.kind in "fc":
            wide = np.complex128 if got.dtype.kind == "c" else np.float64
            g, w = got.astype(wide), want.astype(wide)
            with np.errstate(invalid="ignore"):  # inf - inf where both are inf: equal, so 0
                diff = np.where((np.isnan(g) & np.isnan(w)) | (g == w), 0.0, np.abs(g - w))
            scale = float(np.max(np.abs(np.where(np.isfinite(w), w, 0.0)), initial=0.0))
            largest = float(np.max(diff, initial=0.0))  # NaN when one side alone has NaN
            ok = bool(np.all(diff <= tolerance * max(scale, 1e-30)))
            rel = largest / max(scale, 1e-30)
            print(f"  check {arg.name}: max abs diff {largest:.3g}, relative to max |ref| {rel:.3g}"
                  f"{'' if ok else f': DIFFERENT (tolerance {tolerance:g})'}")
            if not ok:
                failed.append(arg.name)
        else:
            same = np.array_equal(got, want)
            print(f"  check {arg.name}: {'equal' if same else 'DIFFERENT'}")
            if not same:
                failed.append(arg.name)
    if failed:
        print(f"vkpool: error: --check: {len(failed)} output(s) differ from onnxruntime: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


Command = Callable[[argparse.Namespace], int]

if __name__ == "__main__":
    sys.exit(main())
