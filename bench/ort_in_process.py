"""How an onnxruntime session in the same process changes vkpool's latency.

Usage: python -m bench.ort_in_process MODEL.onnx [--device vk0] [--runs 200]

Times ``Session.run`` (median of ``--runs`` after 20 warm-up runs) three times in one process:
before any onnxruntime session exists, with a CPU session of the same model alive (after one run
of it), and after that session is deleted.
"""
from __future__ import annotations

import argparse


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

    def median_ms() -> float:
        return median_run_s(lambda: sess.run(None, feeds), args.runs) * 1e3

    print(f"{args.model}: before onnxruntime {median_ms():.3f} ms", flush=True)
    ref = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    ref.run(None, feeds)
    print(f"{args.model}: with an onnxruntime session alive {median_ms():.3f} ms", flush=True)
    del ref
    print(f"{args.model}: after it is deleted {median_ms():.3f} ms", flush=True)
    sess.close()


if __name__ == "__main__":
    main()
