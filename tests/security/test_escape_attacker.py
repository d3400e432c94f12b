"""One attacker, every way out, in one governed run; and the per-run call limit.

The centrepiece is ``test_the_attacker_gets_nowhere_and_every_refusal_is_on_record``:
an artifact (``tests/security/attacker/attacker.py``) deployed and run like any
other, in a real gVisor sandbox with the real broker, tries in one run the host's
files, /proc and devices, a direct connection, SSRF through the broker, an
unapproved column, bucket and host, three ways to get a secret's value out,
another live run's scratch and broker socket, the tenant CA (its key, and a
blind tunnel it would have to forge), and a flood of the ledger. The test
replays the attacker's token on other runs' sockets from the host, checks every
verdict, and finds each refusal in the tenant's ledger with its decision.

Before it: the call limiter's arithmetic (a fake clock), the limit through a
real Broker on a real ledger, tokens that die with their socket, and the
tenant CA's name constraints against real TLS handshakes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from proctor.broker import (
    SECRET_BINDING_RULE,
    Broker,
    CAError,
    EgressProxy,
    Handlers,
    RunScope,
    SecretBinding,
    TenantCA,
)
from proctor.broker._mitm import name_constraints
from proctor.broker._scope import (
    DEFAULT_CALL_BURST,
    DEFAULT_CALLS_PER_SECOND,
    RATE_LIMIT_RULE,
    CallLimiter,
    RateLimit,
)
from proctor.errors import UsageError
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.lifecycle import Supervisor
from proctor.policy import capability_policies, compile_policies
from proctor.sandbox._rootfs import host_interpreter
from proctor.store import open_store
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import Upstream, UpstreamCA
from tests.sandbox_conftest_helpers import any_backend

SOAK = os.environ.get("PROCTOR_SOAK") == "1"
ATTACKER = Path(__file__).with_name("attacker") / "attacker.py"
# The soak walks every name under /usr too (~40 s in gVisor) and floods 10x longer.
RUN_SECONDS = 600 if SOAK else 150


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the limiter's arithmetic ------------------------------------------------------


def test_the_bucket_lets_a_burst_through_then_refills_at_its_rate() -> None:
    clock = FakeClock()
    limiter = CallLimiter(RateLimit(per_second=10, burst=5), clock)
    assert [limiter.take() for _ in range(7)] == [True] * 5 + [False] * 2
    assert limiter.pending == 2 and limiter.refused_total == 2
    clock.now += 0.25  # 2.5 tokens back
    assert [limiter.take() for _ in range(3)] == [True, True, False]
    clock.now += 60  # a long pause refills only up to the burst
    assert sum(limiter.take() for _ in range(20)) == 5
    count, seconds = limiter.take_pending()
    assert count == 3 + 15 and seconds == pytest.approx(60.25)
    assert limiter.take_pending() == (0, 0.0)
    assert limiter.refused_total == 18
    limiter.give_back(4, 2.0)  # a count that could not be recorded waits for the next
    assert limiter.take_pending() == (4, pytest.approx(2.0))


def test_the_default_limit_lets_the_load_test_through_and_stops_a_flood() -> None:
    assert (DEFAULT_CALLS_PER_SECOND, DEFAULT_CALL_BURST) == (1000.0, 2000)
    # 32 runs of 1,000 calls each at 400 calls/s, each run its own bucket.
    for _ in range(32):
        clock = FakeClock()
        limiter = CallLimiter(RateLimit(), clock)
        for _ in range(1000):
            assert limiter.take()
            clock.now += 1 / 400
    # A run's 1,000 calls all at once fit in the burst.
    limiter = CallLimiter(RateLimit(), FakeClock())
    assert all(limiter.take() for _ in range(1000))
    # 1,500 calls/s for 10 s: the burst lasts 4 s, then 500 of each second's 1,500 are refused.
    clock = FakeClock()
    limiter = CallLimiter(RateLimit(), clock)
    passed = 0
    for _ in range(15_000):
        passed += limiter.take()
        clock.now += 1 / 1500
    assert abs(passed - (2000 + 10 * 1000)) <= 2
    assert limiter.refused_total == 15_000 - passed


@pytest.mark.parametrize(
    ("per_second", "burst"),
    [(0, 10), (-1, 10), (float("nan"), 10), (float("inf"), 10), (10, 0), (10, -5), (10, True)],
)
def test_a_nonsensical_limit_is_refused(per_second: float, burst: int) -> None:
    with pytest.raises(UsageError):
        RateLimit(per_second=per_second, burst=burst)


# -- the limit through a real broker ------------------------------------------------


async def _never(*args: Any) -> Any:
    raise AssertionError("this test makes no data-plane call")


NO_CALLS = Handlers(connect=_never, forward=_never)
ARTIFACT = "sha256:" + "ab" * 32


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    store = open_store(str(tmp_path / "proctor.db"), create=True)
    led = Ledger(store, Signer.generate("test.local"), "test.local")
    led.create_log("acme", EventDraft(Actor("operator", "test"), "tenant.create", "tenant/acme"))
    yield led
    led.close()
    store.close()


def _scope(led: Ledger, run: str, artifact: str = ARTIFACT, **kw: Any) -> RunScope:
    return RunScope(
        tenant="acme",
        run_id=run,
        workload=f"spiffe://test.local/tenant/acme/deployment/churn/run/{run}",
        deployment="churn",
        artifact=artifact,
        approvals=(),
        environment="sandbox",
        ledger=led,
        **{"policies": compile_policies(""), **kw},
    )


def _call(path: Path, token: str | None) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One request on a broker socket, from the host: (status, headers, JSON body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        head = "GET /v1/whoami HTTP/1.1\r\n" + (f"Proctor-Token: {token}\r\n" if token else "")
        s.sendall((head + "\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers[":status-line"] = lines[0]
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def _events(led: Ledger, run: str | None = None) -> list[dict[str, Any]]:
    events = [json.loads(e) for e in led.entries("acme")]
    return [e for e in events if run is None or e.get("run") == run]


def test_a_flood_is_answered_429_and_counted_in_one_event_per_window(ledger: Ledger) -> None:
    calls = 3000 if SOAK else 600
    with Broker(NO_CALLS, os.urandom(32), rate_limit=RateLimit(per_second=40, burst=20)) as b:
        channel = b.open_run(_scope(ledger, "r1"), ttl=60)
        quiet = b.open_run(_scope(ledger, "r2", rate_limit=RateLimit(per_second=5, burst=5)), 60)
        statuses: dict[int, int] = {}
        limited: list[tuple[dict[str, str], dict[str, Any]]] = []
        lock = threading.Lock()

        def worker(n: int, k: int) -> None:
            for i in range(n):
                # Half forged (each a broker.auth event), half good (each a broker.whoami).
                token = channel.token if (i + k) % 2 else "pt1.r1.1.forged"
                status, headers, body = _call(channel.socket, token)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    if status == 429 and len(limited) < 3:
                        limited.append((headers, body))

        started = time.monotonic()
        threads = [threading.Thread(target=worker, args=(calls // 4, k)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        # Another run's bucket is its own: r1's flood leaves r2 its whole budget.
        assert [_call(quiet.socket, quiet.token)[0] for _ in range(5)] == [200] * 5
        assert _call(quiet.socket, quiet.token)[0] == 429
        time.sleep(1.3)  # a window passes: the count is recorded while the run is open
        open_counts = [e for e in _events(ledger, "r1") if e["action"] == "broker.rate_limited"]
        assert open_counts, "no broker.rate_limited event within a window of the refusals"
        b.close_run("r1")
        b.close_run("r2")

    assert set(statuses) <= {200, 401, 429}, statuses
    passed = statuses.get(200, 0) + statuses.get(401, 0)
    refused = statuses[429]
    assert passed + refused == calls
    assert passed <= 20 + 40 * elapsed + 1, (statuses, elapsed)
    assert refused >= calls - (20 + 40 * elapsed + 1)
    headers, body = limited[0]
    assert headers[":status-line"] == "HTTP/1.1 429 Too Many Requests"
    assert headers["Retry-After"] == "1"
    assert body["error"] == "rate_limited" and body["policies"] == [RATE_LIMIT_RULE]

    r1 = _events(ledger, "r1")
    auth = [e for e in r1 if e["action"] == "broker.auth"]
    assert len(auth) == statuses[401], "every forged call that got through is recorded"
    assert all(e["decision"] == "deny" for e in auth)
    counted = [e for e in r1 if e["action"] == "broker.rate_limited"]
    assert sum(e["details"]["refused"] for e in counted) == refused
    assert counted[-1]["details"]["refused_total"] == refused
    assert len(counted) <= elapsed / 1.0 + 3, "at most one event per window (and one at close)"
    for e in counted:
        assert e["decision"] == "deny" and e["policies"] == [RATE_LIMIT_RULE]
        assert e["resource"] == "run/r1" and e["actor"]["id"].endswith("/run/r1")
        assert e["details"]["per_second"] == 40 and e["details"]["burst"] == 20
    whoami = [e for e in r1 if e["action"] == "broker.whoami"]
    assert len(whoami) == statuses.get(200, 0), "every good call that got through is recorded"
    assert len(r1) == len(auth) + len(whoami) + len(counted), "nothing else for the flood"
    r2 = [e for e in _events(ledger, "r2") if e["action"] == "broker.rate_limited"]
    assert [e["details"]["refused"] for e in r2] == [1]
    assert ledger.verify("acme").size == len(_events(ledger))


def test_a_token_dies_with_its_socket_and_a_replay_on_another_run_is_named(
    ledger: Ledger,
) -> None:
    with Broker(NO_CALLS, os.urandom(32)) as b:
        first = b.open_run(_scope(ledger, "r1"), ttl=600)
        other = b.open_run(_scope(ledger, "r2", artifact="sha256:" + "cd" * 32), ttl=600)
        assert _call(first.socket, first.token)[0] == 200
        # r1's token on r2's socket while r1 is open: refused, and named for what it is.
        status, _, body = _call(other.socket, first.token)
        assert (status, body["error"]) == (401, "unauthenticated")
        assert body["message"] == "token belongs to another run"
        b.close_run("r1")
        assert not first.socket.exists()
        with pytest.raises(OSError):
            _call(first.socket, first.token)
        # The same run id opened again (the supervisor never does; a bug might): the
        # first opening's token, not expired, is dead all the same.
        again = b.open_run(_scope(ledger, "r1"), ttl=600)
        status, _, body = _call(again.socket, first.token)
        assert (status, body["message"]) == (
            401,
            "token signature does not match this run and artifact",
        )
        assert _call(again.socket, again.token)[0] == 200
        # The ended opening's token on another open run is refused as a forgery.
        status, _, body = _call(other.socket, first.token)
        assert (status, body["message"]) == (
            401,
            "token signature does not match this run and artifact",
        )
    auth = [e for e in _events(ledger) if e["action"] == "broker.auth"]
    assert [(e["run"], e["decision"], e["reason"]) for e in auth] == [
        ("r2", "deny", "token belongs to another run"),
        ("r1", "deny", "token signature does not match this run and artifact"),
        ("r2", "deny", "token signature does not match this run and artifact"),
    ]


def _secret_upstream(
    tmp_path: Path,
) -> tuple[Upstream, EgressProxy, Handlers, str, SecretBinding, str]:
    """A TLS upstream on loopback whose credential the broker injects, and its proxy."""
    ca = UpstreamCA.make()
    (tmp_path / "up-ca.pem").write_bytes(ca.pem())
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(ca.issue(["localhost"], tmp_path / "up.pem"))
    upstream = Upstream(tls)
    # One response is two writes (head, body): without TCP_NODELAY each request waits
    # out a delayed ACK (~40 ms).
    upstream.RequestHandlerClass = type("NoDelay", (upstream.RequestHandlerClass,),
                                        {"disable_nagle_algorithm": True})  # fmt: skip
    proxy = EgressProxy(tmp_path / "ca", upstream_cafile=str(tmp_path / "up-ca.pem"))
    handlers = Handlers.for_proxy(proxy)
    host = f"localhost:{upstream.port}"
    secret = SecretBinding("api", "value-" + os.urandom(8).hex(), (host,))
    policies = capability_policies("acme", "churn", {"egress": [host], "secrets": ["api"]})
    return upstream, proxy, handlers, host, secret, policies


def test_a_kept_alive_connection_cannot_flood_the_ledger(ledger: Ledger, tmp_path: Path) -> None:
    """Requests inside one CONNECT (TLS terminated to inject a secret) are not recorded
    one by one: the connection was charged and decided once, and its events are a
    constant few however many requests it carries."""
    upstream, proxy, handlers, host, secret, policies = _secret_upstream(tmp_path)
    requests = 2000 if SOAK else 300
    with Broker(handlers, os.urandom(32)) as b:
        scope = _scope(ledger, "r1", policies=compile_policies(policies),
                       secrets={"api": secret}, allowed_ranges=("127.0.0.0/8",))  # fmt: skip
        channel = b.open_run(scope, ttl=60)
        client = ssl.create_default_context(cadata=proxy.tenant_ca("acme").ca_pem().decode())
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(10)
        raw.connect(str(channel.socket))
        raw.sendall(f"CONNECT {host} HTTP/1.1\r\nProctor-Token: {channel.token}\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with client.wrap_socket(raw, server_hostname="localhost") as t:
            reader = t.makefile("rb")
            for i in range(requests):
                t.sendall(f"GET /n/{i} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                assert reader.readline().startswith(b"HTTP/1.1 200")
                length = 0
                while (line := reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                assert reader.read(length) == f"hello GET /n/{i} 0".encode()
        b.close_run("r1")
    upstream.shutdown()
    assert len(upstream.seen) == requests
    assert all(s["headers"]["Authorization"] == f"Bearer {secret.value}" for s in upstream.seen)
    events = _events(ledger, "r1")
    assert [e["action"] for e in events] == ["http.request", "http.request.end"]
    assert events[-1]["details"]["requests"] == requests


def test_requests_inside_a_kept_alive_connection_are_charged_too(
    ledger: Ledger, tmp_path: Path
) -> None:
    upstream, proxy, handlers, host, secret, policies = _secret_upstream(tmp_path)
    statuses = []
    with Broker(handlers, os.urandom(32), rate_limit=RateLimit(per_second=0.5, burst=10)) as b:
        scope = _scope(ledger, "r1", policies=compile_policies(policies),
                       secrets={"api": secret}, allowed_ranges=("127.0.0.0/8",))  # fmt: skip
        channel = b.open_run(scope, ttl=60)
        client = ssl.create_default_context(cadata=proxy.tenant_ca("acme").ca_pem().decode())
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(10)
        raw.connect(str(channel.socket))
        raw.sendall(f"CONNECT {host} HTTP/1.1\r\nProctor-Token: {channel.token}\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with client.wrap_socket(raw, server_hostname="localhost") as t:
            reader = t.makefile("rb")
            for i in range(30):
                t.sendall(f"GET /n/{i} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                status = int(reader.readline().split()[1])
                statuses.append(status)
                length = 0
                while (line := reader.readline()) != b"\r\n":
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = reader.read(length)
                if status == 429:
                    assert json.loads(body)["error"] == "rate_limited"
                    break
        b.close_run("r1")
    upstream.shutdown()
    # The CONNECT took one token of ten, the first request rode on it: ten requests.
    assert statuses == [200] * 10 + [429]
    events = _events(ledger, "r1")
    assert [e["action"] for e in events] == [
        "http.request", "http.request.end", "broker.rate_limited",
    ]  # fmt: skip
    assert events[1]["details"]["requests"] == 10 and events[2]["details"]["refused"] == 1


# -- the tenant CA's name constraints ------------------------------------------------


def _handshake(ca: TenantCA, trust_pem: bytes, leaf_host: str, tmp: Path) -> str:
    """A real TLS handshake on loopback: a server with the tenant CA's leaf for
    ``leaf_host``, a client trusting ``trust_pem`` only; 'ok' or OpenSSL's reason."""
    server_ctx = ca.server_context(leaf_host)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ssl.SSLError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    bundle = tmp / f"trust-{os.urandom(4).hex()}.pem"
    bundle.write_bytes(trust_pem)
    client = ssl.create_default_context(cafile=str(bundle))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client.wrap_socket(raw, server_hostname=leaf_host),
        ):
            return "ok"
    except ssl.SSLCertVerificationError as exc:
        return str(exc.verify_message)
    finally:
        listener.close()
        thread.join(5)


