"""The loaded-model cache (vkpool.model_cache): a second load of a file gives what the first gave,
without onnx; whatever is wrong with an entry ends in a load from the file, never an error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import workloads
from vkpool import inline_weights, model_cache
from vkpool.model import LoadedModel, ModelError, load_model
from vkpool.session import Session

HOUR_NS = 3600 * 10**9


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own, so entries of other tests never answer."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(folder))
    monkeypatch.delenv(model_cache.DISABLE_ENV, raising=False)
    return folder


def _settle(*paths: Path, age_ns: int = HOUR_NS) -> None:
    """Backdates the files: one modified just now is not cached (model_cache.SETTLE_NS)."""
    when = time.time_ns() - age_ns
    for path in paths:
        os.utime(path, ns=(when, when))


def _save(proto: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, path)
    _settle(path)
    return path


def _entries(folder: Path) -> list[Path]:
    models = folder / "models"
    return sorted(models.glob("*.vkm")) if models.exists() else []


def _args(**kw) -> model_cache.LoadArgs:
    return model_cache.LoadArgs(kw.get("batch", 1), tuple(sorted(kw.get("dims", {}).items())),
                                kw.get("fuse", True), kw.get("partial", False))


def assert_same_value(a, b, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_model(got: LoadedModel, want: LoadedModel) -> None:
    assert got.inputs == want.inputs
    assert got.outputs == want.outputs
    assert list(got.tensors.items()) == list(want.tensors.items())
    assert got.opset == want.opset and got.unresolved == want.unresolved
    assert len(got.nodes) == len(want.nodes)
    for g, w in zip(got.nodes, want.nodes):
        assert (g.name, g.op_type, g.domain, g.inputs, g.outputs) == (w.name, w.op_type, w.domain, w.inputs, w.outputs)
        assert list(g.attrs) == list(w.attrs), g.name
        for key in w.attrs:
            assert_same_value(g.attrs[key], w.attrs[key], f"{w.name}.{key}")
    assert list(got.constants) == list(want.constants)
    for name, value in want.constants.items():
        assert_same_value(got.constants[name], value, f"constant {name}")


def _cached(path: Path, **kw) -> LoadedModel:
    """The model as the cache gives it: loaded once from the file (writing the entry), then
    read back from the entry, which must be there."""
    load_model(path, **kw)
    hit = model_cache.load(path, _args(**kw))
    assert hit is not None, "no entry was written, or it was not read back"
    return hit


# -- models ----------------------------------------------------------------------------------------


def _graph_model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _attribute_model() -> onnx.ModelProto:
    """Attributes of every kind a kept node can carry: int, float, string, lists of each, a
    tensor; a fused activation (vkpool's own str attribute); a large weight read in place, a
    large folded constant (Transpose of a weight), small ones; ConstantOfShape of a run-time
    shape makes it load with ``partial=True`` only, with an output of unknown dims."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    big = rng.standard_normal((64, 512)).astype(np.float32)  # 128 KiB: read in place
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(big, "big"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0, 2], np.int64), "idx")]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1], strides=[1, 1],
                         kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("LeakyRelu", ["r"], ["l"], name="leaky", alpha=0.125),
        helper.make_node("Gather", ["l", "idx"], ["g"], name="gather", axis=1),
        helper.make_node("Transpose", ["big"], ["big_t"], name="fold_me", perm=[1, 0]),
        helper.make_node("MatMul", ["v", "big_t"], ["m"], name="mm"),
        helper.make_node("MatMul", ["m", "big"], ["m2"], name="mm2"),
        helper.make_node("ConstantOfShape", ["shape_in"], ["filled"], name="fill",
                         value=numpy_helper.from_array(np.array([2.5], np.float32))),
        helper.make_node("Resize", ["l", "", "scales"], ["up"], name="resize", mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("Cast", ["m2"], ["m2_half"], name="cast", to=TensorProto.FLOAT16),
    ]
    inits += [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    return _graph_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 512]),
         helper.make_tensor_value_info("shape_in", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 2, 6, 6]),
         helper.make_tensor_value_info("m2_half", TensorProto.FLOAT16, [2, 512]),
         helper.make_tensor_value_info("filled", TensorProto.FLOAT, ["rows", "cols"]),
         helper.make_tensor_value_info("up", TensorProto.FLOAT, [1, 8, 12, 12])],
        inits,
    )


