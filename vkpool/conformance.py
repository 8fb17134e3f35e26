"""Runs every ONNX backend node test case on the default Vulkan member; writes a markdown report.

``python -m vkpool.conformance --output docs/conformance.md`` (``make conformance``). Each case
goes through ``vkpool.backend`` exactly as ``onnx.backend.test`` drives a backend: prepare the
model, run every data set, compare with the runner's own ``assert_similar_outputs`` at the case's
tolerances. A case ends in one of three states:

- ``passed``: every output matches;
- ``unsupported``: vkpool refused the model at load (an op, element type or attribute it has
  no kernel for), with its error;
- ``failed``: a wrong result, an exception while running, or the worker crashed or timed out.

Cases run in worker subprocesses, one case at a time each, so a native crash in the Vulkan
driver or a hang costs one case: the worker is replaced and the run goes on.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Sequence

PASSED, FAILED, UNSUPPORTED = "passed", "failed", "unsupported"
#: where the onnx backend test runner takes its tolerances from when a case sets none
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-7
_REASON_CHARS = 160


@dataclass(frozen=True)
class Case:
    """One node test: the serialized model, its data sets (inputs, expected outputs), tolerances."""

    name: str
    op: str
    model: bytes
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL


@dataclass(frozen=True)
class Outcome:
    name: str
    op: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    #: a passed case whose every node was folded on the host at load: no kernel ran
    folded: bool = False


def _schema_names() -> dict[str, str]:
    """Op names of the ai.onnx domain keyed by their lowercase, underscore-free spelling."""
    import onnx.defs

    schemas = onnx.defs.get_all_schemas_with_history()
    return {s.name.lower(): s.name for s in schemas if s.domain in ("", "ai.onnx")}


def op_under_test(name: str, op_types: Sequence[str], schemas: dict[str, str]) -> str:
    """The op a case exercises: the node of a one-node model, else the op its name starts with.

    Expanded cases (``*_expanded``) run a function body of many primitive nodes; they count for
    the op whose body it is.
    """
    if len(set(op_types)) == 1:
        return op_types[0]
    key = name.removeprefix("test_").replace("_", "").lower()
    best = max((s for s in schemas if key.startswith(s)), key=len, default="")
    if best:
        return schemas[best]
    return op_types[-1] if op_types else "?"


def load_cases(pattern: str | None = None) -> list[Case]:
    """Every node test case of the installed onnx whose name matches ``pattern`` (a regex)."""
    from onnx.backend.test.loader import load_model_tests
    from onnx.backend.test.runner import _normalize_tensor

    regex = re.compile(pattern) if pattern else None
    schemas = _schema_names()
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overflow and divide warnings of the generators' own data
        tests = load_model_tests(kind="node")
    for test in tests:
        if test.model is None or (regex is not None and not regex.search(test.name)):
            continue
        data_sets = [([_normalize_tensor(x) for x in inputs], [_normalize_tensor(y) for y in outputs])
                     for inputs, outputs in (test.data_sets or [])]
        op = op_under_test(test.name, [n.op_type for n in test.model.graph.node], schemas)
        cases.append(Case(test.name, op, test.model.SerializeToString(), data_sets, test.rtol, test.atol))
    return cases


def short_reason(exc: BaseException) -> str:
    """One line: the exception type and the informative lines of its message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # numpy's assert_allclose starts with a blank line and a restatement of the tolerances
    noise = ("Not equal to tolerance", "x:", "y:", "ACTUAL", "DESIRED")
    lines = [ln for ln in lines if not ln.startswith(noise)]
    text = "; ".join(lines) or type(exc).__name__
    if not isinstance(exc, AssertionError):
        text = f"{type(exc).__name__}: {text}"
    text = text.replace("|", "/")
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def run_case(case: Case) -> Outcome:
    """Runs one case in this process (a worker calls this); never raises for a case's own errors."""
    import onnx
    from onnx.backend.test.runner import BackendIsNotSupposedToImplementIt, Runner

    from vkpool import backend
    from vkpool.dynamic import kernel_nodes
    from vkpool.kernels.base import UnsupportedOp

    start = time.perf_counter()

    def outcome(status: str, reason: str = "", folded: bool = False) -> Outcome:
        return Outcome(case.name, case.op, status, reason, time.perf_counter() - start, folded)

    model = onnx.load_from_string(case.model)
    try:
        rep = backend.prepare(model, "CPU")
    except (BackendIsNotSupposedToImplementIt, UnsupportedOp) as exc:
        return outcome(UNSUPPORTED, short_reason(exc).removeprefix(f"{type(exc).__name__}: "))
    except Exception as exc:  # any other load error is this case's failure, reported, not raised
        return outcome(FAILED, "load: " + short_reason(exc))
    try:
        for inputs, expected in case.data_sets:
            try:
                got = list(rep.run(inputs))
            except (BackendIsNotSupposedToImplementIt, UnsupportedOp) as exc:
                # the part of a model after a cut at fed values is compiled on its first run
                return outcome(UNSUPPORTED, short_reason(exc).removeprefix(f"{type(exc).__name__}: "))
            Runner.assert_similar_outputs(expected, got, rtol=case.rtol, atol=case.atol)
        folded = kernel_nodes(rep.session) == 0
    except Exception as exc:
        return outcome(FAILED, short_reason(exc))
    finally:
        rep.close()
    return outcome(PASSED, folded=folded)


