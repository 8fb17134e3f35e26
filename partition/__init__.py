"""Partitioning ONNX graphs across pool members under memory budgets.

``plan_model(model, members)`` runs a planner and ``place_model(model, members)`` is where vkpool
runs a model (the placement ``vkpool plan``, sessions and the daemon share); the pieces are importable on their own:
:mod:`.graph` (model → networkx DiGraph with costs), :mod:`.cost` (member speeds, calibration
cache, device spec files), :mod:`.plan` (the Plan, its pricing and validator),
:mod:`.algorithms` (greedy baseline, optimal DP, exhaustive oracle), :mod:`.ilp` (an integer-programming
oracle; needs scipy), :mod:`.render`.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

#: name → submodule; loaded on first use, so that ``vkpool run`` (whose parser registers
#: ``vkpool plan``) does not import networkx
_EXPORTS = {
    "plan_model": "api", "place_model": "api",
    "dp_partition": "algorithms", "exhaustive_partition": "algorithms", "greedy_partition": "algorithms",
    "Member": "cost", "MemberCost": "cost", "load_device_spec": "cost",
    "build_graph": "graph",
    "Chunk": "plan", "PartitionUnfeasible": "plan", "Plan": "plan", "Transfer": "plan", "is_valid_plan": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