def _external_model(folder: Path, weights: np.ndarray) -> Path:
    proto = _graph_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weights.shape[1]])],
        [numpy_helper.from_array(weights, "w")],
    )
    onnx.external_data_helper.convert_model_to_external_data(
        proto, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save(proto, path)  # writes weights.bin beside it
    _settle(path, folder / "weights.bin")
    return path


# -- a warm start in a fresh process ---------------------------------------------------------------

_RUN = textwrap.dedent("""
    import json, sys
    from vkpool.cli import main

    code = main(["run", sys.argv[1], "--device", sys.argv[2]])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("onnx", "networkx", "yaml"))
    print("MODULES " + json.dumps(heavy))
    sys.exit(code)
""")


def _vkpool_run(model: Path, device: str, env: dict[str, str]) -> tuple[list[str], list[str]]:
    proc = subprocess.run([sys.executable, "-c", _RUN, str(model), device], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    modules = json.loads(lines[-1].removeprefix("MODULES "))
    outputs = [line for line in lines[:-1] if "checksum" in line]
    assert outputs, proc.stdout
    return modules, outputs


def test_warm_start_imports_neither_onnx_networkx_nor_yaml_and_runs_the_same(
        tmp_path: Path, own_cache: Path, pool, monkeypatch: pytest.MonkeyPatch) -> None:
    device = pool.vulkan_members[0].id
    model = _save(workloads.mnist12_like(), tmp_path / "mnist12_like.onnx")
    env = {**os.environ, "VKPOOL_CACHE_DIR": str(own_cache)}
    cold_modules, cold_outputs = _vkpool_run(model, device, env)
    assert "onnx" in cold_modules  # the first start loaded the file, and wrote the entry
    assert len(_entries(own_cache)) == 1
    warm_modules, warm_outputs = _vkpool_run(model, device, env)
    assert warm_modules == []
    assert warm_outputs == cold_outputs
    off_modules, off_outputs = _vkpool_run(model, device, {**env, model_cache.DISABLE_ENV: "1"})
    assert "onnx" in off_modules and off_outputs == cold_outputs

    # the outputs themselves, bit for bit: a session on the cached model and one on a cold load
    feeds = workloads.input_for("mnist12_like")
    assert model_cache.load(model, _args(partial=True)) is not None  # what Session loads is cached
    got = _session_run(model, pool, device, feeds)
    monkeypatch.setenv(model_cache.DISABLE_ENV, "1")
    want = _session_run(model, pool, device, feeds)
    assert len(got) == len(want) == 1
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _session_run(model: Path, pool, device: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = Session(str(model), pool=pool, device=device)
    try:
        return session.run(None, feeds)
    finally:
        session.close()


# -- what an entry gives back ----------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False])
def test_entry_gives_the_model_a_load_gives(tmp_path: Path, fuse: bool) -> None:
    path = _save(_attribute_model(), tmp_path / "m.onnx")
    want = load_model(path, fuse=fuse, partial=True, cache=False)
    assert any(n.op_type == "Resize" for n in want.nodes)
    assert ("activation" in next(n for n in want.nodes if n.op_type == "Conv").attrs) == fuse
    assert want.unresolved == ["filled"] and want.outputs[2][1].shape == (-1, -1)
    got = _cached(path, fuse=fuse, partial=True)
    assert_same_model(got, want)
    # the weight read in place is a view of the model file again, not a copy
    found = inline_weights.mapped(got.constants["big"])
    assert found is not None and not got.constants["big"].flags.writeable
    # the folded transpose (128 KiB, computed at load) comes from the entry's data section
    assert "big_t" in got.constants and inline_weights.mapped(got.constants["big_t"]) is not None


def test_mnist_and_inline_weights_models(tmp_path: Path) -> None:
    for name in ("mnist12_like", "mlp", "conv_few_15MB"):
        path = _save(workloads.build(name), tmp_path / f"{name}.onnx")
        assert_same_model(_cached(path), load_model(path, cache=False))


def test_arguments_each_have_their_entry(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    proto = _graph_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")],
    )
    path = _save(proto, tmp_path / "m.onnx")
    for kw in ({}, {"batch": 3}, {"dims": {"N": 5}}, {"partial": True}):
        load_model(path, **kw)
    assert len(_entries(tmp_path / "cache")) == 4
    assert model_cache.load(path, _args(batch=3)).inputs[0][1].shape == (3, 8)
    assert model_cache.load(path, _args(dims={"N": 5})).outputs[0][1].shape == (5, 4)
    assert load_model(path, batch=3).tensors["y"].shape == (3, 4)


def test_external_data_is_mapped_again_and_checked(tmp_path: Path) -> None:
    weights = np.arange(64 * 512, dtype=np.float32).reshape(64, 512)
    path = _external_model(tmp_path / "model", weights)
    got = _cached(path)
    np.testing.assert_array_equal(got.constants["w"], weights)
    assert inline_weights.mapped(got.constants["w"]) is not None
    assert_same_model(got, load_model(path, cache=False))

    # new values of the same size: the entry no longer holds, the load reads the new file
    (tmp_path / "model" / "weights.bin").write_bytes((weights * 2).tobytes())
    _settle(tmp_path / "model" / "weights.bin", age_ns=HOUR_NS // 2)
    assert model_cache.load(path, _args()) is None
    np.testing.assert_array_equal(load_model(path).constants["w"], weights * 2)
    np.testing.assert_array_equal(model_cache.load(path, _args()).constants["w"], weights * 2)

    # a weights file swapped for a link leading out of the folder is refused as the loader does
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((weights * 3).tobytes())
    (tmp_path / "model" / "weights.bin").unlink()
    (tmp_path / "model" / "weights.bin").symlink_to(outside)
    assert model_cache.load(path, _args()) is None
    with pytest.raises(ModelError, match="outside the model's folder"):
        load_model(path)


def test_changed_model_file_is_loaded_again(tmp_path: Path) -> None:
    w1 = np.ones((4, 4), np.float32)
    proto = _graph_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                         [numpy_helper.from_array(w1, "w")])
    path = _save(proto, tmp_path / "m.onnx")
    np.testing.assert_array_equal(_cached(path).constants["w"], w1)
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(w1 * 7, "w"))  # the same size
    onnx.save(proto, path)
    _settle(path, age_ns=HOUR_NS // 2)
    assert model_cache.load(path, _args()) is None
    np.testing.assert_array_equal(load_model(path).constants["w"], w1 * 7)
    assert len(_entries(tmp_path / "cache")) == 1  # rewritten in place, not a second entry


def test_recently_modified_file_is_not_cached(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(workloads.mnist12_like(), path)  # modified just now
    load_model(path)
    assert _entries(tmp_path / "cache") == []
    _settle(path, age_ns=model_cache.SETTLE_NS + 10**9)
    load_model(path)
    assert len(_entries(tmp_path / "cache")) == 1


def test_model_with_a_subgraph_is_not_cached(tmp_path: Path) -> None:
    def branch(value: float) -> onnx.GraphProto:
        const = helper.make_node("Constant", [], ["out"], value=numpy_helper.from_array(
            np.full((2,), value, np.float32)))
        return helper.make_graph([const], "b", [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])])

    proto = _graph_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch(1.0), else_branch=branch(2.0))],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    path = _save(proto, tmp_path / "m.onnx")
    model = load_model(path)
    assert isinstance(model.nodes[0].attrs["then_branch"], onnx.GraphProto)
    assert _entries(tmp_path / "cache") == []
    assert model_cache.load(path, _args()) is None


