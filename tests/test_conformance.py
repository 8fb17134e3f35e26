"""The conformance runner (``make conformance``) on a handful of hand-made cases, on the real device."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest
from onnx import helper

from vkpool.conformance import (
    FAILED,
    PASSED,
    UNSUPPORTED,
    Case,
    Outcome,
    Worker,
    op_under_test,
    run_case,
    run_cases,
    write_markdown,
)


def _case(name: str, node: Any, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
          domains: tuple[str, ...] = ()) -> Case:
    def info(n: str, x: np.ndarray) -> Any:
        return helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)

    graph = helper.make_graph([node], name, [info(n, x) for n, x in inputs.items()],
                              [info(n, y) for n, y in outputs.items()])
    opsets = [helper.make_opsetid("", 21), *(helper.make_opsetid(d, 1) for d in domains)]
    model = helper.make_model(graph, opset_imports=opsets)
    data_set = (list(inputs.values()), list(outputs.values()))
    return Case(name, node.op_type, model.SerializeToString(), [data_set])


X = np.array([[-1.5, 2.0, -3.25], [4.0, -0.5, 0.0]], np.float32)


def abs_case(name: str = "test_abs_small", expected: np.ndarray | None = None) -> Case:
    y = np.abs(X) if expected is None else expected
    return _case(name, helper.make_node("Abs", ["x"], ["y"]), {"x": X}, {"y": y})


def test_passing_case() -> None:
    outcome = run_case(abs_case())
    assert (outcome.status, outcome.reason, outcome.folded) == (PASSED, "", False)


def test_shape_input_is_bound_from_the_feed() -> None:
    shape = np.array([3, 2], np.int64)
    case = _case("test_reshape_fed_shape", helper.make_node("Reshape", ["x", "shape"], ["y"]),
                 {"x": X, "shape": shape}, {"y": X.reshape(3, 2)})
    assert run_case(case).status == PASSED


def test_wrong_result_fails_with_the_mismatch() -> None:
    outcome = run_case(abs_case("test_abs_wrong", expected=np.abs(X) + 1))
    assert outcome.status == FAILED
    assert "Mismatched elements: 6 / 6" in outcome.reason


def test_wrong_dtype_fails() -> None:
    outcome = run_case(abs_case("test_abs_dtype", expected=np.abs(X).astype(np.float64)))
    assert outcome.status == FAILED


def test_op_without_kernel_is_unsupported() -> None:
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")
    outcome = run_case(_case("test_frobnicate", node, {"x": X}, {"y": X}, domains=("com.example",)))
    assert outcome.status == UNSUPPORTED
    assert "com.example::Frobnicate" in outcome.reason


def test_unsupported_element_type() -> None:
    x = X.astype(np.float64)
    outcome = run_case(_case("test_einsum_f64", helper.make_node("Einsum", ["x"], ["y"], equation="ij->ji"),
                             {"x": x}, {"y": x.T.copy()}))
    assert outcome.status == UNSUPPORTED
    assert "float64" in outcome.reason


def test_workers_isolate_cases_and_survive_a_timeout() -> None:
    cases = [abs_case("test_a"), abs_case("test_b", expected=np.abs(X) * 2)]
    outcomes = run_cases(cases, jobs=1, timeout=60)
    assert [(o.name, o.status) for o in outcomes] == [("test_a", PASSED), ("test_b", FAILED)]
    # a limit no case can meet: each one times out, the worker is replaced, the run completes
    seen: list[int] = []
    outcomes = run_cases(cases, jobs=2, timeout=0.0,
                         progress=lambda outcome, done, total, counts: seen.append(done))
    assert [(o.status, o.reason) for o in outcomes] == [(FAILED, "timeout")] * 2
    assert seen == [1, 2]


def test_a_crashed_worker_fails_its_case_and_is_replaced() -> None:
    worker = Worker(mp.get_context("spawn"))
    try:
        worker.submit(abs_case("test_crash"))
        os.kill(worker.process.pid, signal.SIGKILL)  # as a segfault in the driver would end it
        outcome = worker.receive()
        assert (outcome.name, outcome.status, outcome.reason) == ("test_crash", FAILED,
                                                                  "crashed (worker exit code -9)")
        worker.submit(abs_case("test_after_crash"))
        assert worker.receive().status == PASSED
    finally:
        worker.stop()


@pytest.mark.parametrize("name, ops, expected", [
    ("test_abs", ["Abs"], "Abs"),
    ("test_softmax_axis_0_expanded", ["Constant", "ReduceMax", "Sub", "Exp", "ReduceSum", "Div"], "Softmax"),
    ("test_reduce_log_sum_exp_default_axes_keepdims_example_expanded", ["ReduceSum", "Exp", "Log"],
     "ReduceLogSumExp"),
    ("test_layer_normalization_2d_axis0_expanded", ["Shape", "Sub"], "LayerNormalization"),
])
def test_op_under_test(name: str, ops: list[str], expected: str) -> None:
    names = ("Abs", "Softmax", "SoftmaxCrossEntropyLoss", "ReduceLogSum", "ReduceLogSumExp", "ReduceSum",
             "LayerNormalization", "Sub")
    schemas = {n.lower(): n for n in names}
    assert op_under_test(name, ops, schemas) == expected


def test_markdown_report() -> None:
    outcomes = [
        Outcome("test_abs", "Abs", PASSED),
        Outcome("test_abs_example", "Abs", FAILED, "Mismatched elements: 1 / 3 (33.3%)"),
        Outcome("test_acos", "Acos", UNSUPPORTED, "the model uses ops vkpool does not support: Acos"),
        Outcome("test_range", "Range", PASSED, folded=True),
    ]
    text = write_markdown(outcomes, command="python -m vkpool.conformance", onnx_version="1.99.0",
                          device="llvmpipe")
    lines = text.splitlines()
    assert lines[0].startswith("# ")
    assert "| 2 | 1 | 1 | 4 |" in lines[:12]  # totals: passed, failed, unsupported, total
    assert "onnx 1.99.0" in text and "llvmpipe" in text and "`python -m vkpool.conformance`" in text
    assert "rtol 0.001 and atol 1e-07" in text.replace("\n", " ")
    assert "| Abs | 1 | 1 | 0 |" in lines and "| Acos | 0 | 0 | 1 |" in lines
    assert "| test_abs_example | Abs | Mismatched elements: 1 / 3 (33.3%) |" in lines
    assert "| the model uses ops vkpool does not support: Acos | 1 |" in lines
    assert "test_range" in text.split("## Passed with every node folded")[1]
