"""The injected secret never comes back, and no guest byte rides on an injected request.

Issue 13, item 4: the placeholder was replaced in every header value, so an
upstream that echoes one header (a request id, CORS ``Origin``) handed the real
secret back to the guest; and the requests of one guest shared one upstream
connection with the secret injected in each, so a GET whose body the upstream
did not read became a second request that stored the next request's
``Authorization`` header, which the guest then read back.

Real servers on loopback, started here: an echoing upstream (every request
header back in the response headers and the body) and a keep-alive upstream
that leaves GET bodies unread and stores what is POSTed to ``/store``. The
guest is a raw TLS client through the real proxy, trusting only the tenant CA;
everything it receives is kept and searched for the secret, and so is every
byte of the ledger.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from proctor.broker import SecretBinding
from proctor.broker._proxy import SECRET_BINDING_RULE
from tests.conftest import LedgerEnv
from tests.integration.test_broker_proxy import (
    PLACEHOLDER,
    SECRET_VALUE,
    TENANT,
    Env,
    proxy_env,
)

#: The rule a withheld response names (an upstream that sent the secret back).
ECHO_RULE = "proctor:secret:echo"
SMUGGLE_STORE = 600  # the smuggled POST /store swallows this many bytes of what follows


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    made = proxy_env(ledger_env, tmp_path, monkeypatch)
    e = next(made)
    yield e
    # A test that failed half-way leaves its tunnels open: close them, or the
    # harness waits for handlers that wait for the guest.
    for tunnel in e.extra.get("tunnels", []):
        tunnel.drop()
    next(made, None)


# -- upstreams ---------------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class RawUpstream:
    """An HTTP/1.1 keep-alive server over TLS on 127.0.0.1, written by hand so that it
    can behave the way real servers do when they misbehave.

    ``mode="echo"``: every request header comes back as ``X-Echo-<name>`` (and an
    ``Origin`` as ``Access-Control-Allow-Origin``, a ``X-Request-Id`` as itself),
    and the body is the request's head and body; ```/echo-b64`` and ``/echo-pct``
    give the ``Authorization`` value back base64- or percent-encoded, ``/body-only``
    echoes in the body alone, ``/quiet`` echoes nothing. ``mode="desync"``: the body of a GET (or of a request
    to ``/ignore-body``) is never read, so it is read as the next request; a
    complete ``POST /store`` body is kept and ``GET /stored`` returns what was kept.
    """

    tls: ssl.SSLContext
    mode: str
    sock: socket.socket = field(default_factory=socket.socket)
    seen: list[Seen] = field(default_factory=list)
    stored: list[bytes] = field(default_factory=list)
    raw: list[bytearray] = field(default_factory=list)
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> RawUpstream:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        raw = bytearray()
        with self.lock:
            self.raw.append(raw)
        try:
            with self.tls.wrap_socket(conn, server_side=True) as tls:
                reader = tls.makefile("rb")
                while self._one(tls, reader, raw):
                    pass
        except (OSError, ssl.SSLError, ValueError):
            pass

    def _one(self, tls: ssl.SSLSocket, reader: Any, raw: bytearray) -> bool:
        first = reader.readline(65536)
        if not first:
            return False
        raw += first
        headers: list[tuple[str, str]] = []
        while (line := reader.readline(65536)) not in (b"\r\n", b"\n", b""):
            raw += line
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        raw += line
        parts = first.decode("latin-1").split()
        if len(parts) != 3:
            tls.sendall(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return False
        method, path, _ = parts
        lower = {k.lower(): v for k, v in headers}
        body = b""
        reads_body = self.mode == "echo" or (method != "GET" and path != "/ignore-body")
        if reads_body:
            if lower.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = reader.readline(65536)
                    raw += size_line
                    size = int(size_line.split(b";")[0], 16)
                    chunk = reader.read(size + 2) if size else b""
                    raw += chunk
                    body += chunk[:-2]
                    if size == 0:
                        while (t := reader.readline(65536)) not in (b"\r\n", b""):
                            raw += t
                        raw += t
                        break
            else:
                length = int(lower.get("content-length", "0"))
                body = reader.read(length)
                raw += body
                if len(body) < length:
                    return False  # cut short: a real server drops it, stores nothing
        with self.lock:
            self.seen.append(Seen(method, path, headers, body))
        status, out_headers, out_body = self._answer(method, path, headers, body)
        head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in out_headers)
        head += f"Content-Length: {len(out_body)}\r\n\r\n"
        tls.sendall(head.encode("latin-1") + (b"" if method == "HEAD" else out_body))
        return True

    def _answer(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        if self.mode == "desync":
            if method == "POST" and path == "/store":
                with self.lock:
                    self.stored.append(body)
                return 201, [], b"stored"
            if path == "/stored":
                with self.lock:
                    return 200, [], b"\n--\n".join(self.stored)
            return 200, [], f"ok {method} {path}".encode()
        auth = next((v for k, v in headers if k.lower() == "authorization"), "")
        request = f"{method} {path}\n" + "".join(f"{k}: {v}\n" for k, v in headers)
        if path == "/quiet":
            return 200, [], b"ok"
        if path == "/body-only":
            return 200, [], request.encode("latin-1") + body
        if path == "/echo-b64":
            return 200, [("X-Seen", base64.b64encode(auth.encode()).decode())], b"ok"
        if path == "/echo-pct":
            return 200, [("X-Seen", quote(auth, safe=""))], b"ok"
        out = [(f"X-Echo-{k}", v) for k, v in headers]
        for k, v in headers:
            if k.lower() == "origin":
                out.append(("Access-Control-Allow-Origin", v))
            if k.lower() == "x-request-id":
                out.append(("X-Request-Id", v))
        return 200, out, request.encode("latin-1") + body


def _upstream(env: Env, mode: str) -> RawUpstream:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(env.ca.issue(["api.test"], env.tmp / f"{mode}.pem"))
    up = RawUpstream(ctx, mode).start()
    return up


@pytest.fixture
def echo(env: Env) -> Iterator[RawUpstream]:
    up = _upstream(env, "echo")
    yield up
    up.close()


@pytest.fixture
def desync(env: Env) -> Iterator[RawUpstream]:
    up = _upstream(env, "desync")
    yield up
    up.close()


# -- the guest ---------------------------------------------------------------------------


class Tunnel:
    """A guest's CONNECT to api.test through the proxy, TLS to the tenant CA's leaf.

    Every byte it receives is kept in ``received``."""

    def __init__(self, env: Env, port: int) -> None:
        self.received = bytearray()
        raw = socket.create_connection(("127.0.0.1", env.harness.port), timeout=15)
        raw.sendall(f"CONNECT api.test:{port} HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = raw.recv(1)
            assert chunk, answer
            answer += chunk
        self.received += answer
        assert answer.startswith(b"HTTP/1.1 200"), answer
        trust = env.proxy.tenant_ca(TENANT).ca_pem()
        ctx = ssl.create_default_context(cadata=trust.decode())
        self.tls = ctx.wrap_socket(raw, server_hostname="api.test")
        self.reader = self.tls.makefile("rb")
        self.host = f"api.test:{port}"
        env.extra.setdefault("tunnels", []).append(self)

    def send(self, data: bytes) -> None:
        self.tls.sendall(data)

    def request(self, method: str, path: str, headers: str = "", body: bytes = b"") -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{headers}"
        if body:
            head += f"Content-Length: {len(body)}\r\n"
        return head.encode("latin-1") + b"\r\n" + body

    def response(self) -> tuple[int, dict[str, str], bytes] | None:
        """The next response, or None when the proxy closed the connection first."""
        first = self._line()
        if not first:
            return None
        headers: dict[str, str] = {}
        while (line := self._line()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = self.reader.read(length)
        self.received += body
        return int(first.split()[1]), headers, body

    def rest(self) -> bytes:
        """Everything until the proxy closes the connection."""
        data = b""
        try:
            while chunk := self.reader.read(65536):
                data += chunk
        except (OSError, ssl.SSLError):
            pass
        self.received += data
        return data

    def _line(self) -> bytes:
        try:
            line: bytes = self.reader.readline(65536)
        except (OSError, ssl.SSLError):
            return b""
        self.received += line
        return line

    def close(self) -> bytes:
        """The guest is done: a FIN under the TLS session (so the proxy sees the end of
        its requests), then everything the proxy still sends; all it received."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.tls, socket.SHUT_WR)
        self.rest()
        self.drop()
        return bytes(self.received)

    def drop(self) -> None:
        # The file from makefile() holds the socket open: both are closed.
        self.reader.close()
        self.tls.close()