def test_cache_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _save(workloads.mnist12_like(), tmp_path / "m.onnx")
    load_model(path, cache=False)
    monkeypatch.setenv(model_cache.DISABLE_ENV, "1")
    load_model(path)
    assert _entries(tmp_path / "cache") == []
    monkeypatch.setenv(model_cache.DISABLE_ENV, "0")
    load_model(path)
    assert len(_entries(tmp_path / "cache")) == 1


# -- damaged entries -------------------------------------------------------------------------------


def _header(entry: Path) -> tuple[dict, bytes]:
    data = entry.read_bytes()
    size = int.from_bytes(data[8:16], "little")
    return msgpack.unpackb(data[16:16 + size], raw=False, ext_hook=msgpack.ExtType), data[16 + size:]


def _with_header(entry: Path, change) -> None:
    header, rest = _header(entry)
    change(header)
    head = msgpack.packb(header, use_bin_type=True)
    entry.write_bytes(b"VKPMODEL" + len(head).to_bytes(8, "little") + head + rest)


def _first_constant(kind: str):
    def change(header: dict) -> None:
        entry = next(c for c in header["constants"] if c[3][0] == kind)
        entry[3][-1] = 1 << 40  # far past the end of its file
    return change


DAMAGE = {
    "empty": lambda e: e.write_bytes(b""),
    "truncated": lambda e: e.write_bytes(e.read_bytes()[: len(e.read_bytes()) // 2]),
    "truncated data section": lambda e: e.write_bytes(e.read_bytes()[:-100]),
    "garbage": lambda e: e.write_bytes(np.random.default_rng(0).bytes(5000)),
    "garbage after the magic": lambda e: e.write_bytes(b"VKPMODEL" + np.random.default_rng(1).bytes(5000)),
    "header length too large": lambda e: e.write_bytes(e.read_bytes()[:8] + (1 << 62).to_bytes(8, "little")
                                                        + e.read_bytes()[16:]),
    "another format": lambda e: _with_header(e, lambda h: h["key"].__setitem__(0, model_cache.FORMAT + 1)),
    "another vkpool": lambda e: _with_header(e, lambda h: h["key"].__setitem__(1, "0.0.0")),
    "a field missing": lambda e: _with_header(e, lambda h: h.pop("nodes")),
    "an object dtype": lambda e: _with_header(e, lambda h: h["constants"][0].__setitem__(1, "|O")),
    "a negative dim": lambda e: _with_header(e, lambda h: h["constants"][0].__setitem__(2, [-4])),
    "a weight past the model file": lambda e: _with_header(e, _first_constant("model")),
    "a constant past the data section": lambda e: _with_header(e, _first_constant("data")),
    "an unknown place": lambda e: _with_header(e, lambda h: h["constants"][0].__setitem__(3, ["pickle", b"x"])),
    "an unknown extension type": lambda e: _with_header(
        e, lambda h: h["nodes"][0][5].__setitem__("bad", msgpack.ExtType(42, b"\x00"))),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_a_miss_and_gets_rewritten(tmp_path: Path, damage: str) -> None:
    path = _save(_attribute_model(), tmp_path / "m.onnx")
    want = load_model(path, partial=True, cache=False)
    _cached(path, partial=True)
    [entry] = _entries(tmp_path / "cache")
    DAMAGE[damage](entry)
    assert model_cache.load(path, _args(partial=True)) is None
    assert_same_model(load_model(path, partial=True), want)  # loaded from the file, the entry written again
    assert_same_model(model_cache.load(path, _args(partial=True)), want)


def test_entry_cannot_reach_outside_the_model_folder(tmp_path: Path) -> None:
    weights = np.arange(16, dtype=np.float32).reshape(4, 4)
    path = _external_model(tmp_path / "model", weights)
    _cached(path)
    [entry] = _entries(tmp_path / "cache")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x01" * 64)
    st = secret.stat()

    def point_outside(header: dict) -> None:
        header["files"] = [["../secret.bin", st.st_size, st.st_mtime_ns, st.st_ino]]
    _with_header(entry, point_outside)
    assert model_cache.load(path, _args()) is None
    np.testing.assert_array_equal(load_model(path).constants["w"], weights)


# -- host memory -----------------------------------------------------------------------------------

_PEAK = textwrap.dedent("""
    import sys
    from vkpool.model import load_model

    def peak_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    before = peak_kib()
    model = load_model(sys.argv[1])
    print(peak_kib() - before, "onnx" in sys.modules, sum(v.nbytes for v in model.constants.values()))
""")


def test_a_hit_maps_large_weights_instead_of_reading_them(tmp_path: Path, own_cache: Path) -> None:
    """A 256 MiB weight: a hit maps it and leaves its pages on disk (the cold load does too)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8192, 8192), dtype=np.float32)
    proto = _graph_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8192])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8192])],
                         [numpy_helper.from_array(weight, "w")])
    del weight
    path = _save(proto, tmp_path / "big.onnx")
    del proto
    env = {**os.environ, "VKPOOL_CACHE_DIR": str(own_cache)}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True,
                              timeout=300, env=env, check=True)
        grown_kib, onnx_imported, nbytes = proc.stdout.split()
        runs.append((int(grown_kib), onnx_imported == "True", int(nbytes)))
    (cold_kib, cold_onnx, nbytes), (warm_kib, warm_onnx, warm_nbytes) = runs
    assert nbytes == warm_nbytes == 256 << 20
    assert cold_onnx and not warm_onnx
    assert warm_kib < 32 << 10, f"a hit grew the peak by {warm_kib} KiB"
    assert entry_size(own_cache) < 1 << 16  # the weight is referred to, not copied into the entry


def entry_size(folder: Path) -> int:
    [entry] = _entries(folder)
    return entry.stat().st_size
