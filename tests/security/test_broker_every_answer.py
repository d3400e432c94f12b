"""Every answer the broker socket gives has its event in the run's ledger first.

The rule is "every call recorded before it is answered": the whoami answer,
refusals of malformed requests, unknown endpoints and wrong methods, missing
or wrong tokens included. Rate-limited refusals are the one exception: they
are counted into one ``broker.rate_limited`` event per second (recording each
is the flood the limit exists to stop). If the ledger cannot record, the
answer is a refusal: 503 ``not_recorded``, whatever the answer would have been.

The endpoints are taken from the server's own dispatch table
(``proctor.broker._server.ENDPOINTS``): an endpoint added without a case here
fails ``test_every_endpoint_is_driven``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import DatasetBinding, EgressProxy, RateLimit
from proctor.broker._connectors import MAX_SQL_BODY
from proctor.broker._egress import IPAddress, UpstreamFailed
from proctor.broker._http import MAX_HEAD, MAX_HEADERS
from proctor.broker._server import ENDPOINTS
from tests.fuzz._support import Served, exchange, served_broker

pytestmark = pytest.mark.timeout(120)

TOKEN = "\x00TOKEN\x00"  # replaced by the run's token at the socket
EMAILS = ("ada@example.com", "grace@example.com")
CAPS: dict[str, Any] = {
    "datasets": {"crm": {"tables": {"customers": {"columns": ["id", "name"]}}}},
    "buckets": {"reports": "read-write"},
}


async def _no_dns(name: str, port: int) -> list[IPAddress]:
    raise UpstreamFailed(f"no resolver in this test ({name})")


def _world(tmp: Path) -> dict[str, Any]:
    db = tmp / "crm.db"
    conn = sqlite3.connect(db)
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT);"
        f"INSERT INTO customers VALUES (1, 'Ada', '{EMAILS[0]}'), (2, 'Grace', '{EMAILS[1]}');"
    )
    conn.commit()
    conn.close()
    (tmp / "buckets" / "reports").mkdir(parents=True)
    (tmp / "buckets" / "reports" / "a.txt").write_bytes(b"hello")
    (tmp / "buckets" / "inbox").mkdir()
    return {
        "datasets": {"crm": DatasetBinding("crm", "sqlite", str(db))},
        "buckets_dir": tmp / "buckets",
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("every-answer")
    proxy = EgressProxy(tmp / "ca", resolver=_no_dns, connect_timeout=1)
    with served_broker(tmp, CAPS, proxy, **_world(tmp)) as s:
        yield s


def _events(served: Served) -> list[dict[str, Any]]:
    return [json.loads(e) for e in served.ledger.entries("acme")]


STATUS = re.compile(rb"^HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")


def request(
    method: str,
    target: str,
    body: bytes = b"",
    *,
    token: str | None = TOKEN,
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: broker"]
    if token is not None:
        lines.append(f"Proctor-Token: {token}")
    lines += [f"{k}: {v}" for k, v in headers]
    if body and not any(k.lower() == "content-length" for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def sql_body(query: str, dataset: str = "crm") -> bytes:
    return json.dumps({"dataset": dataset, "sql": query}).encode()


@dataclass
class Answer:
    status: int
    body: dict[str, Any] | bytes
    events: list[dict[str, Any]]


def ask(served: Served, wire: bytes) -> Answer:
    before = len(_events(served))
    answer = exchange(served.socket, wire.replace(TOKEN.encode(), served.token.encode()))
    # The event is durable before the answer is written: no waiting here.
    new = _events(served)[before:]
    match = STATUS.match(answer)
    assert match, f"no HTTP answer to {wire[:120]!r}: {answer[:200]!r}"
    head, _, raw = answer.partition(b"\r\n\r\n")
    body: dict[str, Any] | bytes = raw
    if b"application/json" in head:
        body = json.loads(raw)
    return Answer(int(match.group(1)), body, new)


@dataclass(frozen=True)
class Case:
    wire: bytes
    status: int
    action: str
    decision: str = "deny"


# -- every endpoint of the dispatch table, answered and refused ---------------------------

ENDPOINT_CASES: dict[tuple[str, str], list[Case]] = {
    ("GET", "/v1/whoami"): [
        Case(request("GET", "/v1/whoami"), 200, "broker.whoami", "allow"),
        Case(request("GET", "/v1/whoami?x=1"), 200, "broker.whoami", "allow"),
    ],
    ("POST", "/v1/sql"): [
        Case(
            request("POST", "/v1/sql", sql_body("SELECT name FROM customers")),
            200,
            "sql.select",
            "allow",
        ),
        Case(
            request("POST", "/v1/sql", sql_body("SELECT email FROM customers")), 403, "sql.select"
        ),
        Case(request("POST", "/v1/sql", sql_body("SELECT 1", "nope")), 403, "sql.select"),
        Case(request("POST", "/v1/sql", b"{"), 400, "broker.request"),
        Case(request("POST", "/v1/sql", b"[1, 2]"), 400, "broker.request"),
        Case(request("POST", "/v1/sql", b"\xff\xfe"), 400, "broker.request"),
        Case(
            request("POST", "/v1/sql", headers=(("Content-Length", str(MAX_SQL_BODY + 1)),)),
            413,
            "broker.request",
        ),
        Case(
            request("POST", "/v1/sql", headers=(("Transfer-Encoding", "chunked"),)),
            400,
            "broker.request",
        ),
        Case(request("POST", "/v1/sql", headers=(("Content-Length", "x"),)), 400, "broker.request"),
        Case(
            request("POST", "/v1/sql", b"{}", headers=(("Content-Length", "9"),)),
            400,
            "broker.request",
        ),  # the body ends early
    ],
    ("GET", "/v1/files/"): [
        Case(request("GET", "/v1/files/reports/a.txt"), 200, "file.read", "allow"),
        Case(request("GET", "/v1/files/reports/missing.txt"), 404, "file.read"),
        Case(request("GET", "/v1/files/inbox/a.txt"), 403, "file.read"),
        Case(request("GET", "/v1/files/reports/%2e%2e/x"), 400, "file.read"),
        Case(request("GET", "/v1/files/reports"), 400, "broker.request"),
        Case(request("GET", "/v1/files/"), 400, "broker.request"),
    ],
    ("PUT", "/v1/files/"): [
        Case(request("PUT", "/v1/files/reports/b.txt", b"data"), 200, "file.write", "allow"),
        Case(request("PUT", "/v1/files/reports/.hidden", b"data"), 400, "file.write"),
        Case(request("PUT", "/v1/files/inbox/b.txt", b"data"), 403, "file.write"),
        Case(request("PUT", "/v1/files/reports", b"data"), 400, "broker.request"),
        Case(
            request(
                "PUT",
                "/v1/files/reports/c.txt",
                headers=(("Content-Length", str(64 * 1024 * 1024 + 1)),),
            ),
            413,
            "broker.request",
        ),
    ],
    ("CONNECT", "authority"): [
        Case(request("CONNECT", "example.com:443"), 403, "http.request"),
        Case(request("CONNECT", "example.com"), 400, "http.request"),
    ],
    ("*", "absolute-form"): [
        Case(request("GET", "http://example.com/x"), 403, "http.request"),
        Case(request("POST", "https://example.com/x", b"{}"), 400, "http.request"),
    ],
}

UNKNOWN_AND_WRONG_METHOD = [
    Case(request("GET", "/v1/nope"), 404, "broker.request"),
    Case(request("GET", "/"), 404, "broker.request"),
    Case(request("GET", "*"), 404, "broker.request"),
    Case(request("GET", "/v1/whoami/x"), 404, "broker.request"),
    Case(request("GET", "/v1/sqlx"), 404, "broker.request"),
    Case(request("GET", "v1/whoami"), 404, "broker.request"),
    Case(request("OPTIONS", "/v1/whoami"), 405, "broker.request"),
    Case(request("POST", "/v1/whoami", b"{}"), 405, "broker.request"),
    Case(request("GET", "/v1/sql"), 405, "broker.request"),
    Case(request("DELETE", "/v1/sql"), 405, "broker.request"),
    Case(request("DELETE", "/v1/files/reports/a.txt"), 405, "broker.request"),
    Case(request("HEAD", "/v1/files/reports/a.txt"), 405, "broker.request"),
]

token_line = b"Proctor-Token: " + TOKEN.encode() + b"\r\n"
MALFORMED = [
    Case(b"GET /v1/whoami HTTP/2\r\n" + token_line + b"\r\n", 400, "broker.request"),
    Case(b"get /v1/whoami HTTP/1.1\r\n" + token_line + b"\r\n", 400, "broker.request"),
    Case(b"GET  /v1/whoami HTTP/1.1\r\n" + token_line + b"\r\n", 400, "broker.request"),
    Case(b"GET /v1/who\x0bami HTTP/1.1\r\n" + token_line + b"\r\n", 400, "broker.request"),
    Case(b"GET /v1/whoami HTTP/1.1\r\n" + token_line + b"no colon\r\n\r\n", 400, "broker.request"),
    Case(b"GET /v1/whoami HTTP/1.1\r\n" + token_line + b"X: a\x00b\r\n\r\n", 400, "broker.request"),
    Case(
        b"GET /v1/whoami HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n",
        400,
        "broker.request",
    ),
    Case(b"GET /v1/whoami HTTP/1.1\r\nProctor-Tok", 400, "broker.request"),  # ended early
    Case(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, "broker.request"),  # a TLS hello
    Case(b"GET /" + b"a" * (MAX_HEAD + 10) + b" HTTP/1.1\r\n\r\n", 400, "broker.request"),
]

UNAUTHENTICATED = [
    Case(request("GET", "/v1/whoami", token=None), 401, "broker.auth"),
    Case(request("GET", "/v1/whoami", token=""), 401, "broker.auth"),
    Case(request("GET", "/v1/whoami", token="pt1.r1.9999999999." + "A" * 43), 401, "broker.auth"),
    Case(request("GET", "/v1/whoami", token="hello"), 401, "broker.auth"),
    Case(
        request("POST", "/v1/sql", sql_body("SELECT name FROM customers"), token="x"),
        401,
        "broker.auth",
    ),
    Case(request("GET", "/v1/nope", token=None), 401, "broker.auth"),
    Case(request("CONNECT", "example.com:443", token=None), 401, "broker.auth"),
]


def _all_cases() -> list[Case]:
    out = [c for cases in ENDPOINT_CASES.values() for c in cases]
    return out + UNKNOWN_AND_WRONG_METHOD + MALFORMED + UNAUTHENTICATED


def test_every_endpoint_is_driven() -> None:
    """A new endpoint in the dispatch table needs its cases here."""
    assert {(e.method, e.path) for e in ENDPOINTS} == set(ENDPOINT_CASES)
    for key, cases in ENDPOINT_CASES.items():
        # The proxy's successes need an upstream: tests/integration/test_broker_proxy.py.
        assert any(c.status == 200 for c in cases) or key[0] in ("CONNECT", "*"), key


def _case_id(case: Case) -> str:
    return f"{case.status}-{case.action}-" + case.wire[:40].decode("latin-1").split("\r\n")[0]


@pytest.mark.parametrize("case", _all_cases(), ids=_case_id)
def test_each_answer_has_exactly_its_event(served: Served, case: Case) -> None:
    answer = ask(served, case.wire)
    assert answer.status == case.status, answer.body
    assert len(answer.events) == 1, [e["action"] for e in answer.events]
    (ev,) = answer.events
    assert ev["action"] == case.action
    assert ev["decision"] == case.decision
    assert ev["run"] == "r1" and ev["deployment"] == "churn"
    if case.action.startswith("broker."):
        assert ev["resource"] == "run/r1"
    if case.action == "broker.request":
        assert ev["details"]["status"] == case.status
        assert isinstance(answer.body, dict)
        assert ev["details"]["error"] == answer.body["error"]
        assert ev["reason"].startswith("refused: ")
    if case.status >= 400:
        assert isinstance(answer.body, dict)
        keys = {"error", "message", "policies"}
        if ev["decision"] == "deny" and case.status != 401:
            # A refusal names its event (docs/broker.md, "A refusal names its event").
            keys |= {"seq", "reason"}
            assert (answer.body["seq"], answer.body["reason"]) == (ev["seq"], ev["reason"])
        assert set(answer.body) == keys


def test_whoami_event_names_the_run_and_the_answer_matches(served: Served) -> None:
    answer = ask(served, request("GET", "/v1/whoami"))
    assert isinstance(answer.body, dict)
    assert answer.body["run"] == "r1" and answer.body["tenant"] == "acme"
    (ev,) = answer.events
    assert ev["action"] == "broker.whoami" and ev["decision"] == "allow"
    assert ev["policies"] == ["proctor:broker:whoami"]
    assert ev["actor"]["id"] == served.scope.workload


def test_an_empty_connection_is_neither_answered_nor_recorded(served: Served) -> None:
    before = len(_events(served))
    assert exchange(served.socket, b"") == b""
    assert len(_events(served)) == before


def test_guest_text_in_a_refused_request_stays_out_of_the_ledger(served: Served) -> None:
    """An unknown path or a bad header carries the guest's bytes; the event keeps a
    keyed hash of the target, never the text (it could be a row value)."""
    for wire in (
        request("GET", f"/v1/{EMAILS[0]}"),
        request("POST", f"/v1/whoami/{EMAILS[1]}"),
        request("GET", f"/v1/{EMAILS[0]}", token=None),
    ):
        answer = ask(served, wire)
        assert answer.status in (401, 404, 405)
        (ev,) = answer.events
        for email in EMAILS:
            assert email not in json.dumps(ev)
    (ev,) = ask(served, request("GET", f"/v1/{EMAILS[0]}")).events
    assert ev["details"]["target_hmac"] == served.scope.key_hmacs([f"/v1/{EMAILS[0]}"])[0]


# -- fail closed, and counted ------------------------------------------------------------


@pytest.fixture
def unrecordable(tmp_path: Path) -> Iterator[Served]:
    proxy = EgressProxy(tmp_path / "ca", resolver=_no_dns, connect_timeout=1)
    with served_broker(tmp_path, CAPS, proxy, **_world(tmp_path)) as s:
        s.ledger.close()
        yield s


@pytest.mark.parametrize(
    "wire",
    [
        request("GET", "/v1/whoami"),
        request("GET", "/v1/nope"),
        request("DELETE", "/v1/sql"),
        request("POST", "/v1/sql", b"{"),
        request("POST", "/v1/sql", sql_body("SELECT name FROM customers")),
        request("GET", "/v1/files/reports/a.txt"),
        request("GET", "/v1/whoami", token=None),
        b"get /v1/whoami HTTP/1.1\r\n\r\n",
    ],
    ids=lambda w: w.split(b"\r\n")[0].decode(),
)
def test_an_answer_that_cannot_be_recorded_is_a_refusal(unrecordable: Served, wire: bytes) -> None:
    answer = exchange(
        unrecordable.socket, wire.replace(TOKEN.encode(), unrecordable.token.encode())
    )
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"] == "not_recorded"
    assert b"hello" not in answer and b"acme" not in answer


def test_malformed_requests_are_charged_and_counted_past_the_limit(tmp_path: Path) -> None:
    """A malformed request costs the run a call like any other; past the limit the
    refusal is counted into one broker.rate_limited event, not recorded one by one."""
    proxy = EgressProxy(tmp_path / "ca", resolver=_no_dns, connect_timeout=1)
    # A refill this slow gives nothing back during the test: exactly two calls pass.
    limit = RateLimit(per_second=0.0001, burst=2)
    with served_broker(tmp_path, CAPS, proxy, rate_limit=limit, **_world(tmp_path)) as s:
        bad = b"get / HTTP/1.1\r\n\r\n"
        statuses = []
        for _ in range(5):
            answer = exchange(s.socket, bad)
            statuses.append(int(answer[9:12]))
        assert statuses == [400, 400, 429, 429, 429]
        s.broker.close_run("r1")
        actions = [e["action"] for e in _events(s)]
        assert actions.count("broker.request") == 2
        (counted,) = [e for e in _events(s) if e["action"] == "broker.rate_limited"]
        assert counted["details"]["refused"] == 3