def test_the_tenant_ca_given_to_a_sandbox_vouches_only_for_the_secrets_hosts(
    tmp_path: Path,
) -> None:
    ca = TenantCA(tmp_path / "ca", "acme")
    hosts = ["localhost:8443", "127.0.0.1:9443", "*.api.example"]
    constrained = ca.ca_pem(hosts)
    for good in ("localhost", "127.0.0.1", "eu.api.example", "a.b.api.example"):
        assert _handshake(ca, constrained, good, tmp_path) == "ok", good
    # A leaf of the same CA for any other name (a broker bug, or a stolen key):
    # the unconstrained certificate would accept it; the constrained one does not.
    for bad in ("evil.example", "api.example", "127.0.0.2", "::1", "localhost.evil.example"):
        assert _handshake(ca, ca.ca_pem(), bad, tmp_path) == "ok", bad
        assert "subtree violation" in _handshake(ca, constrained, bad, tmp_path), bad
    # No secret hosts: it vouches for nothing.
    nothing = ca.ca_pem([])
    for host in ("localhost", "127.0.0.1"):
        assert "subtree violation" in _handshake(ca, nothing, host, tmp_path)
    # Only names: no address at all, and the other way round.
    assert "subtree violation" in _handshake(ca, ca.ca_pem(["localhost"]), "127.0.0.1", tmp_path)
    assert "subtree violation" in _handshake(ca, ca.ca_pem(["127.0.0.1"]), "localhost", tmp_path)
    constraints = name_constraints(hosts)
    assert constraints.permitted_subtrees is not None
    assert {g.value for g in constraints.permitted_subtrees} >= {"localhost", ".api.example"}
    with pytest.raises(CAError):
        ca.ca_pem(["bad host/x"])
    assert b"PRIVATE KEY" not in constrained


