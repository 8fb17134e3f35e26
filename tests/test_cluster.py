"""vkpool on a real local Ray cluster (vkpool.cluster): two Ray nodes on this machine, each with its
own vkpool actor, its own split of the Vulkan device and its own object store, shared by every test
of this file (starting one costs seconds). The tests that kill a node's actor come last."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is the extra vkpool[cluster] (make test installs it)")

from conftest import vulkan_pool  # noqa: E402

from bench import workloads  # noqa: E402
from vkpool.cli import main  # noqa: E402

NODES = ("n0", "n1")
#: a budget under which neither node holds mnist12_like alone (61.6 KiB) and both together do
SPLIT_BUDGET = "56KiB"
NODE_CONFIG = """\
devices:
  - match: {index: 0}
    split: 3
    budget: [64MiB, 64MiB, 64MiB]
host:
  enabled: false
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(Ray cluster, vkpool Cluster): node ``n<i>`` offers split ``vk0.<i>`` of the device."""
    from ray.cluster_utils import Cluster

    import vkpool.cluster

    vulkan_pool().close()
    folder = tmp_path_factory.mktemp("cluster")
    config = folder / "node.yaml"
    config.write_text(NODE_CONFIG)

    def node(i: int) -> dict[str, Any]:
        return dict(num_cpus=1, resources={"vkpool": 1}, object_store_memory=200 << 20,
                    env_vars={"VKPOOL_NODE_NAME": NODES[i], "VKPOOL_NODE_MEMBERS": f"vk0.{i}",
                              "VKPOOL_CONFIG": str(config)})

    ray_cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node(0)))
    try:
        ray_cluster.add_node(**node(1))
        ray_cluster.wait_for_nodes()
        with vkpool.cluster.connect(ray_cluster.address) as joined:
            yield ray_cluster, joined
    finally:
        ray_cluster.shutdown()


@pytest.fixture(scope="module")
def mnist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], list[np.ndarray]]:
    """mnist12_like, its feeds and the outputs of one member of this machine's pool."""
    from vkpool.session import Session

    path = workloads.save("mnist12_like", tmp_path_factory.mktemp("models"))
    feeds = workloads.input_for("mnist12_like")
    with Session(path, device="vk0") as local:
        return path, feeds, local.run(None, feeds)


@pytest.fixture(autouse=True)
def node_budgets(cluster: Any) -> Iterator[None]:
    """Every test starts and ends with the nodes' budgets of their config."""
    yield
    for node in NODES:
        cluster[1].set_budget(f"{node}/vk0.{NODES.index(node)}", "64MiB")


def address(cluster: Any) -> str:
    return cluster[0].address


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def split_budgets() -> dict[str, str]:
    return {"n0/vk0.0": SPLIT_BUDGET, "n1/vk0.1": SPLIT_BUDGET}


