"""``onnx.backend.base.Backend`` for vkpool, as ``onnxruntime.backend`` provides for ORT.

The ONNX project's backend node tests (``onnx.backend.test``) run against vkpool through it.
ONNX's device names map to pool members: ``"CPU"`` (what the test suite asks for) is the
first Vulkan member, whatever the placement policy would choose, so the Vulkan kernels are what
the tests exercise (``member=`` of :meth:`VkpoolBackend.prepare` names another); ``"VK"``/``"GPU"``
are accepted too. A model with an op vkpool lacks is "not compatible" (the suite skips it).
Inputs whose values fix output shapes (Reshape's shape, TopK's k, ...) need nothing of the
backend: :class:`vkpool.Session` cuts the model where such values are needed and compiles the
rest per value (:mod:`vkpool.dynamic`).
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep
from onnx.backend.test.runner import BackendIsNotSupposedToImplementIt

from vkpool.kernels.base import UnsupportedOp
from vkpool.kernels.registry import unsupported_in
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


def _open(model: onnx.ModelProto, member: str | None) -> Session:
    pool = shared_pool()
    if member is None and pool.vulkan_members:  # vkpool's kernels, whatever the placement policy
        member = pool.vulkan_members[0].id
    try:
        return Session(model.SerializeToString(), pool=pool, device=member)
    except UnsupportedOp as exc:
        # the suite counts this as "not supported" (a skip), not as a failure
        raise BackendIsNotSupposedToImplementIt(str(exc)) from None


class VkpoolRep(BackendRep):
    """A prepared model: one :class:`vkpool.Session`, also for a model whose shapes depend on
    the fed values (the session compiles the dependent part per value on its first runs)."""

    def __init__(self, model: onnx.ModelProto, member: str | None = None) -> None:
        self.model = model
        self.member = member
        init_names = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in init_names]
        self._session: Session | None = _open(model, member)

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError("the prepared model is closed")
        return self._session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.input_names, inputs))
        try:
            return tuple(self.session.run(None, feeds))
        except UnsupportedOp as exc:
            # the part compiled for the fed values needs a kernel vkpool lacks: "not supported"
            raise BackendIsNotSupposedToImplementIt(str(exc)) from None
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

        Of a model whose shapes depend on run-time values, the part before the cut is judged by
        its kernels and the rest by its ops alone: those kernels are chosen once the values are known.
        """
        if not cls.supports_device(device):
            return False
        if unsupported_in([(n.op_type, n.domain) for n in model.graph.node]):
            return False
        from vkpool.cut import Graph, find_cut
        from vkpool.engine import build_ops
        from vkpool.model import ModelError, load_model

        try:
            loaded = load_model(model.SerializeToString(), partial=True)
            split = find_cut(Graph.of(loaded))
            if split is None and loaded.unresolved:
                return False
            nodes = loaded.nodes if split is None else split.prefix
            build_ops(nodes, dict(loaded.tensors), loaded.constants, loaded.opset)
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
