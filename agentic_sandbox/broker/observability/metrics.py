"""Every Prometheus metric family of the server, defined in one place.

A per-server CollectorRegistry (not the process-global one) so that several servers can live
in one test process. It carries prometheus-client's standard process (`process_*`: CPU seconds,
resident memory, open descriptors), interpreter (`python_info`) and garbage-collector
(`python_gc_*`, read from `gc.get_stats()` at scrape time, no collection callbacks) families
too, as any Python exporter's do. Label values are always from bounded sets: states, roles,
route templates, stage names — never instance, session or task ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TASK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

# (family name, help, label names, provider) — providers return {label tuple: value}
Provider = Callable[[], dict[tuple[str, ...], float]]
Family = type[GaugeMetricFamily] | type[CounterMetricFamily]


class _ProviderCollector(Collector):
    """Gauges and counters computed at scrape time from the live state of the server."""

    def __init__(self) -> None:
        self._families: list[tuple[Family, str, str, tuple[str, ...], Provider]] = []

    def add(
        self, kind: Family, name: str, doc: str, labels: tuple[str, ...], provider: Provider
    ) -> None:
        self._families.append((kind, name, doc, labels, provider))

    def collect(self) -> Iterable[Metric]:
        for kind, name, doc, labels, provider in self._families:
            fam = kind(name, doc, labels=list(labels))
            for key, value in provider().items():
                fam.add_metric(list(key), value)
            yield fam

    def describe(self) -> Iterable[Metric]:
        return []


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # `_created` series double the exposition for no use here
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._providers = _ProviderCollector()
        r.register(self._providers)

        self.build_info = Gauge(
            "sandbox_build_info", "Server build information", ["version"], registry=r
        )
        # HTTP
        self.http_requests = Counter(
            "sandbox_http_requests_total",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "sandbox_http_request_duration_seconds",
            "HTTP request duration by route template",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_failures = Counter(
            "sandbox_auth_failures_total",
            "Requests refused for authentication or authorization",
            ["reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "sandbox_rate_limited_total", "Requests refused by the per-token rate limit", registry=r
        )
        # Agents and gRPC
        self.grpc_messages = Counter(
            "sandbox_grpc_messages_total",
            "Agent-link messages by direction and kind",
            ["direction", "kind"],
            registry=r,
        )
        self.enrollments = Counter(
            "sandbox_agent_enrollments_total",
            "Agent enrollments by outcome",
            ["outcome"],
            registry=r,
        )
        self.agent_link_events = Counter(
            "sandbox_agent_link_events_total",
            "Agent link changes: connected, disconnected, stale, replaced",
            ["event"],
            registry=r,
        )
        # Sessions
        self.sessions_opened = Counter(
            "sandbox_sessions_opened_total",
            "PTY sessions asked of agents, by outcome (ok, failed, adopted)",
            ["outcome"],
            registry=r,
        )
        self.session_ends = Counter(
            "sandbox_session_ends_total",
            "Sessions that ended, by how (exited, killed, lost)",
            ["how"],
            registry=r,
        )
        self.session_output_bytes = Counter(
            "sandbox_session_output_bytes_total",
            "PTY output bytes received from agents",
            registry=r,
        )
        self.session_relayed_bytes = Counter(
            "sandbox_session_relayed_bytes_total",
            "PTY output bytes sent to attached clients (all clients together)",
            registry=r,
        )
        self.session_input_bytes = Counter(
            "sandbox_session_input_bytes_total", "Input bytes written by controllers", registry=r
        )
        self.session_resyncs = Counter(
            "sandbox_session_resyncs_total",
            "Clients skipped ahead to a screen snapshot because they fell behind",
            registry=r,
        )
        self.session_client_drops = Counter(
            "sandbox_session_client_drops_total",
            "Clients disconnected because they stayed stuck",
            registry=r,
        )
        self.hitl_prompts = Counter(
            "sandbox_hitl_prompts_total", "Prompts detected that wait for a person", registry=r
        )
        # Tasks
        self.task_transitions = Counter(
            "sandbox_task_transitions_total",
            "Task state transitions",
            ["from_state", "to_state"],
            registry=r,
        )
        self.task_duration = Histogram(
            "sandbox_task_duration_seconds",
            "Task duration from submit to a terminal state",
            ["state"],
            buckets=TASK_BUCKETS,
            registry=r,
        )
        # Fleet, provisioning, images
        self.provision_stage = Histogram(
            "sandbox_provision_stage_duration_seconds",
            "Duration of each provisioning stage",
            ["stage", "outcome"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.provisions = Counter(
            "sandbox_provisions_total",
            "Provisioning operations by outcome and source",
            ["source", "outcome"],
            registry=r,
        )
        self.image_build = Histogram(
            "sandbox_image_build_duration_seconds",
            "Image build duration",
            ["outcome", "cached"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.libvirt_call = Histogram(
            "sandbox_libvirt_call_duration_seconds",
            "Latency of libvirt calls by operation",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.libvirt_errors = Counter(
            "sandbox_libvirt_errors_total",
            "Failed libvirt calls by operation",
            ["operation"],
            registry=r,
        )
        # Events
        self.events_published = Counter(
            "sandbox_events_published_total", "Events published by family", ["family"], registry=r
        )
        self.sse_gaps = Counter(
            "sandbox_event_stream_gaps_total",
            "SSE clients that fell behind and were told they missed events",
            registry=r,
        )

    def provide(self, name: str, doc: str, labels: tuple[str, ...], provider: Provider) -> None:
        """Register a scrape-time gauge family (e.g. instances by state and host)."""
        self._providers.add(GaugeMetricFamily, name, doc, labels, provider)

    def provide_counter(
        self, name: str, doc: str, labels: tuple[str, ...], provider: Provider
    ) -> None:
        """Register a scrape-time counter family (a total kept by the part it counts)."""
        self._providers.add(CounterMetricFamily, name, doc, labels, provider)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class WriterStats(Protocol):
    """What the metrics read of a write-behind writer (`store.batch.BatchWriter`)."""

    @property
    def name(self) -> str: ...

    @property
    def pending(self) -> int: ...

    @property
    def dropped(self) -> int: ...


def provide_writer_metrics(metrics: Metrics, writers: Sequence[WriterStats]) -> None:
    """Backlog and drops of the write-behind writers, labelled by writer name."""
    metrics.provide(
        "sandbox_write_behind_pending",
        "Rows handed to a write-behind writer and not yet stored, by writer",
        ("writer",),
        lambda: {(w.name,): float(w.pending) for w in writers},
    )
    metrics.provide_counter(
        "sandbox_write_behind_dropped",
        "Rows a write-behind writer dropped unwritten because its backlog was full, by writer",
        ("writer",),
        lambda: {(w.name,): float(w.dropped) for w in writers},
    )
