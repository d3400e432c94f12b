"""The API's request spans, in this process (the SDK's in-memory exporter): named by
the route's template, the child of a caller's W3C ``traceparent`` (a new trace
without one, or with one that is malformed), with the chosen attributes only: no
query string, no header, no token. Probes and scrapes are not traced."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proctor import telemetry
from proctor.telemetry._tracing import _use_exporter
from tests.conftest import wait_until
from tests.integration.test_api_support import ApiEnv, build_env


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[ApiEnv, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    _use_exporter(exporter)
    env = build_env(tmp_path)
    try:
        yield env, exporter
    finally:
        env.server.stop()
        env.rt.close()
        telemetry.shutdown_tracing()


def _server_spans(exporter: InMemorySpanExporter, count: int) -> list[Any]:
    """The request spans, once ``count`` have ended (a span ends after its response's
    last byte is sent: the client may read it first)."""

    def ended() -> list[Any]:
        spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        return spans if len(spans) >= count else []

    return list(wait_until(ended, f"{count} request spans"))


def test_a_request_span_joins_the_callers_trace_with_no_query_or_header(
    traced: tuple[ApiEnv, InMemorySpanExporter],
) -> None:
    env, exporter = traced
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    query = "q-" + secrets.token_hex(6)
    with env.http("acme", "root") as http:
        got = http.get(f"/tenants/acme/runs?deployment={query}",
                       headers={"traceparent": f"00-{trace_id}-{parent}-01"})  # fmt: skip
        assert got.status_code == 200
        assert http.get("/healthz").status_code == 200  # a probe: no span
    (span,) = _server_spans(exporter, 1)
    assert span.name == "GET /tenants/{tenant}/runs"
    assert f"{span.context.trace_id:032x}" == trace_id
    assert span.parent is not None and f"{span.parent.span_id:016x}" == parent
    assert dict(span.attributes) == {
        "http.request.method": "GET", "http.route": "/tenants/{tenant}/runs",
        "http.response.status_code": 200, "url.path": "/tenants/acme/runs",
    }  # fmt: skip
    shown = repr(dict(span.attributes)) + span.name
    for leak in (query, env.token("acme", "root"), "?"):
        assert leak not in shown


def test_without_a_valid_traceparent_a_request_starts_a_trace_of_its_own(
    traced: tuple[ApiEnv, InMemorySpanExporter],
) -> None:
    env, exporter = traced
    with httpx.Client(base_url=env.url, timeout=30) as http:
        assert http.get("/key").status_code == 200
        assert http.get("/key", headers={"traceparent": "00-zz-not-a-trace-01"}).status_code == 200
        assert http.get("/no/such/route").status_code == 404
    spans = _server_spans(exporter, 3)
    assert [s.name for s in spans] == ["GET /key", "GET /key", "GET"]
    assert all(s.parent is None for s in spans)
    assert len({s.context.trace_id for s in spans}) == 3
    # A route that matched nothing is named by its method only, its path an attribute.
    assert "http.route" not in spans[2].attributes
    assert spans[2].attributes["http.response.status_code"] == 404
