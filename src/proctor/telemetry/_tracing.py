"""The runtime's OpenTelemetry traces: off unless an OTLP endpoint is set.

Turned on by the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` keeps it
off; ``OTEL_SERVICE_NAME``, headers, timeouts and the rest as the SDK reads
them), exported over OTLP/HTTP in protobuf by a batch processor, so a span's
end costs a queue append, not a request. The SDK is imported only then.

A span tree: the API request (joining a W3C ``traceparent`` the caller sent),
the run it started, each call of the run, each call's stages. The run's span
context is kept here by run id, because the call's span is made in the
broker, which knows the run only by its id.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from proctor import __version__


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.provider: Any = None
        self.runs: dict[str, Any] = {}


_state = _State()


def _wanted(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def configure_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on if the environment asks for it (see the module); whether it is on."""
    environ = os.environ if environ is None else environ
    with _state.lock:
        if _state.provider is not None:
            return True
        if not _wanted(environ):
            return False
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "proctor"),
                                    "service.version": __version__})  # fmt: skip
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _state.provider = provider
        return True


def tracing_enabled() -> bool:
    return _state.provider is not None


def tracer() -> Any:
    """The runtime's tracer (an ``opentelemetry.trace.Tracer``); only while tracing is on."""
    if _state.provider is None:
        raise RuntimeError("tracing is off")
    return _state.provider.get_tracer("proctor", __version__)


def shutdown_tracing() -> None:
    """Export what is queued and stop (``serve``'s end)."""
    with _state.lock:
        provider, _state.provider = _state.provider, None
    if provider is not None:
        provider.shutdown()


def extract_context(headers: Mapping[str, str]) -> Any:
    """The trace context a caller sent (W3C ``traceparent``/``tracestate``), or None."""
    if _state.provider is None or "traceparent" not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier=dict(headers))


def bind_run(run_id: str, context: Any) -> None:
    """Keep ``context`` (an OpenTelemetry Context holding the run's span) for the run's calls."""
    if context is not None:
        with _state.lock:
            _state.runs[run_id] = context


def run_context(run_id: str) -> Any:
    """The context of the run's span, or None (tracing off, or the run not traced)."""
    return _state.runs.get(run_id)


def unbind_run(run_id: str) -> None:
    with _state.lock:
        _state.runs.pop(run_id, None)


def _use_exporter(exporter: Any) -> Any:
    """Tests: trace into ``exporter`` (e.g. the SDK's ``InMemorySpanExporter``), each
    span as it ends, instead of OTLP; :func:`shutdown_tracing` ends it. The provider."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _state.lock:
        if _state.provider is not None:
            raise RuntimeError("tracing is already on")
        _state.provider = provider
    return provider
