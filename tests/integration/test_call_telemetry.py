"""What the operator is told about calls and the ledger: Prometheus metrics and trace
spans, read back against what the ledger holds.

A real broker (its Unix socket, the egress proxy, a real ledger on SQLite and on
PostgreSQL) and a real HTTP upstream on loopback; the guest's side is a raw socket.
The metrics are read as a scrape reads them (``telemetry.exposition()``, parsed
by prometheus_client's own parser), the spans from the SDK's in-memory exporter.
Counters are process-wide, so each test compares before and after.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace as otel
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from proctor import telemetry
from proctor.broker import Broker, EgressProxy, Handlers
from proctor.errors import LedgerError
from proctor.guest.protocol import TOKEN_HEADER
from proctor.policy import capability_policies, compile_policies
from proctor.telemetry import _tracing
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.integration.test_broker_proxy import (
    PLACEHOLDER,
    SECRET_VALUE,
    Env,
    _binding,
    proxy_env,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape() -> Samples:
    body, _ = telemetry.exposition()
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def metrics_on() -> Iterator[None]:
    was = telemetry.tenant_labels()
    telemetry.enable_metrics(tenant_labels=True)
    yield
    telemetry.enable_metrics(tenant_labels=was)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    _tracing._use_exporter(exporter)
    yield exporter
    telemetry.shutdown_tracing()


class _Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = f"got {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Up)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _ask(path: str, request: bytes) -> bytes:
    """One call on its own connection; everything the broker answered."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


# Secrets the guest's calls carry: none may reach a label or a span.
QUERY_SECRET = "q-7c1e9b2d4f6a8c0e"
HEADER_SECRET = "h-5a3f1d9e7b2c4a6e"


def _calls(broker: Broker, channel: Any, entry: str) -> list[bytes]:
    sock, token = str(channel.socket), channel.token
    auth = f"{TOKEN_HEADER}: {token}\r\n"
    base = f"http://{entry}"
    return [
        _ask(sock, f"GET {base}/ok?token={QUERY_SECRET} HTTP/1.1\r\nHost: {entry}\r\n{auth}"
                   f"Authorization: Bearer {HEADER_SECRET}\r\nConnection: close\r\n\r\n".encode()),
        _ask(sock, f"GET {base}/ok HTTP/1.1\r\nHost: {entry}\r\n{auth}"
                   "Connection: close\r\n\r\n".encode()),
        _ask(sock, f"GET {base}/admin HTTP/1.1\r\nHost: {entry}\r\n{auth}"
                   "Connection: close\r\n\r\n".encode()),
        _ask(sock, f"GET /v1/whoami HTTP/1.1\r\n{auth}Connection: close\r\n\r\n".encode()),
        # Refused before its kind is found: a forged token, and no such endpoint.
        _ask(sock, f"GET /v1/whoami HTTP/1.1\r\n{TOKEN_HEADER}: pt1.t1.x.y\r\n\r\n".encode()),
        _ask(sock, f"GET /v1/nothing?{QUERY_SECRET} HTTP/1.1\r\n{auth}\r\n".encode()),
    ]  # fmt: skip


