"""The daemon's view of the runtime: one device pool, sessions opened on it, error mapping.

Everything the daemon asks of the runtime goes through :class:`Runtime`, so tests can hand the
server another object with the same methods.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from vkpool.daemon.protocol import ProtocolViolation


class Runtime:
    """vkpool's runtime: a :class:`vkpool.pool.DevicePool` shared by every loaded model."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @classmethod
    def from_config(cls, config: Any) -> "Runtime":
        """``config``: a path, a parsed config object, or None for the default."""
        from vkpool.pool import DevicePool

        return cls(DevicePool.from_config(config))

    def members(self) -> list[dict[str, Any]]:
        return [{"id": m.id, "kind": m.kind, "name": member_name(m), "budget_bytes": int(m.budget_bytes),
                 "used_bytes": int(m.used_bytes)} for m in self.pool.members]

    def has_member(self, member: str) -> bool:
        return any(m.id == member for m in self.pool.members)

    def budget_of(self, member: str) -> int:
        return int(self.pool.member(member).budget_bytes)

    def open(self, source: Path | bytes, shape: Mapping[str, Any] | None = None,
             batching: Mapping[str, Any] | None = None, objective: str = "latency", run_slots: int = 1) -> Any:
        """A session of the model on the pool; ``shape``: ``{batch, dims}`` binding symbolic dims;
        ``batching``: ``{max_batch, max_queue_delay}`` for a model whose requests are batched;
        ``objective``: what its plan is made for (``latency`` or ``throughput``); ``run_slots``:
        as :class:`vkpool.Session` takes it. A throughput plan's copies run in threads of the
        daemon (``processes=False``), so that the thread that reads the requests drives every
        copy itself (``Session.run_many``) instead of handing each request to a worker process."""
        from vkpool.session import Session

        shape, batching = shape or {}, batching or {}
        return Session(str(source) if isinstance(source, Path) else bytes(source), pool=self.pool,
                       batch=shape.get("batch") or 1, dims=shape.get("dims") or None, objective=objective,
                       max_batch=batching.get("max_batch"), max_queue_delay=batching.get("max_queue_delay", 0.0),
                       run_slots=run_slots, processes=False if objective == "throughput" else None)

    def set_budget(self, member: str, nbytes: int) -> None:
        self.pool.set_budget(member, nbytes)

    def what_if(self, session: Any, budgets: Mapping[str, int]) -> Any:
        """The placement ``session``'s model would run with were the members' budgets ``budgets``
        (member → bytes; none: the placement it runs), rendered as ``vkpool plan`` renders it. As a
        budget change leaves it (:mod:`vkpool.daemon.budgets`): where every changed budget still
        holds what its member holds now, the placement it runs now; else the model placed afresh
        (:func:`vkpool.partition.place_model`) with its own memory given back. Allocates nothing."""
        import dataclasses

        from vkpool.config.loader import placement_policy
        from vkpool.partition import place_model
        from vkpool.partition.render import to_json_dict, to_text
        from vkpool.placement import planner_members

        placement = session.placement
        if placement is None:
            if budgets:
                raise ValueError("the model's shapes depend on run-time values: its parts are placed as "
                                 "they are compiled, so it has no plan to weigh against other budgets")
            return session.plan  # a cut model: its parts' plans, as the session shows them
        used = {m.id: int(m.used_bytes) for m in self.pool.members}
        if any(nbytes < used[member] for member, nbytes in budgets.items()):
            mine = session.memory_by_member()
            free = {m.id: int(budgets.get(m.id, m.budget_bytes)) - used[m.id] + int(mine.get(m.id, 0))
                    for m in self.pool.members}
            m = session.model  # placing may divide products: on a copy, the session runs this one
            model = dataclasses.replace(m, nodes=list(m.nodes), constants=dict(m.constants),
                                        tensors=dict(m.tensors), column_splits=dict(m.column_splits))
            placement = place_model(model, planner_members(self.pool, budgets=free),
                                    policy=placement_policy(self.pool.config))[1]
        return _RenderedPlan(to_text(placement), to_json_dict(placement))


def member_name(member: Any) -> str:
    """The device's name as the driver reports it (``NVIDIA H100 80GB HBM3``, ``llvmpipe ...``),
    with the split for a member that is part of one; ``host CPU`` for the host member."""
    info = getattr(member, "info", None)
    if info is None:
        return "host CPU" if member.kind == "host" else ""
    split = getattr(member, "split_index", None)
    return str(info.name) + ("" if split is None else f" (split {split})")


class _RenderedPlan:
    def __init__(self, text: str, as_json: dict[str, Any]) -> None:
        self.text, self.json = text, as_json

    def to_text(self) -> str:
        return self.text

    def to_json(self) -> dict[str, Any]:
        return self.json


def classify(exc: BaseException) -> ProtocolViolation:
    """The error reply for an exception raised by the runtime."""
    if isinstance(exc, ProtocolViolation):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = str(exc) or type(exc).__name__
    if "ModelError" in names:
        return ProtocolViolation("ModelError", message)
    if "UnsupportedOp" in names:
        return ProtocolViolation("UnsupportedOp", message)
    if "PartitionUnfeasible" in names or "DeviceOutOfMemory" in names:
        details = {k: getattr(exc, k) for k in ("member", "requested", "used", "budget")
                   if isinstance(getattr(exc, k, None), (int, str))}
        return ProtocolViolation("InsufficientMemory", message, details)
    if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
        return ProtocolViolation("FileNotFound", f"the daemon cannot read {exc.filename}: {exc.strerror}",
                                 {"path": str(exc.filename)})
    return ProtocolViolation("EngineError", f"{type(exc).__name__}: {message}")
