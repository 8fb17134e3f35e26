"""Loading an ONNX model into a static graph: checked, every shape known, constants folded.

``load_model`` turns a file, bytes or ``ModelProto`` into a :class:`LoadedModel`:

1. parse without external data, then read external weights through :mod:`mmap` from inside the
   model's own folder only (no ``..``, absolute paths, links leading out, or hardlinks);
2. ``onnx.checker.check_model`` (full check) on the graph with its large weights declared as
   typed inputs: the checker never copies the weights, so models over 2 GiB work too;
3. bind symbolic dimensions of the inputs (``shapes`` by input and axis, else ``dims`` by name,
   else ``batch`` for an input's first dimension). A dim is symbolic when it has a name, no
   value, or a negative value (Paddle2ONNX writes -1); one name may stand for dims that differ
   ("?" for height and width), so names bind only what ``dims`` names. A dim left unbound raises
   :class:`UnboundDims`, naming the input and axis (a :class:`vkpool.Session` then binds it from
   each run's feeds);
4. repeat ``onnx.shape_inference.infer_shapes(data_prop=True, strict_mode=True)`` and constant
   folding until nothing changes, so shapes computed by ``Shape → Gather → Concat → Reshape``
   chains become static. Shapes come from the graph, as onnxruntime takes them: the declared
   shapes of outputs and ``value_info`` are not inputs to the inference, and one that disagrees
   with what the graph computes gives a :class:`DeclaredShapeWarning`. Subgraphs (If, Loop,
   Scan) are inferred with the outer-scope values they read; an If whose condition is known
   (a constant, or folded) is replaced by the branch it takes (:mod:`vkpool.subgraph`), and
   inference and folding go on through its nodes;
5. fail with :class:`ModelError` naming any tensor whose shape or dtype is still unknown (with
   ``partial=True``, list them in ``LoadedModel.unresolved`` instead: their shapes depend on
   values known only at run time, and :mod:`vkpool.dynamic` cuts the model there).

Folding evaluates one node at a time with ``onnx.reference.ReferenceEvaluator``; it runs once at
load, so its speed matters little next to never doing that work per inference.

What a load from a file gives is cached on disk (:mod:`vkpool.model_cache`): loading the same
file again with the same arguments reads the entry and imports neither onnx nor protobuf.
"""
from __future__ import annotations

import mmap
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vkpool import inline_weights, progress
from vkpool.kernels.base import TensorInfo, UnsupportedOp
from vkpool.subgraph import all_names, inline_branch, is_graph, node_outer_names, subgraph_op_types, subgraphs
from vkpool.units import format_size

if TYPE_CHECKING:
    import onnx

# ``onnx`` is imported by the functions that parse, check, infer and fold, never at import: a
# model found in the loaded-model cache (:mod:`vkpool.model_cache`) needs none of them, and
# importing onnx is the largest single cost of a process's start.


class ModelError(ValueError):
    """The model cannot be used: not ONNX, fails the checker, unsafe external data, or shapes
    that stay unknown after binding every symbolic dimension."""


class UnboundDims(ModelError):
    """Symbolic dims of the inputs that nothing bound. ``inputs`` and ``outputs`` are as the
    model declares them, -1 for each symbolic dim (an output declared without a shape has
    shape ``()`` here); ``run_time_ops`` are the ``(op_type, domain)`` of the nodes that read
    the inputs, directly or not (no binding of the dims can fold them away at load)."""

    def __init__(self, message: str, inputs: list[tuple[str, TensorInfo]], outputs: list[tuple[str, TensorInfo]],
                 run_time_ops: list[tuple[str, str]]):
        super().__init__(message)
        self.inputs = inputs
        self.outputs = outputs
        self.run_time_ops = run_time_ops


class DeclaredShapeWarning(UserWarning):
    """A shape the model declares for an output or a ``value_info`` disagrees with what its graph
    computes; the graph's shape is used, as onnxruntime does."""


@dataclass
class Node:
    name: str
    op_type: str
    domain: str
    inputs: list[str]  # '' for an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedModel:
    inputs: list[tuple[str, TensorInfo]]
    outputs: list[tuple[str, TensorInfo]]
    nodes: list[Node]
    constants: dict[str, np.ndarray]
    tensors: dict[str, TensorInfo]
    opset: int
    #: tensors whose shape inference left unknown (``load_model(partial=True)`` only); they are
    #: not in ``tensors``, and an output among them is in ``outputs`` with -1 for each unknown dim
    unresolved: list[str] = field(default_factory=list)
    #: products divided into column blocks before planning (:mod:`vkpool.column_split`):
    #: node name → blocks; a worker process loading the model applies the same
    column_splits: dict[str, int] = field(default_factory=dict)
    #: input name → the axes the model leaves symbolic (bound at load by ``batch``, ``dims`` or
    #: ``shapes``): a run may bind them to other values
    symbolic: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def op_types(self) -> list[tuple[str, str]]:
        """``(op_type, domain)`` of every node, in node order, and of the nodes of their subgraphs."""
        out = []
        for node in self.nodes:
            out.append((node.op_type, node.domain))
            for value in node.attrs.values():
                if is_graph(value):
                    out += subgraph_op_types(value)
        return out

    def fresh_name(self, name: str) -> str:
        """``name``, or ``name_2``, ``name_3``, … : the first no tensor or constant has."""
        candidate, k = name, 1
        while candidate in self.tensors or candidate in self.constants:
            k += 1
            candidate = f"{name}_{k}"
        return candidate

    def drop_unread_constants(self) -> None:
        """Forgets constants no node reads and no output names (left behind by a rewrite)."""
        read = {name for node in self.nodes for name in node.inputs} | {name for name, _ in self.outputs}
        for name in [c for c in self.constants if c not in read]:
            del self.constants[name]
            self.tensors.pop(name, None)


