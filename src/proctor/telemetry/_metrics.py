"""The runtime's Prometheus metrics, named once, here.

Names follow Prometheus's conventions: the ``proctor_`` prefix, base units
(seconds, bytes), ``_total`` on counters (``prometheus_client`` adds it to a
counter's name). Labels carry no secret, key or personal data: a call's kind and
decision, a run's backend and outcome, an API route's template (never its path:
paths hold ids), and a tenant's name only where the operator asked for it
(``serve --metrics-tenant-labels``): each tenant multiplies the series.

Until :func:`enable_metrics` every metric is :data:`_NULL`, which accepts the
same calls and does nothing, so the instrumented code needs no test of its own
and a CLI command never imports ``prometheus_client`` (about 90 ms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from proctor import __version__


class Counter(Protocol):
    def labels(self, *values: str) -> Counter: ...
    def inc(self, amount: float = 1) -> None: ...


class Gauge(Protocol):
    def labels(self, *values: str) -> Gauge: ...
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...
    def set(self, value: float) -> None: ...


class Histogram(Protocol):
    def labels(self, *values: str) -> Histogram: ...
    def observe(self, amount: float) -> None: ...


class _Null:
    """Every metric while metrics are off: the same calls, doing nothing."""

    def labels(self, *values: str) -> _Null:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_NULL = _Null()

#: Latency buckets, in seconds: a call decided from memory takes well under a
#: millisecond; one that waits on an upstream or a fsync, milliseconds to seconds.
LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
#: Events per ledger commit (group commit joins what is queued).
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Metrics:
    """The runtime's metrics. Each field's comment is the metric's meaning; its name
    and labels are in :func:`_real` (names end in ``_total`` for counters)."""

    #: proctor_calls_total{kind, decision, tenant}: calls out of sandboxes, decided.
    calls: Counter
    #: proctor_call_duration_seconds{kind}: a call from its first byte to its answer.
    call_seconds: Histogram
    #: proctor_decision_duration_seconds{kind}: a call's decide stage (its Cedar questions).
    decision_seconds: Histogram
    #: proctor_ledger_appends_total{tenant}: events made durable in the ledger.
    ledger_appends: Counter
    #: proctor_ledger_batch_events: events per commit.
    ledger_batch: Histogram
    #: proctor_ledger_fsync_duration_seconds: one batch's commit, fsync included.
    ledger_fsync_seconds: Histogram
    #: proctor_ledger_write_failures_total: batches the ledger could not make durable
    #: (each refused the calls waiting on it).
    ledger_write_failures: Counter
    #: proctor_runs{state, backend}: this node's runs by state (starting, running).
    runs: Gauge
    #: proctor_runs_finished_total{outcome, backend}: runs ended, by outcome.
    runs_finished: Counter
    #: proctor_warm_pool_size{backend}: sandboxes started ahead, ready to take.
    warm_pool_size: Gauge
    #: proctor_warm_pool_misses_total{backend}: starts that found the pool empty.
    warm_pool_misses: Counter
    #: proctor_broker_connections: connections open on runs' sockets.
    broker_connections: Gauge
    #: proctor_broker_connections_refused_total{reason}: over_run, over_total, idle.
    broker_refused: Counter
    #: proctor_api_connections: connections open to the API.
    api_connections: Gauge
    #: proctor_api_requests_total{method, route, status}: route is the template.
    api_requests: Counter
    #: proctor_api_request_duration_seconds{method, route}: to the answer's last byte.
    api_seconds: Histogram
    #: proctor_rate_limit_refusals_total{surface, reason, tenant}: surface api or
    #: broker; reason the limit (rate, calls, quota, connections, ...).
    rate_limited: Counter
    #: proctor_witness_checkpoint_age_seconds{tenant}: how long the tenant's log has
    #: gone without a checkpoint its witnesses' quorum cosigned, 0 while its head has
    #: one (a quiet log is not stale); tenant labels off: the tenant furthest behind.
    witness_age: Gauge
    #: proctor_retention_pruned_events_total{tenant}: events pruned past retention.
    pruned: Counter
    #: proctor_erasures_total{tenant}: erasure requests carried out.
    erasures: Counter


def _null() -> Metrics:
    return Metrics(**{f.name: _NULL for f in fields(Metrics)})


def _real(registry: Any) -> Metrics:
    from prometheus_client import Counter as C
    from prometheus_client import Gauge as G
    from prometheus_client import Histogram as H

    def c(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return C(name, doc, labels, registry=registry)

    def g(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return G(name, doc, labels, registry=registry)

    def h(
        name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY
    ) -> Any:
        return H(name, doc, labels, registry=registry, buckets=buckets)

    return Metrics(
        calls=c("proctor_calls", "Calls out of sandboxes, decided",
                ("kind", "decision", "tenant")),
        call_seconds=h("proctor_call_duration_seconds",
                       "A call from its first byte to its answer", ("kind",)),
        decision_seconds=h("proctor_decision_duration_seconds", "A call's decide stage",
                           ("kind",)),
        ledger_appends=c("proctor_ledger_appends", "Events made durable in the ledger",
                         ("tenant",)),
        ledger_batch=h("proctor_ledger_batch_events", "Events per ledger commit",
                       buckets=BATCH),
        ledger_fsync_seconds=h("proctor_ledger_fsync_duration_seconds",
                               "One ledger commit, fsync included"),
        ledger_write_failures=c("proctor_ledger_write_failures", "Ledger commits that failed"),
        runs=g("proctor_runs", "This node's runs by state", ("state", "backend")),
        runs_finished=c("proctor_runs_finished", "Runs ended, by outcome",
                        ("outcome", "backend")),
        warm_pool_size=g("proctor_warm_pool_size", "Sandboxes started ahead", ("backend",)),
        warm_pool_misses=c("proctor_warm_pool_misses", "Starts that found the warm pool empty",
                           ("backend",)),
        broker_connections=g("proctor_broker_connections", "Connections open on runs' sockets"),
        broker_refused=c("proctor_broker_connections_refused",
                         "Connections refused on runs' sockets", ("reason",)),
        api_connections=g("proctor_api_connections", "Connections open to the API"),
        api_requests=c("proctor_api_requests", "API requests answered",
                       ("method", "route", "status")),
        api_seconds=h("proctor_api_request_duration_seconds", "API requests, to the last byte",
                      ("method", "route")),
        rate_limited=c("proctor_rate_limit_refusals", "Requests and calls refused by a limit",
                       ("surface", "reason", "tenant")),
        witness_age=g("proctor_witness_checkpoint_age_seconds",
                      "How long the log has gone without a cosigned checkpoint",
                      ("tenant",)),
        pruned=c("proctor_retention_pruned_events", "Events pruned past retention",
                 ("tenant",)),
        erasures=c("proctor_erasures", "Erasure requests carried out", ("tenant",)),
    )  # fmt: skip


class _State:
    """The process's metrics: one set, turned on once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current = _null()
        self.registry: Any = None
        #: The real set and the no-op one, while a bench switches (:func:`_switch`).
        self.real: Metrics | None = None
        self.off = self.current
        self.tenant_labels = False
        self.callbacks: list[Callable[[], None]] = []


