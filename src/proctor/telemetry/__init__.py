"""What the runtime tells the person who operates it: Prometheus metrics and
OpenTelemetry traces (docs/operations.md).

Both are off until ``proctor serve`` (or a test) turns them on, and cost an
attribute lookup and a no-op call until then: a CLI command imports neither
``prometheus_client`` nor the OpenTelemetry SDK.

- Metrics: :func:`metrics` is the one set of the runtime's metrics (the no-op
  set until :func:`enable_metrics`); :func:`exposition` renders them for a
  scrape; :func:`tenant` is the value of a ``tenant`` label (empty, which
  Prometheus reads as no label, unless the operator turned tenant labels on).
- Traces: :func:`configure_tracing` reads the standard ``OTEL_*`` variables and
  turns tracing on when an OTLP endpoint is set; :func:`tracer` gives the
  runtime's tracer; a run's span context is kept by run id
  (:func:`bind_run`, :func:`run_context`) so a call's span joins its run's.
"""

from proctor.telemetry._metrics import (
    Metrics,
    collect_with,
    enable_metrics,
    exposition,
    metrics,
    metrics_enabled,
    serve_metrics,
    tenant,
    tenant_labels,
)
from proctor.telemetry._tracing import (
    bind_run,
    configure_tracing,
    extract_context,
    run_context,
    shutdown_tracing,
    tracer,
    tracing_enabled,
    unbind_run,
)

__all__ = [
    "Metrics",
    "bind_run",
    "collect_with",
    "configure_tracing",
    "enable_metrics",
    "exposition",
    "extract_context",
    "metrics",
    "metrics_enabled",
    "run_context",
    "serve_metrics",
    "shutdown_tracing",
    "tenant",
    "tenant_labels",
    "tracer",
    "tracing_enabled",
    "unbind_run",
]
