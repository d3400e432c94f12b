"""Issue 34: one run's trace, as a real OTLP/HTTP receiver gets it from a real
``proctor serve`` (the SDK's exporter, the protobuf payload decoded with
``opentelemetry-proto``).

The run is started through the API with a W3C ``traceparent``: the request's span
is the caller's span's child, in the caller's trace; the run's span is the
request's child (the run starts in a thread of its own); each call of the run is a
child of the run's span and names the seq of its decision event in the tenant's log,
which is the ledger's event of that call; each stage the call passed is a child of
the call's span. No query string, token or secret reaches an attribute.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import PROCTOR, wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = [pytest.mark.sandbox, pytest.mark.host]
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]
SERVER, INTERNAL = 2, 1  # Span.SpanKind
QUERY = "note=q-" + secrets.token_hex(6)

JOB = """
import json, proctor_guest
res = {"sql": proctor_guest.sql("fake", "SELECT id FROM customers WHERE id <= 3")["row_count"]}
res["write"] = proctor_guest.write("reports", "t.txt", b"traced")["bytes"]
try:
    proctor_guest.write("other", "x", b"x")
    res["refused"] = "ALLOWED"
except proctor_guest.GuestError:
    res["refused"] = "denied"
print(json.dumps(res), flush=True)
"""
CAPS = """
[datasets.fake.tables.customers]
columns = ["id", "country"]
access = "read"
[buckets]
reports = "read-write"
"""


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


class _Receiver(BaseHTTPRequestHandler):
    """OTLP/HTTP in protobuf: what a collector accepts at /v1/traces."""

    spans: list[Span]
    bodies: list[bytes]

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == (
            "application/x-protobuf"
        )
        if ok:
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            self.bodies.append(body)
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(
                            s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                            s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        ))  # fmt: skip
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Traced:
    gov: Gov
    spans: list[Span]
    bodies: list[bytes]
    trace_id: str
    parent_id: str
    run: dict[str, Any]
    stdout: dict[str, Any]
    log: Path


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    tmp = tmp_path_factory.mktemp("otlp")
    gov = build_gov(tmp)
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir("traced", JOB, CAPS))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "traced",
                          environment="sandbox", instruction="traced", actor=gov.op)  # fmt: skip

    class Handler(_Receiver):  # this module's receiver, its own lists
        spans: list[Span] = []  # noqa: RUF012
        bodies: list[bytes] = []  # noqa: RUF012

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    port = _free_port()
    env = dict(os.environ, PROCTOR_HOME=str(gov.home),
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_address[1]}",
               OTEL_BSP_SCHEDULE_DELAY="100", OTEL_SERVICE_NAME="proctor-under-test")  # fmt: skip
    log = tmp / "serve.stderr"
    with log.open("wb") as err, (tmp / "serve.stdout").open("wb") as out_file:
        serve = subprocess.Popen([PROCTOR, "serve", "--backend", BACKEND, "--api-port", str(port)],
                                 env=env, stdout=out_file, stderr=err)  # fmt: skip
    try:
        api = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{api}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return serve.poll() is not None

        wait_until(up, "serve's API")
        assert serve.poll() is None, log.read_text()
        trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
        headers = {"Authorization": f"Bearer {gov.token('dev')}",
                   "traceparent": f"00-{trace_id}-{parent_id}-01"}  # fmt: skip
        with httpx.stream("POST", f"{api}/tenants/acme/deployments/traced/runs?{QUERY}",
                          headers=headers, timeout=120) as resp:  # fmt: skip
            assert resp.status_code == 200, resp.read()
            lines = [json.loads(line) for line in resp.iter_lines() if line]
        run = lines[-1].get("run")
        assert run is not None and run["status"] == "succeeded", (lines, log.read_text())
        out = "".join(d["data"] for d in lines if d.get("stream") == "stdout")
        # serve's end exports what is still queued (shutdown_tracing).
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
        assert serve.returncode == 0, log.read_text()
        yield Traced(gov, Handler.spans, Handler.bodies, trace_id, parent_id, run,
                     json.loads(out.splitlines()[0]), log)  # fmt: skip
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
        receiver.shutdown()
        receiver.server_close()
        rt.close()


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent == parent.span_id and s.trace_id == parent.trace_id]


def test_the_request_the_run_its_calls_and_their_stages_are_one_tree(traced: Traced) -> None:
    t = traced
    assert t.stdout == {"sql": 3, "write": 6, "refused": "denied"}
    mine = [s for s in t.spans if s.trace_id == t.trace_id]
    # The request's span: the caller's span's child, named by the route's template.
    requests = [s for s in mine if s.parent == t.parent_id]
    assert len(requests) == 1, requests
    request = requests[0]
    route = "/tenants/{tenant}/deployments/{name}/runs"
    assert request.name == f"POST {route}" and request.kind == SERVER
    assert request.attributes == {
        "http.request.method": "POST", "http.route": route, "http.response.status_code": 200,
        "url.path": "/tenants/acme/deployments/traced/runs",
    }  # fmt: skip
    # The run's span, the request's child though the run ran in a thread of its own.
    (run,) = _children(mine, request)
    assert run.name == "proctor.run" and run.kind == INTERNAL
    assert run.attributes == {
        "proctor.tenant": "acme", "proctor.deployment": "traced", "proctor.run": t.run["id"],
        "proctor.artifact.digest": t.run["digest"], "proctor.environment": "sandbox",
        "proctor.backend": BACKEND, "proctor.outcome": "succeeded",
    }  # fmt: skip
    assert request.start <= run.start <= run.end <= request.end
    calls = _children(mine, run)
    assert sorted((c.name, c.attributes["proctor.decision"]) for c in calls) == [
        ("proctor.call file.write", "allow"), ("proctor.call file.write", "deny"),
        ("proctor.call sql", "allow"),
    ]  # fmt: skip
    for call in calls:
        stages = _children(mine, call)
        assert stages and all(s.name.startswith("proctor.stage ") for s in stages), call
        names = [
            s.name.removeprefix("proctor.stage ") for s in sorted(stages, key=lambda s: s.start)
        ]
        assert names[0] == "admit" and names[-1] == "answer" and "decide" in names, names
        assert all(call.start <= s.start <= s.end <= call.end for s in stages)
        assert not _children(mine, stages[0])
    # Nothing but the tree: no other span joined the caller's trace.
    assert len(mine) == 2 + len(calls) + sum(len(_children(mine, c)) for c in calls)


def test_each_call_span_names_its_own_event_in_the_ledger(traced: Traced) -> None:
    t = traced
    calls = [s for s in t.spans if s.name.startswith("proctor.call ")
             and s.attributes.get("proctor.run") == t.run["id"]]  # fmt: skip
    assert len(calls) == 3
    events = {json.loads(e)["seq"]: json.loads(e) for e in t.gov.rt.ledger.entries("acme")}
    kinds = {"sql": "sql.select", "file.write": "file.write"}
    for call in calls:
        a = call.attributes
        assert a["proctor.ledger.log"] == "acme"
        event = events[a["proctor.ledger.seq"]]
        # That seq is this call's own decision event: same run, action and decision.
        assert event["run"] == t.run["id"]
        assert event["action"] == kinds[a["proctor.call.kind"]]
        assert event["decision"] == a["proctor.decision"]
    assert len({c.attributes["proctor.ledger.seq"] for c in calls}) == 3


def test_no_query_string_token_or_header_value_reaches_the_collector(traced: Traced) -> None:
    t = traced
    payload = b"".join(t.bodies)
    assert payload
    for secret in (QUERY.split("=")[1], t.gov.token("dev"), "Bearer", "traceparent"):
        assert secret.encode() not in payload, secret
    for span in t.spans:
        for value in span.attributes.values():
            assert "?" not in str(value), (span.name, value)


def test_serves_log_lines_of_the_request_and_its_run_name_the_trace(traced: Traced) -> None:
    t = traced
    lines = [json.loads(line) for line in t.log.read_text().splitlines() if line.startswith("{")]
    request = [d for d in lines if d["event"] == "api.request" and d.get("method") == "POST"]
    assert [d.get("trace_id") for d in request] == [t.trace_id]
    # The run's lines, written in the run's thread, carry the request's trace too.
    run = [d for d in lines if d.get("run") == t.run["id"]]
    assert {d["event"] for d in run} >= {"run.start", "run.end"}
    assert {d.get("trace_id") for d in run} == {t.trace_id}
    # A probe is not traced: its line names no trace.
    assert all("trace_id" not in d for d in lines if d.get("path") == "/healthz")
    # serve says that it traces, and not where to (a URL may carry credentials).
    said = (t.log.parent / "serve.stdout").read_text()
    assert (
        "traces exported over OTLP/HTTP" in said and "127.0.0.1:" not in said.split("HTTP API")[0]
    )