# Ops whose result is not a function of their inputs: folding would freeze one random draw.
NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
# Constants up to this size go into the proto handed to shape inference so that data
# propagation sees their values; larger ones are declared as typed inputs instead, which keeps
# that proto small (a 1 GiB weight never needs its values for shape inference).
_INLINE_CONSTANT_BYTES = 1 << 16
#: the oldest ai.onnx opset whose models load (7: the opset of the classic model-zoo CNNs)
MIN_OPSET = 7
#: a tensor larger than this is refused at load: no device or pool holds one, and sizes past it
#: (a declared 2^40 x 2^40) would overflow the planner's 64-bit arithmetic
MAX_TENSOR_BYTES = 1 << 42
#: a node whose outputs together exceed this is left to the device rather than folded on the host
#: at load (a ConstantOfShape or Expand to a huge size would take the host's memory)
_FOLD_BYTES = 1 << 30


def load_model(
    src: str | os.PathLike[str] | bytes | onnx.ModelProto,
    *,
    batch: int = 1,
    dims: dict[str, int] | None = None,
    fuse: bool = True,
    partial: bool = False,
    cache: bool = True,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> LoadedModel:
    """Loads, checks, binds and folds an ONNX model; see the module docstring. With ``fuse``
    (the default), biases and Relus are folded into the products before them
    (:mod:`vkpool.fusion`). With ``partial``, a tensor of unknown shape is listed in
    ``unresolved`` instead of failing the load (an output needs its dtype and rank known).
    ``shapes`` binds inputs' symbolic dims by position (input name → its whole shape; a fixed dim
    that differs is a :class:`ModelError` naming the input and axis).

    A model loaded from a path is looked up in, and else written to, the loaded-model cache
    (:mod:`vkpool.model_cache`); ``cache=False`` or ``VKPOOL_NO_MODEL_CACHE=1`` skip it."""
    if batch < 1:
        raise ModelError(f"batch must be at least 1, got {batch}")
    what = Path(os.fspath(src)).name if isinstance(src, (str, os.PathLike)) else ""
    with progress.task("load", _LOAD_STEPS, what=what):
        return _load_cached(src, batch, dict(dims or {}), fuse, partial, cache, shapes or {})


#: the steps of a load :func:`progress.advance` counts: parsed, checked, shapes known, fused
_LOAD_STEPS = 4


def _load_cached(src: str | os.PathLike[str] | bytes | onnx.ModelProto, batch: int, dims: dict[str, int],
                 fuse: bool, partial: bool, cache: bool, shapes: dict[str, tuple[int, ...]]) -> LoadedModel:
    """:func:`load_model` once its progress task is open: from the loaded-model cache or the file."""
    trace = LoadTrace()
    if not cache or not isinstance(src, (str, os.PathLike)) or shapes:
        return _load(src, batch, dims, fuse, partial, trace, shapes)
    from vkpool import model_cache

    if not model_cache.enabled():
        return _load(src, batch, dims, fuse, partial, trace)
    args = model_cache.LoadArgs(batch, tuple(sorted((str(k), int(v)) for k, v in dims.items())), fuse, partial)
    found = model_cache.load(src, args)
    if found is not None:
        return found
    before = model_cache.file_stat(src)
    model = _load(src, batch, dims, fuse, partial, trace)
    if before is not None:
        model_cache.store(src, args, model, trace, before)
    return model


@dataclass
class LoadTrace:
    """What a load from a file read besides the file, for :mod:`vkpool.model_cache`."""

    #: memory maps constants may be views of, by ``id``: the map and the external data location
    #: it is of, as the model names it (None: the model file itself)
    maps: dict[int, tuple[mmap.mmap, str | None]] = field(default_factory=dict)
    #: every external data file read, by location: its (size, mtime_ns, inode) when opened, None
    #: if that differed from one opening to the next
    external: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)


