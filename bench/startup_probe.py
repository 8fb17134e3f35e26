"""Where the start of ``vkpool run MODEL`` spends its wall time and host memory.

Two views, both of fresh processes:

1. ``vkpool run MODEL`` itself, run ``--runs`` times in a row (the first may compile pipelines; the
   later ones find them in the disk cache): wall time and peak RSS of each process.
2. The same steps in one process with a checkpoint after each (imports, Vulkan instance and
   physical devices, the pool's logical devices, model load and compile, first run): time since
   the previous checkpoint, resident memory (VmRSS) and peak (VmHWM).

    python -m bench.startup_probe MODEL.onnx [--device vk0] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def staged(model: str, device: str | None) -> list[dict[str, float | str]]:
    """Runs the steps of ``vkpool run`` with a checkpoint after each (call in a fresh process)."""
    rows: list[dict[str, float | str]] = []
    last = time.perf_counter()

    def mark(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        rows.append({"step": step, "ms": (now - last) * 1e3, "rss_mib": _status_kib("VmRSS") / 1024,
                     "peak_mib": _status_kib("VmHWM") / 1024})
        last = now

    mark("interpreter")
    import numpy  # noqa: F401

    mark("import numpy")
    import onnx  # noqa: F401

    mark("import onnx")
    import vulkan  # noqa: F401

    mark("import vulkan (cffi)")
    from vkpool.session import Session

    mark("import vkpool.session")
    from vkpool.discovery import discover

    infos = discover()
    mark(f"Vulkan instance + {len(infos)} physical device(s)")
    from vkpool.pool import DevicePool

    pool = DevicePool.from_config(None, infos=infos)
    mark("pool: logical devices")
    sess = Session(model, device=device, pool=pool)
    mark(f"load + compile on {sess.member.id}")
    from vkpool.cli import _load_feeds

    feeds = _load_feeds([], sess.get_inputs(), 0)
    sess.run(None, feeds)
    mark("first run")
    sess.close()
    pool.close()
    mark("close")
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
    print("\nthe same steps in one process:")
    print(f"  {'step':<40} {'ms':>9} {'RSS MiB':>9} {'peak MiB':>9}")
    for s in steps:
        print(f"  {s['step']:<40} {s['ms']:>9.1f} {s['rss_mib']:>9.1f} {s['peak_mib']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
