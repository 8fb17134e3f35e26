"""Prometheus metrics of a real daemon on the Vulkan device: the families are served on the
configured loopback address, and their values move with the jobs run and the errors answered."""
from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_daemon_support import mlp_model, short_folder, spawn_daemon, wait_ready
from vkpool.daemon import errors as E
from vkpool.daemon.client import Client
from vkpool.daemon.settings import DaemonSettings, SettingsError

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key))


def test_the_metrics_key_is_validated() -> None:
    assert DaemonSettings.from_dict({"metrics": "127.0.0.1:9464"}).metrics == ("127.0.0.1", 9464)
    assert DaemonSettings.from_dict({"metrics": "[::1]:0"}).metrics == ("::1", 0)
    assert DaemonSettings().metrics is None
    for bad in ("9464", "localhost", "host:port", "127.0.0.1:70000"):
        with pytest.raises(SettingsError, match="daemon.metrics: expected HOST:PORT"):
            DaemonSettings.from_dict({"metrics": bad})


def test_metric_families_are_served_and_move_with_jobs_and_errors() -> None:
    port = _free_port()
    with short_folder("vkm") as folder:
        endpoint = f"ipc://{folder}/d.sock"
        config = folder / "vkpool.yaml"
        config.write_text("daemon: " + json.dumps({"metrics": f"127.0.0.1:{port}"}) + "\n")
        model = folder / "mlp.onnx"
        model.write_bytes(mlp_model(8, 16))
        proc = spawn_daemon(endpoint, config=config)
        try:
            wait_ready(endpoint, proc)
            before = _scrape(port)
            for family in ("vkpool_member_used_bytes", "vkpool_member_budget_bytes", "vkpool_models_loaded",
                           "vkpool_models_loading", "vkpool_requests_total"):
                assert family in before, family
            assert _value(before, "vkpool_models_loaded") == 0
            with Client(endpoint) as client:
                members = {m["id"]: m for m in client.devices()}
                assert _value(before, "vkpool_member_budget_bytes", member="vk0") == members["vk0"]["budget_bytes"]
                session = client.session(str(model))
                x = np.ones((1, 8), np.float32)
                for _ in range(5):
                    session.run(None, {"x": x})
                with pytest.raises((E.InvalidTensor, ValueError)):
                    session.run(None, {"x": np.ones((1, 9), np.float32)})
                used = {m["id"]: m["used_bytes"] for m in client.devices()}
                after = _scrape(port)
                model_id = session.model_id[:12]
                session.close()
        finally:
            proc.terminate()
            assert proc.wait(60) == 0
            stderr = proc.stderr.read().decode()
    labels = {"model": "mlp.onnx", "model_id": model_id}
    assert _value(after, "vkpool_jobs_total", status="ok", **labels) == 5
    assert _value(after, "vkpool_job_seconds_count", **labels) == 5
    assert _value(after, "vkpool_job_run_seconds_count", **labels) == 5
    assert _value(after, "vkpool_job_seconds_sum", **labels) > 0
    assert _value(after, "vkpool_batch_size_count", **labels) == 5  # an unbatched model: a run per job
    assert _value(after, "vkpool_batch_size_sum", **labels) == 5
    assert _value(after, "vkpool_job_seconds_bucket", le="+Inf", **labels) == 5
    assert _value(after, "vkpool_errors_total", type="InvalidTensor") == 1
    assert _value(after, "vkpool_queue_depth", **labels) == 0
    assert _value(after, "vkpool_models_loaded") == 1
    for member, nbytes in used.items():
        assert _value(after, "vkpool_member_used_bytes", member=member) == nbytes
    assert _value(after, "vkpool_member_used_bytes", member="vk0") > _value(before, "vkpool_member_used_bytes",
                                                                            member="vk0")
    assert _value(after, "vkpool_requests_total", outcome="error") == 1
    # replies kept for retries: the five runs' and the error's joined those before them
    assert _value(after, "vkpool_replay_bytes") > _value(before, "vkpool_replay_bytes")
    assert _value(after, "vkpool_requests_total", outcome="ok") > _value(before, "vkpool_requests_total", outcome="ok")
    # the error reply was logged at warning level with its type
    assert [line for line in stderr.splitlines() if "WARNING" in line and "answered InvalidTensor" in line]


def test_a_taken_metrics_port_stops_the_start_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with short_folder("vkm") as folder:
            config = folder / "vkpool.yaml"
            config.write_text(f"daemon: {{metrics: '127.0.0.1:{port}'}}\n")
            proc = spawn_daemon(f"ipc://{folder}/d.sock", config=config)
            assert proc.wait(60) == 1
            assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr.read().decode()


