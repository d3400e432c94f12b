"""Keep-alive on the broker's socket: a guest's plain-HTTP proxy connection carries
request after request, each one decided, recorded and answered on its own.

A real broker (its Unix socket, the egress proxy, a real ledger) and a real HTTP
upstream on loopback; the guest's side is a raw socket, so the test sees exactly
what crosses the connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from proctor.broker import Broker, EgressProxy, Handlers
from proctor.guest.protocol import TOKEN_HEADER
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope


class _Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = f"got {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        # The upstream ends its connection after /bye, and, as many servers do, says so
        # when the request asked it to close (a broker that always asked would see
        # every answer closing, and could keep no guest's connection).
        if self.path == "/bye" or self.headers.get("Connection", "").lower() == "close":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        body = b"posted " + self.rfile.read(n)
        self.send_response(201)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Up)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _read_response(f: Any) -> tuple[str, dict[str, str], bytes]:
    status = f.readline().decode().strip()
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline().strip(), 16)) > 0:
            body += f.read(size)
            f.readline()
        f.readline()
    else:
        body = f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def test_a_kept_alive_connection_carries_each_request_decided_and_recorded(
    ledger_env: LedgerEnv, upstream: int
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "k1", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(
        capability_policies("acme", "churn", {"egress": [entry]})
        + '\n@id("no-admin")\nforbid(principal, action, resource) when '
        '{ context has path && context.path == "/admin" };'
    )
    proxy = EgressProxy(None, connect_timeout=5)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=60)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(str(channel.socket))
                f = s.makefile("rb")
                base = f"http://{entry}"
                # The token once: the connection is the guest's from then on.
                s.sendall(f"GET {base}/one HTTP/1.1\r\nHost: {entry}\r\n"
                          f"{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode())  # fmt: skip
                one = _read_response(f)
                s.sendall(f"POST {base}/two HTTP/1.1\r\nHost: {entry}\r\n"
                          "Content-Length: 3\r\n\r\nabc".encode())  # fmt: skip
                two = _read_response(f)
                s.sendall(f"GET {base}/admin HTTP/1.1\r\nHost: {entry}\r\n\r\n".encode())
                three = _read_response(f)
                # Refused: the answer closes the connection.
                assert f.read() == b""
        finally:
            broker.close_run(scope.run_id)
    assert one[0] == "HTTP/1.1 200 OK" and one[2] == b"got /one"
    assert "connection" not in one[1]
    assert two[0] == "HTTP/1.1 201 Created" and two[2] == b"posted abc"
    assert three[0].startswith("HTTP/1.1 403") and three[1]["connection"] == "close"
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    decisions = [e for e in events if e["action"] == "http.request"]
    assert [(e["details"]["method"], e["details"]["path"], e["decision"]) for e in decisions] == [
        ("GET", "/one", "allow"), ("POST", "/two", "allow"), ("GET", "/admin", "deny")]  # fmt: skip
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert [e["details"]["decision_seq"] for e in ends] == [
        decisions[0]["seq"],
        decisions[1]["seq"],
    ]
    assert [e["details"]["status"] for e in ends] == [200, 201]


def test_a_connection_asking_to_close_or_without_a_token_is_not_kept(
    ledger_env: LedgerEnv, upstream: int
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "k2", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(capability_policies("acme", "churn", {"egress": [entry]}))
    proxy = EgressProxy(None, connect_timeout=5)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=60)
        try:
            # The guest asks to close; an HTTP/1.0 guest; the upstream closes (what a
            # client would have seen from it directly).
            for version, extra, path in (("HTTP/1.1", "Connection: close\r\n", "/x"),
                                         ("HTTP/1.0", "", "/x"), ("HTTP/1.1", "", "/bye")):  # fmt: skip
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(str(channel.socket))
                    f = s.makefile("rb")
                    s.sendall(f"GET http://{entry}{path} {version}\r\nHost: {entry}\r\n{extra}"
                              f"{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode())  # fmt: skip
                    status, headers, _ = _read_response(f)
                    assert status.endswith("200 OK") and headers["connection"] == "close"
                    assert f.read() == b""
            # A first request without the token is refused, kept alive or not.
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(str(channel.socket))
                s.sendall(f"GET http://{entry}/x HTTP/1.1\r\nHost: {entry}\r\n\r\n".encode())
                status, headers, _ = _read_response(s.makefile("rb"))
                assert status.startswith("HTTP/1.1 401")
        finally:
            broker.close_run(scope.run_id)


def test_a_completion_that_cannot_be_recorded_refuses_the_runs_next_call(
    ledger_env: LedgerEnv, upstream: int
) -> None:
    from proctor.errors import LedgerError

    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "k3", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(capability_policies("acme", "churn", {"egress": [entry]}))

    def completions_fail(log: str, event: Any) -> Any:
        # As a commit that fails after the answer went out: the queued completion's
        # future fails in the broker's loop, and nothing of it is written.
        future = asyncio.get_running_loop().create_future()
        future.set_exception(LedgerError("the disk is gone (test)"))
        return future

    ledger_env.ledger.append_later = completions_fail  # type: ignore[method-assign]
    proxy = EgressProxy(None, connect_timeout=5)
    answers = []
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=60)
        try:
            for path in ("/first", "/second"):
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(str(channel.socket))
                    s.sendall(f"GET http://{entry}{path} HTTP/1.1\r\nHost: {entry}\r\n"
                              f"Connection: close\r\n{TOKEN_HEADER}: {channel.token}\r\n\r\n"
                              .encode())  # fmt: skip
                    answers.append(_read_response(s.makefile("rb")))
        finally:
            broker.close_run(scope.run_id)
    # The first answer had gone out before its completion failed; the run's next
    # call is refused, and nothing more reaches the upstream.
    assert answers[0][0] == "HTTP/1.1 200 OK" and answers[0][2] == b"got /first"
    assert answers[1][0].startswith("HTTP/1.1 503")
    assert json.loads(answers[1][2])["error"] == "not_recorded"
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    assert [e["details"]["path"] for e in events if e["action"] == "http.request"] == ["/first"]


def test_the_proxys_own_entry_point_keeps_a_connection_when_asked(
    ledger_env: LedgerEnv, upstream: int
) -> None:
    # EgressProxy.handle_forward(persistent=True), for a server that reads heads itself
    # (the peer bench's): True when the connection was kept, each request decided.
    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "k4", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(capability_policies("acme", "churn", {"egress": [entry]}))
    proxy = EgressProxy(None, connect_timeout=5)
    kept: list[bool] = []

    async def on_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not kept or kept[-1]:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ")
                headers = [(k.strip(), v.strip()) for k, _, v in
                           (line.partition(":") for line in head[1:] if line)]  # fmt: skip
                kept.append(await proxy.handle_forward(scope, method, target, headers, reader,
                                                       writer, persistent=True))  # fmt: skip
        finally:
            writer.close()

    async def go() -> list[tuple[str, dict[str, str], bytes]]:
        server = await asyncio.start_server(on_proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = []
        for path, close in (("/a", ""), ("/b", "Connection: close\r\n")):
            writer.write(f"GET http://{entry}{path} HTTP/1.1\r\nHost: {entry}\r\n{close}\r\n"
                         .encode())  # fmt: skip
            status = (await reader.readline()).decode().strip()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            got.append((status, headers, await reader.readexactly(int(headers["content-length"]))))
        assert await reader.read() == b""  # closed after the request that asked
        writer.close()
        server.close()
        await server.wait_closed()
        return got

    got = asyncio.run(go())
    assert [(s, b) for s, _, b in got] == [
        ("HTTP/1.1 200 OK", b"got /a"),
        ("HTTP/1.1 200 OK", b"got /b"),
    ]
    assert "connection" not in got[0][1] and got[1][1]["connection"] == "close"
    assert kept == [True, False]
    ledger_env.ledger.flush()
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    assert [e["details"]["path"] for e in events if e["action"] == "http.request"] == ["/a", "/b"]
