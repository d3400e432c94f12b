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

import contextlib
import hashlib
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

from proctor.api import Limits
from proctor.broker import Broker, DatasetBinding, RunChannel, RunScope, make_broker
from proctor.governance import Runs
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store
from tests.integration.test_api_support import ApiEnv, build_env
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


# -- stalled uploads --------------------------------------------------------------------


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


#: What the senders send, made once: the test's own buffers are not the server's growth.
_PIECE = bytes(range(256)) * 4096


def _stall_upload(channel: RunChannel, key: str, sent: int, opened: list[socket.socket]) -> None:
    """Announce a 64 MiB object, send ``sent`` bytes of it, then stall (the socket is
    left open in ``opened``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(channel.socket))
    opened.append(sock)
    head = (
        f"PUT /v1/files/reports/{key} HTTP/1.1\r\nHost: broker\r\n"
        f"{TOKEN_HEADER}: {channel.token}\r\nContent-Length: {64 << 20}\r\n\r\n"
    )
    with contextlib.suppress(OSError):  # refused from the head: the broker hangs up
        sock.sendall(head.encode())
        for _ in range(sent // len(_PIECE)):
            sock.sendall(_PIECE)


def test_stalled_uploads_are_decided_from_the_head_and_never_held_in_memory(
    two: TwoTenants,
) -> None:
    """Eight stalled 64 MiB uploads grew the server by the bytes sent: the body was
    read whole before the call was decided. A run with no bucket is refused from
    the head (its body is not read); a granted upload streams to disk."""
    idle = _idle(two)
    sent = 8 << 20
    opened: list[socket.socket] = []
    before = _rss()
    senders = [
        threading.Thread(target=_stall_upload, args=(two.attacker.channel, f"k{i}", sent, opened))
        for i in range(8)
    ] + [
        # The victim's own run has the bucket: its stalled uploads go to disk.
        threading.Thread(target=_stall_upload, args=(two.victim.channel, f"v{i}", sent, opened))
        for i in range(4)
    ]
    try:
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        grown = _rss() - before
        loaded = [timed(_victim_call, two) for _ in range(SAMPLES)]
    finally:
        for sock in opened:
            sock.close()
    total = sent * len(senders)
    print(
        f"sent {total >> 20} MiB, RSS grew {grown >> 20} MiB; victim idle "
        f"{idle * 1e3:.1f} ms, under stalled uploads {p50(loaded) * 1e3:.1f} ms"
    )
    assert grown < total / 5, (grown, total)
    assert p50(loaded) < RATIO * idle, (idle, loaded)
    refused = two.events("mallory", "file.write")
    assert len(refused) == 8 and all(e["decision"] == "deny" for e in refused)
    assert all(e["reason"] == "refused: this run has no buckets" for e in refused), refused[0]


def test_a_granted_upload_streams_to_disk_whole_and_a_cut_one_leaves_nothing(
    two: TwoTenants, tmp_path: Path
) -> None:
    data = _PIECE * 3 + b"tail"
    status, doc = call(two.victim.channel, "PUT", "/v1/files/reports/big.bin", data)
    assert status == 200, doc
    assert doc == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    bucket = tmp_path / "buckets-victim" / "reports"
    assert (bucket / "big.bin").read_bytes() == data
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(two.victim.channel.socket))
    head = (
        f"PUT /v1/files/reports/cut.bin HTTP/1.1\r\nHost: broker\r\n"
        f"{TOKEN_HEADER}: {two.victim.channel.token}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data[:-10])
    sock.shutdown(socket.SHUT_WR)  # the body ends early
    answer = sock.makefile("rb").read()
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert sorted(p.name for p in bucket.iterdir()) == ["big.bin"]
    last = two.events("victim", "file.write")[-1]
    assert last["decision"] == "deny" and "ended early" in last["reason"]


# -- idle connections ---------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


#: Opens N connections to a Unix socket and holds them until its stdin closes.
_HOLDER = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
print("held", flush=True)
sys.stdin.read()
"""