def test_the_cluster_pool_lists_every_nodes_members(cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    members = cluster[1].members()
    assert [m["id"] for m in members] == ["n0/vk0.0", "n1/vk0.1"]
    assert all(m["budget_bytes"] == 64 << 20 and m["kind"] == "vulkan" for m in members)
    assert main(["devices", "--cluster", address(cluster), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["id"] for m in listed["members"]] == ["n0/vk0.0", "n1/vk0.1"]
    assert all(n["link"]["bytes_per_s"] > 0 for n in listed["nodes"])
    assert main(["devices", "--cluster", address(cluster)]) == 0
    text = capsys.readouterr().out
    assert "n0/vk0.0" in text and "n1/vk0.1" in text and "64 MiB" in text


def test_the_gpus_ray_gives_a_node_are_its_vulkan_devices_of_those_uuids() -> None:
    from vkpool.cluster.node import node_pool, ray_gpu_uuids

    pool = vulkan_pool()
    uuid = pool.vulkan_members[0].info.uuid
    pool.close()
    assert ray_gpu_uuids([f"GPU-{uuid.upper()}"]) == [uuid.lower()]
    given = node_pool([uuid])
    try:
        assert [m.info.uuid for m in given.vulkan_members] == [uuid]
    finally:
        given.close()
    with pytest.raises(RuntimeError, match="that no Vulkan device has"):
        node_pool(["00000000-0000-0000-0000-00000000beef"])


def test_a_model_split_across_two_nodes_gives_one_members_outputs(cluster: Any, mnist: Any) -> None:
    from vkpool.cluster.session import HANDOVER_BYTES, MAX_BUNDLE, SPLIT_MAX_BUNDLE

    path, feeds, want = mnist
    with cluster[1].session(path, budgets=split_budgets()) as session:
        members = [c.member for c in session.plan.chunks]
        assert members == ["n0/vk0.0", "n1/vk0.1"] or members == ["n1/vk0.1", "n0/vk0.0"]
        assert [t.src != t.dst for t in session.plan.transfers] == [True]
        assert_same(session.run(None, feeds), want)
        futures = [session.submit(feeds) for _ in range(8)]
        for future in futures:
            assert_same(future.result(timeout=60), want)
        assert set(session.memory_by_member()) == set(members)
        assert [i.name for i in session.get_inputs()] == ["x"]
        shown_plan = session.plan
        # its calls are sized for the hand-over between the nodes (a few KiB a request here)
        handed = sum(t.nbytes for t in shown_plan.transfers)
        assert session._max_bundle == min(SPLIT_MAX_BUNDLE, -(-HANDOVER_BYTES // handed)) > MAX_BUNDLE
    with cluster[1].session(path, plan=shown_plan, max_bundle=8) as again:  # the plan given is the plan run
        assert again.placement.member_of == shown_plan.member_of and again._max_bundle == 8
        assert_same(again.run(None, feeds), want)


class _Recorded:
    """A node's actor handle whose ``run_chunks`` calls are noted (arguments and result)."""

    def __init__(self, actor: Any, calls: list[tuple[tuple[Any, ...], Any]]) -> None:
        self._actor, self._calls = actor, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._actor, name)
        if name != "run_chunks":
            return attr
        calls = self._calls

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                ref = attr.remote(*args)
                calls.append((args, ref))
                return ref
        return _Method


def test_a_split_hands_its_tensor_from_node_to_node_not_through_the_caller(cluster: Any, mnist: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    path, feeds, want = mnist
    calls: list[tuple[tuple[Any, ...], Any]] = []
    gathered: list[Any] = []
    with cluster[1].session(path, budgets=split_budgets()) as session:
        monkeypatch.setattr(cluster[1], "actors", {n: _Recorded(a, calls) for n, a in cluster[1].actors.items()})
        gather = session._gather
        monkeypatch.setattr(session, "_gather", lambda copy, call, refs: (gathered.extend(refs),
                                                                         gather(copy, call, refs))[1])
        assert_same(session.run(None, feeds), want)
    assert len(calls) == 2, calls  # one call per stage, on its own node
    (first_args, first_ref), (second_args, second_ref) = calls
    # the second stage is given the first stage's reference, which Ray resolves on the second
    # node from the first node's store; the caller waits only on what makes the outputs
    assert any(isinstance(a, ray.ObjectRef) and a == first_ref for a in second_args)
    assert gathered == [second_ref]


def test_replicas_over_two_nodes_share_the_requests(cluster: Any, mnist: Any) -> None:
    import vkpool.cluster
    from vkpool.cluster import DRIVER_INLINE_BYTES, INLINE_SETTING
    from vkpool.cluster.session import INLINE_SLACK, MAX_BUNDLE

    path, feeds, want = mnist
    # the driver vkpool connected sends calls of up to 1 MiB inside Ray's call, and leaves the
    # setting out of the environment of the processes it starts
    assert cluster[1].inline_bytes == DRIVER_INLINE_BYTES and INLINE_SETTING not in os.environ
    with vkpool.cluster.connect(address(cluster)) as again:  # another in the same process: Ray as it was set
        assert again.inline_bytes == DRIVER_INLINE_BYTES
    with cluster[1].session(path, objective="throughput", calls_per_step=2) as session:
        row = feeds["x"].nbytes
        assert session._max_bundle == min(MAX_BUNDLE, (DRIVER_INLINE_BYTES - INLINE_SLACK) // row)
    cluster[1].inline_bytes = 40 * row + INLINE_SLACK  # as a driver with Ray's setting at 40 rows
    try:
        with cluster[1].session(path, objective="throughput") as small, \
                cluster[1].session(path, objective="throughput", max_bundle=64) as given:
            assert small._max_bundle == 40 and given._max_bundle == 64  # a max_bundle given is kept
    finally:
        cluster[1].inline_bytes = DRIVER_INLINE_BYTES
    with cluster[1].session(path, objective="throughput") as session:
        assert session.plan.replicas and len(session.copies) == 2
        assert {n for copy in session.copies for n in copy["nodes"]} == set(NODES)
        futures = [session.submit(feeds) for _ in range(32)]
        for future in futures:
            assert_same(future.result(timeout=60), want)
        assert all(copy["served"] > 0 for copy in session.copies), session.copies


def test_run_many_sends_groups_to_every_replica_and_answers_in_order(cluster: Any, mnist: Any) -> None:
    """run_many reads its feeds lazily, keeps at most ``window`` in flight in groups over both
    replicas, and gives each request its own outputs, a refused one its error, in order."""
    from vkpool.errors import InvalidInput

    path, feeds, _ = mnist
    inputs = [{"x": (feeds["x"] * (1 + k / 4)).astype(np.float32)} for k in range(5)]
    with cluster[1].session(path, objective="throughput", max_bundle=4) as session:
        wants = [session.run(None, f) for f in inputs]
        served = [copy["served"] for copy in session.copies]
        ended, most = [], [0]

        def source() -> Iterator[dict[str, np.ndarray]]:
            for i in range(60):
                most[0] = max(most[0], sum(copy["in_flight"] for copy in session.copies))
                yield {"x": np.zeros((1, 3), np.float32)} if i == 17 else inputs[i % 5]

        results = session.run_many(source(), each=lambda index, _: ended.append(index), window=6)
        assert ended == list(range(60)) and len(results) == 60
        assert 0 < most[0] <= 6, most
        assert isinstance(results[17], InvalidInput)
        for i, result in enumerate(results):
            if i != 17:
                assert_same(result, wants[i % 5])
        assert all(copy["served"] > s for copy, s in zip(session.copies, served)), session.copies
        assert all(copy["in_flight"] == 0 for copy in session.copies)
        with pytest.raises(InvalidInput, match="unknown output"):
            session.run_many(inputs, output_names=["nope"])
        assert session.run_many([]) == []


def test_requests_that_share_a_call_fail_alone(cluster: Any, mnist: Any) -> None:
    """Requests waiting for a copy travel in one call, packed (vkpool.cluster.rows); one that
    failed fails only itself, on a replica and through the steps of a split."""
    import ray

    from vkpool.cluster.rows import Rows

    path, feeds, want = mnist
    earlier = ValueError("failed on an earlier step")
    packed = Rows.pack([feeds, feeds, feeds], ["x"])
    with cluster[1].session(path, objective="throughput") as session:
        copy = session._copies[0]
        actor = cluster[1].actors[copy.nodes[0]]
        out = ray.get(actor.run.remote(copy.key, Rows(3, packed.tensors, {1: earlier})), timeout=60)
        assert set(out.failed) == {1} and str(out.failed[1]) == str(earlier)
        for row in (0, 2):
            assert_same([out.tensors[name][row] for name in [o.name for o in session.get_outputs()]], want)
        futures = [session.submit(feeds) for _ in range(200)]
        for future in futures:
            assert_same(future.result(timeout=60), want)
        assert all(copy["served"] > 0 for copy in session.copies), session.copies
    with cluster[1].session(path, budgets=split_budgets()) as split:
        copy = split._copies[0]
        first = copy.steps[0]
        actor = cluster[1].actors[first.node]
        out = ray.get(actor.run_chunks.remote(copy.key, first.chunks, Rows(3, packed.tensors, {0: earlier})),
                      timeout=60)
        assert set(out.failed) == {0} and not np.any([t[0] for t in out.tensors.values()])
        assert np.all([np.any(t[1]) and np.array_equal(t[1], t[2]) for t in out.tensors.values()])
        futures = [split.submit(feeds) for _ in range(100)]
        for future in futures:
            assert_same(future.result(timeout=60), want)


def test_a_request_is_refused_alone_and_its_feeds_are_copied(cluster: Any, mnist: Any) -> None:
    from vkpool.errors import InvalidInput

    path, feeds, want = mnist
    with cluster[1].session(path, objective="throughput", max_bundle=4, calls_per_step=1) as session:
        mine = {"x": feeds["x"].copy()}
        futures = [session.submit(mine) for _ in range(12)]
        mine["x"][:] = 0  # the caller reuses its array: the requests already submitted keep their feeds
        with pytest.raises(InvalidInput, match="shape"):
            session.submit({"x": np.zeros((1, 3), np.float32)})
        with pytest.raises(InvalidInput, match="missing"):
            session.submit({})
        for future in futures:
            assert_same(future.result(timeout=60), want)
        futures[0].result()[0][...] = 0  # each request's outputs are its own to write
        assert_same(futures[1].result(), want)
        # run_many, as vkpool.Session's: each request's outputs, a refused one its own error
        ended: list[int] = []
        results = session.run_many([feeds, {"x": np.zeros((1, 3), np.float32)}, feeds],
                                   each=lambda index, _: ended.append(index))
        assert isinstance(results[1], InvalidInput) and ended == [0, 1, 2]
        assert_same(results[0], want)
        assert_same(results[2], want)
    with pytest.raises(ValueError, match="at least 1"):
        cluster[1].session(path, max_bundle=0)


def test_a_replicas_stream_runs_the_requests_of_calls_from_several_threads(mnist: Any) -> None:
    """A node runs the requests of every call to a replica as one stream (one Session.run_many
    over two run slots): calls from several threads at once each get their own outputs in their
    order, a request that cannot be fed fails alone, and a stream that ended refuses calls."""
    from vkpool.cluster.node import _Stream
    from vkpool.errors import InvalidInput
    from vkpool.session import Session

    path, feeds, _ = mnist
    inputs = [{"x": (feeds["x"] * (1 + k / 4)).astype(np.float32)} for k in range(5)]
    bad = {"x": np.zeros((1, 3), np.float32)}
    with Session(path, device="vk0", run_slots=2) as session:
        names = [o.name for o in session.get_outputs()]
        wants = [session.run(None, f) for f in inputs]
        stream = _Stream(lambda source, each: session.run_many(source, None, each),
                         lambda out: dict(zip(names, out)))

        def call(k: int) -> tuple[list[int], list[Any]]:
            picks = [(k + i) % 5 for i in range(k % 4 + 1)]
            fed = [inputs[p] for p in picks]
            if k % 7 == 3:
                picks.insert(1, -1)
                fed.insert(1, bad)
            return picks, stream.run(fed)

        with ThreadPoolExecutor(6) as pool:
            calls = list(pool.map(call, range(30)))
        for picks, results in calls:
            assert len(results) == len(picks)
            for p, result in zip(picks, results):
                if p < 0:
                    assert isinstance(result, InvalidInput), result
                else:
                    assert_same([result[n] for n in names], wants[p])
        stream.close()
        with pytest.raises(RuntimeError, match="closed"):
            stream.run([inputs[0]])


def test_rows_pack_requests_and_a_failure_stays_with_its_request() -> None:
    from vkpool.cluster.node import _Stream
    from vkpool.cluster.rows import Rows, gather, merge, pending
    from vkpool.pipeline import back_to_back

    feeds = [{"x": np.full((1, 2), i, np.float32)} for i in range(5)]
    rows = Rows.pack(feeds, ["x"])
    assert rows.tensors["x"].shape == (5, 1, 2) and np.array_equal(rows.row(3)["x"], feeds[3]["x"])
    in_flight: list[int] = []
    most = [0]

    def start(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if f["x"][0, 0] == 2:
            raise ValueError("row 2 refused")
        in_flight.append(1)
        most[0] = max(most[0], len(in_flight))
        return f

    def finish(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        in_flight.pop()
        if f["x"][0, 0] == 4:
            raise RuntimeError("row 4 failed")
        return {"y": f["x"] * 2}

    earlier = KeyError("failed before")
    given = Rows(5, rows.tensors, {1: earlier})  # as a chunk's stream runs a call's rows
    stream = _Stream(lambda source, each: back_to_back(start, finish, source, 2, each))
    out = gather(given, stream.run(pending(given)))
    stream.close()
    assert most[0] == 2 and not in_flight  # two runs in flight at most, every one finished
    assert out.failed[1] is earlier and "row 2" in str(out.failed[2]) and "row 4" in str(out.failed[4])
    assert out.tensors["y"][:, 0, 0].tolist() == [0, 0, 0, 6, 0]
    both = merge([out, Rows(5, {"z": rows.tensors["x"]}, {3: ValueError("later")})])
    assert set(both.tensors) == {"y", "z"} and set(both.failed) == {1, 2, 3, 4}
    frozen = Rows(5, {"y": np.zeros((5, 2))})
    frozen.tensors["y"].flags.writeable = False
    assert frozen.writable().tensors["y"].flags.writeable


def test_a_copy_keeps_as_many_calls_in_flight_as_its_requests_fill(cluster: Any, mnist: Any) -> None:
    from vkpool.cluster.session import _Copy

    with cluster[1].session(mnist[0], devices=["n0/vk0.0"], max_bundle=64, calls_per_step=4) as session:
        def room(in_flight: int, calls: int = 0, max_calls: int = 4) -> tuple[int, int]:
            copy = _Copy(0, "k", ["n0"], "n0/vk0.0", in_flight=in_flight, max_calls=max_calls)
            copy.calls = {i: [] for i in range(calls)}
            return session._room(copy)

        assert room(256) == (4, 64)  # full calls, as many as the ceiling allows
        assert room(128) == (2, 64)
        assert room(128, calls=2) == (0, 64)
        assert room(8) == (2, 4)  # a light load: still a second call behind the first
        assert room(1000) == (4, 64)
        assert room(1000, max_calls=8) == (8, 64)  # a split over two nodes: 4 per step
        assert room(8, max_calls=1) == (1, 8)  # calls_per_step=1


def test_budgets_that_hold_nothing_are_refused_as_on_one_machine(cluster: Any, mnist: Any) -> None:
    from vkpool.partition.plan import PartitionUnfeasible

    with pytest.raises(PartitionUnfeasible, match="n0/vk0.0 .* n1/vk0.1"):
        cluster[1].session(mnist[0], budgets={"n0/vk0.0": "20KiB", "n1/vk0.1": "20KiB"})


def shown(*argv: str, tmp: Path) -> dict[str, Any]:
    out = tmp / "plan.json"
    assert main(["plan", *argv, "--format", "json", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def placement(plan: dict[str, Any]) -> tuple[dict[str, str], list[str], list[str]]:
    return ({op["name"]: op["member"] for op in plan["ops"]}, [c["member"] for c in plan["chunks"]],
            plan.get("replicas", []))


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_vkpool_plan_cluster_is_what_a_cluster_session_runs(cluster: Any, mnist: Any, tmp_path: Path,
                                                            objective: str) -> None:
    from vkpool.partition.render import to_json_dict

    path = mnist[0]
    budgets = [f"--budget={k}={v}" for k, v in split_budgets().items()] if objective == "latency" else []
    plan = shown(str(path), "--cluster", address(cluster), "--objective", objective, *budgets, tmp=tmp_path)
    with cluster[1].session(path, objective=objective,
                            budgets=split_budgets() if objective == "latency" else None) as session:
        assert placement(to_json_dict(session.placement)) == placement(plan)
        runs_on = {m for m, n in session.memory_by_member().items() if n}
        assert runs_on == set(placement(plan)[1]) | set(placement(plan)[2])
    assert len(runs_on) == 2
    svg = tmp_path / "plan.svg"
    assert main(["plan", str(path), "--cluster", address(cluster), "--format", "svg", "-o", str(svg)]) == 0
    assert "<svg" in svg.read_text() and "n0/vk0.0" in svg.read_text()


def test_a_cluster_spec_file_plans_without_a_cluster(mnist: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "cluster.yaml"
    spec.write_text("""\
version: 1
name: two nodes of one H200 each
members:
  - {id: a/gpu0, kind: vulkan, budget: 56KiB, flops_per_s: 5.0e13, bytes_per_s: 4.3e12}
  - {id: b/gpu0, kind: vulkan, budget: 56KiB, flops_per_s: 5.0e13, bytes_per_s: 4.3e12}
links:
  default: {bytes_per_s: 1.25e9, latency_s: 5.0e-5}
""")
    plan = shown(str(mnist[0]), "--cluster", str(spec), tmp=tmp_path)
    assert placement(plan)[1] == ["a/gpu0", "b/gpu0"]
    slow = shown(str(mnist[0]), "--cluster", str(spec), "--budget", "a/gpu0=1MiB", tmp=tmp_path)
    assert placement(slow)[1] == ["a/gpu0"]  # one member holds it: no hop over the network
    # the network's cost is in the plan: the hop costs at least one trip over the link
    assert plan["latency_s"] > slow["latency_s"] + 5e-5
    assert main(["plan", str(mnist[0]), "--cluster", str(spec), "--budget", "a/gpu0=20KiB",
                 "--budget", "b/gpu0=20KiB"]) == 1
    assert "no member's budget holds the whole model" in capsys.readouterr().err
    # what the cluster decides, or cannot do, is refused with the reason
    assert main(["plan", str(mnist[0]), "--cluster", str(spec), "--remote"]) == 1
    assert "drop --devices and --remote" in capsys.readouterr().err
    assert main(["serve", "--cluster", "127.0.0.1:1", "--detach"]) == 2
    assert "--detach cannot be honoured here" in capsys.readouterr().err


def test_serve_cluster_offers_the_cluster_to_a_daemon_client(cluster: Any, mnist: Any) -> None:
    from test_daemon_support import daemon_env, short_folder, wait_ready
    from vkpool.daemon.client import Client

    path, feeds, want = mnist
    with short_folder() as folder:
        endpoint = f"ipc://{folder}/d.sock"
        proc = subprocess.Popen([sys.executable, "-m", "vkpool", "serve", "--cluster", address(cluster),
                                 "--endpoint", endpoint], env=daemon_env(), stderr=subprocess.PIPE)
        try:
            wait_ready(endpoint, proc, timeout=120)
            with Client(endpoint) as client:
                ids = {"n0/vk0.0", "n1/vk0.1"}
                assert {m["id"] for m in client.devices()} == ids
                remote = client.session(str(path))
                assert_same(remote.run(None, feeds), want)
                assert set(remote.info["members"]) <= {"n0/vk0.0", "n1/vk0.1"}
                status = client.status()
                assert {m["id"] for m in status["members"]} == {"n0/vk0.0", "n1/vk0.1"}
                assert [m["id"] for m in status["models"]] == [remote.model_id]
                # the daemon's plan is the cluster's, and a what-if over the cluster's budgets
                served_plan = client.plan(remote.model_id)["plan"]
                assert placement(served_plan)[1] and set(placement(served_plan)[1]) <= ids
                what_if = client.plan(remote.model_id, {"n0/vk0.0": 56 << 10, "n1/vk0.1": 56 << 10})["plan"]
                assert sorted(placement(what_if)[1]) == ["n0/vk0.0", "n1/vk0.1"]
                assert client.set_budget("n1/vk0.1", "32MiB")["budget_bytes"] == 32 << 20
                assert {m["id"]: m["budget_bytes"] for m in client.devices()}["n1/vk0.1"] == 32 << 20
                remote.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_replicas_batch_the_requests_of_each_node(cluster: Any, mnist: Any, tmp_path: Path) -> None:
    import onnx

    path, feeds, want = mnist
    batched = tmp_path / "mnist-batch.onnx"
    onnx.save_model(workloads.symbolic_batch(onnx.load(path)), batched)
    with cluster[1].session(batched, objective="throughput", max_batch=4, max_queue_delay=0.01) as session:
        assert len(session.copies) == 2
        futures = [session.submit(feeds) for _ in range(16)]
        for future in futures:
            assert_same(future.result(timeout=60), want)
        figures = session.batching
        assert [f["max_batch"] for f in figures] == [4, 4]
        assert sum(f["requests"] for f in figures) == 16
    with pytest.raises(ValueError, match="max_batch batches requests on one member"):
        cluster[1].session(batched, budgets=split_budgets(), max_batch=4)


def test_links_given_instead_of_measured_price_the_plan(cluster: Any, mnist: Any, tmp_path: Path) -> None:
    measured = {name: link.to_dict() for name, link in cluster[1].links().items()}
    budgets = [f"--budget={k}={v}" for k, v in split_budgets().items()]
    args = [str(mnist[0]), "--cluster", address(cluster), *budgets]
    try:
        cluster[1].set_links({"default": {"bytes_per_s": 1e6, "latency_s": 0.5}})
        slow = shown(*args, tmp=tmp_path)
        assert slow["latency_s"] > 1.0  # a trip over each link: the feeds in, the hop, the outputs out
        with pytest.raises(KeyError, match="no vkpool node"):
            cluster[1].set_links({"n7": {"bytes_per_s": 1e6, "latency_s": 0.5}})
    finally:
        cluster[1].set_links(measured)
    assert shown(*args, tmp=tmp_path)["latency_s"] < slow["latency_s"]


def test_what_a_driver_that_died_opened_is_closed_on_the_nodes(cluster: Any, mnist: Any) -> None:
    from test_daemon_support import daemon_env

    def held() -> list[str]:
        return [key for d in cluster[1].describe() for key in d["models"]]

    assert held() == []
    code = ("import sys, time, vkpool.cluster; c = vkpool.cluster.connect(sys.argv[1]); "
            "s = c.session(sys.argv[2], devices=['n1/vk0.1']); print('open', flush=True); time.sleep(120)")
    driver = subprocess.Popen([sys.executable, "-c", code, address(cluster), str(mnist[0])], env=daemon_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "open"
        assert len(held()) == 1
        assert next(m for m in cluster[1].members() if m["id"] == "n1/vk0.1")["used_bytes"] > 0
    finally:
        driver.kill()
        driver.wait()
    wait_until(lambda: held() == [])  # each look at the nodes closes what a gone driver left
    assert next(m for m in cluster[1].members() if m["id"] == "n1/vk0.1")["used_bytes"] == 0


def test_sessions_of_one_name_share_the_copies_across_drivers(cluster: Any, mnist: Any) -> None:
    """Sessions opened under one name, here and in another driver process, run on the same
    copies: the second takes the first's plan and holds the copies too; they close once no
    driver holds them, a driver that died included. Another model under the name is refused."""
    from test_daemon_support import daemon_env

    path, feeds, want = mnist

    def held() -> list[str]:
        return [key for d in cluster[1].describe() for key in d["models"]]

    assert held() == []
    first = cluster[1].session(path, objective="throughput", name="digits")
    try:
        assert len(held()) == 2  # a replica on each node
        import vkpool.cluster.placement as placement

        placed: list[int] = []
        real = placement.place_on_cluster

        def counted(*args: Any, **kwargs: Any) -> Any:
            placed.append(1)
            return real(*args, **kwargs)

        placement.place_on_cluster = counted
        try:
            second = cluster[1].session(path, objective="throughput", name="digits")
        finally:
            placement.place_on_cluster = real
        with second:
            assert len(placed) == 1  # the plan taken from the name is placed once
            assert second._key == first._key and second.placement.member_of == first.placement.member_of
            assert_same(second.run(None, feeds), want)
        assert len(held()) == 2 and first.run(None, feeds)  # the first still holds them
        with pytest.raises(ValueError, match="runs another model, or the same with other options"):
            cluster[1].session(path, objective="latency", name="digits")
        code = ("import sys, time, numpy as np, vkpool.cluster; c = vkpool.cluster.connect(sys.argv[1]); "
                "s = c.session(sys.argv[2], objective='throughput', name='digits'); "
                "x = np.load(sys.argv[3]); print(s._key, float(np.abs(s.run(None, {'x': x})[0]).sum()), "
                "flush=True); time.sleep(120)")
        np.save(Path(path).with_suffix(".x.npy"), feeds["x"])
        driver = subprocess.Popen([sys.executable, "-c", code, address(cluster), str(path),
                                   str(Path(path).with_suffix(".x.npy"))], env=daemon_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert driver.stdout is not None
            key, total = driver.stdout.readline().split()
            assert key == first._key and abs(float(total) - float(np.abs(want[0]).sum())) < 1e-4
            assert len(held()) == 2
        finally:
            driver.kill()
            driver.wait()
        assert_same(first.run(None, feeds), want)  # a driver that died leaves the others' copies
    finally:
        first.close()
    wait_until(lambda: held() == [])
    with cluster[1].session(path, objective="latency", name="digits") as again:  # the name is free again
        assert_same(again.run(None, feeds), want)


# -- faults: these kill a node's actor, so they come last ------------------------------------------
def test_the_benchs_hops_move_tensors_from_node_to_node_several_at_once(cluster: Any) -> None:
    from bench.cluster import hop_throughput

    _, joined = cluster
    rates = hop_throughput(joined, sizes_mib=(0.25, 1), seconds=0.3, nodes=NODES)
    assert [mib for mib, _ in rates] == [0.25, 1]
    assert all(rate > 0 for _, rate in rates), rates


def actor_pid(cluster: Any, node: str) -> int:
    return next(d["pid"] for d in cluster[1].describe() if d["node"] == node)


def wait_until(condition: Any, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def kill_after(futures: list[Any], done: int, pid: int) -> None:
    """SIGKILL ``pid`` once ``done`` of ``futures`` completed (the others are in flight)."""
    wait_until(lambda: sum(f.done() for f in futures) >= done, timeout=60)
    os.kill(pid, signal.SIGKILL)


def test_a_node_killed_mid_run_sends_its_requests_to_the_other_replica(cluster: Any, mnist: Any) -> None:
    path, feeds, want = mnist
    with cluster[1].session(path, objective="throughput") as session:
        lane_of = {copy["nodes"][0]: copy["index"] for copy in session.copies}
        before = actor_pid(cluster, "n1")
        with ThreadPoolExecutor(1) as pool:  # run_many's groups in flight too
            many = pool.submit(session.run_many, (feeds for _ in range(300)), None, None, window=64)
            futures = [session.submit(feeds) for _ in range(300)]
            kill_after(futures, 10, before)
            for future in futures:  # every request is answered, by the replica that lived
                assert_same(future.result(timeout=120), want)
            for result in many.result(timeout=120):
                assert_same(result, want)
        # Ray restarts the actor; the session opens the model there again and sends it requests
        wait_until(lambda: actor_pid(cluster, "n1") != before)
        served = session.copies[lane_of["n1"]]["served"]

        def n1_serves() -> bool:
            for future in [session.submit(feeds) for _ in range(8)]:
                assert_same(future.result(timeout=60), want)
            return session.copies[lane_of["n1"]]["served"] > served

        wait_until(n1_serves)


def test_a_node_killed_mid_run_without_a_replica_fails_each_request_clearly(cluster: Any, mnist: Any) -> None:
    from vkpool.cluster import NodeLost

    path, feeds, want = mnist
    # calls of 8 (a split's own are far larger): many of them still in flight when the node dies
    with cluster[1].session(path, budgets=split_budgets(), max_bundle=8) as session:
        before = actor_pid(cluster, "n1")
        futures = [session.submit(feeds) for _ in range(300)]
        kill_after(futures, 5, before)
        lost = 0
        for future in futures:  # each ends: with the right outputs, or a clear error; none hangs
            try:
                assert_same(future.result(timeout=120), want)
            except NodeLost as exc:
                assert "n1" in str(exc) and "no other replica" in str(exc)
                lost += 1
        assert lost > 0
        wait_until(lambda: actor_pid(cluster, "n1") != before)

        def runs() -> bool:  # once the session has opened its part on the restarted actor
            try:
                assert_same(session.run(None, feeds), want)
            except NodeLost:
                return False
            return True

        wait_until(runs)
    # no thread of the closed session is left holding Ray's references (freed after Ray shuts
    # down, one ends the process): its answers' thread and its reviver have ended
    assert not any(t.is_alive() for t in session._completions._threads)
    assert session._reviver is None or not session._reviver.is_alive()