# -- the attacker, end to end ---------------------------------------------------------

SECRET = "s3cr3t-" + os.urandom(12).hex()
VICTIM = r"""
import os, time
marker = os.environ["VICTIM_MARKER_A"] + os.environ["VICTIM_MARKER_B"]
os.makedirs("/tmp/work/deep", exist_ok=True)
for path in ("/tmp/marker.txt", "/tmp/work/deep/notes"):
    with open(path, "w") as f:
        f.write("customer notes " + marker)
assert open("/tmp/marker.txt").read().endswith(marker)
print("READY", os.environ["PROCTOR_RUN"], flush=True)
time.sleep(600)
"""


class _Upstream(BaseHTTPRequestHandler):
    """The secret's host (checks the injected credential) or the plain one (echoes)."""

    protocol_version = "HTTP/1.1"
    received: list[bytes]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.received.append(str(self.headers).encode())
        if self.path == "/echo":
            body = str(self.headers).encode()
        else:
            ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
            body = b"authorized" if ok else b"no credentials"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _tls_server(ca: UpstreamCA, d: Path, name: str) -> tuple[ThreadingHTTPServer, list[bytes]]:
    received: list[bytes] = []
    handler = type(f"Upstream_{name}", (_Upstream,), {"received": received})
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["localhost", "127.0.0.1"], d / f"{name}.pem"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, received


