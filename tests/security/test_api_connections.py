"""Unauthenticated connections cannot make the API refuse every tenant (issue 31,
item 6).

Before: the gate that bounded connections per address and in all let a flood from
a handful of addresses take the whole total (a quarter of the descriptors, but at
least 256: all of them under a limit of 256), after which every new connection,
an authenticated tenant's too, was closed unread (RemoteDisconnected); under TLS it
saw a connection only after its handshake, so one address that never finished one
held every descriptor; a client that sent a byte and then dribbled its head was
held for ever, and an idle kept-alive connection for 30 s.

The server runs in a child process with a small descriptor limit (soft 128, hard
1,024 or 256), so a flood well over 1,024 connections is cheap; the attacker holds
its connections while a principal of another tenant asks.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.api import Limits
from tests.integration.test_api_support import build_env, self_signed

SOFT = 128
#: The start of a request head, and of a TLS handshake record (a ClientHello of 512
#: bytes announced, 4 sent): what a slow client sends before it stalls.
SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
SLOW_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc"


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    stderr: Path
    context: ssl.SSLContext | None

    @property
    def host(self) -> str:
        return str(self.info["host"])

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def token(self, tenant: str) -> str:
        return str(self.info["tokens"][tenant])

    def connect(self, source: str, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(
            (self.host, self.port), timeout=timeout, source_address=(source, 0)
        )

    def http(self, source: str) -> http.client.HTTPConnection:
        if self.context is not None:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=10, context=self.context, source_address=(source, 0)
            )
        return http.client.HTTPConnection(
            self.host, self.port, timeout=10, source_address=(source, 0)
        )

    def stop(self) -> list[dict[str, Any]]:
        """Stop the server; the ``api.connections.refused`` events it recorded."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        line = self.proc.stdout.readline()
        self.proc.wait(30)
        return list(json.loads(line))


