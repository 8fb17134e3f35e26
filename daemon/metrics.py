"""Prometheus metrics of the daemon, served over HTTP when the config sets ``daemon.metrics``.

Jobs are observed as they run (:meth:`Metrics.job_ran`, called through
:meth:`vkpool.daemon.stats.Stats.job_ran`); everything else is read from the daemon's state
when Prometheus scrapes (:class:`_DaemonCollector`), so the daemon's hot path pays for nothing
but the job observations, and nothing at all when metrics are off.

The families (``docs/daemon.md`` lists them with their labels):

- ``vkpool_jobs_total{model, model_id, status}``: jobs run, ``status`` is ``ok`` or the error type;
- ``vkpool_job_seconds{model, model_id}``: a job's time from acceptance to the end of its run;
- ``vkpool_job_run_seconds{model, model_id}``: the engine's run time alone;
- ``vkpool_job_batch_size{model, model_id}``: the samples each job ran (the model's bound batch);
- ``vkpool_errors_total{type}``: error replies to any request, by error type;
- ``vkpool_queue_depth{model, model_id}``: jobs queued;
- ``vkpool_member_used_bytes{member}``, ``vkpool_member_budget_bytes{member}``;
- ``vkpool_models_loaded``, ``vkpool_models_loading``;
- ``vkpool_requests_total{outcome}``: the status counters (accepted, ok, error, client_gone, busy, ...).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("vkpool.daemon")

#: seconds: from the tens of microseconds of a small model on a GPU to a long job on a software device
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_MODEL = ("model", "model_id")


class Metrics:
    """The daemon's metrics on a registry of their own (several daemons in one process, as in
    tests, do not mix). :meth:`watch` adds the state read at scrape time; :meth:`serve` starts
    the HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.jobs = Counter("vkpool_jobs", "Jobs run, by model and outcome (ok, or the error type)",
                            [*_MODEL, "status"], registry=self.registry)
        self.job_seconds = Histogram("vkpool_job_seconds", "Time from a job's acceptance to the end of its run",
                                     _MODEL, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.run_seconds = Histogram("vkpool_job_run_seconds", "Time the engine spent running a job",
                                     _MODEL, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("vkpool_job_batch_size", "Samples per job: the batch the model was loaded with",
                                    _MODEL, buckets=BATCH_BUCKETS, registry=self.registry)
        self._server: Any = None

    def job_ran(self, entry: Any, status: str, queued_s: float, run_s: float) -> None:
        labels = (entry.name, entry.id[:12])
        self.jobs.labels(*labels, status).inc()
        self.job_seconds.labels(*labels).observe(queued_s + run_s)
        self.run_seconds.labels(*labels).observe(run_s)
        self.batch_size.labels(*labels).observe(entry.binding.get("batch", 1))

    def watch(self, service: Any, stats: Any) -> None:
        """Read the state of ``service`` (its registry, scheduler and engine) and ``stats`` at
        each scrape."""
        self.registry.register(_DaemonCollector(service, stats))

    def serve(self, address: tuple[str, int]) -> tuple[str, int]:
        """Serve ``/metrics`` on ``address`` (a thread of prometheus_client's); the address bound."""
        host, port = address
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", *_url_host(bound))
        return bound[0], bound[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _DaemonCollector:
    """Gauges and counters read from the daemon's state when Prometheus scrapes."""

    def __init__(self, service: Any, stats: Any) -> None:
        self.service, self.stats = service, stats

    def describe(self) -> list[Any]:
        return []  # the families are known only once collected; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        service = self.service
        entries = {e.id: e for e in service.registry.all()}
        depth = GaugeMetricFamily("vkpool_queue_depth", "Jobs queued, by model", labels=list(_MODEL))
        for model_id, queued in service.scheduler.depths().items():
            entry = entries.get(model_id)
            depth.add_metric([entry.name if entry is not None else "", model_id[:12]], queued)
        yield depth
        used = GaugeMetricFamily("vkpool_member_used_bytes", "Bytes vkpool holds on a pool member",
                                 labels=["member"])
        budget = GaugeMetricFamily("vkpool_member_budget_bytes", "A pool member's budget in bytes",
                                   labels=["member"])
        for member in service.engine.members():
            used.add_metric([member["id"]], member["used_bytes"])
            budget.add_metric([member["id"]], member["budget_bytes"])
        yield used
        yield budget
        yield GaugeMetricFamily("vkpool_models_loaded", "Models loaded", value=len(entries))
        yield GaugeMetricFamily("vkpool_models_loading", "Models being loaded",
                                value=len(service.registry.loading_infos()))
        errors = CounterMetricFamily("vkpool_errors", "Error replies, by error type", labels=["type"])
        for error_type, count in sorted(self.stats.errors_by_type.items()):
            errors.add_metric([error_type], count)
        yield errors
        requests = CounterMetricFamily("vkpool_requests", "Requests by outcome, as `vkpool status` counts them",
                                       labels=["outcome"])
        for outcome, count in self.stats.snapshot(0)["counters"].items():
            if outcome not in ("in_flight", "connections", "lanes"):
                requests.add_metric([outcome], count)
        yield requests


def _url_host(address: tuple[str, int]) -> tuple[str, int]:
    host, port = address
    return (f"[{host}]" if ":" in host else host), port
