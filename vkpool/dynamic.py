"""Data-dependent output shapes: a model cut where run-time values fix a shape.

vkpool compiles static shapes and records each chunk once. Some shapes depend on the *values*
of a tensor: an input an op lists in ``constant_inputs`` (Reshape's shape, TopK's k, Range's
start/limit/delta, Slice's starts, Expand's shape, Tile's repeats, Resize's sizes,
ConstantOfShape's input, OneHot's depth, Compress's condition, ...), NonZero's input among
them (its output has one column per non-zero). Where such a tensor is known only at run time,
:class:`vkpool.Session` cuts the model there instead of refusing it:

- **prefix**: the nodes that depend on no such point, compiled and recorded once like any
  static model (on one member or planned over several);
- **points**: the tensors whose values fix shapes right after the prefix. After the prefix runs
  they are read back (NonZero: its input is read back and the indices are computed on the host
  with numpy);
- **suffix**: the rest of the graph with those values bound as constants and the prefix's other
  boundary tensors as inputs. Bound, the values fold (NonZero becomes a constant, TopK's k is
  known, a Range of constants is evaluated on the host, ...) and the shapes follow from the
  kernels' own ``output_infos``. A suffix is compiled per distinct set of values and kept in a
  least-recently-used cache of :data:`SUFFIX_CACHE_SIZE` entries (``Session(suffix_cache=)``).
  A suffix that still holds such points (one depending on another) is cut the same way.

Control flow is cut the same way: an If's condition is such a point (the suffix is compiled with
the branch taken in its place), and a Loop, a Scan or a NonMaxSuppression runs at the cut on the
values read back (:mod:`vkpool.control_flow`; a loop's body is a part compiled per set of input
shapes and replayed per iteration), its outputs inputs of the suffix, compiled per their shapes.

A model without such points is not touched: the check is one pass over the nodes at load.
Finding the cut and binding values is :mod:`vkpool.cut`; this module compiles and runs the parts.

:class:`ShapeSessions` does the same for the shapes of a model's inputs: a model with symbolic
input dims is compiled per distinct set of input shapes its runs bring, kept in a bounded cache.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np

from vkpool.control_flow import host_runner
from vkpool.cut import CutPoint, Graph, Split, find_cut, node_label, resolve
from vkpool.kernels.base import OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.ops.nonzero import nonzero_indices
from vkpool.kernels.registry import op_class
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel, ModelError, Node, check_tensor_sizes

#: compiled suffixes kept per cut, one per distinct set of bound values; the least recently
#: used is closed (its device memory freed) when a new one would exceed this
SUFFIX_CACHE_SIZE = 8

@dataclass
class CutCounters:
    """What a cut did so far: the prefix is compiled (recorded) once; suffixes per values."""

    prefix_compiles: int = 0
    suffix_compiles: int = 0
    suffix_reuses: int = 0
    suffix_evictions: int = 0


def compile_part(graph: Graph, compile_static: Callable[[LoadedModel], Any], cache_size: int) -> Any:
    """A static part compiled by ``compile_static``, or a :class:`DynamicModel` where it is cut."""
    split = find_cut(graph)
    if split is None:
        return compile_static(graph.static())
    return DynamicModel(graph, split, compile_static, cache_size)


def run_part(part: Any, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if isinstance(part, DynamicModel):
        produced = part.run(feeds)
        return {n: produced[n] for n in names}
    return dict(zip(names, part.run(names, feeds)))


def kernel_nodes(part: Any) -> int:
    """Nodes left to kernels in what ``part`` (a Session or a DynamicModel) compiled: for a cut
    model, its prefix, the loop bodies and the suffix the last run used (0 when everything folded
    on the host)."""
    cut = part if isinstance(part, DynamicModel) else part.dynamic
    if cut is None:
        return len(part.model.nodes)
    return sum(kernel_nodes(p) for p in (cut.prefix, *cut.bodies(), cut.latest) if p is not None)


def _summary(value: np.ndarray) -> str:
    if value.size <= 8:
        return np.array2string(value.reshape(-1) if value.ndim > 1 else value, separator=", ")
    return f"{value.dtype} {list(value.shape)}"


class _Entry:
    def __init__(self, part: Any, what: str) -> None:
        self.part = part
        self.what = what
        self.users = 0
        self.retired = False

    def close_when_idle(self) -> None:
        self.retired = True
        if self.users == 0:
            self.part.close()


def _keep(cache: OrderedDict, key: Any, entry: _Entry, size: int) -> int:
    """Puts a new entry in a least-recently-used ``cache`` of ``size`` entries, takes it for a run
    and closes (once idle) what falls out; how many fell out. Call with the cache's lock held."""
    cache[key] = entry
    evicted = 0
    while len(cache) > size:
        cache.popitem(last=False)[1].close_when_idle()
        evicted += 1
    entry.users += 1
    return evicted


