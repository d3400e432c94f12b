"""Bytes through the guest shim's CONNECT tunnel arrive whole, in order, on both
backends: the shim moves them with splice inside the sandbox (gVisor's own
implementation on one backend, the host kernel's on the other), and a splice that
loses or reorders a byte would be read by the guest as its upstream's.

Found by bench/transparent.py: with the shim's pipe grown to 1 MiB, large
downloads through gVisor failed TLS's record MAC (the bytes were not the bytes
sent); TLS caught it there, a plain tunnel would not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.broker import Broker, EgressProxy, Handlers
from proctor.lifecycle import run_brokered
from proctor.policy import capability_policies, compile_policies
from proctor.sandbox import Limits, get_driver
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox

SIZE = 24 << 20
BODY = random.Random(22).randbytes(SIZE)

GUEST = r"""
import hashlib, json, os, socket
host, port = os.environ["HTTP_PROXY"].rsplit("/", 1)[1].split(":")
target = os.environ["TARGET"]
s = socket.create_connection((host, int(port)), timeout=60)
s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
digest, n = hashlib.sha256(), 0
# Small reads and large ones, as clients do, each whatever the tunnel has.
sizes = [1, 7, 4096, 65536, 1 << 20]
i = 0
while chunk := s.recv(sizes[i % len(sizes)]):
    digest.update(chunk)
    n += len(chunk)
    i += 1
print(json.dumps({"status": head.split(b"\r\n")[0].decode(), "bytes": n,
                  "sha256": digest.hexdigest()}))
"""


@pytest.fixture
def upstream() -> Iterator[int]:
    """A raw TCP upstream that sends BODY to each connection, then closes."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(BODY)

    threading.Thread(target=serve, daemon=True).start()
    yield int(server.getsockname()[1])
    stop.set()
    server.close()


# The ledger's engine is not what this tests.
@pytest.mark.parametrize("store_engine", ["sqlite"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_tunnel_through_the_shim_arrives_whole(
    ledger_env: LedgerEnv, upstream: int, backend: str, tmp_path: Path
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "tun", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(capability_policies("acme", "churn", {"egress": [entry]}))
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(GUEST)
    os.chmod(code, 0o755)
    (code / "main.py").chmod(0o644)
    out: list[bytes] = []
    err: list[bytes] = []
    with Broker(Handlers.for_proxy(EgressProxy(None, connect_timeout=5)), os.urandom(32)) as b:
        result = run_brokered(
            b, scope, get_driver(backend), ("python3", "/code/main.py"), code_dir=code,
            env={"TARGET": entry}, limits=Limits(wall_seconds=120, memory_bytes=1 << 30),
            on_stdout=out.append, on_stderr=err.append, transparent=False,
        )  # fmt: skip
    assert result.exit_code == 0, b"".join(err).decode(errors="replace")[-2000:]
    got = json.loads(b"".join(out))
    assert got["status"].startswith("HTTP/1.1 200"), got
    assert got["bytes"] == SIZE, got
    assert got["sha256"] == hashlib.sha256(BODY).hexdigest(), got
