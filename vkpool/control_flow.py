"""Loop, Scan and NonMaxSuppression, run where a model is cut (:mod:`vkpool.dynamic`).

At a cut, every input of such a node is known on the host: read back from the prefix, or a
model input or constant. Then:

- **Loop** and **Scan**: the body is compiled as a part of its own (a static
  :class:`vkpool.Session`, or one cut again where its shapes depend on values, such as an If
  inside the body) once per set of input shapes, kept in a least-recently-used cache, and run
  once per iteration: its command buffers are recorded once and replayed. The loop-carried values
  go from one iteration's outputs to the next one's inputs; the trip count and the condition are
  read on the host, where the loop decides whether to go on. The outer-scope values the body
  reads are constants of the body where the model holds them as such, inputs fed to each
  iteration otherwise. Scan outputs are stacked (Loop: along a new first axis; Scan: along
  ``scan_output_axes``, in ``scan_output_directions``).
- **NonMaxSuppression**: computed on the host (:func:`~vkpool.kernels.ops.control_flow.non_max_suppression`)
  from the boxes and scores read back.

Their outputs are inputs of the rest of the model (the suffix), compiled per set of their shapes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable

import numpy as np

from vkpool.kernels.base import TensorInfo, UnsupportedOp
from vkpool.kernels.ops.control_flow import non_max_suppression
from vkpool.model import ModelError, Node, static_info, to_node
from vkpool.subgraph import formal_inputs, initializers

#: bodies kept compiled per Loop or Scan, one per distinct set of input shapes
BODY_CACHE_SIZE = 8
#: the most iterations one Loop may run: a Loop whose condition never turns false (or whose trip
#: count is astronomically large) fails with a ModelError there instead of holding its caller,
#: a daemon's worker among them, forever
LOOP_ITERATION_LIMIT = 1 << 20

Values = Callable[[str], np.ndarray]
#: a compiled body: the part (None when every output is known without running), its inputs, the
#: outputs it computes, those folded to constants, and the infos of every output known
_Compiled = tuple[Any, list[str], list[str], dict[str, np.ndarray], dict[str, TensorInfo]]


def host_runner(node: Node, constants: dict[str, np.ndarray], opset: int, compile_part: Callable[[Any], Any],
                run_part: Callable[[Any, list[str], dict[str, np.ndarray]], dict[str, np.ndarray]]) -> Any:
    """The runner of ``node`` (a Loop, Scan or NonMaxSuppression): ``run(value)`` returns its
    outputs, ``value(name)`` giving any tensor it reads."""
    if node.op_type == "NonMaxSuppression":
        return _Suppression(node)
    body = _Body(node, constants, opset, compile_part, run_part)
    return _Loop(node, body) if node.op_type == "Loop" else _Scan(node, body, legacy=opset < 9)


class _Suppression:
    """NonMaxSuppression on the boxes and scores read back (its inputs 2 to 4 optional)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.center = int(node.attrs.get("center_point_box", 0))
        if self.center not in (0, 1):
            raise ModelError(f"NonMaxSuppression '{node.name}': center_point_box must be 0 or 1, got {self.center}")

    def run(self, value: Values) -> list[np.ndarray]:
        inputs = [value(t) if t else None for t in self.node.inputs[:5]] + [None] * (5 - len(self.node.inputs[:5]))
        boxes, scores, most, iou, least = inputs
        assert boxes is not None and scores is not None
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0] \
                or scores.shape[2] != boxes.shape[1]:
            raise ModelError(f"NonMaxSuppression '{self.node.name}': boxes {list(boxes.shape)} and scores "
                             f"{list(scores.shape)} must be [batches, boxes, 4] and [batches, classes, boxes]")
        return [non_max_suppression(
            boxes, scores, 0 if most is None or most.size == 0 else int(most.reshape(-1)[0]),
            0.0 if iou is None or iou.size == 0 else float(iou.reshape(-1)[0]),
            None if least is None or least.size == 0 else float(least.reshape(-1)[0]), self.center)]

    def parts(self) -> Iterable[Any]:
        return ()

    def close(self) -> None:
        pass


