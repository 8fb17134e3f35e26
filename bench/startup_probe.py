"""Where the start of ``vkpool run MODEL`` spends its wall time and host memory.

Two views, both of fresh processes:

1. ``vkpool run MODEL`` itself, run ``--runs`` times in a row (the first may compile pipelines and
   load the model from its file; the later ones find both in the disk caches): wall time and
   peak RSS of each process, and the median of all but the first.
2. The same steps in one process with a checkpoint after each (imports, Vulkan instance and
   physical devices, the pool's logical devices, model load and compile, first run): time since
   the previous checkpoint, resident memory (VmRSS) and peak (VmHWM); the load of the model is
   also timed on its own, and the heavy packages the process imported are listed (a warm start
   imports neither ``onnx`` nor ``networkx``).

    python -m bench.startup_probe MODEL.onnx [--device vk0] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: packages a plain `vkpool run` of a cached model needs none of
HEAVY = ("onnx", "networkx", "yaml", "onnxruntime", "torch")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def staged(model: str, device: str | None) -> list[dict[str, float | str | None]]:
    """Runs the steps of ``vkpool run`` with a checkpoint after each (call in a fresh process)."""
    rows: list[dict[str, float | str | None]] = []
    last = time.perf_counter()

    def mark(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        rows.append({"step": step, "ms": (now - last) * 1e3, "rss_mib": _status_kib("VmRSS") / 1024,
                     "peak_mib": _status_kib("VmHWM") / 1024})
        last = now

    mark("interpreter")
    __import__("numpy")

    mark("import numpy")
    __import__("vulkan")  # the cffi binding, before vkpool imports it

    mark("import vulkan (cffi)")
    import vkpool.session
    from vkpool.session import Session

    mark("import vkpool.session")
    load_s: list[float] = []
    load_model = vkpool.session.load_model

    def timed_load(*args: object, **kwargs: object) -> object:
        t = time.perf_counter()
        try:
            return load_model(*args, **kwargs)
        finally:
            load_s.append(time.perf_counter() - t)

    vkpool.session.load_model = timed_load  # type: ignore[assignment]
    from vkpool.discovery import discover

    infos = discover()
    mark(f"Vulkan instance + {len(infos)} physical device(s)")
    from vkpool.pool import DevicePool

    pool = DevicePool.from_config(None, infos=infos)
    mark("pool: logical devices")
    sess = Session(model, device=device, pool=pool)
    mark(f"load + compile on {sess.member.id}")
    rows.append({"step": "  of which load_model", "ms": sum(load_s) * 1e3, "rss_mib": None, "peak_mib": None})
    from vkpool.cli import _load_feeds

    feeds = _load_feeds([], sess.get_inputs(), 0)
    sess.run(None, feeds)
    mark("first run")
    sess.close()
    pool.close()
    mark("close")
    heavy = sorted(m for m in sys.modules if m in HEAVY)
    rows.append({"step": f"imported: {', '.join(heavy) or 'none of ' + ', '.join(HEAVY)}", "ms": None,
                 "rss_mib": None, "peak_mib": None})
    return rows


def whole_runs(model: str, device: str | None, runs: int) -> list[dict[str, float]]:
    out = []
    cmd = [sys.executable, "-m", "vkpool", "run", model] + (["--device", device] if device else [])
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        wall = time.perf_counter() - t
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"vkpool run failed: {err.strip()}")
        out.append({"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--runs", type=int, default=3, help="fresh `vkpool run` processes to time")
    ap.add_argument("--staged-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)
    if args.staged_only:
        print(json.dumps(staged(args.model, args.device)))
        return 0
    runs = whole_runs(args.model, args.device, args.runs)
    cmd = [sys.executable, "-m", "bench.startup_probe", args.model, "--staged-only"]
    cmd += ["--device", args.device] if args.device else []
    steps = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if args.json:
        print(json.dumps({"runs": runs, "steps": steps}, indent=1))
        return 0
    print(f"`vkpool run {args.model}`, fresh processes:")
    for i, r in enumerate(runs, 1):
        print(f"  run {i}: {r['wall_s']:.3f} s wall, peak RSS {r['peak_rss_mib']:.0f} MiB")
    if len(runs) > 1:
        later = "run 2" if len(runs) == 2 else f"runs 2-{len(runs)}"
        print(f"  {later}: median {statistics.median(r['wall_s'] for r in runs[1:]):.3f} s")
    print("\nthe same steps in one process:")
    print(f"  {'step':<40} {'ms':>9} {'RSS MiB':>9} {'peak MiB':>9}")
    for s in steps:
        cells = "".join(f" {'' if v is None else f'{v:.1f}':>9}" for v in (s["ms"], s["rss_mib"], s["peak_mib"]))
        print(f"  {s['step']:<40}{cells}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
