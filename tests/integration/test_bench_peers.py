"""The peer bench's native client and upstream (bench/peers/) say what the bench
reads from them: built with gcc as the bench builds them, run on loopback.

No figure is asserted (speed is the bench's to print); what is held is the
protocol: keep-alive honoured by the upstream, one connection per request by
the client, the request forms it sends through a proxy, a failed answer counted
as an error and never as a sample, and both programs ending by themselves.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SOURCES = Path(__file__).resolve().parents[2] / "bench" / "peers"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("peers")
    for name in ("client", "upstream"):
        subprocess.run(
            ["gcc", "-O2", "-Wall", "-Werror", "-pthread", "-o", str(out / name),
             str(SOURCES / f"{name}.c")], check=True,
        )  # fmt: skip
    return out


@pytest.fixture
def upstream(built: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    proc = subprocess.Popen(
        [str(built / "upstream"), "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        yield int(proc.stdout.readline()), proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)


class Responses:
    """Responses read off one connection, Content-Length framed; bytes past one
    response are kept for the next."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def next(self) -> tuple[bytes, bytes]:
        """The next response's head and body."""
        while b"\r\n\r\n" not in self.data:
            chunk = self.sock.recv(65536)
            assert chunk, f"closed before a head: {self.data!r}"
            self.data += chunk
        head, _, rest = self.data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            chunk = self.sock.recv(1 << 20)
            assert chunk
            rest += chunk
        self.data = rest[length:]
        return head, rest[:length]


def closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    return sock.recv(1) == b""


def test_upstream_keeps_http11_alive_and_closes_when_asked(
    upstream: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, _ = upstream
    with socket.create_connection(("127.0.0.1", port)) as s:
        responses = Responses(s)
        # Two requests in one write, then a third: all answered on the one connection.
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert responses.next()[1] == b"ok"
        assert responses.next()[1] == b"ok"
        assert responses.data == b""
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, body = responses.next()
        assert body == b"ok" and b"Connection: close" in head
        assert closed(s)


def test_upstream_http10_closes_unless_keep_alive(
    upstream: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, _ = upstream
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert Responses(s).next()[1] == b"ok"
        assert closed(s)
    with socket.create_connection(("127.0.0.1", port)) as s:
        responses = Responses(s)
        s.sendall(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        head, _ = responses.next()
        assert b"Connection: keep-alive" in head
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert responses.next()[1] == b"ok"
        assert closed(s)


def test_upstream_serves_megabytes(upstream: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, _ = upstream
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /mb/3 HTTP/1.1\r\nHost: x\r\n\r\n")
        _, body = Responses(s).next()
        assert len(body) == 3 << 20 and set(body) == {ord("x")}


def test_upstream_ends_when_its_stdin_closes(built: Path) -> None:
    proc = subprocess.Popen(
        [str(built / "upstream")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdin is not None
    int(proc.stdout.readline())
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0


def client(built: Path, *argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(built / "client"), *argv], capture_output=True, timeout=60, check=True
    )
    return dict(json.loads(done.stdout))


def test_client_direct(built: Path, upstream: tuple[int, subprocess.Popen[bytes]]) -> None:
    port, _ = upstream
    target = f"127.0.0.1:{port}"
    got = client(built, "lat", "127.0.0.1", str(port), "direct", target, "7")
    assert got["errors"] == 0 and len(got["lat_us"]) == 7
    got = client(built, "tunnel", "127.0.0.1", str(port), "direct", target, "2")
    assert got == {"bytes": 2 << 20, "seconds": got["seconds"], "errors": 0}
    got = client(built, "rps", "127.0.0.1", str(port), "direct", target, "4", "200")
    assert got["errors"] == 0 and int(got["done"]) > 0


class FakeProxy:
    """A loopback server that records each connection's first request and answers it
    with ``answer(head)`` (the whole bytes to send), then closes."""

    def __init__(
        self, answer: Callable[[bytes, socket.socket], None], arrivals: list[str] | None = None
    ) -> None:
        self.heads: list[bytes] = []
        #: Shared by several proxies: which of them each request reached, in order.
        self.arrivals = arrivals if arrivals is not None else []
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                self.heads.append(head)
                self.arrivals.append(str(self.port))
                self.answer(head, conn)

    def close(self) -> None:
        self.listener.close()


def test_client_through_a_proxy_absolute_form_one_connection_each(built: Path) -> None:
    def chunked(head: bytes, conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\no\r\n1\r\nk\r\n0\r\n\r\n"
        )

    proxy = FakeProxy(chunked)
    try:
        got = client(built, "lat", "127.0.0.1", str(proxy.port), "proxy", "127.0.0.1:9", "3")
    finally:
        proxy.close()
    assert got["errors"] == 0 and len(got["lat_us"]) == 3
    # One connection per request, each an absolute-form GET naming the target.
    assert proxy.heads == [b"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"] * 3


def test_client_counts_a_refusal_as_an_error_not_a_sample(built: Path) -> None:
    def refuse(head: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno")

    proxy = FakeProxy(refuse)
    try:
        got = client(built, "lat", "127.0.0.1", str(proxy.port), "proxy", "127.0.0.1:9", "4")
        load = client(built, "rps", "127.0.0.1", str(proxy.port), "proxy", "127.0.0.1:9",
                      "2", "100")  # fmt: skip
        tunnel = client(built, "tunnel", "127.0.0.1", str(proxy.port), "proxy", "127.0.0.1:9",
                        "1")  # fmt: skip
    finally:
        proxy.close()
    assert got == {"lat_us": [], "errors": 4}
    assert load["done"] == 0 and int(load["errors"]) > 0
    assert tunnel["errors"] == 1 and tunnel["bytes"] == 0


def test_client_tunnel_sends_connect_then_the_get_inside(built: Path) -> None:
    inside: list[bytes] = []

    def tunnel(head: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            got += conn.recv(4096)
        inside.append(got)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 20))
        conn.sendall(b"y" * (1 << 20))

    proxy = FakeProxy(tunnel)
    try:
        got = client(built, "tunnel", "127.0.0.1", str(proxy.port), "proxy", "127.0.0.1:9", "1")
    finally:
        proxy.close()
    assert got["errors"] == 0 and got["bytes"] == 1 << 20
    assert proxy.heads == [b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"]
    assert inside == [b"GET /mb/1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"]


def test_client_mix_takes_turns_request_by_request(
    built: Path, upstream: tuple[int, subprocess.Popen[bytes]]
) -> None:
    port, _ = upstream
    target = f"127.0.0.1:{port}"

    def ok(head: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def refuse(head: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")

    arrivals: list[str] = []
    first, second = FakeProxy(ok, arrivals), FakeProxy(refuse, arrivals)
    try:
        got = client(built, "mix", "127.0.0.1", target, "3", "1000", f"{first.port}:proxy",
                     f"{port}:direct", f"{second.port}:proxy")  # fmt: skip
    finally:
        first.close()
        second.close()
    assert [len(x) for x in got["lat_us"]] == [3, 3, 0]
    assert got["errors"] == [0, 0, 3]
    assert arrivals == [str(first.port), str(second.port)] * 3
    assert first.heads == [f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()] * 3
    # A malformed endpoint is refused before anything is sent.
    bad = subprocess.run([str(built / "client"), "mix", "127.0.0.1", target, "1", "0", "1:sideways"],
                         capture_output=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == b""