def _children(all_spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    own = parent.get_span_context().span_id
    kids = [s for s in all_spans if s.parent is not None and s.parent.span_id == own]
    return sorted(kids, key=lambda s: s.start_time or 0)


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "not seen within 10 s"
        time.sleep(0.02)


def test_calls_are_counted_by_kind_and_decision_and_traced_to_their_ledger_event(
    ledger_env: LedgerEnv, upstream: int, metrics_on: None, spans: InMemorySpanExporter
) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger, "t1", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(
        capability_policies("acme", "churn", {"egress": [entry]})
        + '\n@id("no-admin")\nforbid(principal, action, resource) when '
        '{ context has path && context.path == "/admin" };'
    )
    run_span = telemetry.tracer().start_span("proctor.run")
    telemetry.bind_run("t1", otel.set_span_in_context(run_span))
    before = _scrape()
    size_before = ledger.head("acme").size
    proxy = EgressProxy(None, connect_timeout=5)
    try:
        with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
            channel = broker.open_run(scope, ttl=60)
            try:
                answers = _calls(broker, channel, entry)
                # A connection held open shows in the gauge while it is open.
                with socket.socket(socket.AF_UNIX) as held:
                    held.connect(str(channel.socket))
                    _wait_for(lambda: _delta(before, _scrape(), "proctor_broker_connections") == 1)
                _wait_for(lambda: _delta(before, _scrape(), "proctor_broker_connections") == 0)
            finally:
                broker.close_run("t1")
            traces = [t for t in broker.traces if t.run_id == "t1"]
    finally:
        telemetry.unbind_run("t1")
        run_span.end()
    ledger.flush()  # the completion records are queued behind their answers
    after = _scrape()
    statuses = [a.split(b"\r\n", 1)[0].split(b" ")[1] for a in answers]
    assert statuses == [b"200", b"200", b"403", b"200", b"401", b"404"]

    # -- metrics: exact counts per kind and decision ----------------------------
    def calls(kind: str, decision: str) -> float:
        return _delta(before, after, "proctor_calls_total", kind=kind, decision=decision,
                      tenant="acme")  # fmt: skip

    assert calls("egress.forward", "allow") == 2
    assert calls("egress.forward", "deny") == 1
    assert calls("whoami", "allow") == 1
    assert calls("unknown", "deny") == 2
    assert calls("whoami", "deny") == 0
    count = "proctor_call_duration_seconds_count"
    assert _delta(before, after, count, kind="egress.forward") == 3
    assert _delta(before, after, count, kind="unknown") == 2
    assert _delta(before, after, "proctor_decision_duration_seconds_count",
                  kind="egress.forward") == 3  # fmt: skip
    # What the ledger grew by is what it counted as appended, no more, no less.
    grown = ledger.head("acme").size - size_before
    assert grown > 0
    assert _delta(before, after, "proctor_ledger_appends_total", tenant="acme") == grown
    assert _delta(before, after, "proctor_ledger_batch_events_count") >= 1
    assert _delta(before, after, "proctor_ledger_batch_events_sum") >= grown
    assert _delta(before, after, "proctor_ledger_fsync_duration_seconds_count") >= 1

    # -- spans: one per call, under the run's, stages in order -------------------
    finished = spans.get_finished_spans()
    call_spans = [s for s in finished if s.name.startswith("proctor.call ")]
    assert [s.name for s in call_spans] == [
        "proctor.call egress.forward", "proctor.call egress.forward",
        "proctor.call egress.forward", "proctor.call whoami",
        "proctor.call unknown", "proctor.call unknown",
    ]  # fmt: skip
    run_context = run_span.get_span_context()
    for span in call_spans:
        assert span.parent is not None and span.parent.span_id == run_context.span_id
        assert span.get_span_context().trace_id == run_context.trace_id
        assert span.kind == otel.SpanKind.INTERNAL
    # The calls whose kind was found are the broker's traces, stage for stage.
    known = [s for s in call_spans if s.name != "proctor.call unknown"]
    assert len(traces) == len(known) == 4
    for span, kept in zip(known, traces, strict=True):
        stages = _children(list(finished), span)
        assert [c.name for c in stages] == [f"proctor.stage {s}" for s in kept.stages]
        assert stages[0].start_time >= span.start_time  # type: ignore[operator]
        assert stages[-1].end_time <= span.end_time  # type: ignore[operator]
        for a, b in itertools.pairwise(stages):
            assert a.end_time == b.start_time
    assert traces[0].stages == ("admit", "parse", "decide", "record", "act", "complete",
                                "answer")  # fmt: skip
    # Each call span names the event the ledger holds for that call: read back.
    events = {e["seq"]: e for e in (json.loads(b) for b in ledger.entries("acme"))}
    named = []
    for span in call_spans:
        attrs = span.attributes or {}
        assert attrs["proctor.run"] == "t1" and attrs["proctor.ledger.log"] == "acme"
        event = events[attrs["proctor.ledger.seq"]]
        assert event["run"] == "t1"
        assert event["decision"] == attrs["proctor.decision"]
        named.append(event["action"])
    assert named == ["http.request", "http.request", "http.request", "broker.whoami",
                     "broker.auth", "broker.request"]  # fmt: skip
    # ... and every decision event of the run is named by exactly one call span.
    decisions = {s for s, e in events.items() if e.get("run") == "t1"
                 and e["action"] != "http.request.end"}  # fmt: skip
    assert decisions == {(s.attributes or {})["proctor.ledger.seq"] for s in call_spans}

    # -- nothing the guest sent is in a label or an attribute -------------------
    text = telemetry.exposition()[0].decode()
    said = " ".join(
        [s.name for s in finished]
        + [str(v) for s in finished for v in (s.attributes or {}).values()]
    )
    for secret in (QUERY_SECRET, HEADER_SECRET, channel.token, "/ok", "/admin", "/v1/nothing"):
        assert secret not in text
        assert secret not in said


def test_a_refusal_over_the_rate_is_counted_as_a_broker_rate_limit(
    ledger_env: LedgerEnv, metrics_on: None
) -> None:
    from proctor.broker import RateLimit

    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "t2", rate_limit=RateLimit(per_second=0.001, burst=1))
    before = _scrape()
    with Broker(Handlers(connect=_never, forward=_never), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=60)
        try:
            ask = f"GET /v1/whoami HTTP/1.1\r\n{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode()
            first = _ask(str(channel.socket), ask)
            second = _ask(str(channel.socket), ask)
        finally:
            broker.close_run("t2")
    after = _scrape()
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 429")
    limited = "proctor_rate_limit_refusals_total"
    assert _delta(before, after, limited, surface="broker", reason="rate", tenant="acme") == 1
    assert _delta(before, after, "proctor_calls_total", kind="unknown", decision="deny",
                  tenant="acme") == 1  # fmt: skip
    assert _delta(before, after, "proctor_calls_total", kind="whoami", decision="allow",
                  tenant="acme") == 1  # fmt: skip


