"""How an egress call ended, in its OCSF lines, from a real proxy (issue 31, item 8).

The proxy's own events (tests/integration/test_broker_proxy.py's harness: real
upstreams on loopback, HTTP, HTTPS with a secret injected, refusals inside the
TLS the proxy ends, an upstream that is gone) mapped to OCSF: every line valid
against the vendored schema, every status the events record in
``http_response.code`` of an HTTP Activity line, and no address in a hostname.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.evidence._ocsf import ocsf_line
from tests.conftest import LedgerEnv
from tests.integration.test_broker_proxy import PLACEHOLDER, TENANT, Env, _binding, proxy_env
from tests.integration.test_ocsf_valid import _errors, _untruths


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


def _lines(env: Env) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events = env.events()
    lines = [ocsf_line(ev, env.ledger_env.ledger.origin(TENANT)) for ev in events]
    assert _errors(lines) == {}
    assert _untruths(events, lines) == []
    return events, [json.loads(line) for line in lines]


def test_plain_http_to_an_address_ends_in_its_response(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    with env.opener().open(f"http://127.0.0.1:{env.http.port}/hello", timeout=10) as resp:
        assert resp.status == 200
    events, lines = _lines(env)
    (request, end), (asked, ended) = events, lines
    assert (request["action"], end["action"], end["details"]["status"]) == (
        "http.request", "http.request.end", 200,
    )  # fmt: skip
    # The guest wrote an address: it is the ip, and no hostname anywhere.
    assert asked["dst_endpoint"] == {"port": env.http.port, "ip": "127.0.0.1"}
    assert "hostname" not in asked["http_request"]["url"]
    assert (ended["class_uid"], ended["http_response"]["code"]) == (4002, 200)
    assert ended["http_response"]["length"] == end["details"]["bytes_down"]
    assert ended["status"] == "Success"


def test_an_injected_tunnel_ends_in_its_last_response(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca(TENANT).ca_pem().decode())
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel("api.test", env.api.port)
    conn.request("GET", "/one", headers={"Authorization": f"Bearer {PLACEHOLDER}"})
    conn.getresponse().read()
    conn.request("POST", "/two", body=b"payload")
    assert conn.getresponse().status == 200
    conn.close()
    events, lines = _lines(env)
    end, ended = events[-1], lines[-1]
    assert (end["details"]["requests"], end["details"]["status"]) == (2, 200)
    assert ended["http_response"] == {"code": 200}  # the last of two: no one length
    assert ended["dst_endpoint"]["hostname"] == "api.test"


def test_refusals_inside_a_tunnel_carry_the_status_answered(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca(TENANT).ca_pem().decode())
    host = f"api.test:{env.api.port}"
    with socket.create_connection(("127.0.0.1", env.harness.port), timeout=10) as raw:
        raw.sendall(f"CONNECT {host} HTTP/1.1\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with ctx.wrap_socket(raw, server_hostname="api.test") as tls:
            tls.sendall(b"GET /x HTTP/1.1\r\nHost: " + host.encode() + b"\r\nBad Header: 1\r\n\r\n")
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 400")
    events, lines = _lines(env)
    refused = [(e, o) for e, o in zip(events, lines, strict=True)
               if e["action"] == "http.request" and e["decision"] == "deny"]  # fmt: skip
    assert [(e["details"]["status"], o["http_response"]["code"]) for e, o in refused] == [
        (400, 400)
    ]
    assert "policy" not in refused[0][1]  # the proxy's own refusal, before any policy
    ended = lines[-1]
    assert (ended["class_uid"], ended["http_response"]["code"], ended["status"]) == (
        4002, 400, "Failure",
    )  # fmt: skip


def test_an_upstream_that_is_gone_ends_in_proctors_502(env: Env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env.scope([f"127.0.0.1:{closed}"])
    status, _, _ = env.raw(f"GET http://127.0.0.1:{closed}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 502
    events, lines = _lines(env)
    assert "status" not in events[-1]["details"]
    ended = lines[-1]
    assert (ended["class_uid"], ended["http_response"], ended["status_id"]) == (
        4002, {"code": 502}, 2,
    )  # fmt: skip
    assert ended["status_detail"] == events[-1]["details"]["error"]
