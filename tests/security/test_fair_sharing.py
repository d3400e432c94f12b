"""One tenant cannot starve another (issue 23, item 5).

Two tenants share one real broker (real sockets, real SQLite datasets, a real
ledger) or one real API server on loopback. The victim's latency is measured
idle, then while the other tenant floods; the bound is a ratio to the idle
latency measured in the same test, never an absolute time. Each flood is
scaled down to seconds but stays above the limit that broke before: more slow
statements than the event loop's default executor had threads, more idle
connections than a source may hold, uploads a run could not make at all.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sqlite3
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import Broker, DatasetBinding, RunChannel, RunScope, make_broker
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store
from tests.integration.test_broker_sql import make_dataset

#: The victim's latency under a flood may be this many times its idle latency.
RATIO = 10.0
#: Calls measured for each figure.
SAMPLES = 15


# -- a real broker with two tenants ------------------------------------------------


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def call(
    channel: RunChannel, method: str, target: str, body: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    conn = _UnixConnection(channel.socket)
    try:
        headers = {TOKEN_HEADER: channel.token}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, target, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data.startswith(b"{") else {}
    finally:
        conn.close()


def sql(channel: RunChannel, statement: str) -> tuple[int, dict[str, Any]]:
    return call(
        channel, "POST", "/v1/sql", json.dumps({"dataset": "crm", "sql": statement}).encode()
    )


def timed(fn: Any, *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


@dataclass
class Tenant:
    name: str
    dataset: Path
    scope: RunScope
    channel: RunChannel


@dataclass
class TwoTenants:
    broker: Broker
    ledger: Ledger
    attacker: Tenant
    victim: Tenant

    def events(self, tenant: str, action: str) -> list[dict[str, Any]]:
        out = [json.loads(e) for e in self.ledger.entries(tenant)]
        return [e for e in out if e["action"] == action]


def _caps(access: str) -> dict[str, Any]:
    return {
        "datasets": {
            "crm": {"tables": {"customers": {"columns": ["id", "name"], "access": access}}}
        },
        "buckets": {"reports": "read-write"},
    }


def _tenant(
    broker: Broker, ledger: Ledger, tmp: Path, name: str, *, buckets: bool, timeout: float
) -> Tenant:
    ledger.create_log(
        name, EventDraft(Actor("operator", "test"), "tenant.create", f"tenant/{name}")
    )
    dataset = make_dataset(tmp / f"{name}.db")
    run = f"run-{name}"
    buckets_dir = None
    if buckets:
        buckets_dir = tmp / f"buckets-{name}"
        (buckets_dir / "reports").mkdir(parents=True)
    scope = RunScope(
        tenant=name,
        run_id=run,
        workload=f"spiffe://test.local/tenant/{name}/deployment/job/run/{run}",
        deployment="job",
        artifact="sha256:" + "ab" * 32,
        approvals=(),
        environment="production",
        policies=compile_policies(capability_policies(name, "job", _caps("read-write"))),
        ledger=ledger,
        datasets={"crm": DatasetBinding("crm", "sqlite", str(dataset))},
        buckets_dir=buckets_dir,
        lineage_key=b"k" * 32,
        statement_timeout=timeout,
    )
    return Tenant(name, dataset, scope, broker.open_run(scope, ttl=600))


@pytest.fixture
def two(tmp_path: Path) -> Iterator[TwoTenants]:
    store = open_store(str(tmp_path / "proctor.db"), create=True)
    signer = Signer.generate("test.local")
    ledger = Ledger(store, signer, "test.local")
    broker = make_broker(tmp_path / "ca", os.urandom(32)).start()
    try:
        attacker = _tenant(broker, ledger, tmp_path, "mallory", buckets=False, timeout=2.0)
        victim = _tenant(broker, ledger, tmp_path, "victim", buckets=True, timeout=2.0)
        yield TwoTenants(broker, ledger, attacker, victim)
    finally:
        broker.stop()
        ledger.close()
        store.close()


def _victim_call(two: TwoTenants) -> None:
    status, doc = sql(two.victim.channel, "SELECT id, name FROM customers WHERE id = 42")
    assert status == 200, doc
    assert doc["rows"] == [[42, "Barbara Liskov"]]


def _idle(two: TwoTenants) -> float:
    for _ in range(3):  # warm: pools, caches, the first connection
        _victim_call(two)
    return p50([timed(_victim_call, two) for _ in range(SAMPLES)])


# -- slow statements ------------------------------------------------------------------


def test_slow_statements_of_one_tenant_do_not_delay_another(two: TwoTenants) -> None:
    """Twelve statements that each wait 2 s (on a write lock the test holds; no CPU
    burnt) used to fill the six threads every brokered call of every tenant
    shared: the victim's 5 ms call took seconds."""
    idle = _idle(two)
    holder = sqlite3.connect(two.attacker.dataset, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    stop = threading.Event()

    def slow(i: int) -> None:
        while not stop.is_set():
            sql(two.attacker.channel, f"UPDATE customers SET name = 'x{i}' WHERE id = 1")

    flood = [threading.Thread(target=slow, args=(i,)) for i in range(12)]
    try:
        for t in flood:
            t.start()
        time.sleep(0.3)  # let the flood take its workers
        loaded = [timed(_victim_call, two) for _ in range(SAMPLES)]
    finally:
        stop.set()
        holder.execute("ROLLBACK")
        holder.close()
        for t in flood:
            t.join()
    print(
        f"idle p50 {idle * 1e3:.1f} ms; under flood p50 {p50(loaded) * 1e3:.1f} ms, "
        f"max {max(loaded) * 1e3:.1f} ms"
    )
    assert p50(loaded) < RATIO * idle, (idle, loaded)
