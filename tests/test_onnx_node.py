"""The ONNX project's backend node tests of the core op set, on the real Vulkan device.

In scope: every node test whose model uses only core ops (vkpool.conformance_scope.CORE_OPS).
A case the kernels cannot run (an element type or attribute they lack) is reported as a skip
with the reason; `make conformance` runs every case and writes docs/conformance.md.
"""
from __future__ import annotations

import re

import onnx.backend.test

import vkpool.backend
from vkpool.conformance_scope import in_scope

_backend_test = onnx.backend.test.BackendTest(vkpool.backend, __name__)
_names = in_scope()
_backend_test.include("^(" + "|".join(re.escape(n) for n in _names) + ")_cpu$")
globals().update(_backend_test.test_cases)