class DynamicModel:
    """A graph cut at ``split``: the prefix compiled once, the suffix per value (see the module
    docstring). ``compile_static`` compiles a static part (a :class:`~vkpool.model.LoadedModel`)
    into something with ``run(names, feeds)``, ``plan``, ``memory_by_member()`` and ``close()``:
    a :class:`vkpool.Session` with the session's placement."""

    def __init__(self, graph: Graph, split: Split, compile_static: Callable[[LoadedModel], Any],
                 cache_size: int = SUFFIX_CACHE_SIZE) -> None:
        if cache_size < 1:
            raise ValueError(f"the suffix cache must keep at least one suffix, got {cache_size}")
        self.graph, self.split, self.points = graph, split, split.points
        self.cache_size = cache_size
        self.counters = CutCounters()
        self._compile_static = compile_static
        self._cache: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._latest: _Entry | None = None
        self._lock = threading.Lock()
        self.prefix: Any = None
        self._prepare_suffix()
        self._host = [host_runner(node, graph.constants, graph.opset, self._compile_body, run_part)
                      for node in split.host]
        self._prepare_prefix()

    # -- construction -----------------------------------------------------------------------
    def _prepare_suffix(self) -> None:
        graph = self.graph
        taken = set(graph.tensors) | set(graph.constants)
        taken |= {t for n in graph.nodes for t in (*n.inputs, *n.outputs)}
        #: tensor read back -> the constant that holds its value in the suffix
        self._binding: dict[str, str] = {}
        #: output of a NonZero evaluated on the host -> the tensor it reads
        self._nonzero: dict[str, str] = {}
        for point in self.points:
            if point.position < 0:  # a Loop, Scan or NonMaxSuppression, run on the host
                continue
            if point.op_type == "NonZero":
                self._nonzero[point.output] = point.tensor
            elif point.tensor not in self._binding:
                name, k = f"{point.tensor}@value", 1
                while name in taken:
                    k += 1
                    name = f"{point.tensor}@value{k}"
                taken.add(name)
                self._binding[point.tensor] = name
        host = {id(n) for n in self.split.host}
        #: outputs of the Loops, Scans and NonMaxSuppressions run on the host
        self._host_outputs = {o for n in self.split.host for o in n.outputs if o}
        made = {o for n in self.split.suffix if id(n) not in host for o in n.outputs if o}
        nodes: list[Node] = []
        for node in self.split.suffix:
            if node.op_type == "NonZero" and node.outputs and node.outputs[0] in self._nonzero:
                continue
            if id(node) in host:
                continue
            fixed = set(op_class(node.op_type, node.domain).constant_inputs)
            inputs = [self._binding.get(t, t) if i in fixed else t for i, t in enumerate(node.inputs)]
            nodes.append(node if inputs == node.inputs else replace(node, inputs=inputs))
        self._suffix_nodes = nodes
        skip = set(graph.constants) | set(self._binding.values()) | set(self._nonzero)
        made_here = {o for n in nodes for o in n.outputs if o}
        self._suffix_inputs = list(dict.fromkeys(
            t for n in nodes for t in n.inputs if t and t not in skip and t not in made_here))
        self._suffix_outputs = list(dict.fromkeys(n for n in graph.outputs if n in made))
        self._suffix_constants = {t: graph.constants[t] for n in nodes for t in n.inputs
                                  if t in graph.constants}

    def _prepare_prefix(self) -> None:
        graph, prefix = self.graph, self.split.prefix
        made = {o for n in prefix for o in n.outputs if o}
        host_inputs = [t for n in self.split.host for t in n.inputs if t]
        wanted = [*self._suffix_inputs, *self._binding, *self._nonzero.values(), *host_inputs, *graph.outputs]
        self._prefix_outputs = list(dict.fromkeys(t for t in wanted if t in made))
        read = {t for n in prefix for t in n.inputs if t}
        self._prefix_inputs = [n for n, _ in graph.inputs if n in read]
        if not self._prefix_outputs:
            return
        names = set(self._prefix_inputs) | read | made
        model = LoadedModel(
            inputs=[(n, i) for n, i in graph.inputs if n in read],
            outputs=[(n, graph.tensors[n]) for n in self._prefix_outputs],
            nodes=list(prefix),
            constants={k: v for k, v in graph.constants.items() if k in read},
            tensors={n: graph.tensors[n] for n in names if n in graph.tensors},
            opset=graph.opset,
        )
        self.prefix = self._compile_static(model)
        self.counters.prefix_compiles += 1

    # -- running ----------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output of the graph, by name, for ``feeds`` (every graph input)."""
        values = dict(feeds)
        if self.prefix is not None:
            values.update(run_part(self.prefix, self._prefix_outputs,
                                   {n: feeds[n] for n in self._prefix_inputs}))
        for runner in self._host:
            outs = runner.run(lambda t: values[t] if t in values else self.graph.constants[t])
            values.update((n, v) for n, v in zip(runner.node.outputs, outs) if n)
        bound = {name: np.asarray(values[t]) for t, name in self._binding.items()}
        bound.update({out: nonzero_indices(values[t]) for out, t in self._nonzero.items()})
        if self._suffix_outputs:
            # the host ops' outputs are inputs of the suffix, compiled per their shapes
            shapes = {n: TensorInfo(values[n].shape, values[n].dtype) for n in self._suffix_inputs
                      if n in self._host_outputs}
            entry = self._acquire(bound, shapes)
            try:
                values.update(run_part(entry.part, self._suffix_outputs,
                                       {n: values[n] for n in self._suffix_inputs}))
            finally:
                self._release(entry)
        return {n: values[n] if n in values else np.array(self.graph.constants[n], copy=True)
                for n in self.graph.outputs}

    def _acquire(self, bound: dict[str, np.ndarray], shapes: dict[str, TensorInfo]) -> _Entry:
        key = tuple((n, v.dtype.str, v.shape, v.tobytes()) for n, v in sorted(bound.items()))
        key += tuple((n, i.dtype.str, i.shape) for n, i in sorted(shapes.items()))
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.counters.suffix_reuses += 1
            else:
                entry = _Entry(self._compile_suffix(bound, shapes), self._what(bound))
                self.counters.suffix_compiles += 1
                self.counters.suffix_evictions += _keep(self._cache, key, entry, self.cache_size)
                self._latest = entry
                return entry
            entry.users += 1
            self._latest = entry
            return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.retired and entry.users == 0:
                entry.part.close()

    def _compile_suffix(self, bound: dict[str, np.ndarray], shapes: dict[str, TensorInfo]) -> Any:
        infos = {n: shapes[n] if n in shapes else self.graph.tensors[n] for n in self._suffix_inputs}
        part_graph = Graph(
            inputs=list(infos.items()),
            outputs=self._suffix_outputs,
            nodes=self._suffix_nodes,
            constants={**self._suffix_constants, **bound},
            tensors=dict(infos),
            opset=self.graph.opset,
        )
        try:
            resolved = resolve(part_graph)
            check_tensor_sizes(resolved.tensors)
        except (OpError, UnsupportedOp, ModelError) as exc:
            raise type(exc)(f"{exc} (in the part of the model after {self._what(bound)})") from exc
        for attempt in range(2):
            try:
                return compile_part(resolved, self._compile_static, self.cache_size)
            except DeviceOutOfMemory:
                idle = [k for k, e in self._cache.items() if e.users == 0]
                if attempt or not idle:
                    raise
                for k in idle:  # make room: the suffixes of other values are compiled again when needed
                    evicted = self._cache.pop(k)
                    if evicted is self._latest:
                        self._latest = None
                    evicted.close_when_idle()
                    self.counters.suffix_evictions += 1
            except (OpError, UnsupportedOp, ModelError) as exc:
                raise type(exc)(f"{exc} (in the part of the model after {self._what(bound)})") from exc
        raise AssertionError("unreachable")

    def _what(self, bound: dict[str, np.ndarray]) -> str:
        parts = []
        for point in self.points:
            if point.position < 0:
                parts.append(point.describe())
            elif point.op_type == "NonZero":
                count = bound[point.output].shape[1]
                parts.append(f"{point.describe()} ({count} non-zero{'s' if count != 1 else ''})")
            else:
                parts.append(f"{point.describe()} = {_summary(bound[self._binding[point.tensor]])}")
        return "; ".join(dict.fromkeys(parts))

    # -- what it holds ------------------------------------------------------------------------
    @property
    def suffixes(self) -> int:
        """Suffixes compiled and kept now."""
        return len(self._cache)

    @property
    def latest(self) -> Any:
        """The suffix the last run used (a compiled part), or None before the first run."""
        return None if self._latest is None else self._latest.part

    def bodies(self) -> list[Any]:
        """The Loop and Scan bodies compiled and kept (parts of their own)."""
        return [p for runner in self._host for p in runner.parts()]

    def _compile_body(self, graph: Graph) -> Any:
        return compile_part(graph, self._compile_static, self.cache_size)

    def parts(self) -> Iterable[Any]:
        """The prefix (if any), the loop bodies compiled and every suffix kept."""
        if self.prefix is not None:
            yield self.prefix
        yield from self.bodies()
        with self._lock:
            entries = list(self._cache.values())
        yield from (e.part for e in entries)

    def memory_by_member(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self.parts():
            for member, nbytes in part.memory_by_member().items():
                total[member] = total.get(member, 0) + nbytes
        return total

    def summary(self) -> list[str]:
        """What is cut where, in a few lines."""
        points = "; ".join(dict.fromkeys(p.describe() if p.position < 0 else f"tensor '{p.tensor}' ({p.describe()})"
                                         for p in self.points))
        c = self.counters
        lines = [
            f"prefix: {len(self.split.prefix)} ops recorded once",
            f"suffix: {len(self.split.suffix)} ops compiled per value of {points}",
        ]
        if self._host:
            lines.append(f"  run at the cut: {', '.join(node_label(n) for n in self.split.host)}; "
                         f"{len(self.bodies())} loop body part(s) compiled, one per set of input shapes, "
                         "each replayed once per iteration")
        if self.split.later:
            lines.append(f"  {self.split.later} op(s) of the suffix depend on those values for their own "
                         "shapes: the suffix is cut again")
        lines.append(f"  {self.suffixes} suffix(es) kept of at most {self.cache_size}; {c.suffix_compiles} "
                     f"compiled, {c.suffix_reuses} reused, {c.suffix_evictions} evicted")
        return lines

    @property
    def plan(self) -> CutPlan:
        return CutPlan(self)

    def close(self) -> None:
        with self._lock:
            entries = list(self._cache.values())
            self._cache.clear()
            self._latest = None
        for entry in entries:
            entry.close_when_idle()
        for runner in self._host:
            runner.close()
        if self.prefix is not None:
            self.prefix.close()
            self.prefix = None


class CutPlan:
    """``Session.plan`` of a cut model: where it is cut, the prefix's plan and the plan of the
    suffix the last run used."""

    def __init__(self, model: DynamicModel) -> None:
        self.model = model
        self.prefix = None if model.prefix is None else model.prefix.plan
        latest = model._latest
        self.suffix = None if latest is None else latest.part.plan
        self.suffix_values = None if latest is None else latest.what

    @property
    def assignment(self) -> dict[str, str]:
        """Node name (or op type and index) → member id, of the prefix and the latest suffix."""
        out: dict[str, str] = {}
        for plan in (self.prefix, self.suffix):
            if plan is not None:
                out.update(plan.assignment)
        return out

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "cut": {
                "prefix_ops": len(m.split.prefix),
                "suffix_ops": len(m.split.suffix),
                "points": [{"tensor": p.tensor, "node": p.node, "op_type": p.op_type, "input": p.input_name}
                           for p in m.points],
                "cut_again": m.split.later,
                "suffixes_kept": m.suffixes,
                "cache_size": m.cache_size,
                "counters": vars(m.counters).copy(),
            },
            "prefix": None if self.prefix is None else self.prefix.to_dict(),
            "suffix": None if self.suffix is None else self.suffix.to_dict(),
            "suffix_values": self.suffix_values,
        }

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_text(self) -> str:
        lines = ["cut model: shapes depend on run-time values", *("  " + s for s in self.model.summary())]
        if self.prefix is not None:
            lines += ["prefix:", *("  " + s for s in self.prefix.to_text().rstrip("\n").splitlines())]
        else:
            lines.append("prefix: none (the values come straight from the inputs)")
        if self.suffix is not None:
            lines += [f"suffix for {self.suffix_values}:",
                      *("  " + s for s in self.suffix.to_text().rstrip("\n").splitlines())]
        elif not self.model._suffix_outputs:
            lines.append("suffix: none (the prefix and the ops run at the cut give every output)")
        else:
            lines.append("suffix: compiled on the first run")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_text()


