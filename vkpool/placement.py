"""Where a session runs a model: whole on one member, or a partition plan over several.

:func:`planner_members` is the pool as every placement sees it (``vkpool plan``, sessions, the
daemon's what-if); :func:`vkpool.partition.place_model` then decides."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Mapping, Sequence

from vkpool.units import format_size


def engine_suffix(chunk: Any) -> str:
    """`` (onnxruntime 1.32.0)`` for a host chunk: what runs it, and why numpy where it fell back;
    '' for a Vulkan chunk."""
    engine = getattr(chunk, "engine", "vulkan")
    if engine == "vulkan":
        return ""
    note = getattr(chunk, "engine_note", "")
    return f" ({engine}{'; onnxruntime refused it: ' + note if note else ''})"


class SingleMemberPlan:
    def __init__(self, model: Any, member_id: str, stats: Any, engine: str = "vulkan", engine_note: str = "") -> None:
        self.model = model
        self.member_id = member_id
        self.stats = stats
        #: what runs the chunk: ``vulkan``, ``onnxruntime <version>`` or ``numpy`` (the ``cpu`` member)
        self.engine = engine
        self.engine_note = engine_note

    @property
    def assignment(self) -> dict[str, str]:
        """Node name (or op type and index) → member id."""
        return {(n.name or f"{n.op_type}_{i}"): self.member_id for i, n in enumerate(self.model.nodes)}

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "members": [self.member_id],
            "chunks": [{"member": self.member_id, "ops": len(self.model.nodes), "engine": self.engine}],
            "transfers": [],
            "memory": {self.member_id: {"weights": s.weight_bytes, "activations": s.arena_bytes,
                                        "io": s.io_bytes, "peak_live_activations": s.peak_live_bytes}},
            "dispatches": s.dispatches, "barriers": s.barriers,
            "ops": dict(Counter(n.op_type for n in self.model.nodes)),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        s = self.stats
        ops = ", ".join(f"{k}×{v}" for k, v in sorted(Counter(n.op_type for n in self.model.nodes).items()))
        return (
            f"chunk 0 on {self.member_id}{engine_suffix(self)}: {len(self.model.nodes)} ops ({ops})\n"
            f"  {s.dispatches} dispatches in {s.levels} dependency levels, {s.barriers} barriers\n"
            f"  memory on {self.member_id}: weights {format_size(s.weight_bytes)}, "
            f"activations {format_size(s.arena_bytes)} (largest live set {format_size(s.peak_live_bytes)}), "
            f"inputs/outputs {format_size(s.io_bytes)}\n"
            "  transfers: none"
        )

    def __str__(self) -> str:
        return self.to_text()


class PlanView:
    """A partition :class:`~vkpool.partition.plan.Plan` as something runs it: reads like the Plan
    (``member_of``, ``chunks``, ``transfers``, ``replicas``, … are the Plan's) and renders as
    ``vkpool plan`` does (:mod:`vkpool.partition.render`)."""

    def __init__(self, plan: Any, graph: Any) -> None:
        self.partition_plan = plan
        self.graph = graph

    def __getattr__(self, name: str) -> Any:
        if name in ("partition_plan", "graph"):  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.partition_plan, name)

    @property
    def assignment(self) -> dict[str, str]:
        """Node name (or op type and index) → member id."""
        return dict(self.partition_plan.member_of)

    def to_dict(self) -> dict[str, Any]:
        from vkpool.partition.render import to_json_dict

        return to_json_dict(self.partition_plan)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        from vkpool.partition.render import to_text

        return to_text(self.partition_plan)

    def render(self, fmt: str) -> str:
        """``text``, ``json``, ``dot`` or ``svg``, as ``vkpool plan --format`` writes them."""
        from vkpool.partition.render import render

        return render(self.graph, self.partition_plan, fmt)

    def __str__(self) -> str:
        return self.to_text()


class MultiMemberPlan(PlanView):
    """The plan a session runs over several members, followed by what each chunk holds once
    compiled."""

    def __init__(self, plan: Any, graph: Any, executor: Any) -> None:
        super().__init__(plan, graph)
        self._executor = executor

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["compiled"] = [
            {"copy": copy.index, "chunk": stage.index, "member": stage.member.id, "ops": len(stage.nodes),
             "weights": stage.chunk.stats.weight_bytes, "activations": stage.chunk.stats.arena_bytes,
             "io": stage.chunk.stats.io_bytes, "dispatches": stage.chunk.stats.dispatches,
             "engine": getattr(stage.chunk, "engine", "vulkan")}
            for copy in self._executor.copies for stage in copy.stages
        ]
        return out

    def to_text(self) -> str:
        lines = [super().to_text().rstrip("\n"), "", f"Compiled, run by {self._executor.runs_in}:"]
        for copy in self._executor.copies:
            for stage in copy.stages:
                s = stage.chunk.stats
                where = f"chunk {stage.index}" if copy.index == 0 else f"replica {copy.index}"
                lines.append(f"  {where} on {stage.member.id}{engine_suffix(stage.chunk)}: {len(stage.nodes)} ops, "
                             f"{s.dispatches} dispatches; weights {format_size(s.weight_bytes)}, "
                             f"activations {format_size(s.arena_bytes)}, inputs/outputs {format_size(s.io_bytes)}")
        return "\n".join(lines) + "\n"


def planner_members(pool: Any, ids: Sequence[str] | None = None,
                    budgets: Mapping[str, int] | None = None) -> list[Any]:
    """The partitioner's view of ``pool``'s members (``ids``, else all, in the pool's order):
    what each has free of its budget, counting every vkpool process on the machine
    (:mod:`vkpool.ledger`), and its speeds (:func:`vkpool.partition.cost.pool_member_cost`,
    ``measured`` when calibrated or set in the config).
    ``budgets``: member id → bytes free instead, for a what-if."""
    from vkpool.partition.cost import Member as PlanMember, has_measured_cost, pool_member_cost

    out = []
    for member_id in ids if ids is not None else [m.id for m in pool.members]:
        member = pool.member(member_id)
        free = member.budget.free_bytes if budgets is None or member.id not in budgets else budgets[member.id]
        out.append(PlanMember(member.id, max(0, int(free)), pool_member_cost(member), member.kind,
                              getattr(getattr(member, "info", None), "name", ""), has_measured_cost(member)))
    return out


def balanced_cut(graph: Any, k: int) -> list[list[str]]:
    """The cut of ``graph``'s op order into ``k`` contiguous segments whose largest chunk (peak
    bytes as :func:`vkpool.partition.plan.chunk_peak_bytes` prices it) is smallest.

    Budgets set to these chunks' sizes force a k-member plan where the model allows one.
    Dynamic programming over (segments, end): O(n² · k) peak evaluations for n ops.
    """
    from vkpool.partition.plan import chunk_peak_bytes

    order = list(graph.graph["order"])
    n = len(order)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} ops into {k} non-empty segments")
    peak = {(i, j): chunk_peak_bytes(graph, order[i:j]) for i in range(n) for j in range(i + 1, n + 1)}
    best: dict[tuple[int, int], tuple[int, list[int]]] = {(0, 0): (0, [])}
    for parts in range(1, k + 1):
        for end in range(parts, n + 1):
            options = [(max(best[(parts - 1, start)][0], peak[(start, end)]), best[(parts - 1, start)][1] + [end])
                       for start in range(parts - 1, end) if (parts - 1, start) in best]
            best[(parts, end)] = min(options)
    bounds = [0] + best[(k, n)][1]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]