class _Run:
    """A run started in a thread of its own, its output collected line by line."""

    def __init__(self, sup: Supervisor, deployment: str, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.stderr: list[bytes] = []
        self._buf = b""
        self._changed = threading.Condition()
        self.cancel = threading.Event()
        self.record: Any = None
        self.error: BaseException | None = None

        def on_stdout(data: bytes) -> None:
            with self._changed:
                self._buf += data
                *done, self._buf = self._buf.split(b"\n")
                self.lines += [line.decode(errors="replace") for line in done]
                self._changed.notify_all()

        def target() -> None:
            try:
                self.record = sup.start("acme", deployment, Actor("operator", "test"),
                                        on_stdout=on_stdout, on_stderr=self.stderr.append,
                                        cancel=self.cancel, env=env)  # fmt: skip
            except BaseException as exc:
                self.error = exc
            with self._changed:
                self._changed.notify_all()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def wait_line(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line[len(prefix) :].strip()
                left = deadline - time.monotonic()
                if left <= 0 or (not self.thread.is_alive() and self.record is not None):
                    err = b"".join(self.stderr).decode(errors="replace")[-3000:]
                    raise AssertionError(f"no {prefix!r} line: {self.lines} {self.error}\n{err}")
                self._changed.wait(min(left, 0.5))

    def finish(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not end"
        assert self.error is None, self.error
        return self.record


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _deploy(gov: Gov, name: str, main: str, manifest: str, env: str = "sandbox") -> None:
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir(name, main, manifest))
    if env == "production":
        rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), name, environment=env,
                          instruction="escape test", actor=gov.op)  # fmt: skip