# -- isolation: worker subprocesses ------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """A worker's loop: a case in, its outcome out, until it receives None."""
    warnings.simplefilter("ignore")  # numpy overflow warnings of the cases' own data
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send(run_case(case))


def device_name() -> str:
    """The device of the member ``vkpool.backend`` runs on, with its driver."""
    from vkpool.backend import shared_pool

    members = shared_pool().vulkan_members
    if not members:
        return "no Vulkan member"
    info = members[0].info
    return f"{info.name}, driver {info.driver_name} {info.driver_info}".strip()


def _describe(conn: Connection) -> None:
    conn.send(device_name())


class Worker:
    """A subprocess running cases one at a time; ``restart`` replaces it after a crash or hang."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.case: Case | None = None
        self.started = 0.0
        self._start()

    def _start(self) -> None:
        self.conn, child = self._ctx.Pipe()
        self.process = self._ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def submit(self, case: Case) -> None:
        self.case, self.started = case, time.monotonic()
        self.conn.send(case)

    def receive(self) -> Outcome:
        """The outcome of the submitted case; a dead worker yields a 'crashed' failure."""
        case, self.case = self.case, None
        assert case is not None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            code = self.process.exitcode
            self.restart()
            return Outcome(case.name, case.op, FAILED, f"crashed (worker exit code {code})",
                           time.monotonic() - self.started)

    def expire(self) -> Outcome:
        case, self.case = self.case, None
        assert case is not None
        self.restart()
        return Outcome(case.name, case.op, FAILED, "timeout", time.monotonic() - self.started)

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(10)
        self.kill()


def run_cases(cases: Sequence[Case], *, jobs: int = 1, timeout: float = 60.0,
              progress: Callable[[Outcome, int, int, Counter[str]], None] | None = None) -> list[Outcome]:
    """Runs ``cases`` in ``jobs`` worker subprocesses, each case limited to ``timeout`` seconds.

    Outcomes come back in the order of ``cases``.
    """
    ctx = mp.get_context("spawn")  # a fresh interpreter: no Vulkan state inherited by fork
    workers = [Worker(ctx) for _ in range(max(1, min(jobs, len(cases))))]
    pending = list(reversed(cases))
    done: dict[str, Outcome] = {}
    counts: Counter[str] = Counter()
    try:
        for w in workers:
            if pending:
                w.submit(pending.pop())
        while any(w.case is not None for w in workers):
            busy = [w for w in workers if w.case is not None]
            now = time.monotonic()
            left = min(w.started + timeout - now for w in busy)
            ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], max(0.0, left))
            for w in busy:
                if w.conn in ready or w.process.sentinel in ready:
                    outcome = w.receive()
                elif time.monotonic() - w.started >= timeout:
                    outcome = w.expire()
                else:
                    continue
                done[outcome.name] = outcome
                counts[outcome.status] += 1
                if progress is not None:
                    progress(outcome, len(done), len(cases), counts)
                if pending:
                    w.submit(pending.pop())
    finally:
        for w in workers:
            w.stop()
    return [done[c.name] for c in cases]


def query_device_name() -> str:
    """The device name, asked of a subprocess so this process never loads the Vulkan driver."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_describe, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        return parent.recv() if parent.poll(120) else "unknown (the device query timed out)"
    except EOFError:
        return "unknown (the device query crashed)"
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


# -- the report ----------------------------------------------------------------------------------


@dataclass
class Summary:
    outcomes: list[Outcome]
    by_op: dict[str, Counter[str]] = field(init=False)
    totals: Counter[str] = field(init=False)

    def __post_init__(self) -> None:
        self.by_op = defaultdict(Counter)
        self.totals = Counter()
        for o in self.outcomes:
            self.by_op[o.op][o.status] += 1
            self.totals[o.status] += 1