class _Body:
    """A Loop's or Scan's body, compiled per set of input shapes (see the module docstring)."""

    def __init__(self, node: Node, constants: dict[str, np.ndarray], opset: int, compile_part: Callable[[Any], Any],
                 run_part: Callable[[Any, list[str], dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
        graph = node.attrs["body"]
        self.node = node
        self.opset = opset
        self.inputs = [i.name for i in graph.input]
        self.outputs = [o.name for o in graph.output]
        self.nodes = [to_node(n) for n in graph.node]
        self.constants = initializers(graph)
        outer = node.inputs[formal_inputs(node.op_type, node.attrs, node.inputs, opset):]
        self.constants.update({n: constants[n] for n in outer if n in constants})
        #: outer-scope values fed to every iteration
        self.outer = [n for n in outer if n not in constants]
        self._compile, self._run = compile_part, run_part
        self._cache: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The body's outputs for ``feeds`` (its inputs and the outer values it reads). Runs of one
        body are serialised: a part the cache evicts is never one a run is using."""
        with self._lock:
            part, inputs, computed, folded, _ = self._compiled(feeds)
            produced = self._run(part, computed, {n: feeds[n] for n in inputs}) if computed else {}
        return [produced[n] if n in produced else folded[n] if n in folded else feeds[n] for n in self.outputs]

    def output_infos(self, feeds: dict[str, np.ndarray]) -> dict[str, TensorInfo]:
        with self._lock:
            return self._compiled(feeds)[4]

    def _compiled(self, feeds: dict[str, np.ndarray]) -> _Compiled:
        """The body compiled for the shapes of ``feeds``; call with the lock held."""
        key = tuple((n, feeds[n].dtype.str, feeds[n].shape) for n in sorted(feeds))
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        found = self._build(feeds)
        self._cache[key] = found
        while len(self._cache) > BODY_CACHE_SIZE:
            evicted = self._cache.popitem(last=False)[1][0]
            if evicted is not None:
                evicted.close()
        return found

    def _build(self, feeds: dict[str, np.ndarray]) -> _Compiled:
        from vkpool.cut import Graph, resolve

        infos = {n: TensorInfo(v.shape, v.dtype) for n, v in feeds.items()}
        graph = Graph(inputs=list(infos.items()), outputs=list(self.outputs), nodes=self.nodes,
                      constants=dict(self.constants), tensors=dict(infos), opset=self.opset)
        try:
            resolved = resolve(graph)
        except (UnsupportedOp, ModelError, ValueError) as exc:
            raise type(exc)(f"in the body of {self.node.op_type} '{self.node.name}': {exc}") from exc
        folded = {n: resolved.constants[n] for n in self.outputs if n in resolved.constants}
        computed = [n for n in dict.fromkeys(self.outputs) if n not in folded and n not in feeds]
        out_infos = {n: resolved.tensors[n] for n in self.outputs if n in resolved.tensors}
        if not computed:
            return None, [], [], folded, out_infos
        read = {t for n in resolved.nodes for t in n.inputs if t}
        inputs = [(n, i) for n, i in infos.items() if n in read]
        part_graph = Graph(inputs=inputs, outputs=computed, nodes=resolved.nodes, constants=resolved.constants,
                           tensors=resolved.tensors, opset=self.opset)
        try:
            part = self._compile(part_graph)
        except (UnsupportedOp, ModelError, ValueError) as exc:
            raise type(exc)(f"in the body of {self.node.op_type} '{self.node.name}': {exc}") from exc
        return part, [n for n, _ in inputs], computed, folded, out_infos

    def parts(self) -> Iterable[Any]:
        with self._lock:
            return [c[0] for c in self._cache.values() if c[0] is not None]

    def close(self) -> None:
        with self._lock:
            parts = [c[0] for c in self._cache.values() if c[0] is not None]
            self._cache.clear()
        for part in parts:
            part.close()


def _iteration_value(value: Any, dtype: Any, declared: Any) -> np.ndarray:
    """An iteration number or condition as the body declares it: a scalar, or of shape [1]."""
    array = np.array(value, dtype=dtype)
    return array.reshape(1) if declared == 1 else array


def _declared_rank(graph: Any, index: int) -> int | None:
    value = graph.input[index]
    t = value.type.tensor_type if value.type.HasField("tensor_type") else None
    return len(t.shape.dim) if t is not None and t.HasField("shape") else None


class _Loop:
    """A Loop: while the trip count lasts and the condition holds (the body's own, from its first
    iteration on, as onnxruntime does), the body runs on the carried values."""

    def __init__(self, node: Node, body: _Body) -> None:
        self.node, self.body = node, body
        self.carried = len(body.inputs) - 2
        self.scanned = len(body.outputs) - 1 - self.carried
        if self.carried < 0 or self.scanned < 0:
            raise ModelError(f"Loop '{node.name}': its body has {len(body.inputs)} inputs and {len(body.outputs)} "
                             "outputs; it needs the iteration number, the condition and the carried values in, "
                             "the condition and the carried values out")
        graph = node.attrs["body"]
        self._ranks = (_declared_rank(graph, 0), _declared_rank(graph, 1))

    def run(self, value: Values) -> list[np.ndarray]:
        node, body = self.node, self.body
        trip = None if not node.inputs[0] else int(value(node.inputs[0]).reshape(-1)[0])
        cond = True if not node.inputs[1] else bool(value(node.inputs[1]).reshape(-1)[0])
        carried = [value(t) for t in node.inputs[2:2 + self.carried]]
        outer = {n: value(n) for n in body.outer}
        scans: list[list[np.ndarray]] = [[] for _ in range(self.scanned)]
        i = 0
        while cond and (trip is None or i < trip):
            if i >= LOOP_ITERATION_LIMIT:
                raise ModelError(
                    f"Loop '{node.name}' ran {LOOP_ITERATION_LIMIT:,} iterations without stopping "
                    f"(trip count {'none' if trip is None else f'{trip:,}'}, its condition still true): vkpool stops a "
                    "Loop there (vkpool.control_flow.LOOP_ITERATION_LIMIT); check the model's condition and trip count")
            feeds = {body.inputs[0]: _iteration_value(i, np.int64, self._ranks[0]),
                     body.inputs[1]: _iteration_value(cond, np.bool_, self._ranks[1]),
                     **dict(zip(body.inputs[2:], carried)), **outer}
            outs = body.run(feeds)
            cond = bool(np.asarray(outs[0]).reshape(-1)[0])
            carried = [np.asarray(v) for v in outs[1:1 + self.carried]]
            for k, v in enumerate(outs[1 + self.carried:]):
                scans[k].append(np.asarray(v))
            i += 1
        stacked = []
        for k, values in enumerate(scans):
            if values:
                stacked.append(np.stack(values))
                continue
            name = body.outputs[1 + self.carried + k]
            info = body.output_infos({body.inputs[0]: _iteration_value(0, np.int64, self._ranks[0]),
                                      body.inputs[1]: _iteration_value(True, np.bool_, self._ranks[1]),
                                      **dict(zip(body.inputs[2:], carried)), **outer}).get(name)
            if info is None:  # the shape its body declares, where the body alone does not fix it
                info = static_info(node.attrs["body"].output[1 + self.carried + k])
            if info is None:
                raise ModelError(f"Loop '{node.name}' ran no iteration and the shape of its scan output {name!r} "
                                 "is not known without one")
            stacked.append(np.zeros((0, *info.shape), info.dtype))
        return [*carried, *stacked]

    def parts(self) -> Iterable[Any]:
        return self.body.parts()

    def close(self) -> None:
        self.body.close()


class _Scan:
    """Scan from opset 9 on; of opset 8 (``legacy``: a batch axis first, then the scan axis; an
    optional ``sequence_lens`` first input), each batch item is scanned the same way."""

    def __init__(self, node: Node, body: _Body, legacy: bool) -> None:
        self.node, self.body, self.legacy = node, body, legacy
        self.scan_inputs = int(node.attrs["num_scan_inputs"])
        self.states = len(body.inputs) - self.scan_inputs
        self.scan_outputs = len(body.outputs) - self.states
        if self.states < 0 or self.scan_outputs < 0:
            raise ModelError(f"Scan '{node.name}': num_scan_inputs={self.scan_inputs} does not fit a body of "
                             f"{len(body.inputs)} inputs and {len(body.outputs)} outputs")
        attrs = node.attrs
        if legacy:
            self.in_axes, self.out_axes = [0] * self.scan_inputs, [0] * self.scan_outputs
            self.in_reverse = [bool(d) for d in attrs.get("directions", [0] * self.scan_inputs)]
            self.out_reverse = [False] * self.scan_outputs
        else:
            self.in_axes = list(attrs.get("scan_input_axes", [0] * self.scan_inputs))
            self.in_reverse = [bool(d) for d in attrs.get("scan_input_directions", [0] * self.scan_inputs)]
            self.out_axes = list(attrs.get("scan_output_axes", [0] * self.scan_outputs))
            self.out_reverse = [bool(d) for d in attrs.get("scan_output_directions", [0] * self.scan_outputs)]

    def run(self, value: Values) -> list[np.ndarray]:
        first = 1 if self.legacy else 0
        inputs = self.node.inputs[first:first + self.states + self.scan_inputs]
        states = [value(t) for t in inputs[:self.states]]
        sequences = [value(t) for t in inputs[self.states:]]
        outer = {n: value(n) for n in self.body.outer}
        if not self.legacy:
            return self._scan(states, sequences, outer)
        lens = value(self.node.inputs[0]).reshape(-1) if self.node.inputs[0] else None
        batch = {x.shape[0] for x in [*states, *sequences]}
        if len(batch) != 1:
            raise ModelError(f"Scan '{self.node.name}': its states and scan inputs have batch sizes {sorted(batch)}")
        per_item = []
        for b in range(batch.pop()):
            full = sequences[0].shape[1] if sequences else 0
            if lens is not None and int(lens[b]) != full:
                raise ModelError(f"Scan '{self.node.name}': sequence_lens[{b}] = {int(lens[b])} is shorter than the "
                                 f"scan inputs' {full} steps; vkpool runs opset 8 Scan over whole sequences only")
            per_item.append(self._scan([x[b] for x in states], [x[b] for x in sequences], outer))
        return [np.stack(values) for values in zip(*per_item)]

    def _scan(self, states: list[np.ndarray], sequences: list[np.ndarray], outer: dict[str, np.ndarray]
              ) -> list[np.ndarray]:
        """The final states and the stacked scan outputs of one scan over ``sequences``."""
        node, body = self.node, self.body
        axes = [a + s.ndim if a < 0 else a for a, s in zip(self.in_axes, sequences)]
        lengths = {s.shape[a] for s, a in zip(sequences, axes)}
        if len(lengths) != 1:
            raise ModelError(f"Scan '{node.name}': its scan inputs have different lengths {sorted(lengths)} "
                             "along their scan axes")
        length = lengths.pop()
        scans: list[list[np.ndarray]] = [[] for _ in range(self.scan_outputs)]
        for t in range(length):
            slices = [np.take(s, length - 1 - t if rev else t, axis=a)
                      for s, a, rev in zip(sequences, axes, self.in_reverse)]
            outs = body.run({**dict(zip(body.inputs, states)),
                             **dict(zip(body.inputs[self.states:], slices)), **outer})
            states = [np.asarray(v) for v in outs[:self.states]]
            for k, v in enumerate(outs[self.states:]):
                scans[k].append(np.asarray(v))
        stacked = []
        for k, values in enumerate(scans):
            if not values:  # no step: the shapes of one step's outputs, from the body
                empty = [np.zeros(tuple(d for i, d in enumerate(s.shape) if i != a), s.dtype)
                         for s, a in zip(sequences, axes)]
                name = body.outputs[self.states + k]
                info = body.output_infos({**dict(zip(body.inputs, states)),
                                          **dict(zip(body.inputs[self.states:], empty)), **outer}).get(name)
                if info is None:
                    raise ModelError(f"Scan '{node.name}' ran no step and the shape of its scan output {name!r} is "
                                     "not known without one")
                axis = self.out_axes[k] + len(info.shape) + 1 if self.out_axes[k] < 0 else self.out_axes[k]
                shape = list(info.shape)
                shape.insert(axis, 0)
                stacked.append(np.zeros(shape, info.dtype))
                continue
            if self.out_reverse[k]:
                values = values[::-1]
            rank = values[0].ndim + 1
            axis = self.out_axes[k] + rank if self.out_axes[k] < 0 else self.out_axes[k]
            stacked.append(np.stack(values, axis=axis))
        return [*states, *stacked]

    def parts(self) -> Iterable[Any]:
        return self.body.parts()

    def close(self) -> None:
        self.body.close()
