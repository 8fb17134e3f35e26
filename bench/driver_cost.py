"""``python -m bench.driver_cost``: what a cluster session's own Python costs the driver per request.

Runs :class:`vkpool.cluster.session.ClusterSession`'s request path (``submit``, the packing of
calls, the answer of each call with the callers' callbacks) in one thread with no Ray and no
node: calls are answered at once with outputs of the model's size. The figure is the driver's
CPU per request that is vkpool's own, to set beside what ``bench.cluster`` measures on a cluster
(the completion thread's CPU per request there also holds Ray's share of each call). ``--bulk``
measures ``run_many`` instead (its groups, each call answered as it is sent).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench import workloads


def fake_session(inputs: dict[str, tuple[np.dtype, tuple[int, ...]]], outputs: dict[str, np.ndarray],
                 max_bundle: int, answer_at_once: bool = False) -> tuple[Any, list]:
    """A ClusterSession of one replica whose calls are kept in a list instead of going to Ray
    (``answer_at_once``: answered as they are sent)."""
    from vkpool.cluster import session as cs
    from vkpool.cluster.rows import Rows

    s = cs.ClusterSession.__new__(cs.ClusterSession)
    s._closed, s._lock, s._reviver = False, threading.Lock(), None
    s._answering = threading.local()
    s._completions = ThreadPoolExecutor(1)
    s._max_bundle, s._calls_per_step = max_bundle, cs.CALLS_PER_STEP
    s._call_ids = iter(range(1 << 62))
    s._inputs, s._output_names = inputs, list(outputs)
    s._copies = [cs._Copy(0, "k0", ["n0"], "n0/vk0")]
    s._copies[0].max_calls = cs.CALLS_PER_STEP
    sent: list = []

    def start(copy: Any, bundle: list) -> list:
        sent.append([copy, bundle, Rows.pack([f for p in bundle for f in p.rows], s._inputs)])
        return []

    def gather(copy: Any, call: int, refs: list) -> None:
        sent[-1].append(call)
        if answer_at_once:
            answer(s, outputs, *sent.pop())

    s._start = start
    s._gather = gather
    return s, sent


def answer(session: Any, outputs: dict[str, np.ndarray], copy: Any, bundle: list, rows: Any, call: int) -> None:
    """Answers a call with outputs of the model's size, read-only as Ray hands them over."""
    from vkpool.cluster.rows import Rows

    with session._lock:
        copy.calls.pop(call)
    out = Rows(rows.count, {n: np.repeat(v[None], rows.count, 0) for n, v in outputs.items()})
    for tensor in out.tensors.values():
        tensor.flags.writeable = False
    session._answer(copy, bundle, [out])


def per_request_us(name: str, window: int, max_bundle: int, rounds: int = 40, bulk: bool = False) -> float:
    """Best of 5: CPU µs per request of ``window`` submits and their answers, over ``rounds``
    (``bulk``: ``window`` requests of one ``run_many``)."""
    from vkpool.model import load_model

    feeds = workloads.input_for(name)
    model = load_model(workloads.build(name).SerializeToString())
    inputs = {n: (np.dtype(i.dtype), tuple(i.shape)) for n, i in model.inputs}
    outputs = {n: np.zeros(tuple(i.shape), np.dtype(i.dtype)) for n, i in model.outputs}
    session, sent = fake_session(inputs, outputs, max_bundle, answer_at_once=bulk)
    answered = [0]

    def callback(*_: Any) -> None:
        answered[0] += 1

    def one_round() -> None:
        if bulk:
            session.run_many((feeds for _ in range(window)), None, callback, window=window)
            return
        for _ in range(window):
            session.submit(feeds).add_done_callback(callback)
        while sent:
            copy, bundle, rows, call = sent.pop(0)
            answer(session, outputs, copy, bundle, rows, call)
            session._flush(copy)

    for _ in range(rounds // 2):
        one_round()
    best = float("inf")
    for _ in range(5):
        start, done = time.process_time(), answered[0]
        for _ in range(rounds):
            one_round()
        best = min(best, (time.process_time() - start) / (answered[0] - done) * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.driver_cost", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="mnist12_like", help="workload (default mnist12_like)")
    parser.add_argument("--window", type=int, default=256, help="requests submitted per round (default 256)")
    parser.add_argument("--max-bundle", type=int, default=64, help="requests per call at most (default 64)")
    parser.add_argument("--bulk", action="store_true", help="the requests of one run_many instead of submits")
    args = parser.parse_args(argv)
    us = per_request_us(args.model, args.window, args.max_bundle, bulk=args.bulk)
    how = "run_many: groups, packing, answer" if args.bulk else "submit, packing, answer"
    print(f"{args.model}: {us:.2f} µs of the driver's CPU per request ({how}; "
          f"window {args.window}, calls of up to {args.max_bundle}; Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
