"""The egress proxy against real HTTP(S) servers on loopback, driven by ordinary clients.

The proxy's handlers run on a real asyncio server (a loopback stand-in for the
broker's per-run socket) that reads the request head and calls them, as the
broker's server does. Clients are urllib with a ProxyHandler, http.client
tunnels and raw sockets; upstreams count the connections they accept.
"""

from __future__ import annotations

import ast
import asyncio
import datetime
import http.client
import ipaddress
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proctor.broker import RunScope, SecretBinding
from proctor.broker._egress import SPECIAL_ADDRESS_RULE, IPAddress
from proctor.broker._proxy import SECRET_BINDING_RULE, EgressProxy, system_resolver
from proctor.ledger import Actor, EventDraft
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv

TENANT = "acme"
WORKLOAD = "spiffe://proctor.test/tenant/acme/deployment/churn/run/r1"
SECRET_VALUE = "tok-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
PLACEHOLDER = "proctor-secret:crm_token"


# -- certificates made by the tests ---------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass
class UpstreamCA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls) -> UpstreamCA:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("proctor test upstream CA"))
            .issuer_name(_name("proctor test upstream CA"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, names: list[str], path: Path) -> Path:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
            .sign(self.key, hashes.SHA256())
        )
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return path


# -- upstream servers ------------------------------------------------------------


@contextmanager
def https_upstream(
    handler: type[BaseHTTPRequestHandler], names: list[str], directory: Path
) -> Iterator[tuple[int, UpstreamCA]]:
    """A real HTTPS server on 127.0.0.1 serving ``handler``, its certificate for
    ``names`` from a CA of its own: (port, that CA), shut down on exit."""
    ca = UpstreamCA.make()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(names, directory / "leaf.pem"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], ca
    finally:
        server.shutdown()
        server.server_close()


class Upstream(ThreadingHTTPServer):
    """A real HTTP(S) server on 127.0.0.1 that counts connections and keeps request heads."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.tls = tls
        self.connections = 0
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        with self.lock:
            self.connections += 1
        if self.tls is not None:
            # Handshake in the handler's thread, not in the accept loop.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        return data if len(data) == length else None

    def _handle(self) -> None:
        body = self._body()
        if body is None:  # a truncated request: never acted on
            self.close_connection = True
            return
        with self.server.lock:
            self.server.seen.append(
                {"method": self.command, "path": self.path, "headers": dict(self.headers.items())}
            )
        if self.path.startswith("/redirect?to="):
            self._reply(302, b"", {"Location": self.path.split("=", 1)[1]})
        elif self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"first ", b"second"):
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._reply(200, f"hello {self.command} {self.path} {len(body)}".encode())

    do_GET = do_POST = do_PUT = do_HEAD = _handle


# -- the proxy on a real asyncio server ------------------------------------------


class ProxyHarness:
    """An asyncio server on 127.0.0.1 in a thread, handing each request to the handlers."""

    def __init__(self, proxy: EgressProxy, scope: RunScope) -> None:
        self.proxy = proxy
        self.scope = scope
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(asyncio.start_server(self._on_connection, "127.0.0.1", 0))
        self.port = int(self.server.sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.active = 0

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every handler has returned (completion events are written last)."""

        async def idle() -> None:
            while self.active:
                await asyncio.sleep(0.005)

        self.run(asyncio.wait_for(idle(), timeout))

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.active += 1
        try:
            await self._handle(reader, writer)
        finally:
            self.active -= 1

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")[:-2]
        method, target, _version = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if not name.lower().startswith("proxy-"):
                headers.append((name, value.strip()))
        if method == "CONNECT":
            await self.proxy.handle_connect(self.scope, target, reader, writer)
        else:
            await self.proxy.handle_forward(self.scope, method, target, headers, reader, writer)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()

        self.settle()
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeResolver:
    """Names the tests own, resolved as a DNS server would answer; counts lookups."""

    def __init__(self, answers: dict[str, list[list[str]]] | None = None) -> None:
        self.answers = answers or {}
        self.calls: dict[str, int] = {}

    async def __call__(self, name: str, port: int) -> list[IPAddress]:
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.answers:
            rounds = self.answers[name]
            answer = rounds[min(self.calls[name], len(rounds)) - 1]
            return [ipaddress.ip_address(a) for a in answer]
        return await system_resolver(name, port)


