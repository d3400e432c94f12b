"""The guest shim as a process of its own (as it runs in a sandbox, here on the
host's loopback) in front of a real broker and proxy: its threads are reused from
one connection to the next, long-lived tunnels do not starve new requests, and
each request through it is decided and recorded on its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.broker import Broker, EgressProxy, Handlers
from proctor.guest.shim import _Workers
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.integration.test_broker_keepalive import _read_response, upstream  # noqa: F401


def _threads(pid: int) -> set[int]:
    return {int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def shim(ledger_env: LedgerEnv, upstream: int) -> Iterator[tuple[int, int, str]]:  # noqa: F811
    ledger_env.ledger.create_log("acme", draft(0))
    entry = f"127.0.0.1:{upstream}"
    scope = _scope(ledger_env.ledger, "s1", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(capability_policies("acme", "churn", {"egress": [entry]}))
    with Broker(Handlers.for_proxy(EgressProxy(None, connect_timeout=5)), os.urandom(32)) as b:
        channel = b.open_run(scope, ttl=120)
        port = _free_port()
        env = dict(os.environ, PROCTOR_BROKER=str(channel.socket), PROCTOR_TOKEN=channel.token,
                   PROCTOR_PROXY_PORT=str(port))  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "proctor.guest.shim", "--", sys.executable, "-c",
             "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the shim did not listen"
                    time.sleep(0.05)
            yield port, proc.pid, entry
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)
            b.close_run("s1")


def _get(port: int, entry: str, path: str) -> tuple[str, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET http://{entry}{path} HTTP/1.1\r\nHost: {entry}\r\n"
                  "Connection: close\r\n\r\n".encode())  # fmt: skip
        status, _, body = _read_response(s.makefile("rb"))
    return status, body


def test_requests_through_the_shim_reuse_its_threads_and_are_each_recorded(
    shim: tuple[int, int, str], ledger_env: LedgerEnv
) -> None:
    port, pid, entry = shim
    seen: set[int] = set()
    for i in range(40):
        assert _get(port, entry, f"/n{i}") == ("HTTP/1.1 200 OK", f"got /n{i}".encode())
        seen |= _threads(pid)
    # Two workers a connection (a bridge and its way back), taken again for the next
    # one: not a thread, let alone two, started per request.
    assert len(seen) <= 8, f"{len(seen)} threads for 40 requests one after another"
    deadline = time.monotonic() + 10
    while True:  # the last answer can reach the client before its end is queued
        ledger_env.ledger.flush()
        events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
        if sum(e["action"] == "http.request.end" for e in events) == 40:
            break
        assert time.monotonic() < deadline, "completion records missing"
        time.sleep(0.05)
    paths = [e["details"]["path"] for e in events if e["action"] == "http.request"]
    assert paths == [f"/n{i}" for i in range(40)]


def test_open_tunnels_do_not_starve_the_next_request(shim: tuple[int, int, str]) -> None:
    port, _, entry = shim
    tunnels = []
    try:
        for _ in range(24):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(f"CONNECT {entry} HTTP/1.1\r\nHost: {entry}\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            tunnels.append(s)
        # Every tunnel holds two workers; a request still gets its own.
        assert _get(port, entry, "/after") == ("HTTP/1.1 200 OK", b"got /after")
        # And the tunnels still carry bytes, each to the upstream.
        for i, s in enumerate(tunnels):
            s.sendall(f"GET /t{i} HTTP/1.1\r\nHost: {entry}\r\nConnection: close\r\n\r\n".encode())
            assert _read_response(s.makefile("rb"))[2] == f"got /t{i}".encode()
    finally:
        for s in tunnels:
            s.close()


def test_idle_workers_end_and_a_late_task_is_still_run() -> None:
    workers = _Workers(idle=0.05)
    before = threading.active_count()
    done = threading.Event()
    seen: list[int] = []
    for i in range(5):
        workers.submit(seen.append, i)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before, "idle workers were left behind"
    assert sorted(seen) == [0, 1, 2, 3, 4]
    workers.submit(done.set)  # no worker left: a new one takes it
    assert done.wait(5)
