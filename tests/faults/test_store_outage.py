"""PostgreSQL goes away under a running runtime (immediate shutdown), then comes back.

A runtime whose store is PostgreSQL (``init_home(store=dsn)``) on a server of
this test's own, so stopping it disturbs no other test, runs the workload of
test_disk_full.py: ledger appends, SQL through the broker, control-plane
changes. Mid-workload the server is stopped with ``pg_ctl -m immediate`` (every
backend killed at once, as in a crash), kept down, and started again on the
same port. What must hold:

- while it is down every call fails closed, within a bounded time (no call
  hangs on a dead server): refused, never answered without an event;
- after it is back the same runtime object answers again by itself: the
  store's connections (the ledger writer's and each thread's readers) are
  replaced without a restart, and the first read of a thread that held a
  connection from before the outage does not fail;
- every acknowledged event is in the log, nothing refused is, ``verify``
  passes, and a new process (the CLI) reads the same log.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.errors import StoreError
from proctor.runtime import Runtime, init_home
from proctor.testing import PostgresServer, PostgresUnavailable
from tests.faults.test_disk_full import (
    CYCLES,
    SOAK,
    TENANT,
    Call,
    Workload,
    check_from_disk,
    check_log_matches,
    unexpected,
)
from tests.integration.test_broker_sql import make_dataset
from tests.sandbox_conftest_helpers import unavailable

# How long a refused call may take while the server is down: a refusal that
# takes longer than this is a hang as far as a caller is concerned.
REFUSAL_BOUND = 5.0


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    server = PostgresServer(durable=True, max_connections=50)
    try:
        server.start()
    except PostgresUnavailable as exc:
        unavailable("PostgreSQL", exc.message)
    try:
        yield server
    finally:
        server.stop()


def _pg_ctl(server: PostgresServer, *args: str) -> None:
    cmd = server._cmd("pg_ctl", "-D", str(server.data_dir), *args)
    proc = subprocess.run(cmd, capture_output=True, timeout=90, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")


def stop_immediately(server: PostgresServer) -> None:
    _pg_ctl(server, "-m", "immediate", "-w", "stop")


def start_again(server: PostgresServer) -> None:
    log = server.data_dir.parent / "server.log"
    _pg_ctl(server, "-l", str(log), "-o", f"-p {server.port}", "-w", "-t", "60", "start")


def test_postgres_outage_fails_closed_then_recovers_by_itself(
    own_pg: PostgresServer, tmp_path: Path
) -> None:
    dsn = own_pg.create_database("proctor_outage")
    dataset = make_dataset(tmp_path / "crm.db")
    home = tmp_path / "home"
    init_home(home, store=dsn)
    rt = Runtime.open(home)
    try:
        rt.tenants.create(TENANT, rt.operator)
        # This (main) thread now holds a reader connection from before the outage.
        assert rt.ledger.head(TENANT).size == 1
        outage(rt, own_pg, home, dataset)
    finally:
        rt.close()


def outage(rt: Runtime, server: PostgresServer, home: Path, dataset: Path) -> None:
    kinds = ("append", "sql", "control")
    down_for = 2.0 if SOAK else 1.0
    # stop asked, stopped, start asked, started, answering again
    windows: list[tuple[float, float, float, float, float]] = []
    with Workload(rt, dataset, pace=0.001) as load:
        load.wait_for("calls before the outage", lambda cs: len(cs) >= 200, 30)
        for _cycle in range(CYCLES):
            stopping = time.monotonic()
            stop_immediately(server)
            down_at = time.monotonic()

            def refused_each(cs: list[Call], since: float = down_at) -> bool:
                late = [c for c in cs if c.start > since]
                return all(sum(c.kind == k for c in late) >= 3 for k in kinds)

            load.wait_for("refusals of every kind while PostgreSQL is down", refused_each, 30)
            time.sleep(down_for)

            starting = time.monotonic()
            start_again(server)
            up_at = time.monotonic()

            def answered_each(cs: list[Call], since: float = up_at) -> bool:
                late = [c for c in cs if c.start > since and c.ok]
                return all(sum(c.kind == k for c in late) >= 3 for k in kinds)

            calls = load.wait_for("the same runtime to answer again", answered_each, 30)
            back = min(c.end for c in calls if c.start > up_at and c.ok)
            windows.append((stopping, down_at, starting, up_at, back))
            # A thread that last read before the outage reads again, first time.
            assert rt.ledger.head(TENANT).size > 1
            time.sleep(1.0 if SOAK else 0.3)
    calls = load.calls

    # Failing closed: while the server was down nothing was answered, every
    # call was refused, and quickly. Control changes read their current value
    # before appending: that read's StoreError refuses them just as well.
    down = [c for w in windows for c in calls if w[1] < c.start and c.end < w[2]]
    assert down and not any(c.ok for c in down), [c for c in down if c.ok][:5]
    bad = [
        c
        for c in unexpected(calls)
        if not (c.kind == "control" and c.error.startswith(StoreError.__name__ + ":"))
    ]
    assert not bad, bad[:5]
    took = sorted(c.took for c in down)
    assert took[-1] < REFUSAL_BOUND, f"a refusal took {took[-1]:.2f} s while PostgreSQL was down"
    # Once it answered again it kept answering: no connection left dead.
    for _, _, _, _, back in windows:
        nxt = min([w[0] for w in windows if w[0] > back], default=float("inf"))
        after = [c for c in calls if back < c.start and c.end < nxt]
        assert after and all(c.ok for c in after), [c for c in after if not c.ok][:5]

    # A call in flight when the server was killed may have committed without
    # hearing so: refused, yet its event may be there. Only those.
    in_doubt = [c for w in windows for c in calls if not c.ok and c.start < w[1] and c.end > w[0]]
    rows = check_log_matches(rt, calls, in_doubt)
    for log in ("system", TENANT):
        assert rt.ledger.verify(log).size == rt.ledger.head(log).size
    check_from_disk(home, rows)
    stop_ms = max(w[1] - w[0] for w in windows) * 1000
    start_ms = max(w[3] - w[2] for w in windows) * 1000
    recovered_ms = max(w[4] - w[3] for w in windows) * 1000
    print(
        f"\npostgres outage x{CYCLES}: {len(calls)} calls, {sum(c.ok for c in calls)} answered, "
        f"{sum(not c.ok for c in calls)} refused ({len(down)} while down, {len(in_doubt)} in "
        f"flight at the kill); stop took {stop_ms:.0f} ms, start {start_ms:.0f} ms; "
        f"refusal p50 {took[len(took) // 2] * 1000:.1f} ms, p99 "
        f"{took[int(len(took) * 0.99)] * 1000:.1f} ms, max {took[-1] * 1000:.1f} ms; first "
        f"answer at most {recovered_ms:.0f} ms after the server was up; log {len(rows)} events"
    )
