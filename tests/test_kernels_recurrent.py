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