def _load(src: str | os.PathLike[str] | bytes | onnx.ModelProto, batch: int, dims: dict[str, int],
          fuse: bool, partial: bool, trace: LoadTrace, shapes: dict[str, tuple[int, ...]] | None = None
          ) -> LoadedModel:
    """The load itself, without the cache; ``trace`` gets the files it read."""
    proto, base_dir, in_place = _parse(src)
    for array in in_place.values():
        found = inline_weights.mapped(array)
        if found is not None:
            trace.maps[id(found[0])] = (found[0], None)
    # external paths are vetted (and every weight read) before the checker sees the graph
    constants = _take_initializers(proto, base_dir, in_place, trace)
    progress.advance("load")
    _negative_dims_unknown(proto.graph)
    opset = _onnx_opset(proto)
    _refuse_vendor_ops(proto)
    _check(_weightless(proto, constants))
    progress.advance("load")
    graph = proto.graph
    declared = _declared_shapes(graph)
    bound, symbolic = _bind_dims(graph, batch, dims, shapes or {}, set(constants))

    nodes = list(graph.node)
    input_names = [i.name for i in graph.input if i.name not in constants]
    output_names = [o.name for o in graph.output]
    types: dict[str, TensorInfo] = {}
    ranked: dict[str, TensorInfo] = {}  # dtype and rank known, -1 for each unknown dim
    taken = all_names(graph) | set(constants)
    while True:
        types = _infer(proto, nodes, bound, constants, types, ranked)
        nodes, changed = _fold(nodes, constants, types, proto, taken)
        if not changed:
            break
    progress.advance("load")
    _warn_declared(declared, types)

    kept_nodes = _without_unknown_unread_outputs([to_node(n) for n in nodes], types, set(output_names))
    used = {t for n in kept_nodes for t in n.inputs if t} | set(output_names)
    constants = {k: v for k, v in constants.items() if k in used}
    tensors: dict[str, TensorInfo] = {}
    for name, value in constants.items():
        tensors[name] = TensorInfo(value.shape, value.dtype)
    unresolved: list[str] = []
    skipped: set[str] = set()
    every_name = [*input_names, *output_names] + [t for n in kept_nodes for t in (*n.inputs, *n.outputs)]
    for name in every_name:
        if not name or name in tensors or name in skipped:
            continue
        info = types.get(name)
        if info is None:
            if not partial:
                raise ModelError(
                    f"tensor {name!r}: shape or dtype is still unknown after binding symbolic dims")
            if name in output_names and name not in ranked:
                raise ModelError(f"output {name!r}: its dtype or rank stays unknown until run time; "
                                 "vkpool needs both known at load")
            unresolved.append(name)
            skipped.add(name)
            continue
        tensors[name] = info
    check_tensor_sizes(tensors)
    model = LoadedModel(
        inputs=[(n, tensors[n]) for n in input_names],
        outputs=[(n, tensors[n] if n in tensors else ranked[n]) for n in output_names],
        nodes=kept_nodes,
        constants=constants,
        tensors=tensors,
        opset=opset,
        unresolved=unresolved,
        symbolic=symbolic,
    )
    if fuse:
        from vkpool.fusion import fuse as fuse_epilogues

        fuse_epilogues(model)
    progress.advance("load")
    return model


#: ops whose trailing optional outputs may be left out without changing the others (not
#: BatchNormalization: before opset 14 its statistics outputs select training mode)
_DROPPABLE_OUTPUTS = frozenset({"Dropout"})


def _without_unknown_unread_outputs(nodes: list[Node], types: dict[str, TensorInfo], graph_outputs: set[str]
                                    ) -> list[Node]:
    """An output nobody reads does not block a load: a trailing one whose shape stays unknown
    (Dropout's mask at opset 7) leaves its node, as an omitted optional output, where the op's
    other outputs do not depend on it being asked for."""
    read = {t for n in nodes for t in n.inputs if t} | graph_outputs
    for node in nodes:
        if node.op_type in _DROPPABLE_OUTPUTS and node.domain in ("", "ai.onnx"):
            while len(node.outputs) > 1 and node.outputs[-1] not in read and node.outputs[-1] not in types:
                node.outputs.pop()
    return nodes


# -- parsing and external data -------------------------------------------------------------------


def _parse(src: str | os.PathLike[str] | bytes | onnx.ModelProto
           ) -> tuple[onnx.ModelProto, Path | None, dict[int, np.ndarray]]:
    """Returns the proto without external data loaded, the folder external data may come from,
    and, for a file, its large inline weights read in place (by initializer index)."""
    import onnx

    in_place: dict[int, np.ndarray] = {}
    if isinstance(src, onnx.ModelProto):
        proto, base_dir = _copy_for_loading(src), None
        what = "the given ModelProto"
    elif isinstance(src, (bytes, bytearray, memoryview)):
        proto, base_dir = _from_bytes(bytes(src), "the given bytes"), None
        what = "the given bytes"
    else:
        path = Path(os.fspath(src))
        try:
            data, in_place = inline_weights.read(path)
        except OSError as exc:
            raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except inline_weights.WireError as exc:
            raise ModelError(f"not an ONNX model: {path} ({exc})") from exc
        proto, base_dir = _from_bytes(data, str(path)), path.resolve().parent
        what = str(path)
    if base_dir is None and _external_tensors(proto):
        raise ModelError(
            f"{what} references external data files; load it from its path so they can be read"
        )
    return proto, base_dir, in_place


