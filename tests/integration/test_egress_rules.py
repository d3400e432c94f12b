"""Request rules of an egress host, enforced for real: a real HTTPS upstream on
127.0.0.1 whose TLS the broker ends with the tenant CA because its egress entry has
rules (no secret bound), ordinary clients (http.client, urllib) through the proxy,
and the ledger read back. Each test tries what the rules forbid and checks that the
upstream never saw it, the guest was refused naming the rule, and the refusal is on
record with the rule.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import ssl
import threading
import urllib.error
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import RunScope
from proctor.policy import EgressRule, capability_policies, compile_policies
from tests.conftest import LedgerEnv
from tests.integration.test_broker_proxy import TENANT, WORKLOAD, Env, proxy_env


class _Api(BaseHTTPRequestHandler):
    """A CRM's REST API: customers (small, large, chunked), and whatever else is asked."""

    protocol_version = "HTTP/1.1"
    server: ApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        with self.server.lock:
            self.server.seen.append((self.command, self.path, body))
        size = int(self.path.split("n=", 1)[1]) if "n=" in self.path else 0
        if self.path.startswith("/v1/customers/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(size // 500):
                self.wfile.write(b"1f4\r\n" + b"c" * 500 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        out = b"x" * size if size else json.dumps({"path": self.path, "got": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Api)
        self.tls = tls
        self.seen: list[tuple[str, str, bytes]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


@pytest.fixture
def crm(env: Env) -> Iterator[ApiServer]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(env.ca.issue(["api.test"], env.tmp / "crm.pem"))
    server = ApiServer(ctx)
    yield server
    server.shutdown()
    server.server_close()


def _scope(env: Env, entry: str, rules: dict[str, Any], policy_extra: str = "") -> RunScope:
    caps = {"egress": [entry], "egress_rules": {entry: rules}}
    scope = RunScope(
        tenant=TENANT,
        run_id="r1",
        workload=WORKLOAD,
        deployment="churn",
        artifact=None,
        approvals=(),
        environment="sandbox",
        policies=compile_policies(capability_policies(TENANT, "churn", caps) + policy_extra),
        ledger=env.ledger_env.ledger,
        allowed_ranges=("127.0.0.0/8",),
        egress_rules={entry: EgressRule.from_json(entry, rules)},
    )
    env.harness.scope = scope
    return scope


def _client(env: Env, port: int) -> http.client.HTTPSConnection:
    trust = env.proxy.tenant_ca(TENANT).ca_pem()
    ctx = ssl.create_default_context(cadata=trust.decode())
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel("api.test", port)
    return conn


def _ask(
    conn: http.client.HTTPSConnection, method: str, path: str, body: Any = None, **kw: Any
) -> tuple[int, bytes]:
    conn.request(method, path, body=body, **kw)
    resp = conn.getresponse()
    return resp.status, resp.read()


READ_ONLY = {"methods": ["GET"], "paths": ["/v1/customers/*"]}


def test_a_read_only_api_allows_get_of_customers_and_nothing_else(env: Env, crm: ApiServer) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, READ_ONLY)
    conn = _client(env, crm.port)
    status, body = _ask(conn, "GET", "/v1/customers/42?expand=plan")
    assert status == 200 and json.loads(body)["path"] == "/v1/customers/42?expand=plan"
    # The broker ended TLS: the guest sees a leaf of the tenant CA, not the upstream's.
    sock = conn.sock
    assert isinstance(sock, ssl.SSLSocket)
    issuer = dict(x[0] for x in sock.getpeercert()["issuer"])  # type: ignore[index]
    assert TENANT in str(issuer.get("commonName", ""))
    # A DELETE: refused inside TLS, naming the rule; never reaches the API.
    status, body = _ask(conn, "DELETE", "/v1/customers/42")
    conn.close()
    assert status == 403
    answer = json.loads(body)
    assert answer["policies"] == [f"proctor:egress:rule:{entry}:methods"]
    assert "DELETE is not a method" in answer["message"]
    assert [(m, p) for m, p, _ in crm.seen] == [("GET", "/v1/customers/42?expand=plan")]
    events = env.events()
    decision, deny, end = events
    assert decision["action"] == "http.request" and decision["decision"] == "allow"
    assert decision["details"]["rules"] == {
        "body_digests": False, "methods": ["GET"], "paths": ["/v1/customers/*"]
    }  # fmt: skip
    assert deny["action"] == "http.request" and deny["decision"] == "deny"
    assert deny["policies"] == [f"proctor:egress:rule:{entry}:methods"]
    assert deny["details"]["method"] == "DELETE"
    assert deny["details"]["path"] == "/v1/customers/42"
    assert deny["reason"].startswith("refused: DELETE is not a method")
    assert end["action"] == "http.request.end" and end["details"]["requests"] == 1


@pytest.mark.parametrize(
    "path",
    ["/v1/invoices/7", "/v1/customers/42/delete", "/v1/customers/..%2f..%2fadmin",
     "/v1/customers/%2e%2e/admin", "/v1/customers/1/../../admin", "/v1//customers/1"],
)  # fmt: skip
def test_a_path_outside_the_pattern_is_refused_and_recorded(
    env: Env, crm: ApiServer, path: str
) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, READ_ONLY)
    conn = _client(env, crm.port)
    status, body = _ask(conn, "GET", path)
    conn.close()
    assert status == 403
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:paths"]
    assert crm.seen == []
    deny = [e for e in env.events() if e["decision"] == "deny"]
    assert len(deny) == 1
    assert deny[0]["policies"] == [f"proctor:egress:rule:{entry}:paths"]
    assert deny[0]["details"]["key"] == "paths"


def test_the_host_header_cannot_take_a_request_out_from_under_the_rules(
    env: Env, crm: ApiServer
) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, READ_ONLY)
    conn = _client(env, crm.port)
    status, body = _ask(conn, "GET", "/v1/customers/1", headers={"Host": "admin.test"})
    conn.close()
    assert status == 403
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:host"]
    assert crm.seen == []
    [deny] = [e for e in env.events() if e["decision"] == "deny"]
    assert deny["action"] == "http.request"
    assert deny["policies"] == [f"proctor:egress:rule:{entry}:host"]


def test_a_response_over_the_bound_is_withheld_or_cut_and_recorded(
    env: Env, crm: ApiServer
) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, {**READ_ONLY, "response_bytes": 1000})
    conn = _client(env, crm.port)
    assert _ask(conn, "GET", "/v1/customers/small?n=1000") == (200, b"x" * 1000)
    # Content-Length over the bound: withheld before its head, a 502 naming the rule.
    status, body = _ask(conn, "GET", "/v1/customers/big?n=5000")
    conn.close()
    assert status == 502
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:response_bytes"]
    # A chunked response: relayed up to the bound, then cut (no end of the body).
    conn = _client(env, crm.port)
    conn.request("GET", "/v1/customers/chunked?n=5000")
    resp = conn.getresponse()
    assert resp.status == 200
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert len(info.value.partial) <= 1000
    conn.close()
    events = env.events()
    denies = [e for e in events if e["decision"] == "deny"]
    assert [d["policies"] for d in denies] == [[f"proctor:egress:rule:{entry}:response_bytes"]] * 2
    assert "withheld" in denies[0]["reason"] and "cut" in denies[1]["reason"]
    assert denies[1]["details"]["response_bytes"] == 1000
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert "cut" in ends[-1]["details"]["error"]