@dataclass
class Env:
    ledger_env: LedgerEnv
    tmp: Path
    ca: UpstreamCA
    cafile: Path
    http: Upstream
    https: Upstream
    api: Upstream  # HTTPS, certificate for api.test
    resolver: FakeResolver
    proxy: EgressProxy
    harness: ProxyHarness
    start: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def scope(
        self,
        egress: list[str] | None = None,
        *,
        secrets: list[str] | None = None,
        bindings: list[SecretBinding] | None = None,
        allowed: tuple[str, ...] = ("127.0.0.0/8",),
        policy_text: str | None = None,
    ) -> RunScope:
        text = policy_text or capability_policies(
            TENANT, "churn", {"egress": egress or [], "secrets": secrets or []}
        )
        scope = RunScope(
            tenant=TENANT,
            run_id="r1",
            workload=WORKLOAD,
            deployment="churn",
            artifact=None,
            approvals=(),
            environment="sandbox",
            policies=compile_policies(text),
            ledger=self.ledger_env.ledger,
            secrets={b.name: b for b in bindings or []},
            allowed_ranges=allowed,
        )
        self.harness.scope = scope
        return scope

    def raw_events(self) -> list[bytes]:
        self.harness.settle()
        # Completion records go out after their answer, with the next commit.
        self.ledger_env.ledger.flush()
        return list(self.ledger_env.ledger.entries(TENANT))[1:]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.raw_events()]

    def opener(self, *, trust: bytes | None = None) -> urllib.request.OpenerDirector:
        ctx = ssl.create_default_context(cadata=(trust or self.ca.pem()).decode())
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": self.harness.url, "https": self.harness.url}),
            urllib.request.HTTPSHandler(context=ctx),
        )

    def raw(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """Send bytes to the proxy; the status, headers and body it answers."""
        with socket.create_connection(("127.0.0.1", self.harness.port), timeout=10) as s:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        return int(lines[0].split(" ")[1]), headers, body


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


def proxy_env(
    ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Env]:
    """Upstreams, a proxy and its harness; shared with the SSRF suite."""
    for var in ("no_proxy", "NO_PROXY", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    ledger_env.ledger.create_log(
        TENANT, EventDraft(Actor("operator", "test"), "tenant.create", f"tenant/{TENANT}")
    )
    ca = UpstreamCA.make()
    cafile = tmp_path / "upstream-ca.pem"
    cafile.write_bytes(ca.pem())

    def tls(names: list[str], file: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(ca.issue(names, tmp_path / file))
        return ctx

    http_up = Upstream()
    https_up = Upstream(tls(["127.0.0.1"], "loop.pem"))
    api_up = Upstream(tls(["api.test"], "api.pem"))
    resolver = FakeResolver({"api.test": [["127.0.0.1"]], "other.test": [["127.0.0.1"]]})
    proxy = EgressProxy(tmp_path / "ca", upstream_cafile=str(cafile), resolver=resolver)
    env = Env(ledger_env, tmp_path, ca, cafile, http_up, https_up, api_up, resolver, proxy, None)  # type: ignore[arg-type]
    env.harness = ProxyHarness(proxy, None)  # type: ignore[arg-type]
    yield env
    env.harness.close()
    for up in (http_up, https_up, api_up):
        up.shutdown()
        up.server_close()


def _by_action(events: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [e for e in events if e["action"] == action]


# -- allowed calls ---------------------------------------------------------------


def test_allowed_http_request_works_and_is_recorded(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    with env.opener().open(f"http://127.0.0.1:{env.http.port}/hello?x=1", timeout=10) as resp:
        assert resp.status == 200
        assert resp.read() == b"hello GET /hello?x=1 0"
        assert resp.headers["Connection"] == "close"
    decision, end = env.events()
    assert decision["action"] == "http.request"
    assert decision["decision"] == "allow"
    assert decision["policies"] == [f"deploy:churn:egress:127.0.0.1:{env.http.port}"]
    assert decision["details"]["address"] == "127.0.0.1"
    assert decision["details"]["path"] == "/hello"
    assert end["action"] == "http.request.end"
    assert end["details"]["status"] == 200
    assert end["details"]["decision_seq"] == decision["seq"]
    assert end["details"]["bytes_up"] > 0 and end["details"]["bytes_down"] > 0
    assert end["details"]["duration_ms"] >= 0
    # The Host header names the URL's authority, whatever the client wrote.
    assert env.http.seen[0]["headers"]["Host"] == f"127.0.0.1:{env.http.port}"


def test_request_bodies_and_chunked_responses_are_relayed(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    url = f"http://127.0.0.1:{env.http.port}/upload"
    req = urllib.request.Request(url, data=b"x" * 100_000, method="POST")
    with env.opener().open(req, timeout=10) as resp:
        assert resp.read() == b"hello POST /upload 100000"
    conn = http.client.HTTPConnection("127.0.0.1", env.harness.port, timeout=10)
    conn.request("PUT", url, body=iter([b"ab", b"cde"]), encode_chunked=True)
    assert conn.getresponse().read() == b"hello PUT /upload 5"
    conn = http.client.HTTPConnection("127.0.0.1", env.harness.port, timeout=10)
    conn.request("GET", f"http://127.0.0.1:{env.http.port}/chunked")
    assert conn.getresponse().read() == b"first second"


def test_allowed_https_through_connect(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.https.port}"])
    with env.opener().open(f"https://127.0.0.1:{env.https.port}/secure", timeout=10) as resp:
        assert resp.read() == b"hello GET /secure 0"
    decision, end = env.events()
    assert decision["details"]["method"] == "CONNECT"
    assert decision["decision"] == "allow"
    assert end["details"]["bytes_up"] > 0 and end["details"]["bytes_down"] > 0


def test_connect_to_a_port_not_allowed_is_refused(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.https.port}"])
    status, headers, body = env.raw(
        f"CONNECT 127.0.0.1:{env.http.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    assert status == 403
    assert headers["connection"] == "close"
    assert json.loads(body) == {
        "error": "denied",
        "message": f"http.request to host/127.0.0.1:{env.http.port} denied: no policy permits it",
        "policies": [],
    }
    assert env.http.connections == 0
    (event,) = env.events()
    assert event["decision"] == "deny"
    assert event["details"]["port"] == env.http.port


def test_redirect_to_a_disallowed_host_is_refused_when_followed(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    for target in (
        f"http://localhost:{env.https.port}/",
        f"http://127.0.0.1:{env.https.port}/",
        "http://169.254.169.254/latest/meta-data/",
    ):
        url = f"http://127.0.0.1:{env.http.port}/redirect?to={target}"
        with pytest.raises(urllib.error.HTTPError) as info:
            env.opener().open(url, timeout=10)
        assert info.value.code == 403
        assert json.loads(info.value.read())["error"] == "denied"
    assert env.https.connections == 0
    requests = _by_action(env.events(), "http.request")
    assert [e["decision"] for e in requests] == ["allow", "deny"] * 3


def test_special_range_needs_the_run_to_allow_it(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"], allowed=())
    status, _, body = env.raw(
        f"GET http://127.0.0.1:{env.http.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    assert status == 403
    assert json.loads(body)["policies"] == [SPECIAL_ADDRESS_RULE]
    assert env.http.connections == 0
    (event,) = env.events()
    assert event["decision"] == "deny"
    assert event["policies"] == [SPECIAL_ADDRESS_RULE]
    assert event["details"]["permitted_by"] == [f"deploy:churn:egress:127.0.0.1:{env.http.port}"]
    assert event["details"]["special_ranges"] == ["127.0.0.0/8"]

    env.scope([f"127.0.0.1:{env.http.port}"], allowed=("127.0.0.0/8",))
    with env.opener().open(f"http://127.0.0.1:{env.http.port}/", timeout=10) as resp:
        assert resp.status == 200


def test_a_name_is_resolved_once_per_connection(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"])
    env.proxy.upstream_cafile = str(env.cafile)
    with env.opener().open(f"https://api.test:{env.api.port}/", timeout=10) as resp:
        assert resp.status == 200
    assert env.resolver.calls["api.test"] == 1
    decision = _by_action(env.events(), "http.request")[0]
    assert decision["details"]["resolved"] == ["127.0.0.1"]


def test_a_denied_name_is_never_resolved(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"])
    status, _, _ = env.raw(b"CONNECT other.test:443 HTTP/1.1\r\n\r\n")
    assert status == 403
    assert "other.test" not in env.resolver.calls


def test_malformed_requests_are_refused_and_recorded(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    cases = [
        b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n",
        b"CONNECT [::1 HTTP/1.1\r\n\r\n",
        f"GET ftp://127.0.0.1:{env.http.port}/ HTTP/1.1\r\n\r\n".encode(),
        f"GET http://user@127.0.0.1:{env.http.port}/ HTTP/1.1\r\n\r\n".encode(),
        (
            f"POST http://127.0.0.1:{env.http.port}/ HTTP/1.1\r\nContent-Length: 3\r\n"
            "Transfer-Encoding: chunked\r\n\r\nabc"
        ).encode(),
    ]
    for request in cases:
        status, _, body = env.raw(request)
        assert status == 400, request
        assert json.loads(body)["error"] == "bad_request"
    assert env.http.connections == 0
    events = env.events()
    assert len(events) == len(cases)
    assert all(e["decision"] == "deny" for e in events)


def test_unreachable_upstream_is_a_502(env: Env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env.scope([f"127.0.0.1:{closed}"])
    status, _, body = env.raw(f"GET http://127.0.0.1:{closed}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 502
    assert json.loads(body)["error"] == "upstream_failed"
    decision, end = env.events()
    assert decision["decision"] == "allow"
    assert "could not connect" in end["details"]["error"]


# -- fail closed -------------------------------------------------------------------


def test_ledger_failure_refuses_and_connects_nowhere(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}", f"127.0.0.1:{env.https.port}"])
    env.ledger_env.ledger.close()
    with pytest.raises(urllib.error.HTTPError) as info:
        env.opener().open(f"http://127.0.0.1:{env.http.port}/", timeout=10)
    assert info.value.code == 503
    assert json.loads(info.value.read())["error"] == "not_recorded"
    status, _, body = env.raw(f"CONNECT 127.0.0.1:{env.https.port} HTTP/1.1\r\n\r\n".encode())
    assert status == 503
    assert json.loads(body)["error"] == "not_recorded"
    assert env.http.connections == 0
    assert env.https.connections == 0


# -- credential injection ----------------------------------------------------------


def _binding(*hosts: str, name: str = "crm_token", value: str = SECRET_VALUE) -> SecretBinding:
    return SecretBinding(name=name, value=value, hosts=hosts)


def test_secret_is_injected_and_never_seen_by_the_guest_or_the_ledger(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    trust = env.proxy.tenant_ca(TENANT).ca_pem()
    assert b"PRIVATE KEY" not in trust
    ctx = ssl.create_default_context(cadata=trust.decode())
    received = b""
    # Two requests on one connection: the header goes on each.
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel("api.test", env.api.port)
    conn.request("GET", "/one", headers={"Authorization": f"Bearer {PLACEHOLDER}"})
    first = conn.getresponse()
    received += first.read()
    conn.request("POST", "/two", body=b"payload")
    second = conn.getresponse()
    received += second.read() + str(second.headers).encode()
    conn.close()
    assert first.status == 200 and second.status == 200
    assert [s["headers"]["Authorization"] for s in env.api.seen] == [f"Bearer {SECRET_VALUE}"] * 2
    # One guest connection, one upstream connection per injected request (never reused).
    assert env.api.connections == 2
    assert SECRET_VALUE.encode() not in received
    for event in env.raw_events():
        assert SECRET_VALUE.encode() not in event
    # One decision and one event for the request, the secret inside it; then the
    # completion record.
    actions = [(e["action"], e["decision"]) for e in env.events()]
    assert actions == [("http.request", "allow"), ("http.request.end", "allow")]
    request = env.events()[0]
    assert request["details"]["inject"] == [{"secret": "crm_token", "header": "Authorization"}]
    assert any(p.endswith(":secret:crm_token") for p in request["policies"])
    assert any(":egress:" in p for p in request["policies"])
    end = env.events()[-1]
    assert end["details"]["requests"] == 2
    assert end["details"]["secrets"] == ["crm_token"]


def test_urllib_works_unchanged_against_an_injected_host(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("*.test")])
    opener = env.opener(trust=env.proxy.tenant_ca(TENANT).ca_pem())
    with opener.open(f"https://api.test:{env.api.port}/x", timeout=10) as resp:
        body = resp.read()
    assert body == b"hello GET /x 0"
    assert env.api.seen[0]["headers"]["Authorization"] == f"Bearer {SECRET_VALUE}"


def test_guest_that_does_not_trust_the_tenant_ca_gets_nothing(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    with pytest.raises(urllib.error.URLError):
        env.opener().open(f"https://api.test:{env.api.port}/x", timeout=10)
    assert env.api.seen == []


def test_placeholder_to_another_host_is_refused(env: Env) -> None:
    env.scope(
        [f"127.0.0.1:{env.http.port}"], secrets=["crm_token"], bindings=[_binding("api.test")]
    )
    url = f"http://127.0.0.1:{env.http.port}/leak"
    req = urllib.request.Request(url, headers={"X-Api-Key": PLACEHOLDER})
    with pytest.raises(urllib.error.HTTPError) as info:
        env.opener().open(req, timeout=10)
    assert info.value.code == 403
    assert json.loads(info.value.read())["policies"] == [SECRET_BINDING_RULE]
    assert env.http.connections == 0
    # In the body: the upstream never gets a complete request.
    body = b"a" * 70_000 + PLACEHOLDER.encode() + b"z" * 10
    with pytest.raises(urllib.error.HTTPError) as info:
        env.opener().open(urllib.request.Request(url, data=body), timeout=10)
    assert info.value.code == 403
    assert env.http.seen == []
    refusals = _by_action(env.events(), "secret.use")
    assert len(refusals) == 2
    assert all(e["decision"] == "deny" for e in refusals)
    assert all(e["policies"] == [SECRET_BINDING_RULE] for e in refusals)


def test_placeholder_over_plain_http_to_its_own_host_is_refused(env: Env) -> None:
    env.scope(
        [f"127.0.0.1:{env.http.port}"], secrets=["crm_token"], bindings=[_binding("127.0.0.1")]
    )
    status, _, body = env.raw(
        f"GET http://127.0.0.1:{env.http.port}/ HTTP/1.1\r\n"
        f"Authorization: {PLACEHOLDER}\r\n\r\n".encode()
    )
    assert status == 403
    assert "only inside TLS" in json.loads(body)["message"]
    assert env.http.connections == 0


def test_other_secrets_placeholder_inside_an_injected_tunnel_is_refused(env: Env) -> None:
    other = _binding("elsewhere.test", name="other_token", value="other-value-123456")
    env.scope(
        [f"api.test:{env.api.port}"],
        secrets=["crm_token", "other_token"],
        bindings=[_binding("api.test"), other],
    )
    opener = env.opener(trust=env.proxy.tenant_ca(TENANT).ca_pem())
    req = urllib.request.Request(
        f"https://api.test:{env.api.port}/x", headers={"X-Other": other.placeholder}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(req, timeout=10)
    assert info.value.code == 403
    payload = info.value.read()
    assert SECRET_VALUE.encode() not in payload
    assert env.api.seen == []


def test_host_header_must_name_the_bound_host(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    opener = env.opener(trust=env.proxy.tenant_ca(TENANT).ca_pem())
    req = urllib.request.Request(
        f"https://api.test:{env.api.port}/x", headers={"Host": "fronted.example"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(req, timeout=10)
    assert info.value.code == 403
    assert env.api.seen == []


def test_secret_use_is_decided_by_policy(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=[], bindings=[_binding("api.test")])
    status, _, body = env.raw(f"CONNECT api.test:{env.api.port} HTTP/1.1\r\n\r\n".encode())
    assert status == 403
    assert "secret.use of secret/crm_token" in json.loads(body)["message"]
    assert env.api.connections == 0
    # The request's one event is the deny, naming the secret; nothing was admitted.
    events = env.events()
    assert [(e["action"], e["decision"]) for e in events] == [("http.request", "deny")]
    assert events[0]["details"]["inject"] == [{"secret": "crm_token", "header": "Authorization"}]
    assert "secret.use of secret/crm_token" in events[0]["reason"]


def test_upstream_certificate_is_verified(env: Env) -> None:
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    env.proxy.upstream_cafile = None
    env.proxy._upstream_ctx = None  # the system bundle does not know the test CA
    status, _, body = env.raw(f"CONNECT api.test:{env.api.port} HTTP/1.1\r\n\r\n".encode())
    assert status == 502
    assert "did not verify" in json.loads(body)["message"]
    assert env.api.seen == []
    assert SECRET_VALUE.encode() not in body


def test_tenant_ca_is_kept_and_reused(env: Env, tmp_path: Path) -> None:
    first = env.proxy.tenant_ca(TENANT).ca_pem()
    again = EgressProxy(tmp_path / "ca").tenant_ca(TENANT).ca_pem()
    assert first == again
    key_file = tmp_path / "ca" / TENANT / "tenant-ca.pem"
    assert key_file.stat().st_mode & 0o077 == 0
    assert [p.name for p in (tmp_path / "ca" / TENANT).iterdir()] == ["tenant-ca.pem"]


def test_every_answer_inside_an_injected_tunnel_is_recorded_first(env: Env) -> None:
    """A refusal inside the TLS the proxy ends (malformed, an upgrade, not origin-form)
    is a deny event, and the completion event that says what was answered is written
    before the answer: nothing the proxy says goes unrecorded (issue 13, item 7)."""
    env.scope([f"api.test:{env.api.port}"], secrets=["crm_token"], bindings=[_binding("api.test")])
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca(TENANT).ca_pem().decode())
    host = f"api.test:{env.api.port}"
    cases = [
        b"GET /x HTTP/1.1\r\nHost: " + host.encode() + b"\r\nBad Header: 1\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: " + host.encode() + b"\r\nUpgrade: websocket\r\n\r\n",
        b"GET http://elsewhere/ HTTP/1.1\r\nHost: " + host.encode() + b"\r\n\r\n",
    ]
    for request in cases:
        with socket.create_connection(("127.0.0.1", env.harness.port), timeout=10) as raw:
            raw.sendall(f"CONNECT {host} HTTP/1.1\r\n\r\n".encode())
            assert raw.recv(4096).startswith(b"HTTP/1.1 200")
            with ctx.wrap_socket(raw, server_hostname="api.test") as tls:
                tls.sendall(request)
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 400"), answer
    assert env.api.seen == []
    events = env.events()
    refusals = [e for e in events if e["action"] == "http.request" and e["decision"] == "deny"]
    assert len(refusals) == len(cases)
    assert all(e["reason"].startswith("refused: ") for e in refusals)
    ends = _by_action(events, "http.request.end")
    assert [e["details"]["answered"] for e in ends] == [400] * len(cases)
    # Each refusal is recorded before its tunnel's completion event.
    for refusal, end in zip(refusals, ends, strict=True):
        assert refusal["seq"] < end["seq"]


def test_a_502_after_admission_is_in_the_completion_event(env: Env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env.scope([f"127.0.0.1:{closed}"])
    status, _, _ = env.raw(f"GET http://127.0.0.1:{closed}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 502
    _, end = env.events()
    assert end["details"]["answered"] == 502


def test_the_acts_leave_their_records_to_the_record_stage() -> None:
    """The file kinds' and the injected tunnel's acts do not call back into the
    record stage: a refusal found acting is the pipeline's to record (``Acted.refusal``),
    and an injected tunnel's completion record is written by ``_proxy._carry`` (the
    act's caller), its owed answer sent inside TLS by the answer stage."""
    import proctor.broker._files as files
    import proctor.broker._inject as inject

    for module in (files, inject):
        assert module.__file__ is not None
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "proctor.broker._record" not in imported, module.__name__


def test_an_egress_refusal_found_parsing_is_left_to_the_record_stage(env: Env) -> None:
    """A malformed CONNECT target and a placeholder in a forwarded head are refused
    in the parse, which appends nothing: the refusal goes on as a ruling, recorded by
    the record stage as the call's one event."""
    from proctor.broker._calls import Call
    from proctor.broker._http import RequestHead
    from proctor.broker._proxy import CONNECT, FORWARD, EgressRefused

    scope = env.scope(
        [f"127.0.0.1:{env.http.port}"], secrets=["crm_token"], bindings=[_binding("127.0.0.1")]
    )
    url = f"http://127.0.0.1:{env.http.port}/"
    heads = [
        (CONNECT, RequestHead("CONNECT", "[::1", "HTTP/1.1", [])),
        (FORWARD, RequestHead("GET", url, "HTTP/1.1", [("Authorization", PLACEHOLDER)])),
    ]
    for kind, head in heads:
        parsed = asyncio.run(kind.parse(Call(scope, head=head, proxy=env.proxy)))
        assert isinstance(parsed, EgressRefused) and parsed.ruling.refusal is not None
    assert env.events() == []
    status, _, body = env.raw(b"CONNECT [::1 HTTP/1.1\r\n\r\n")
    assert status == 400
    status, _, body = env.raw(
        f"GET {url} HTTP/1.1\r\nAuthorization: {PLACEHOLDER}\r\n\r\n".encode()
    )
    assert status == 403 and "only inside TLS" in json.loads(body)["message"]
    bad, placeholder = env.events()
    assert (bad["action"], bad["decision"]) == ("http.request", "deny")
    assert bad["details"]["target"] == "[::1" and bad["reason"].startswith("refused: ")
    assert (placeholder["action"], placeholder["decision"]) == ("secret.use", "deny")
    assert placeholder["policies"] == [SECRET_BINDING_RULE]
    assert placeholder["details"]["secret"] == "crm_token" and placeholder["details"]["where"]
    assert env.http.connections == 0
