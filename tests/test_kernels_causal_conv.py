"""CausalConvWithState on the real Vulkan device, against ONNX's reference evaluator: with and
without bias and past state, SiLU, a one-tap kernel (an empty state), a kernel longer than the
input, float16. Float32 rtol 1e-5 (atol 1e-6); float16 rtol 2e-3 (the reference accumulates in
float16, the shader in float32)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(27)


@pytest.mark.parametrize("length,k,bias,past,activation,dtype", [
    (9, 4, False, False, "none", np.float32), (9, 4, True, True, "silu", np.float32),
    (1, 4, True, True, "none", np.float32), (3, 6, False, True, "swish", np.float32),
    (5, 1, True, False, "none", np.float32), (8, 3, True, True, "silu", np.float16),
])
def test_causal_conv_with_state(pool, length, k, bias, past, activation, dtype):
    n, c = 2, 3
    inputs = [RNG.standard_normal((n, c, length)).astype(dtype), RNG.standard_normal((c, 1, k)).astype(dtype),
              RNG.standard_normal(c).astype(dtype) if bias else None,
              RNG.standard_normal((n, c, k - 1)).astype(dtype) if past else None]
    got, expected = run_node(pool, "CausalConvWithState", inputs, {"activation": activation}, num_outputs=2,
                             opset=27)
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-6}
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, **tol)