_state = _State()


def metrics() -> Metrics:
    """The runtime's metrics: the no-op set until :func:`enable_metrics`."""
    return _state.current


def metrics_enabled() -> bool:
    return _state.registry is not None


def enable_metrics(*, tenant_labels: bool = False) -> Metrics:
    """Turn the metrics on, once per process (a second call changes only whether
    tenant labels are given). Also exports the process's own (CPU, memory,
    descriptors) and Python's garbage collector, and ``proctor_build_info``."""
    with _state.lock:
        _state.tenant_labels = tenant_labels
        if _state.registry is None:
            from prometheus_client import (
                CollectorRegistry,
                Gauge,
                gc_collector,
                platform_collector,
                process_collector,
            )

            registry = CollectorRegistry()
            process_collector.ProcessCollector(registry=registry)
            platform_collector.PlatformCollector(registry=registry)
            gc_collector.GCCollector(registry=registry)
            Gauge("proctor_build_info", "The running version", ("version",),
                  registry=registry).labels(__version__).set(1)  # fmt: skip
            _state.current = _real(registry)
            _state.registry = registry
        return _state.current


def _switch(on: bool) -> None:
    """Benches: turn the metrics off (the no-op set) and on again, to compare. The
    registry and what it counted stay."""
    with _state.lock:
        if _state.registry is None:
            return  # never turned on: off already
        if _state.real is None:
            _state.real = _state.current
        _state.current = _state.real if on else _state.off


def tenant(name: str) -> str:
    """The value of a ``tenant`` label: the tenant's name if the operator turned
    tenant labels on, else empty (which Prometheus reads as no label)."""
    return name if _state.tenant_labels else ""


def tenant_labels() -> bool:
    return _state.tenant_labels


def collect_with(callback: Callable[[], None]) -> None:
    """Run ``callback`` before every scrape (a gauge read from state, not counted)."""
    with _state.lock:
        _state.callbacks.append(callback)


def _before_scrape() -> Any:
    for callback in list(_state.callbacks):
        callback()
    return _state.registry


def exposition(accept: str | None = None) -> tuple[bytes, str]:
    """The metrics as a scrape asks for them (OpenMetrics or the text format, by its
    Accept header): the body and its content type."""
    if _state.registry is None:
        enable_metrics(tenant_labels=_state.tenant_labels)
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept or "")
    return encoder(_before_scrape()), content_type


def serve_metrics(host: str, port: int) -> Callable[[], None]:
    """Serve ``/metrics`` alone on ``host:port`` (``serve --metrics-port``, for a serve
    without the API); the function that stops it."""
    from prometheus_client import start_http_server

    enable_metrics(tenant_labels=_state.tenant_labels)
    server, thread = start_http_server(port, host, registry=_CallbackRegistry())

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


class _CallbackRegistry:
    """The registry as the standalone server reads it, with the callbacks run first."""

    def collect(self) -> Any:
        return _before_scrape().collect()

    def restricted_registry(self, names: Any) -> Any:
        return _before_scrape().restricted_registry(names)