def test_job_histograms_match_prometheus_clients_own() -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from vkpool.daemon.metrics import LATENCY_BUCKETS, Metrics

    ours = Metrics()
    reference = CollectorRegistry()
    theirs = Histogram("vkpool_job_run_seconds", "", ["model", "model_id"], buckets=LATENCY_BUCKETS,
                       registry=reference)
    entry = SimpleNamespace(name="m.onnx", id="ab" * 32, binding={"batch": 4})
    values = [*LATENCY_BUCKETS, 0.0, 1e-6, 7e-5, 0.003, 31.0, 1e3, *np.nextafter(LATENCY_BUCKETS, np.inf)]
    for value in values:
        ours.ran(entry, "ok", float(value), [0.0])
        theirs.labels("m.onnx", "ab" * 6).observe(float(value))
    class Jobs:
        def collect(self) -> Any:
            return ours.jobs_collected()

    ours.registry.register(Jobs())

    def run_seconds(registry: CollectorRegistry) -> dict:
        samples = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            if family.name == "vkpool_job_run_seconds":
                samples.update({(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
                                if not s.name.endswith("_created")})
        return samples

    expected = run_seconds(reference)
    assert expected and run_seconds(ours.registry) == expected
    collected = {f.name: f for f in ours.jobs_collected()}
    assert [s.value for s in collected["vkpool_jobs"].samples] == [len(values)]

    batched = Metrics()
    batched.ran(entry, "ok", 0.002, [0.001, 0.003, 0.0, 0.010])  # one run of a batch of 4 jobs
    batched.ran(entry, "Timeout", 0.004, [0.0])
    collected = {f.name: f for f in batched.jobs_collected()}
    jobs = {s.labels["status"]: s.value for s in collected["vkpool_jobs"].samples}
    assert jobs == {"ok": 4, "Timeout": 1}
    sizes = {s.labels.get("le"): s.value for s in collected["vkpool_batch_size"].samples if "le" in s.labels}
    assert sizes["1.0"] == 1 and sizes["2.0"] == 1 and sizes["4.0"] == 2 and sizes["+Inf"] == 2
    latency = {s.labels.get("le"): s.value for s in collected["vkpool_job_seconds"].samples if "le" in s.labels}
    assert latency["0.0025"] == 1 and latency["0.005"] == 4 and latency["0.025"] == 5  # queue + run, per job
    runs = [s for s in collected["vkpool_job_run_seconds"].samples if s.name.endswith("_sum")]
    assert runs[0].value == pytest.approx(4 * 0.002 + 0.004)


def test_a_batching_models_runs_are_counted_as_batches() -> None:
    import threading

    import zmq
    from prometheus_client import generate_latest

    from test_daemon_batching import batch_model
    from vkpool.daemon.runtime import Runtime
    from vkpool.daemon.metrics import Metrics
    from vkpool.daemon.server import Server

    metrics, ctx = Metrics(), zmq.Context()
    endpoint = "inproc://vkpool-test-metrics-batching"
    server = Server(Runtime.from_config(None), DaemonSettings(), endpoint, context=ctx, metrics=metrics)
    metrics.watch(server.service, server.stats)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(endpoint, context=ctx) as admin:
            model = admin.load_model(batch_model(graph="metrics"), name="batched", max_batch=8,
                                     max_queue_delay=0.3, keep_alive=0)

            def one(rows: int) -> None:
                with Client(endpoint, context=ctx) as c:
                    session = c.session(batch_model(graph="metrics"), max_batch=8, max_queue_delay=0.3)
                    session.run(None, {"x": np.ones((rows, 16), np.float32)})

            threads = [threading.Thread(target=one, args=(rows,)) for rows in (1, 2, 1, 3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            batching = next(m for m in admin.status()["models"] if m["id"] == model["id"])["batching"]
            samples: dict = {}
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
                for sample in family.samples:
                    samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    finally:
        server.request_stop()
        thread.join(30)
        ctx.term()
    labels = {"model": "batched", "model_id": model["id"][:12]}
    assert _value(samples, "vkpool_jobs_total", status="ok", **labels) == 4
    assert _value(samples, "vkpool_job_seconds_count", **labels) == 4
    assert _value(samples, "vkpool_batch_size_sum", **labels) == 4  # jobs, in
    assert _value(samples, "vkpool_batch_size_count", **labels) == batching["batches"] < 4  # fewer runs


def test_jobs_per_s_counts_the_infers_of_the_rate_window_only() -> None:
    """``status``'s jobs/s: infers answered within the last ``RATE_WINDOW_S``, counted in steps of
    ``RATE_STEP_S`` (several passes in one step add to it), those older dropped."""
    import time

    from vkpool.daemon.stats import Stats

    stats = Stats()
    now = time.monotonic()
    stats.started = now - 2 * Stats.RATE_WINDOW_S
    stats.infers_done([0.001] * 5, now - Stats.RATE_WINDOW_S - 1.0)  # out of the window
    stats.infers_done([0.001] * 3, now - 1.0)
    stats.infers_done([0.002] * 4, now - 1.0 + Stats.RATE_STEP_S / 2)  # the same step
    stats.infers_done([0.003] * 2, now - 0.5)
    snap = stats.snapshot(connections=0)
    assert round(snap["jobs_per_s"] * Stats.RATE_WINDOW_S) == 9, snap
    assert len(stats._finished) == 2
    assert snap["latency_ms"]["p50"] > 0
