"""vkpool on a Ray cluster: a pool of the nodes' pools.

``vkpool.cluster.connect(address)`` joins a running Ray cluster whose vkpool nodes were started
with the custom resource ``{"vkpool": 1}`` (``docs/cluster.md``), starts or finds the one vkpool
actor of each such node (:mod:`vkpool.cluster.node`) and returns a :class:`Cluster`:
``members()`` lists every node's members (``<node>/vk0``, ``<node>/cpu``, ...) and
``session(model, **options)`` opens a :class:`~vkpool.cluster.session.ClusterSession`, placed by
the planners of :mod:`vkpool.partition` over the cluster's members with their network links
(:mod:`vkpool.cluster.links`). Ray is the extra ``vkpool[cluster]``.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Mapping

from vkpool.cluster.links import Link, cluster_members, load_cluster_spec, measure_link, read_links
from vkpool.cluster.session import ClusterSession, NodeLost

#: the Ray namespace of vkpool's actors, so that every driver finds the same ones
NAMESPACE = "vkpool"
#: the custom resource a node offers to be a vkpool node (one unit: one actor per node)
RESOURCE = "vkpool"
#: how long the first answer of a node's actor may take (it starts Vulkan and builds its pool)
START_TIMEOUT_S = 120.0
#: how often Ray restarts a node's actor that died (then its node is given up)
MAX_RESTARTS = 100
#: Ray's setting of the largest call argument it sends inside the call itself, and its default
INLINE_SETTING, RAY_INLINE_BYTES = "RAY_max_direct_call_object_size", 100 * 1024
#: what a driver that vkpool connects to Ray sends inside its calls (unless ``$RAY_max_direct_call_object_size``
#: says otherwise): Ray's 100 KiB sends a larger argument through the driver's object store,
#: from which another node's actor pulls it, a transfer of several milliseconds per call (5-9 ms
#: between two nodes of one host, bench.cluster's hop), and it costs the driver two to three
#: times the CPU of a call that carries it. Calls to the nodes carry many requests' feeds (a call
#: of 64 ``mnist12_like`` requests is 196 KiB), so they travel inside the call up to this size.
DRIVER_INLINE_BYTES = 1 << 20
#: what this process's Ray inlines, as vkpool set it when it connected (None: it did not)
_connected_inline: int | None = None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("vkpool.cluster runs on Ray, which is not installed: pip install 'vkpool[cluster]' "
                          "(or pip install ray)") from None
    return ray


def connect(address: str | None = None, *, links: Any = None) -> Cluster:
    """The vkpool nodes of the Ray cluster at ``address`` (``host:port`` of its head, or
    ``ray://...``; None: ``$RAY_ADDRESS``, else the cluster running on this machine). A process
    already connected to Ray keeps its connection. ``links``: the nodes' links instead of those
    measured (:meth:`Cluster.set_links`)."""
    cluster = Cluster(address)
    if links is not None:
        cluster.set_links(links)
    return cluster


class Cluster:
    """The vkpool nodes of a Ray cluster, in the order of their names."""

    def __init__(self, address: str | None = None) -> None:
        ray = _ray()
        self._own_connection = not ray.is_initialized()
        #: the largest call argument this process's Ray sends inside the call (it reads its
        #: setting once, as it connects)
        global _connected_inline
        self.inline_bytes = _connected_inline or int(os.environ.get(INLINE_SETTING, RAY_INLINE_BYTES))
        if self._own_connection:
            given = os.environ.get(INLINE_SETTING)
            if given is None:
                os.environ[INLINE_SETTING] = str(DRIVER_INLINE_BYTES)
                self.inline_bytes = DRIVER_INLINE_BYTES
            try:
                ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False,
                         logging_level="ERROR")
            except ConnectionError as exc:
                raise ConnectionError(f"no Ray cluster at {address or 'auto'} ({exc}); start one with "
                                      f"`ray start --head --resources '{{\"{RESOURCE}\": 1}}'` "
                                      "(docs/cluster.md)") from None
            finally:
                if given is None:  # Ray has read it: processes this one starts get Ray's default
                    del os.environ[INLINE_SETTING]
            _connected_inline = self.inline_bytes
        self.actors: dict[str, Any] = {}
        self._names: Any = None
        self._links: dict[str, dict[str, float]] = {}  # node → the link its actor keeps
        from vkpool.cluster.node import Lease

        # nodes close what this driver opened once it is gone (Ray ends the lease with its owner);
        # they look the lease up by its name, holding no reference to it
        self.lease = f"vkpool-lease-{uuid.uuid4().hex}"
        lease = ray.remote(Lease).options(name=self.lease, namespace=NAMESPACE, num_cpus=0)
        self._lease: Any = lease.remote()
        ray.get(self._lease.ping.remote(), timeout=START_TIMEOUT_S)
        self.refresh()

    def refresh(self) -> None:
        """Finds the cluster's vkpool nodes (those offering the ``vkpool`` resource), starting the
        actor of each that has none, and measures the link of each whose actor keeps none."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from vkpool.cluster.node import NodeActor

        remote = ray.remote(NodeActor)
        found = []
        for node in ray.nodes():
            if not node.get("Alive") or node.get("Resources", {}).get(RESOURCE, 0) < 1:
                continue
            gpus = node["Resources"].get("GPU", 0)
            actor = remote.options(
                name=f"vkpool-node-{node['NodeID']}", namespace=NAMESPACE, lifetime="detached",
                get_if_exists=True, resources={RESOURCE: 1}, num_cpus=0, num_gpus=gpus,
                max_restarts=MAX_RESTARTS, max_task_retries=0, max_concurrency=32,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            found.append((node["NodeID"], actor))
        if not found:
            raise RuntimeError(f"the Ray cluster has no vkpool node: start nodes with `ray start --resources "
                               f"'{{\"{RESOURCE}\": 1}}'` (docs/cluster.md)")
        names = ray.get([a.ping.remote() for _, a in found], timeout=START_TIMEOUT_S)
        self.actors = {}
        for (node_id, actor), d in zip(found, names):
            name = d if names.count(d) == 1 else f"{d}-{node_id[:6]}"
            self.actors[name] = actor
        self.actors = dict(sorted(self.actors.items()))
        self.describe()

    def describe(self) -> list[dict[str, Any]]:
        """Each node as its actor describes it (:meth:`~vkpool.cluster.node.NodeActor.describe`),
        under the name the cluster gives it. A node's actor that keeps no link (it is new, or Ray
        restarted it) is given the one this cluster measured for it before, else one measured now."""
        ray = _ray()
        described = ray.get([a.describe.remote() for a in self.actors.values()], timeout=START_TIMEOUT_S)
        out = []
        for (name, actor), d in zip(self.actors.items(), described):
            if d["link"] is None:
                link = self._links.get(name) or measure_link(actor).to_dict()
                ray.get(actor.set_link.remote(link))
                d["link"] = link
            self._links[name] = d["link"]
            out.append({**d, "node": name})
        return out

    def set_links(self, links: Any) -> None:
        """Gives the nodes these links (:func:`vkpool.cluster.links.read_links`: a mapping by node
        name or ``default``, or a cluster spec file) for every later plan, of every driver."""
        from vkpool.cluster.links import read_links

        given = read_links(links)
        unknown = sorted(set(given) - set(self.actors) - {"default"})
        if unknown:
            raise KeyError(f"links name no vkpool node {unknown}; nodes: {', '.join(self.actors)}")
        for name, actor in self.actors.items():
            link = given.get(name, given.get("default"))
            if link is not None:
                _ray().get(actor.set_link.remote(link.to_dict()))
                self._links[name] = link.to_dict()

    @property
    def nodes(self) -> list[str]:
        return list(self.actors)

    def members(self) -> list[dict[str, Any]]:
        """Every node's members: ``id`` (``<node>/<member>``), ``node``, ``kind``, ``name``,
        ``budget_bytes``, ``used_bytes`` (what every vkpool process of that machine holds)."""
        return [{"id": f"{d['node']}/{m['id']}", "node": d["node"], "kind": m["kind"], "name": m["name"],
                 "uuid": m["uuid"], "budget_bytes": m["budget_bytes"], "used_bytes": m["used_bytes"]}
                for d in self.describe() for m in d["members"]]

    def planner_members(self, budgets: Mapping[str, int] | None = None) -> list[Any]:
        """The cluster's members as the planners see them (:func:`vkpool.cluster.links.cluster_members`)."""
        return cluster_members(self.describe(), budgets)

    def links(self) -> dict[str, Link]:
        return {d["node"]: Link.from_dict(d["link"]) for d in self.describe()}

    def set_budget(self, member_id: str, size: int | str) -> None:
        """Sets a member's budget on its node, as :meth:`vkpool.DevicePool.set_budget` does."""
        from vkpool.cluster.links import node_of

        node = node_of(member_id)
        if node not in self.actors:
            raise KeyError(f"no vkpool node {node!r}; nodes: {', '.join(self.actors)}")
        _ray().get(self.actors[node].set_budget.remote(member_id[len(node) + 1:], size))

    @property
    def names(self) -> Any:
        """The cluster's :class:`~vkpool.cluster.node.Names` actor (shared sessions), started by
        the first driver that needs it."""
        if self._names is None:
            from vkpool.cluster.node import Names

            self._names = _ray().remote(Names).options(
                name="vkpool-names", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=-1).remote()
        return self._names

    def session(self, model: Any, **options: Any) -> Any:
        """A :class:`~vkpool.cluster.session.ClusterSession` of ``model`` on this cluster."""
        return ClusterSession(self, model, **options)

    def close(self) -> None:
        """Leaves the cluster: the nodes close what this driver left open (its lease ends); their
        actors, and what other drivers opened, stay."""
        ray = _ray()
        if self._lease is not None:
            ray.kill(self._lease)
            self._lease = None
        if self._own_connection:
            global _connected_inline
            ray.shutdown()
            self._own_connection = False
            _connected_inline = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["connect", "Cluster", "ClusterSession", "NodeLost", "Link", "cluster_members", "load_cluster_spec",
           "measure_link", "read_links"]