def test_the_run_total_holds_across_connections(env: Env, crm: ApiServer) -> None:
    entry = f"api.test:{crm.port}"
    scope = _scope(env, entry, {**READ_ONLY, "run_response_bytes": 2500})
    statuses = []
    for _ in range(3):
        conn = _client(env, crm.port)
        statuses.append(_ask(conn, "GET", "/v1/customers/page?n=1000")[0])
        conn.close()
    assert statuses == [200, 200, 502]
    assert scope.egress_totals[entry].response == 2000
    deny = [e for e in env.events() if e["decision"] == "deny"]
    assert deny[0]["policies"] == [f"proctor:egress:rule:{entry}:run_response_bytes"]
    assert len(crm.seen) == 3  # the third was asked, its answer withheld


def test_a_request_body_over_the_bound_never_reaches_the_upstream(env: Env, crm: ApiServer) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, {"methods": ["POST"], "request_bytes": 10})
    conn = _client(env, crm.port)
    assert _ask(conn, "POST", "/v1/notes", body=b"0123456789")[0] == 200
    status, body = _ask(conn, "POST", "/v1/notes", body=b"0123456789A")
    conn.close()
    assert status == 403
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:request_bytes"]
    # Chunked: stopped before the byte over the bound, so the upstream has no whole request.
    conn = _client(env, crm.port)
    status, body = _ask(conn, "POST", "/v1/notes", body=iter([b"01234", b"56789", b"AB"]),
                        encode_chunked=True)  # fmt: skip
    conn.close()
    assert status == 403
    assert [b for _, _, b in crm.seen] == [b"0123456789"]
    deny = [e for e in env.events() if e["decision"] == "deny"]
    assert [d["policies"] for d in deny] == [[f"proctor:egress:rule:{entry}:request_bytes"]] * 2


