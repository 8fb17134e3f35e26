"""STFT on the real Vulkan device, against numpy's FFT of the windowed frames: real signals
one-sided and complex ones full, with and without a window. Float32 rtol 1e-4, atol 1e-4 (sums
of 16 terms of magnitude ~1)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(17)


@pytest.mark.parametrize("channels,onesided,windowed", [
    (1, 1, False), (1, 1, True), (2, 0, True), (1, 0, False),
])
def test_stft(pool, channels, onesided, windowed):
    x = RNG.standard_normal((2, 50, channels)).astype(np.float32)
    step, frame = 7, 16
    window = np.hanning(frame).astype(np.float32) if windowed else None
    signal = x[..., 0] + (1j * x[..., 1] if channels == 2 else 0)
    frames = np.stack([signal[:, s:s + frame] for s in range(0, 50 - frame + 1, step)], axis=1)
    bins = frame // 2 + 1 if onesided else frame
    spectrum = np.fft.fft(frames * (window if windowed else 1), axis=-1)[..., :bins]
    want = np.stack([spectrum.real, spectrum.imag], axis=-1).astype(np.float32)
    inputs = [x, np.array(step, np.int64), window, np.array(frame, np.int64)]
    got, _ = run_node(pool, "STFT", inputs, {"onesided": onesided}, constants=(1, 3), opset=17,
                      expected=[want])
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
