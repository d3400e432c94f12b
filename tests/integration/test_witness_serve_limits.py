"""What one client may hold of ``proctor witness serve`` (issue 31, 6), for real: the
witness is a subprocess on loopback, started with a low soft descriptor limit, and
the clients are raw sockets bound to their own loopback addresses (127.0.0.2 and
up: every one of 127/8 is this host's), so the server sees distinct clients.

* One address holding its bound of connections gets 503 for every further one,
  while another address is still answered.
* A request whose header arrives a byte at a time, each byte well inside the
  per-read timeout, is closed at its deadline; so is a connection that idles.
* The soft descriptor limit was raised to the hard one at start."""

from __future__ import annotations

import hashlib
import json
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proctor.ledger import Signer
from proctor.witness import Witness
from tests.conftest import PROCTOR

ORIGIN = "test.local/tenant/acme"


def _low_soft_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))


class Served:
    def __init__(self, state: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [PROCTOR, "witness", "serve", "--state", str(state), "--listen", "127.0.0.1:0",
             "--json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_low_soft_limit,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read().decode() if self.proc.stderr else ""
        self.info = json.loads(line)
        host, port = self.info["listen"].rsplit(":", 1)
        self.address = (host, int(port))

    def limits(self) -> tuple[int, int]:
        for line in Path(f"/proc/{self.proc.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
        raise AssertionError("no open files limit")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    w = Witness.init(tmp_path / "w", "witness.test/lim")
    w.add_log(ORIGIN, Signer.generate("test.local").verifier.vkey())
    return tmp_path / "w"


@pytest.fixture
def bounded(state: Path) -> Iterator[Served]:
    served = Served(state, "--per-address", "8", "--request-timeout", "120")
    yield served
    served.stop()


@pytest.fixture
def hasty(state: Path) -> Iterator[Served]:
    served = Served(state, "--request-timeout", "2")
    yield served
    served.stop()


def _connect(source: str, to: tuple[str, int]) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(30)
    s.connect(to)
    return s


def _closed_with(s: socket.socket) -> bytes:
    """Everything the server sent before it closed ``s`` (waits for the close)."""
    got = b""
    while True:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def _served(source: str, to: tuple[str, int]) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    path = "/" + hashlib.sha256(ORIGIN.encode()).hexdigest() + "/checkpoint"
    with httpx.Client(transport=transport, timeout=30) as client:
        return client.get(f"http://{to[0]}:{to[1]}{path}")


def test_one_address_cannot_hold_the_witness(bounded: Served) -> None:
    soft, hard = bounded.limits()
    assert soft == hard  # raised from 256 at start
    assert bounded.info["per_address"] == 8
    assert bounded.info["max_connections"] >= 4 * 8  # three quarters stay for others
    held = [_connect("127.0.0.2", bounded.address) for _ in range(8)]
    try:
        # The ninth and later connections of that address: 503, closed unread.
        over = [_connect("127.0.0.2", bounded.address) for _ in range(12)]
        for s in over:
            answer = _closed_with(s)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            s.close()
        # Another client is answered meanwhile (nothing cosigned yet: 404 from the
        # handler, not the gate's 503), and so is a third.
        for source in ("127.0.0.3", "127.0.0.4"):
            got = _served(source, bounded.address)
            assert (got.status_code, got.text) == (404, "not found\n")
        # The held connections are still open: none was dropped to make room.
        for s in held:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in held:
            s.close()
    # Their slots come back when they close: the same address is served again.
    deadline = time.monotonic() + 30
    while True:
        got = _served("127.0.0.2", bounded.address)
        if got.status_code == 404 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got.status_code == 404, got.text


def test_slow_headers_and_idle_connections_are_closed(hasty: Served) -> None:
    # A header sent a byte every half second: each read is well inside the 2 s
    # per-read timeout, so only the request's deadline can end it.
    slow = _connect("127.0.0.5", hasty.address)
    slow.sendall(b"GET /")
    sent = 0
    start = time.monotonic()
    closed = False
    while time.monotonic() - start < 60:
        try:
            slow.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        sent += 1
        slow.settimeout(0.5)
        try:
            if slow.recv(4096) == b"":
                closed = True
                break
        except TimeoutError:
            pass
    slow.close()
    assert closed, "a header trickled in for a minute and the connection stayed open"
    assert sent >= 2  # it was sending all along, never silent for a whole read timeout
    # A connection that never sends: closed, unanswered.
    idle = _connect("127.0.0.5", hasty.address)
    assert _closed_with(idle) == b""
    idle.close()
    # A kept-alive connection idling after one answer: closed after it.
    kept = _connect("127.0.0.5", hasty.address)
    path = "/" + hashlib.sha256(ORIGIN.encode()).hexdigest() + "/checkpoint"
    kept.sendall(f"GET {path} HTTP/1.1\r\nHost: w\r\n\r\n".encode())
    answer = _closed_with(kept)
    assert answer.startswith(b"HTTP/1.1 404 ") and answer.endswith(b"not found\n"), answer
    kept.close()
    # The server is still whole for the next client.
    assert _served("127.0.0.6", hasty.address).status_code == 404