def _copy_for_loading(src: onnx.ModelProto) -> onnx.ModelProto:
    """A copy the loader may rewrite, sharing nothing with ``src``; weights are copied once here
    and then moved out of the copy, so the caller's proto is never modified."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(src)
    return out


def _from_bytes(data: bytes, what: str) -> onnx.ModelProto:
    import onnx

    try:
        proto = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises DecodeError, or RuntimeWarning-like errors
        raise ModelError(f"not an ONNX model: {what} ({type(exc).__name__}: {exc})") from exc
    # protobuf parses many byte strings (the empty one included) into a message with no graph
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise ModelError(f"not an ONNX model: {what} (no ir_version, opset or graph)")
    return proto


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    import onnx

    return [
        t for t in onnx.external_data_helper._get_all_tensors(proto)
        if t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
    ]


def _weightless(proto: onnx.ModelProto, constants: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The graph as the checker sees it: small weights as initializers, large ones as typed
    graph inputs. The checker serialises what it checks; a 1 GiB weight would be copied twice
    more for a check that, for its bytes, only compares their size with the shape, which
    reading them into arrays has done already."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)  # holds no weights: they were taken out
    declared = {i.name for i in out.graph.input}
    for name, value in constants.items():
        if value.nbytes <= _INLINE_CONSTANT_BYTES and value.dtype.kind != "O":
            out.graph.initializer.append(numpy_helper.from_array(np.array(value, order="C", copy=None), name))
        elif name not in declared:
            out.graph.input.append(_value_info(name, TensorInfo(value.shape, value.dtype)))
    _outputs_as_computed(out)
    return out


def _outputs_as_computed(proto: onnx.ModelProto) -> None:
    """Gives the graph's outputs the types its inference computes and drops its value_infos, so
    that the checker (which requires an output's shape, and fails where a declared one disagrees
    with the graph's) judges the graph, not what an exporter declared about it. An output whose
    shape the inference cannot find keeps its declared rank, every dim unknown."""
    import onnx
    from onnx import helper

    graph = proto.graph
    del graph.value_info[:]
    declared = {o.name: onnx.ValueInfoProto.FromString(o.SerializeToString()) for o in graph.output}
    for o in graph.output:
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    failed = ""
    try:
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(proto, strict_mode=True).graph.output}
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        inferred, failed = {}, str(exc)
    for o in graph.output:
        found = inferred.get(o.name)
        if found is not None and found.type.tensor_type.HasField("shape"):
            o.type.tensor_type.shape.CopyFrom(found.type.tensor_type.shape)
            continue
        old = declared[o.name].type.tensor_type if declared[o.name].type.HasField("tensor_type") else None
        if old is not None and old.HasField("shape"):
            o.type.tensor_type.shape.CopyFrom(helper.make_tensor_type_proto(
                old.elem_type, [None] * len(old.shape.dim)).tensor_type.shape)
        elif failed:
            raise ModelError(f"output {o.name!r} is declared without a shape, and shape inference failed: {failed}")


def _check(proto: onnx.ModelProto) -> None:
    import onnx

    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ModelError(f"the ONNX checker rejected the model: {exc}") from exc


def _safe_external_path(base_dir: Path, location: str, tensor: str) -> Path:
    """The resolved file of an external tensor, refused unless it lies inside ``base_dir``."""
    rel = Path(location)
    if not location or rel.is_absolute() or rel.drive:
        raise ModelError(f"tensor {tensor!r}: external data location {location!r} must be a relative path")
    if ".." in rel.parts:
        raise ModelError(f"tensor {tensor!r}: external data location {location!r} must not contain '..'")
    resolved = (base_dir / rel).resolve()
    if not resolved.is_relative_to(base_dir):
        raise ModelError(
            f"tensor {tensor!r}: external data {location!r} resolves to {resolved}, outside the model's "
            f"folder {base_dir} (a link leading out of it)"
        )
    return resolved


def open_external(base_dir: Path, location: str, tensor: str) -> tuple[int, os.stat_result, Path]:
    """An open descriptor of an external data file, its stat and its path, after the checks:
    inside ``base_dir``, no link, a regular file with one hard link."""
    path = _safe_external_path(base_dir, location, tensor)
    try:
        # O_NOFOLLOW: the resolved path has no link left; one appearing now is refused
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ModelError(f"tensor {tensor!r}: cannot open external data {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"tensor {tensor!r}: external data {path} is not a regular file")
        if st.st_nlink > 1:
            # a hardlink may share its inode with a file anywhere on the volume
            raise ModelError(f"tensor {tensor!r}: external data {path} has {st.st_nlink} hard links; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd, st, path


def _read_external(tensor: onnx.TensorProto, base_dir: Path, dtype: np.dtype, trace: LoadTrace) -> np.ndarray:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    offset = int(info.get("offset", 0) or 0)
    count = int(np.prod(tensor.dims, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if "length" in info and int(info["length"]) != nbytes:
        raise ModelError(f"tensor {tensor.name!r}: external length {info['length']} != {nbytes} bytes")
    fd, st, path = open_external(base_dir, location, tensor.name)
    stat_key = (st.st_size, st.st_mtime_ns, st.st_ino)
    if trace.external.setdefault(location, stat_key) != stat_key:
        trace.external[location] = None
    try:
        if offset < 0 or offset + nbytes > st.st_size:
            raise ModelError(
                f"tensor {tensor.name!r}: external data {path} has {st.st_size} bytes, "
                f"needs {nbytes} at offset {offset}"
            )
        if nbytes == 0:
            return np.zeros(tuple(tensor.dims), dtype)
        # a read-only map: no copy, pages come in when the weights are first uploaded
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    trace.maps[id(mapped)] = (mapped, location)
    return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(tuple(tensor.dims))


def _tensor_to_array(tensor: onnx.TensorProto, base_dir: Path | None, trace: LoadTrace) -> np.ndarray:
    import onnx
    from onnx import helper, numpy_helper

    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    simple = dtype.kind in "biufc" and tensor.data_type not in _packed_types() and sys.byteorder == "little"
    if tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL:
        if not simple or base_dir is None:
            raise ModelError(f"tensor {tensor.name!r}: external data of this dtype is not supported")
        return _read_external(tensor, base_dir, dtype, trace)
    if simple and tensor.HasField("raw_data"):
        raw = tensor.raw_data
        tensor.ClearField("raw_data")  # the proto's copy goes; the array keeps the only one
        return np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor)


def _packed_types() -> frozenset[int]:
    """ONNX types of less than a byte per element, packed two or four to a byte."""
    from onnx import TensorProto

    return frozenset(getattr(TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
                     if hasattr(TensorProto, n))


def _take_initializers(proto: onnx.ModelProto, base_dir: Path | None, in_place: dict[int, np.ndarray],
                       trace: LoadTrace) -> dict[str, np.ndarray]:
    """Moves initializers out of the proto into arrays (the proto keeps only their names);
    ``in_place`` holds those already read from the file, by index."""
    graph = proto.graph
    constants: dict[str, np.ndarray] = {}
    for index, init in enumerate(graph.initializer):
        if index in in_place:
            constants[init.name] = in_place[index]
            continue
        try:
            constants[init.name] = _tensor_to_array(init, base_dir, trace)
        except ValueError as exc:  # the data's size does not match the declared shape
            raise ModelError(f"initializer {init.name!r} of shape {list(init.dims)}: {exc}") from exc
    for sparse in graph.sparse_initializer:
        constants[sparse.values.name] = _sparse_to_dense(sparse)
    del graph.initializer[:]
    del graph.sparse_initializer[:]
    return constants


def _sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    from onnx import numpy_helper

    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    shape = tuple(sparse.dims)
    dense = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), shape)
    dense[flat] = values
    return dense.reshape(shape)


def _onnx_opset(proto: onnx.ModelProto) -> int:
    import onnx.defs

    newest = onnx.defs.onnx_opset_version()
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            if entry.version > newest:
                raise ModelError(f"the model imports ai.onnx opset {entry.version}; vkpool loads opsets up to "
                                 f"{newest} (re-export it at one of those, or convert it with onnx.version_converter)")
            if entry.version < MIN_OPSET:
                # an older opset loads when none of its ops changed before MIN_OPSET (Not, Relu, ...):
                # the kernels implement the definitions in force from MIN_OPSET on
                changed = sorted({n.op_type for n in proto.graph.node if n.domain in ("", "ai.onnx")
                                  and not _same_definition(n.op_type, int(entry.version))})
                if changed:
                    raise ModelError(
                        f"the model imports ai.onnx opset {entry.version}, where {', '.join(changed)} "
                        f"{'has' if len(changed) == 1 else 'have'} an older definition than vkpool's kernels "
                        f"(opset {MIN_OPSET} on); re-export it at opset {MIN_OPSET} or later, or convert it "
                        "with onnx.version_converter")
                return MIN_OPSET
            return int(entry.version)
    raise ModelError("the model imports no ai.onnx opset")


def _same_definition(op_type: str, opset: int) -> bool:
    """Whether ``op_type`` at ``opset`` is the definition in force at MIN_OPSET."""
    import onnx.defs

    try:
        return (onnx.defs.get_schema(op_type, opset).since_version
                == onnx.defs.get_schema(op_type, MIN_OPSET).since_version)
    except onnx.defs.SchemaError:
        return False


def _refuse_vendor_ops(proto: onnx.ModelProto) -> None:
    """Refuses, before any other check, nodes of domains other than ai.onnx (com.microsoft's fused
    ops, ai.onnx.ml, ...) that are not functions the model defines: there are no kernels for them."""
    local = {(f.domain, f.name) for f in proto.functions}
    vendor = {(domain, op) for op, domain in subgraph_op_types(proto.graph)
              if domain not in ("", "ai.onnx") and (domain, op) not in local}
    if vendor:
        ops = ", ".join(f"{op} (domain {domain})" for domain, op in sorted(vendor))
        raise UnsupportedOp(f"the model uses ops outside the ai.onnx domain: {ops}; vkpool has kernels for ai.onnx "
                            "ops only (export without vendor-specific fusions, e.g. onnxruntime graph optimizations "
                            "at the 'basic' level or below)")


def check_tensor_sizes(tensors: dict[str, TensorInfo]) -> None:
    """Refuses (:class:`ModelError`) a tensor over :data:`MAX_TENSOR_BYTES`."""
    for name, info in tensors.items():
        nbytes = _nbytes(info)
        if nbytes > MAX_TENSOR_BYTES:
            raise ModelError(f"tensor {name!r} of shape {list(info.shape)} ({info.dtype}) needs {format_size(nbytes)}; "
                             f"vkpool refuses tensors over {format_size(MAX_TENSOR_BYTES)} (no device holds "
                             "one): check the model's shapes and the dims bound to its inputs")


# -- symbolic dimensions and shape inference -----------------------------------------------------


def _bind_dims(graph: onnx.GraphProto, batch: int, dims: dict[str, int], shapes: dict[str, tuple[int, ...]],
               constants: set[str]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Writes concrete values for the symbolic dims of the graph inputs; returns the names bound
    and, per input, the axes that were symbolic.

    ``shapes[input]`` gives every dim of that input; else a named dim takes ``dims[name]``; else
    the first dim of an input takes ``batch``. (A negative dim was made one without a name.)
    """

    binding = dict(dims)
    symbolic: dict[str, tuple[int, ...]] = {}
    names: set[str] = set()
    batch_used = False
    unbound: list[str] = []
    inputs = _declared_values(graph.input, constants)
    for value in graph.input:
        if value.name in constants or not value.type.HasField("tensor_type"):
            continue
        ttype = value.type.tensor_type
        if not ttype.HasField("shape"):
            raise ModelError(f"input {value.name!r} has no shape; vkpool needs each input's rank")
        given = shapes.get(value.name)
        if given is not None and len(given) != len(ttype.shape.dim):
            raise ModelError(f"input {value.name!r} has rank {len(ttype.shape.dim)}; a feed of shape "
                             f"{list(given)} cannot bind it")
        axes = []
        for axis, dim in enumerate(ttype.shape.dim):
            if dim.HasField("dim_value"):
                if given is not None and given[axis] != dim.dim_value:
                    raise ModelError(f"input {value.name!r} axis {axis} is {dim.dim_value} in the model; "
                                     f"a feed of shape {list(given)} cannot bind it")
                continue
            name = dim.dim_param
            axes.append(axis)
            names.add(name)
            if given is not None:
                dim.dim_value = int(given[axis])
                batch_used |= axis == 0
            elif name and name in binding:
                dim.dim_value = binding[name]
            elif axis == 0:
                if name:
                    binding[name] = batch
                dim.dim_value = batch
                batch_used = True
            else:
                unbound.append(f"input {value.name!r} axis {axis}" + (f" ({name!r})" if name else " (no name)"))
        if axes:
            symbolic[value.name] = tuple(axes)
    # a binding the model has no use for would load another identical copy: refuse it
    unknown_dims = sorted(set(dims) - names)
    if unknown_dims or (batch != 1 and not batch_used):
        what = f"dims {unknown_dims}" if unknown_dims else f"batch={batch}"
        described = ", ".join(f"{v.name} {[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]}"
                              for v in graph.input if v.type.HasField("tensor_type") and v.name not in constants)
        raise ModelError(f"{what}: no input of the model has such a symbolic dim (inputs: {described}; batch "
                         "binds an input's symbolic first dim, dims a named one)")
    if unbound:
        raise UnboundDims(f"{'; '.join(unbound)}: a symbolic dim nothing binds; give dims={{name: value}} for a "
                          "named one, or run the model in a vkpool.Session, which binds them from each run's feeds",
                          inputs, _declared_values(graph.output, constants), _run_time_ops(graph, constants))
    return binding, symbolic


def _run_time_ops(graph: onnx.GraphProto, constants: set[str]) -> list[tuple[str, str]]:
    """``(op_type, domain)`` of the nodes that read a graph input, directly or through others."""
    live = {i.name for i in graph.input if i.name not in constants}
    ops = []
    for node in graph.node:  # graph order is topological
        if any(t in live for t in (*node.input, *node_outer_names(node))):
            live.update(node.output)
            ops.append((node.op_type, node.domain))
            ops += [t for sub in subgraphs(node) for t in subgraph_op_types(sub)]
    return ops


def _negative_dims_unknown(graph: onnx.GraphProto) -> None:
    """A negative dim (Paddle2ONNX writes -1 for a dynamic one) becomes a dim without a name."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    dim.dim_param = ""


def _declared_values(values: Any, constants: set[str]) -> list[tuple[str, TensorInfo]]:
    """Name and info of each typed value as declared, -1 for each symbolic dim."""
    import onnx

    out = []
    for v in values:
        if v.name in constants or not v.type.HasField("tensor_type"):
            continue
        t = v.type.tensor_type
        if t.elem_type == onnx.TensorProto.UNDEFINED:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        out.append((v.name, TensorInfo(shape, _np_dtype(t.elem_type))))
    return out


def _np_dtype(elem_type: int) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _declared_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """The shapes the model declares for its outputs and value_infos, -1 for a symbolic dim."""
    out: dict[str, tuple[int, ...]] = {}
    for value in [*graph.output, *graph.value_info]:
        ttype = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if ttype is not None and ttype.HasField("shape"):
            out[value.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim)
    return out


def _warn_declared(declared: dict[str, tuple[int, ...]], types: dict[str, TensorInfo]) -> None:
    """One warning listing the declared shapes the graph's own shapes contradict."""
    import warnings

    wrong = []
    for name, shape in declared.items():
        info = types.get(name)
        if info is None:
            continue
        if len(shape) != len(info.shape) or any(d >= 0 and d != c for d, c in zip(shape, info.shape)):
            wrong.append(f"{name!r} declared {['?' if d < 0 else d for d in shape]}, computed {list(info.shape)}")
    if wrong:
        warnings.warn(f"the graph's shapes are used where the model declares others: {'; '.join(wrong[:8])}"
                      + (f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""), DeclaredShapeWarning,
                      stacklevel=5)


def _value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(info.dtype), info.shape)


