"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss on the real Vulkan device: every
reduction, with and without class weights and an ignored index. NLL is compared with the
function the ONNX backend tests generate their data with (the reference evaluator averages over
ignored targets too when ignore_index is -1 and there are no weights, against the operator's
definition); SoftmaxCrossEntropyLoss with the reference evaluator; float16 Softmax/LogSoftmax
with numpy in float32. Float32 rtol 1e-5 (atol 1e-6); float16 rtol 2e-3."""
from __future__ import annotations

import numpy as np
import pytest
from onnx.backend.test.case.node.negativeloglikelihoodloss import compute_negative_log_likelihood_loss

from node_cases import run_node

RNG = np.random.default_rng(77)


def inputs(shape: tuple[int, ...], target_dtype: type = np.int64, ignore: int | None = None,
           weighted: bool = False) -> list[np.ndarray | None]:
    x = RNG.standard_normal(shape).astype(np.float32)
    t = RNG.integers(0, shape[1], size=shape[:1] + shape[2:]).astype(target_dtype)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore  # an ignored index may lie outside [0, C)
    w = RNG.uniform(0.2, 2.0, size=shape[1]).astype(np.float32) if weighted else None
    return [x, t, w]


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape,ignore,weighted", [
    ((5, 4), None, False), ((3, 6, 7), 2, True), ((2, 3, 4, 5), -1, False), ((4, 5, 9), 40, True),
])
def test_nll_loss(pool, reduction, shape, ignore, weighted):
    attrs = {"reduction": reduction} | ({"ignore_index": ignore} if ignore is not None else {})
    x, t, w = inputs(shape, ignore=ignore, weighted=weighted)
    assert x is not None and t is not None
    want = compute_negative_log_likelihood_loss(x, t, w, reduction, ignore)
    got, _ = run_node(pool, "NegativeLogLikelihoodLoss", [x, t, w], attrs, opset=22, expected=[want])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)


def test_nll_loss_int32_targets_sum_over_many_elements(pool):
    got, expected = run_node(pool, "NegativeLogLikelihoodLoss", inputs((8, 10, 300), np.int32),
                             {"reduction": "sum"}, opset=22)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("log_prob", [False, True])
def test_softmax_cross_entropy(pool, reduction, log_prob):
    attrs = {"reduction": reduction, "ignore_index": 1}
    got, expected = run_node(pool, "SoftmaxCrossEntropyLoss", inputs((3, 5, 2, 4), ignore=1, weighted=True),
                             attrs, num_outputs=2 if log_prob else 1, opset=13)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_float16_softmax(pool, op):
    # float16 storage, float32 arithmetic, one rounding at the store; the reference evaluator works
    # in float16 throughout (its LogSoftmax even reaches -inf here), so compare with float32 numpy
    x = (RNG.standard_normal((3, 7, 5)) * 4).astype(np.float16)
    wide = x.astype(np.float32)
    shifted = wide - wide.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    want = (np.exp(shifted - log_sum) if op == "Softmax" else shifted - log_sum).astype(np.float16)
    got, _ = run_node(pool, op, [x], {"axis": 1}, opset=13, expected=[want])
    assert got[0].dtype == np.float16
    np.testing.assert_allclose(got[0].astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
