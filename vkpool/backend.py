"""``onnx.backend.base.Backend`` for vkpool, as ``onnxruntime.backend`` provides for ORT.

The ONNX project's backend node tests (``onnx.backend.test``) run against vkpool through it.
ONNX's device names map to pool members: ``"CPU"`` (what the test suite asks for) is the
default Vulkan member, so the Vulkan kernels are what the tests exercise; ``"VK"``/``"GPU"``
are accepted too. A model with an op vkpool lacks is "not compatible" (the suite skips it).
Inputs that fix output shapes are bound from the fed values before the model loads
(``shape_inputs``), since vkpool compiles static shapes.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep
from onnx.backend.test.runner import BackendIsNotSupposedToImplementIt

from vkpool.kernels.base import UnsupportedOp
from vkpool.kernels.registry import op_class, unsupported_in
from vkpool.pool import DevicePool
from vkpool.session import Session

_DEVICES = ("CPU", "VK", "GPU")
_pool: DevicePool | None = None
_pool_lock = threading.Lock()


def shared_pool() -> DevicePool:
    """One pool per process: the suite prepares thousands of models."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = DevicePool.from_config(None)
        return _pool


#: ops whose outputs depend on their inputs' static shapes only: a value traced through them
#: comes from no input's values
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def shape_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs whose values reach a node input its kernel needs known at load time.

    Reshape's shape, Slice's starts, TopK's k, Resize's sizes, ... fix output shapes, and vkpool
    compiles static shapes; the backend binds these inputs from the fed values. An input counts
    when such a value is computed from its values (a window size cast and fed to Range, say),
    not when only its shape is read (Shape, Size).
    """
    fed = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output if out}
    found: list[str] = []
    seen: set[str] = set()

    def trace(name: str) -> None:
        if not name or name in seen:
            return
        seen.add(name)
        if name in fed:
            found.append(name)
        elif name in producer and producer[name].op_type not in _SHAPE_ONLY:
            for src in producer[name].input:
                trace(src)

    for node in model.graph.node:
        try:
            positions = op_class(node.op_type, node.domain).constant_inputs
        except UnsupportedOp:
            continue
        for pos in positions:
            if pos < len(node.input):
                trace(node.input[pos])
    return found


def bind_inputs(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs named in ``values`` are initializers holding them."""
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    kept = [i for i in bound.graph.input if i.name not in values]
    del bound.graph.input[:]
    bound.graph.input.extend(kept)
    bound.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), name) for name, v in values.items())
    return bound


def _open(model: onnx.ModelProto, member: str | None) -> Session:
    try:
        return Session(model.SerializeToString(), pool=shared_pool(), device=member)
    except UnsupportedOp as exc:
        # the suite counts this as "not supported" (a skip), not as a failure
        raise BackendIsNotSupposedToImplementIt(str(exc)) from None


class VkpoolRep(BackendRep):
    """A prepared model. Where inputs fix shapes (``shape_inputs``), the session is built on the
    first run from their values, and rebuilt when a later run feeds other values."""

    def __init__(self, model: onnx.ModelProto, member: str | None = None) -> None:
        self.model = model
        self.member = member
        init_names = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in init_names]
        self.bound = shape_inputs(model)
        self._bound_key: tuple[bytes, ...] | None = None
        self._session: Session | None = None if self.bound else _open(model, member)

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError(f"the model is built on its first run, from the values of {self.bound}")
        return self._session

    def _session_for(self, feeds: dict[str, Any]) -> Session:
        if not self.bound:
            return self.session
        missing = [n for n in self.bound if n not in feeds]
        if missing:
            raise ValueError(f"inputs {missing} fix output shapes and must be fed")
        values = {n: np.asarray(feeds[n]) for n in self.bound}
        key = tuple(f"{v.dtype}{v.shape}".encode() + v.tobytes() for v in values.values())
        if self._session is None or key != self._bound_key:
            self.close()
            self._session = _open(bind_inputs(self.model, values), self.member)
            self._bound_key = key
        return self._session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.input_names, inputs))
        session = self._session_for(feeds)
        try:
            return tuple(session.run(None, {k: v for k, v in feeds.items() if k not in self.bound}))
        finally:
            if kwargs.get("close", False):
                self.close()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class VkpoolBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        """Whether vkpool has kernels for every node as this model uses it (op, types, attributes).

        A model with inputs that fix shapes is judged on its ops alone: its kernels are chosen once
        those values are fed.
        """
        if not cls.supports_device(device):
            return False
        if unsupported_in([(n.op_type, n.domain) for n in model.graph.node]):
            return False
        if shape_inputs(model):
            return True
        from vkpool.engine import build_ops
        from vkpool.model import ModelError, load_model

        try:
            loaded = load_model(model.SerializeToString())
            build_ops(loaded.nodes, dict(loaded.tensors), loaded.constants, loaded.opset)
        except (UnsupportedOp, ModelError):
            return False
        return True

    @classmethod
    def prepare(cls, model: onnx.ModelProto | bytes | str, device: str = "CPU", **kwargs: Any) -> VkpoolRep:
        if not cls.supports_device(device):
            raise UnsupportedOp(f"device {device!r} is not one of {_DEVICES}")
        if isinstance(model, str):
            model = onnx.load(model)
        elif isinstance(model, bytes):
            model = onnx.load_from_string(model)
        kinds = {v.type.WhichOneof("value") for v in [*model.graph.input, *model.graph.output]}
        other = sorted(kinds - {"tensor_type"})
        if other:
            raise BackendIsNotSupposedToImplementIt(
                f"only tensor inputs and outputs are supported, not {', '.join(other)}")
        missing = unsupported_in([(n.op_type, n.domain) for n in model.graph.node])
        if missing:
            raise BackendIsNotSupposedToImplementIt(
                f"the model uses ops vkpool does not support: {', '.join(missing)}")
        return VkpoolRep(model, kwargs.get("member"))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any
                  ) -> tuple[np.ndarray, ...]:
        rep = cls.prepare(model, device, **kwargs)
        try:
            return rep.run(inputs)
        finally:
            rep.close()

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[np.ndarray], device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None, **kwargs: Any
                 ) -> tuple[np.ndarray, ...]:
        from onnx import helper

        in_infos = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype),
                                                  np.asarray(x).shape)
                    for name, x in zip(node.input, inputs) if name]
        out_infos = [helper.make_empty_tensor_value_info(name) for name in node.output if name]
        graph = helper.make_graph([node], "node", in_infos, out_infos)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return cls.run_model(model, [np.asarray(x) for x in inputs], device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper().split(":")[0] in _DEVICES


prepare = VkpoolBackend.prepare
run_model = VkpoolBackend.run_model
run_node = VkpoolBackend.run_node
supports_device = VkpoolBackend.supports_device
is_compatible = VkpoolBackend.is_compatible
