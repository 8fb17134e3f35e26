"""The cluster as the planners see it: members ``<node>/<member>`` whose links include the network.

A tensor crossing nodes goes through Ray's object store: the producer's node writes it, the
consumer's node pulls it over the network. Each node has a link (``bytes_per_s``,
``latency_s``: measured by :func:`measure_link`, or given in a spec file), and every member of
the node pays half of it on each upload and download besides its own host link::

    1 / h2d' = 1 / h2d + 1 / (2 · bytes_per_s)        network_latency' = network_latency + latency_s / 2

so a tensor moving from a member of node A to one of node B pays, as every planner prices a
move (the producer's download plus the consumer's upload), both members' host links plus
``(latency_A + latency_B) / 2 + b / (2 · bw_A) + b / (2 · bw_B)``: one trip over the network.
The network's latency counts in a plan's latency, not in its throughput (requests in flight
overlap it). The planners of :mod:`vkpool.partition` then run unchanged. Two members of one node are priced
as if the network lay between them too (an upper bound: they hand tensors over in host memory).

A cluster spec file is a device spec file (``partition/specs``) whose member ids are
``<node>/<member>``, with a ``links`` mapping: node name (or ``default``) → the two figures.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from vkpool.partition.cost import Member, MemberCost

#: bytes of the blob :func:`measure_link` sends to each node (several times)
CALIBRATION_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class Link:
    """A node's path to the others through the object store."""

    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or not self.latency_s >= 0:
            raise ValueError(f"a link needs bytes_per_s > 0 and latency_s >= 0, got {self}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "link") -> Link:
        unknown = set(data) - {"bytes_per_s", "latency_s"}
        if unknown or len(data) != 2:
            raise ValueError(f"{where}: a link has exactly bytes_per_s and latency_s, got {sorted(data)}")
        return cls(float(data["bytes_per_s"]), float(data["latency_s"]))

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def with_link(member: Member, link: Link) -> Member:
    """``member`` with half of its node's link added to each of its uploads and downloads."""
    c = member.cost
    half = 2 * link.bytes_per_s
    cost = dataclasses.replace(c, h2d_bytes_per_s=1 / (1 / c.h2d_bytes_per_s + 1 / half),
                               d2h_bytes_per_s=1 / (1 / c.d2h_bytes_per_s + 1 / half),
                               network_latency_s=c.network_latency_s + link.latency_s / 2)
    return dataclasses.replace(member, cost=cost)


def node_of(member_id: str) -> str:
    """The node of a cluster member id ``<node>/<member>``."""
    node, sep, _ = member_id.rpartition("/")
    if not sep or not node:
        raise ValueError(f"a cluster member id is <node>/<member>, got {member_id!r}")
    return node


def cluster_members(nodes: Sequence[Mapping[str, Any]],
                    budgets: Mapping[str, int] | None = None) -> list[Member]:
    """Planner members of described nodes (:meth:`vkpool.cluster.node.NodeActor.describe`, each
    with its ``link``), in the nodes' order: Vulkan members of every node first, then host ones
    (the order a local pool has); each budget what the member has free, or ``budgets[id]``."""
    out = []
    for node in nodes:
        link = Link.from_dict(node["link"], f"node {node['node']}")
        for m in node["members"]:
            member_id = f"{node['node']}/{m['id']}"
            free = (budgets or {}).get(member_id, m["free_bytes"])
            cost = MemberCost.from_dict(m["cost"])
            member = Member(member_id, max(0, int(free)), cost, m["kind"], m["name"])
            out.append(with_link(member, link))
    return [m for m in out if m.kind == "vulkan"] + [m for m in out if m.kind != "vulkan"]


def read_links(source: str | Path | Mapping[str, Any]) -> dict[str, Link]:
    """Links by node name (or ``default``): a mapping of :class:`Link` or of their two figures,
    or a YAML file (a cluster spec file) with such a ``links`` mapping."""
    where = "links"
    if isinstance(source, (str, Path)):
        import yaml

        where = f"{source}: links"
        data = yaml.safe_load(Path(source).read_text())
        source = data.get("links") if isinstance(data, dict) else None
    if not isinstance(source, Mapping) or not source:
        raise ValueError(f"{where}: expected a mapping of node name (or default) → "
                         "{bytes_per_s, latency_s}")
    return {str(k): v if isinstance(v, Link) else Link.from_dict(v or {}, f"{where}.{k}")
            for k, v in source.items()}


def load_cluster_spec(path: str | Path) -> list[Member]:
    """The members of a cluster spec file (see the module doc), links folded in."""
    from vkpool.partition.cost import load_device_spec

    members = load_device_spec(path)
    parsed = read_links(path)
    out = []
    for m in members:
        try:
            node = node_of(m.id)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        link = parsed.get(node, parsed.get("default"))
        if link is None:
            raise ValueError(f"{path}: node {node} has no link; give links.{node} or links.default")
        out.append(with_link(m, link))
    return [m for m in out if m.kind == "vulkan"] + [m for m in out if m.kind != "vulkan"]


def measure_link(actor: Any, *, repeat: int = 3) -> Link:
    """A node's link as a round trip through the object store shows it: the latency of a call
    carrying a few bytes, and the bandwidth of pulling :data:`CALIBRATION_BYTES` put by this
    process (the best of ``repeat``; the first pull warms the path up and is not counted)."""
    import numpy as np
    import ray

    def best(call: Any) -> float:
        ray.get(call())
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            ray.get(call())
            times.append(time.perf_counter() - t)
        return min(times)

    small = ray.put(np.zeros(8, np.uint8))
    latency = best(lambda: actor.pull.remote(small))
    # a fresh object each time (a node keeps what it pulled): the hop is a put and a pull
    big = best(lambda: actor.pull.remote(ray.put(np.ones(CALIBRATION_BYTES, np.uint8))))
    return Link(CALIBRATION_BYTES / max(big - latency, 1e-9), latency)
