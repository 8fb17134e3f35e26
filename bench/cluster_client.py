"""A driver process of ``bench.cluster --drivers N``: its own session on the bench's cluster.

``python -m bench.cluster_client SPEC.json WINDOW``: connects to the cluster at the spec's
address, opens a session of its model with its options, checks the outputs against the
spec's, warms up, prints ``ready`` and waits for a start time (``time.time()``) on stdin. It
then keeps WINDOW requests in flight for the spec's seconds (``bench.cluster.jobs_per_s``) and
prints one JSON line: ``{"rate": jobs/s, "latencies": [s, ...]}``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    window = int(args[1])

    import vkpool.cluster
    from bench import workloads
    from bench.cluster import jobs_per_s, warm_up

    model = Path(spec["model"])
    feeds = workloads.input_for(model.stem)
    stored = np.load(spec["want"])
    want = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    with vkpool.cluster.connect(spec["address"]) as cluster, \
            cluster.session(model, **spec["options"]) as session:
        warm_up(session, feeds, want, window)
        latencies: list[float] = []
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
        rate = jobs_per_s(session, feeds, want, spec["seconds"], window, spec["load"], start_at, latencies)[0]
    print(json.dumps({"rate": rate, "latencies": latencies}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
