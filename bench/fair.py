"""One tenant floods, another is measured: the victim's latency idle and under
each flood of issue 23 (item 5), on a real broker (Unix sockets, SQLite
datasets, a signed ledger) and a real API server on loopback.

Floods: slow statements (each waits on a write lock, no CPU), stalled
uploads, idle connections to the broker, log follows on the API. For slow
statements the figures are also taken "before": the broker's blocking work on
the event loop's default executor, shared by every tenant, as it was.

    .venv/bin/python bench/fair.py [--samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import socket
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from proctor.api import Limits, serve_api
from proctor.broker import Broker, DatasetBinding, RunChannel, RunScope, _fair, make_broker
from proctor.governance import Runs
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.runtime import Runtime, init_home
from proctor.store import open_store


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=60)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def sql(channel: RunChannel, statement: str) -> int:
    conn = _Unix(channel.socket)
    try:
        body = json.dumps({"dataset": "crm", "sql": statement}).encode()
        conn.request("POST", "/v1/sql", body=body, headers={TOKEN_HEADER: channel.token})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def make_dataset(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.executemany("INSERT INTO customers VALUES (?, ?)", [(i, f"c{i}") for i in range(1000)])
    conn.commit()
    conn.close()


def open_run(broker: Broker, ledger: Ledger, tmp: Path, tenant: str) -> RunChannel:
    ledger.create_log(
        tenant, EventDraft(Actor("operator", "bench"), "tenant.create", f"tenant/{tenant}")
    )
    make_dataset(tmp / f"{tenant}.db")
    (tmp / tenant / "reports").mkdir(parents=True)
    caps = {
        "datasets": {
            "crm": {"tables": {"customers": {"columns": ["id", "name"], "access": "read-write"}}}
        },
        "buckets": {"reports": "read-write"},
    }
    scope = RunScope(
        tenant=tenant,
        run_id=f"run-{tenant}",
        workload=f"spiffe://bench.local/tenant/{tenant}/deployment/job/run/run-{tenant}",
        deployment="job",
        artifact="sha256:" + "ab" * 32,
        approvals=(),
        environment="production",
        policies=compile_policies(capability_policies(tenant, "job", caps)),
        ledger=ledger,
        datasets={"crm": DatasetBinding("crm", "sqlite", str(tmp / f"{tenant}.db"))},
        buckets_dir=tmp / tenant,
        lineage_key=b"k" * 32,
        statement_timeout=2.0,
    )
    return broker.open_run(scope, ttl=3600)


def measure(call: Callable[[], Any], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        call()
        out.append(time.perf_counter() - started)
    return out


def row(name: str, lat: list[float]) -> str:
    return f"| {name} | {pct(lat, 0.5) * 1e3:.1f} ms | {pct(lat, 0.99) * 1e3:.1f} ms |"


class _SharedDefaultExecutor:
    """The broker as it was: every tenant's blocking work on the loop's default executor."""

    async def run(self, tenant: str, run: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)


@contextlib.contextmanager
def slow_statements(attacker: RunChannel, dataset: Path, threads: int = 12) -> Iterator[None]:
    holder = sqlite3.connect(dataset, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    stop = threading.Event()

    def flood(i: int) -> None:
        while not stop.is_set():
            sql(attacker, f"UPDATE customers SET name = 'x{i}' WHERE id = 1")

    workers = [threading.Thread(target=flood, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        holder.execute("ROLLBACK")
        holder.close()
        for t in workers:
            t.join()


@contextlib.contextmanager
def stalled_uploads(attacker: RunChannel, count: int = 8, sent: int = 8 << 20) -> Iterator[None]:
    piece = bytes(range(256)) * 4096
    socks = []
    for i in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(attacker.socket))
        socks.append(sock)
        head = (
            f"PUT /v1/files/reports/k{i} HTTP/1.1\r\nHost: b\r\n{TOKEN_HEADER}: {attacker.token}"
            f"\r\nContent-Length: {64 << 20}\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            sock.sendall(head.encode())
            for _ in range(sent // len(piece)):
                sock.sendall(piece)
    try:
        yield
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def idle_connections(attacker: RunChannel, count: int = 1000) -> Iterator[None]:
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(attacker.socket))
        socks.append(sock)
    time.sleep(0.5)
    try:
        yield
    finally:
        for sock in socks:
            sock.close()


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def broker_figures(samples: int) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        store = open_store(str(tmp / "proctor.db"), create=True)
        ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
        broker = make_broker(tmp / "ca", os.urandom(32)).start()
        try:
            attacker = open_run(broker, ledger, tmp, "mallory")
            victim = open_run(broker, ledger, tmp, "victim")

            def victim_call() -> None:
                assert sql(victim, "SELECT id, name FROM customers WHERE id = 42") == 200

            measure(victim_call, 20)
            lines.append(row("idle", measure(victim_call, samples)))
            fair = _fair.POOL
            _fair.POOL = _SharedDefaultExecutor()  # type: ignore[assignment]
            try:
                with slow_statements(attacker, tmp / "mallory.db"):
                    lines.append(row("12 slow statements, before (shared default executor)",
                                     measure(victim_call, max(10, samples // 10))))  # fmt: skip
            finally:
                _fair.POOL = fair
            with slow_statements(attacker, tmp / "mallory.db"):
                lines.append(row("12 slow statements, fair pool", measure(victim_call, samples)))
            before = rss()
            with stalled_uploads(attacker):
                grown = rss() - before
                lat = measure(victim_call, samples)
            lines.append(
                row(
                    f"8 stalled uploads, streamed to disk (64 MiB sent; RSS +{grown >> 20} MiB)",
                    lat,
                )
            )
            with idle_connections(attacker):
                lines.append(
                    row("1,000 idle connections to the run's socket", measure(victim_call, samples))
                )
        finally:
            broker.stop()
            ledger.close()
            store.close()
    return lines


def api_figures(samples: int) -> list[str]:
    import httpx

    lines = []
    with tempfile.TemporaryDirectory() as tmpdir:
        home = Path(tmpdir) / "home"
        init_home(home)
        rt = Runtime.open(home)
        tokens = {}
        for t in ("acme", "globex"):
            rt.tenants.create(t, rt.operator)
            tokens[t] = rt.principals.create(t, "aud", "user", ["auditor"], rt.operator)[1]
        with rt.store.write() as conn:
            Runs.insert(conn, (
                "run-follow", "globex", "job", 1, "sha256:" + "ab" * 32, "production",
                "spiffe://x/tenant/globex/deployment/job/run/run-follow", "[]", "bubblewrap",
                None, "running", None, None, 1, "{}", None, "2026-01-01T00:00:00.000000Z", None,
            ), "bench")  # fmt: skip
        server = serve_api(rt, "127.0.0.1", 0, limits=Limits(follows_per_principal=64))
        try:
            headers = {"Authorization": f"Bearer {tokens['acme']}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:

                def victim_get() -> None:
                    assert client.get("/tenants/acme/runs").status_code == 200

                measure(victim_get, 20)
                lines.append(row("API idle", measure(victim_get, samples)))
                follows = []
                for _ in range(45):
                    sock = socket.create_connection((server.host, server.port))
                    sock.sendall(
                        f"GET /tenants/globex/runs/run-follow/logs?follow=true HTTP/1.1\r\n"
                        f"Host: x\r\nAuthorization: Bearer {tokens['globex']}\r\n\r\n".encode()
                    )
                    follows.append(sock)
                for sock in follows:
                    sock.recv(12)
                lines.append(row("API, 45 log follows of another tenant's auditor",
                                 measure(victim_get, samples)))  # fmt: skip
                for sock in follows:
                    sock.close()
        finally:
            server.stop()
            rt.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    out = ["| victim's call, while the other tenant... | p50 | p99 |", "|---|---:|---:|"]
    out += broker_figures(args.samples)
    out += api_figures(args.samples)
    print("\n".join(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