def _infer(
    proto: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    bound: dict[str, int],
    constants: dict[str, np.ndarray],
    known: dict[str, TensorInfo],
    ranked: dict[str, TensorInfo],
) -> dict[str, TensorInfo]:
    """Static infos of every tensor the inference can reach, for the current (folded) nodes;
    ``ranked`` gets those of known dtype and rank only, with -1 for each unknown dim."""
    import onnx
    from onnx import helper, numpy_helper

    src = proto.graph
    needed = {t for n in nodes for t in (*n.input, *node_outer_names(n))} | {o.name for o in src.output}
    inputs = [i for i in src.input if i.name not in constants]
    inits: list[onnx.TensorProto] = []
    for name in sorted(needed & constants.keys()):
        value = constants[name]
        if value.nbytes <= _INLINE_CONSTANT_BYTES and value.dtype.kind != "O":
            inits.append(numpy_helper.from_array(np.array(value, order="C", copy=None), name))
        else:
            inputs.append(_value_info(name, TensorInfo(value.shape, value.dtype)))
    produced = {t for n in nodes for t in n.output}
    # an output folded into a constant is no longer produced by any node. The graph computes the
    # shapes: value_infos are left out, and outputs keep their element type and declared rank
    # (a rank the graph leaves open, as after a Squeeze of run-time axes), or with a rank the
    # graph contradicts, their element type only
    kept = [o for o in src.output if o.name in produced or o.name in {i.name for i in inputs}]

    def inferred_with(rank: bool) -> onnx.ModelProto:
        outputs = [helper.make_tensor_value_info(
            o.name, o.type.tensor_type.elem_type,
            [None] * len(o.type.tensor_type.shape.dim) if rank and o.type.tensor_type.HasField("shape") else None)
            if o.type.HasField("tensor_type") else o for o in kept]
        graph = helper.make_graph(nodes, src.name or "g", inputs, outputs, inits)
        # IR 4 at least: before it, an initializer types a tensor only when it is also a graph
        # input (IR 3 models list every weight there), and the inputs here leave the constants out
        model = helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=max(proto.ir_version, 4))
        model.functions.extend(proto.functions)
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)

    try:
        try:
            inferred = inferred_with(rank=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            inferred = inferred_with(rank=False)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"shape inference failed: {exc}") from exc
    infos = dict(known)
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        info = static_info(value)
        if info is not None:
            infos[value.name] = info
        else:
            rank_only = _ranked_info(value)
            if rank_only is not None:
                ranked[value.name] = rank_only
    # where the graph says nothing (an op whose inference onnx leaves open), the declared shape is
    # taken, its named dims as bound
    for value in [*src.value_info, *src.output]:
        if value.name in produced and value.name not in infos:
            declared = static_info(_with_bound_names(value, bound))
            if declared is not None:
                infos[value.name] = declared
                ranked.pop(value.name, None)
    for name, value in constants.items():
        infos[name] = TensorInfo(value.shape, value.dtype)
    return infos


