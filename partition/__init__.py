"""Partitioning ONNX graphs across pool members under memory budgets.

``plan_model(model, members)`` is the entry point; the pieces are importable on their own:
:mod:`.graph` (model → networkx DiGraph with costs), :mod:`.cost` (member speeds, calibration
cache, device spec files), :mod:`.plan` (the Plan, its pricing and validator),
:mod:`.algorithms` (greedy baseline, optimal DP, exhaustive oracle), :mod:`.ilp` (an integer-programming
oracle; needs scipy), :mod:`.render`.
"""
from __future__ import annotations

from vkpool.partition.api import plan_model
from vkpool.partition.algorithms import dp_partition, exhaustive_partition, greedy_partition
from vkpool.partition.cost import Member, MemberCost, load_device_spec
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import Chunk, PartitionUnfeasible, Plan, Transfer, is_valid_plan

__all__ = [
    "Chunk", "Member", "MemberCost", "PartitionUnfeasible", "Plan", "Transfer", "build_graph",
    "dp_partition", "exhaustive_partition", "greedy_partition", "is_valid_plan", "load_device_spec",
    "plan_model",
]
