"""The ONNX project's backend node tests of the core op set, on the real Vulkan device.

In scope: every node test whose model uses only core ops (vkpool.conformance_scope.CORE_OPS).
A case the kernels cannot run (an element type or attribute they lack) is reported as a skip
with the reason; `make conformance` runs every case and writes docs/conformance.md.
"""
from __future__ import annotations

import onnx.backend.test

import vkpool.backend
from vkpool.conformance_scope import in_scope

_backend_test = onnx.backend.test.BackendTest(vkpool.backend, __name__)
_wanted = {f"{n}_cpu" for n in in_scope()}
# BackendTest makes a method of every case it knows and skips those its include patterns leave
# out; cases never in scope are removed instead, so that a skip says what the kernels lack
_test_cases = _backend_test.test_cases
for _case in _test_cases.values():
    for _name in [n for n in vars(_case) if n.startswith("test_") and n not in _wanted]:
        delattr(_case, _name)
globals().update({name: case for name, case in _test_cases.items()
                  if any(n.startswith("test_") for n in vars(case))})