__all__ = ["CutCounters", "CutPlan", "CutPoint", "DynamicModel", "Graph", "Split", "SUFFIX_CACHE_SIZE",
           "find_cut", "kernel_nodes", "resolve"]


# -- shapes bound per request --------------------------------------------------------------------

#: sessions kept per model whose inputs have symbolic dims, one per distinct set of input shapes
SHAPE_CACHE_SIZE = 8


@dataclass
class ShapeCounters:
    compiles: int = 0
    reuses: int = 0
    evictions: int = 0


class ShapeSessions:
    """A model whose inputs have symbolic dims, compiled once per distinct set of input shapes.

    ``compile_shapes`` loads and compiles the model with every input's shape given (input name →
    shape) and returns a session; the sessions are kept in a least-recently-used cache of
    ``cache_size`` entries (an evicted one is closed once no run uses it; when a compile runs out
    of budget, the idle ones are closed and it is tried once more). Compiles are serialised;
    runs of kept shapes are not.
    """

    def __init__(self, compile_shapes: Callable[[dict[str, tuple[int, ...]]], Any], cache_size: int) -> None:
        if cache_size < 1:
            raise ValueError(f"shape_cache must be at least 1, got {cache_size}")
        self._compile = compile_shapes
        self.cache_size = cache_size
        self.counters = ShapeCounters()
        self._cache: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling = threading.Lock()
        self._latest: _Entry | None = None

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs ``names`` for ``feeds``, by the session compiled for their shapes."""
        shapes = {n: tuple(int(d) for d in v.shape) for n, v in feeds.items()}
        entry = self._acquire(shapes)
        try:
            return dict(zip(names, entry.part.run(names, feeds)))
        finally:
            with self._lock:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    entry.part.close()

    def _acquire(self, shapes: dict[str, tuple[int, ...]]) -> _Entry:
        key = tuple(sorted(shapes.items()))
        entry = self._lookup(key)
        if entry is not None:
            return entry
        with self._compiling:  # one compile at a time; runs of kept shapes go on meanwhile
            entry = self._lookup(key)  # compiled while this run waited
            if entry is not None:
                return entry
            try:
                part = self._compile(shapes)
            except DeviceOutOfMemory:
                if not self._evict_idle():
                    raise
                part = self._compile(shapes)  # once more, with the idle shapes' memory freed
            with self._lock:
                entry = _Entry(part, ", ".join(f"{n} {list(s)}" for n, s in key))
                self.counters.compiles += 1
                self.counters.evictions += _keep(self._cache, key, entry, self.cache_size)
                self._latest = entry
                return entry

    def _evict_idle(self) -> bool:
        """Closes the kept sessions no run is using; whether there was one."""
        with self._lock:
            idle = [k for k, e in self._cache.items() if e.users == 0]
            for k in idle:
                evicted = self._cache.pop(k)
                if evicted is self._latest:
                    self._latest = None
                evicted.close_when_idle()
                self.counters.evictions += 1
        return bool(idle)

    def _lookup(self, key: tuple[Any, ...]) -> _Entry | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.counters.reuses += 1
                entry.users += 1
                self._latest = entry
            return entry

    @property
    def latest(self) -> Any:
        """The session the last run used (None before the first)."""
        return self._latest.part if self._latest is not None else None

    @property
    def shapes(self) -> list[str]:
        """The input shapes compiled and kept, least recently used first."""
        with self._lock:
            return [e.what for e in self._cache.values()]

    def close(self) -> None:
        with self._lock:
            entries = list(self._cache.values())
            self._cache.clear()
            self._latest = None
        for entry in entries:
            entry.part.close()