def _secret_forms(value: str) -> list[bytes]:
    raw = value.encode()
    return [
        raw,
        base64.b64encode(raw),
        base64.b64encode(f"Bearer {value}".encode()),
        quote(value, safe="").encode(),
        raw.hex().encode(),
    ]


def _assert_no_secret(env: Env, *received: bytes) -> None:
    for data in received:
        for form in _secret_forms(SECRET_VALUE):
            assert form not in data, f"the guest received the secret: {data[:400]!r}"
    for event in env.raw_events():
        assert SECRET_VALUE.encode() not in event, event


def _scope(env: Env, port: int, binding: SecretBinding | None = None) -> None:
    binding = binding or SecretBinding("crm_token", SECRET_VALUE, ("api.test",))
    env.scope([f"api.test:{port}"], secrets=[binding.name], bindings=[binding])


def _placeholder_denies(env: Env) -> list[dict[str, Any]]:
    return [
        e
        for e in env.events()
        if e["action"] == "secret.use"
        and e["decision"] == "deny"
        and e["policies"] == [SECRET_BINDING_RULE]
    ]


# -- the placeholder goes only where its secret is bound ------------------------------------


@pytest.mark.parametrize(
    "header",
    ["X-Request-Id", "Origin", "Cookie", "X-Forwarded-Authorization", "Proctor-Note"],
)
def test_a_placeholder_in_another_header_is_refused_and_recorded(
    env: Env, echo: RawUpstream, header: str
) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", "/who", f"{header}: x {PLACEHOLDER} y\r\n"))
    answer = t.response()
    assert answer is not None
    status, _, body = answer
    assert status == 403
    assert json.loads(body)["policies"] == [SECRET_BINDING_RULE]
    assert header in json.loads(body)["message"]
    received = t.close()
    assert echo.seen == [], "a refused request reached the upstream"
    (deny,) = _placeholder_denies(env)
    assert deny["details"]["where"] == f"header {header}"
    _assert_no_secret(env, received)


