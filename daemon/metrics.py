"""Prometheus metrics of the daemon, served over HTTP when the config sets ``daemon.metrics``.

Everything is collected when Prometheus scrapes (:class:`_DaemonCollector`, the custom-collector
pattern of prometheus_client): the daemon's state (queues, members, models, the status counters,
error replies by type) is read then, and the jobs' counts and histograms are kept by
:meth:`Metrics.ran` in plain lists under one lock: 1.8 µs per job on a shared 2-core VM,
where prometheus_client's own objects (three ``Histogram.observe`` and a labelled counter) took
6.7 µs, a large part of a small model's round trip. With metrics off, a job pays one attribute test.

The families (``docs/daemon.md`` lists them with their labels):

- ``vkpool_jobs_total{model, model_id, status}``: jobs run, ``status`` is ``ok`` or the error type;
- ``vkpool_job_seconds{model, model_id}``: a job's time from acceptance to the end of its run;
- ``vkpool_job_run_seconds{model, model_id}``: the runtime's run time alone (of its batch, when batched);
- ``vkpool_batch_size{model, model_id}``: jobs per run (1, or the jobs of a batch);
- ``vkpool_errors_total{type}``: error replies to any request, by error type;
- ``vkpool_queue_depth{model, model_id}``: jobs queued;
- ``vkpool_member_used_bytes{member}``, ``vkpool_member_budget_bytes{member}``;
- ``vkpool_models_loaded``, ``vkpool_models_loading``;
- ``vkpool_replay_bytes``: the replies kept for retried request ids;
- ``vkpool_requests_total{outcome}``: the status counters (accepted, ok, error, client_gone, busy, ...).

With ``process_per_device`` the front serves them all, labelled by serving process
(:class:`GatheredMetrics`).
"""
from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import Counter
from typing import Any, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger("vkpool.daemon")

#: seconds: from the tens of microseconds of a small model on a GPU to a long job on a software device
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_MODEL = ["model", "model_id"]


class _Histogram:
    """Counts per bucket (the last one: above every bound) and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i holds bounds[i-1] < value <= bounds[i]
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            total += count
            out.append((bound, total))
        return out


class _ModelSeries:
    """What the jobs of one model add up to."""

    __slots__ = ("jobs", "latency", "run", "batch")

    def __init__(self) -> None:
        self.jobs: Counter[str] = Counter()
        self.latency, self.run = _Histogram(LATENCY_BUCKETS), _Histogram(LATENCY_BUCKETS)
        self.batch = _Histogram(BATCH_BUCKETS)


class Metrics:
    """The daemon's metrics on a registry of their own (several daemons in one process, as in
    tests, do not mix). :meth:`watch` names the daemon they describe; :meth:`serve` starts the
    HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._models: dict[tuple[str, str], _ModelSeries] = {}  # by (name, id prefix): the labels
        self._server: Any = None

    def ran(self, entry: Any, status: str, run_s: float, queued_s: Sequence[float]) -> None:
        """One run of the jobs that were queued for ``queued_s`` (one job, or a batch)."""
        labels = (entry.name, entry.id[:12])
        with self._lock:
            series = self._models.get(labels)
            if series is None:
                series = self._models[labels] = _ModelSeries()
            series.jobs[status] += len(queued_s)
            for queued in queued_s:
                series.latency.observe(queued + run_s)
                series.run.observe(run_s)
            series.batch.observe(len(queued_s))

    def jobs_collected(self) -> Iterator[Any]:
        """The job families, from what :meth:`ran` kept."""
        jobs = CounterMetricFamily("vkpool_jobs", "Jobs run, by model and outcome (ok, or the error type)",
                                   labels=[*_MODEL, "status"])
        latency = HistogramMetricFamily("vkpool_job_seconds", "Time from a job's acceptance to the end of its run",
                                        labels=_MODEL)
        run = HistogramMetricFamily("vkpool_job_run_seconds", "Time the runtime spent running a job", labels=_MODEL)
        batch = HistogramMetricFamily("vkpool_batch_size", "Jobs per run: 1, or the jobs of a batch",
                                      labels=_MODEL)
        with self._lock:
            for labels, series in self._models.items():
                for status, count in sorted(series.jobs.items()):
                    jobs.add_metric([*labels, status], count)
                for family, histogram in ((latency, series.latency), (run, series.run), (batch, series.batch)):
                    family.add_metric(list(labels), histogram.cumulative(), histogram.sum)
        yield from (jobs, latency, run, batch)

    def watch(self, service: Any, stats: Any) -> None:
        """Collect the state of ``service`` (its registry, scheduler and runtime), ``stats`` and
        the jobs at each scrape."""
        self.registry.register(_DaemonCollector(self, service, stats))

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

    def __init__(self, metrics: Metrics, service: Any, stats: Any) -> None:
        self.metrics, self.service, self.stats = metrics, service, stats

    def describe(self) -> list[Any]:
        return []  # the families are known only once collected; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        yield from self.metrics.jobs_collected()
        service = self.service
        entries = {e.id: e for e in service.registry.all()}
        depth = GaugeMetricFamily("vkpool_queue_depth", "Jobs queued, by model", labels=_MODEL)
        for model_id, queued in service.scheduler.depths().items():
            entry = entries.get(model_id)
            depth.add_metric([entry.name if entry is not None else "", model_id[:12]], queued)
        yield depth
        used = GaugeMetricFamily("vkpool_member_used_bytes", "Bytes vkpool holds on a pool member",
                                 labels=["member"])
        budget = GaugeMetricFamily("vkpool_member_budget_bytes", "A pool member's budget in bytes",
                                   labels=["member"])
        for member in service.runtime.members():
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
            if outcome not in ("in_flight", "connections", "lanes", "replay_bytes"):
                requests.add_metric([outcome], count)
        yield requests
        yield GaugeMetricFamily("vkpool_replay_bytes", "Bytes of the replies kept for retried request ids",
                                value=self.stats.replay_bytes)


def _url_host(address: tuple[str, int]) -> tuple[str, int]:
    host, port = address
    return (f"[{host}]" if ":" in host else host), port


class GatheredMetrics:
    """The metrics of a daemon with a serving process per device, served by its front: at each
    scrape, every serving process's families (read from its own endpoint, a free local port) with
    a ``serving`` label naming its member, and ``vkpool_serving_process_up{serving}`` (1 while it
    answers the scrape) and ``vkpool_serving_process_restarts_total{serving}``. ``sources()``
    gives ``(member, "host:port" or None, restarts)`` for each serving process."""

    def __init__(self, sources: Any) -> None:
        self.sources = sources
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        self._server: Any = None

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        import urllib.request

        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families

        up = GaugeMetricFamily("vkpool_serving_process_up", "1 while the serving process answers, else 0",
                               labels=["serving"])
        restarts = CounterMetricFamily("vkpool_serving_process_restarts", "Times the serving process was "
                                       "started again", labels=["serving"])
        families: dict[str, Any] = {}
        for member, address, started_again in self.sources():
            text = None
            if address is not None:
                try:
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as reply:
                        text = reply.read().decode()
                except OSError as exc:
                    log.warning("metrics of the serving process for %s: %s", member, exc)
            up.add_metric([member], 0.0 if text is None else 1.0)
            restarts.add_metric([member], started_again)
            for family in text_string_to_metric_families(text or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "serving": member}, sample.value)
        yield up
        yield restarts
        yield from families.values()

    serve = Metrics.serve
    close = Metrics.close