def _with_bound_names(value: onnx.ValueInfoProto, bound: dict[str, int]) -> onnx.ValueInfoProto:
    """A copy of ``value`` whose dims named in ``bound`` have its values."""
    import onnx

    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    if out.type.HasField("tensor_type"):
        for dim in out.type.tensor_type.shape.dim:
            if not dim.HasField("dim_value") and dim.dim_param in bound:
                dim.dim_value = bound[dim.dim_param]
    return out


def static_info(value: onnx.ValueInfoProto) -> TensorInfo | None:
    import onnx
    from onnx import helper

    if not value.type.HasField("tensor_type"):
        return None
    ttype = value.type.tensor_type
    if ttype.elem_type == onnx.TensorProto.UNDEFINED or not ttype.HasField("shape"):
        return None
    if any(not d.HasField("dim_value") for d in ttype.shape.dim):
        return None
    return TensorInfo(tuple(d.dim_value for d in ttype.shape.dim),
                      helper.tensor_dtype_to_np_dtype(ttype.elem_type))


def _ranked_info(value: onnx.ValueInfoProto) -> TensorInfo | None:
    import onnx
    from onnx import helper

    ttype = value.type.tensor_type if value.type.HasField("tensor_type") else None
    if ttype is None or ttype.elem_type == onnx.TensorProto.UNDEFINED or not ttype.HasField("shape"):
        return None
    return TensorInfo(tuple(d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim),
                      helper.tensor_dtype_to_np_dtype(ttype.elem_type))


