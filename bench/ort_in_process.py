"""How an onnxruntime session in the same process changes vkpool's latency.

Usage: python -m bench.ort_in_process MODEL.onnx [--device vk0] [--runs 200]

Times ``Session.run`` (median of ``--runs`` after 20 warm-up runs) three times in one process:
before any onnxruntime session exists, with a CPU session of the same model alive (after one run
of it), and after that session is deleted. Each phase also reports the GPU time of the recorded
commands (timestamps, median of 5) and, where ``nvidia-smi`` exists, the GPU's SM clock and
performance state sampled right after the timed runs: whether a slow phase is slow on the GPU.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device")
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    import onnxruntime as ort

    from bench.stats import median_run_s
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    sess = Session(args.model, device=args.device)
    feeds = random_inputs(sess.get_inputs())

    def phase(label: str) -> None:
        wall = median_run_s(lambda: sess.run(None, feeds), args.runs) * 1e3
        clocks = _gpu_clocks()
        chunk = sess._chunk
        gpu = statistics.median(sum(chunk.device.profile(chunk.commands)) for _ in range(5)) / 1e3
        print(f"{args.model}: {label} {wall:.3f} ms; GPU {gpu:.3f} ms{clocks}", flush=True)

    phase("before onnxruntime")
    ref = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    ref.run(None, feeds)
    phase("with an onnxruntime session alive")
    del ref
    phase("after it is deleted")
    sess.close()


def _gpu_clocks() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,pstate,power.draw",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"; nvidia-smi: {out.strip().splitlines()[0]}" if out.strip() else ""


if __name__ == "__main__":
    main()
