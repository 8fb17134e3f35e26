"""The in-process API, shaped like ONNX Runtime's ``InferenceSession``."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from vkpool.kernels.base import UnsupportedOp
from vkpool.kernels.registry import unsupported_in
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import LoadedModel, load_model
from vkpool.pool import DevicePool, HostMember, Member, VulkanMember

ORT_TYPES = {
    np.dtype(np.float32): "tensor(float)", np.dtype(np.float16): "tensor(float16)",
    np.dtype(np.float64): "tensor(double)", np.dtype(np.int64): "tensor(int64)",
    np.dtype(np.int32): "tensor(int32)", np.dtype(np.int16): "tensor(int16)",
    np.dtype(np.int8): "tensor(int8)", np.dtype(np.uint8): "tensor(uint8)",
    np.dtype(np.bool_): "tensor(bool)",
}


class InvalidInput(ValueError):
    """The inputs given to ``run`` do not match the model's inputs."""


@dataclass(frozen=True)
class NodeArg:
    """An input or output of the model, as ONNX Runtime describes it."""

    name: str
    shape: list[int]
    dtype: np.dtype

    @property
    def type(self) -> str:
        return ORT_TYPES.get(self.dtype, f"tensor({self.dtype})")


class Session:
    """Loads an ONNX model onto the pool and runs it.

    ``model``: a path or the model's bytes. ``device``: a member id (``"vk0"``, ``"vk0.1"``,
    ``"cpu"``); by default the first Vulkan member whose budget holds the model. ``budgets``:
    member id → size (``"512MiB"`` or bytes) applied to the pool before placing. ``config``: a
    config path for the pool this session creates; ``pool``: an existing pool to share.
    ``batch``/``dims`` bind symbolic dimensions (the batch dimension defaults to 1).
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        *,
        device: str | None = None,
        budgets: Mapping[str, int | str] | None = None,
        config: str | os.PathLike | None = None,
        pool: DevicePool | None = None,
        batch: int = 1,
        dims: Mapping[str, int] | None = None,
    ) -> None:
        self._own_pool = pool is None
        self.pool = pool if pool is not None else DevicePool.from_config(None if config is None else str(config))
        self._chunk: Any = None
        self._closed = False
        self._lock = threading.Lock()
        try:
            for member_id, size in (budgets or {}).items():
                self.pool.set_budget(member_id, size)
            self.model: LoadedModel = load_model(model, batch=batch, dims=dict(dims or {}))
            missing = unsupported_in(self.model.op_types())
            if missing:
                raise UnsupportedOp(
                    f"the model uses ops vkpool does not support: {', '.join(missing)}. "
                    "`vkpool ops` lists the supported ops."
                )
            self._compile(device)
        except BaseException:
            self.close()
            raise

    # -- placement -------------------------------------------------------------------------
    def _candidates(self, device: str | None) -> list[Member]:
        if device is not None:
            return [self.pool.member(device)]
        members = list(self.pool.vulkan_members)
        members += [m for m in self.pool.members if isinstance(m, HostMember)]
        if not members:
            raise RuntimeError("the pool has no members: check the config's device rules and host.enabled")
        return members

    def _compile(self, device: str | None) -> None:
        from vkpool.engine import HostChunk, VulkanChunk

        m = self.model
        used = {n for node in m.nodes for n in node.inputs if n}
        self._chunk_outputs = [name for name, _ in m.outputs if name not in m.constants]
        self._chunk_inputs = [name for name, _ in m.inputs if name in used or name in self._chunk_outputs]
        errors: list[str] = []
        for member in self._candidates(device):
            cls = VulkanChunk if isinstance(member, VulkanMember) else HostChunk
            tensors = dict(m.tensors)
            try:
                self._chunk = cls(member, m.nodes, tensors, m.constants, self._chunk_inputs,
                                  self._chunk_outputs, m.opset)
                self.member = member
                return
            except DeviceOutOfMemory as exc:
                errors.append(str(exc))
                if device is not None:
                    raise
        raise DeviceOutOfMemory(
            "pool", 0, 0, 0, "no member's budget holds the whole model: " + " | ".join(errors)
        )

    # -- ONNX Runtime-shaped API ----------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(n, list(i.shape), i.dtype) for n, i in self.model.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(n, list(i.shape), i.dtype) for n, i in self.model.outputs]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Runs the model; returns the outputs named (all, in model order, when None)."""
        if self._closed:
            raise RuntimeError("the session is closed")
        feeds = self._check_feeds(input_feed)
        names = [n for n, _ in self.model.outputs] if output_names is None else list(output_names)
        known = {n for n, _ in self.model.outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidInput(f"unknown output(s) {unknown}; the model's outputs are {sorted(known)}")
        produced = self._chunk.run({n: feeds[n] for n in self._chunk_inputs})
        out = []
        for name in names:
            if name in produced:
                out.append(produced[name])
            else:
                out.append(np.array(self.model.constants[name], copy=True))
        return out

    def _check_feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        expected = {n: i for n, i in self.model.inputs}
        extra = sorted(set(input_feed) - set(expected))
        if extra:
            raise InvalidInput(f"unknown input(s) {extra}; the model's inputs are {sorted(expected)}")
        missing = sorted(set(expected) - set(input_feed))
        if missing:
            raise InvalidInput(f"missing input(s) {missing}")
        feeds = {}
        for name, info in expected.items():
            value = np.asarray(input_feed[name])
            if value.dtype != info.dtype:
                raise InvalidInput(f"input {name!r} must be {info.dtype}, got {value.dtype}")
            if tuple(value.shape) != info.shape:
                raise InvalidInput(f"input {name!r} must have shape {list(info.shape)}, got {list(value.shape)}")
            feeds[name] = value
        return feeds

    # -- what it holds ----------------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        from vkpool.placement import SingleMemberPlan

        return SingleMemberPlan(self.model, self.member.id, self._chunk.stats)

    def memory_by_member(self) -> dict[str, int]:
        stats = self._chunk.stats
        return {self.member.id: stats.weight_bytes + stats.arena_bytes + stats.io_bytes}

    @property
    def stats(self) -> Any:
        return self._chunk.stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._chunk is not None:
                self._chunk.close()
                self._chunk = None
            if self._own_pool and getattr(self, "pool", None) is not None:
                self.pool.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
