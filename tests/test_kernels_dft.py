"""DFT on the real Vulkan device, against numpy's FFT: real and complex signals, forward (full and
one-sided), inverse, the inverse of a one-sided spectrum, padded and truncated lengths, opset 19's
axis attribute and opset 20's axis input. Float32 rtol 1e-4, atol 1e-4 (sums of 16 terms of
magnitude ~1; the reference evaluator wraps the same numpy calls)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(16)


def complexify(signal: np.ndarray) -> np.ndarray:
    return np.stack([signal.real, signal.imag], axis=-1).astype(np.float32)


@pytest.mark.parametrize("channels,inverse,onesided,length,axis", [
    (1, 0, 0, None, 1), (2, 0, 0, 12, 2), (1, 0, 1, None, 2), (2, 1, 0, 6, 1), (2, 1, 1, None, 1),
    (2, 1, 1, 9, 1),
])
@pytest.mark.parametrize("opset", [19, 20])
def test_dft(pool, channels, inverse, onesided, length, axis, opset):
    x = RNG.standard_normal((2, 7, 5, channels)).astype(np.float32)
    signal = x[..., 0] + (1j * x[..., 1] if channels == 2 else 0)
    if inverse and onesided:
        n = length or 2 * (x.shape[axis] - 1)
        want = np.fft.irfft(signal, n=n, axis=axis)[..., None].astype(np.float32)
    else:
        spectrum = (np.fft.ifft if inverse else np.fft.fft)(signal, n=length, axis=axis)
        if onesided:
            spectrum = np.take(spectrum, np.arange(spectrum.shape[axis] // 2 + 1), axis=axis)
        want = complexify(spectrum)
    inputs: list[np.ndarray | None] = [x, None if length is None else np.array(length, np.int64)]
    attrs = {"inverse": inverse, "onesided": onesided}
    constants = (1,) if length is not None else ()
    if opset >= 20:
        inputs.append(np.array(axis, np.int64))
        constants += (2,)
    else:
        attrs["axis"] = axis
    got, _ = run_node(pool, "DFT", inputs, attrs, constants=constants, opset=opset, expected=[want])
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