@pytest.mark.sandbox
def test_the_attacker_gets_nowhere_and_every_refusal_is_on_record(gov: Gov, tmp_path: Path) -> None:
    rt = gov.rt
    backend = any_backend()[0]  # gVisor where it works
    up_ca = UpstreamCA.make()
    (tmp_path / "up-ca.pem").write_bytes(up_ca.pem())
    secret_server, secret_seen = _tls_server(up_ca, tmp_path, "secret")
    plain_server, plain_seen = _tls_server(up_ca, tmp_path, "plain")
    secret_port, plain_port = secret_server.server_address[1], plain_server.server_address[1]
    plain_der = x509.load_pem_x509_certificate((tmp_path / "plain.pem").read_bytes()).public_bytes(
        serialization.Encoding.DER
    )
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    host_port = listener.getsockname()[1]
    host_file = tmp_path / "host-only.txt"
    host_file.write_text(SECRET)
    marker_a, marker_b = "proctor-scratch-", os.urandom(8).hex()
    host_process = f"proctor-host-process-{os.urandom(4).hex()}"

    # The attacker's budget, from its manifest: low, so that the flood outruns it however
    # loaded the machine is (the ~30 calls before the flood fit in the burst).
    rate = RateLimit(per_second=10, burst=100)
    rt.resources.set_secret("acme", "api_token", SECRET, [f"localhost:{secret_port}"], gov.op)
    rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)
    rt.subprocessors.add("acme", "upstream-co", purpose="test upstreams", location="here",
                         hosts=[f"localhost:{secret_port}", f"localhost:{plain_port}"],
                         actor=gov.op)  # fmt: skip
    # Approved code, the strongest case: the real secret and production egress.
    _deploy(gov, "attacker", ATTACKER.read_text(), f"""
        [datasets.fake.tables.customers]
        columns = ["id", "country"]
        access = "read"
        [egress]
        hosts = ["localhost:{secret_port}", "localhost:{plain_port}"]
        [secrets]
        names = ["api_token"]
        [buckets]
        reports = "write"
        [limits]
        timeout = "{RUN_SECONDS}s"
        calls_per_second = {rate.per_second}
        call_burst = {rate.burst}
        """, env="production")  # fmt: skip
    _deploy(gov, "victim", VICTIM, f'[limits]\ntimeout = "{RUN_SECONDS}s"\n')
    flood_calls = 20_000 if SOAK else 2_000
    victim_env = {"VICTIM_MARKER_A": marker_a, "VICTIM_MARKER_B": marker_b}
    log_before = len(_events(rt.ledger))

    decoy = subprocess.Popen(["/bin/sh", "-c", "sleep 300", host_process])
    started: list[_Run] = []
    try:
        with rt.make_broker(upstream_cafile=str(tmp_path / "up-ca.pem")) as broker:
            sup = Supervisor(rt, broker, backend)
            victim = _Run(sup, "victim", victim_env)
            started.append(victim)
            victim_run = victim.wait_line("READY")
            victim_socket = broker.socket_path(victim_run)
            assert victim_socket is not None and victim_socket.exists()
            facts = {
                "host_file": str(host_file), "host_port": host_port,
                "host_process_marker": host_process, "secret_port": secret_port,
                "plain_port": plain_port, "secret_name": "api_token",
                "plain_fingerprint": hashlib.sha256(plain_der).hexdigest(),
                "other_socket": str(victim_socket), "prefix": str(host_interpreter().prefix),
                "flood_calls": flood_calls, "flood_threads": 4, "full_walk": SOAK,
                "ro_binds": ["/usr", str(host_interpreter().prefix)],
            }  # fmt: skip
            # The attacker knows the marker it looks for, in halves: its own
            # environment must not hold it whole.
            attacker = _Run(sup, "attacker", {"ATTACK_FACTS": json.dumps(facts),
                                               "MARKER_A": marker_a, "MARKER_B": marker_b})  # fmt: skip
            started.append(attacker)
            stolen = json.loads(attacker.wait_line("TOKEN"))
            attacker_socket = broker.socket_path(stolen["run"])
            assert attacker_socket is not None
            # From the host, the attacker's token on the live victim's socket.
            on_victim = _call(victim_socket, stolen["token"])
            attacker.wait_line("DONE", timeout=RUN_SECONDS)
            attacker_record = attacker.finish()
            # After the attacker's run: its socket is gone, and a later run refuses its token.
            assert not attacker_socket.exists()
            with pytest.raises(OSError):
                _call(attacker_socket, stolen["token"])
            later = _Run(sup, "victim", victim_env)
            started.append(later)
            later_run = later.wait_line("READY")
            later_socket = broker.socket_path(later_run)
            assert later_socket is not None
            on_later = _call(later_socket, stolen["token"])
            victim.cancel.set()
            later.cancel.set()
            assert victim.finish().status == later.finish().status == "stopped"
    finally:
        for run in started:  # on a failure, nothing left running
            run.cancel.set()
            run.thread.join(30)
        decoy.kill()
        decoy.wait()
        secret_server.shutdown()
        plain_server.shutdown()

    out = "\n".join(attacker.lines)
    verdict = json.loads(attacker.wait_line("VERDICT"))
    attempts = {k: v for k, v in verdict.items() if isinstance(v, dict) and "escaped" in v}
    assert len(attempts) == 16, sorted(attempts)
    escaped = {k: v["detail"] for k, v in attempts.items() if v["escaped"]}
    assert escaped == {}, escaped
    assert attacker_record.status == "succeeded", attacker_record

    # The attempts really were made, and failed for the right reason.
    walk = verdict["walk"]
    assert walk["control"] == ["/tmp/own/deeper/control.txt"], "the walk reads the scratch"
    assert walk["paths"] > (100_000 if SOAK else 20) and walk["files"] >= 5, walk
    # What a quick walk leaves out are the read-only binds of host directories.
    assert all(o.split(",")[0] == "ro" for o in verdict["skipped_mounts"].values())
    assert set(verdict["skipped_mounts"]) <= {"/usr", str(host_interpreter().prefix)}
    assert attempts["unapproved_host"]["detail"] == "status 403"
    assert json.loads(attempts["ssrf_loopback_via_broker"]["detail"]) and all(
        c == 403 for c in json.loads(attempts["ssrf_loopback_via_broker"]["detail"]).values()
    )
    assert attempts["secret_domain_fronting"]["detail"].startswith("HTTP/1.1 403")
    assert str(victim_socket) in attempts["other_broker_sockets"]["detail"]
    assert "reached []" in attempts["other_broker_sockets"]["detail"]
    assert "bundle.pem" in attempts["ca_private_key"]["detail"]
    tenant_ca = x509.load_pem_x509_certificate(verdict["tenant_ca_pem"].encode())
    assert tenant_ca.subject.rfc4514_string() == "CN=Proctor egress CA for acme,O=Proctor"
    # Constrained to the run's one secret host: it vouches for no other name.
    constraints = tenant_ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    assert [g.value for g in constraints.value.permitted_subtrees or []] == ["localhost"]
    assert any(b"proctor-secret:api_token" in h for h in plain_seen), "the blind tunnel worked"
    assert secret_seen == [], "the fronted request never reached the secret's host"
    assert not any(SECRET.encode() in h for h in plain_seen)
    assert SECRET not in out and "PRIVATE KEY" not in out
    with pytest.raises(TimeoutError):
        listener.accept()  # the direct connection never reached the host
    listener.close()

    # The token replays, from the host.
    assert on_victim[0] == 401 and on_victim[2]["message"] == "token belongs to another run"
    assert on_later[0] == 401
    assert on_later[2]["message"] == "token signature does not match this run and artifact"

    # The ledger holds each refusal with its decision.
    run_a = stolen["run"]
    events = _events(rt.ledger)
    mine = [e for e in events if e.get("run") == run_a]
    denied = {(e["action"], e["resource"]) for e in mine if e["decision"] == "deny"}
    for resource in (f"host/127.0.0.1:{host_port}", f"host/localhost:{host_port}",
                     "host/169.254.169.254:80", "host/exfil.example:80"):  # fmt: skip
        assert ("http.request", resource) in denied, resource
    assert ("file.write", "bucket/other/loot.txt") in denied
    secret_denies = [e for e in mine if e["action"] == "secret.use" and e["decision"] == "deny"]
    assert len(secret_denies) == 2
    assert all(e["policies"] == [SECRET_BINDING_RULE] for e in secret_denies)
    # Three blind tunnels to the host without a secret: admitted, and nothing injected.
    plain = [e for e in mine if e["resource"] == f"host/localhost:{plain_port}"]
    assert [e["action"] for e in plain if e["decision"] == "allow"].count("http.request") == 3
    ends = [e for e in plain if e["action"] == "http.request.end"]
    assert len(ends) == 3 and not any("secrets" in e["details"] for e in ends)
    replays = [(e["run"], e["reason"]) for e in events if e["action"] == "broker.auth"
               and e["run"] in (victim_run, later_run)]  # fmt: skip
    assert replays == [(victim_run, "token belongs to another run"),
                       (later_run, "token signature does not match this run and artifact")]  # fmt: skip

    # The flood: refused by the limit, counted, and the ledger grew by far less.
    counts = {int(k): v for k, v in verdict["flood_counts"].items()}
    attempted = verdict["flood_attempted"]
    assert sum(counts.values()) == attempted and set(counts) <= {401, 403, 429}, counts
    limited = [e for e in mine if e["action"] == "broker.rate_limited"]
    assert sum(e["details"]["refused"] for e in limited) == counts[429]
    assert all(e["decision"] == "deny" and e["policies"] == [RATE_LIMIT_RULE] for e in limited)
    assert len(limited) <= verdict["flood_seconds"] + 3
    # Every flood call that got through is recorded: forged tokens and denied queries.
    flood_auth = [e for e in mine if e["action"] == "broker.auth"]
    assert len(flood_auth) == counts.get(401, 0)
    sql_denies = [e for e in mine if e["action"] == "sql.select" and e["decision"] == "deny"]
    assert len(sql_denies) == counts.get(403, 0) + 1  # and the unapproved column before
    end = next(e for e in mine if e["action"] == "run.end")
    assert all(e["seq"] < end["seq"] for e in limited), "all counted before the run ended"
    passed = counts.get(401, 0) + counts.get(403, 0)
    assert passed <= rate.burst + rate.per_second * verdict["flood_seconds"] + 1, counts
    assert counts[429] > attempted * 0.5
    assert len(mine) < attempted / 4, (len(mine), attempted)
    assert len(events) - log_before < attempted / 3
    report = rt.ledger.verify("acme")
    assert report.size == len(events)