# -- constant folding ----------------------------------------------------------------------------


def _fold(
    nodes: list[onnx.NodeProto],
    constants: dict[str, np.ndarray],
    infos: dict[str, TensorInfo],
    proto: onnx.ModelProto,
    taken: set[str],
) -> tuple[list[onnx.NodeProto], bool]:
    """One pass in topological order; a node folded here makes its consumers foldable too. An If
    whose condition is known is replaced by the branch it takes (``taken``: every name in use)."""
    kept: list[onnx.NodeProto] = []
    changed = False
    for node in nodes:
        if node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] in constants:
            branches = {a.name: a.g for a in node.attribute}
            chosen = branches["then_branch" if bool(np.asarray(constants[node.input[0]]).reshape(-1)[0])
                              else "else_branch"]
            inlined, values = inline_branch(node.name, list(node.output), chosen, taken)
            for name, value in values.items():
                constants[name] = value
                infos[name] = TensorInfo(value.shape, value.dtype)
            kept.extend(inlined)
            changed = True
            continue
        values = _fold_node(node, constants, infos, proto)
        if values is None:
            kept.append(node)
            continue
        changed = True
        for name, value in zip(node.output, values):
            if name:
                constants[name] = value
                infos[name] = TensorInfo(value.shape, value.dtype)
    return kept, changed