def test_a_placeholder_in_the_bound_header_is_injected_there_alone(
    env: Env, echo: RawUpstream
) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", "/quiet", f"Authorization: Bearer {PLACEHOLDER}\r\nX-Note: hi\r\n"))
    assert t.response() == (200, {"content-length": "2"}, b"ok")
    received = t.close()
    (seen,) = echo.seen
    assert [v for k, v in seen.headers if k == "Authorization"] == [f"Bearer {SECRET_VALUE}"]
    assert [k for k, v in seen.headers if SECRET_VALUE in v] == ["Authorization"]
    _assert_no_secret(env, received)


def test_a_secret_bound_to_another_header_is_not_put_in_authorization(
    env: Env, echo: RawUpstream
) -> None:
    binding = SecretBinding("crm_token", SECRET_VALUE, ("api.test",), "X-Api-Key", "{secret}")
    _scope(env, echo.port, binding)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", "/who", f"Authorization: Bearer {PLACEHOLDER}\r\n"))
    answer = t.response()
    assert answer is not None and answer[0] == 403
    received = t.close()
    assert echo.seen == []
    assert len(_placeholder_denies(env)) == 1
    _assert_no_secret(env, received)


@pytest.mark.parametrize(
    "target",
    [
        f"/search?q={PLACEHOLDER}",
        f"/{PLACEHOLDER}/x",
        f"/x?a=1&{PLACEHOLDER}",
    ],
)
def test_a_placeholder_in_the_url_is_refused_and_recorded(
    env: Env, echo: RawUpstream, target: str
) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", target, f"Authorization: Bearer {PLACEHOLDER}\r\n"))
    answer = t.response()
    assert answer is not None and answer[0] == 403
    received = t.close()
    assert echo.seen == []
    (deny,) = _placeholder_denies(env)
    assert deny["details"]["where"] == "request line"
    _assert_no_secret(env, received)