def test_idle_connections_of_one_run_are_bounded_refused_and_counted(two: TwoTenants) -> None:
    """1,120 idle connections from one guest took the process to its descriptor
    limit and other tenants' calls timed out, with no event. Scaled: the broker's
    process gets 300 descriptors of headroom and the guest (another process)
    opens 400 connections."""
    import resource
    import subprocess
    import sys

    idle = _idle(two)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + 300, hard))
    started = time.monotonic()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(two.attacker.channel.socket), "400"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        # The guest's process has descriptors of its own.
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        time.sleep(0.3)  # the broker accepts them all (and refuses the excess)
        loaded = [timed(_victim_call, two) for _ in range(SAMPLES)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # The holder keeps its connections until every one over the bound is refused: one
    # the broker could not accept yet (out of descriptors, asyncio retries a second
    # later) would otherwise be accepted under the bound once the held ones closed,
    # and not counted (CI failed so on a loaded machine: 280 of 336).
    expected = 400 - two.broker.max_connections_per_run
    try:
        deadline = time.monotonic() + 10
        while True:  # one summary per second of refusals
            refused = two.events("mallory", "broker.connections.refused")
            total = sum(e["details"]["refused"] for e in refused)
            if total >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        holder.communicate(timeout=30)
    print(
        f"victim idle {idle * 1e3:.1f} ms, beside 400 idle connections {p50(loaded) * 1e3:.1f} ms"
    )
    assert p50(loaded) < RATIO * idle, (idle, loaded)
    assert total == expected, refused
    # A summary per second of refusals, not an event per connection.
    assert len(refused) <= time.monotonic() - started + 2, refused
    assert all(e["decision"] == "deny" for e in refused)


def test_a_connection_that_sends_nothing_is_closed_and_counted(
    two: TwoTenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a silent connection was held 30 s and then answered, one recorded
    refusal each; now it is closed at the first-byte timeout and counted."""
    from proctor.broker import _server

    monkeypatch.setattr(_server, "FIRST_BYTE_TIMEOUT", 0.2)
    socks = []
    for _ in range(5):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(str(two.victim.channel.socket))
        socks.append(sock)
    try:
        assert [s.recv(100) for s in socks] == [b""] * 5  # closed, nothing answered
    finally:
        for sock in socks:
            sock.close()
    two.broker.close_run(two.victim.scope.run_id)
    refused = two.events("victim", "broker.connections.refused")
    assert [e["details"]["idle"] for e in refused] == [5]
    assert two.events("victim", "broker.request") == []


# -- the API --------------------------------------------------------------------------


@dataclass
class Api:
    env: ApiEnv
    run_id: str  # a run of globex, 'running'


def _api(tmp: Path, limits: Limits) -> Api:
    env = build_env(tmp, limits=limits)
    run_id = "run-follow"
    with env.rt.store.write() as conn:
        Runs.insert(conn, (
            run_id, "globex", "job", 1, "sha256:" + "ab" * 32, "production",
            "spiffe://x/tenant/globex/deployment/job/run/run-follow", "[]", "bubblewrap", None,
            "running", None, None, 1, "{}", None, "2026-01-01T00:00:00.000000Z", None,
        ), "test")  # fmt: skip
    return Api(env, run_id)


@contextlib.contextmanager
def _api_env(tmp: Path, limits: Limits) -> Iterator[Api]:
    api = _api(tmp, limits)
    try:
        yield api
    finally:
        api.env.server.stop()
        api.env.rt.close()


def _victim_get(client: Any) -> None:
    resp = client.get("/tenants/acme/runs")
    assert resp.status_code == 200, resp.text


def _api_idle(client: Any) -> float:
    for _ in range(3):
        _victim_get(client)
    return p50([timed(_victim_get, client) for _ in range(SAMPLES)])


def _raw_get(
    host: str, port: int, path: str, token: str, source: str = "127.0.0.1"
) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    )
    return sock


@pytest.mark.parametrize("bound", [None, 64], ids=["default-bound", "bound-raised"])
def test_log_follows_of_one_auditor_hold_no_worker_threads(
    tmp_path: Path, bound: int | None
) -> None:
    """Forty follows of one auditor held the API's forty shared worker threads and
    another tenant's GET timed out. Now a principal holds at most a few follows
    (429 beyond), and a follow waits on the event loop, not on a worker thread:
    with the bound raised past them, 45 follows still leave the victim near idle."""
    limits = Limits() if bound is None else Limits(follows_per_principal=bound)
    with _api_env(tmp_path, limits) as api:
        env = api.env
        with env.http("acme", "aud") as victim:
            idle = _api_idle(victim)
            path = f"/tenants/globex/runs/{api.run_id}/logs?follow=true"
            follows = [
                _raw_get(env.server.host, env.server.port, path, env.token("globex", "aud"))
                for _ in range(45)
            ]
            try:
                answers = [sock.recv(12) for sock in follows]
                loaded = [timed(_victim_get, victim) for _ in range(SAMPLES)]
            finally:
                for sock in follows:
                    sock.close()
        print(f"API victim idle {idle * 1e3:.1f} ms, beside 45 follows {p50(loaded) * 1e3:.1f} ms")
        assert p50(loaded) < RATIO * idle, (idle, loaded)
        held = answers.count(b"HTTP/1.1 200")
        assert held == (45 if bound else Limits().follows_per_principal), answers
        assert answers.count(b"HTTP/1.1 429") == 45 - held


def test_follows_per_principal_are_bounded_with_a_clear_429(tmp_path: Path) -> None:
    with _api_env(tmp_path, Limits(follows_per_principal=2)) as api:
        env = api.env
        path = f"/tenants/globex/runs/{api.run_id}/logs?follow=true"
        token = env.token("globex", "aud")
        held = [_raw_get(env.server.host, env.server.port, path, token) for _ in range(2)]
        try:
            for sock in held:
                assert sock.recv(12) == b"HTTP/1.1 200"
            with env.http("globex", "aud") as client:
                resp = client.get(path)
                assert resp.status_code == 429, resp.text
                assert resp.json()["error"]["code"] == "rate_limited"
                assert "follows 2 logs" in resp.json()["error"]["message"]
                assert resp.headers["Retry-After"] == "1"
                # Another principal of the tenant is not held up by this one's follows.
                with env.http("globex", "root") as other:
                    assert other.get(f"/tenants/globex/runs/{api.run_id}").status_code == 200
        finally:
            for sock in held:
                sock.close()
        # Given back when the client goes: a follow can be taken again.
        deadline = time.monotonic() + 10
        while True:
            with env.http("globex", "aud") as client, client.stream("GET", path) as resp:
                if resp.status_code == 200 or time.monotonic() > deadline:
                    break
            time.sleep(0.2)
        assert resp.status_code == 200


def test_api_requests_per_principal_are_rate_limited_and_counted(tmp_path: Path) -> None:
    """2,000 reads added 2,000 events with no limit. Now a principal over its budget
    is answered 429 before its request is decided, and the refusals are counted in
    one api.rate_limited event per second, not one event each."""
    with _api_env(tmp_path, Limits(requests_per_second=5, request_burst=40)) as api:
        env = api.env
        with env.http("acme", "aud") as victim:
            idle = _api_idle(victim)
            before = len(env.events("globex"))
            with env.http("globex", "aud") as flood:
                codes = [flood.get("/tenants/globex/runs").status_code for _ in range(300)]
            loaded = [timed(_victim_get, victim) for _ in range(SAMPLES)]
        refused = codes.count(429)
        assert set(codes) == {200, 429} and refused >= 200, codes
        assert p50(loaded) < RATIO * idle, (idle, loaded)
        env.server.stop()  # what is still only counted is recorded at shutdown
        added = env.events("globex")[before:]
        requests = [e for e in added if e["action"] == "api.request"]
        summaries = [e for e in added if e["action"] == "api.rate_limited"]
        assert len(requests) == codes.count(200)
        assert sum(e["details"]["refused"] for e in summaries) == refused
        assert len(summaries) <= 1 + len(codes) // 20  # one per second at most, not one each
        assert all(e["actor"]["id"].endswith("aud") for e in summaries), summaries


_TCP_HOLDER = """
import socket, sys
held = []
for _ in range(int(sys.argv[3])):
    held.append(socket.create_connection((sys.argv[1], int(sys.argv[2])),
                                         source_address=("127.0.0.2", 0)))
print("held", flush=True)
sys.stdin.read()
"""


def test_idle_api_connections_of_one_address_are_bounded_refused_and_counted(
    tmp_path: Path,
) -> None:
    """1,100 idle unauthenticated connections took the API to its descriptor limit
    and other tenants' requests timed out, with no event. Scaled: the server's
    process gets 400 descriptors of headroom; one address (127.0.0.2) opens 800."""
    import resource
    import subprocess
    import sys

    with _api_env(tmp_path, Limits()) as api:
        env = api.env
        with env.http("acme", "aud") as victim:
            idle = _api_idle(victim)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + 400, hard))
            started = time.monotonic()
            holder = subprocess.Popen(
                [sys.executable, "-c", _TCP_HOLDER, env.server.host, str(env.server.port), "800"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
            )
            try:
                assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
                time.sleep(0.5)
                loaded = [timed(_victim_get, victim) for _ in range(SAMPLES)]
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                holder.communicate(timeout=30)
        print(
            f"API victim idle {idle * 1e3:.1f} ms, beside 800 idle connections "
            f"{p50(loaded) * 1e3:.1f} ms"
        )
        assert p50(loaded) < RATIO * idle, (idle, loaded)
        env.server.stop()
        refused = [
            json.loads(e)
            for e in env.rt.ledger.entries("system")
            if json.loads(e)["action"] == "api.connections.refused"
        ]
        assert refused, "the refused connections are not on the record"
        assert sum(e["details"]["over_source"] for e in refused) >= 800 - 64
        # A summary per second of refusals, not an event per connection.
        assert len(refused) <= time.monotonic() - started + 2, refused


# -- the fair pool itself --------------------------------------------------------------


def test_the_fair_pool_bounds_runs_and_tenants_and_serves_tenants_in_turn() -> None:
    import asyncio

    from proctor.broker._fair import FairPool

    pool = FairPool(workers=6, per_tenant=4, per_run=2)
    gate = threading.Event()
    seen: list[tuple[int, dict[str, int]]] = []
    order: list[str] = []

    def job(name: str) -> str:
        seen.append(pool.busy())
        gate.wait(10)
        order.append(name)
        return name

    async def scenario() -> None:
        flood = [asyncio.create_task(pool.run("a", f"a{i % 3}", job, f"a{i}")) for i in range(20)]
        await asyncio.sleep(0.2)
        assert pool.busy() == (4, {"a": 4})  # the tenant's share, not the pool
        # A cancelled waiter gives up its place and takes nothing with it.
        flood[-1].cancel()
        other = asyncio.create_task(pool.run("b", "b0", job, "b0"))
        await asyncio.sleep(0.2)
        assert pool.busy() == (5, {"a": 4, "b": 1})  # b had a worker at once
        gate.set()
        done = await asyncio.gather(*flood[:-1], other)
        assert sorted(done) == sorted([f"a{i}" for i in range(19)] + ["b0"])
        assert pool.busy() == (0, {})

    asyncio.run(scenario())
    assert all(busy <= 6 and counts.get("a", 0) <= 4 for busy, counts in seen)


@pytest.mark.postgres
def test_slow_postgresql_statements_of_one_tenant_do_not_delay_another(
    two: TwoTenants, pg_server: Any, tmp_path: Path
) -> None:
    """The same on PostgreSQL: twelve statements of one tenant's run that each wait
    on a lock the test holds (up to the 2 s limit) leave the victim near idle."""
    import psycopg

    from proctor.broker._pg_sql import (
        close_pg_pools,
        grant_deployment_role,
        revoke_deployment_role,
    )

    name = f"crm_fair_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = pg_server.create_database(name)
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE customers (id BIGINT PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO customers VALUES (1, 'a'), (2, 'b')")
    tables = _caps("read")["datasets"]["crm"]["tables"]
    grant_deployment_role(dsn, "mallory", "job", "crm", tables)
    attacker = two.attacker.scope
    scope = RunScope(
        tenant="mallory",
        run_id="run-mallory-pg",
        workload="spiffe://test.local/tenant/mallory/deployment/job/run/run-mallory-pg",
        deployment="job",
        artifact=attacker.artifact,
        approvals=(),
        environment="production",
        policies=attacker.policies,
        ledger=two.ledger,
        datasets={"crm": DatasetBinding("crm", "postgresql", dsn)},
        lineage_key=b"k" * 32,
        statement_timeout=2.0,
    )
    channel = two.broker.open_run(scope, ttl=600)
    try:
        assert sql(channel, "SELECT id, name FROM customers WHERE id = 1")[0] == 200
        idle = _idle(two)
        stop = threading.Event()

        def slow() -> None:
            while not stop.is_set():
                sql(channel, "SELECT id, name FROM customers WHERE id = 2")

        flood = [threading.Thread(target=slow) for _ in range(12)]
        with psycopg.connect(dsn) as holder:
            holder.execute("LOCK TABLE customers IN ACCESS EXCLUSIVE MODE")
            try:
                for t in flood:
                    t.start()
                time.sleep(0.3)
                loaded = [timed(_victim_call, two) for _ in range(SAMPLES)]
            finally:
                stop.set()
                holder.rollback()
                for t in flood:
                    t.join()
        print(
            f"PostgreSQL flood: victim idle {idle * 1e3:.1f} ms, "
            f"under flood {p50(loaded) * 1e3:.1f} ms"
        )
        assert p50(loaded) < RATIO * idle, (idle, loaded)
    finally:
        two.broker.close_run(scope.run_id)
        close_pg_pools(scope)
        revoke_deployment_role(dsn, "mallory", "job", "crm")
        pg_server.drop_database(name)


def test_an_api_connection_that_sends_nothing_is_closed_and_counted(tmp_path: Path) -> None:
    """Before, a silent connection was held for as long as its client liked."""
    with _api_env(tmp_path, Limits(first_byte_timeout=0.2)) as api:
        env = api.env
        socks = [
            socket.create_connection(
                (env.server.host, env.server.port), timeout=5, source_address=("127.0.0.3", 0)
            )
            for _ in range(3)
        ]
        try:
            assert [s.recv(100) for s in socks] == [b""] * 3  # closed, nothing answered
        finally:
            for sock in socks:
                sock.close()
        env.server.stop()
        refused = [json.loads(e) for e in env.rt.ledger.entries("system")]
        refused = [e for e in refused if e["action"] == "api.connections.refused"]
        assert sum(e["details"]["idle"] for e in refused) == 3, refused


# -- name lookups ---------------------------------------------------------------------


def test_slow_name_lookups_of_one_tenant_do_not_hold_another_tenants(
    two: TwoTenants, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A permitted host that resolves slowly holds its tenant's share of the fair pool,
    not the event loop's shared executor. The lookup itself is the system's
    ``getaddrinfo`` made to block for one name: no real resolver is slow on loopback."""
    import asyncio

    from proctor.broker._admission import resolve_as, system_resolver

    gate = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.example":
            gate.wait(30)
        return real("127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def scenario() -> list[Any]:
        slow = two.attacker.scope
        # More lookups than the loop's default executor has threads (min(32, cpus + 4)).
        flood = [
            asyncio.create_task(resolve_as(slow, system_resolver, "slow.example", 443))
            for _ in range((os.cpu_count() or 1) + 8)
        ]
        await asyncio.sleep(0.2)
        try:
            # Waits on the gate forever if the flood holds every worker it could use.
            return await asyncio.wait_for(
                resolve_as(two.victim.scope, system_resolver, "fast.example", 443), 20
            )
        finally:
            gate.set()
            await asyncio.gather(*flood)

    assert [str(a) for a in asyncio.run(scenario())] == ["127.0.0.1"]