def _fold_node(
    node: onnx.NodeProto,
    constants: dict[str, np.ndarray],
    infos: dict[str, TensorInfo],
    proto: onnx.ModelProto,
) -> list[np.ndarray] | None:
    import onnx

    if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None  # subgraphs may read outer-scope values the single-node model lacks
    present = [t for t in node.input if t]
    if node.op_type in ("Shape", "Size") and present and present[0] in infos and present[0] not in constants:
        return [_shape_or_size(node, infos[present[0]])]
    if not all(t in constants for t in present):
        return None
    outputs = [infos.get(t) for t in node.output if t]
    if all(o is not None for o in outputs) and sum(_nbytes(o) for o in outputs if o is not None) > _FOLD_BYTES:
        return None
    try:
        values = evaluate_node(node, constants, list(proto.opset_import), proto.ir_version, proto.functions)
    except Exception:  # an op the reference cannot evaluate stays a node; the runtime runs it
        return None
    out: list[np.ndarray] = []
    for name, value in zip(node.output, values):
        if not name:
            out.append(np.zeros(0))
            continue
        array = np.asarray(value)
        if name in infos and infos[name].dtype != array.dtype and array.dtype.kind != "O":
            array = array.astype(infos[name].dtype)  # keep the declared dtype (int64 shapes ...)
        out.append(array)
    return out


def _nbytes(info: TensorInfo) -> int:
    """Bytes of ``info`` in Python integers (a product of huge dims must not wrap around)."""
    count = 1
    for d in info.shape:
        count *= max(int(d), 0)
    return count * info.dtype.itemsize


def _shape_or_size(node: onnx.NodeProto, info: TensorInfo) -> np.ndarray:
    from onnx import helper

    if node.op_type == "Size":
        return np.array(info.size, dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    rank = len(info.shape)
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(info.shape[start:end], dtype=np.int64)


def evaluate_node(node: onnx.NodeProto, constants: dict[str, np.ndarray], opset_imports: list[Any],
                  ir_version: int | None = None, functions: Any = ()) -> list[Any]:
    """The outputs of ``node`` on the values in ``constants``, by onnx's ReferenceEvaluator (None
    for an omitted optional output); raises whatever the evaluator raises."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator  # imported on first fold: it is slow to import

    names = list(dict.fromkeys(t for t in node.input if t))
    inputs = [_value_info(n, TensorInfo(constants[n].shape, constants[n].dtype)) for n in names]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    model = helper.make_model(graph, opset_imports=opset_imports)
    if ir_version is not None:
        model.ir_version = ir_version
    model.functions.extend(functions)
    results = iter(ReferenceEvaluator(model).run(None, {n: constants[n] for n in names}))
    # omitted optional outputs ('') get no value; _fold skips them by name
    return [next(results) if o else None for o in node.output]


def to_node(node: onnx.NodeProto) -> Node:
    """A loaded node of ``node``: attributes as Python values (a subgraph stays a GraphProto), the
    outer-scope names its subgraphs read appended to its inputs."""
    import onnx
    from onnx import helper, numpy_helper

    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, list) and value and isinstance(value[0], onnx.TensorProto):
            value = [numpy_helper.to_array(v) for v in value]
        attrs[attr.name] = value
    # the outer-scope values of subgraphs follow the op's own inputs (vkpool.subgraph.formal_inputs)
    inputs = [*node.input, *node_outer_names(node)]
    return Node(node.name, node.op_type, node.domain, inputs, list(node.output), attrs)
