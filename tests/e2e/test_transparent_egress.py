"""Transparent egress on both backends: real programs with no proxy configuration
reach an allowed upstream on the host's loopback through the broker, and are
refused elsewhere; each call is one decision event with the proxy's fields.

The guest resolves ``api.test`` through the broker (an address from the reserved
range, never a real one); the broker resolves it (the test's resolver) to
127.0.0.1, where the test's own HTTPS, HTTP and echo servers listen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socketserver
import ssl
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import Broker, EgressProxy, Handlers
from proctor.lifecycle import brokered_spec
from proctor.policy import compile_policies
from proctor.sandbox import GuestNetwork, Limits, get_driver, network_available
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.integration.test_broker_proxy import UpstreamCA, https_upstream
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables"),
]

POLICY = """
@id("api")
permit(principal, action == Proctor::Action::"http.request", resource == Proctor::Host::"api.test");
@id("metadata")
permit(principal, action == Proctor::Action::"http.request", resource == Proctor::Host::"169.254.169.254");
"""


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = f"hello {self.headers.get('Host')}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"echo:" + self.request.recv(64))


@dataclasses.dataclass
class Upstreams:
    https: int
    http: int
    echo: int
    ca: Path


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstreams]:
    d = tmp_path_factory.mktemp("up")
    ca = UpstreamCA.make()
    (d / "ca.pem").write_bytes(ca.pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["api.test"], d / "leaf.pem"))
    tls = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    plain = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    echo = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    servers: list[socketserver.BaseServer] = [tls, plain, echo]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield Upstreams(tls.server_address[1], plain.server_address[1], echo.server_address[1],
                    d / "ca.pem")  # fmt: skip
    for s in servers:
        s.shutdown()


async def _resolver(name: str, port: int) -> list[Any]:
    return [ip_address("127.0.0.1")] if name == "api.test" else []


PYTHON_GUEST = r"""
import asyncio, json, os, socket, ssl, subprocess, urllib.request, urllib.error
for k in [k for k in os.environ if k.lower().endswith("_proxy")]:
    del os.environ[k]
S, H, E = (int(os.environ[k]) for k in ("UP_HTTPS", "UP_HTTP", "UP_ECHO"))
res = {"resolved": socket.getaddrinfo("api.test", S, type=socket.SOCK_STREAM)[0][4][0]}
def attempt(name, fn):
    try:
        res[name] = fn()
    except Exception as e:
        res[name] = "refused: " + type(e).__name__
attempt("urllib", lambda: urllib.request.urlopen(f"https://api.test:{S}/", timeout=10).read().decode())
attempt("urllib_http", lambda: urllib.request.urlopen(f"http://api.test:{H}/x", timeout=10).read().decode())
import requests, httpx, aiohttp
# Default settings: no proxy variables left, the CA from the variables each reads.
attempt("requests", lambda: requests.get(f"https://api.test:{S}/", timeout=10).text)
attempt("httpx", lambda: httpx.get(f"https://api.test:{S}/", timeout=10).text)
async def aio():
    async with aiohttp.ClientSession() as s:
        async with s.get(f"https://api.test:{S}/") as r:
            return await r.text()
attempt("aiohttp", lambda: asyncio.run(aio()))
def raw():
    c = socket.create_connection(("api.test", E), timeout=10); c.sendall(b"ping")
    return c.recv(64).decode()
attempt("raw", raw)
def raw_literal():
    c = socket.create_connection(("169.254.169.254", 80), timeout=10); c.sendall(b"ping")
    return c.recv(64).decode() or "refused: closed"
attempt("raw_literal", raw_literal)
attempt("denied_name", lambda: urllib.request.urlopen(f"https://other.test:{S}/", timeout=10).read())
def denied_http():
    try:
        urllib.request.urlopen(f"http://other.test:{H}/", timeout=10)
    except urllib.error.HTTPError as e:
        return e.code
attempt("denied_http", denied_http)
attempt("metadata", lambda: urllib.request.urlopen("http://169.254.169.254/latest/meta-data/", timeout=10).read())
def sni_mismatch():
    ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection((res["resolved"], S), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="other.test").recv(10).decode()
