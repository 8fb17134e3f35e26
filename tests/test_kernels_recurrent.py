"""RNN, GRU and LSTM on the real Vulkan device, against ONNX's reference evaluator: each
direction, both layouts, initial states, biases, GRU's linear_before_reset, LSTM's peepholes.
The evaluator ignores sequence lengths and clipping; those are checked against the kernels'
numpy reference, itself checked against the evaluator where they agree, and against what the
operator promises (zeros past a row's length, Y_h from its last step). Float32 rtol 1e-5,
atol 1e-6 (a few steps of tanh/sigmoid)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from node_cases import run_node
from vkpool.kernels.base import TensorInfo
from vkpool.kernels.ops.recurrent import GRU, LSTM, RNN

RNG = np.random.default_rng(5)
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
CLASSES: dict[str, Any] = {"RNN": RNN, "GRU": GRU, "LSTM": LSTM}


def inputs(op: str, seq: int, batch: int, size: int, hidden: int, dirs: int, layout: int, full: bool,
           short: bool = False) -> list[np.ndarray | None]:
    """X, W, R, and with ``full`` B, sequence lengths (below ``seq`` with ``short``), states, P."""
    g = GATES[op]
    x = RNG.standard_normal((batch, seq, size) if layout else (seq, batch, size)).astype(np.float32)
    w = (RNG.standard_normal((dirs, g * hidden, size)) * 0.5).astype(np.float32)
    r = (RNG.standard_normal((dirs, g * hidden, hidden)) * 0.5).astype(np.float32)
    if not full:
        return [x, w, r]
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    b = RNG.standard_normal((dirs, 2 * g * hidden)).astype(np.float32)
    lens = (RNG.integers(1, seq, size=batch) if short else np.full(batch, seq)).astype(np.int32)
    h0 = RNG.standard_normal(state).astype(np.float32)
    out: list[np.ndarray | None] = [x, w, r, b, lens, h0]
    if op == "LSTM":
        out += [RNG.standard_normal(state).astype(np.float32),
                RNG.standard_normal((dirs, 3 * hidden)).astype(np.float32)]
    return out


# each case is a shader variant to compile
@pytest.mark.parametrize("op,direction,layout,full,attrs", [
    ("RNN", "forward", 0, False, {}), ("RNN", "bidirectional", 0, True, {}),
    ("GRU", "reverse", 1, False, {}), ("GRU", "bidirectional", 0, True, {"linear_before_reset": 1}),
    ("GRU", "forward", 0, True, {}), ("LSTM", "forward", 1, True, {}),
    ("LSTM", "bidirectional", 0, True, {}), ("LSTM", "reverse", 0, False, {}),
    ("GRU", "bidirectional", 1, True, {}),
])
def test_recurrent(pool, op, direction, layout, full, attrs):
    dirs = 2 if direction == "bidirectional" else 1
    hidden = 5
    feeds = inputs(op, 4, 3, 6, hidden, dirs, layout, full)
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout, **attrs}
    outputs = 3 if op == "LSTM" else 2
    got, expected = run_node(pool, op, feeds, attrs, num_outputs=outputs, opset=22)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # the host member's numpy reference agrees too
    infos = [TensorInfo(f.shape, f.dtype) if f is not None else None for f in feeds]
    ours = CLASSES[op](attrs, infos, opset=22, num_outputs=outputs).reference(feeds)
    for o, e in zip(ours, expected):
        np.testing.assert_allclose(o, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,direction", [("RNN", "bidirectional"), ("GRU", "forward"), ("LSTM", "reverse")])
def test_recurrent_sequence_lengths_and_clip(pool, op, direction):
    dirs = 2 if direction == "bidirectional" else 1
    hidden, seq = 4, 5
    feeds = inputs(op, seq, 3, 3, hidden, dirs, 0, True, short=True)
    attrs = {"hidden_size": hidden, "direction": direction, "clip": 0.75}
    outputs = 3 if op == "LSTM" else 2
    infos = [TensorInfo(f.shape, f.dtype) if f is not None else None for f in feeds]
    want = CLASSES[op](attrs, infos, opset=22, num_outputs=outputs).reference(feeds)
    got, _ = run_node(pool, op, feeds, attrs, num_outputs=outputs, opset=22, expected=want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    y, y_h = got[0], got[1]
    lens = feeds[4]
    assert lens is not None
    for n, length in enumerate(lens):
        assert not y[length:, :, n].any()  # zeros past the row's length
        if direction == "forward":
            np.testing.assert_array_equal(y_h[0, n], y[length - 1, 0, n])
        elif direction == "reverse":
            np.testing.assert_array_equal(y_h[0, n], y[0, 0, n])


# -- one dispatch per step: past one workgroup's hidden units, or past the device's loop limit -------

@pytest.fixture(scope="module")
def stepwise_pool():
    """A pool whose device believes it completes 1,000 loop iterations per invocation, so every
    case below runs one dispatch per step (VKPOOL_DEVICE_LIMITS)."""
    from conftest import vulkan_pool

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_loop_iterations=1000")
        p = vulkan_pool()
    yield p
    p.close()


@pytest.mark.parametrize("op,direction,layout,attrs", [
    ("RNN", "bidirectional", 0, {}), ("GRU", "forward", 1, {}), ("GRU", "bidirectional", 0, {"linear_before_reset": 1}),
    ("LSTM", "bidirectional", 1, {}), ("LSTM", "reverse", 0, {"clip": 0.75}),
])
def test_recurrent_stepwise(stepwise_pool, op, direction, layout, attrs):
    dirs = 2 if direction == "bidirectional" else 1
    hidden, seq = 20, 30  # 30 steps of (20 + 20) iterations per gate: past the lowered 1,000
    feeds = inputs(op, seq, 3, hidden, hidden, dirs, layout, True, short=True)
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout, **attrs}
    outputs = 3 if op == "LSTM" else 2
    infos = [TensorInfo(f.shape, f.dtype) if f is not None else None for f in feeds]
    node = CLASSES[op](attrs, infos, opset=22, num_outputs=outputs)
    assert node.stepwise(stepwise_pool.vulkan_members[0].device.caps)
    want = node.reference(feeds)
    got, _ = run_node(stepwise_pool, op, feeds, attrs, num_outputs=outputs, opset=22, expected=want)
    for g, e in zip(got, want):  # 30 steps: float32 against float64, the project's 1e-4
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op,seq,hidden,size", [("LSTM", 100, 128, 128), ("GRU", 6, 300, 40), ("LSTM", 5, 512, 64),
                                                ("RNN", 4, 260, 8)])
def test_recurrent_large_against_onnxruntime(pool, op, seq, hidden, size):
    """A hidden size past one workgroup, and an LSTM whose steps pass lavapipe's 65,535 loop
    iterations in one invocation (it returned wrong numbers from the step where they ran out)."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
    from onnx import helper, numpy_helper

    g = GATES[op]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((seq, 2, size)).astype(np.float32)
    w = (rng.standard_normal((1, g * hidden, size)) / np.sqrt(size)).astype(np.float32)
    r = (rng.standard_normal((1, g * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    outs = ["y", "y_h"] + (["y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, ["x", "w", "r"], outs, hidden_size=hidden)

    def model(values: list) -> bytes:
        graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", 1, x.shape)], values,
                                  initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(r, "r")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8).SerializeToString()

    expected = ort.InferenceSession(model([helper.make_empty_tensor_value_info(o) for o in outs]),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})
    typed = [helper.make_tensor_value_info(o, 1, e.shape) for o, e in zip(outs, expected)]
    import vkpool

    with vkpool.Session(model(typed), pool=pool) as session:
        got = session.run(None, {"x": x})
    for g_, e in zip(got, expected):
        assert g_.shape == e.shape
        np.testing.assert_allclose(g_, e, rtol=1e-4, atol=1e-5)