@contextlib.contextmanager
def child(tmp: Path, limits: dict[str, Any], tls: bool, hard: int) -> Iterator[Child]:
    argv = [str(tmp / "home"), str(SOFT), str(hard), json.dumps(limits)]
    context = None
    if tls:
        certfile, keyfile = self_signed(tmp)
        argv += ["--tls", str(certfile), str(keyfile)]
        context = ssl.create_default_context(cafile=str(certfile))
    stderr = tmp / "server.err"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.security.api_child", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=Path(__file__).parents[2],
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, stderr.read_text()
        yield Child(proc, json.loads(line), stderr, context)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` (it has neither closed nor reset it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def _flood(c: Child, source: str, i: int, count: int, held: list[socket.socket]) -> None:
    """``count`` connections from ``source``, every other one sending the start of a
    head (or of a TLS handshake) and no more."""
    start = SLOW_HEAD if c.context is None else SLOW_HELLO
    for j in range(count):
        try:
            sock = c.connect(source)
        except OSError:
            return  # the server no longer accepts: what broke before
        if (i + j) % 2:
            with contextlib.suppress(OSError):  # closed already: fine
                sock.sendall(start)
        held.append(sock)


def _get(c: Child, path: str, token: str, source: str) -> int:
    conn = c.http(source)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("scheme", "hard", "addresses", "per_address"),
    # Over HTTP under a limit of 1,024 (the old total, 256, was then below it, and the
    # flood filled it); over TLS under 256 and fewer connections: before, 300 from one
    # address held every descriptor.
    [("http", 1024, 8, 150), ("https", 256, 4, 100)],
)
def test_a_flood_of_unauthenticated_connections_leaves_another_tenant_served(
    tmp_path: Path, scheme: str, hard: int, addresses: int, per_address: int
) -> None:
    """1,200 connections from eight addresses (400 from four over TLS), half of them
    sending the start of a head (of a handshake) and stalling, all held open; then a
    principal of another tenant asks, from its own address and from one of the
    flood's. Before: RemoteDisconnected at once over HTTP (the total was full), a
    timeout over HTTPS (every descriptor held before the handshake, unseen)."""
    attackers = [f"127.0.0.{i}" for i in range(2, 2 + addresses)]
    with child(tmp_path, {}, tls=scheme == "https", hard=hard) as c:
        # The soft limit was raised to the hard one, and the bounds derive from it.
        assert c.info["before"] == [SOFT, hard]
        assert c.info["after"] == [hard, hard]
        bounds = c.info["bounds"]
        assert bounds["total"] == hard // 4
        assert bounds["unauthenticated"] < bounds["total"]
        assert bounds["per_source"] <= bounds["unauthenticated"]

        # An authenticated follow, opened before the flood: a connection that carries
        # a principal is never closed to make room.
        follow = c.http("127.0.0.1")
        follow.request(
            "GET",
            "/tenants/globex/events/follow",
            headers={"Authorization": f"Bearer {c.token('globex')}"},
        )
        followed = follow.getresponse()
        assert followed.status == 200

        held: list[socket.socket] = []
        try:
            # One thread per address: a connect the server's backlog drops waits 1 s
            # for the retry, and the addresses' waits overlap.
            floods = [
                threading.Thread(target=_flood, args=(c, source, i, per_address, held))
                for i, source in enumerate(attackers)
            ]
            for t in floods:
                t.start()
            for t in floods:
                t.join()
            time.sleep(1.0)  # the server accepts (and closes) what it will
            still = sum(_open(s) for s in held)

            # Another tenant's principal, while the flood is held: served.
            path = "/tenants/acme/runs"
            assert _get(c, path, c.token("acme"), "127.0.0.1") == 200
            # And from an address of the flood: it gets in by closing the oldest
            # unauthenticated connection of that address.
            assert _get(c, path, c.token("acme"), attackers[0]) == 200
            # The follow is still open: the next event of its log reaches it.
            assert _get(c, "/tenants/globex/runs", c.token("globex"), "127.0.0.1") == 200
            assert b'"api.request"' in followed.readline()
            # The server never stopped accepting, and holds no more than its bound.
            assert len(held) == addresses * per_address
            assert still <= bounds["unauthenticated"], still
        finally:
            for sock in held:
                sock.close()
            follow.close()
        refused = c.stop()
    assert "Too many open files" not in c.stderr.read_text()
    # Every connection the server closed is counted (idle ones too: the flood's silent
    # half meets the 10 s first-byte timeout on a slow machine).
    closed = sum(e["details"]["refused"] for e in refused)
    assert closed >= addresses * per_address - bounds["unauthenticated"], refused
    assert sum(e["details"]["over_source"] + e["details"]["over_total"] for e in refused)
    assert all(e["actor"] == {"type": "runtime", "id": "proctor-api"} for e in refused)


# -- slow heads and idle connections, in this process ------------------------------------


def _closed(sock: socket.socket, limit: float = 10.0) -> bytes:
    """Read until the server closes ``sock``; what it sent. Fails (timeout) if it does
    not close it within ``limit`` seconds."""
    sock.settimeout(limit)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            got += chunk
    return got


def _response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(4096)
    return head + b"\r\n\r\n" + rest


def _refused(env: Any) -> list[dict[str, Any]]:
    events = [json.loads(e) for e in env.rt.ledger.entries("system")]
    return [e for e in events if e["action"] == "api.connections.refused"]


def test_slow_heads_and_idle_kept_alive_connections_are_closed_and_counted(
    tmp_path: Path,
) -> None:
    """A head dribbled a byte at a time (slowloris), on a new connection and on a
    kept-alive one after a served request, and a kept-alive connection left idle:
    each closed (before, the first two were held for as long as the client kept
    sending, the idle one for 30 s)."""
    env = build_env(tmp_path, limits=Limits(first_byte_timeout=0.5, head_timeout=1.5))
    try:
        host, port = env.server.host, env.server.port

        def dribble(sock: socket.socket, head: bytes) -> None:
            for byte in head:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return  # closed: what the test waits for
                time.sleep(0.1)

        slow = socket.create_connection((host, port), timeout=10, source_address=("127.0.0.5", 0))
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
        dribble(slow, head)
        assert _closed(slow) == b""  # nothing answered
        slow.close()

        kept = socket.create_connection((host, port), timeout=10, source_address=("127.0.0.6", 0))
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = _response(kept)
        assert first.startswith(b"HTTP/1.1 200"), first
        dribble(kept, head)
        assert _closed(kept) == b""  # no second answer
        kept.close()

        idle = socket.create_connection((host, port), timeout=10, source_address=("127.0.0.7", 0))
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(idle).startswith(b"HTTP/1.1 200")
        assert _closed(idle) == b""
        idle.close()

        env.server.stop()
        refused = _refused(env)
        assert sum(e["details"]["slow_head"] for e in refused) == 2, refused
        assert sum(e["details"]["idle"] for e in refused) == 1, refused
    finally:
        env.server.stop()
        env.rt.close()


def test_a_tls_handshake_never_finished_is_closed_and_counted(tmp_path: Path) -> None:
    """Before, a connection was under the gate only once its TLS handshake was done:
    one that never sent a ClientHello was held 60 s and counted nowhere."""
    certfile, keyfile = self_signed(tmp_path)
    env = build_env(
        tmp_path,
        limits=Limits(first_byte_timeout=0.5, head_timeout=1.0),
        certfile=certfile,
        keyfile=keyfile,
    )
    try:
        host, port = env.server.host, env.server.port
        silent = socket.create_connection((host, port), source_address=("127.0.0.8", 0))
        assert _closed(silent) == b""
        silent.close()
        env.server.stop()
        assert sum(e["details"]["idle"] for e in _refused(env)) == 1
    finally:
        env.server.stop()
        env.rt.close()


def test_a_connection_that_authenticated_is_not_the_one_closed_to_make_room(
    tmp_path: Path,
) -> None:
    """An address at its bound (2 here) opens one more: its oldest unauthenticated
    connection gives way, not the older one that carried a principal's request (the
    mark goes from authentication, on a worker thread, to the socket's gate)."""
    env = build_env(tmp_path, limits=Limits(connections_per_source=2))
    try:
        host, port, source = env.server.host, env.server.port, "127.0.0.9"
        gate = env.server.gate
        assert gate is not None
        authed = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        request = (
            f"GET /tenants/acme/runs HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {env.token('acme', 'aud')}\r\n\r\n"
        ).encode()
        authed.sendall(request)
        assert _response(authed).startswith(b"HTTP/1.1 200")
        assert gate.unauthenticated() == 0
        first = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        second = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        assert _closed(first) == b""  # the address's oldest unauthenticated one
        assert _open(second)
        authed.sendall(request)  # the same kept-alive connection, served again
        assert _response(authed).startswith(b"HTTP/1.1 200")
        for sock in (authed, first, second):
            sock.close()
    finally:
        env.server.stop()
        env.rt.close()