async def _never(*args: Any) -> Any:
    raise AssertionError("this test makes no data-plane call")


def test_a_batch_the_ledger_cannot_commit_is_counted_and_counts_no_append(
    ledger_env: LedgerEnv, metrics_on: None
) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))
    before = _scrape()

    def fence(conn: Any) -> None:
        raise LedgerError("this node lost its lease")

    ledger.set_fence(fence)
    with pytest.raises(LedgerError):
        ledger.append("acme", draft(1))
    ledger.set_fence(None)
    ledger.append("acme", draft(2))
    ledger.flush()  # a batch is counted once its waiters are woken
    after = _scrape()
    assert _delta(before, after, "proctor_ledger_write_failures_total") == 1
    assert _delta(before, after, "proctor_ledger_appends_total", tenant="acme") == 1
    assert ledger.head("acme").size == 2


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


def test_an_injected_secret_reaches_no_label_and_no_span(
    env: Env, metrics_on: None, spans: InMemorySpanExporter
) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    before = _scrape()
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca("acme").ca_pem().decode())
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel("api.test", env.api.port)
    conn.request(
        "GET", f"/one?key={QUERY_SECRET}", headers={"Authorization": f"Bearer {PLACEHOLDER}"}
    )
    assert conn.getresponse().read()
    conn.close()
    # The placeholder where it may not go (plain HTTP): refused, and recorded.
    status, _, _ = env.raw(
        f"GET http://api.test:{env.api.port}/two HTTP/1.1\r\nX-Key: {PLACEHOLDER}\r\n\r\n".encode()
    )
    assert status == 403
    events = env.events()
    assert env.api.seen[0]["headers"]["Authorization"] == f"Bearer {SECRET_VALUE}"
    after = _scrape()
    assert _delta(before, after, "proctor_calls_total", kind="egress.connect", decision="allow",
                  tenant="acme") == 1  # fmt: skip
    assert _delta(before, after, "proctor_calls_total", kind="egress.forward", decision="deny",
                  tenant="acme") == 1  # fmt: skip
    finished = spans.get_finished_spans()
    call_spans = [s for s in finished if s.name.startswith("proctor.call ")]
    assert len(call_spans) == 2
    seqs = [(s.attributes or {})["proctor.ledger.seq"] for s in call_spans]
    assert seqs == [e["seq"] for e in events if e["action"] != "http.request.end"]
    text = telemetry.exposition()[0].decode()
    said = " ".join(
        [s.name for s in finished]
        + [str(v) for s in finished for v in (s.attributes or {}).values()]
    )
    for secret in (SECRET_VALUE, PLACEHOLDER, QUERY_SECRET, "/one", "/two"):
        assert secret not in text
        assert secret not in said


def test_the_run_bound_and_a_connection_over_the_run_s_bound_are_counted(
    ledger_env: LedgerEnv, metrics_on: None
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "t3", call_bound=1)
    before = _scrape()
    broker = Broker(Handlers(connect=_never, forward=_never), os.urandom(32),
                    max_connections_per_run=1)  # fmt: skip
    with broker:
        channel = broker.open_run(scope, ttl=60)
        try:
            ask = f"GET /v1/whoami HTTP/1.1\r\n{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode()
            first = _ask(str(channel.socket), ask)
            second = _ask(str(channel.socket), ask)
            # One connection held: the run's bound is one, so the next is closed unread.
            with socket.socket(socket.AF_UNIX) as held:
                held.connect(str(channel.socket))
                _wait_for(lambda: _delta(before, _scrape(), "proctor_broker_connections") == 1)
                with socket.socket(socket.AF_UNIX) as over:
                    over.settimeout(10)
                    over.connect(str(channel.socket))
                    assert over.recv(1) == b""
        finally:
            broker.close_run("t3")
    after = _scrape()
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 403")
    limited = "proctor_rate_limit_refusals_total"
    assert _delta(before, after, limited, surface="broker", reason="calls", tenant="acme") == 1
    assert _delta(before, after, limited, surface="broker", reason="rate", tenant="acme") == 0
    refused = "proctor_broker_connections_refused_total"
    assert _delta(before, after, refused, reason="over_run") == 1
    assert _delta(before, after, "proctor_calls_total", kind="unknown", decision="deny",
                  tenant="acme") == 1  # fmt: skip