def _chunked(*parts: bytes, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    out = b"".join(f"{len(p):x}".encode() + ext + b"\r\n" + p + b"\r\n" for p in parts)
    return out + b"0\r\n" + trailer + b"\r\n"


@pytest.mark.parametrize(
    ("framing", "body", "where"),
    [
        ("length", b'{"token": "' + PLACEHOLDER.encode() + b'"}', "body"),
        ("length", b"a" * 70_000 + PLACEHOLDER.encode() + b"z", "body"),
        # Split across two chunks: found all the same.
        (
            "chunked",
            _chunked(b"x" * 10 + PLACEHOLDER.encode()[:9], PLACEHOLDER.encode()[9:]),
            "body",
        ),
        ("chunked", _chunked(b"hello", ext=b";n=" + PLACEHOLDER.encode()), "body"),
        ("chunked", _chunked(b"hello", trailer=b"X-T: " + PLACEHOLDER.encode() + b"\r\n"), "body"),
    ],
    ids=["json", "far-in", "split-chunks", "chunk-extension", "trailer"],
)
def test_a_placeholder_in_the_body_is_refused_before_the_upstream_has_a_request(
    env: Env, echo: RawUpstream, framing: str, body: bytes, where: str
) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    head = f"POST /upload HTTP/1.1\r\nHost: {t.host}\r\nAuthorization: Bearer {PLACEHOLDER}\r\n"
    if framing == "length":
        head += f"Content-Length: {len(body)}\r\n"
    else:
        head += "Transfer-Encoding: chunked\r\n"
    t.send(head.encode() + b"\r\n" + body)
    answer = t.response()
    assert answer is not None and answer[0] == 403
    received = t.close()
    # The upstream never has a complete request: the connection is cut mid-body.
    assert echo.seen == []
    (deny,) = _placeholder_denies(env)
    assert deny["details"]["where"] == where
    _assert_no_secret(env, received)


# -- an upstream that echoes the injected header back ----------------------------------------


@pytest.mark.parametrize("path", ["/echo", "/echo-b64", "/echo-pct"])
def test_a_response_head_carrying_the_secret_is_withheld_and_recorded(
    env: Env, echo: RawUpstream, path: str
) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", path, f"Authorization: Bearer {PLACEHOLDER}\r\n"))
    answer = t.response()
    assert answer is not None
    status, _, body = answer
    assert status == 502
    assert json.loads(body)["policies"] == [ECHO_RULE]
    received = t.close()
    assert len(echo.seen) == 1  # it did get the request: what came back was withheld
    echoes = [
        e for e in env.events() if e["action"] == "secret.use" and e["policies"] == [ECHO_RULE]
    ]
    assert len(echoes) == 1 and echoes[0]["decision"] == "deny"
    assert echoes[0]["details"]["where"] == "response head"
    _assert_no_secret(env, received)


def test_a_response_body_carrying_the_secret_is_cut_before_it(env: Env, echo: RawUpstream) -> None:
    _scope(env, echo.port)
    t = Tunnel(env, echo.port)
    t.send(t.request("GET", "/body-only", f"Authorization: Bearer {PLACEHOLDER}\r\n"))
    answer = t.response()
    received = t.close()
    # The head went on (nothing in it), then the body was cut before the secret.
    assert answer is not None and answer[0] == 200
    assert len(answer[2]) < int(answer[1]["content-length"])
    echoes = [
        e for e in env.events() if e["action"] == "secret.use" and e["policies"] == [ECHO_RULE]
    ]
    assert len(echoes) == 1 and echoes[0]["details"]["where"] == "response body"
    _assert_no_secret(env, received)


# -- a keep-alive upstream that does not read GET bodies ---------------------------------------


def _smuggled(host: str) -> bytes:
    return (
        f"POST /store HTTP/1.1\r\nHost: {host}\r\nContent-Length: {SMUGGLE_STORE}\r\n\r\n"
    ).encode()


def test_a_get_body_cannot_become_a_second_request_that_stores_the_next_secret(
    env: Env, desync: RawUpstream
) -> None:
    _scope(env, desync.port)
    t = Tunnel(env, desync.port)
    smuggled = _smuggled(t.host)
    auth = f"Authorization: Bearer {PLACEHOLDER}\r\n"
    # A GET whose body is a request, then a request whose head the smuggled one would
    # swallow (padded so that it is long enough), sent back to back.
    t.send(t.request("GET", "/a", auth, smuggled))
    t.send(t.request("POST", "/b", auth, b"p" * 2 * SMUGGLE_STORE))
    answers = []
    while (answer := t.response()) is not None:
        answers.append(answer)
    received = t.close()
    assert answers and answers[0][0] == 400, answers
    assert "body" in json.loads(answers[0][2])["message"]
    # Then the guest asks for what was stored, on a new connection.
    t2 = Tunnel(env, desync.port)
    t2.send(t2.request("GET", "/stored", auth))
    stored = t2.response()
    received2 = t2.close()
    assert stored is not None and stored[0] == 200
    assert all(s.path != "/store" for s in desync.seen), "the smuggled request reached it"
    assert not any(b"/store " in bytes(r) for r in desync.raw)
    assert desync.stored == []
    refusals = [
        e for e in env.events() if e["action"] == "http.request" and e["decision"] == "deny"
    ]
    assert len(refusals) == 1 and "body" in refusals[0]["reason"]
    _assert_no_secret(env, received, received2)


def test_a_body_the_upstream_ignores_cannot_join_a_later_injected_request(
    env: Env, desync: RawUpstream
) -> None:
    """A POST body the upstream leaves unread is read by it as a request of its own; on a
    connection that carries nothing after it, it has nothing of the next request to
    take. Each injected request has a fresh upstream connection, closed after it."""
    _scope(env, desync.port)
    t = Tunnel(env, desync.port)
    auth = f"Authorization: Bearer {PLACEHOLDER}\r\n"
    t.send(t.request("POST", "/ignore-body", auth, _smuggled(t.host)))
    t.send(t.request("POST", "/b", auth, b"p" * 2 * SMUGGLE_STORE))
    t.send(t.request("GET", "/stored", auth))
    statuses = []
    bodies = []
    for _ in range(3):
        answer = t.response()
        assert answer is not None
        statuses.append(answer[0])
        bodies.append(answer[2])
    received = t.close()
    assert statuses == [200, 200, 200]
    assert bodies[0] == b"ok POST /ignore-body" and bodies[2] == b""
    assert desync.stored == []
    assert desync.connections == 3  # one per injected request, none reused
    for raw in desync.raw:
        assert bytes(raw).count(SECRET_VALUE.encode()) <= 1
    _assert_no_secret(env, received)


@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE", "OPTIONS", "TRACE"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_on_a_method_the_upstream_may_ignore_is_refused(
    env: Env, desync: RawUpstream, method: str, framing: str
) -> None:
    _scope(env, desync.port)
    t = Tunnel(env, desync.port)
    head = f"{method} /a HTTP/1.1\r\nHost: {t.host}\r\n"
    if framing == "length":
        t.send(f"{head}Content-Length: 4\r\n\r\nabcd".encode())
    else:
        t.send(f"{head}Transfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n".encode())
    answer = t.response()
    t.close()
    assert answer is not None and answer[0] == 400
    # The CONNECT dialed (to answer 502 there if the host is down); nothing was sent.
    assert desync.seen == [] and not any(desync.raw)
    (refusal,) = [e for e in env.events() if e["decision"] == "deny"]
    assert refusal["action"] == "http.request"


def test_an_empty_body_on_a_get_is_fine(env: Env, desync: RawUpstream) -> None:
    _scope(env, desync.port)
    t = Tunnel(env, desync.port)
    t.send(f"GET /a HTTP/1.1\r\nHost: {t.host}\r\nContent-Length: 0\r\n\r\n".encode())
    answer = t.response()
    t.close()
    assert answer is not None and answer[0] == 200 and answer[2] == b"ok GET /a"