attempt("sni_mismatch", sni_mismatch)
def late(server_hostname):
    # Silent past the broker's wait before TLS starts: decided as raw TCP, and the
    # ClientHello, when it comes, is still held to the name.
    import time
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    ctx.check_hostname = False
    raw = socket.create_connection(("api.test", S), timeout=10)
    time.sleep(1.5)
    t = ctx.wrap_socket(raw, server_hostname=server_hostname)
    t.sendall(b"GET / HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    return t.recv(200).decode().split("\r\n")[0]
attempt("late_ok", lambda: late("api.test"))
attempt("late_mismatch", lambda: late("other.test"))
def host_mismatch():
    c = socket.create_connection(("api.test", H), timeout=10)
    c.sendall(b"GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
    return c.recv(200).decode().split("\r\n")[0]
attempt("host_mismatch", host_mismatch)
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1)
    u.sendto(b"x", ("198.51.100.7", 123))
    try:
        return u.recv(10).decode()
    except socket.timeout:
        return "no answer"
attempt("udp", udp)
curl = subprocess.run(["curl", "-sS", "--noproxy", "*", "--cacert", os.environ["SSL_CERT_FILE"],
                       f"https://api.test:{S}/"], capture_output=True, text=True, timeout=30)
res["curl"] = curl.stdout or "refused: " + curl.stderr[:60]
node = subprocess.run(["node", "/code/probe.mjs"], capture_output=True, text=True, timeout=60)
res["node"] = json.loads(node.stdout) if node.returncode == 0 else "failed: " + node.stderr[-300:]
print(json.dumps(res), flush=True)
"""

NODE_GUEST = r"""
import https from "node:https";
const S = process.env.UP_HTTPS;
const get = () => new Promise((ok, no) => https.get(`https://api.test:${S}/`, (r) => {
  let b = ""; r.on("data", (d) => (b += d)); r.on("end", () => ok(b));
}).on("error", no));
const out = {};
try { out.https_get = await get(); } catch (e) { out.https_get = "refused: " + e.code; }
try { out.fetch = await (await fetch(`https://api.test:${S}/`)).text(); }
catch (e) { out.fetch = "refused: " + (e.cause?.code ?? e.message); }
console.log(JSON.stringify(out));
"""


def _site_packages() -> Path:
    import requests

    return Path(requests.__file__).resolve().parent.parent


# The ledger's engine is not what these test (the proxy path's tests run on both).
@pytest.mark.parametrize("store_engine", ["sqlite"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_programs_without_proxy_settings_are_brokered(
    ledger_env: LedgerEnv, upstreams: Upstreams, backend: str, tmp_path: Path
) -> None:
    if shutil.which("node") is None or shutil.which("curl") is None:
        pytest.skip("needs node and curl")
    ledger_env.ledger.create_log("acme", _draft())
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(PYTHON_GUEST)
    (code / "probe.mjs").write_text(NODE_GUEST)
    shutil.copy(upstreams.ca, code / "ca.pem")
    os.chmod(code, 0o755)
    for f in code.iterdir():
        f.chmod(0o644)
    scope = _scope(ledger_env.ledger, "t1", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=_resolver, connect_timeout=5)
    out: list[bytes] = []
    err: list[bytes] = []
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=300)
        network = GuestNetwork.create()
        try:
            broker.attach_network(scope.run_id, network)
            env = {"UP_HTTPS": str(upstreams.https), "UP_HTTP": str(upstreams.http),
                   "UP_ECHO": str(upstreams.echo), "SSL_CERT_FILE": "/code/ca.pem",
                   "REQUESTS_CA_BUNDLE": "/code/ca.pem",
                   "NODE_EXTRA_CA_CERTS": "/code/ca.pem"}  # fmt: skip
            spec = brokered_spec(channel, ("python3", "/code/main.py"), code_dir=code, env=env,
                                 limits=Limits(wall_seconds=120, memory_bytes=1 << 30, pids=256),
                                 network=network)  # fmt: skip
            site = _site_packages()
            spec = dataclasses.replace(
                spec,
                ro_dirs={**spec.ro_dirs, site: "/opt/site"},
                env={**spec.env, "PYTHONPATH": spec.env["PYTHONPATH"] + ":/opt/site"},
            )
            result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
        finally:
            broker.close_run(scope.run_id)
            network.close()
    stderr = b"".join(err).decode(errors="replace")
    assert result.exit_code == 0, stderr[-2000:]
    res = json.loads(b"".join(out).decode().strip().splitlines()[-1])
    hello = f"hello api.test:{upstreams.https}"
    # DNS inside the run answers from the reserved range: never the real address.
    assert res["resolved"].startswith("198.1"), res
    for client in ("urllib", "requests", "httpx", "aiohttp", "curl"):
        assert res[client] == hello, (client, res[client], stderr[-1500:])
    assert res["node"] == {"https_get": hello, "fetch": hello}, res["node"]
    assert res["urllib_http"] == f"hello api.test:{upstreams.http}"
    assert res["raw"] == "echo:ping"
    assert res["raw_literal"].startswith("refused"), res["raw_literal"]
    assert res["late_ok"] == "HTTP/1.1 200 OK", res["late_ok"]
    for refused in ("denied_name", "metadata", "sni_mismatch", "late_mismatch"):
        assert res[refused].startswith("refused"), (refused, res[refused])
    assert res["denied_http"] == 403
    assert res["host_mismatch"].startswith("HTTP/1.1 403"), res["host_mismatch"]
    assert res["udp"].startswith(("no answer", "refused")), res["udp"]

    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    decisions = [e for e in events if e["action"] == "http.request"]
    allowed = [e for e in decisions if e["decision"] == "allow"]
    # One decision per call: 4 Python HTTPS clients, plain HTTP, raw, 2 late TLS
    # (decided as raw TCP before their ClientHello came), curl, 2 node.
    assert len(allowed) == 11, [(e["resource"], e["details"].get("protocol")) for e in allowed]
    assert all(e["details"]["via"] == "transparent" for e in allowed)
    https_calls = [e for e in allowed if e["resource"] == f"host/api.test:{upstreams.https}"]
    assert len(https_calls) == 9
    assert [e["details"].get("sni") for e in https_calls].count("api.test") == 7
    assert all(e["details"]["address"] == "127.0.0.1" for e in allowed)
    raw = [e for e in allowed if e["resource"] == f"host/api.test:{upstreams.echo}"]
    assert [e["details"]["protocol"] for e in raw] == ["tcp"]
    assert [e["details"]["protocol"] for e in https_calls].count("tcp") == 2  # the late ones
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert sorted(e["details"]["decision_seq"] for e in ends) == sorted(e["seq"] for e in allowed)
    denied = {e["resource"]: e for e in decisions if e["decision"] != "allow"}
    assert f"host/other.test:{upstreams.https}" in denied
    assert f"host/other.test:{upstreams.http}" in denied
    metadata = [e for e in decisions if e["resource"] == "host/169.254.169.254:80"]
    assert {e["details"]["protocol"] for e in metadata} == {"http", "tcp"}
    assert all("proctor:egress:special-purpose-address" in e["policies"] for e in metadata)
    mismatches = [e for e in decisions if "proctor:egress:name-mismatch" in e["policies"]]
    assert {e["details"]["protocol"] for e in mismatches} == {"tls", "http"}
    late = [e for e in mismatches if e["details"].get("late")]
    assert [e["details"]["sni"] for e in late] == ["other.test"]
    assert "udp/198.51.100.7:123" in denied
    assert denied["udp/198.51.100.7:123"]["policies"] == ["proctor:egress:udp"]


def _draft() -> Any:
    return draft(0)


def test_interpreter_in_sandbox_is_the_one_with_these_packages() -> None:
    # The guest runs the host's base interpreter; the packages bound in must be
    # for its version, or the Python clients above test nothing.
    assert _site_packages().match(f"*/python{sys.version_info[0]}.{sys.version_info[1]}/*")


class _Authed(_Hello):
    def do_GET(self) -> None:
        ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
        body = f"{self.path} auth={'yes' if ok else 'no'}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


SECRET = "s3cr3t-" + os.urandom(8).hex()


@pytest.fixture
def authed(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An HTTPS API on loopback that says whether it got the secret: (port, its CA file)."""
    d = tmp_path / "up"
    d.mkdir()
    with https_upstream(_Authed, ["api.test"], d) as (port, ca):
        (d / "ca.pem").write_bytes(ca.pem())
        yield port, d / "ca.pem"


RULED_GUEST = r"""
import json, os, urllib.request, urllib.error
for k in [k for k in os.environ if k.lower().endswith("_proxy")]:
    del os.environ[k]
S = int(os.environ["UP_HTTPS"])
res = {}
for name, method, path in [("get", "GET", "/v1/customers/7"), ("delete", "DELETE", "/v1/customers/7"),
                           ("other_path", "GET", "/admin")]:
    req = urllib.request.Request(f"https://api.test:{S}{path}", method=method,
                                 headers={"Authorization": "Bearer proctor-secret:tok"})
    try:
        res[name] = urllib.request.urlopen(req, timeout=10).read().decode()
    except urllib.error.HTTPError as e:
        res[name] = e.code
print(json.dumps(res), flush=True)
"""


# The ledger's engine is not what these test (the proxy path's tests run on both).
@pytest.mark.parametrize("store_engine", ["sqlite"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_redirected_tls_to_a_host_with_a_secret_or_rules_is_ended_and_held(
    ledger_env: LedgerEnv, tmp_path: Path, backend: str, authed: tuple[int, Path]
) -> None:
    from proctor.broker import SecretBinding
    from proctor.policy import EgressRule, capability_policies

    port, upstream_ca = authed
    ledger_env.ledger.create_log("acme", _draft())
    entry = f"api.test:{port}"
    rules = {"methods": ["GET"], "paths": ["/v1/customers/*"]}
    caps = {"egress": [entry], "egress_rules": {entry: rules}, "secrets": ["tok"]}
    scope = _scope(ledger_env.ledger, "t2", allowed_ranges=("127.0.0.0/8",),
                   egress_rules={entry: EgressRule.from_json(entry, rules)},
                   secrets={"tok": SecretBinding("tok", SECRET, (entry,))})  # fmt: skip
    scope.policies = compile_policies(capability_policies("acme", "churn", caps))
    proxy = EgressProxy(tmp_path / "ca", resolver=_resolver, connect_timeout=5,
                        upstream_cafile=str(upstream_ca))  # fmt: skip
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(RULED_GUEST)
    (code / "ca.pem").write_bytes(proxy.tenant_ca("acme").ca_pem())
    os.chmod(code, 0o755)
    for f in code.iterdir():
        f.chmod(0o644)
    out: list[bytes] = []
    err: list[bytes] = []
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=300)
        network = GuestNetwork.create()
        try:
            broker.attach_network(scope.run_id, network)
            spec = brokered_spec(channel, ("python3", "/code/main.py"), code_dir=code,
                                 env={"UP_HTTPS": str(port), "SSL_CERT_FILE": "/code/ca.pem"},
                                 network=network)  # fmt: skip
            result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
        finally:
            broker.close_run(scope.run_id)
            network.close()
    assert result.exit_code == 0, b"".join(err).decode(errors="replace")[-2000:]
    res = json.loads(b"".join(out).decode().strip().splitlines()[-1])
    # The secret is injected inside the broker's TLS; the rules hold each request.
    assert res == {"get": "/v1/customers/7 auth=yes", "delete": 403, "other_path": 403}, res
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    allowed = [e for e in events if e["action"] == "http.request" and e["decision"] == "allow"]
    assert allowed and all(e["details"]["via"] == "transparent" for e in allowed)
    assert allowed[0]["details"]["inject"] == [{"secret": "tok", "header": "Authorization"}]
    refused = [p for e in events if e["decision"] != "allow" for p in e["policies"]]
    assert f"proctor:egress:rule:{entry}:methods" in refused
    assert f"proctor:egress:rule:{entry}:paths" in refused
    assert SECRET not in json.dumps(events)


JAVA_MAIN = r"""
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class Main {
    public static void main(String[] args) throws Exception {
        HttpClient client = HttpClient.newHttpClient();
        HttpRequest req = HttpRequest.newBuilder(URI.create(args[0])).build();
        System.out.println(client.send(req, HttpResponse.BodyHandlers.ofString()).body());
    }
}
"""

GO_MAIN = r"""
package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
)

func main() {
	pool := x509.NewCertPool()
	pem, _ := os.ReadFile("/code/ca.pem")
	pool.AppendCertsFromPEM(pem)
	client := &http.Client{Transport: &http.Transport{
		Proxy:           nil,
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}}
	resp, err := client.Get(os.Args[1])
	if err != nil {
		fmt.Println("refused:", err)
		return
	}
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(string(body))
}
"""


def _compiled(tmp: Path, code: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The programs this host can build: (name, argv in the guest)."""
    import subprocess

    programs: list[tuple[str, tuple[str, ...]]] = []
    if shutil.which("javac") and shutil.which("keytool") and shutil.which("java"):
        (tmp / "Main.java").write_text(JAVA_MAIN)
        subprocess.run(["javac", "-d", str(code), str(tmp / "Main.java")], check=True)
        subprocess.run(["keytool", "-importcert", "-noprompt", "-storetype", "PKCS12",
                        "-keystore", str(code / "trust.p12"), "-storepass", "changeit",
                        "-alias", "test", "-file", str(code / "ca.pem")],
                       check=True, capture_output=True)  # fmt: skip
        java = os.path.realpath(shutil.which("java") or "java")  # not /etc/alternatives
        programs.append(("java", (java, "-Djavax.net.ssl.trustStore=/code/trust.p12",
                                   "-Djavax.net.ssl.trustStorePassword=changeit",
                                   "-cp", "/code", "Main")))  # fmt: skip
    if shutil.which("go"):
        (tmp / "main.go").write_text(GO_MAIN)
        env = {**os.environ, "CGO_ENABLED": "0", "GOCACHE": str(tmp / "gocache"),
               "GOPATH": str(tmp / "gopath"), "GOFLAGS": "-mod=mod"}  # fmt: skip
        subprocess.run(["go", "build", "-o", str(code / "probe"), str(tmp / "main.go")],
                       check=True, env=env, capture_output=True, timeout=300)  # fmt: skip
        programs.append(("go", ("/code/probe",)))
    return programs


# The ledger's engine is not what these test (the proxy path's tests run on both).
@pytest.mark.parametrize("store_engine", ["sqlite"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_java_and_go_without_proxy_settings_are_brokered(
    ledger_env: LedgerEnv, upstreams: Upstreams, backend: str, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(upstreams.ca, code / "ca.pem")
    programs = _compiled(tmp_path, code)
    if not programs:
        pytest.skip("needs a JDK or Go")
    os.chmod(code, 0o755)
    for f in code.iterdir():
        f.chmod(0o755)
    ledger_env.ledger.create_log("acme", _draft())
    scope = _scope(ledger_env.ledger, "t3", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=_resolver, connect_timeout=5)
    url = f"https://api.test:{upstreams.https}/"
    outputs: dict[str, str] = {}
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        for name, argv in programs:
            run_id = f"t3-{name}"
            run_scope = dataclasses.replace(scope, run_id=run_id)
            channel = broker.open_run(run_scope, ttl=300)
            network = GuestNetwork.create()
            out: list[bytes] = []
            err: list[bytes] = []
            try:
                broker.attach_network(run_id, network)
                spec = brokered_spec(channel, (*argv, url), code_dir=code, network=network,
                                     limits=Limits(wall_seconds=120, memory_bytes=1 << 30,
                                                   pids=256))  # fmt: skip
                result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
            finally:
                broker.close_run(run_id)
                network.close()
            assert result.exit_code == 0, (name, b"".join(err).decode(errors="replace")[-1500:])
            outputs[name] = b"".join(out).decode().strip().splitlines()[-1]
    assert outputs == {name: f"hello api.test:{upstreams.https}" for name, _ in programs}
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    allowed = [e for e in events if e["action"] == "http.request" and e["decision"] == "allow"]
    assert len(allowed) == len(programs), [e["details"] for e in allowed]
    # A JVM slow to send its ClientHello (gVisor under load) is decided as raw TCP
    # first and its ClientHello held to the name when it comes (the late path).
    seen = [(e["details"]["protocol"], e["details"].get("sni")) for e in allowed]
    assert all(e["details"]["via"] == "transparent" for e in allowed)
    assert all(p == ("tls", "api.test") or p == ("tcp", None) for p in seen), seen


def test_a_warm_pool_never_shares_a_run_network() -> None:
    from proctor.sandbox import GVisorDriver, SandboxSpec, SandboxSpecInvalid, WarmPool

    network = GuestNetwork.create()
    try:
        spec = SandboxSpec(argv=("python3", "-c", "pass"), network=network)
        with pytest.raises(SandboxSpecInvalid, match="network"):
            WarmPool(GVisorDriver(), spec)
    finally:
        network.close()


def test_the_guest_resolv_conf_names_the_relay() -> None:
    from proctor.sandbox._network import NET_FILES, RELAY_ADDRESS

    assert f"nameserver {RELAY_ADDRESS}\n" in (NET_FILES / "resolv.conf").read_text()
