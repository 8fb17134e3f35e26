"""The plan of a model placed whole on one member (the partitioner's Plan covers splits)."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from vkpool.units import format_size


class SingleMemberPlan:
    def __init__(self, model: Any, member_id: str, stats: Any) -> None:
        self.model = model
        self.member_id = member_id
        self.stats = stats

    @property
    def assignment(self) -> dict[str, str]:
        """Node name (or op type and index) → member id."""
        return {(n.name or f"{n.op_type}_{i}"): self.member_id for i, n in enumerate(self.model.nodes)}

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "members": [self.member_id],
            "chunks": [{"member": self.member_id, "ops": len(self.model.nodes)}],
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
            f"chunk 0 on {self.member_id}: {len(self.model.nodes)} ops ({ops})\n"
            f"  {s.dispatches} dispatches in {s.levels} dependency levels, {s.barriers} barriers\n"
            f"  memory on {self.member_id}: weights {format_size(s.weight_bytes)}, "
            f"activations {format_size(s.arena_bytes)} (largest live set {format_size(s.peak_live_bytes)}), "
            f"inputs/outputs {format_size(s.io_bytes)}\n"
            "  transfers: none"
        )

    def __str__(self) -> str:
        return self.to_text()
