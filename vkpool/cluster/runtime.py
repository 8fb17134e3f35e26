"""``vkpool serve --cluster``: the daemon's runtime (:class:`vkpool.daemon.runtime.Runtime`'s
methods) over a Ray cluster, so that local clients reach the cluster's pool through the daemon
protocol unchanged: models open as :class:`~vkpool.cluster.session.ClusterSession`, members are
the cluster's (``<node>/<member>``), budgets are set on the nodes."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


class ClusterRuntime:
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    @staticmethod
    def refuses(settings: Any) -> str | None:
        """Why a daemon with ``settings`` cannot run on a cluster, or None."""
        from vkpool.executor import RUN_SLOTS

        if settings.run_slots != RUN_SLOTS:
            return (f"daemon.run_slots is {settings.run_slots}, but with --cluster each node runs its copies "
                    f"with {RUN_SLOTS} run slots of its own: leave daemon.run_slots out, or set it to {RUN_SLOTS}")
        return None

    def members(self) -> list[dict[str, Any]]:
        return [{"id": m["id"], "kind": m["kind"], "name": m["name"], "budget_bytes": int(m["budget_bytes"]),
                 "used_bytes": int(m["used_bytes"])} for m in self.cluster.members()]

    def has_member(self, member: str) -> bool:
        return any(m["id"] == member for m in self.members())

    def budget_of(self, member: str) -> int:
        return next(m["budget_bytes"] for m in self.members() if m["id"] == member)

    def set_budget(self, member: str, nbytes: int) -> None:
        from vkpool.cluster.session import _cause

        try:
            self.cluster.set_budget(member, nbytes)
        except Exception as exc:  # the node's refusal (a ValueError), not Ray's wrapper of it
            raise _cause(exc) from None

    def open(self, source: Path | bytes, shape: Mapping[str, Any] | None = None,
             batching: Mapping[str, Any] | None = None, objective: str = "latency", run_slots: int = 1) -> Any:
        """A cluster session of the model; ``shape``, ``batching`` and ``objective`` as
        :meth:`Runtime.open` takes them. ``run_slots`` is not the driver's to give: each node
        opens its copies with :data:`vkpool.executor.RUN_SLOTS` (a daemon configured otherwise
        does not start: :meth:`refuses`)."""
        shape, batching = shape or {}, batching or {}
        options: dict[str, Any] = {"batch": shape.get("batch") or 1, "dims": shape.get("dims") or None,
                                   "objective": objective}
        if batching.get("max_batch"):
            options.update(max_batch=batching["max_batch"],
                           max_queue_delay=batching.get("max_queue_delay", 0.0))
        return self.cluster.session(source if isinstance(source, Path) else bytes(source), **options)

    def what_if(self, session: Any, budgets: Mapping[str, int]) -> Any:
        """The plan ``session``'s model would have were the members' budgets ``budgets`` (none:
        the plan it runs), rendered as ``vkpool plan`` renders it; allocates nothing."""
        from vkpool.cluster.placement import ClusterPlan, place_on_cluster

        if not budgets:
            return _Rendered(session.plan)
        used = {m["id"]: m["used_bytes"] for m in self.cluster.members()}
        mine = session.memory_by_member()
        free = {k: int(v) - used[k] + int(mine.get(k, 0)) for k, v in budgets.items()}
        _, graph, plan = place_on_cluster(session.model_bytes, self.cluster.planner_members(free),
                                          objective=session.placement.objective, **session.load_options)
        return _Rendered(ClusterPlan(plan, graph))


class _Rendered:
    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def to_text(self) -> str:
        return self.plan.to_text()

    def to_json(self) -> dict[str, Any]:
        return self.plan.to_dict()