def write_markdown(outcomes: Sequence[Outcome], *, command: str, onnx_version: str, device: str,
                   rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> str:
    """The report: totals, per-op counts, the failed cases with reasons, the unsupported reasons."""
    s = Summary(list(outcomes))
    total = len(outcomes)
    lines = [
        "# ONNX backend node tests on vkpool",
        "",
        f"Generated by `{command}`: every node test case of onnx {onnx_version}",
        "(`onnx.backend.test.loader.load_model_tests(kind=\"node\")`), each run through `vkpool.backend`",
        f"on {device}.",
        "",
        "| passed | failed | unsupported | total |",
        "|---:|---:|---:|---:|",
        f"| {s.totals[PASSED]} | {s.totals[FAILED]} | {s.totals[UNSUPPORTED]} | {total} |",
        "",
        "Outputs are compared as the onnx backend test runner compares them",
        "(`Runner.assert_similar_outputs`): same count, shapes and dtypes, values within",
        f"rtol {rtol:g} and atol {atol:g}.",
        "*Unsupported*: vkpool refused the model at load (an op, element type or attribute without a",
        "kernel). *Failed*: a wrong result, an error while running, or a crash or timeout of the",
        "case's worker process. Inputs whose values fix output shapes (Reshape's shape, Slice's",
        "starts, ...) cut the model there: the rest is compiled once those values are fed",
        "(docs/dynamic-shapes.md).",
        "",
        "## Per op",
        "",
        "| op | passed | failed | unsupported |",
        "|---|---:|---:|---:|",
    ]
    for op in sorted(s.by_op, key=str.lower):
        c = s.by_op[op]
        lines.append(f"| {op} | {c[PASSED]} | {c[FAILED]} | {c[UNSUPPORTED]} |")
    failed = [o for o in outcomes if o.status == FAILED]
    lines += ["", f"## Failed cases ({len(failed)})", ""]
    if failed:
        lines += ["| case | op | reason |", "|---|---|---|"]
        lines += [f"| {o.name} | {o.op} | {o.reason} |" for o in sorted(failed, key=lambda o: o.name)]
    else:
        lines.append("None.")
    folded = sorted(o.name for o in outcomes if o.folded)
    lines += ["", f"## Passed with every node folded at load ({len(folded)})", "",
              "The outputs of these models follow from static shapes, attributes and inputs that fix",
              "shapes: vkpool computes them on the host (at load, or once those inputs are fed), as it",
              "folds the constant subgraphs of any model, and no kernel runs.", ""]
    lines.append(", ".join(folded) + "." if folded else "None.")
    unsupported = Counter(_reason_kind(o.reason) for o in outcomes if o.status == UNSUPPORTED)
    lines += ["", f"## Why cases are unsupported ({sum(unsupported.values())})", ""]
    if unsupported:
        lines += ["| reason | cases |", "|---|---:|"]
        ranked = sorted(unsupported.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"| {reason} | {n} |" for reason, n in ranked]
    else:
        lines.append("None.")
    return "\n".join(lines) + "\n"


def _reason_kind(reason: str) -> str:
    """Groups refusals that differ only in the model's names, shapes and numbers."""
    reason = re.sub(r"'[^']*'", "'…'", reason)
    reason = re.sub(r"\([^)]*(\)|$)|\[[^\]]*(\]|$)", "", reason)
    reason = re.sub(r"\b\d+\b", "N", reason)
    return re.sub(r"\s+", " ", reason).strip()


def _print_progress(outcome: Outcome, done: int, total: int, counts: Counter[str]) -> None:
    mark = "" if outcome.status == PASSED else f"  {outcome.name}: {outcome.status} {outcome.reason[:80]}"
    print(f"[{done}/{total}] passed {counts[PASSED]} failed {counts[FAILED]} "
          f"unsupported {counts[UNSUPPORTED]}{mark}", file=sys.stderr, flush=True)


def main(argv: Iterable[str] | None = None) -> int:
    import onnx

    parser = argparse.ArgumentParser(prog="python -m vkpool.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--output", "-o", help="markdown file to write (default: print it)")
    parser.add_argument("--filter", "-k", help="only the cases whose name matches this regex")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    args = parser.parse_args(list(argv) if argv is not None else None)

    started = time.monotonic()
    print("loading the onnx node test cases ...", file=sys.stderr, flush=True)
    cases = load_cases(args.filter)
    device = query_device_name()
    print(f"{len(cases)} cases on {device}", file=sys.stderr, flush=True)
    outcomes = run_cases(cases, jobs=args.jobs, timeout=args.timeout, progress=_print_progress)
    command = "python -m vkpool.conformance" + (f" --filter '{args.filter}'" if args.filter else "")
    report = write_markdown(outcomes, command=command, onnx_version=onnx.__version__, device=device)
    if args.output:
        # the table of real models (python -m bench.realworld --doc) lives in the same file: keep it
        begin, end = "<!-- BEGIN REAL MODELS -->", "<!-- END REAL MODELS -->"
        try:
            old = open(args.output, encoding="utf-8").read()
        except OSError:
            old = ""
        if begin in old and end in old:
            report = report.rstrip("\n") + "\n\n" + begin + old.split(begin, 1)[1].split(end, 1)[0] + end + "\n"
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(report)
    else:
        sys.stdout.write(report)
    totals = Counter(o.status for o in outcomes)
    print(f"{totals[PASSED]} passed, {totals[FAILED]} failed, {totals[UNSUPPORTED]} unsupported of "
          f"{len(outcomes)} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