def test_bodies_are_recorded_as_digests_when_the_rules_say(env: Env, crm: ApiServer) -> None:
    entry = f"api.test:{crm.port}"
    _scope(env, entry, {"methods": ["GET", "POST"], "body_digests": True})
    conn = _client(env, crm.port)
    _, first = _ask(conn, "POST", "/v1/notes", body=b"hello")
    _, second = _ask(conn, "GET", "/v1/customers/x?n=7")
    assert second == b"x" * 7
    conn.close()
    end = env.events()[-1]
    assert end["action"] == "http.request.end"
    bodies = end["details"]["bodies"]
    assert end["details"]["bodies_count"] == 2
    assert bodies[0] == {
        "method": "POST", "status": 200,
        "request_sha256": hashlib.sha256(b"hello").hexdigest(),
        "response_sha256": hashlib.sha256(first).hexdigest(),
    }  # fmt: skip
    assert bodies[1]["response_sha256"] == hashlib.sha256(b"x" * 7).hexdigest()
    assert bodies[1]["request_sha256"] == hashlib.sha256(b"").hexdigest()


def test_plain_http_is_held_to_the_rules_before_anything_is_dialed(env: Env) -> None:
    entry = f"127.0.0.1:{env.http.port}"
    _scope(env, entry, READ_ONLY)
    base = f"http://127.0.0.1:{env.http.port}"
    with env.opener().open(f"{base}/v1/customers/42", timeout=10) as resp:
        assert resp.status == 200
    for method, path, key in (("DELETE", "/v1/customers/42", "methods"),
                              ("GET", "/v1/customers/%2e%2e/admin", "paths")):  # fmt: skip
        status, _, body = env.raw(f"{method} {base}{path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status == 403
        assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:{key}"]
    assert [s["path"] for s in env.http.seen] == ["/v1/customers/42"]
    denies = [e for e in env.events() if e["decision"] == "deny"]
    assert [d["policies"] for d in denies] == [
        [f"proctor:egress:rule:{entry}:methods"], [f"proctor:egress:rule:{entry}:paths"]
    ]  # fmt: skip
    assert all(d["action"] == "http.request" for d in denies)


def test_a_tenant_may_require_read_only_rules_through_cedar(env: Env, crm: ApiServer) -> None:
    entry = f"api.test:{crm.port}"
    forbid = (
        '\n@id("tenant:crm-read-only")\n'
        'forbid (principal, action == Proctor::Action::"http.request", '
        'resource == Proctor::Host::"api.test")\n'
        "unless { context has rules && context.rules has methods && "
        '["GET"].containsAll(context.rules.methods) };\n'
    )
    _scope(env, entry, {"methods": ["GET", "DELETE"]}, forbid)
    with pytest.raises(OSError, match="403"):
        _ask(_client(env, crm.port), "GET", "/v1/customers/1")
    _scope(env, entry, READ_ONLY, forbid)
    assert _ask(_client(env, crm.port), "GET", "/v1/customers/1")[0] == 200
    decisions = [e for e in env.events() if e["action"] == "http.request"]
    assert decisions[0]["policies"] == ["tenant:crm-read-only"]
    assert decisions[1]["decision"] == "allow"


def test_a_guest_that_does_not_trust_the_tenant_ca_gets_nothing(env: Env, crm: ApiServer) -> None:
    _scope(env, f"api.test:{crm.port}", READ_ONLY)
    with pytest.raises(urllib.error.URLError):
        env.opener().open(f"https://api.test:{crm.port}/v1/customers/1", timeout=10)
    assert crm.seen == []


def test_plain_http_bodies_are_held_to_the_byte_bounds(env: Env) -> None:
    entry = f"127.0.0.1:{env.http.port}"
    base = f"http://127.0.0.1:{env.http.port}"
    _scope(env, entry, {"request_bytes": 10, "response_bytes": 8})
    # A response announced over the bound: withheld, 502 naming the rule.
    status, _, body = env.raw(f"GET {base}/v1/x HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 502
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:response_bytes"]
    # A chunked one ("first " then "second"): cut before the piece that passes the bound.
    conn = http.client.HTTPConnection("127.0.0.1", env.harness.port, timeout=10)
    conn.request("GET", f"{base}/chunked")
    resp = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert info.value.partial == b"first "
    conn.close()
    # A request body over the bound: the upstream never has a whole request.
    status, _, body = env.raw(
        f"POST {base}/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n0123456789A".encode()
    )
    assert status == 403
    assert json.loads(body)["policies"] == [f"proctor:egress:rule:{entry}:request_bytes"]
    assert [s["method"] for s in env.http.seen] == ["GET", "GET"]
    denies = [e for e in env.events() if e["decision"] == "deny"]
    assert [d["policies"][0].rsplit(":", 1)[1] for d in denies] == [
        "response_bytes", "response_bytes", "request_bytes"
    ]  # fmt: skip


def test_plain_http_bodies_are_recorded_as_digests_when_the_rules_say(env: Env) -> None:
    entry = f"127.0.0.1:{env.http.port}"
    _scope(env, entry, {"methods": ["POST"], "body_digests": True})
    status, _, body = env.raw(
        f"POST http://{entry}/v1/notes HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
        "hello".encode()
    )
    assert status == 200
    end = env.events()[-1]
    assert end["action"] == "http.request.end"
    assert end["details"]["bodies"] == [{
        "method": "POST", "status": 200,
        "request_sha256": hashlib.sha256(b"hello").hexdigest(),
        "response_sha256": hashlib.sha256(body).hexdigest(),
    }]  # fmt: skip


def test_a_tenant_forbid_on_method_and_path_holds_inside_tls(env: Env, crm: ApiServer) -> None:
    from proctor.evidence._policies import redecide

    entry = f"api.test:{crm.port}"
    forbid = (
        '\n@id("tenant:no-deletes")\n'
        'forbid (principal, action == Proctor::Action::"http.request", resource)\n'
        'when { context.method == "DELETE" || (context has path && '
        'context.path like "/v1/customers/*/erase") };\n'
    )
    scope = _scope(env, entry, {"methods": ["GET", "DELETE"], "paths": ["/v1/customers/**"]},
                   forbid)  # fmt: skip
    conn = _client(env, crm.port)
    assert _ask(conn, "GET", "/v1/customers/42")[0] == 200
    status, body = _ask(conn, "DELETE", "/v1/customers/42")
    conn.close()
    assert status == 403 and json.loads(body)["policies"] == ["tenant:no-deletes"]
    conn = _client(env, crm.port)
    assert _ask(conn, "GET", "/v1/customers/42/erase")[0] == 403
    conn.close()
    assert [(m, p) for m, p, _ in crm.seen] == [("GET", "/v1/customers/42")]
    denies = [e for e in env.events() if e["decision"] == "deny"]
    assert [(d["details"]["method"], d["policies"]) for d in denies] == [
        ("DELETE", ["tenant:no-deletes"]), ("GET", ["tenant:no-deletes"])
    ]  # fmt: skip
    # Cedar's own decisions, not a broker rule's: the verifier decides them again.
    for deny in denies:
        assert not deny["reason"].startswith("refused:")
        assert redecide(scope.policies, deny, "sandbox", 10_000) is None
